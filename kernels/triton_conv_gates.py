"""One Triton kernel for everything between a layer's input projection and its recurrence,
over all nodes of a draft: `conv_gates_ref` in `kernels/reference.py`. And, for one AR token
of a model with small heads, that and the recurrence step in one launch:
`conv_recurrent_step_ref`.

Why: in a verification forward these steps are ~20 tiny torch ops per layer (the gather of
each node's ancestor window, the conv, SiLU, two l2 norms, softplus, sigmoid, dtype casts,
copies of the factors). Each is a few microseconds even inside a CUDA graph, and at the
GDN-1.3B shape (24 layers) they cost more than the recurrence itself. One program per
(node, head) does them all and writes the per-token factors (k, g and the raw conv inputs)
straight into the commit buffers, so the copies disappear too.

Arithmetic as the AR step's: the conv accumulates in fp32 and rounds once to the input
dtype (fla's conv update kernel), q and k are l2-normalised in fp32 as
x / sqrt(sum(x^2) + 1e-6), g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.l2_prefetch import l2_prefetch_share, prefetch_args


@triton.jit
def _node_conv(x, x_row_stride, window, window_stride, weight, bias, rows, in_window, o_w, w_mask,
               channels, c_mask, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """SiLU(conv) of one node for `channels` [BC] -> fp32 [BC], rounded once to x's dtype."""
    # rows [BW]: positions in concat(window, nodes); the first W-1 are the committed window
    from_window = tl.load(window + channels[None, :] * window_stride + rows[:, None],
                          mask=w_mask[:, None] & in_window[:, None] & c_mask[None, :], other=0.0)
    from_nodes = tl.load(x + (rows[:, None] - (W - 1)) * x_row_stride + channels[None, :],
                         mask=w_mask[:, None] & (~in_window[:, None]) & c_mask[None, :], other=0.0)
    hist = tl.where(in_window[:, None], from_window.to(tl.float32), from_nodes.to(tl.float32))
    taps = tl.load(weight + channels[None, :] * W + o_w[:, None],
                   mask=w_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
    out = tl.sum(hist * taps, axis=0)
    if HAS_BIAS:
        out += tl.load(bias + channels, mask=c_mask, other=0.0).to(tl.float32)
    out = out * tl.sigmoid(out)
    return out.to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _l2_normed(x, scale):
    """fla's l2 norm of a head's fp32 vector, times scale."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)) * scale


@triton.jit
def _log_decay_and_beta(a, b, neg_A, dt_bias, h, NEG_EIGVAL: tl.constexpr):
    """Head h's g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) (x2 with negative
    eigenvalues), from the raw projections a, b of one row."""
    raw_a = tl.load(a + h).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
    softplus = tl.where(raw_a > 20.0, raw_a, tl.log(1.0 + tl.exp(tl.minimum(raw_a, 20.0))))
    beta = tl.sigmoid(tl.load(b + h).to(tl.float32))
    if NEG_EIGVAL:
        beta = beta * 2.0
    return tl.load(neg_A + h).to(tl.float32) * softplus, beta


@triton.jit
def _conv_gates_node(x, x_row_stride, window, window_stride, index, weight, bias,
                     a, b, ab_row_stride, neg_A, dt_bias,
                     q_out, k_out, v_out, g_out, beta_out, x_out, C, scale, n, h,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
                     HAS_BIAS: tl.constexpr, NEG_EIGVAL: tl.constexpr, COPY_X: tl.constexpr):
    """Node n, head h: its conv window, q, k, v, g, beta and (COPY_X) its raw conv inputs."""
    o_w = tl.arange(0, BW)
    w_mask = o_w < W
    rows = tl.load(index + n * W + o_w, mask=w_mask, other=0)
    in_window = rows < W - 1
    o_k = tl.arange(0, BK)
    k_mask = o_k < K
    o_v = tl.arange(0, BV)
    v_mask = o_v < V

    q_ch = h * K + o_k
    k_ch = H * K + h * K + o_k
    v_ch = 2 * H * K + h * V + o_v
    q = _node_conv(x, x_row_stride, window, window_stride, weight, bias, rows, in_window, o_w, w_mask,
                   q_ch, k_mask, W, HAS_BIAS)
    k = _node_conv(x, x_row_stride, window, window_stride, weight, bias, rows, in_window, o_w, w_mask,
                   k_ch, k_mask, W, HAS_BIAS)
    v = _node_conv(x, x_row_stride, window, window_stride, weight, bias, rows, in_window, o_w, w_mask,
                   v_ch, v_mask, W, HAS_BIAS)
    q = _l2_normed(q, scale)
    k = _l2_normed(k, 1.0)
    head = n * H + h
    tl.store(q_out + head * K + o_k, q, mask=k_mask)
    tl.store(k_out + head * K + o_k, k, mask=k_mask)
    tl.store(v_out + head * V + o_v, v, mask=v_mask)

    g, beta = _log_decay_and_beta(a + n * ab_row_stride, b + n * ab_row_stride, neg_A, dt_bias, h, NEG_EIGVAL)
    tl.store(g_out + head, g)
    tl.store(beta_out + head, beta)

    if COPY_X:   # the raw conv inputs of this head's channels: the conv-window factor
        tl.store(x_out + n * C + q_ch, tl.load(x + n * x_row_stride + q_ch, mask=k_mask), mask=k_mask)
        tl.store(x_out + n * C + k_ch, tl.load(x + n * x_row_stride + k_ch, mask=k_mask), mask=k_mask)
        tl.store(x_out + n * C + v_ch, tl.load(x + n * x_row_stride + v_ch, mask=v_mask), mask=v_mask)


@triton.jit
def _conv_gates_kernel(x, x_row_stride, window, window_stride, index, weight, bias,
                       a, b, ab_row_stride, neg_A, dt_bias,
                       q_out, k_out, v_out, g_out, beta_out, x_out, C, scale, pf, pf_bytes,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
                       HAS_BIAS: tl.constexpr, NEG_EIGVAL: tl.constexpr, COPY_X: tl.constexpr,
                       PREFETCH: tl.constexpr = 0):
    if PREFETCH != 0:   # no weights streamed here: L2 fetches the next kernel's meanwhile
        l2_prefetch_share(pf, pf_bytes, tl.program_id(1) * tl.num_programs(0) + tl.program_id(0),
                          tl.num_programs(0) * H)
    _conv_gates_node(x, x_row_stride, window, window_stride, index, weight, bias, a, b, ab_row_stride,
                     neg_A, dt_bias, q_out, k_out, v_out, g_out, beta_out, x_out, C, scale,
                     tl.program_id(0), tl.program_id(1), H, K, V, W, BK, BV, BW, HAS_BIAS, NEG_EIGVAL, COPY_X)


def conv_gates(x: torch.Tensor, window: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor,
               dt_bias: torch.Tensor, head_dim: int, head_v_dim: int, neg_eigval: bool = False,
               k_out: torch.Tensor | None = None, g_out: torch.Tensor | None = None,
               x_out: torch.Tensor | None = None, prefetch: torch.Tensor | None = None):
    """`conv_gates_ref`, in one launch. x [1,N,C] and a, b [1,N,H] may be column slices of
    one projection output (rows strided); window [1,C,W-1] a view of the conv cache. The
    optional outputs receive k [1,N,H,K] and g [1,N,H] (fp32) and a copy of x [1,N,C]: the
    factors a commit needs. Returns (q, k, v, g, beta) as the reference does. prefetch: the next
    kernel's weights, whose first bytes the programs ask L2 for (`kernels/l2_prefetch.py`)."""
    _, N, C = x.shape
    H, K, V = a.shape[-1], head_dim, head_v_dim
    W = weight.shape[1]
    if C != H * (2 * K + V) or weight.shape[0] != C or index.shape != (N, W):
        raise ValueError(f"conv_gates: x {tuple(x.shape)}, weight {tuple(weight.shape)}, index "
                         f"{tuple(index.shape)} do not fit H={H}, K={K}, V={V}")
    if x.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1 or window.stride(-1) != 1:
        raise ValueError("conv_gates: the last dimension of x, a, b and window must be contiguous")
    if a.stride(1) != b.stride(1):
        raise ValueError("conv_gates: a and b must share their row stride")
    dev = x.device
    q = torch.empty(1, N, H, K, device=dev, dtype=torch.float32)
    v = torch.empty(1, N, H, V, device=dev, dtype=torch.float32)
    beta = torch.empty(1, N, H, device=dev, dtype=torch.float32)
    k = k_out if k_out is not None else torch.empty(1, N, H, K, device=dev, dtype=torch.float32)
    g = g_out if g_out is not None else torch.empty(1, N, H, device=dev, dtype=torch.float32)
    for name, t, shape in (("k_out", k, (1, N, H, K)), ("g_out", g, (1, N, H))):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"conv_gates: {name} must be a contiguous fp32 tensor of shape {shape}")
    if x_out is not None and (tuple(x_out.shape) != (1, N, C) or not x_out.is_contiguous()):
        raise ValueError(f"conv_gates: x_out must be contiguous of shape {(1, N, C)}")
    pf, pf_bytes, pf_mode = prefetch_args(prefetch, dev, N)
    _conv_gates_kernel[(N, H)](
        x, x.stride(1), window, window.stride(1), index.contiguous(), weight.contiguous(),
        bias, a, b, a.stride(1), neg_A, dt_bias, q, k, v, g, beta,
        x_out if x_out is not None else x, C, head_dim ** -0.5, x if pf is None else pf, pf_bytes,
        H=H, K=K, V=V, W=W, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
        BW=triton.next_power_of_2(W), HAS_BIAS=bias is not None, NEG_EIGVAL=neg_eigval,
        COPY_X=x_out is not None, PREFETCH=pf_mode, num_warps=4 if max(K, V) >= 256 else 2)
    return q, k, v, g, beta


@triton.jit
def _shift_window(cache, stride, x, channels, c_mask, o_w, w_mask, W: tl.constexpr):
    """cache[c, :] <- cache[c, 1:] + [x[c]] for `channels`: the conv inputs, x newest. Every
    thread's loads land before any thread's store (the slots overlap)."""
    older = tl.load(cache + channels[None, :] * stride + o_w[:, None] + 1,
                    mask=(o_w < W - 1)[:, None] & c_mask[None, :], other=0.0)
    newest = tl.load(x + channels, mask=c_mask, other=0.0).to(older.dtype)
    shifted = tl.where((o_w == W - 1)[:, None], newest[None, :], older)
    tl.debug_barrier()
    tl.store(cache + channels[None, :] * stride + o_w[:, None], shifted, mask=w_mask[:, None] & c_mask[None, :])


@triton.jit
def _head_queries_and_gates(x, window, cache_stride, weight, bias, a, b, neg_A, dt_bias, h, scale,
                            H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BK: tl.constexpr,
                            BW: tl.constexpr, HAS_BIAS: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """One AR token's q, k (conv, SiLU, l2 norm) and decay, beta for head h. `window` is the
    conv cache's last W-1 slots (cache + 1), x the token's conv inputs."""
    o_w = tl.arange(0, BW)
    w_mask = o_w < W
    in_window = o_w < W - 1            # rows 0..W-2: cache slots 1..W-1; row W-1: x
    o_k = tl.arange(0, BK)
    k_mask = o_k < K
    q = _node_conv(x, 0, window, cache_stride, weight, bias, o_w, in_window, o_w, w_mask,
                   h * K + o_k, k_mask, W, HAS_BIAS)
    k = _node_conv(x, 0, window, cache_stride, weight, bias, o_w, in_window, o_w, w_mask,
                   H * K + h * K + o_k, k_mask, W, HAS_BIAS)
    g, beta = _log_decay_and_beta(a, b, neg_A, dt_bias, h, NEG_EIGVAL)
    return _l2_normed(q, scale), _l2_normed(k, 1.0), tl.exp(g), beta


@triton.jit
def _state_tile_step(x, window, cache_stride, weight, bias, S, o, q, k, decay, beta, h, v0,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The delta-rule step on columns [v0, v0 + BV) of head h's [K, V] state S (fp32, in
    place), with their v channels' conv; writes those columns of o (fp32 [H, V])."""
    o_w = tl.arange(0, BW)
    w_mask = o_w < W
    o_k = tl.arange(0, BK)
    k_mask = o_k < K
    o_v = v0 + tl.arange(0, BV)
    v_mask = o_v < V
    v = _node_conv(x, 0, window, cache_stride, weight, bias, o_w, o_w < W - 1, o_w, w_mask,
                   2 * H * K + h * V + o_v, v_mask, W, HAS_BIAS)
    tile = S + h * K * V + o_k[:, None] * V + o_v[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(tile, mask=mask, other=0.0) * decay
    delta = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * delta[None, :]
    tl.store(tile, s, mask=mask)
    tl.store(o + h * V + o_v, tl.sum(s * q[:, None], axis=0), mask=v_mask)


@triton.jit
def _shift_head_window(cache, cache_stride, x, h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr):
    """Shift head h's q, k and v channels of the conv cache by one, x newest."""
    o_w = tl.arange(0, BW)
    w_mask = o_w < W
    o_k = tl.arange(0, BK)
    _shift_window(cache, cache_stride, x, h * K + o_k, o_k < K, o_w, w_mask, W)
    _shift_window(cache, cache_stride, x, H * K + h * K + o_k, o_k < K, o_w, w_mask, W)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        _shift_window(cache, cache_stride, x, 2 * H * K + h * V + o_v, o_v < V, o_w, w_mask, W)


@triton.jit
def _conv_recurrent_step_kernel(x, cache, cache_stride, weight, bias, a, b, neg_A, dt_bias, S, o, scale,
                                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                                BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
                                HAS_BIAS: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """One head: conv + SiLU of its q, k, v channels, the gates, the delta-rule step on its
    [K, V] state in V tiles of BV, and the shift of its conv inputs. One program owns all of a
    head's channels, so no program reads a conv window another one is shifting."""
    h = tl.program_id(0)
    window = cache + 1
    q, k, decay, beta = _head_queries_and_gates(x, window, cache_stride, weight, bias, a, b, neg_A, dt_bias,
                                                h, scale, H, K, W, BK, BW, HAS_BIAS, NEG_EIGVAL)
    for v0 in range(0, V, BV):
        _state_tile_step(x, window, cache_stride, weight, bias, S, o, q, k, decay, beta, h, v0,
                         H, K, V, W, BK, BV, BW, HAS_BIAS)
    tl.debug_barrier()          # every conv above has read the window before it shifts
    _shift_head_window(cache, cache_stride, x, h, H, K, V, W, BK, BV, BW)


def conv_recurrent_step(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor, dt_bias: torch.Tensor,
                        S: torch.Tensor, head_dim: int, head_v_dim: int, neg_eigval: bool = False,
                        block_v: int | None = None) -> torch.Tensor:
    """`conv_recurrent_step_ref` in one launch, S and cache updated in place: x [1,1,C] and
    a, b [1,1,H] may be column slices of one projection row; cache [1,C,W] contiguous; S
    [1,H,K,V] fp32 contiguous. Returns o [1,1,H,V] fp32. One program a head: meant for small
    heads (a launch-bound step), where a head's state is a few register tiles."""
    C, W = cache.shape[1], cache.shape[2]
    H, K, V = a.shape[-1], head_dim, head_v_dim
    if x.shape != (1, 1, C) or C != H * (2 * K + V) or weight.shape != (C, W):
        raise ValueError(f"conv_recurrent_step: x {tuple(x.shape)}, cache {tuple(cache.shape)}, weight "
                         f"{tuple(weight.shape)} do not fit H={H}, K={K}, V={V}")
    if S.shape != (1, H, K, V) or S.dtype != torch.float32 or not S.is_contiguous():
        raise ValueError(f"conv_recurrent_step: S must be a contiguous fp32 [1, {H}, {K}, {V}] state")
    if not cache.is_contiguous() or x.stride(-1) != 1:
        raise ValueError("conv_recurrent_step: the cache must be contiguous and x's channels contiguous")
    o = torch.empty(1, 1, H, V, device=x.device, dtype=torch.float32)
    BK = triton.next_power_of_2(K)
    BV = block_v or min(triton.next_power_of_2(V), max(16, 4096 // BK))    # <= 4096 state values a tile
    _conv_recurrent_step_kernel[(H,)](
        x, cache, cache.stride(1), weight.contiguous(), bias, a, b, neg_A, dt_bias, S, o, K ** -0.5,
        H=H, K=K, V=V, W=W, BK=BK, BV=BV, BW=triton.next_power_of_2(W), HAS_BIAS=bias is not None,
        NEG_EIGVAL=neg_eigval, num_warps=4)
    return o
