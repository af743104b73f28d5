"""Layer 2: the app over HTTP with gradio_client, as another program or a second user sees it.

The demo is launched on 127.0.0.1 on a free port with the queue; runs stream through
`client.submit`, two clients at once get their own results, and a trace round-trips
through /export and /replay.
"""
import os
from pathlib import Path

for _key, _value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(_key, _value)
os.environ.setdefault("GRADIO_TEMP_DIR", str(Path(__file__).resolve().parent.parent / ".gradio"))

import html  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402

from specla import explorer, runner  # noqa: E402
from specla.api_client import arrivals  # noqa: E402
from specla.trace import MAX_TRACE_BYTES, load_trace  # noqa: E402
from tests.helpers import default_runtime, served  # noqa: E402

STATUS, TEXT, SUMMARY = 0, 1, 8     # API outputs: the views without the two gr.State values


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def app():
    rt = default_runtime()
    with served(explorer.build_demo(rt, model_limit=1)) as url:
        yield rt, url


def client(url: str, tmp_path) -> Client:
    return Client(url, verbose=False, analytics_enabled=False, download_files=str(tmp_path))


def settings(rt, **overrides) -> list:
    return explorer.control_values(rt, **{"drafter": runner.ORACLE, "max_new_tokens": 24, **overrides})


def test_run_streams_over_http(app, tmp_path):
    rt, url = app
    job = client(url, tmp_path).submit("def add(a, b):\n", *settings(rt), api_name="/run")
    updates = list(arrivals(job))               # every streamed output, as it arrives
    final = job.outputs()[-1]
    assert len(updates) >= 2
    assert final[STATUS].startswith("**Done**")
    produced = int(re.match(r"\*\*(\d+) tokens in", final[SUMMARY]).group(1))
    assert "def add(a, b):" in final[TEXT] and final[TEXT].count('class="tok tok-') == produced
    assert 0 < produced <= 24 and "measured in this run" in final[SUMMARY]
    plots = [o for o in final if isinstance(o, dict) and o.get("type") == "plotly"]
    assert len(plots) == 4


def test_two_clients_get_their_own_runs(app, tmp_path):
    rt, url = app
    prompts = ("class Alpha:\n", "import beta\n")
    jobs = [client(url, tmp_path).submit(p, *settings(rt, seed=i), api_name="/run") for i, p in enumerate(prompts)]
    finals = [job.result() for job in jobs]     # both queued on the model's one slot
    for prompt, other, final in zip(prompts, prompts[::-1], finals):
        assert final[STATUS].startswith("**Done**")
        assert html.escape(prompt.strip()) in final[TEXT] and html.escape(other.strip()) not in final[TEXT]


def test_bad_input_over_http_is_a_message(app, tmp_path):
    rt, url = app
    c = client(url, tmp_path)
    final = c.predict("", *settings(rt), api_name="/run")
    assert final[STATUS].startswith("**Error:**") and "empty" in final[STATUS]
    final = c.predict("def f():", *settings(rt, tree="beam", mode="chain"), api_name="/run")
    assert "chain verification needs a chain" in final[STATUS]


def test_export_and_replay_round_trip(app, tmp_path):
    rt, url = app
    c = client(url, tmp_path)
    run = c.predict("def f():\n", *settings(rt, max_new_tokens=8), api_name="/run")   # the session's trace
    path, status = c.predict(api_name="/export")
    assert "Trace ready" in status
    assert isinstance(path, str) and Path(path).name.startswith("trace-") and load_trace(path)
    replay = client(url, tmp_path).predict(handle_file(path), api_name="/replay")   # a fresh session
    assert "Replaying" in replay[STATUS] and replay[SUMMARY] == run[SUMMARY]
    assert replay[TEXT].count('class="tok tok-') == run[TEXT].count('class="tok tok-') > 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something else"}')
    replay = c.predict(handle_file(str(bad)), api_name="/replay")
    assert replay[STATUS].startswith("**Error:**") and "not a SpecLA trace" in replay[STATUS]


def test_every_endpoint_names_its_parameters(app, tmp_path):
    rt, url = app
    api = client(url, tmp_path).view_api(return_format="dict", print_info=False)["named_endpoints"]
    names = {name: [p["parameter_name"] for p in ep["parameters"]] for name, ep in api.items()}
    assert names["/run"] == names["/step"] == ["prompt", *explorer.CONTROLS]
    assert names["/scrub"] == ["step"] and names["/export"] == [] and names["/replay"] == ["file"]
    optional = {p["parameter_name"] for p in api["/run"]["parameters"] if p["parameter_has_default"]}
    assert set(explorer.CONTROLS) <= optional and "paths" in optional
    assert [r["label"] for r in api["/export"]["returns"]] == ["Download trace", "run status"]


def test_named_parameters_with_defaults_run(app, tmp_path):
    rt, url = app
    final = client(url, tmp_path).predict("def f():\n", drafter=runner.ORACLE, max_new_tokens=5, top_k=2,
                                          api_name="/run")
    assert final[STATUS].startswith("**Done**: 5 tokens")


@pytest.mark.parametrize("overrides,expect", [
    ({"top_k": "abc"}, "top k must be a number, got 'abc'"),
    ({"top_k": None}, "top k must be a number, got None"),
    ({"max_new_tokens": 3.7}, "max new tokens must be a whole number, got 3.7"),
    ({"deferred": "no"}, "deferred commit must be true or false"),
    ({"tree": ["beam"]}, "tree shape must be one of"),
    ({"drafter": {"kind": "block"}}, "unknown drafter"),
    ({"temperature": -1}, "temperature must be between 0.0 and 10.0, got -1.0"),
    ({"model": "gpt-5"}, "unknown model 'gpt-5'; this page has: loaded, gdn-1.3b-random"),
    pytest.param({"model": runner.RANDOM_1P3B}, "The GDN-1.3B shape cannot run here: it needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA says")),
], ids=["text", "none", "fraction", "bool-text", "list", "dict", "range", "unknown-model", "1p3b-without-cuda"])
def test_wrong_types_over_http_get_a_message_and_no_traceback(app, tmp_path, capfd, caplog, overrides, expect):
    rt, url = app
    final = client(url, tmp_path).predict("def f():", *settings(rt, **overrides), api_name="/run")
    assert final[STATUS] == f"**Error:** {final[STATUS][len('**Error:** '):]}" and expect in final[STATUS]
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out and "Traceback" not in caplog.text


def test_a_nan_seed_over_raw_http_gets_a_message(app, capfd):
    """JSON clients can send NaN (Python's json does); the message must say what is wrong with it."""
    rt, url = app
    values = settings(rt, max_new_tokens=4)
    values[explorer.CONTROLS.index("seed")] = float("nan")
    body = json.dumps({"data": ["def f():", *values]})
    assert "NaN" in body
    event = httpx.post(url + "gradio_api/call/run", content=body,
                       headers={"content-type": "application/json"}, timeout=30).json()["event_id"]
    stream = httpx.get(url + f"gradio_api/call/run/{event}", timeout=60).text
    assert "event: complete" in stream and "seed must be a finite number, got nan" in stream
    assert "Traceback" not in capfd.readouterr().err


def test_an_oversized_upload_is_refused_before_it_is_stored(app, tmp_path):
    rt, url = app
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_TRACE_BYTES + 1)                        # sparse: nothing written
    with open(big, "rb") as f:
        reply = httpx.post(url + "gradio_api/upload", files={"files": ("big.json", f, "application/json")},
                           timeout=60)
    assert reply.status_code == 413 and str(MAX_TRACE_BYTES) in reply.text
    assert explorer.LAUNCH_KWARGS["max_file_size"] == MAX_TRACE_BYTES      # the browser refuses it unsent


def raw_call(url: str, endpoint: str, data: list) -> str:
    """POST a request as any HTTP client could and return the event stream it answers with."""
    event = httpx.post(url + f"gradio_api/call/{endpoint}", json={"data": data}, timeout=30).json()["event_id"]
    return httpx.get(url + f"gradio_api/call/{endpoint}/{event}", timeout=60).text


@pytest.mark.parametrize("endpoint,data,expect", [
    ("replay", ["not a file"], "this parameter takes a file"),
    ("replay", [{"path": "/etc/hostname"}], "this parameter takes a file"),
    ("run", [], "didn't receive enough input values (needed: 17, got: 0)"),
    ("scrub", ["abc"], "step must be a number, got 'abc'"),
    ("step", ["def f():", runner.ORACLE, 0.8, "chain", "", "x", 8, 6, 8, 0, "auto", True, 0, 1, 4, 0, "loaded"],
     "top k must be a number, got 'x'"),
], ids=["replay-text", "replay-path", "run-missing", "scrub-text", "step-text"])
def test_malformed_raw_requests_get_a_message_and_no_traceback(app, capfd, endpoint, data, expect):
    rt, url = app
    stream = raw_call(url, endpoint, data)
    assert expect in stream, stream[-400:]
    assert '"error": null' not in stream
    assert "Traceback" not in capfd.readouterr().err
