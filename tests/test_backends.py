"""The engine's two backends give the same decode: eager (the reference) and CUDA graphs.

For every drafter x tree shape x deferred commit, both backends give the same tokens, the
same accepted lengths, the same draft trees and the same target choices, step by step, in
fp32 (on the CPU the graphed bodies run eagerly, `use_graph=False`; the `gpu` cases capture
them). The trained embedded pair is used where its assets exist, so drafts are accepted.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specla.decode import DecodeSettings, replay_state
from specla.drafters.base import DraftSettings
from specla.engine import Engine, Plan
from specla.trace import step_to_dict

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: graphs are captured only there")
SHAPES = {"chain": DraftSettings(tree="chain", top_k=4, budget=7, block_size=8, depth=6),
          "best-first": DraftSettings(tree="best-first", top_k=4, budget=10, block_size=8, depth=6),
          "beam": DraftSettings(tree="beam", top_k=3, budget=9, block_size=8, depth=4)}
CASES = [(kind, shape, deferred) for kind in ("block", "lilicorr", "eagle")
         for shape in ("chain", "best-first") for deferred in (True, False)]
CASES += [("block", "beam", True), ("lilicorr", "beam", True)]


def embedded(device: str):
    """(target fp32, drafters, two held-out-style prompts) or a skip."""
    if not (ROOT / "assets" / "target" / "config.json").exists():
        pytest.skip("the embedded model is absent")
    from specla.checkpoint import load_model
    from specla.drafters import load_drafter

    target, tokenizer, _ = load_model(ROOT / "assets" / "target", device=device, dtype=torch.float32)
    drafters = {kind: load_drafter(ROOT / "assets" / "drafters" / kind, target) for kind in ("block", "lilicorr", "eagle")}
    lines = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()[:2]
    prompts = [tokenizer.encode(json.loads(line)["prompt"], add_special_tokens=False) for line in lines]
    return target, drafters, prompts


@pytest.fixture(scope="module")
def cpu_pair():
    torch.set_num_threads(2)
    return embedded("cpu")


def compare(eager: Engine, graphed: Engine, prompt, drafter, settings, ds, near_tie: float = 0.0):
    """Both backends' records, step by step; fp32 on one device must agree exactly."""
    a = list(eager.speculate(prompt, drafter, settings, ds))
    b = list(graphed.speculate(prompt, drafter, settings, ds))
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.tree.tokens == y.tree.tokens and x.tree.parents == y.tree.parents, f"step {i}: trees differ"
        assert x.acceptance.path == y.acceptance.path and x.acceptance.bonus == y.acceptance.bonus, f"step {i}"
        assert x.new_tokens == y.new_tokens
        path_choice = [x.acceptance.target_choice[n] for n in x.acceptance.path]
        assert path_choice == [y.acceptance.target_choice[n] for n in y.acceptance.path]
        assert max(abs(p - q) for p, q in zip(x.target_probs, y.target_probs)) < 1e-3
        assert max(abs(p - q) for p, q in zip(x.draft_probs, y.draft_probs)) < 1e-3
        assert set(step_to_dict(x)) == set(step_to_dict(y)), "both backends fill the same trace fields"
        assert y.backend == "graphed" and y.elapsed_ms > 0
    assert len(a) == len(b)
    return a, b


@pytest.mark.parametrize("kind,shape,deferred", CASES)
def test_graphed_backend_equals_eager_fp32(cpu_pair, kind, shape, deferred):
    target, drafters, prompts = cpu_pair
    eager, graphed = Engine(target, "eager"), Engine(target, "graphed", use_graph=False)
    settings = DecodeSettings(max_new_tokens=24, deferred=deferred)
    accepted = 0
    for prompt in prompts[:1 if deferred is False else 2]:
        a, _ = compare(eager, graphed, prompt, drafters[kind], settings, SHAPES[shape])
        accepted += sum(len(r.acceptance.tokens) for r in a)
    assert accepted > 0, "no draft accepted: the comparison would only cover rejections"
    plan = graphed.plan(drafters[kind], settings, SHAPES[shape])
    assert plan.drafting == "device", plan
    # the last decode's verification path, as the app shows it: per-op launches on a CPU
    assert graphed.verification_note().startswith("per-op "), graphed.verification_note()
    # and its drafting path: the persistent draft needs CUDA
    if kind in ("block", "lilicorr"):
        assert "it needs a CUDA device" in graphed.drafting_note(), graphed.drafting_note()


def test_graphed_state_equals_a_replay(cpu_pair):
    """After a device-drafted tree decode, the state (pending commit folded) equals feeding the
    same tokens one at a time."""
    target, drafters, prompts = cpu_pair
    graphed = Engine(target, "graphed", use_graph=False)
    settings = DecodeSettings(max_new_tokens=20)
    records = list(graphed.speculate(prompts[0], drafters["lilicorr"], settings, SHAPES["best-first"]))
    yielded = [t for r in records for t in r.acceptance.tokens + [r.acceptance.bonus]]
    dec = graphed.decoder(drafters["lilicorr"], settings, SHAPES["best-first"])
    made = dec.state.output()         # the steps a batch ran past the decode's end included
    assert made[:len(yielded)] == yielded
    state = dec.state_after()
    want = replay_state(target, prompts[0] + made[:-1])
    assert torch.allclose(state.recurrent, want.recurrent, rtol=1e-4, atol=1e-5)
    assert torch.allclose(state.conv[..., 1:], want.conv, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.gpu])])
def test_readback_returns_the_rows_queued_and_no_later_write(device):
    """A batch's rows are copied behind the work queued before them: a write queued after the
    copy does not show in what `take` returns (on CUDA, without waiting for that write)."""
    from specla.graphs.readback import Readback

    buf = torch.arange(40, device=device).view(10, 4)
    rb = Readback({"x": buf}, rows=4)
    rb.enqueue(2, 3)
    buf.add_(100)
    assert rb.take() == {"x": [list(range(8, 12)), list(range(12, 16)), list(range(16, 20))]}
    # the decoder's order: take a batch, queue the next, then read the taken batch's rows
    rb.enqueue(0, 1)
    buf.add_(100)
    first = rb.take()
    rb.enqueue(0, 2)                  # into the other mirrors: the first batch's are untouched
    assert first["x"] == [[100, 101, 102, 103]]
    rb.enqueue(1, 1)                  # two copies in flight
    with pytest.raises(RuntimeError, match="not taken"):
        rb.enqueue(1, 1)
    second = rb.take()
    rb.enqueue(5, 1)                  # reuses the second batch's mirrors before its rows were read
    with pytest.raises(RuntimeError, match="reused"):
        second["x"]
    assert rb.take()["x"] == [[204, 205, 206, 207]] and rb.take()["x"] == [[220, 221, 222, 223]]
    rb.discard()
    with pytest.raises(RuntimeError, match="no rows"):
        rb.take()
    with pytest.raises(ValueError, match="exceed"):
        rb.enqueue(0, 5)


def test_plan_says_where_a_step_runs(cpu_pair):
    target, drafters, _ = cpu_pair
    graphed = Engine(target, "graphed", use_graph=False)
    greedy, sampled = DecodeSettings(), DecodeSettings(temperature=0.7)
    assert graphed.plan(drafters["block"], greedy, SHAPES["best-first"]).drafting == "device"
    assert graphed.plan(drafters["block"], sampled, SHAPES["chain"]) == Plan("graphed", "device", "device")
    assert graphed.plan(drafters["eagle"], greedy, SHAPES["best-first"]).drafting == "device"
    from specla.runner import PresetShape
    # a preset of the block drafter's candidates drafts on the device; over candidates that
    # depend on the path (LiLiCorr) on the host
    preset = [[0], [1], [0, 0]]
    assert graphed.plan(PresetShape(drafters["block"], preset), greedy, SHAPES["chain"]).drafting == "device"
    plan = graphed.plan(PresetShape(drafters["lilicorr"], preset), greedy, SHAPES["chain"])
    assert plan.drafting == "host" and "preset" in plan.note
    plan = graphed.plan(PresetShape(drafters["lilicorr"], preset), sampled, SHAPES["chain"])
    assert (plan.drafting, plan.acceptance) == ("host", "host")
    assert Engine(target, "eager").plan(drafters["block"], greedy, SHAPES["chain"]).backend == "eager"
    with pytest.raises(ValueError, match="backend"):
        Engine(target, "fast")


def test_measured_preset_graphed_equals_eager(cpu_pair):
    """The block drafter's measured preset (drafter.json): drafted on the device by the graphed
    backend, every step's tree, path and bonus equal the eager loop's host drafter."""
    from specla.runner import PresetShape, measured_preset

    target, drafters, prompts = cpu_pair
    eager, graphed = Engine(target, "eager"), Engine(target, "graphed", use_graph=False)
    preset = PresetShape(drafters["block"], measured_preset(drafters["block"], "block"))
    settings = DecodeSettings(max_new_tokens=24)
    assert graphed.plan(preset, settings, SHAPES["chain"]).drafting == "device"
    records, _ = compare(eager, graphed, prompts[1], preset, settings, SHAPES["chain"])
    assert all(len(r.tree) == len(preset.paths) + 1 for r in records)


def test_host_sampling_equals_eager_sampling(cpu_pair):
    """A host drafter on the graphed backend (a tree preset: verify graphed, rejection sampling
    on the host) draws the same tokens as the eager loop from the same seed."""
    from specla.runner import PresetShape

    target, drafters, prompts = cpu_pair
    eager, graphed = Engine(target, "eager"), Engine(target, "graphed", use_graph=False)
    preset = [[0], [1], [0, 0], [0, 0, 0]]
    settings = DecodeSettings(max_new_tokens=20, temperature=0.8, seed=3)
    runs = [[t for r in engine.speculate(prompts[0], PresetShape(drafters["lilicorr"], preset), settings, SHAPES["chain"])
             for t in r.new_tokens] for engine in (eager, graphed)]
    assert runs[0] == runs[1]


SAMPLING_CASES = [("block", "chain"), ("block", "best-first"), ("block", "preset"), ("eagle", "chain")]


def device_sampling_chi2(kind: str, shape: str, device: str) -> tuple[float, float]:
    """Two sampled tokens after a prompt, 1500 times, drawn by a device drafter and accepted on
    the device: their joint distribution against the target's exact one (chi-square)."""
    from specla.drafters import new_drafter
    from tests.helpers import random_target
    from tests.test_engine import chi2_critical, exact_two_token_distribution

    target = random_target(vocab=6, hidden=32, heads=2, head_dim=8, std=0.6, seed=5)
    prompt, n = [1, 2, 3], 1500
    expected = exact_two_token_distribution(target, prompt, 1.0)
    target = target.to(device)            # before the drafter: it borrows the target's embedding
    torch.manual_seed(0)
    if kind == "block":
        drafter = new_drafter(kind, target, top_k=2, feature_layers=(0, 1), block_size=4, width=16, heads=2,
                              mlp_hidden=32, window=8)
    else:
        drafter = new_drafter(kind, target, top_k=2, heads=2, mlp_hidden=32, window=8)
    # head_dim 8 is below what the Triton verify kernels take: the torch recurrence on the GPU
    engine = Engine(target, "graphed", use_graph=None if device == "cuda" else False,
                    recurrence="torch" if device == "cuda" else "kernels")
    if shape == "preset":           # a fixed tree of the block drafter's candidates, drafted on the device
        from specla.runner import PresetShape
        drafter, shape = PresetShape(drafter, [[0], [1], [0, 0], [0, 1], [0, 0, 0]]), "chain"
    ds = DraftSettings(tree=shape, top_k=2, budget=3, block_size=4, depth=3)
    counts = torch.zeros_like(expected)
    for seed in range(n):
        settings = DecodeSettings(max_new_tokens=2, temperature=1.0, seed=seed)
        assert engine.plan(drafter, settings, ds).acceptance == "device"
        tokens = [t for r in engine.speculate(prompt, drafter, settings, ds) for t in r.new_tokens]
        counts[tokens[0] * 6 + tokens[1]] += 1
    keep = expected * n >= 5           # pool the rare cells, as the chi-square test requires
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep] * n, (expected[~keep].sum() * n).view(1)])
    return float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum()), chi2_critical(int(keep.sum()))


@pytest.mark.parametrize("kind,shape", SAMPLING_CASES)
def test_device_sampling_follows_the_target_distribution(kind, shape):
    chi2, critical = device_sampling_chi2(kind, shape, "cpu")
    assert chi2 < critical, f"chi2={chi2:.1f} >= {critical:.1f}"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind,shape,deferred", CASES)
def test_graphed_backend_equals_eager_fp32_cuda(kind, shape, deferred):
    """Captured graphs on the GPU against the eager loop on the same GPU, fp32: the same steps
    (fused kernels round differently; a flip is allowed only at an fp32 near-tie)."""
    target, drafters, prompts = embedded("cuda")
    # uncompiled drafts here (each torch.compile takes tens of seconds); test_device_drafter
    # checks the compiled ones against these
    eager, graphed = Engine(target, "eager"), Engine(target, "graphed", compile_drafter=False)
    settings = DecodeSettings(max_new_tokens=48, deferred=deferred)
    for prompt in prompts:
        try:
            compare(eager, graphed, prompt, drafters[kind], settings, SHAPES[shape])
        except AssertionError:
            ar = eager.ar(prompt, settings).tokens
            out = [t for r in graphed.speculate(prompt, drafters[kind], settings, SHAPES[shape]) for t in r.new_tokens]
            i = next((j for j, (x, y) in enumerate(zip(ar, out)) if x != y), None)
            assert i is not None, "records differ although the outputs agree"
            d = graphed.divergence(prompt, out, i, ar[i])
            assert d["top2_gap"] < 1e-3, f"graphed output left AR beyond an fp32 near-tie: {d}"


def test_graphed_oracle_equals_ar_and_accepts():
    """The oracle drafter on the graphed backend runs on the device (calibrated, then replayed
    step by step): its output is AR's, and it accepts at the asked rate."""
    from specla.drafters.oracle import OracleDrafter
    from tests.helpers import random_target

    target = random_target(vocab=128)
    prompt = [5, 9, 13, 4, 2, 77]
    graphed, eager = Engine(target, "graphed", use_graph=False), Engine(target, "eager")
    settings = DecodeSettings(max_new_tokens=40)
    ar = eager.ar(prompt, settings).tokens
    for shape, ds in (("chain", DraftSettings(budget=6)), ("tree", DraftSettings(budget=9, top_k=3))):
        records = list(graphed.speculate(prompt, OracleDrafter(ar, 128, alpha=0.8, shape=shape), settings, ds))
        assert [t for r in records for t in r.new_tokens] == ar, shape
        assert sum(len(r.acceptance.tokens) for r in records) >= len(records), "alpha 0.8 accepts about 2+ a step"
        assert all(set(r.times_ms) == {"draft", "verify", "accept"} for r in records)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind,shape", SAMPLING_CASES)
def test_device_sampling_follows_the_target_distribution_cuda(kind, shape):
    """The same chi-square test with the drafts and the rejection sampling captured in CUDA
    graphs (torch's CUDA generator inside the graphs)."""
    chi2, critical = device_sampling_chi2(kind, shape, "cuda")
    assert chi2 < critical, f"chi2={chi2:.1f} >= {critical:.1f}"


def test_a_device_drafter_that_fails_falls_back_to_host_drafting(cpu_pair, monkeypatch):
    """A device drafter that does not build or capture: the decode still runs, drafting on the
    host, and the plan says why."""
    import specla.graphs.drafters as device_drafters

    target, drafters, prompts = cpu_pair

    def broken(*args, **kwargs):
        if kwargs.get("check_only"):
            return None, None
        raise RuntimeError("no capture today")

    monkeypatch.setattr(device_drafters, "device_drafter_for", broken)
    graphed, eager = Engine(target, "graphed", use_graph=False), Engine(target, "eager")
    settings = DecodeSettings(max_new_tokens=16)
    assert graphed.plan(drafters["block"], settings, SHAPES["chain"]).drafting == "device"
    out = [t for r in graphed.speculate(prompts[0], drafters["block"], settings, SHAPES["chain"]) for t in r.new_tokens]
    assert out == eager.ar(prompts[0], settings).tokens
    plan = graphed.plan(drafters["block"], settings, SHAPES["chain"])
    assert plan.drafting == "host" and "no capture today" in plan.note


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="torch.compile on the CPU needs a C++ compiler"))])
@pytest.mark.parametrize("shape", ["chain", "best-first", "beam"])
def test_device_ngram_drafter_equals_the_host_one(shape, compiled):
    """The model-free drafter inside the step graphs (its tensor core over a device history;
    torch.compile'd as on the GPU, or not) takes the steps the host drafter takes: same trees,
    same accepted paths, output = AR's. A target that repeats itself, so continuations are
    found and accepted."""
    from specla.drafters import model_free_drafter
    from tests.helpers import random_target

    target = random_target(vocab=8, seed=3)           # a small vocabulary: it falls into loops
    drafter = model_free_drafter("ngram", target)
    graphed = Engine(target, "graphed", use_graph=False, compile_drafter=compiled)
    eager = Engine(target, "eager")
    settings = DecodeSettings(max_new_tokens=48)
    ds = DraftSettings(tree=shape, top_k=3, budget=8, depth=5)
    assert graphed.plan(drafter, settings, ds).drafting == "device"
    a, b = compare(eager, graphed, [1, 2, 3, 1, 2, 3, 1], drafter, settings, ds)
    assert [t for r in b for t in r.new_tokens] == eager.ar([1, 2, 3, 1, 2, 3, 1], settings).tokens
    assert sum(len(r.acceptance.tokens) for r in b) > 0, "the loop should be drafted and accepted"


def test_copies_of_a_model_free_drafter_share_one_captured_decoder():
    """The app decodes with a copy of the n-gram drafter per run: a copy with the same settings
    reuses the decoder captured for the first (no capture per run), other settings do not."""
    import copy

    from specla.drafters import model_free_drafter
    from tests.helpers import random_target

    target = random_target(vocab=8, seed=3)
    drafter = model_free_drafter("ngram", target)
    graphed = Engine(target, "graphed", use_graph=False)
    settings, ds = DecodeSettings(max_new_tokens=12), DraftSettings(tree="chain", budget=4, depth=4)
    runs = [list(graphed.speculate([1, 2, 3, 1, 2], copy.copy(drafter), settings, ds)) for _ in range(2)]
    assert [r.new_tokens for r in runs[0]] == [r.new_tokens for r in runs[1]]
    assert len(graphed._decoders) == 1
    other = model_free_drafter("ngram", target)
    other.max_ngram = drafter.max_ngram - 1
    list(graphed.speculate([1, 2, 3, 1, 2], other, settings, ds))
    assert len(graphed._decoders) == 2


def test_a_compiled_acceptance_that_fails_captures_uncompiled(cpu_pair):
    """torch.compile failing on the acceptance (a compiler bug, a missing toolchain): the phase
    is captured with the plain ops instead, and the spec says why."""
    from specla.graphs.runtime import PackedTarget
    from specla.graphs.spec import GraphedSpec, SpecState
    from specla.tree import DraftTree

    target = cpu_pair[0]
    rt = PackedTarget(target)
    tree = DraftTree.chain([0, 1, 2])
    spec = GraphedSpec(rt, SpecState(rt, max_path=3, capacity=8), tree, use_graph=False, compile=True)
    assert spec.compiled
    bodies = []

    def capture_once(phase):
        bodies.append(spec._accept)
        if len(bodies) == 1:
            raise RuntimeError("inductor: no compiler today")

    spec._capture_once = capture_once
    spec._capture("accept")
    assert not spec.compiled and "no compiler today" in spec.compile_error
    assert bodies[0] is not spec.accept and bodies[1] == spec.accept
    with pytest.raises(RuntimeError, match="verify failed"):   # other phases' failures propagate
        spec._capture_once = lambda phase: (_ for _ in ()).throw(RuntimeError("verify failed"))
        spec._capture("verify")
