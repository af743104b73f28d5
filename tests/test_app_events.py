"""Layer 1: the explorer's event functions called directly, as the page would call them.

A tiny random-weight target with the oracle drafter (and a random LiLiCorr drafter, so the
lattice view gets real data), unless a trained model sits in assets/target.
"""
import os
from pathlib import Path

for _key, _value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(_key, _value)
os.environ.setdefault("GRADIO_TEMP_DIR", str(Path(__file__).resolve().parent.parent / ".gradio"))

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import gradio as gr  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from specla import figures as F  # noqa: E402
from specla import runner  # noqa: E402
from specla.decode import DecodeSettings, ar_generate  # noqa: E402
from specla.explorer import (CONTROL_DEFAULTS, CONTROLS, KEPT_TRACE, N_REPLAY, N_VIEWS, DrawPace,  # noqa: E402
                             Explorer, build_demo, control_values)
from specla.model_choice import LOADED  # noqa: E402
from specla.trace import (MAX_TRACE_BYTES, TraceError, lattice_with_prefixes, load_trace,  # noqa: E402
                          output_tokens, validate_trace)

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


def test_a_graphed_run_does_not_yield_a_heartbeat_per_batched_step(rt):
    """The graphed backend decodes steps in batches before their records arrive: the run
    yields far fewer empty updates than steps, its first trace already holds the first step,
    and its trace equals one with a heartbeat each."""
    import dataclasses

    from specla.engine import Engine

    graphed = dataclasses.replace(rt, engine=Engine(rt.target, "graphed", use_graph=False))
    settings = {"drafter": runner.ORACLE, "max_new_tokens": 48}
    updates = list(runner.run(graphed, "def f(x):\n", settings))
    traces = [u for u in updates if isinstance(u, dict)]
    trace = traces[-1]
    assert trace["engine"]["backend"] == "graphed"
    assert len(traces[0]["steps"]) == 1, "no empty trace is drawn before the first step: it comes at once"
    heartbeats = sum(u is None for u in updates)
    assert len(trace["steps"]) >= 10 and heartbeats < len(trace["steps"]) / 2
    eager = [u for u in runner.run(rt, "def f(x):\n", settings) if isinstance(u, dict)][-1]
    assert trace["output"]["tokens"] == eager["output"]["tokens"]


def test_the_first_step_is_drawn_at_once_and_the_stages_are_timed(rt):
    updates = [u for u in runner.run(rt, "def f(x):\n", {"drafter": runner.ORACLE, "max_new_tokens": 24})
               if isinstance(u, dict)]
    assert len(updates[1]["steps"]) == 1, "the first decoded step is drawn without waiting for the throttle"
    stages = updates[-1]["latency_ms"]
    assert list(stages) == ["ar_baseline", "drafter_and_capture", "first_step", "decode", "exactness"]
    assert all(ms >= 0 for ms in stages.values())


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


def frame_centres(trace) -> list[tuple[float, float]]:
    """Centres of the square frames of a None-separated polyline (5 corners + None each)."""
    xs, ys = list(trace.x), list(trace.y)
    return [(sum(xs[i:i + 4]) / 4, sum(ys[i:i + 4]) / 4) for i in range(0, len(xs), 6)]


def test_lattice_figure_from_a_lattice_and_empty_state(beam_trace):
    # a hand-made lattice: 3 slots x 2 candidates; truth = 5, 8 (the chosen path), bonus 9
    class Acc:
        tokens, bonus = [5, 8], 9
    lat = lattice_with_prefixes({"candidates": [[4, 5], [8, 7], [1, 2]], "logprobs": [[-0.1, -2], [-0.5, -1], [-1, -7]],
                                 "pair": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], "chosen": [1, 0, 1], "top1": [0, 0, 0]},
                                Acc, None)
    assert (lat["selected_prefix"], lat["top1_prefix"], lat["oracle_prefix"]) == (2, 0, 2)
    trace = dict(beam_trace, steps=[dict(beam_trace["steps"][0], lattice=lat)])
    fig = F.lattice_figure(trace, 0)
    heat = fig.data[0]
    assert len(heat.z) == 2 and len(heat.z[0]) == 3            # rank x slot
    assert frame_centres(by_name(fig, "chosen path")) == [(1, 1), (2, 0), (3, 1)]
    assert frame_centres(by_name(fig, "target's token")) == [(1, 1), (2, 0)]
    scores = by_name(fig, "pair score")
    assert list(scores.text) == ["2.0", "5.0"]                  # pair[0][1][0], pair[1][0][1]
    assert all(y < -0.5 for y in scores.y)                       # a row above rank 0, off the cells
    # frames and the top-1 line keep clear of the cell centres, where the token text sits
    for name in ("chosen path", "target's token", "top-1 path"):
        line = by_name(fig, name)
        assert all(abs(x - round(x)) > 0.3 or abs(y - round(y)) > 0.3
                   for x, y in zip(line.x, line.y) if x is not None)
    # token text: black on the light cells, white on the dark ones
    words = fig.data[1]
    colour = {(x, y): c for x, y, c in zip(words.x, words.y, words.textfont.color)}
    assert colour[(1, 0)] == "#ffffff" and colour[(3, 1)] == "#111827"   # log p -0.1 / -7
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
    assert len(frame_centres(by_name(fig, "chosen path"))) == len(trace["steps"][0]["lattice"]["chosen"])


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
    (None, {}, "the prompt must be text"),
    ("def f():", {"tree": "beam", "mode": "chain"}, "chain verification needs a chain"),
    ("def f():", {"paths": "[[0], [0, 0"}, "not a JSON list"),
    ("def f():", {"paths": "[[1, 0]]"}, "comes before its parent"),
    ("def f():", {"paths": 7}, "tree preset must be a non-empty list"),
    ("def f():", {"drafter": "nope"}, "unknown drafter"),
    ("def f():", {"drafter": [1]}, "unknown drafter"),
    ("def f():", {"tree": 5}, "tree shape must be one of chain, beam, best-first, got 5"),
    ("def f():", {"mode": None}, "verification mode must be one of"),
    ("def f():", {"top_k": 0}, "top k must be between 1"),
    ("def f():", {"top_k": "abc"}, "top k must be a number, got 'abc'"),
    ("def f():", {"top_k": None}, "top k must be a number, got None"),
    ("def f():", {"top_k": True}, "top k must be a number, got True"),
    ("def f():", {"budget": [3]}, "budget must be a number, got [3]"),
    ("def f():", {"temperature": float("nan")}, "temperature must be a finite number"),
    ("def f():", {"seed": float("nan")}, "seed must be a finite number"),
    ("def f():", {"max_new_tokens": 3.7}, "max new tokens must be a whole number, got 3.7"),
    ("def f():", {"max_new_tokens": "3.5"}, "max new tokens must be a whole number, got '3.5'"),
    ("def f():", {"deferred": "yes"}, "deferred commit must be true or false, got 'yes'"),
], ids=["empty", "blank", "huge", "none-prompt", "chain-on-tree", "bad-preset", "orphan-preset", "number-preset",
        "drafter", "list-drafter", "int-tree", "none-mode", "top-k-0", "top-k-text", "top-k-none", "top-k-bool",
        "list-budget", "nan", "nan-seed", "fraction", "fraction-text", "deferred-text"])
def test_bad_input_gives_a_message(ex, prompt, settings, expect):
    outs = run(ex, prompt, **settings)
    assert len(outs) == 1, "refused before any model work"
    assert outs[-1][0] == f"{ERROR} {outs[-1][0][len(ERROR) + 1:]}" and expect in outs[-1][0], outs[-1][0]
    assert all(o == gr.skip() for o in outs[-1][1:]), "bad input leaves every view and the kept trace alone"


def test_whole_numbers_may_come_as_floats_or_text(ex):
    trace = last_trace(run(ex, "def f():", top_k="3", budget=5.0, max_new_tokens="7", seed=2.0))
    assert trace["settings"]["top_k"] == 3 and trace["settings"]["budget"] == 5
    assert trace["settings"]["max_new_tokens"] == 7 == len(trace["output"]["tokens"])


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
    foreign = dict(beam_trace, model=dict(beam_trace["model"], name="another-model", fingerprint="0" * 16))
    known = [int(t) for t in list(beam_trace["token_text"])[:2]]
    step = dict(beam_trace["steps"][0], lattice={"candidates": [known, "x"], "chosen": ["a"]},
                draft_probs=[], target_probs=[None], target_choice=None)
    foreign["steps"] = [step] + beam_trace["steps"][1:]
    out = drain(ex.on_upload(_write(tmp_path, "foreign-model.json", json.dumps(foreign).encode())))[-1]
    assert "not the loaded model" in out[0] and "another-model" in out[0]
    assert len(out[4].data) >= 3 and "No lattice" in out[5].layout.annotations[0].text
    empty = dict(beam_trace, steps=[], output={"tokens": [], "sources": [], "step_of": [], "text": ""},
                 summary=dict(beam_trace["summary"], new_tokens=0, target_forwards=0))
    out = drain(ex.on_upload(_write(tmp_path, "empty.json", json.dumps(empty).encode())))[-1]
    assert "Replaying" in out[0] and out[4].layout.annotations


def test_a_trace_with_wrong_types_inside_still_replays(ex, beam_trace, tmp_path, monkeypatch):
    odd = json.loads(json.dumps(beam_trace))
    odd["model"]["name"] = "\ud800 <b>bold</b>"
    odd["model"]["hardware"] = ["not", "a", "string"]
    odd["summary"]["tau"] = "many"
    odd["settings"]["drafter"] = {"x": 1}
    odd["settings"]["top_k"] = "three"
    odd["steps"][1]["commit"] = {"folded_now": "two"}
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(odd))                     # ASCII, surrogate escaped

    def broken(trace, step):
        raise KeyError("no such field")
    monkeypatch.setattr(F, "tree_figure", broken)        # a view that cannot read a trace
    out = drain(ex.on_upload(str(path)))[-1]
    assert "Replaying" in out[0] and "<b>" not in out[0]
    assert "is not loaded here" in out[0] and "top-k 'three' is not a number" in out[0]
    assert "cannot be drawn" in out[4].layout.annotations[0].text       # only that view gives up
    for fig in out[4:8]:
        fig.to_json()                                                  # what gr.Plot sends
    load_trace(runner.export_trace(out[9]))


def cut_an_early_step(trace: dict) -> None:
    """Drop the bonus of a step before the last, output and summary made to agree, as if cut."""
    step = next(s for s in trace["steps"][:-1] if len(s["new_tokens"]) >= 2)
    step["new_tokens"] = step["new_tokens"][:-1]
    tokens, sources, step_of = output_tokens(trace["steps"])
    trace["output"].update(tokens=tokens, sources=sources, step_of=step_of)
    trace["summary"]["new_tokens"] = len(tokens)


@pytest.mark.parametrize("break_it,expect", [
    (lambda t: t["summary"].update(new_tokens=t["summary"]["new_tokens"] + 5), "summary counts"),
    (lambda t: t["summary"].update(target_forwards=1), "target forwards"),
    (lambda t: t["steps"].append(dict(t["steps"][0], index=len(t["steps"]))),
     "output tokens|only a run's last step"),
    (lambda t: t["token_text"].pop(str(t["output"]["tokens"][-1])), "has no text"),
    (lambda t: t["token_text"].pop(str(t["steps"][0]["tree"]["tokens"][-1])), "has no text"),
    (lambda t: t["steps"][0].update(new_tokens=[1, 2, 3]), "not its accepted tokens"),
    (lambda t: t["steps"][0]["tree"].update(tokens=["a"] * len(t["steps"][0]["tree"]["tokens"])),
     "not a token id"),
    (lambda t: t["summary"].update(speedup_spread=[2.0, 1.0]), "speedup_spread"),
    (cut_an_early_step, "only a run's last step is cut"),
], ids=["tokens", "forwards", "extra-step", "output-text", "tree-text", "new-tokens", "str-token", "spread",
        "cut-early"])
def test_an_inconsistent_trace_is_refused_on_export_and_on_load(beam_trace, tmp_path, break_it, expect):
    broken = json.loads(json.dumps(beam_trace))
    break_it(broken)
    with pytest.raises(TraceError, match=expect):
        runner.export_trace(broken, folder=tmp_path)
    assert not list((tmp_path / "traces").glob("*.json"))              # nothing written
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(TraceError, match=expect):
        load_trace(path)


def test_every_partial_and_revealed_trace_keeps_the_invariant(rt, beam_trace):
    for update in runner.run(rt, "def f(x):\n", {"drafter": runner.ORACLE, "tree": "beam", "max_new_tokens": 40}):
        if isinstance(update, dict):        # None: a heartbeat; str: a status line
            validate_trace(update)
    for n in range(len(beam_trace["steps"]) + 1):
        validate_trace(runner.reveal(beam_trace, n))


def test_export_writes_a_random_name_that_replays(ex, beam_trace):
    file, status = ex.on_export(beam_trace)
    path = Path(file)
    assert re.fullmatch(r"trace-[0-9a-f]{32}\.json", path.name) and "Trace ready" in status
    assert str(path).startswith(os.environ["GRADIO_TEMP_DIR"])
    assert load_trace(path) == json.loads(json.dumps(beam_trace))
    out = drain(ex.on_upload(str(path)))[-1]
    assert "loaded model" in out[0] and out[9]["output"] == beam_trace["output"]
    assert path.exists(), "an exported trace is not an upload: replaying it keeps it"
    file, status = ex.on_export(None)
    assert file is None and status.startswith(ERROR)


def test_controls_stay_consistent(ex):
    radio, note = ex.on_shape("beam", "", "chain")
    assert radio.value == "auto" and "chain" not in [c[0] for c in radio.choices] and "switched" in note
    radio, note = ex.on_shape("chain", "[[0], [0, 0]]", "chain")          # a chain preset keeps chain
    assert radio.value == "chain" and "2 nodes" in note
    radio, note = ex.on_shape("chain", "[[0], [1]]", "chain")
    assert radio.value == "auto"
    assert ex.on_depth(12, 8).value == 12 and ex.on_budget(3, 6).value == 3
    alpha, block, top_k, paths, mode, note = ex.on_drafter(runner.ORACLE, 8, 4)
    assert alpha.visible is True and paths.value == "" and note == ""


@pytest.mark.skipif(not (runner.ASSETS / "drafters" / "block").exists(), reason="needs the trained block drafter")
def test_a_graphed_page_starts_the_block_drafter_on_its_measured_preset(rt):
    """Where the engine runs CUDA graphs (here without capture, on the CPU) the page starts on
    the fastest path measured there: the block drafter's measured preset. A preset left at a
    default follows the drafter; one the user wrote is kept; the eager page keeps the chain,
    and starts on the drafter measured fastest there, LiLiCorr's chain."""
    from specla.engine import Engine
    graphed = dataclasses.replace(rt, engine=Engine(rt.target, "graphed", use_graph=False))
    gx, eager = Explorer(graphed), Explorer(rt)
    assert gx.first_drafter == "block" and gx.preset_for("block") == runner.MEASURED
    assert eager.first_drafter == "lilicorr" and runner.normalize_settings(rt, {})["drafter"] == "lilicorr"
    assert runner.default_drafter(dataclasses.replace(rt, drafters={"ngram": rt.drafters["ngram"]})) == "ngram"
    assert eager.preset_for("block") == "" and gx.preset_for("lilicorr") == ""
    *_, paths, mode, note = gx.on_drafter("lilicorr", 8, 4, LOADED, "chain", "measured", "auto")
    assert paths.value == "" and mode.value == "auto" and note == ""
    *_, paths, mode, note = gx.on_drafter("block", 8, 4, LOADED, "chain", "", "chain")
    assert paths.value == runner.MEASURED and mode.value == "auto" and "measured tree" in note
    assert "switched to auto" in note          # chain verification cannot verify a tree
    *_, paths, _, _ = gx.on_drafter("lilicorr", 8, 4, LOADED, "chain", "[[0], [1]]", "auto")
    assert paths.value == "[[0], [1]]"
    box = next(b for b in build_demo(graphed).blocks.values() if getattr(b, "elem_id", None) == "paths")
    assert box.value == runner.MEASURED
    assert control_values(graphed)[CONTROLS.index("paths")] == runner.MEASURED
    assert control_values(rt)[CONTROLS.index("paths")] == ""
    trace = last_trace(drain(gx.on_run("def add(a, b):\n\treturn",
                                       *control_values(graphed, max_new_tokens=12))))
    assert trace["settings"]["paths"] == runner.measured_preset(rt.drafters["block"], "block")
    assert trace["engine"]["backend"] == "graphed" and trace["engine"]["drafting"] == "device"
    assert max(len(step["tree"]["tokens"]) for step in trace["steps"]) > 8     # trees, not the chain of 7


def test_stop_redraws_the_kept_partial_trace(ex, beam_trace):
    out = ex.on_stop(beam_trace, None)
    assert out[0].startswith("**Stopped** after") and out[9] is beam_trace
    assert out[1].count('class="tok tok-') == len(beam_trace["output"]["tokens"])
    out = ex.on_stop(beam_trace, 2)                                   # in step mode: what was revealed
    assert out[1].count('class="tok tok-') == len(runner.reveal(beam_trace, 2)["output"]["tokens"])
    assert "before the first step" in ex.on_stop(None, None)[0]


def test_a_new_run_or_step_decode_clears_the_kept_trace_once_its_input_is_checked(ex, beam_trace):
    """Stop during the AR measurement (or a Step's background decode) must not keep the previous run."""
    values = control_values(ex.runtime, drafter=runner.ORACLE, max_new_tokens=4)
    for gen in (ex.on_run("def g():", *values), ex.on_step("def g():", beam_trace, 3, *values)):
        first = next(gen)
        gen.close()
        assert first[9] is None and first[10] is None
    bad = drain(ex.on_run("", *values))[-1]                        # refused input keeps the trace
    assert bad[9] == gr.skip() and bad[10] == gr.skip()


def test_reset_clears_every_view(ex):
    out = ex.on_reset()
    assert out[0] == "Ready." and out[9] is None and out[10] is None
    assert "No run yet" in out[1] and out[-1].visible is False


def test_handlers_take_named_parameters(ex):
    import inspect
    run_params = inspect.signature(ex.on_run).parameters
    assert list(run_params) == ["prompt", *CONTROLS]
    assert list(inspect.signature(ex.on_step).parameters) == ["prompt", "trace", "cursor", *CONTROLS]
    for name in CONTROLS:     # one set of defaults: the page's
        expected = None if name in ("drafter", "paths") else CONTROL_DEFAULTS[name]
        assert run_params[name].default == expected, name


def test_the_kept_trace_is_a_snapshot_that_later_steps_cannot_change(rt, beam_trace):
    """A producer that keeps appending to a list it already yielded must not change the kept trace."""
    def leaky(model, prompt, settings):
        partial = runner.reveal(beam_trace, 3)
        yield partial
        partial["steps"].append(beam_trace["steps"][3])      # the list the page keeps, if it kept it
        yield None
        yield runner.reveal(beam_trace, 5)

    outs = drain(Explorer(rt, leaky).on_run("def f(x):", *control_values(rt, drafter=runner.ORACLE)))
    kept = [o[KEPT_TRACE] for o in outs if isinstance(o[KEPT_TRACE], dict) and "steps" in o[KEPT_TRACE]]
    assert [len(t["steps"]) for t in kept] == [3, 5, 5]
    for trace in kept:
        validate_trace(trace)


def test_a_fast_stream_draws_at_the_pace_of_drawing_and_keeps_every_trace(rt, beam_trace, monkeypatch):
    """Partial traces that come faster than the page can draw them are kept (Stop redraws the
    newest) but not drawn: a page drawing behind the stream stops answering clicks."""
    n = len(beam_trace["steps"])
    monkeypatch.setattr(DrawPace, "MIN_SECONDS", 600.0)    # the burst is inside one spacing on any machine

    def burst(model, prompt, settings):
        for k in range(1, n + 1):
            yield runner.reveal(beam_trace, k)

    outs = drain(Explorer(rt, burst).on_run("def f(x):", *control_values(rt, drafter=runner.ORACLE)))
    kept = [o[KEPT_TRACE] for o in outs if isinstance(o[KEPT_TRACE], dict) and "steps" in o[KEPT_TRACE]]
    drawn = [o for o in outs if o[4] != gr.skip()]
    assert [len(t["steps"]) for t in kept] == list(range(1, n + 1)) + [n], "every partial trace is kept"
    assert len(drawn) == 2, "the first step, then the whole trace"
    assert outs[-1][0].startswith(DONE) and len(outs[-1][KEPT_TRACE]["steps"]) == n
    assert f"after {n} steps" in Explorer(rt).on_stop(kept[-2], None)[0], "Stop draws the newest kept trace"


def test_heartbeats_become_empty_updates_and_a_cancel_stops_within_one_step(rt):
    """Gradio cancels a generator between yields: one yield per engine step bounds Stop to one step."""
    pulled, closed = [], []

    def counting(model, prompt, settings):
        try:
            for update in runner.run(rt, prompt, settings):
                pulled.append(update)
                yield update
        finally:
            closed.append(len(pulled))

    gen = Explorer(rt, counting).on_run("def f(x):\n", *control_values(rt, drafter=runner.ORACLE,
                                                                         max_new_tokens=200))
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for out in gen:
            outs.append(out)
            if len(outs) == 25:
                break
        gen.close()                                            # what Gradio's cancel does
    assert closed == [len(pulled)], "the engine's generator is closed with the page's"
    assert len(pulled) == len(outs) - 1, "one engine yield (step or heartbeat) per page update"
    skips = [o for o in outs if all(v == gr.skip() for v in o)]
    assert len(skips) == sum(u is None for u in pulled)
    kept = last_trace(outs)
    validate_trace(kept)
    assert 0 < kept["summary"]["new_tokens"] < 200
    load_trace(runner.export_trace(kept))


def test_replay_restores_the_prompt_and_every_setting(ex, rt, tmp_path):
    prompt = "class Point:\n    def __init__(self, x, y):\n"
    settings = dict(drafter=runner.ORACLE, oracle_alpha=0.6, tree="beam", top_k=3, block_size=5, depth=4, budget=10,
                    prune_tau=2.5, mode="hybrid", deferred=False, temperature=0.5, top_p=0.9, max_new_tokens=12,
                    seed=7)
    trace = last_trace(run(ex, prompt, **settings))
    out = drain(ex.on_upload(str(runner.export_trace(trace, folder=tmp_path))))[-1]
    assert len(out) == N_REPLAY
    assert "every setting are restored" in out[0] and "except" not in out[0]
    assert out[N_VIEWS] == prompt
    shown = dict(zip(CONTROLS, out[N_VIEWS + 1:N_VIEWS + 1 + len(CONTROLS)]))
    values = {name: getattr(v, "value", v) for name, v in shown.items()}
    assert values == dict(settings, paths="", model=LOADED)
    assert shown["oracle_alpha"].visible is True
    assert "chain" not in [c[0] for c in shown["mode"].choices]      # a beam tree cannot be verified as a chain
    # what does not fit the page is said, and set to the nearest value the page allows
    odd = dict(trace, settings=dict(trace["settings"], drafter="medusa", max_new_tokens=4000,
                                    paths=[[0], [1], [0, 0]]))
    path = tmp_path / "odd-settings.json"
    path.write_text(json.dumps(odd))
    out = drain(ex.on_upload(str(path)))[-1]
    assert "its drafter 'medusa' is not loaded here" in out[0]
    assert "max new tokens 4000 is outside this page's range" in out[0]
    values = {name: getattr(v, "value", v) for name, v in zip(CONTROLS, out[N_VIEWS + 1:])}
    assert values["max_new_tokens"] == ex.control_range("max_new_tokens")[1]
    assert json.loads(values["paths"]) == [[0], [1], [0, 0]] and "3 nodes" in out[-1]


def test_a_truncated_last_step_says_why_and_counts_are_plural(ex):
    outs = run(ex, "def add(a, b):\n", oracle_alpha=1.0, budget=8, max_new_tokens=3)
    trace = last_trace(outs)
    assert outs[-1][0].startswith("**Done**: 3 tokens in 1 step ")
    step = F.step_html(trace, 0)
    assert "→ 3 new tokens" in step and "Cut to 3 tokens: this step reached max new tokens (3)" in step
    outs = run(ex, "def add(a, b):\n", oracle_alpha=1.0, budget=8, max_new_tokens=1)
    assert outs[-1][0].startswith("**Done**: 1 token in 1 step ")
    assert "→ 1 new token ·" in F.step_html(last_trace(outs), 0)
    eos_cut = {"steps": [{"accepted_tokens": [5, 0, 7], "bonus": 9, "new_tokens": [5, 0]}],
               "model": {"config": {"eos_token_id": 0}}, "settings": {"max_new_tokens": 64}}
    assert F.truncation(eos_cut, 0).startswith("Cut to 2 tokens: the end-of-text token ends the run, so the "
                                               "2 more tokens verified after it are not kept")


def test_commit_and_phase_plots_clip_an_outlier_and_mark_it(beam_trace):
    trace = json.loads(json.dumps(beam_trace))
    for i, step in enumerate(trace["steps"]):
        step["times_ms"]["commit"] = 23.0 if i == 2 else 0.1 + 0.01 * i
    fig = F.commit_figure(trace)
    assert fig.layout.yaxis3.range[1] < 23.0
    marks = by_name(fig, "▲ bar above the axis")
    assert list(marks.x) == [trace["steps"][2]["index"]] and list(marks.text) == ["23.0 ms"]
    even = json.loads(json.dumps(beam_trace))    # measured times can hold an outlier: set them even
    for step in even["steps"]:
        step["times_ms"]["commit"] = 0.1
    plain = F.commit_figure(even)
    assert not [d for d in plain.data if (d.name or "").startswith("▲")] and plain.layout.yaxis3.range is None
    trace["steps"][1]["times_ms"]["verify"] = 500.0
    fig = F.speedup_figure(trace)
    assert list(by_name(fig, "▲ bar above the axis").x) == [trace["steps"][1]["index"]]
    assert fig.layout.yaxis4.range[1] < 500


def test_token_labels_are_escaped_exactly_once(beam_trace):
    trace = json.loads(json.dumps(beam_trace))
    tokens = trace["steps"][0]["tree"]["tokens"]
    texts = ['"""', "a&b", "<b>x", "it's"]
    for token, text in zip(tokens, texts):
        trace["token_text"][str(token)] = text
    fig = F.tree_figure(trace, 0)
    nodes = by_name(fig, "drafted node")
    labels = dict(zip(nodes.customdata, nodes.text))
    # plotly reads &amp; &lt; &gt; back into characters, but shows &quot; and &#x27; as they are
    assert [labels[i] for i in range(len(texts)) if i < len(tokens)] == ['"""', "a&amp;b", "&lt;b&gt;x", "it's"][
        :len(tokens)]
    assert "&quot;" not in json.dumps(fig.to_plotly_json()) and "&#x27;" not in json.dumps(fig.to_plotly_json())
    assert "&quot;" not in F.step_html(trace, 0) and "&amp;amp;" not in F.step_html(trace, 0)


def test_speedup_spread_is_shown_when_the_trace_has_it(ex, beam_trace):
    trace = dict(beam_trace, summary=dict(beam_trace["summary"], speedup_spread=[1.1, 1.3]))
    assert "alternating runs: 1.10× to 1.30×" in ex.summary_md(trace)
    assert "1.10× to 1.30× over alternating runs" in F.speedup_figure(trace).layout.title.text
    assert beam_trace["summary"]["speedup_spread"] == beam_trace["timing"]["speedup_spread"], "the CPU runs alternate"
    single = dict(beam_trace, summary={k: v for k, v in beam_trace["summary"].items() if k != "speedup_spread"})
    assert "alternating" not in ex.summary_md(single)


def test_uploads_in_the_temp_folder_are_deleted_once_read(ex, beam_trace):
    temp = Path(os.environ["GRADIO_TEMP_DIR"]) / "upload-test-0123456789"
    for data, expect in ((json.dumps(beam_trace).encode(), "Replaying"), (b"{broken", ERROR)):
        temp.mkdir(parents=True, exist_ok=True)
        upload = temp / "trace.json"
        upload.write_bytes(data)
        assert expect in drain(ex.on_upload(str(upload)))[-1][0]
        assert not upload.exists() and not temp.exists()


def test_exported_traces_on_disk_stay_bounded(beam_trace, tmp_path):
    folder = runner.export_folder(tmp_path)
    folder.mkdir(parents=True)
    now = time.time()
    for i in range(runner.EXPORT_KEEP + 10):
        old = folder / f"trace-{i:032x}.json"
        old.write_text("{}")
        age = runner.EXPORT_MAX_AGE_S + 60 if i < 5 else i      # five expired, the rest recent
        os.utime(old, (now - age, now - age))
    path = runner.export_trace(beam_trace, folder=tmp_path)
    left = sorted(folder.glob("trace-*.json"))
    assert path in left and len(left) == runner.EXPORT_KEEP
    assert not any((folder / f"trace-{i:032x}.json").exists() for i in range(5))


def test_summary_names_the_engine_and_says_where_the_output_leaves_ar(ex, beam_trace):
    """The summary says which backend ran and why a part ran on the host, and shows a bf16
    divergence with its logit gap instead of claiming equality."""
    trace = dict(beam_trace, engine={"backend": "graphed", "drafting": "host", "acceptance": "host",
                                     "note": "a tree preset (device drafters grow chains)", "ops": "fla fused kernels",
                                     "dtype": "bfloat16", "graphs": 3, "capture_ms": 1500.0},
                 exactness={"checked": True, "equal": False, "compared_tokens": 20, "dtype": "bfloat16",
                            "first_divergence": {"position": 7, "logit_gap": 0.0123, "noise": 0.02, "near_tie": True}})
    text = ex.summary_md(trace)
    assert "CUDA graphs" in text and "drafting on the host" in text and "a tree preset" in text
    assert "leaves AR's at token 7" in text and "0.0123" in text and "near-tie" in text
    assert "equals AR" in ex.summary_md(dict(beam_trace, exactness={"checked": True, "equal": True,
                                                                    "compared_tokens": 20, "dtype": "float32"}))
    assert "eager PyTorch" in ex.summary_md(beam_trace)


# -- the Model selector: the loaded model, or the GDN-1.3B shape built on demand --------------------
ONE_B = runner.RANDOM_1P3B
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA says")
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def fake_1p3b() -> runner.Runtime:
    """A tiny stand-in for the GDN-1.3B runtime: the oracle only, labelled and described like it."""
    fake = runner.tiny_random_runtime(seed=1, note=runner.RANDOM_1P3B_NOTE)
    fake.labels, fake.model_name = dict(runner.RANDOM_1P3B_LABELS), runner.RANDOM_1P3B_NAME
    return fake


@pytest.fixture
def gpu_like(monkeypatch):
    """A machine where the 1.3B shape can be built (it builds the stand-in); records the builds
    and the cache flushes."""
    built, flushes = [], []

    def build():
        built.append(fake_1p3b())
        return built[-1]
    monkeypatch.setattr(runner, "gpu_shortfall", lambda gib: None)
    monkeypatch.setattr(runner, "random_1p3b_runtime", build)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: flushes.append(1))
    return built, flushes


def model_selector(demo) -> gr.Dropdown:
    return next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "model")


def switch(ex, model: str, drafter: str) -> dict:
    names = ("model", "drafter", "oracle_alpha", "block_size", "top_k", "max_new_tokens", "model_line", "status")
    return dict(zip(names, ex.on_model(model, drafter, 8, 4, 64)))


@NO_CUDA
def test_the_1p3b_choice_says_it_needs_a_cuda_gpu_and_builds_nothing(rt, monkeypatch, caplog):
    monkeypatch.setattr(runner, "random_1p3b_runtime", lambda *a: pytest.fail("nothing may be built here"))
    demo = build_demo(rt)
    selector, ex = model_selector(demo), demo.explorer
    assert [key for _, key in selector.choices] == [LOADED, ONE_B] and selector.value == LOADED
    assert "needs a CUDA GPU" in selector.info
    out = switch(ex, ONE_B, runner.ORACLE)
    assert out["model"].value == LOADED and "cannot run here: it needs a CUDA GPU" in out["status"]
    assert [name for _, name in out["drafter"].choices] == list(rt.drafters)     # the loaded model's, still
    outs = run(ex, model=ONE_B)
    assert len(outs) == 1 and "The GDN-1.3B shape cannot run here: it needs a CUDA GPU" in outs[0][0]
    assert ex.models.get(ONE_B).runtime is None and "Traceback" not in caplog.text
    assert run(ex, max_new_tokens=4)[-1][0].startswith(DONE)


def test_too_little_free_gpu_memory_is_named_with_both_numbers(rt, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2.5 * 2**30, 80 * 2**30))
    out = switch(Explorer(rt), ONE_B, runner.ORACLE)
    assert out["model"].value == LOADED
    assert "needs about 6 GiB of free GPU memory; 2.5 GiB are free" in out["status"]


def test_the_1p3b_choice_offers_the_oracle_runs_and_switches_back(rt, gpu_like, tmp_path):
    built, _ = gpu_like
    ex = Explorer(rt)
    out = switch(ex, ONE_B, next(iter(rt.drafters)))
    assert out["status"] == gr.skip() and out["model"].value == ONE_B
    assert out["drafter"].choices == [(runner.RANDOM_1P3B_LABELS[runner.ORACLE], runner.ORACLE)]
    assert out["drafter"].value == runner.ORACLE and out["oracle_alpha"].visible is True
    assert runner.RANDOM_1P3B_NAME in out["model_line"] and "Random weights" in out["model_line"]
    assert not built, "selecting it builds nothing: the first run does"
    outs = run(ex, oracle_alpha=0.7, max_new_tokens=12, model=ONE_B)
    assert any(str(o[0]).startswith("Building the GDN-1.3B shape") for o in outs)
    assert outs[-1][0].startswith(DONE) and "oracle (simulated acceptance α)" in outs[-1][0]
    trace = last_trace(outs)
    assert trace["model"]["name"] == runner.RANDOM_1P3B_NAME and trace["model"]["fingerprint"] == built[0].fingerprint
    assert "Model: GDN-1.3B public shape, random bf16 weights" in outs[-1][8]
    assert "α = 0.70 (a simulated acceptance rate)" in outs[-1][8]
    assert run(ex, max_new_tokens=4, model=ONE_B)[-1][0].startswith(DONE) and len(built) == 1, "built once, kept"
    # Step on it too: same model, same settings -> the next click reveals, it does not decode again
    values = control_values(rt, drafter=runner.ORACLE, max_new_tokens=6, model=ONE_B)
    first = drain(ex.on_step("def f():\n", None, None, *values))[-1]
    again = drain(ex.on_step("def f():\n", first[9], first[10], *values))[-1]
    assert "Step 1 revealed" in again[0] and again[9]["model"]["fingerprint"] == built[0].fingerprint
    # a replay of its trace selects it again, with its drafters
    replay = drain(Explorer(rt, models=ex.models).on_upload(str(runner.export_trace(trace, folder=tmp_path))))[-1]
    shown = dict(zip(CONTROLS, replay[N_VIEWS + 1:]))
    assert shown["model"] == ONE_B and [n for _, n in shown["drafter"].choices] == [runner.ORACLE]
    assert "again with the GDN-1.3B shape" in replay[0] and "except" not in replay[0]
    # back to the loaded model: its drafters again, and its runs
    back = switch(ex, LOADED, runner.ORACLE)
    assert [name for _, name in back["drafter"].choices] == list(rt.drafters) and back["model"].value == LOADED
    assert rt.model_name in back["model_line"]
    outs = run(ex, max_new_tokens=4)
    assert outs[-1][0].startswith(DONE) and last_trace(outs)["model"]["name"] == rt.model_name


def test_a_1p3b_trace_replayed_where_it_cannot_run_restores_the_loaded_model(rt, gpu_like, monkeypatch, tmp_path):
    ex = Explorer(rt)
    trace = last_trace(run(ex, max_new_tokens=4, model=ONE_B))
    monkeypatch.setattr(runner, "gpu_shortfall", lambda gib: "needs a CUDA GPU")
    fresh = Explorer(rt)                                   # another server: nothing built there
    out = drain(fresh.on_upload(str(runner.export_trace(trace, folder=tmp_path))))[-1]
    shown = dict(zip(CONTROLS, out[N_VIEWS + 1:]))
    assert shown["model"] == LOADED and "its model, the GDN-1.3B shape, needs a CUDA GPU here" in out[0]
    assert "not the loaded model" in out[0] and out[9]["model"]["name"] == trace["model"]["name"]


def test_two_sessions_asking_at_once_build_the_1p3b_once(rt, gpu_like, monkeypatch):
    import threading
    built, _ = gpu_like
    gate = threading.Event()

    def slow():
        gate.wait(5)
        built.append(fake_1p3b())
        return built[-1]
    monkeypatch.setattr(runner, "random_1p3b_runtime", slow)
    models = Explorer(rt).models
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.runtime(ONE_B))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(10)
    assert len(built) == 1 and len(got) == 4 and all(r is built[0] for r in got)


def test_running_out_of_gpu_memory_while_building_is_a_message(rt, gpu_like, monkeypatch, caplog):
    import weakref
    _, flushes = gpu_like
    held = []

    def half_built():
        weights = torch.zeros(1024)             # what a real build holds when the allocator gives up
        held.append(weakref.ref(weights))
        raise torch.cuda.OutOfMemoryError(OOM)
    monkeypatch.setattr(runner, "random_1p3b_runtime", half_built)
    ex = Explorer(rt)
    outs = run(ex, model=ONE_B)
    status = outs[-1][0]
    assert status.startswith(ERROR) and "The GDN-1.3B shape ran out of GPU memory: " + OOM in status
    assert "the loaded model" in status and "still works" in status and "internal error" not in status
    assert ex.models.get(ONE_B).runtime is None and flushes, "nothing half-built is kept; the cache is emptied"
    assert held[0]() is None, "the half-built weights are freed"
    assert "Traceback" not in caplog.text
    assert run(ex, max_new_tokens=4)[-1][0].startswith(DONE), "the loaded model still runs"


def test_running_out_of_gpu_memory_mid_decode_is_a_message(rt, gpu_like, caplog):
    built, flushes = gpu_like
    ex = Explorer(rt)
    fake = ex.models.runtime(ONE_B)
    decode = fake.engine.speculate

    def failing(tokens, drafter, settings, *args):
        for i, record in enumerate(decode(tokens, drafter, settings, *args)):
            if settings.max_new_tokens > 4 and i == 2:     # the streamed decode, not the warm-up
                raise torch.cuda.OutOfMemoryError(OOM)
            yield record
    fake.engine.speculate = failing
    outs = run(ex, oracle_alpha=0.0, max_new_tokens=16, model=ONE_B)
    status = outs[-1][0]
    assert status.startswith(ERROR) and "The GDN-1.3B shape ran out of GPU memory: " + OOM in status
    assert "internal error" not in status and "Traceback" not in caplog.text
    partial = last_trace(outs)
    assert 1 <= len(partial["steps"]) <= 2
    validate_trace(partial)                                    # what the session keeps stays exportable
    assert ex.models.get(ONE_B).runtime is None and flushes, "the runtime is dropped and its memory freed"
    assert run(ex, max_new_tokens=4)[-1][0].startswith(DONE), "the loaded model still runs"
    assert run(ex, max_new_tokens=4, model=ONE_B)[-1][0].startswith(DONE) and len(built) == 2, "built again"


def test_an_unknown_model_is_a_message(ex):
    outs = run(ex, model="gpt-5")
    assert len(outs) == 1 and "unknown model 'gpt-5'; this page has: loaded, gdn-1.3b-random" in outs[0][0]


def test_the_engine_line_names_how_chains_were_verified():
    """A graphed run's trace says which verification path ran (the persistent chain launch or
    the per-op one), and the engine line shows it beside the op set."""
    trace = {"engine": {"backend": "graphed", "ops": "fused projections", "dtype": "bfloat16", "drafting": "device",
                        "acceptance": "device", "graphs": 4, "capture_ms": 1200.0,
                        "verification": "a chain's verification as one persistent launch (132 programs)"}}
    line = Explorer.engine_md(trace)
    assert "fused projections; a chain&#x27;s verification as one persistent launch (132 programs)" in line
    del trace["engine"]["verification"]
    assert "persistent" not in Explorer.engine_md(trace)
    trace["engine"]["drafting_kernel"] = "one persistent launch"
    assert "drafting on the device (one persistent launch)" in Explorer.engine_md(trace)
    trace["engine"]["drafting"] = "host"          # a host drafter's note is not the device kernel's
    assert "persistent" not in Explorer.engine_md(trace)
