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
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402

from specla import explorer, runner  # noqa: E402
from tests.helpers import default_runtime, free_port  # noqa: E402

STATUS, TEXT, SUMMARY = 0, 1, 8     # API outputs: the views without the two gr.State values


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def app():
    rt = default_runtime()
    demo = explorer.build_demo(rt, model_limit=1)
    demo.queue(default_concurrency_limit=4)
    _, url, _ = demo.launch(prevent_thread_lock=True, ssr_mode=False, server_name="127.0.0.1",
                            server_port=free_port(), quiet=True, **explorer.LAUNCH_KWARGS)
    yield rt, url
    demo.close()


def client(url: str, tmp_path) -> Client:
    return Client(url, verbose=False, analytics_enabled=False, download_files=str(tmp_path))


def settings(rt, **overrides) -> list:
    return explorer.control_values(rt, **{"drafter": runner.ORACLE, "max_new_tokens": 24, **overrides})


def test_run_streams_over_http(app, tmp_path):
    rt, url = app
    job = client(url, tmp_path).submit("def add(a, b):\n", *settings(rt), api_name="/run")
    updates = list(job)                         # every streamed output, as it arrives
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
    download, status = c.predict(api_name="/export")
    assert "Trace ready" in status
    path = download if isinstance(download, str) else download.get("value") or download.get("path")
    assert Path(path).name.startswith("trace-")
    replay = client(url, tmp_path).predict(handle_file(path), api_name="/replay")   # a fresh session
    assert "Replaying" in replay[STATUS] and replay[SUMMARY] == run[SUMMARY]
    assert replay[TEXT].count('class="tok tok-') == run[TEXT].count('class="tok tok-') > 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something else"}')
    replay = c.predict(handle_file(str(bad)), api_name="/replay")
    assert replay[STATUS].startswith("**Error:**") and "not a SpecLA trace" in replay[STATUS]
