"""A layer's conv + gates and its parallel-form verification in one launch:
`conv_verify_ref` in `kernels/reference.py`.

Why: in the per-op verification forward, `triton_conv_gates` is a launch of its own between
the input projection and the recurrence, and the recurrence's first act is to read back
what it wrote. At the GDN-1.3B shape it took 4.1 us a layer of a 9-node verification on the
H100 (99 of 1906 us, benchmarks/results/h100/session26/), mostly a launch's fill and drain.

Here each (head, V tile) program of the parallel form (`triton_verify._parallel_tile`) first
computes the inputs it reads: its head's q and k for every node (the conv along each node's
path, SiLU, l2 norm), its V tile's v, and its head's g and beta. q and k are the same for all
V / BV programs of a head; each computes them itself (two [N, K] convs of 4 taps, a few
thousand FMAs) into its own slot of a scratch buffer, so no program waits for another and no
two write the same address. Then a barrier, and the parallel form as before. The first V tile
of a head also writes the commit factors (k, g, the raw conv inputs of q and k); every tile
writes the raw conv inputs of its own v columns.

The arithmetic is `triton_conv_gates`'s (fp32 conv rounded once to the input dtype, l2 norm
x / sqrt(sum x^2 + 1e-6) in fp32), except that the conv's four taps are summed in tap order
and the l2 norm's squares in K blocks: q and k may differ from that kernel's in the last fp32
bit, and then in the bf16 rounding of a conv output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_conv_gates import _log_decay_and_beta
from kernels.triton_verify import (DOT_PRECISION, OUT_DTYPES, PARALLEL_MAX_NODES, _check_inputs, _contig,
                                   _parallel_config, _parallel_tile, _pending_args, _strides, default_form,
                                   supports)

MODES = ("chain", "tree")      # the parallel form's two masks


@triton.jit
def _nodes_conv(x, x_row_stride, window, window_stride, index, weight, bias, o_n, m_n, channels, c_mask,
                W: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr):
    """SiLU(conv) of every node (o_n, masked by m_n) for `channels` -> fp32 [BN, BC], rounded
    once to x's dtype. index [N, W] holds each node's taps as positions in concat(window, x)."""
    acc = tl.zeros([BN, BC], dtype=tl.float32)
    mask = m_n[:, None] & c_mask[None, :]
    for t in tl.static_range(W):
        pos = tl.load(index + o_n * W + t, mask=m_n, other=0)
        in_window = (pos < W - 1)[:, None]
        from_window = tl.load(window + channels[None, :] * window_stride + pos[:, None],
                              mask=mask & in_window, other=0.0)
        from_nodes = tl.load(x + (pos[:, None] - (W - 1)) * x_row_stride + channels[None, :],
                             mask=mask & ~in_window, other=0.0)
        hist = tl.where(in_window, from_window.to(tl.float32), from_nodes.to(tl.float32))
        tap = tl.load(weight + channels * W + t, mask=c_mask, other=0.0).to(tl.float32)
        acc += hist * tap[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + channels, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.sigmoid(acc)
    return acc.to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _copy_raw(x, x_row_stride, x_out, C, o_n, m_n, channels, c_mask):
    """The nodes' raw conv inputs of `channels`: the conv-window commit factor."""
    mask = m_n[:, None] & c_mask[None, :]
    raw = tl.load(x + o_n[:, None] * x_row_stride + channels[None, :], mask=mask)
    tl.store(x_out + o_n[:, None] * C + channels[None, :], raw, mask=mask)


@triton.jit
def _head_inputs(x, x_row_stride, window, window_stride, index, conv_w, conv_b, a, b, ab_row_stride,
                 neg_A, dt_bias, q, k, v, g, beta, k_out, g_out, x_out, C, scale, N, i_h, i_v,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                 BN: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, HAS_BIAS: tl.constexpr,
                 NEG_EIGVAL: tl.constexpr, FACTORS: tl.constexpr, COPY_X: tl.constexpr):
    """Head i_h's q, k [N, K] and g, beta [N] and V tile i_v's v [N, BV], into q, k, v, g,
    beta ([1, N, H, *] layouts); with FACTORS the first V tile also writes k and g to k_out,
    g_out, and with COPY_X the raw conv inputs of its channels to x_out."""
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    rows = o_n * H + i_h
    first = i_v == 0
    # the l2 norms need whole rows: one pass for the sums of squares, one for the values
    ss_q = tl.zeros([BN], dtype=tl.float32)
    ss_k = tl.zeros([BN], dtype=tl.float32)
    for c0 in range(0, K, BC):
        ch = c0 + tl.arange(0, BC)
        cq = _nodes_conv(x, x_row_stride, window, window_stride, index, conv_w, conv_b, o_n, m_n,
                         i_h * K + ch, ch < K, W, HAS_BIAS, BN, BC)
        ck = _nodes_conv(x, x_row_stride, window, window_stride, index, conv_w, conv_b, o_n, m_n,
                         (H + i_h) * K + ch, ch < K, W, HAS_BIAS, BN, BC)
        ss_q += tl.sum(cq * cq, axis=1)
        ss_k += tl.sum(ck * ck, axis=1)
    r_q = 1.0 / tl.sqrt(ss_q + 1e-6)
    r_k = 1.0 / tl.sqrt(ss_k + 1e-6)
    for c0 in range(0, K, BC):
        ch = c0 + tl.arange(0, BC)
        mask = m_n[:, None] & (ch < K)[None, :]
        offs = rows[:, None] * K + ch[None, :]
        cq = _nodes_conv(x, x_row_stride, window, window_stride, index, conv_w, conv_b, o_n, m_n,
                         i_h * K + ch, ch < K, W, HAS_BIAS, BN, BC)
        ck = _nodes_conv(x, x_row_stride, window, window_stride, index, conv_w, conv_b, o_n, m_n,
                         (H + i_h) * K + ch, ch < K, W, HAS_BIAS, BN, BC)
        tl.store(q + offs, cq * r_q[:, None] * scale, mask=mask)
        kn = ck * r_k[:, None]
        tl.store(k + offs, kn, mask=mask)
        if FACTORS:
            tl.store(k_out + offs, kn, mask=mask & first)
        if COPY_X:
            if first:
                _copy_raw(x, x_row_stride, x_out, C, o_n, m_n, i_h * K + ch, ch < K)
                _copy_raw(x, x_row_stride, x_out, C, o_n, m_n, (H + i_h) * K + ch, ch < K)
    cols = i_v * BV + tl.arange(0, BV)
    v_ch = 2 * H * K + i_h * V + cols
    cv = _nodes_conv(x, x_row_stride, window, window_stride, index, conv_w, conv_b, o_n, m_n,
                     v_ch, cols < V, W, HAS_BIAS, BN, BV)
    tl.store(v + rows[:, None] * V + cols[None, :], cv, mask=m_n[:, None] & (cols < V)[None, :])
    if COPY_X:
        _copy_raw(x, x_row_stride, x_out, C, o_n, m_n, v_ch, cols < V)
    b_g, b_beta = _log_decay_and_beta(a + o_n * ab_row_stride, b + o_n * ab_row_stride, neg_A, dt_bias, i_h,
                                      NEG_EIGVAL, m_n)
    tl.store(g + rows, b_g, mask=m_n)
    tl.store(beta + rows, b_beta, mask=m_n)
    if FACTORS:
        tl.store(g_out + rows, b_g, mask=m_n & first)


@triton.jit(do_not_specialize=["P", "N"])
def _conv_parallel_kernel(
    x, x_row_stride, window, window_stride, index, conv_w, conv_b, a, b, ab_row_stride, neg_A, dt_bias,
    q_rep, k_rep, v, g_rep, beta_rep, k_out, g_out, x_out, C, scale,
    parents, S, o, delta, stride_sb, stride_sh, stride_sk, stride_sv, kp, dp, gp, P, N,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
    CHAIN: tl.constexpr, HAS_PENDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, NEG_EIGVAL: tl.constexpr, FACTORS: tl.constexpr, COPY_X: tl.constexpr,
):
    """Program (V tile, head): `_head_inputs` into its own scratch slot, then `_parallel_tile`."""
    i_v, i_h = tl.program_id(0), tl.program_id(1)
    # the slot of this V tile: [1, N, H, K] for q and k, [1, N, H] for g and beta
    q = q_rep + i_v * N * H * K
    k = k_rep + i_v * N * H * K
    g = g_rep + i_v * N * H
    beta = beta_rep + i_v * N * H
    _head_inputs(x, x_row_stride, window, window_stride, index, conv_w, conv_b, a, b, ab_row_stride,
                 neg_A, dt_bias, q, k, v, g, beta, k_out, g_out, x_out, C, scale, N, i_h, i_v,
                 H, K, V, W, BN, BC, BV, HAS_BIAS, NEG_EIGVAL, FACTORS, COPY_X)
    tl.debug_barrier()        # the parallel form reads these through other threads
    _parallel_tile(q, k, v, g, beta, parents, S, o, delta, stride_sb, stride_sh, stride_sk, stride_sv,
                   kp, dp, gp, P, N, i_v, i_h, H, K, V, BN, BK, BV, CHAIN, HAS_PENDING, DOT_PRECISION)


def applies(mode: str, N: int, K: int, V: int) -> bool:
    """Whether a draft of N nodes verified as `mode` with heads K x V runs the parallel form
    (`triton_verify.default_form`), which is what `conv_verify` runs."""
    return mode in MODES and supports(K, V) and default_form(mode, N) == "parallel"


def _check_buffer(name: str, t: torch.Tensor | None, shape: tuple, dtypes: tuple, device) -> None:
    if t is not None and (tuple(t.shape) != shape or t.dtype not in dtypes or not t.is_contiguous()
                          or t.device != device):
        raise ValueError(f"conv_verify: {name} must be a contiguous {shape} tensor on {device} "
                         f"of dtype {' or '.join(str(d) for d in dtypes)}, got {tuple(t.shape)} {t.dtype}")


def conv_verify(mode: str, x: torch.Tensor, window: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor,
                dt_bias: torch.Tensor, S0: torch.Tensor, parents: torch.Tensor | None, head_dim: int,
                head_v_dim: int, neg_eigval: bool = False,
                pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
                out: tuple[torch.Tensor, torch.Tensor] | None = None, k_out: torch.Tensor | None = None,
                g_out: torch.Tensor | None = None, x_out: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`conv_verify_ref` in one launch: (o, delta) [1,N,H,V] of a chain (mode "chain") or a
    tree (mode "tree", parents [N] on the device) of N <= PARALLEL_MAX_NODES nodes.

    x [1,N,C] and a, b [1,N,H] may be column slices of one projection output (rows strided);
    window [1,C,W-1] a view of the conv cache; S0 [1,H,K,V] fp32, written only to fold
    `pending` in. out: (o, delta) buffers as `triton_verify.verify` takes them; k_out
    [1,N,H,K], g_out [1,N,H] (fp32) and x_out [1,N,C] receive the commit factors.
    """
    if mode not in MODES:
        raise ValueError(f"conv_verify runs the parallel form of {' or '.join(MODES)}, not {mode!r}")
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"conv_verify: x must be [1, N, C], got {tuple(x.shape)}")
    _, N, C = x.shape
    H, K, V = a.shape[-1], head_dim, head_v_dim
    W = weight.shape[-1]
    if not 0 < N <= PARALLEL_MAX_NODES:
        raise ValueError(f"conv_verify: the parallel form takes 1 to {PARALLEL_MAX_NODES} nodes, not {N}")
    if C != H * (2 * K + V) or weight.shape != (C, W) or index.shape != (N, W) \
            or a.shape != (1, N, H) or b.shape != (1, N, H) or window.shape != (1, C, W - 1):
        raise ValueError(f"conv_verify: x {tuple(x.shape)}, window {tuple(window.shape)}, weight "
                         f"{tuple(weight.shape)}, index {tuple(index.shape)}, a {tuple(a.shape)}, b "
                         f"{tuple(b.shape)} do not fit H={H}, K={K}, V={V}")
    if x.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1 or window.stride(-1) != 1:
        raise ValueError("conv_verify: the last dimension of x, a, b and window must be contiguous")
    if a.stride(1) != b.stride(1):
        raise ValueError("conv_verify: a and b must share their row stride")
    if mode == "tree" and (parents is None or tuple(parents.shape) != (N,) or parents.device != x.device):
        raise ValueError(f"conv_verify: a tree needs parents [{N}] on {x.device}")
    cfg = _parallel_config(N, K, V)
    BV = cfg["BV"]
    tiles = V // BV
    dev = x.device
    q_rep = torch.empty(tiles, 1, N, H, K, device=dev, dtype=torch.float32)
    k_rep = torch.empty_like(q_rep)
    g_rep = torch.empty(tiles, 1, N, H, device=dev, dtype=torch.float32)
    beta_rep = torch.empty_like(g_rep)
    v = torch.empty(1, N, H, V, device=dev, dtype=torch.float32)
    _check_inputs(q_rep[0], k_rep[0], v, g_rep[0], beta_rep[0], S0, pending)
    if out is None:
        o, delta = torch.empty_like(v), torch.empty_like(v)
    else:
        o, delta = out
        _check_buffer("out o", o, (1, N, H, V), OUT_DTYPES, dev)
        _check_buffer("out delta", delta, (1, N, H, V), (torch.float32,), dev)
    _check_buffer("k_out", k_out, (1, N, H, K), (torch.float32,), dev)
    _check_buffer("g_out", g_out, (1, N, H), (torch.float32,), dev)
    _check_buffer("x_out", x_out, (1, N, C), (x.dtype,), dev)
    factors = k_out is not None or g_out is not None
    if factors and (k_out is None or g_out is None):
        raise ValueError("conv_verify: k_out and g_out are written together")
    kp, dp, gp, P, has_pending = _pending_args(pending, S0)
    index, weight = _contig(index, weight)
    _conv_parallel_kernel[(tiles, H)](
        x, x.stride(1), window, window.stride(1), index, weight, bias if bias is not None else weight,
        a, b, a.stride(1), neg_A, dt_bias,
        q_rep, k_rep, v, g_rep, beta_rep, k_out if factors else q_rep, g_out if factors else g_rep,
        x_out if x_out is not None else x, C, K ** -0.5,
        parents if parents is not None else index, S0, o, delta, *_strides(S0), kp, dp, gp, P, N,
        H=H, K=K, V=V, W=W, BN=cfg["BN"], BK=cfg["BK"], BV=BV, BC=min(K, 64),
        CHAIN=mode == "chain", HAS_PENDING=has_pending, DOT_PRECISION=DOT_PRECISION,
        HAS_BIAS=bias is not None, NEG_EIGVAL=neg_eigval, FACTORS=factors, COPY_X=x_out is not None,
        num_warps=cfg["num_warps"])
    return o, delta
