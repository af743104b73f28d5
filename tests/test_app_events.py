"""Layer 1: the explorer's event functions called directly, as the page would call them.

A tiny random-weight target with the oracle drafter (and a random LiLiCorr drafter, so the
lattice view gets real data), unless a trained model sits in assets/target.
"""
import os
from pathlib import Path

for _key, _value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(_key, _value)
os.environ.setdefault("GRADIO_TEMP_DIR", str(Path(__file__).resolve().parent.parent / ".gradio"))

import json  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from specla import figures as F  # noqa: E402
from specla import runner  # noqa: E402
from specla.decode import DecodeSettings, ar_generate  # noqa: E402
from specla.explorer import Explorer, control_values  # noqa: E402
from specla.trace import MAX_TRACE_BYTES, lattice_with_prefixes, load_trace, validate_trace  # noqa: E402

ERROR, DONE = "**Error:**", "**Done**"
# gr.Warning outside a page falls back to warnings.warn: expected here
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:gradio.helpers")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def make_runtime() -> runner.Runtime:
    if (runner.ASSETS / "target").exists():
        return runner.load_runtime(device="cpu")
    return runner.tiny_random_runtime(random_drafters=("lilicorr",))


@pytest.fixture(scope="module")
def rt():
    return make_runtime()


@pytest.fixture(scope="module")
def ex(rt):
    return Explorer(rt)


def drain(gen):
    """All yields of an event generator, with gr.Warning's console fallback silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return list(gen)


def run(ex, prompt="def add(a, b):\n\treturn", **settings):
    settings.setdefault("drafter", runner.ORACLE)
    settings.setdefault("max_new_tokens", 24)
    return drain(ex.on_run(prompt, *control_values(ex.runtime, **settings)))


def last_trace(outs) -> dict:
    """The trace the session keeps after a run (the final yield only updates the status)."""
    return [o[9] for o in outs if isinstance(o[9], dict) and "steps" in o[9]][-1]


def by_name(fig, prefix):
    found = [d for d in fig.data if (d.name or "").startswith(prefix)]
    assert found, f"no trace named {prefix!r} in {[d.name for d in fig.data]}"
    return found[0]


@pytest.fixture(scope="module")
def beam_trace(ex):
    outs = run(ex, tree="beam", top_k=3, budget=10, max_new_tokens=32)
    return last_trace(outs)


def test_run_streams_partial_traces_then_the_complete_one(ex):
    outs = run(ex, max_new_tokens=48)
    assert outs[-1][0].startswith(DONE)
    trace = validate_trace(last_trace(outs))
    counts = [len(o[9]["steps"]) for o in outs if isinstance(o[9], dict) and "steps" in o[9]]
    assert 2 <= len(counts) <= 25, "trace updates are throttled"
    heartbeats = [o for o in outs if all(isinstance(x, dict) and x.get("__type__") == "update" and len(x) == 1
                                         for x in o)]
    assert len(heartbeats) >= len(trace["steps"]) - len(counts), \
        "every decoded step yields (an empty update when there is nothing to draw), so Stop can cancel there"
    assert counts == sorted(counts) and counts[-1] == len(trace["steps"])
    assert trace["summary"]["new_tokens"] == len(trace["output"]["tokens"]) <= 48
    assert trace["baseline"]["kind"] == "ar" and trace["baseline"]["tokens_per_s"] > 0
    json.dumps(trace)   # JSON-able: what gr.State and the export need


def test_greedy_output_equals_ar(rt):
    prompt = "x = [1, 2, 3]\n"
    trace = list(runner.run(rt, prompt, {"drafter": runner.ORACLE, "tree": "beam", "max_new_tokens": 20}))[-1]
    ar = ar_generate(rt.target, rt.encode(prompt), DecodeSettings(max_new_tokens=20,
                     stop_at_eos=rt.eos_token_id is not None), rt.eos_token_id)
    assert trace["output"]["tokens"] == ar.tokens


def test_tree_figure_nodes_path_and_bonus(beam_trace):
    for i, step in enumerate(beam_trace["steps"]):
        fig = F.tree_figure(beam_trace, i)
        assert len(by_name(fig, "drafted node").x) == len(step["tree"]["tokens"])
        assert len(by_name(fig, "accepted path").x) == len(step["accepted_tokens"]) + 1
        assert len(by_name(fig, "+1 bonus token").x) == 1
        assert fig.layout.uirevision == "tree" and fig.layout.title.text
        edges = by_name(fig, "drafted edge")
        assert edges.x.count(None) == len(step["tree"]["tokens"]) - 1   # one polyline, None-separated


def test_commit_bars_sum_to_the_tokens_written(beam_trace):
    fig = F.commit_figure(beam_trace, 0)
    committed = sum(by_name(fig, "committed").y)
    steps = beam_trace["steps"]
    assert committed == sum(len(s["accepted_nodes"]) for s in steps)
    last = steps[-1]
    if len(last["new_tokens"]) == len(last["accepted_tokens"]) + 1:    # the last step was not cut
        # the state absorbed the prompt's last token and every output token but the final bonus
        assert committed == len(beam_trace["output"]["tokens"])
    assert fig.layout.yaxis2.type == "log"


def test_speedup_is_the_ratio_of_the_two_measured_rates(beam_trace):
    s, b = beam_trace["summary"], beam_trace["baseline"]
    assert s["speedup"] == pytest.approx(s["tokens_per_s"] / b["tokens_per_s"], rel=1e-2)
    fig = F.speedup_figure(beam_trace)
    assert by_name(fig, "speculative tokens/s").y[0] == s["tokens_per_s"]
    assert by_name(fig, "AR baseline").y[0] == b["tokens_per_s"]
    assert by_name(fig, "AR baseline").line.dash == "dash"
    assert "measured in this run" in fig.layout.title.text
    assert beam_trace["model"]["hardware"] in fig.layout.title.text
    taus = by_name(fig, "τ of each step").y
    assert sum(taus) / len(taus) == pytest.approx(s["tau"], abs=1e-3)


def test_lattice_figure_from_a_lattice_and_empty_state(beam_trace):
    # a hand-made lattice: 3 slots x 2 candidates; truth = 5, 8 (the chosen path), bonus 9
    class Acc:
        tokens, bonus = [5, 8], 9
    lat = lattice_with_prefixes({"candidates": [[4, 5], [8, 7], [1, 2]], "logprobs": [[-0.1, -2], [-0.5, -1], [-1, -3]],
                                 "pair": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], "chosen": [1, 0, 1], "top1": [0, 0, 0]},
                                Acc, None)
    assert (lat["selected_prefix"], lat["top1_prefix"], lat["oracle_prefix"]) == (2, 0, 2)
    trace = dict(beam_trace, steps=[dict(beam_trace["steps"][0], lattice=lat)])
    fig = F.lattice_figure(trace, 0)
    heat = fig.data[0]
    assert len(heat.z) == 2 and len(heat.z[0]) == 3            # rank x slot
    assert list(by_name(fig, "chosen path").y) == [1, 0, 1]
    assert list(by_name(fig, "pair score").text) == ["2.0", "5.0"]   # pair[0][1][0], pair[1][0][1]
    assert "selected prefix 2" in fig.layout.title.text and "oracle prefix 2" in fig.layout.title.text
    empty = F.lattice_figure(beam_trace, 0)                      # the oracle builds no lattice
    assert "No lattice" in empty.layout.annotations[0].text


def test_lattice_from_a_lilicorr_run(ex):
    if "lilicorr" not in ex.runtime.drafters:
        pytest.skip("no LiLiCorr drafter loaded")
    trace = last_trace(run(ex, drafter="lilicorr", tree="beam", top_k=2, budget=4, block_size=4, max_new_tokens=3))
    assert trace["steps"][0]["lattice"]["candidates"]
    fig = F.lattice_figure(trace, 0)
    assert fig.data[0].type == "heatmap"
    assert len(by_name(fig, "chosen path").x) == len(trace["steps"][0]["lattice"]["chosen"])


def test_token_html_escapes_and_shows_whitespace(ex):
    prompt = "<script>alert(1)</script>\n\tx = 'é✓' \x00\x1b"
    trace = last_trace(run(ex, prompt, max_new_tokens=6))
    page = F.token_html(trace, 0)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "↵" in page and "→" in page and "␀" in page and "␛" in page
    assert page.count('class="tok tok-') == len(trace["output"]["tokens"])
    assert "title=" in page and "step 0" in page


def test_step_reveals_one_step_per_click(ex):
    prompt, values = "def f():\n", control_values(ex.runtime, drafter=runner.ORACLE, max_new_tokens=12)
    outs = drain(ex.on_step(prompt, None, None, *values))
    status, trace, cursor = outs[-1][0], outs[-1][9], outs[-1][10]
    assert "Step 0 revealed" in status and cursor == 1
    n = len(trace["steps"])
    for k in range(2, n + 1):
        out = drain(ex.on_step(prompt, trace, cursor, *values))[-1]
        cursor = out[10]
        assert cursor == k and out[9] is trace or out[9] == trace
        shown = runner.reveal(trace, k)
        assert out[1].count('class="tok tok-') == len(shown["output"]["tokens"])
    assert "All" in drain(ex.on_step(prompt, trace, cursor, *values))[-1][0]
    # a changed prompt starts a new background decode
    assert "Step 0 revealed" in drain(ex.on_step("other", trace, cursor, *values))[-1][0]


def test_scrub_moves_the_step_views(ex, beam_trace):
    out = drain(ex.on_scrub(1, beam_trace, None))[-1]
    assert "step 1" in out[4].layout.title.text
    assert out[7] is not None   # skip object for the speedup view
    out = drain(ex.on_scrub(10_000, beam_trace, None))[-1]      # out of range is clamped
    assert f"step {len(beam_trace['steps']) - 1}" in out[4].layout.title.text


@pytest.mark.parametrize("prompt,settings,expect", [
    ("", {}, "empty"),
    ("   \n\t ", {}, "empty"),
    ("x" * 30_000, {}, "limit"),
    ("def f():", {"tree": "beam", "mode": "chain"}, "chain verification needs a chain"),
    ("def f():", {"paths": "[[0], [0, 0"}, "not a JSON list"),
    ("def f():", {"paths": "[[1, 0]]"}, "comes before its parent"),
    ("def f():", {"drafter": "nope"}, "unknown drafter"),
    ("def f():", {"top_k": 0}, "top k"),
    ("def f():", {"temperature": float("nan")}, "finite"),
], ids=["empty", "blank", "huge", "chain-on-tree", "bad-preset", "orphan-preset", "drafter", "top-k-0", "nan"])
def test_bad_input_gives_a_message(ex, prompt, settings, expect):
    outs = run(ex, prompt, **settings)
    assert outs[-1][0].startswith(ERROR) and expect in outs[-1][0]


@pytest.mark.parametrize("prompt,settings", [
    ("\ud800 lone surrogate, RTL \u202e, zero-width \u200b, emoji 🧪, NUL \x00", {}),
    ("a", {"max_new_tokens": 1}),
    ("def f():", {"top_k": 1, "budget": 1, "depth": 1, "block_size": 2}),
    ("def f():", {"budget": 255, "max_new_tokens": 4}),
    ("def f():", {"tree": "best-first", "top_k": 16, "budget": 40, "prune_tau": 10, "max_new_tokens": 4}),
    ("def f():", {"temperature": 2.0, "top_p": 0.05, "seed": 2**31 - 1, "oracle_alpha": 0.0}),
    ("def f():", {"paths": "[[0], [0, 0], [1], [0, 1], [0, 0, 0]]", "deferred": False, "mode": "hybrid"}),
], ids=["odd-unicode", "one-token", "minimal-tree", "max-budget", "wide-pruned", "sampling-extremes", "preset"])
def test_extreme_settings_still_run(ex, prompt, settings):
    settings.setdefault("max_new_tokens", 6)
    outs = run(ex, prompt, **settings)
    assert outs[-1][0].startswith(DONE), outs[-1][0]
    validate_trace(last_trace(outs))
    load_trace(runner.export_trace(last_trace(outs)))      # exportable, whatever the input


def _write(tmp_path, name, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_bad_trace_files_give_messages(ex, beam_trace, tmp_path):
    good = json.dumps(beam_trace).encode()
    cases = {
        "invalid.json": (b"{not json", "not valid JSON"),
        "truncated.json": (good[: len(good) // 2], "not valid JSON"),
        "foreign.json": (b'{"name": "some other tool", "data": [1, 2]}', "not a SpecLA trace"),
        "list.json": (b"[1, 2, 3]", "not a SpecLA trace"),
        "binary.json": (bytes(range(256)), "not UTF-8"),
        "future.json": (json.dumps(dict(beam_trace, version=99)).encode(), "newer"),
        "cycle.json": (json.dumps(dict(beam_trace, steps=[dict(beam_trace["steps"][0], tree={
            "tokens": [1, 2], "parents": [-1, 1]})])).encode(), "topological"),
    }
    for name, (data, expect) in cases.items():
        out = drain(ex.on_upload(_write(tmp_path, name, data)))[-1]
        assert out[0].startswith(ERROR) and expect in out[0], (name, out[0])
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_TRACE_BYTES + 1)                        # sparse: no 20 MiB written
    assert "limit is 20 MiB" in drain(ex.on_upload(str(big)))[-1][0]
    assert drain(ex.on_upload(None))[-1][0].startswith(ERROR)


def test_replay_of_a_foreign_model_and_of_odd_but_valid_traces(ex, beam_trace, tmp_path):
    foreign = dict(beam_trace, model=dict(beam_trace["model"], name="another-model", fingerprint="0" * 16),
                   token_text={})
    step = dict(beam_trace["steps"][0], lattice={"candidates": [[1, 2], "x"], "chosen": ["a"]},
                draft_probs=[], target_probs=[None], target_choice=None)
    foreign["steps"] = [step] + beam_trace["steps"][1:]
    out = drain(ex.on_upload(_write(tmp_path, "foreign-model.json", json.dumps(foreign).encode())))[-1]
    assert "not the loaded model" in out[0] and "another-model" in out[0]
    assert len(out[4].data) >= 3 and "No lattice" in out[5].layout.annotations[0].text
    empty = dict(beam_trace, steps=[], output={"tokens": [], "sources": [], "step_of": [], "text": ""})
    out = drain(ex.on_upload(_write(tmp_path, "empty.json", json.dumps(empty).encode())))[-1]
    assert "Replaying" in out[0] and out[4].layout.annotations


def test_a_trace_with_wrong_types_inside_still_replays(ex, beam_trace, tmp_path):
    odd = json.loads(json.dumps(beam_trace))
    odd["model"]["name"] = "\ud800 <b>bold</b>"
    odd["model"]["hardware"] = ["not", "a", "string"]
    odd["summary"]["tau"] = "many"
    odd["settings"]["drafter"] = {"x": 1}
    odd["steps"][0]["tree"]["tokens"] = ["a"] * len(odd["steps"][0]["tree"]["tokens"])
    odd["steps"][1]["commit"] = {"folded_now": "two"}
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(odd))                     # ASCII, surrogate escaped
    out = drain(ex.on_upload(str(path)))[-1]
    assert "Replaying" in out[0] and "<b>" not in out[0]
    assert "cannot be drawn" in out[4].layout.annotations[0].text       # the tree of step 0
    for fig in out[4:8]:
        fig.to_json()                                                  # what gr.Plot sends
    load_trace(runner.export_trace(out[9]))


def test_export_writes_a_random_name_that_replays(ex, beam_trace):
    button, status = ex.on_export(beam_trace)
    path = Path(button.value if isinstance(button.value, str) else button.value["path"])
    assert re.fullmatch(r"trace-[0-9a-f]{32}\.json", path.name) and "Trace ready" in status
    assert str(path).startswith(os.environ["GRADIO_TEMP_DIR"])
    assert load_trace(path) == json.loads(json.dumps(beam_trace))
    out = drain(ex.on_upload(str(path)))[-1]
    assert "loaded model" in out[0] and out[9]["output"] == beam_trace["output"]
    button, status = ex.on_export(None)
    assert status.startswith(ERROR)


def test_controls_stay_consistent(ex):
    radio, note = ex.on_shape("beam", "", "chain")
    assert radio.value == "auto" and "chain" not in [c[0] for c in radio.choices] and "switched" in note
    radio, note = ex.on_shape("chain", "[[0], [0, 0]]", "chain")          # a chain preset keeps chain
    assert radio.value == "chain" and "2 nodes" in note
    radio, note = ex.on_shape("chain", "[[0], [1]]", "chain")
    assert radio.value == "auto"
    assert ex.on_depth(12, 8).value == 12 and ex.on_budget(3, 6).value == 3
    alpha, block, top_k = ex.on_drafter(runner.ORACLE, 8, 4)
    assert alpha.visible is True


def test_stop_redraws_the_kept_partial_trace(ex, beam_trace):
    out = ex.on_stop(beam_trace, None)
    assert out[0].startswith("**Stopped** after") and out[9] is beam_trace
    assert out[1].count('class="tok tok-') == len(beam_trace["output"]["tokens"])
    out = ex.on_stop(beam_trace, 2)                                   # in step mode: what was revealed
    assert out[1].count('class="tok tok-') == len(runner.reveal(beam_trace, 2)["output"]["tokens"])
    assert "after 0 steps" in ex.on_stop(None, None)[0]


def test_reset_clears_every_view(ex):
    out = ex.on_reset()
    assert out[0] == "Ready." and out[9] is None and out[10] is None
    assert "No run yet" in out[1] and out[-1].visible is False
