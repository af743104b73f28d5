"""A layer's conv + gates and its parallel-form verification in one launch
(kernels/triton_conv_verify.py) against `conv_verify_ref`: outputs, deltas, the commit factors
(k, g, raw conv inputs) and the state with the deferred commit folded in. On the GPU here; on
the CPU through Triton's interpreter, in tests/test_kernels.py's "conv_gates" group. The
runtime's side (the verification forward that takes it) is checked with torch ops on the CPU."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from tests.test_kernels import RTOL, chain, needs_cuda, random_tree, rel_err


def check_conv_verify(parents: list[int], H: int, K: int, V: int, W: int, P: int, dtype, bias: bool, device,
                      seed: int = 0, neg_eigval: bool = False, factors: bool = True) -> list[str]:
    """One layer through the kernel and the reference from the same state, as a chain (when
    `parents` is one) or a tree; the factor buffers and outputs are poisoned first."""
    from kernels.triton_conv_verify import conv_verify
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    N, C = len(parents), H * (2 * K + V)
    proj = rnd(1, N, C + 2 * H + 5)          # the conv inputs and a, b as column slices of one output
    x, a, b = proj[..., :C], proj[..., C:C + H], proj[..., C + H:C + 2 * H]
    window = rnd(1, C, W)[..., 1:]
    weight, conv_b = rnd(C, W, scale=0.5), rnd(C, scale=0.1) if bias else None
    neg_A = -(torch.rand(H, generator=gen) * 2).exp().to(device)
    dt_bias = rnd(H, scale=0.5, dt=torch.float32)
    index = reference.tree_conv_index(parents, W).to(device)
    tree = torch.tensor(parents, device=device)
    S = rnd(1, H, K, V, scale=0.1, dt=torch.float32)
    pending = None
    if P:
        pending = (F.normalize(rnd(1, P, H, K, dt=torch.float32), dim=-1), rnd(1, P, H, V, scale=0.1, dt=torch.float32),
                   -torch.rand(1, P, H, generator=gen).to(device))
    S_ref = S.clone()
    poison = float("nan")
    outs = (torch.full((1, N, H, V), poison, device=device), torch.full((1, N, H, V), poison, device=device))
    k_out, g_out = torch.full((1, N, H, K), poison, device=device), torch.full((1, N, H), poison, device=device)
    x_out = torch.full((1, N, C), poison, device=device, dtype=dtype)
    mode = "chain" if parents == chain(N) else "tree"
    o, delta = conv_verify(mode, x, window, index, weight, conv_b, a, b, neg_A, dt_bias, S,
                           tree if mode == "tree" else None, K, V, neg_eigval, pending, out=outs,
                           **(dict(k_out=k_out, g_out=g_out, x_out=x_out) if factors else {}))
    want = reference.conv_verify_ref(*(t.cpu() if torch.is_tensor(t) else t for t in (
        x, window, index, weight, conv_b, a, b, neg_A, dt_bias, S_ref, tree, K, V, neg_eigval)),
        pending=None if pending is None else tuple(t.cpu() for t in pending))
    # fp32: rounding only. bf16: a conv output one rounding away from the reference's (its
    # taps summed in another order; Triton's CPU interpreter truncates where the GPU rounds)
    tol = RTOL * 10 if dtype == torch.float32 else 3e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 2e-2
    checks = [("o", o, want[0]), ("delta", delta, want[1]), ("state", S, S_ref.cpu())]
    if factors:
        checks += [("k factor", k_out, want[2]), ("g factor", g_out, want[3])]
    problems = [f"{name}: relative error {rel_err(got, ref):.2e}" for name, got, ref in checks
                if not (got.shape == ref.shape and rel_err(got, ref) < tol)]
    if o is not outs[0] or delta is not outs[1]:
        problems.append("the out buffers were not the ones returned")
    if factors and not torch.equal(x_out.cpu(), x.cpu()):
        problems.append("the raw conv inputs were not copied bit for bit")
    return problems


CASES = [   # parents, H, K, V, W, pending, bias
    (chain(9), 8, 256, 256, 4, 8, False),        # the GDN-1.3B shape: a chain of 8 drafts and the root
    (random_tree(16, seed=5), 8, 256, 256, 4, 8, False),
    (chain(6), 6, 64, 64, 4, 0, True),           # the embedded model's shape
    (random_tree(11, seed=1), 6, 64, 64, 4, 3, True),
    (random_tree(5, seed=2), 2, 32, 128, 3, 1, True),
]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("parents,H,K,V,W,P,bias", CASES)
def test_conv_verify_matches_reference(parents, H, K, V, W, P, bias, dtype):
    assert not check_conv_verify(parents, H, K, V, W, P, dtype, bias, "cuda", seed=len(parents) + K)


@needs_cuda
def test_conv_verify_without_factors_and_with_negative_eigenvalues():
    assert not check_conv_verify(chain(7), 4, 64, 64, 4, 2, torch.bfloat16, False, "cuda", seed=3,
                                 neg_eigval=True, factors=False)


def test_conv_verify_applies_to_the_parallel_form_only():
    from kernels.triton_conv_verify import applies
    assert applies("chain", 9, 256, 256) and applies("tree", 16, 64, 64) and applies("tree", 1, 16, 16)
    assert not applies("chain", 4, 256, 256)        # the walk verifies short chains
    assert not applies("tree", 17, 64, 64)          # the gram + solve verifies larger trees
    assert not applies("hybrid", 9, 64, 64)
    assert not applies("tree", 9, 8, 8)             # heads the kernels do not take


def test_conv_verify_rejects_bad_inputs():
    """Wrong modes, sizes, shapes and buffers: a clear error before any launch."""
    from kernels.triton_conv_verify import conv_verify
    H, K, V, W, N = 2, 16, 16, 4, 5
    C = H * (2 * K + V)
    x, a = torch.zeros(1, N, C), torch.zeros(1, N, H)
    window, weight, index = torch.zeros(1, C, W - 1), torch.zeros(C, W), torch.zeros(N, W, dtype=torch.long)
    S, neg_A, dt_bias = torch.zeros(1, H, K, V), torch.zeros(H), torch.zeros(H)

    def call(mode="tree", x=x, index=index, S=S, parents=torch.zeros(N, dtype=torch.long), **kw):
        conv_verify(mode, x, window, index, weight, None, a, a, neg_A, dt_bias, S, parents, K, V, **kw)

    with pytest.raises(ValueError, match="parallel form of chain or tree"):
        call("hybrid")
    with pytest.raises(ValueError, match="1 to 16 nodes"):
        call(x=torch.zeros(1, 17, C))
    with pytest.raises(ValueError, match="do not fit"):
        call(x=torch.zeros(1, N, C + 1))
    with pytest.raises(ValueError, match="do not fit"):
        call(index=torch.zeros(N, W + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="parents"):
        call(parents=None)
    with pytest.raises(ValueError, match="float32"):
        call(S=torch.zeros(1, H, K, V, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out delta"):
        call(out=(torch.zeros(1, N, H, V), torch.zeros(1, N, H, V, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="together"):
        call(k_out=torch.zeros(1, N, H, K))
    with pytest.raises(ValueError, match="pending"):
        call(pending=(torch.zeros(1, 2, H, K), torch.zeros(1, 2, H, V), torch.zeros(1, 3, H)))


def test_tree_forward_takes_the_fused_layer_where_it_applies():
    """The verification forward with a `conv_verify_fn` that takes some layers (the reference,
    writing the factors and out buffers as the kernel does) and declines the others gives the
    logits, factors and states of the forward without it."""
    from specla.graphs.runtime import PackedTarget, StaticState
    from specla.verify import verify_layer
    from specla.model import Topology
    from specla.tree import DraftTree
    from tests.helpers import random_target

    target = random_target(vocab=64, hidden=64, std=0.2)
    packed = PackedTarget(target, ops="torch")
    c = packed.config
    parents = [-1, 0, 1, 0, 3]
    topo = Topology.of(DraftTree(tokens=[0] * len(parents), parents=parents), c.conv_size)
    tokens = torch.tensor([[5, 9, 2, 33, 7]])
    pending = [(F.normalize(torch.randn(1, 2, c.num_heads, c.head_dim), dim=-1),
                torch.randn(1, 2, c.num_heads, c.head_v_dim) * 0.1, -torch.rand(1, 2, c.num_heads))
               for _ in range(c.num_hidden_layers)]
    start = StaticState(c, packed.device, packed.dtype)
    start.recurrent.normal_(std=0.1)
    taken = []

    def verify(l, q, k, v, g, beta, S, out):
        return verify_layer("tree", q, k, v, g, beta, S, topo, pending=pending[l], out=out)

    def fused(l, x, a, b, window, index, layer, factors_out, S, out):
        if l % 2:
            return None
        taken.append(l)
        o, delta, k, g = reference.conv_verify_ref(x, window, index, layer.conv_w, layer.conv_b, a, b, layer.neg_A,
                                                   layer.dt_bias, S, topo.parents, c.head_dim, c.head_v_dim,
                                                   c.allow_neg_eigval, pending[l])
        factors_out[0].copy_(k), factors_out[1].copy_(g), factors_out[2].copy_(x)
        out[1].copy_(delta)
        return o.to(out[0].dtype), out[1]

    runs = []
    for fn in (None, fused):
        state = start.clone()
        factors = packed.new_factors(len(parents))
        logits, hidden, _ = packed.tree_forward(tokens, state, topo.conv_index, verify, factors, (), fn)
        runs.append((logits, hidden, state.recurrent, factors.k, factors.g, factors.delta, factors.conv_in))
    assert taken == list(range(0, c.num_hidden_layers, 2)) and taken
    for name, want, got in zip(("logits", "hidden", "state", "k", "g", "delta", "conv_in"), *runs):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), name


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_per_op_spec_with_the_conv_in_the_verification_equals_ar_fp32(shape):
    """The per-op verification forward (not the persistent one) of a chain of 7 drafts and a
    tree of 9 nodes, each layer's conv + gates in the verification's launch: in fp32 the
    speculative tokens are AR's and the state after decoding equals a replay."""
    from specla.graphs.oracle import DeviceOracle, oracle_calibrate
    from specla.graphs.spec import GraphedSpec, SpecState
    from tests.test_gpu_runtime import SHAPES, ar_tokens, setup

    _, rt, ar, snap, prompt = setup("cuda", torch.float32, ops="fused")
    calls = []
    fused = rt.ops.conv_verify
    rt.ops.conv_verify = lambda *args, **kw: calls.append(args[0]) or fused(*args, **kw)
    root, n, tree = prompt[-1], 48, SHAPES[shape]
    cont = ar_tokens(ar, snap, root, n + 4 * (tree.depth + 1))
    P = tree.depth + 1
    state = SpecState(rt, max_path=P, capacity=n + 2 * P + 8, max_nodes=len(tree))
    oracle = DeviceOracle(cont, rt.config.vocab_size, 0.7, max_steps=n + 2 * P + 9, max_nodes=len(tree),
                          capacity=n + 4 * P + 16, device=rt.device, seed=3)
    spec = GraphedSpec(rt, state, tree, oracle=oracle, persistent_verify=False)
    run = oracle_calibrate(spec, ar, snap, root, n)
    assert calls and set(calls) == {spec.mode}, "the verification did not take the conv"
    assert not run.divergences and run.tokens[:n] == cont[:n]
    spec.state.flush()
    ar.logits_along(snap, root, run.tokens[:-1])
    assert torch.allclose(spec.state.cache.recurrent, ar.state.recurrent, rtol=1e-4, atol=1e-5)
    assert torch.allclose(spec.state.cache.conv[..., 1:], ar.state.conv[..., 1:], rtol=1e-4, atol=1e-5)
