"""The L2 prefetch of the next kernel's weights (kernels/l2_prefetch.py): which matrix each
fused op asks for, that the prefetching kernels compile for sm_90 with the bulk prefetch in
them (on the CPU), and on the GPU that they give the bits of the kernels without it."""
from __future__ import annotations

import os

import pytest
import torch

from tests.test_kernels import needs_cuda

compiles = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                              reason="the check compiles; the interpreter does not")


def test_the_plan_links_each_matrix_to_the_next_large_one():
    """Each projection prefetches the matrix the step reads after it, if that one is large
    enough to stream from HBM; the AR recurrence its layer's output projection."""
    from kernels.triton_projection import LATENCY_BOUND_BYTES
    from specla.graphs.ops import FusedOps, TorchOps
    big = LATENCY_BOUND_BYTES // 2            # bf16 elements: exactly the bound
    w_in, w_o, w_up, small, head = (torch.zeros(n, dtype=torch.bfloat16) for n in (big, big, big, 16, big))
    ops = FusedOps()
    ops.plan_l2_prefetch([w_in, w_o, w_up, small, head])
    assert ops._prefetch(w_in)["prefetch"] is w_o and ops._prefetch(w_o)["prefetch"] is w_up
    assert ops._prefetch(w_up) == {}          # the next one is small: nothing to stream
    assert ops._prefetch(small)["prefetch"] is head and ops._prefetch(head) == {}
    TorchOps().plan_l2_prefetch([w_in, w_o])  # plain ops take the plan and do nothing


def test_prefetch_args_cap_and_align_the_bytes(monkeypatch):
    from kernels import l2_prefetch
    nxt = torch.zeros(3 << 20, dtype=torch.bfloat16)                # 6 MB
    assert l2_prefetch.prefetch_args(nxt, torch.device("cpu")) == (None, 0, 0)
    monkeypatch.setattr(l2_prefetch, "l2_prefetch_applies", lambda device: True)
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", (1 << 20) + 7)
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES_ROWS", 2 << 20)
    assert l2_prefetch.prefetch_args(nxt, torch.device("cpu"))[1:] == (1 << 20, 2)
    assert l2_prefetch.prefetch_args(nxt, torch.device("cpu"), rows=2)[1] == 1 << 20    # an AR kernel's cap
    assert l2_prefetch.prefetch_args(nxt, torch.device("cpu"), rows=9)[1] == 2 << 20    # a verification's
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES_ROWS", 64 << 20)
    assert l2_prefetch.prefetch_args(nxt, torch.device("cpu"), rows=9)[1] == 6 << 20    # the whole matrix
    monkeypatch.setattr(l2_prefetch, "AT", "start")
    assert l2_prefetch.prefetch_args(nxt, torch.device("cpu"))[2] == 1
    assert l2_prefetch.prefetch_args(None, torch.device("cpu")) == (None, 0, 0)


@compiles
def test_prefetching_kernels_compile_for_sm90_with_the_bulk_prefetch(monkeypatch):
    """The GEMV and swapped projections (prefetch at the start and at the end), the
    recurrence step and the verification's conv + gates, compiled on the CPU for sm_90: each
    has one bulk prefetch, ptxas takes it, nothing spills."""
    pytest.importorskip("triton")
    from benchmarks import ptxas_check
    from kernels import l2_prefetch, triton_projection as tp, triton_recurrent_step as rs
    monkeypatch.setattr(l2_prefetch, "l2_prefetch_applies", lambda device: True)
    bf = torch.bfloat16
    x, nw, w, nxt = torch.zeros(1, 512, dtype=bf), torch.ones(512, dtype=bf), torch.zeros(1024, 512, dtype=bf), \
        torch.zeros(64, 512, dtype=bf)
    o9, g9 = torch.zeros(9, 2, 256, dtype=bf), torch.zeros(9, 512, dtype=bf)
    calls = []
    for at in ("start", "end"):
        monkeypatch.setattr(l2_prefetch, "AT", at)
        calls += ptxas_check.recorded_launches(lambda: tp.norm_linear(x, nw, 1e-6, x, w, prefetch=nxt),
                                               ["_projection_kernel"], tp)
    calls += ptxas_check.recorded_launches(
        lambda: tp.gated_norm_linear(o9, g9, torch.ones(256, dtype=bf), 1e-6, "swish", w[:512], prefetch=nxt,
                                     swap=True), ["_projection_kernel"], tp)
    q, ab = torch.zeros(1, 1, 2, 64, dtype=bf), torch.zeros(1, 1, 2, dtype=bf)
    calls += ptxas_check.recorded_launches(
        lambda: rs.recurrent_step(q, q, q, ab, ab, torch.zeros(2), torch.zeros(2), torch.zeros(1, 2, 64, 64),
                                  prefetch=nxt), ["_recurrent_step_kernel"], rs)
    from kernels import triton_conv_gates as cg
    from specla.model import Topology
    xc, ab3 = torch.zeros(1, 3, 2 * 3 * 64, dtype=bf), torch.zeros(1, 3, 2, dtype=bf)
    calls += ptxas_check.recorded_launches(
        lambda: cg.conv_gates(xc, torch.zeros(1, 384, 3, dtype=bf), Topology.chain(3, 4, "cpu").conv_index,
                              torch.zeros(384, 4, dtype=bf), torch.zeros(384, dtype=bf), ab3, ab3, torch.zeros(2),
                              torch.zeros(2), 64, 64, prefetch=nxt), ["_conv_gates_kernel"], cg)
    assert [kw["PREFETCH"] for _, _, kw in calls] == [1, 2, 2, 2, 2]
    for kernel, args, kwargs in calls:
        compiled = ptxas_check.compile_sm90(kernel, args, kwargs)
        assert compiled.asm["ptx"].count("cp.async.bulk.prefetch.L2.global") == 1, kernel.__name__
        usage = ptxas_check.ptxas_usage(compiled.asm["ptx"])
        assert usage["spill_stores"] == 0, (kernel.__name__, usage)


@needs_cuda
@pytest.mark.parametrize("at", ["start", "end"])
def test_prefetching_kernels_give_the_bits_of_plain_ones(at, monkeypatch):
    """At the GDN-1.3B widths: the in-projection's GEMV (with its residual), the 9-row swapped
    output projection, the split-K down projection, the recurrence step and a 9-node conv +
    gates, eagerly and replayed from a CUDA graph, with a 24 MB prefetch each: the same bits
    as with none."""
    from kernels import l2_prefetch, triton_conv_gates as cg, triton_projection as tp, triton_recurrent_step as rs
    from specla.model import Topology
    device = torch.device("cuda")
    if not l2_prefetch.l2_prefetch_applies(device):
        pytest.skip("the bulk L2 prefetch needs sm_90+")
    monkeypatch.setattr(l2_prefetch, "AT", at)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").bfloat16()  # noqa: E731
    D, H, K, I = 2048, 8, 256, 5632
    x, res, nw = rnd(1, D), rnd(1, D), rnd(D) * 0.1 + 1
    w_in, w_o, w_down = rnd(8208, D) * D ** -0.5, rnd(D, D) * D ** -0.5, rnd(D, I) * I ** -0.5
    o9, g9, onw, gu = rnd(9, H, K), rnd(9, D), rnd(K) * 0.1 + 1, rnd(1, 2 * I)
    q, kk, v, ab = rnd(1, 1, H, K), rnd(1, 1, H, K), rnd(1, 1, H, K), rnd(1, 1, H)
    neg_A, dt_bias = -torch.rand(H, device="cuda"), torch.zeros(H, device="cuda")
    nxt = torch.zeros(12 << 20, device="cuda", dtype=torch.bfloat16)
    S0 = torch.randn(1, H, K, K, generator=gen, device="cuda") * 0.1
    C = 3 * H * K
    xc, window, ab9 = rnd(1, 9, C + 2 * H), rnd(1, C, 3), rnd(1, 9, 2 * H)
    conv_w, index = rnd(C, 4) * 0.5, Topology.chain(9, 4, device).conv_index
    S = S0.clone()

    def run(**pf):
        S.copy_(S0)
        return [*tp.norm_linear(x, nw, 1e-6, res, w_in, **pf),
                tp.gated_norm_linear(o9, g9, onw, 1e-6, "swish", w_o, **pf),
                tp.swiglu_linear(gu, w_down, **pf),
                rs.recurrent_step(q, kk, v, ab, ab, neg_A, dt_bias, S, **pf), S.clone(),
                *cg.conv_gates(xc[..., :C], window, index, conv_w, None, ab9[..., :H], ab9[..., H:], neg_A,
                               dt_bias, K, K, **pf)]

    assert l2_prefetch.prefetch_args(nxt, device)[2] == (1 if at == "start" else 2)
    want = run()
    assert all(torch.equal(g, w) for g, w in zip(run(prefetch=nxt), want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run(prefetch=nxt)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(g, w) for g, w in zip(got, want))
