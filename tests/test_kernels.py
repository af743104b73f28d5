"""The Triton kernels (kernels/triton_verify.py: verify, commit; kernels/triton_conv_gates.py:
the verify forward's conv + gates; kernels/triton_lilicorr.py: the whole LiLiCorr head)
against the plain-torch references (kernels/reference.py; for the head, the trained module
`specla.drafters.lilicorr.LiLiCorrHead` itself).

On CUDA: every mode at the GDN-1.3B head shape (H=8, K=V=256) and smaller ones, over
chains, wide-shallow, deep-narrow and random trees, with and without a pending commit,
outputs poisoned with NaN first; plus the commit kernel, CUDA-graph capture and errors.
On CPU: the same comparisons at tiny shapes in Triton's interpreter, run in a subprocess
because TRITON_INTERPRET must be set before triton is imported
(`python tests/test_kernels.py --interpreter GROUP` runs one group by hand).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import types
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kernels import reference  # noqa: E402
from benchmarks.bench_kernels import chain, deep_narrow, random_tree, wide_shallow  # noqa: E402

RTOL = 1e-4  # ||out - ref|| / ||ref|| for fp32 (the kernels land near 1e-7)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="Triton kernels need a CUDA GPU (the CPU runs them "
                                       "in the interpreter: test_interpreter)")


# ---------------------------------------------------------------------------------------
# Topologies: parent lists (parents[i] < i, -1 hangs off the state)
# ---------------------------------------------------------------------------------------

def forest(n: int) -> list[int]:
    """Several nodes hanging off the state (not a DraftTree, but the kernels allow it)."""
    rng = random.Random(n)
    return [-1, 0, -1, 2, 0, -1, 5, 6][:n] + [rng.randrange(i) for i in range(8, n)]


TOPOLOGIES = {"chain": chain, "wide": wide_shallow, "deep": deep_narrow, "random": random_tree,
              "forest": forest}


def make_topo(parents: list[int], device) -> "object":
    """A specla Topology (or a stand-in for a forest, which DraftTree rejects)."""
    from specla.model import Topology
    from specla.tree import DraftTree
    if sum(p < 0 for p in parents) == 1:
        return Topology.of(DraftTree([0] * len(parents), parents), conv_size=4, device=device)
    tree = types.SimpleNamespace(parents=parents, is_chain=False)
    return Topology(tree, torch.tensor(parents, device=device), torch.empty(0))


# ---------------------------------------------------------------------------------------
# One comparison
# ---------------------------------------------------------------------------------------

def random_inputs(B, N, H, K, V, P, seed, device):
    """Fresh inputs with fla's conventions; non-zero state, g = -rand, beta = rand."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.rand(*s, generator=gen)    # noqa: E731
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=F.normalize(randn(B, N, H, K), dim=-1) * K ** -0.5,
             k=F.normalize(randn(B, N, H, K), dim=-1), v=randn(B, N, H, V),
             g=-rand(B, N, H), beta=rand(B, N, H), S0=randn(B, H, K, V))
    pending = None
    if P:
        pending = (F.normalize(randn(B, P, H, K), dim=-1), randn(B, P, H, V) * 0.5, -rand(B, P, H))
        pending = tuple(t.to(device) for t in pending)
    return {name: t.to(device) for name, t in x.items()}, pending


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def check_verify(mode: str, parents: list[int], B: int, H: int, K: int, V: int, P: int,
                 device, seed: int = 0, block_v: int | None = None,
                 o_dtype: torch.dtype = torch.float32, **options) -> list[str]:
    """Run one kernel call against its reference; returns a list of problems (empty = ok)."""
    from kernels import triton_verify
    N = len(parents)
    x, pending = random_inputs(B, N, H, K, V, P, seed, device)
    topo = make_topo(parents, device)
    # reference: fold the pending factors, then verify from the folded state (on the CPU)
    cpu = {name: t.cpu() for name, t in x.items()}
    S_ref = cpu["S0"] if pending is None else reference.commit_ref(cpu["S0"], *(t.cpu() for t in pending))
    args = (cpu["q"], cpu["k"], cpu["v"], cpu["g"], cpu["beta"], S_ref)
    if mode == "chain":
        o_ref, d_ref = reference.chain_verify_ref(*args)
    else:
        o_ref, d_ref = reference.VERIFY_REFERENCES[mode](*args, torch.tensor(parents))

    S = x["S0"].clone()
    # o may be stored rounded to the model's dtype: then it is within that dtype's rounding
    out = (torch.full((B, N, H, V), float("nan"), device=device, dtype=o_dtype),
           torch.full((B, N, H, V), float("nan"), device=device))
    o, d = triton_verify.verify(mode, x["q"], x["k"], x["v"], x["g"], x["beta"], S, topo,
                                pending=pending, out=out, block_v=block_v, **options)
    problems = []
    if o.dtype != o_dtype:
        problems.append(f"o: {o.dtype}, not the {o_dtype} buffer it was given")
    o_tol = RTOL if o_dtype == torch.float32 else 1e-2
    for name, got, want, tol in (("o", o, o_ref, o_tol), ("delta", d, d_ref, RTOL), ("state", S, S_ref, RTOL)):
        if not torch.isfinite(got).all():
            problems.append(f"{name}: {int((~torch.isfinite(got)).sum())} elements unwritten/non-finite")
            continue
        err = rel_err(got, want)
        if not err < tol:
            problems.append(f"{name}: relative error {err:.2e} >= {tol:.0e}")
    if pending is None and not torch.equal(S.cpu(), cpu["S0"]):
        problems.append("state: written although no pending commit was given")
    return problems


def check_repeated_keys(mode: str, n: int, H: int, K: int, V: int, device, seed: int = 0,
                        **options) -> list[str]:
    """The parallel form where its repeated squaring rounds worst: every node the same key,
    beta near 1, little decay (a model repeating itself). Against the reference in float64."""
    from kernels import triton_verify
    parents = chain(n) if mode == "chain" else random_tree(n, seed=seed)
    x, _ = random_inputs(1, n, H, K, V, 0, seed, device)
    x["k"][:] = x["k"][:, :1].clone()
    x["beta"] = 0.95 + 0.05 * x["beta"]
    x["g"] = 0.01 * x["g"]
    args = [x[name] for name in ("q", "k", "v", "g", "beta", "S0")]
    o_ref, d_ref = reference.tree_verify_ref(*(a.cpu().double() for a in args), torch.tensor(parents))
    o, d = triton_verify.verify(mode, *args, make_topo(parents, device), form="parallel", **options)
    errors = {"o": rel_err(o, o_ref), "delta": rel_err(d, d_ref)}
    return [f"{name}: relative error {err:.2e} >= {RTOL:.0e}" for name, err in errors.items() if not err < RTOL]


def check_commit(B: int, T: int, H: int, K: int, V: int, device, seed: int = 0) -> list[str]:
    from kernels import triton_verify
    x, _ = random_inputs(B, 1, H, K, V, 0, seed, device)
    gen = torch.Generator().manual_seed(seed + 1)
    factors = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
               torch.randn(B, T, H, V, generator=gen), -torch.rand(B, T, H, generator=gen))
    S = x["S0"].clone()
    triton_verify.commit(S, *(t.to(device) for t in factors))
    err = rel_err(S, reference.commit_ref(x["S0"].cpu(), *factors))
    return [] if err < RTOL else [f"state: relative error {err:.2e} >= {RTOL:.0e}"]


def ancestor_windows(parents: list[int], W: int) -> torch.Tensor:
    """index [N, W] into concat(window of W-1, nodes): the committed tail, then the node's
    ancestors and itself (what specla's Topology builds for the tree-aware conv)."""
    rows = []
    for n in range(len(parents)):
        path, p = [], n
        while p >= 0:
            path.append(W - 1 + p)
            p = parents[p]
        rows.append((list(range(W - 1)) + path[::-1])[-W:])
    return torch.tensor(rows)


def check_conv_gates(parents: list[int], H: int, K: int, V: int, W: int, dtype, bias: bool,
                     device, seed: int = 0) -> list[str]:
    """The fused conv + gates kernel against `conv_gates_ref`, with x, a, b as strided column
    slices of one projection (as the runtime passes them) and NaN-poisoned factor buffers."""
    from kernels.triton_conv_gates import conv_gates
    gen = torch.Generator().manual_seed(seed)
    N, C = len(parents), H * (2 * K + V)
    proj = torch.randn(1, N, C + 2 * H + 3, generator=gen).to(device=device, dtype=dtype)
    x, a, b = proj[..., :C], proj[..., C:C + H], proj[..., C + H:C + 2 * H]
    window = torch.randn(1, C, W, generator=gen).to(device=device, dtype=dtype)[..., 1:]
    weight = (torch.randn(C, W, generator=gen) * 0.5).to(device=device, dtype=dtype)
    conv_b = (torch.randn(C, generator=gen) * 0.1).to(device=device, dtype=dtype) if bias else None
    neg_A = -(torch.rand(H, generator=gen) * 2).exp().to(device)
    dt_bias = (torch.randn(H, generator=gen) * 0.5).to(device)
    index = ancestor_windows(parents, W).to(device)
    args = (x, window, index, weight, conv_b, a, b, neg_A, dt_bias, K, V)
    nan = dict(device=device, dtype=torch.float32)
    k_out, g_out = torch.full((1, N, H, K), float("nan"), **nan), torch.full((1, N, H), float("nan"), **nan)
    x_out = torch.full((1, N, C), float("nan"), device=device).to(dtype)
    got = conv_gates(*args, k_out=k_out, g_out=g_out, x_out=x_out)
    want = reference.conv_gates_ref(*(t.cpu() if torch.is_tensor(t) else t for t in args))
    # fp32: rounding only; bf16: the conv output is rounded to bf16 once, and a sum in
    # another order may round a value to its neighbour (one bf16 ulp is 2^-8 relative)
    tol = RTOL if dtype == torch.float32 else 1e-2
    problems = [f"{name}: relative error {rel_err(o, r):.2e}" for name, o, r in
                zip(("q", "k", "v", "g", "beta"), got, want) if not rel_err(o, r) < tol]
    if got[1] is not k_out or got[3] is not g_out:
        problems.append("k and g were not written into the factor buffers")
    if not torch.equal(x_out, x):
        problems.append("the conv-input factor is not a copy of x")
    return problems


def check_projection(prologue: str, M: int, K: int, N: int, dtype, device, seed: int = 0,
                     heads: int = 2, **blocks) -> list[str]:
    """One fused projection against its reference, with the inputs laid out as the runtime
    passes them (the gate a strided column slice of a wider projection); `blocks` pick the
    kernel's tiling (the GEMV form, split-K, say). Each call runs twice and must give the same
    bits both times (split-K sums its partials in a fixed order; a CUDA-graph replay is
    compared with an eager run token for token)."""
    from kernels import triton_projection as tp
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    w = rnd(N, K, scale=K ** -0.5)
    norm_w = rnd(K if prologue == "norm" else K // heads, scale=0.1) + 1
    if prologue == "norm":
        x, res = rnd(1, M, K), rnd(1, M, K)
        run = lambda: [*tp.norm_linear(x, norm_w, 1e-6, res, w, **blocks),  # noqa: E731
                       tp.norm_linear(x, norm_w, 1e-6, None, w, **blocks)[0]]
        want = [*reference.norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-6, res.cpu(), w.cpu()),
                reference.norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-6, None, w.cpu())[0]]
    elif prologue == "gated_norm":
        o = torch.randn(1, M, heads, K // heads, generator=gen).to(device)            # fp32, as the recurrence gives it
        wide = rnd(1, M, K + 7)
        gate = wide[..., 3:3 + K]
        run = lambda: [tp.gated_norm_linear(o, gate, norm_w, 1e-6, act, w, **blocks)  # noqa: E731
                       for act in ("swish", "sigmoid")]
        want = [reference.gated_norm_linear_ref(o.cpu(), gate.cpu(), norm_w.cpu(), 1e-6, act, w.cpu())
                for act in ("swish", "sigmoid")]
    else:
        gu = rnd(1, M, 2 * K)
        run = lambda: [tp.swiglu_linear(gu, w, **blocks)]  # noqa: E731
        want = [reference.swiglu_linear_ref(gu.cpu(), w.cpu())]
    got, again = run(), run()
    # fp32: rounding only; bf16: every op's output is rounded to bf16 (one ulp is 2^-8). Triton's
    # CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest (checked: its casts
    # equal a mask of the low 16 bits), which biases the gated norm's four roundings by ~1.3%
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    tol = RTOL if dtype == torch.float32 else 2e-2 if interpreted else 1e-2
    problems = [f"output {i}: relative error {rel_err(g, r):.2e}" for i, (g, r) in enumerate(zip(got, want))
                if not (g.shape == r.shape and rel_err(g, r) < tol)]
    return problems + [f"output {i}: a second call gave other bits" for i, (g, a) in enumerate(zip(got, again))
                       if not torch.equal(g, a)]


PROJECTION_CASES = [("norm", 1, 384, 1548), ("norm", 8, 384, 1548), ("norm", 9, 384, 2048),
                    ("norm", 64, 2048, 512), ("norm", 1, 2048, 8208), ("norm", 2, 2048, 8208),
                    ("gated_norm", 1, 384, 384), ("gated_norm", 8, 384, 384), ("gated_norm", 1, 2048, 2048),
                    ("gated_norm", 17, 2048, 2048),
                    ("swiglu", 1, 1024, 384), ("swiglu", 9, 1024, 384), ("swiglu", 1, 5632, 2048),
                    ("swiglu", 16, 5632, 2048)]


def projection_test_tilings(M: int) -> list[dict]:
    """The default tiling and, around it, the GEMV form (a row or two: several heads a K
    block, narrow and wide N blocks, split-K) and the tl.dot form with and without split-K;
    256-column K blocks are whole heads at both models' head widths (64 and 256)."""
    # 128 weight rows a tile in two stages: three (the shared-memory rule's count) overflowed
    # sm_90's 227 KB at a 256-wide gated-norm head on the H100 (237568 bytes asked)
    tilings = [{}, {"gemv": False, "split_k": 1}, {"gemv": False, "split_k": 4}, {"swap": True},
               {"swap": True, "block_n": 128, "split_k": 1, "num_stages": 2},
               {"swap": True, "preload": True}, {"swap": True, "preload": False}, {"swap": True, "split_k": 8}]
    if M <= 2:
        tilings += [{"gemv": True, "split_k": 1}, {"gemv": True, "split_k": 4, "block_n": 4},
                    {"gemv": True, "block_k": 256, "block_n": 8 // M, "split_k": 2},
                    {"gemv": True, "block_k": 256, "packed": False, "split_k": 1},
                    {"gemv": True, "block_k": 256, "block_n": 16, "split_k": 8}]
    return tilings


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prologue,M,K,N", PROJECTION_CASES, ids=lambda x: str(x))
def test_projection_matches_reference(prologue, M, K, N, dtype):
    """At the embedded model's and the GDN-1.3B shape's widths (heads of 64 and 256), each
    tiling of `projection_test_tilings`."""
    heads = 6 if K == 384 else 8
    for blocks in projection_test_tilings(M):
        problems = check_projection(prologue, M, K, N, dtype, "cuda", seed=M + K, heads=heads, **blocks)
        assert not problems, (blocks, problems)


@needs_cuda
@pytest.mark.parametrize("form", ["walk", "parallel"])
@pytest.mark.parametrize("M", [1, 2])
def test_kernels_with_pdl_in_a_graph_give_the_same_bits(M, form):
    """Dependent kernels captured in a CUDA graph, the GEMV projections with programmatic
    dependent launch: two projections (norm, SwiGLU) feeding a verify with a deferred
    commit, then a commit, then a projection of the verify's output with the residual.
    Every replay gives the bits of plainly stream-ordered launches (PDL off): no kernel read
    its inputs early."""
    from kernels import pdl
    from kernels import triton_projection as tp
    from kernels import triton_verify as tv
    gen = torch.Generator(device="cuda").manual_seed(M)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    H, Kh, D, hidden = 8, 128, 1024, 2048
    x, norm_w = rnd(M, D).bfloat16(), rnd(D).bfloat16() * 0.1 + 1
    w_up = (rnd(2 * hidden, D) * D ** -0.5).bfloat16()
    w_kv = (rnd(2 * D + 2 * H, hidden) * hidden ** -0.5).bfloat16()
    w_out = (rnd(D, D) * D ** -0.5).bfloat16()
    S = rnd(1, H, Kh, Kh)
    pending = (F.normalize(rnd(1, 3, H, Kh), dim=-1), rnd(1, 3, H, Kh) * 0.5, -rnd(1, 3, H).abs())
    topo = make_topo(chain(M), "cuda")

    def layer():
        h = tp.swiglu_linear(tp.norm_linear(x, norm_w, 1e-6, None, w_up)[0], w_kv).float()
        k = F.normalize(h[:, :D].view(1, M, H, Kh), dim=-1)
        v = h[:, D:2 * D].view(1, M, H, Kh)
        g, beta = -F.softplus(h[:, 2 * D:2 * D + H]).view(1, M, H), h[:, 2 * D + H:].sigmoid().view(1, M, H)
        o, d = tv.verify("chain", k * Kh ** -0.5, k, v, g, beta, S, topo, pending=pending, form=form)
        tv.commit(S, k, d, g)
        return tp.norm_linear(o.reshape(M, D).bfloat16(), norm_w, 1e-6, x, w_out)[0], S

    start = S.clone()
    if not pdl.pdl_applies(x.device):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton with griddepcontrol")
    layer()                                              # compile the PDL variants
    S.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = layer()
    pdl.use_pdl(False)
    try:
        for _ in range(10):
            x.copy_(rnd(M, D).bfloat16())
            S.copy_(start)
            want = [t.clone() for t in layer()]
            S.copy_(start)
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    finally:
        pdl.use_pdl(True)


HEAD_SHAPES = {  # name: (HeadConfig fields, slots, top_k, vocab)
    "embedded": (dict(drafter_width=256, target_hidden=384, width=128, heads=4, layers=2,
                      mlp_hidden=256, max_slots=7, max_k=8), 7, 8, 4096),
    "odd": (dict(drafter_width=48, target_hidden=40, width=32, heads=2, layers=1, mlp_hidden=64,
                 max_slots=5, max_k=4), 4, 3, 50),
    "deep": (dict(drafter_width=64, target_hidden=96, width=64, heads=4, layers=3, mlp_hidden=384,
                  max_slots=15, max_k=8), 15, 2, 300),
    # a head for a GDN-1.3B-sized pair: 2048-wide inputs, an MLP of three 256-column blocks
    "wide": (dict(drafter_width=2048, target_hidden=2048, width=128, heads=4, layers=2, mlp_hidden=768,
                  max_slots=7, max_k=8), 7, 8, 512),
}


def random_head(fields: dict, seed: int):
    """A LiLiCorr head with every weight random at a trained head's scale (its own init
    leaves the biases at zero and the out/in heads tiny: too easy to match)."""
    from specla.drafters.lilicorr import HeadConfig, LiLiCorrHead
    torch.manual_seed(seed)
    head = LiLiCorrHead(HeadConfig(**fields))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3 if p.dim() < 2 else p.shape[-1] ** -0.5)
    return head.eval()


def check_lilicorr_head(shape: str, dtype, device, seed: int = 0, N: int = 2, **options) -> list[str]:
    """The fused head (built with `options`) against the module: scores, and the walk
    against `greedy_walk`.

    fp32: rounding only. bf16: the module rounds every intermediate to bf16 and the kernel
    keeps fp32 activations, so both are compared with the fp32 math: the kernel may be off
    by at most twice the bf16 module's own error (plus 1% of the score scale)."""
    from kernels.triton_lilicorr import FusedLiLiCorrHead
    from specla.drafters.lilicorr import greedy_walk
    fields, S, k, vocab = HEAD_SHAPES[shape]
    head32 = random_head(fields, seed)
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, fields["target_hidden"], generator=gen)
    cand = torch.stack([torch.randperm(vocab, generator=gen)[:S * k].view(S, k) for _ in range(N)])
    logp = torch.log_softmax(torch.randn(N, S, 4 * k, generator=gen) * 3, -1).topk(k, -1).values
    logp[0, 1] = -45.0                                    # below the features' clamp at -30
    hidden = torch.randn(N, S, fields["drafter_width"], generator=gen)
    anchor = torch.randn(N, fields["drafter_width"], generator=gen)
    with torch.no_grad():
        want = head32(embed[cand], logp, hidden, anchor)
        head = head32 if dtype == torch.float32 else random_head(fields, seed).to(dtype)
        bf16_err = max((w - g).abs().max().item() for w, g in zip(
            want, head(embed.to(dtype)[cand], logp, hidden.to(dtype), anchor.to(dtype))))
        fused = FusedLiLiCorrHead(head.to(device), S, k, embed.to(device), **options)
        start, pair, ranks, tokens = fused(cand.to(device), logp.to(device), hidden.to(device).to(dtype),
                                           anchor.to(device).to(dtype))
    scale = fields.get("scale", 8.0)
    tol = 1e-4 * scale if dtype == torch.float32 else 2 * bf16_err + 0.01 * scale
    problems = [f"{name}: max error {(g.cpu() - w).abs().max().item():.2e} > {tol:.2e}"
                for name, g, w in (("start", start, want[0]), ("pair", pair, want[1]))
                if not (g.cpu() - w).abs().max().item() <= tol]
    if not torch.equal(ranks.cpu(), greedy_walk(start, pair).cpu()):
        problems.append("the in-kernel walk differs from greedy_walk on the kernel's own scores")
    if dtype == torch.float32 and not torch.equal(ranks.cpu(), greedy_walk(*want)):
        problems.append("the walk differs from the module's")
    if not torch.equal(tokens.cpu(), cand.gather(-1, ranks.cpu()[..., None])[..., 0]):
        problems.append("tokens are not the walked candidates")
    return problems


def check_lilicorr_draft(shape: str, device, seed: int = 0, N: int = 2) -> list[str]:
    """`draft` (top-k inside the prologue launch) against `lattice_topk` and then the fused
    head on those candidates: the same candidates, and bit for bit the same scores and walk."""
    from kernels.triton_lilicorr import FusedLiLiCorrHead, lattice_topk
    fields, S, k, vocab = HEAD_SHAPES[shape]
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, S, vocab, generator=gen) * 4).to(device)
    hidden = torch.randn(N, S, fields["drafter_width"], generator=gen).to(device, dtype)
    anchor = torch.randn(N, fields["drafter_width"], generator=gen).to(device, dtype)
    embed = torch.randn(vocab, fields["target_hidden"], generator=gen).to(device)
    with torch.no_grad():
        fused = FusedLiLiCorrHead(random_head(fields, seed).to(device, dtype), S, k, embed)
        got = fused.draft(logits, hidden, anchor)
        cand, logp = lattice_topk(logits, k)
        want = (cand, logp, *fused(cand, logp, hidden, anchor))
    names = ("candidates", "log-probs", "start", "pair", "ranks", "tokens")
    return [f"draft's {name} differ" for name, g, w in zip(names, got, want) if not torch.equal(g, w)]


def check_lattice_topk(N: int, S: int, V: int, k: int, device, seed: int = 0) -> list[str]:
    """The top-k kernel against `candidates` (log_softmax + topk): the same tokens in the same
    order (random logits have no ties) and log-probs to fp32 rounding."""
    from kernels.triton_lilicorr import lattice_topk
    from specla.drafters.lilicorr import candidates
    logits = (torch.randn(N, S, V, generator=torch.Generator().manual_seed(seed)) * 4).to(device)
    cand, logp = lattice_topk(logits, k)
    want_cand, want_logp = candidates(logits.cpu(), k)
    problems = []
    if not torch.equal(cand.cpu(), want_cand):
        problems.append("top-k tokens differ")
    if not (logp.cpu() - want_logp).abs().max().item() < 1e-4:
        problems.append(f"log-probs differ by {(logp.cpu() - want_logp).abs().max().item():.2e}")
    return problems


# ---------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------

SHAPES = [  # (B, H, K, V)
    (1, 8, 256, 256),   # GDN-1.3B public checkpoint (m-a-p): 8 heads x 256
    (1, 6, 256, 512),   # fla's default 1.3B config: expand_v 2
    (1, 6, 64, 64),
    (2, 2, 16, 16),
    (2, 3, 32, 128),
]
SIZES = {"chain": (1, 2, 5, 16, 33, 64), "wide": (9, 64), "deep": (24, 64),
         "random": (7, 33, 64), "forest": (12,)}


def forms(mode: str, n: int) -> tuple[str, ...]:
    """The kernels that compute `mode` for n nodes (the parallel form takes up to 16)."""
    from kernels.triton_verify import FORMS, PARALLEL_MAX_NODES
    return tuple(f for f in FORMS[mode] if f != "parallel" or n <= PARALLEL_MAX_NODES)


def verify_cases():
    for B, H, K, V in SHAPES:
        for topo_name, sizes in SIZES.items():
            for n in sizes:
                modes = ("chain", "tree", "hybrid") if topo_name == "chain" else ("tree", "hybrid")
                for mode in modes:
                    for form in forms(mode, n):
                        for P in (0, 8):
                            yield pytest.param(mode, form, topo_name, n, B, H, K, V, P,
                                               id=f"{mode}-{form}-N{n}-H{H}-K{K}-V{V}-{topo_name}-B{B}-P{P}")


@needs_cuda
@pytest.mark.parametrize("mode,form,topo_name,n,B,H,K,V,P", verify_cases())
def test_verify_matches_reference(mode, form, topo_name, n, B, H, K, V, P):
    parents = TOPOLOGIES[topo_name](n)
    seed = zlib.crc32(f"{mode}{topo_name}{n}{B}{H}{K}{V}{P}".encode())
    problems = check_verify(mode, parents, B, H, K, V, P, "cuda", seed=seed, form=form)
    assert not problems, problems


# the parallel form's orders and product precisions (verify keywords) its GPU tests cover
PARALLEL_OPTIONS = [dict(gram_first=False, dot_precision="ieee"), dict(gram_first=True, dot_precision="ieee"),
                    dict(gram_first=False, dot_precision="tf32x3"), dict(gram_first=True, dot_precision="tf32x3")]


@needs_cuda
@pytest.mark.parametrize("mode,n", [("chain", 9), ("chain", 16), ("tree", 16)])
@pytest.mark.parametrize("K,V", [(256, 256), (64, 64)], ids=lambda x: str(x))
@pytest.mark.parametrize("options", PARALLEL_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_parallel_form_on_repeated_keys(mode, n, K, V, options):
    assert not check_repeated_keys(mode, n, 8 if K == 256 else 6, K, V, "cuda", **options)


@needs_cuda
@pytest.mark.parametrize("P", range(9), ids=lambda p: f"P{p}")
@pytest.mark.parametrize("mode", ["chain", "tree", "hybrid"])
def test_pending_counts(mode, P):
    parents = chain(16) if mode == "chain" else random_tree(16, seed=P)
    problems = check_verify(mode, parents, 1, 8, 256, 256, P, "cuda", seed=100 + P)
    assert not problems, problems


@needs_cuda
@pytest.mark.parametrize("P", [1, 8, 16, 20], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("mode,n", [("chain", 9), ("tree", 16)])
@pytest.mark.parametrize("options", PARALLEL_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_parallel_form_folds_pending(mode, n, P, options):
    """The pending commit folded into the state tile before the K pass, at the GDN-1.3B head
    shape; 20 pending factors take two blocks. Both orders of the parallel form, and its
    products on tensor cores."""
    parents = chain(n) if mode == "chain" else random_tree(n, seed=P)
    problems = check_verify(mode, parents, 1, 8, 256, 256, P, "cuda", seed=200 + P, form="parallel", **options)
    assert not problems, problems


@needs_cuda
@pytest.mark.parametrize("block_v", [16, 32, 64])
@pytest.mark.parametrize("mode", ["chain", "tree", "hybrid"])
def test_block_v_override(mode, block_v):
    parents = chain(12) if mode == "chain" else deep_narrow(12)
    assert not check_verify(mode, parents, 1, 8, 256, 256, 3, "cuda", seed=7, block_v=block_v)


@needs_cuda
@pytest.mark.parametrize("mode", ["chain", "tree", "hybrid"])
def test_outputs_rounded_to_bf16(mode):
    """o stored straight into a bf16 buffer (what the runtime's output norm reads)."""
    parents = chain(9) if mode == "chain" else random_tree(9, seed=1)
    assert not check_verify(mode, parents, 1, 8, 256, 256, 4, "cuda", seed=3, o_dtype=torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("warps", [1, 2, 4])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("mode,H,K,V,P", [("chain", 8, 256, 256, 9), ("chain", 6, 64, 64, 9),
                                           ("chain", 6, 64, 64, 20), ("hybrid", 8, 256, 256, 3)],
                         ids=lambda x: str(x))
def test_walk_orientations(mode, H, K, V, P, v_first, warps):
    """Both tile orientations of the walk kernel, at the 1.3B and the embedded head shapes,
    with a deferred commit of P factors folded in (P=20: two blocks of the fold)."""
    parents = chain(9) if mode == "chain" else deep_narrow(12)
    assert not check_verify(mode, parents, 1, H, K, V, P, "cuda", seed=P + warps, block_v=16,
                            num_warps=warps, v_first=v_first, form="walk")


@needs_cuda
@pytest.mark.parametrize("B,H,K,V", [(1, 8, 256, 256), (2, 6, 64, 64), (2, 2, 16, 32)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("T", [0, 1, 2, 4, 8, 16, 17, 64], ids=lambda t: f"T{t}")
def test_commit_matches_reference(T, B, H, K, V):
    assert not check_commit(B, T, H, K, V, "cuda", seed=T)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H,K,V,W,bias", [(8, 256, 256, 4, False), (6, 256, 512, 4, False),
                                           (4, 128, 256, 4, True), (2, 16, 32, 3, False)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("topo_name,n", [("chain", 1), ("chain", 17), ("random", 33), ("wide", 64)])
def test_conv_gates_matches_reference(topo_name, n, H, K, V, W, bias, dtype):
    parents = TOPOLOGIES[topo_name](n)
    assert not check_conv_gates(parents, H, K, V, W, dtype, bias, "cuda", seed=n + H)


@needs_cuda
@pytest.mark.parametrize("N,S,V,k", [(1, 7, 4096, 4), (1, 7, 4096, 8), (2, 15, 32000, 8), (1, 3, 50, 1)])
def test_lattice_topk_matches_candidates(N, S, V, k):
    assert not check_lattice_topk(N, S, V, k, "cuda", seed=V + k)


@needs_cuda
@pytest.mark.parametrize("dtype,shape,options", [
    (torch.bfloat16, "embedded", {}), (torch.bfloat16, "embedded", {"mlp_block": 128, "num_warps": 4}),
    (torch.bfloat16, "odd", {"num_warps": 4}),
    (torch.float32, "odd", {}), (torch.bfloat16, "deep", {}), (torch.bfloat16, "wide", {})], ids=str)
def test_lilicorr_head_matches_module(shape, dtype, options):
    assert not check_lilicorr_head(shape, dtype, "cuda", seed=len(shape), **options)


@needs_cuda
@pytest.mark.parametrize("shape", ["embedded", "wide"])
def test_lilicorr_draft_matches_topk_then_head(shape):
    assert not check_lilicorr_draft(shape, "cuda", seed=3)


def test_lilicorr_head_bad_inputs():
    pytest.importorskip("triton")
    from kernels.triton_lilicorr import FusedLiLiCorrHead
    fields, S, k, vocab = HEAD_SHAPES["odd"]
    embed = torch.zeros(vocab, fields["target_hidden"])
    with pytest.raises(ValueError, match="power-of-two"):
        FusedLiLiCorrHead(random_head({**fields, "width": 48}, 0), S, k, embed)
    with pytest.raises(ValueError, match="outside the head"):
        FusedLiLiCorrHead(random_head(fields, 0), S, fields["max_k"] + 1, embed)
    # fp32 at width 128 runs only in the interpreter (on the GPU it did not finish compiling)
    wide, S_w, k_w, _ = HEAD_SHAPES["embedded"]
    with pytest.raises(ValueError, match="cast the drafter to bf16"):
        FusedLiLiCorrHead(random_head(wide, 0), S_w, k_w, torch.zeros(8, wide["target_hidden"]))
    FusedLiLiCorrHead(random_head(wide, 0).to(torch.bfloat16), S_w, k_w, torch.zeros(8, wide["target_hidden"]))
    with pytest.raises(ValueError, match="mlp_block"):
        FusedLiLiCorrHead(random_head(fields, 0), S, k, embed, mlp_block=48)
    fused = FusedLiLiCorrHead(random_head(fields, 0), S, k, embed)
    with pytest.raises(ValueError, match="lattice"):
        fused(torch.zeros(1, S, k + 1, dtype=torch.long), torch.zeros(1, S, k + 1),
              torch.zeros(1, S, fields["drafter_width"]), torch.zeros(1, fields["drafter_width"]))
    with pytest.raises(ValueError, match="logits"):
        fused.draft(torch.zeros(1, S + 1, vocab), torch.zeros(1, S, fields["drafter_width"]),
                    torch.zeros(1, fields["drafter_width"]))


@needs_cuda
@pytest.mark.parametrize("mode", ["chain", "tree", "hybrid"])
def test_cuda_graph_capture(mode):
    """The per-call path captures into a CUDA graph (no host sync); tree mode replays with
    a different tree written into the same parents tensor."""
    from kernels import triton_verify
    B, H, K, V, N, P = 1, 8, 256, 256, 16, 4
    parents = chain(N) if mode == "chain" else random_tree(N, seed=1)
    topo = make_topo(parents, "cuda")
    triton_verify.prepare_topology(topo, "cuda")
    x, pending = random_inputs(B, N, H, K, V, P, 3, "cuda")
    inputs = [x[n] for n in ("q", "k", "v", "g", "beta")]
    S = x["S0"].clone()
    out = tuple(torch.empty(B, N, H, V, device="cuda") for _ in range(2))
    triton_verify.verify(mode, *inputs, S, topo, pending=pending, out=out)   # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_verify.verify(mode, *inputs, S, topo, pending=pending, out=out)
    for t in out:
        t.fill_(float("nan"))
    S.copy_(x["S0"])
    graph.replay()
    torch.cuda.synchronize()
    S_ref = reference.commit_ref(x["S0"].cpu(), *(t.cpu() for t in pending))
    cpu = [x[n].cpu() for n in ("q", "k", "v", "g", "beta")]
    if mode == "chain":
        o_ref, d_ref = reference.chain_verify_ref(*cpu, S_ref)
    else:
        o_ref, d_ref = reference.VERIFY_REFERENCES[mode](*cpu, S_ref, torch.tensor(parents))
    assert rel_err(out[0], o_ref) < RTOL and rel_err(out[1], d_ref) < RTOL
    assert rel_err(S, S_ref) < RTOL
    if mode == "tree":
        other = wide_shallow(N)
        topo.parents.copy_(torch.tensor(other))
        S.copy_(x["S0"])
        graph.replay()
        torch.cuda.synchronize()
        o_ref, d_ref = reference.tree_verify_ref(*cpu, S_ref, torch.tensor(other))
        assert rel_err(out[0], o_ref) < RTOL and rel_err(out[1], d_ref) < RTOL


@needs_cuda
@pytest.mark.parametrize("mode", ["tree", "hybrid"])
def test_tree_swapped_in_place(mode):
    assert not check_tree_swap(mode, "cuda", H=8, K=256, V=256)


@needs_cuda
@pytest.mark.parametrize("mode", ["auto", "chain", "tree", "hybrid"])
def test_runtime_dispatch(mode):
    """specla.verify on CUDA tensors (the kernels) equals it on CPU tensors (the references),
    with a deferred commit and then an immediate one."""
    from specla.verify import commit_layer, verify_layer
    parents = chain(10) if mode == "chain" else deep_narrow(10)
    x, pending = random_inputs(1, 10, 8, 256, 256, 3, 11, "cpu")
    results = {}
    for device in ("cpu", "cuda"):
        y = {n: t.to(device) for n, t in x.items()}
        S = y["S0"].clone()
        o, d = verify_layer(mode, y["q"], y["k"], y["v"], y["g"], y["beta"], S,
                            make_topo(parents, device), pending=tuple(t.to(device) for t in pending))
        commit_layer(S, y["k"][:, :4], d[:, :4], y["g"][:, :4])
        results[device] = (o, d, S)
    for got, want in zip(results["cuda"], results["cpu"]):
        assert rel_err(got, want) < RTOL


# ---------------------------------------------------------------------------------------
# Errors (no kernel launch: these run anywhere)
# ---------------------------------------------------------------------------------------

def test_auto_mode_sends_small_drafts_to_one_launch():
    """On CUDA `auto` verifies trees of up to 16 nodes with the tree mode (its one-launch
    parallel form), larger deep ones with the hybrid; chains with the chain mode, whose
    kernel is the parallel form from 6 to 16 nodes and the walk otherwise."""
    pytest.importorskip("triton")
    from kernels import triton_verify
    from specla.verify import resolve_mode
    for parents, want in ((random_tree(9), "tree"), (wide_shallow(16), "tree"), (chain(9), "chain"),
                          (deep_narrow(40), "hybrid")):
        assert resolve_mode("auto", make_topo(parents, "cpu"), "cuda") == want, (len(parents), want)
    assert resolve_mode("auto", make_topo(random_tree(9), "cpu"), "cpu") == "tree"
    assert triton_verify.CHAIN_PARALLEL_MIN_NODES <= triton_verify.PARALLEL_MAX_NODES


def test_projection_launch_drops_stages_until_shared_memory_fits():
    """A kernel that asks for more shared memory than the GPU has is launched again with one
    pipeline stage fewer at a time; the depth that fit is kept for its next call, and a kernel
    that fits at no depth raises."""
    from triton.runtime.errors import OutOfResources
    from kernels import triton_projection as tp
    asked = []

    def launch(num_stages=None):
        asked.append(num_stages)
        if num_stages is None or num_stages > 2:
            raise OutOfResources(240 << 10, 227 << 10, "shared memory")

    for key in (("test", 4), ("test", None)):
        tp._FITTED_STAGES.pop(key, None)
    tp._launch_fitting(launch, ("test", 4), 4)
    assert asked == [4, 3, 2] and tp._FITTED_STAGES[("test", 4)] == 2
    asked.clear()
    tp._launch_fitting(launch, ("test", 4), 4)
    assert asked == [2]
    asked.clear()
    tp._launch_fitting(launch, ("test", None), None)       # Triton's default depth, 3, then 2
    assert asked == [None, 2]

    def never(num_stages=None):
        asked.append(num_stages)
        raise OutOfResources(240 << 10, 227 << 10, "shared memory")

    asked.clear()
    with pytest.raises(OutOfResources):
        tp._launch_fitting(never, ("test", "never"), 2)
    assert asked == [2, 1]


def test_bad_inputs_raise():
    pytest.importorskip("triton")
    from kernels import triton_verify
    x, _ = random_inputs(1, 4, 2, 16, 16, 0, 0, "cpu")
    topo = make_topo(chain(4), "cpu")
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "S0")]
    with pytest.raises(ValueError, match="unknown verification mode"):
        triton_verify.verify("dense", *args, topo)
    y, _ = random_inputs(1, 4, 2, 24, 16, 0, 0, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        triton_verify.verify("chain", *[y[n] for n in ("q", "k", "v", "g", "beta", "S0")], topo)
    with pytest.raises(ValueError, match="shape"):
        triton_verify.verify("chain", *args[:5], args[5][:, :1], topo)
    with pytest.raises(ValueError, match="float32"):
        triton_verify.verify("chain", *args[:5], args[5].double(), topo)
    with pytest.raises(ValueError, match="block_v"):
        triton_verify.verify("chain", *args, topo, block_v=8)
    with pytest.raises(ValueError, match="no form 'gram_solve'"):
        triton_verify.verify("chain", *args, topo, form="gram_solve")
    with pytest.raises(ValueError, match="no form 'parallel'"):
        triton_verify.verify("hybrid", *args, topo, form="parallel")
    w, _ = random_inputs(1, 17, 2, 16, 16, 0, 0, "cpu")
    with pytest.raises(ValueError, match="up to 16 nodes"):
        triton_verify.verify("chain", *[w[n] for n in ("q", "k", "v", "g", "beta", "S0")],
                             make_topo(chain(17), "cpu"), form="parallel")
    z, _ = random_inputs(1, 129, 1, 16, 16, 0, 0, "cpu")
    with pytest.raises(ValueError, match="exceeds"):
        triton_verify.verify("tree", *[z[n] for n in ("q", "k", "v", "g", "beta", "S0")],
                             make_topo(chain(129), "cpu"))


# ---------------------------------------------------------------------------------------
# CPU: Triton's interpreter, tiny shapes, one subprocess per group
# ---------------------------------------------------------------------------------------

# (M, K, N, tiling) at tiny widths, the gated norm's heads 16 wide: the GEMV form with several
# heads a K block and two K steps (the prefetch), two rows, a half-masked last block, split-K
# into 2 and 4 slices for the GEMV and tl.dot forms, 4 asked of 3 K blocks (3 slices run)
PROJECTION_TILING_CASES = [
    (1, 128, 40, dict(gemv=True, block_k=64, block_n=4)),
    (2, 96, 40, dict(gemv=True, block_k=64, block_n=8, split_k=2)),
    (2, 96, 40, dict()),
    (1, 128, 40, dict(gemv=True, block_k=32, block_n=16, split_k=4)),
    (9, 128, 40, dict(gemv=False, block_k=32, split_k=2)),
    (9, 128, 33, dict(gemv=False, block_k=32, block_n=16, split_k=4)),
    (9, 96, 40, dict(gemv=False, block_k=32, split_k=4)),
    (1, 128, 40, dict(gemv=True, block_k=64, block_n=8, packed=False)),   # the sum after the loop
    (2, 96, 40, dict(out_dtype=torch.float32)),                           # fp32 out of bf16 weights
    (9, 128, 40, dict(swap=True, block_k=32, block_n=32, split_k=2)),    # weights on the MMA's M side
    (1, 96, 33, dict(swap=True, block_k=32, block_n=16)),
    (9, 128, 40, dict(swap=True, block_k=32, block_n=32, split_k=2, preload=True)),  # inputs a block ahead
    (9, 128, 40, dict(swap=True, block_k=32, block_n=32, split_k=2, preload=False)),  # ... or staged by Triton
    (9, 96, 33, dict(gemv=False, block_k=32, block_n=16, preload=True)),
    (5, 128, 40, dict(swap=True, block_k=16, block_n=16, split_k=2, preload=True)),   # mean square 128 a step
]


def interpreter_cases(group: str):
    """(description, callable returning problems) for one group, at tiny shapes."""
    dev = "cpu"
    if group == "conv_gates":
        for name, parents in (("chain", chain(1)), ("chain", chain(6)), ("random", random_tree(9, seed=2))):
            for dtype in (torch.float32, torch.bfloat16):
                for H, K, V, W, bias in ((2, 16, 32, 4, False), (3, 16, 16, 3, True)):
                    yield (f"conv_gates-{name}{len(parents)}-H{H}-K{K}-V{V}-W{W}-{dtype}",
                           lambda p=parents, H=H, K=K, V=V, W=W, dt=dtype, bias=bias: check_conv_gates(
                               p, H, K, V, W, dt, bias, dev, seed=len(p) + H))
        return
    if group == "step":  # tests/test_conv_recurrent_step.py, test_conv_projection.py, test_greedy.py
        from tests.test_conv_recurrent_step import check_conv_recurrent_step
        for H, K, V, W, bias, neg, bv in ((2, 16, 32, 4, False, False, 16), (3, 16, 16, 3, True, True, None)):
            for dtype in (torch.float32, torch.bfloat16):
                yield (f"conv_recurrent_step-H{H}-K{K}-V{V}-W{W}-BV{bv}-{dtype}",
                       lambda a=(H, K, V, W, dtype, bias, neg), bv=bv: check_conv_recurrent_step(
                           *a, dev, seed=a[0], block_v=bv))
        from tests.test_conv_projection import check_norm_linear_conv    # the AR conv in the in-projection
        for K, N, C, W, bias, blocks in ((64, 48, 40, 4, False, {"block_n": 8, "block_k": 32}),
                                         (96, 40, 24, 2, True, {})):
            for dtype in (torch.float32, torch.bfloat16):
                yield (f"norm_linear_conv-K{K}-N{N}-C{C}-W{W}-{dtype}",
                       lambda a=(K, N, C, W, dtype, bias), b=blocks: check_norm_linear_conv(*a, dev, seed=a[0], **b))
        from tests.test_recurrent_step import check_recurrent_step      # the large-headed recurrence
        for H, K, V, neg, tile in ((2, 16, 32, False, {"block_v": 8}), (3, 16, 24, True, {"block_v": 16})):
            for dtype in (torch.float32, torch.bfloat16):
                yield (f"recurrent_step-H{H}-K{K}-V{V}-{dtype}",
                       lambda a=(H, K, V, dtype, neg), t=tile: check_recurrent_step(*a, dev, seed=a[0], **t))
        from tests.test_greedy import check_greedy_take     # the AR step's greedy token
        for vocab, chunk in ((5000, 1024), (300, 128), (100, 2048)):
            yield f"greedy_take-V{vocab}-chunk{chunk}", lambda v=vocab, c=chunk: check_greedy_take(v, c, dev, seed=v)
        return
    if group == "lilicorr":
        for N, S, V, k in ((1, 7, 4096, 8), (2, 3, 50, 4), (1, 15, 300, 1)):
            yield f"lattice_topk-N{N}-S{S}-V{V}-k{k}", lambda a=(N, S, V, k): check_lattice_topk(*a, dev)
        for shape in HEAD_SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                yield (f"lilicorr-{shape}-{dtype}",
                       lambda shape=shape, dt=dtype: check_lilicorr_head(shape, dt, dev, seed=len(shape)))
        yield ("lilicorr-deep-mlp_block16", lambda: check_lilicorr_head("deep", torch.float32, dev, seed=4,
                                                                        mlp_block=16))
        for shape in ("odd", "wide"):
            yield f"lilicorr-draft-{shape}", lambda shape=shape: check_lilicorr_draft(shape, dev, seed=6)
        return
    if group == "projection":
        for prologue in ("norm", "gated_norm", "swiglu"):
            # two heads: the gated norm's of 32 and 64; K = 96 (not a power of two) for the others
            for M, K, N in ((1, 64, 48), (5, 64 if prologue == "gated_norm" else 96, 40), (17, 128, 33)):
                for dtype in (torch.float32, torch.bfloat16):
                    yield (f"projection-{prologue}-M{M}-K{K}-N{N}-{dtype}",
                           lambda a=(prologue, M, K, N, dtype): check_projection(*a, dev, seed=a[1]))
                    if M == 1:
                        yield (f"projection-gemv-{prologue}-K{K}-N{N}-{dtype}",
                               lambda a=(prologue, M, K, N, dtype): check_projection(*a, dev, seed=2, gemv=True))
            for M, K, N, blocks in PROJECTION_TILING_CASES:
                for dtype in (torch.float32, torch.bfloat16):
                    tiling = "-".join(f"{k}{v}" for k, v in blocks.items()) or "default"
                    yield (f"projection-{prologue}-M{M}-K{K}-N{N}-{tiling}-{dtype}",
                           lambda a=(prologue, M, K, N, dtype), b=blocks: check_projection(
                               *a, dev, seed=a[1] + a[2], heads=a[2] // 16, **b))
        return
    if group == "commit":
        for T in (0, 1, 5, 16, 37):      # 37: three blocks of the fold
            yield f"commit-T{T}-H2-K16-V32", lambda T=T: check_commit(2, T, 2, 16, 32, dev, seed=T)
        return
    from kernels import triton_verify
    if group in ("tree", "hybrid"):
        yield f"{group}-N9-H2-K16-V16-swap", lambda: check_tree_swap(group, dev)
    parents = chain(9) if group == "chain" else random_tree(8, seed=3)
    yield (f"{group}-N{len(parents)}-H2-K16-V32-o-bf16",
           lambda: check_verify(group, parents, 2, 2, 16, 32, 3, dev, seed=11, o_dtype=torch.bfloat16))
    topologies = [("chain", chain(1)), ("chain", chain(2)), ("chain", chain(9))]
    if group != "chain":
        topologies += [("wide", wide_shallow(9, width=3)), ("deep", deep_narrow(9)),
                       ("random", random_tree(8, seed=3)), ("forest", forest(7))]
    if group != "hybrid":   # 17 nodes: past the parallel form (the walk, the gram + solve)
        topologies.append(("chain" if group == "chain" else "random", chain(17) if group == "chain"
                           else random_tree(17, seed=4)))
        for n in (9, 16):
            for gram_first in (False, True):
                yield (f"{group}-parallel-N{n}-repeated-keys-gram_first={gram_first}",
                       lambda n=n, gf=gram_first: check_repeated_keys(group, n, 2, 16, 16, dev, seed=n,
                                                                      gram_first=gf))
    # every form and the walk's two tile orientations; P=20 folds a pending commit in two blocks
    variants = [{"form": "walk", "v_first": False}, {"form": "walk", "v_first": True}]
    for name, parents in topologies:
        options = [{"form": f} for f in forms(group, len(parents)) if f != "walk"]
        if "parallel" in forms(group, len(parents)):
            options.append({"form": "parallel", "gram_first": not triton_verify.PARALLEL_GRAM_FIRST})
        options += variants if "walk" in forms(group, len(parents)) else []
        for P in (0, 3, 20):
            for K, V in ((16, 16), (16, 32)):
                for opt in options:
                    tag = "-".join(f"{k}={v}" for k, v in opt.items())
                    yield (f"{group}-N{len(parents)}-H2-K{K}-V{V}-{name}-P{P}-{tag}",
                           lambda parents=parents, P=P, K=K, V=V, opt=opt: check_verify(
                               group, parents, 2, 2, K, V, P, dev, seed=len(parents) * 10 + P, **opt))


def check_tree_swap(mode: str, device, H: int = 2, K: int = 16, V: int = 16) -> list[str]:
    """One Topology object, its tree replaced in place between calls (as
    specla.graphs.spec.SpecTopology.load does): the second call must see the new tree."""
    from kernels import triton_verify
    first, second = deep_narrow(9), wide_shallow(9, width=3)
    topo = make_topo(first, device)
    x, _ = random_inputs(1, 9, H, K, V, 0, 5, device)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "S0")]
    triton_verify.verify(mode, *args, topo)
    topo.parents.copy_(torch.tensor(second))
    topo.tree = make_topo(second, "cpu").tree
    o, d = triton_verify.verify(mode, *args, topo)
    o_ref, d_ref = reference.VERIFY_REFERENCES[mode](*(t.cpu() for t in args), torch.tensor(second))
    err = max(rel_err(o, o_ref), rel_err(d, d_ref))
    return [] if err < RTOL else [f"after the swap: relative error {err:.2e}"]


def run_interpreter_group(group: str) -> int:
    failures = 0
    for desc, case in interpreter_cases(group):
        problems = case()
        print(("FAIL " if problems else "ok   ") + desc + ("  " + "; ".join(problems) if problems else ""))
        failures += bool(problems)
    return failures


@pytest.mark.parametrize("group", ["chain", "tree", "hybrid", "commit", "conv_gates", "step", "lilicorr",
                                   "projection"])
def test_interpreter(group):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, __file__, "--interpreter", group], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ok   " in proc.stdout


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--interpreter":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("set TRITON_INTERPRET=1 (before triton is imported) to run on the CPU")
        sys.exit(1 if run_interpreter_group(sys.argv[2]) else 0)
    sys.exit(f"usage: TRITON_INTERPRET=1 python {sys.argv[0]} --interpreter chain|tree|hybrid|commit|conv_gates|step|lilicorr|projection")


def test_head_dims_outside_the_kernels_run_the_references():
    """The verify and commit kernels take powers of two from 16; the engine and `verify_layer`
    route any other head dims (a tiny test model's 8) to the plain-torch references."""
    from kernels import triton_verify
    from specla.engine import _verify_kernels_take
    from specla.verify import kernels_apply
    from tests.helpers import random_target

    assert triton_verify.supports(16, 16) and triton_verify.supports(64, 512)
    assert not triton_verify.supports(8, 64) and not triton_verify.supports(64, 48)
    assert not triton_verify.supports(512, 64)
    assert _verify_kernels_take(random_target(vocab=16, head_dim=16).config)
    assert not _verify_kernels_take(random_target(vocab=16, head_dim=8).config)
    assert not kernels_apply(torch.zeros(1, 2, 64, 64))          # a CPU state: always the references
