"""The CUDA-graph runtime equals the eager references.

`GraphedAR` (one token per graph replay) gives the eager decode's greedy tokens; `GraphedSpec`
with the device oracle drafter (chain and tree, deferred commit on and off) gives AR's
tokens, and its state after decoding equals a token-by-token replay. On CUDA the graphs are
captured and replayed (the `cuda` cases, skipped without a GPU); the same bodies run eagerly
on the CPU (`use_graph=False`), so the logic is checked on every machine.

fp32 comparisons are strict. bf16 ones excuse a divergence only at a near-tie: where the
target's logit gap between its pick and AR's is within the logit difference measured between
the speculative forward and the AR step (x2 since both logits move, x1.5 margin because it is
measured at other positions); a real bug moves logits by far more.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from specla.accept import accept_greedy
from specla.config import PUBLIC_1P3B, GDNConfig
from specla.decode import DecodeSettings, ar_generate
from specla.drafters.base import Draft, DraftSettings
from specla.tree import DraftTree
from specla.bench.measure import FlaAR, build_fla_model
from specla.graphs.ar import GraphedAR
from specla.graphs.buckets import comb_tree
from specla.graphs.decoders import GraphedDecoder
from specla.graphs.ops import FlaOps, FusedOps, auto_ops_name, check_ops
from specla.graphs.oracle import DeviceOracle, oracle_calibrate, oracle_timed
from specla.graphs.runtime import PackedTarget
from specla.graphs.spec import (GraphedSpec, SpecState, SpecTopology, greedy_accept, spec_vs_ar_noise,
                                torch_tree_verify)
from specla.model import random_gdn

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: graphs are captured only there")
DEVICES = ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.gpu])]

# K = V = 64: powers of two, as the Triton verify kernels require.
SMALL = GDNConfig(vocab_size=512, hidden_size=128, num_hidden_layers=3, num_heads=2, head_dim=64,
                  expand_v=1.0)
SHAPES = {"chain": DraftTree.chain([0] * 7), "tree": comb_tree(3, 9)}


def setup(device, dtype, config=SMALL, prompt_len=40, seed=0, ops="auto"):
    target = random_gdn(config, device, dtype, seed=seed)
    rt = PackedTarget(target, ops)
    rng = random.Random(seed)
    prompt = [rng.randrange(config.vocab_size) for _ in range(prompt_len)]
    ar = GraphedAR(rt, max_len=320)
    ar.prefill(prompt)
    return target, rt, ar, ar.state.clone(), prompt


def ar_tokens(ar, snap, root, n):
    ar.reset(snap, root)
    return ar.decode(n)


def oracle_spec(rt, tree, cont, alpha, deferred=True, n=48, **options):
    P = tree.depth + 1
    state = SpecState(rt, max_path=P, capacity=n + 2 * P + 8, max_nodes=len(tree))
    oracle = DeviceOracle(cont, rt.config.vocab_size, alpha, max_steps=n + 2 * P + 9,
                             max_nodes=len(tree), capacity=n + 4 * P + 16, device=rt.device, seed=3)
    return GraphedSpec(rt, state, tree, deferred=deferred, oracle=oracle, **options)


def first_mismatch(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# --------------------------------------------------------------------------- AR

@pytest.mark.parametrize("device", DEVICES)
def test_graphed_ar_equals_eager_decode(device):
    target, rt, ar, snap, prompt = setup(device, torch.float32)
    n = 48
    got = ar.generate(prompt, n)                 # prefill + n replays, one read at the end
    cpu_target = target if device == "cpu" else copy.deepcopy(target).cpu()
    ref = ar_generate(cpu_target, prompt, DecodeSettings(max_new_tokens=n))
    i = first_mismatch(got, ref.tokens)
    if i is not None:   # only an fp32 near-tie may differ (fused kernels vs plain torch)
        from specla.acceptance import top2_gaps
        gap = top2_gaps(cpu_target, prompt, ref.tokens[:i + 1])[i]
        assert gap < 1e-4, f"graphed AR leaves the eager decode at token {i} (top-2 gap {gap:.2e})"
        return
    assert torch.allclose(ar.state.recurrent.cpu(), ref.state.recurrent, rtol=1e-4, atol=1e-5)
    assert torch.allclose(ar.state.conv[..., 1:].cpu(), ref.state.conv, rtol=1e-4, atol=1e-5)


class _StubWholeStep:
    """Stands in for the persistent AR step: writes token 7 greedily; `failed` as told."""

    def __init__(self, gave_up: bool):
        self.gave_up = gave_up

    def __call__(self, token, conv, recurrent, logits, greedy):
        next_token, out, count = greedy
        next_token.fill_(7)
        out[count] = 7
        count.add_(1)

    def failed(self) -> bool:
        return self.gave_up


@pytest.mark.parametrize("gave_up", [False, True])
def test_graphed_ar_refuses_tokens_of_a_step_whose_barrier_gave_up(gave_up):
    rt = PackedTarget(random_gdn(SMALL, "cpu", torch.float32, seed=0), "torch")
    rt.whole_step = _StubWholeStep(gave_up)
    ar = GraphedAR(rt, max_len=16, use_graph=False)
    if gave_up:
        with pytest.raises(RuntimeError, match="grid barrier"):
            ar.decode(4)
        with pytest.raises(RuntimeError, match="grid barrier"):
            ar.timed_generate(ar.state.clone(), 1, 4)
    else:
        assert ar.decode(4) == [7] * 4
        assert ar.timed_generate(ar.state.clone(), 1, 3)[0] == [7] * 3


# --------------------------------------------------------------------------- speculation

@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "immediate"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("device", DEVICES)
def test_graphed_spec_equals_ar_fp32(device, shape, deferred):
    _, rt, ar, snap, prompt = setup(device, torch.float32)
    root, n, tree = prompt[-1], 48, SHAPES[shape]
    cont = ar_tokens(ar, snap, root, n + 4 * (tree.depth + 1))
    spec = oracle_spec(rt, tree, cont, alpha=0.7, deferred=deferred, n=n)
    run = oracle_calibrate(spec, ar, snap, root, n)
    assert not run.divergences, f"fp32: the target left AR's tokens: {run.divergences}"
    assert run.tokens[:n] == cont[:n]
    assert run.steps < n, "the oracle at alpha 0.7 should accept something"
    # graph replays are deterministic: the timed run reproduces the trajectory
    timed = oracle_timed(spec, snap, root, n, run.steps)
    assert timed.tokens == run.tokens and timed.steps == run.steps
    # the state after decoding equals a token-by-token replay of the same tokens
    spec.state.flush()
    ar.logits_along(snap, root, run.tokens[:-1])
    assert torch.allclose(spec.state.cache.recurrent, ar.state.recurrent, rtol=1e-4, atol=1e-5)
    assert torch.allclose(spec.state.cache.conv[..., 1:], ar.state.conv[..., 1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_oracle_realignment_keeps_the_trajectory(device):
    """Where the target leaves the oracle's continuation (bf16 near-ties on a GPU; injected
    here), calibration redoes the step with the target's own token: the accepted lengths are
    those of a clean continuation, so tau carries no artefact of the realignment."""
    _, rt, ar, snap, prompt = setup(device, torch.float32)
    root, n, tree = prompt[-1], 48, SHAPES["chain"]
    clean = ar_tokens(ar, snap, root, n + 32)
    corrupt = [(t + 5) % SMALL.vocab_size if i in (9, 30, 31) else t for i, t in enumerate(clean)]
    runs = {}
    for name, cont in (("clean", clean), ("corrupt", corrupt)):
        spec = oracle_spec(rt, tree, cont, alpha=0.9, n=n)
        runs[name] = oracle_calibrate(spec, ar, snap, root, n)
        assert oracle_timed(spec, snap, root, n, runs[name].steps).tokens == runs[name].tokens
    assert [d["position"] for d in runs["corrupt"].divergences] == [9]
    assert runs["corrupt"].tokens == runs["clean"].tokens and runs["clean"].tokens[:n] == clean[:n]
    assert runs["corrupt"].accepted == runs["clean"].accepted


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_graphed_spec_bf16_diverges_only_at_near_ties(shape):
    _, rt, ar, snap, prompt = setup("cuda", torch.bfloat16)
    root, n, tree = prompt[-1], 64, SHAPES[shape]
    cont = ar_tokens(ar, snap, root, n + 4 * (tree.depth + 1))
    noise = spec_vs_ar_noise(rt, ar, snap, root, cont)
    spec = oracle_spec(rt, tree, cont, alpha=0.8, n=n)
    run = oracle_calibrate(spec, ar, snap, root, n)
    for d in run.divergences:   # 2x bounds a flip if `noise` bounded every position; 3x: margin
        assert d["gap"] <= 3 * noise + 1e-6, f"divergence beyond bf16 noise {noise:.4f}: {d}"
    if not run.divergences:
        assert run.tokens[:n] == cont[:n]
    timed = oracle_timed(spec, snap, root, n, run.steps)
    assert timed.tokens == run.tokens


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_accept_matches_accept_greedy(device):
    rng = random.Random(0)
    for trial in range(40):
        n = rng.randrange(1, 14)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        if trial % 4 == 0:
            parents = list(range(-1, n - 1))
        tokens = [rng.randrange(6) for _ in range(n)]        # small vocab: duplicate siblings
        tree = DraftTree(tokens, parents)
        logits = torch.randn(n, 6, generator=torch.Generator().manual_seed(trial))
        for i in range(n):   # make matches likely: the argmax often is some child's token
            kids = tree.children[i]
            if kids and rng.random() < 0.8:
                logits[i, tokens[rng.choice(kids)]] += 10
        want = accept_greedy(tree, logits)
        topo = SpecTopology(tree, 4, tree.depth + 1, device)
        a, end, path, valid, bonus = greedy_accept(topo, torch.tensor(tokens, device=device),
                                                      logits.to(device))
        assert path[:int(a) + 1].tolist() == want.path, (parents, tokens)
        assert int(bonus) == want.bonus and int(valid.sum()) == len(want.path)


class ScriptedDrafter:
    """Random tree shapes (chains too) with the true continuation along one random branch."""
    name, feature_layers = "scripted", ()

    def __init__(self, truth: list[int], vocab: int, max_nodes: int = 12, seed: int = 0):
        self.truth, self.vocab, self.max_nodes = truth, vocab, max_nodes
        self.rng, self.pos = random.Random(seed), 0

    def reset(self, prompt, features, hidden):
        self.pos = 0

    def observe(self, accepted):
        self.pos += len(accepted.tokens)

    def propose(self, ctx):
        n = self.rng.randrange(1, self.max_nodes + 1)
        chain = self.rng.random() < 0.3
        parents = [-1] + [i - 1 if chain else self.rng.randrange(i) for i in range(1, n)]
        tree = DraftTree([0] * n, parents)
        leaf = self.rng.choice(tree.leaves())
        true_nodes = set(tree.path_to(leaf))
        tokens = [ctx.root_token]
        for i in range(1, n):
            d = tree.depths[i]
            t = self.truth[self.pos + d - 1] if self.pos + d - 1 < len(self.truth) else 0
            tokens.append(t if i in true_nodes and self.rng.random() < 0.85 else self.rng.randrange(self.vocab))
        return Draft(DraftTree(tokens, parents))


@pytest.mark.parametrize("device", DEVICES)
def test_host_drafter_with_padded_buckets_equals_ar(device):
    """Chains padded at their end and trees padded with dummies off the root, the topology
    rewritten in place between replays of one graph per bucket: output equals AR."""
    _, rt, ar, snap, prompt = setup(device, torch.float32)
    root, n = prompt[-1], 60
    cont = ar_tokens(ar, snap, root, n + 32)
    drafter = ScriptedDrafter(cont, SMALL.vocab_size)
    dec = GraphedDecoder(rt, drafter, DraftSettings(budget=12), capacity=n + 32)
    steps = list(dec.steps(prompt, n, prefilled=(snap, None, None)))
    tokens = [t for st in steps for t in [st.tree.tokens[i] for i in st.outcome.path[1:]] + [st.outcome.bonus]]
    assert tokens[:n] == cont[:n] and -1 not in tokens
    assert len(steps) < n
    # the step log matches the host's own view of each step: the tree it drafted, the target's
    # argmax at every node, and a probability for every node's token
    for st in steps:
        assert len(st.choice) == len(st.target_prob) == len(st.tree)
        assert all(0.0 <= p <= 1.0 for p in st.target_prob) and st.target_prob[0] == 1.0
        assert [st.tree.tokens[i] for i in st.outcome.path[1:]] == \
            [st.choice[st.tree.parents[i]] for i in st.outcome.path[1:]]
        assert st.outcome.bonus == st.choice[st.outcome.end]
    assert len(dec.specs) <= 5, f"expected <= 3 chain + 2 tree buckets, got {list(dec.specs)}"


def test_torch_tree_verify_matches_reference():
    from kernels.reference import commit_ref, tree_verify_ref

    g = torch.Generator().manual_seed(0)
    tree = DraftTree([0] * 9, [-1, 0, 1, 1, 0, 4, 2, 2, 6])
    B, N, H, K, V, P = 1, 9, 2, 16, 32, 3
    q = torch.nn.functional.normalize(torch.randn(B, N, H, K, generator=g), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, N, H, K, generator=g), dim=-1)
    v, beta = torch.randn(B, N, H, V, generator=g), torch.rand(B, N, H, generator=g)
    gate = -torch.rand(B, N, H, generator=g)
    S0 = torch.randn(B, H, K, V, generator=g)
    pk = torch.nn.functional.normalize(torch.randn(B, P, H, K, generator=g), dim=-1)
    pd, pg = torch.randn(B, P, H, V, generator=g), -torch.rand(B, P, H, generator=g)
    topo = SpecTopology(tree, 4, tree.depth + 1, "cpu")
    S = S0.clone()
    o, d = torch_tree_verify(q, k, v, gate, beta, S, topo, (pk, pd, pg))
    S_ref = commit_ref(S0, pk, pd, pg)
    o_ref, d_ref = tree_verify_ref(q, k, v, gate, beta, S_ref, topo.model_topo.parents)
    assert torch.allclose(S, S_ref, atol=1e-6)
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(d, d_ref, atol=1e-5)


# --------------------------------------------------------------------------- CUDA only

@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [SMALL, PUBLIC_1P3B], ids=["small", "1p3b"])
@pytest.mark.parametrize("ops", [FlaOps, FusedOps], ids=["fla", "fused"])
def test_fla_ops_match_torch_ops(ops, config, dtype):
    failures = check_ops(ops(), config, "cuda", dtype)
    assert not failures, failures


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_graphed_spec_with_fused_projections_equals_its_ar_fp32(shape):
    """ops="fused": the speculative step and the AR step both run the fused projections,
    so in fp32 speculation still reproduces AR token for token, and the state a replay."""
    _, rt, ar, snap, prompt = setup("cuda", torch.float32, ops="fused")
    assert rt.ops.name == "fused"
    root, n, tree = prompt[-1], 48, SHAPES[shape]
    cont = ar_tokens(ar, snap, root, n + 4 * (tree.depth + 1))
    spec = oracle_spec(rt, tree, cont, alpha=0.7, n=n)
    # a chain or a tree of up to 16 nodes is verified in one persistent launch
    # (kernels/triton_verify_step.py) where the AR token is one, which the random target's width allows
    assert spec.chain_verify is not None and spec.kernel_accept, spec.verify_note
    run = oracle_calibrate(spec, ar, snap, root, n)
    assert not run.divergences and run.tokens[:n] == cont[:n]
    spec.state.flush()
    ar.logits_along(snap, root, run.tokens[:-1])
    assert torch.allclose(spec.state.cache.recurrent, ar.state.recurrent, rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_per_op_verification_equals_ar_fp32(shape):
    """The per-op verification forward (a large target's: no persistent launch) with the fused
    ops at a small width: in fp32 speculation reproduces AR token for token, and the state a
    replay."""
    _, rt, ar, snap, prompt = setup("cuda", torch.float32, ops="fused")
    root, n, tree = prompt[-1], 48, SHAPES[shape]
    cont = ar_tokens(ar, snap, root, n + 4 * (tree.depth + 1))
    spec = oracle_spec(rt, tree, cont, alpha=0.7, n=n, persistent_verify=False)
    assert spec.chain_verify is None and spec.mode in ("chain", "tree"), spec.verify_note
    run = oracle_calibrate(spec, ar, snap, root, n)
    assert not run.divergences and run.tokens[:n] == cont[:n]
    assert run.steps < n, "the oracle at alpha 0.7 should accept something"
    spec.state.flush()
    ar.logits_along(snap, root, run.tokens[:-1])
    assert torch.allclose(spec.state.cache.recurrent, ar.state.recurrent, rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.gpu
def test_fla_graph_equals_fla_eager_and_ours():
    pytest.importorskip("fla.models", reason="fla's models need fla + triton")
    target, rt, ar, snap, prompt = setup("cuda", torch.float32)
    n = 16
    fla = FlaAR(build_fla_model(target), max_len=n + 4)
    fla.prefill(prompt)
    eager, _ = fla.eager_generate(n)
    assert fla.capture() in ("model", "layer-ops")
    graph, _ = fla.graph_generate(n)
    assert graph == eager, f"fla in a graph differs from fla eager ({fla.mode})"
    ours = ar_tokens(ar, snap, prompt[-1], n)
    i = first_mismatch(ours, graph)
    if i is not None:
        rows = fla.full_logits(prompt + ours[:i])[len(prompt) - 1:]
        gap = float(rows[i].max() - rows[i, ours[i]])
        assert gap < 1e-4, f"ours leaves fla at token {i} by {gap:.2e} (fp32)"


@needs_cuda
@pytest.mark.gpu
def test_graphed_ar_samples_on_device():
    target = random_gdn(SMALL, "cuda", torch.bfloat16, seed=0)
    ar = GraphedAR(target, max_len=64, temperature=1.0)
    ar.reset(None, 5)
    tokens = ar.decode(32)
    assert all(0 <= t < SMALL.vocab_size for t in tokens) and len(set(tokens)) > 1


@needs_cuda
@pytest.mark.gpu
def test_public_1p3b_shape_short():
    """GDN-1.3B public shape, bf16: graphed AR, then graphed chain speculation equals it up to
    near-ties. Kept short (a 32-token prompt, 24 new tokens)."""
    _, rt, ar, snap, prompt = setup("cuda", torch.bfloat16, config=PUBLIC_1P3B, prompt_len=32)
    assert rt.ops.name == auto_ops_name(rt.config, "cuda"), rt.ops_note
    root, n, tree = prompt[-1], 24, DraftTree.chain([0] * 9)
    cont = ar_tokens(ar, snap, root, n + 40)
    noise = spec_vs_ar_noise(rt, ar, snap, root, cont)
    spec = oracle_spec(rt, tree, cont, alpha=0.8, n=n)
    run = oracle_calibrate(spec, ar, snap, root, n)
    for d in run.divergences:
        assert d["gap"] <= 3 * noise + 1e-6, f"divergence beyond bf16 noise {noise:.4f}: {d}"
    assert oracle_timed(spec, snap, root, n, run.steps).tokens == run.tokens
