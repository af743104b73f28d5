"""One AR token of the gated delta rule for large heads, launched with programmatic dependent
launch (`kernels/pdl.py`).

Each program owns one [K, BV] tile of one head's fp32 state: it l2-normalises the head's q
and k, computes the decay and beta from the raw gate projections, decays the tile, applies
the delta rule and writes its columns of the output. The arithmetic is fla's fused recurrent
kernel's; the difference is the launch (`PDL_MODE`). Every program signals its dependents at
its top, so the next kernel (the output projection, whose first weight tile loads before its
wait) is scheduled while this one runs. Launched early itself ("launch"), nothing is read
before `gdc_wait`, the state included (another kernel of the same graph may write it).
Reference: `kernels/reference.recurrent_step_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.l2_prefetch import l2_prefetch_share, prefetch_args
from kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_applies
from kernels.triton_conv_gates import _l2_normed, _log_decay_and_beta

# How the kernel takes part in programmatic dependent launch: "signal" (launched plainly, so it
# waits for the input projection as any launch does, but lets the output projection after it
# be scheduled early), "launch" (also launched early itself), "off". The 1.3B AR step on the
# H100 (benchmarks/results/h100/session26/): "signal" 1.3558 ms/token, "off" 1.3650, fla's
# kernel 1.3833 in one run; "launch" 1.4122 against fla's 1.3813 in another (its kernel sum
# fell 18 us, but its early programs held the SMs the input projection's tail needed).
PDL_MODE = "signal"


@triton.jit
def _recurrent_step_kernel(q, k, v, a, b, neg_A, dt_bias, S, o, scale, pf, pf_bytes,
                           K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           NEG_EIGVAL: tl.constexpr, SIGNAL: tl.constexpr = False, PDL: tl.constexpr = False,
                           PREFETCH: tl.constexpr = 0):
    if SIGNAL or PDL:
        gdc_launch_dependents()
    i_v, h = tl.program_id(0), tl.program_id(1)
    if PREFETCH != 0:   # the step streams no weights: L2 fetches the next kernel's meanwhile
        l2_prefetch_share(pf, pf_bytes, h * tl.num_programs(0) + i_v, tl.num_programs(0) * tl.num_programs(1))
    if PDL:
        gdc_wait()
    o_k = tl.arange(0, BK)
    k_mask = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    v_mask = o_v < V
    qh = _l2_normed(tl.load(q + h * K + o_k, mask=k_mask, other=0.0).to(tl.float32), scale)
    kh = _l2_normed(tl.load(k + h * K + o_k, mask=k_mask, other=0.0).to(tl.float32), 1.0)
    g, beta = _log_decay_and_beta(a, b, neg_A, dt_bias, h, NEG_EIGVAL)
    vh = tl.load(v + h * V + o_v, mask=v_mask, other=0.0).to(tl.float32)
    tile = S + h * K * V + o_k[:, None] * V + o_v[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(tile, mask=mask, other=0.0) * tl.exp(g)
    delta = beta * (vh - tl.sum(s * kh[:, None], axis=0))
    s = s + kh[:, None] * delta[None, :]
    tl.store(tile, s, mask=mask)
    tl.store(o + h * V + o_v, tl.sum(s * qh[:, None], axis=0).to(o.dtype.element_ty), mask=v_mask)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   neg_A: torch.Tensor, dt_bias: torch.Tensor, S: torch.Tensor, neg_eigval: bool = False,
                   block_v: int = 8, num_warps: int = 1, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """`recurrent_step_ref` in one launch, S updated in place: q, k [1,1,H,K], v [1,1,H,V]
    (each head's channels contiguous; column slices of one projection row are fine), a, b
    [1,1,H], S [1,H,K,V] fp32 contiguous. Returns o [1,1,H,V] in v's dtype. The default tile
    (8 columns, one warp) is fla's for this kernel. prefetch: the next kernel's weights, whose
    first bytes the programs ask L2 for at their start (`kernels/l2_prefetch.py`)."""
    H, K, V = q.shape[-2], q.shape[-1], v.shape[-1]
    if q.shape != (1, 1, H, K) or k.shape != q.shape or v.shape != (1, 1, H, V) or a.shape[-1] != H:
        raise ValueError(f"recurrent_step: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"a {tuple(a.shape)} are not one token of the same heads")
    if S.shape != (1, H, K, V) or S.dtype != torch.float32 or not S.is_contiguous():
        raise ValueError(f"recurrent_step: S must be a contiguous fp32 [1, {H}, {K}, {V}] state")
    if any(t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (q, k, v)):
        raise ValueError("recurrent_step: each head's q, k and v channels must follow one another")
    if triton.next_power_of_2(block_v) != block_v:
        raise ValueError(f"recurrent_step: block_v {block_v} must be a power of two")
    o = torch.empty(1, 1, H, V, device=v.device, dtype=v.dtype)
    options = launch_options(q.device) if PDL_MODE == "launch" else {}
    options["SIGNAL"] = PDL_MODE == "signal" and pdl_applies(q.device)
    pf, pf_bytes, options["PREFETCH"] = prefetch_args(prefetch, q.device)
    _recurrent_step_kernel[(triton.cdiv(V, block_v), H)](
        q, k, v, a, b, neg_A, dt_bias, S, o, K ** -0.5, S if pf is None else pf, pf_bytes,
        K=K, V=V, BK=triton.next_power_of_2(K), BV=block_v,
        NEG_EIGVAL=neg_eigval, num_warps=num_warps, **options)
    return o
