"""A layer's projections with the small op before each folded into one Triton kernel, for
the few rows of a decode step (an AR token or a draft's nodes, M <= 64).

Why: at batch 1 a GDN layer is ~11 kernels, and on a GPU every kernel costs ~2 us however
little it does (69 kernels, 152 us of kernel time for the embedded model's AR step, measured
in benchmarks/results/h200/session8/). The norms and the SwiGLU in front of the projections
are separate kernels that only scale the matrix's input, so they fit into the projection's
loop over the input dimension:

    norm        y = rms_norm(x + residual) @ W.T     (also writes x + residual)
    gated_norm  y = (rms_norm_per_head(o) * act(gate)) @ W.T
    swiglu      y = (silu(gu[:, :I]) * gu[:, I:]) @ W.T

Each program owns BN output columns for all rows; its prologue recomputes the scaled input
block by block (the norm's mean square in a first pass over x), which costs a re-read of x:
a few KB against the weights' hundreds. The arithmetic rounds where the plain-torch ops of
`kernels/reference.py` round (x + residual and every op's output in the input dtype), with
fp32 products accumulated in fp32; `reference.norm_linear_ref` and friends are the spec.

For a row or two (`gemv=True`) the products are summed in registers instead of by tl.dot,
whose tensor-core operands need 16 rows and a trip through shared memory.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

PROLOGUES = {"norm": 0, "gated_norm": 1, "swiglu": 2}
MAX_ROWS = 64              # [BM, BK] input blocks live in registers
MAX_GEMV_ROWS = 2          # the GEMV form's [BM, BN, BK] products too


@triton.jit
def _dot(h, w, DOT: tl.constexpr):
    """h [BM, BK] @ w[BN, BK].T, fp32 accumulation. DOT "ieee": fp32 operands as plain fp32
    FMA (not the GPU's default tf32); "native": bf16 tensor-core products; "emulate": the
    bf16 product in fp32 (Triton's CPU interpreter gets bf16 dots wrong; the values are a
    bf16 dot's, bar the order of the sums)."""
    if DOT == "ieee":
        return tl.dot(h, tl.trans(w), input_precision="ieee")
    if DOT == "emulate":
        return tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(h, tl.trans(w))


@triton.jit
def _summed_input(x, x_stride, res, res_stride, rows, r_mask, ks, k_mask, HAS_RES: tl.constexpr):
    """x + residual for one [BM, BK] block, rounded to x's dtype as a torch add is; fp32."""
    mask = r_mask[:, None] & k_mask[None, :]
    r = tl.load(x + rows[:, None] * x_stride + ks[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r2 = tl.load(res + rows[:, None] * res_stride + ks[None, :], mask=mask, other=0.0)
        r = (r.to(tl.float32) + r2.to(tl.float32)).to(x.dtype.element_ty)
    return r.to(tl.float32)


@triton.jit
def _projection_kernel(x, x_stride, res, res_stride, res_out, gate, gate_stride, norm_w, w, y, y_stride,
                       M, N, K, eps,
                       PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, SWISH: tl.constexpr,
                       DOT: tl.constexpr, GEMV: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BM)
    r_mask = rows < M
    cols = pid * BN + tl.arange(0, BN)
    c_mask = cols < N
    dtype = w.dtype.element_ty
    rstd = tl.zeros([BM], dtype=tl.float32)
    if PROLOGUE == 0:        # the norm's mean square, over the whole row first
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            r = _summed_input(x, x_stride, res, res_stride, rows, r_mask, ks, ks < K, HAS_RES)
            ss += tl.sum(r * r, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_mask = ks < K
        mask = r_mask[:, None] & k_mask[None, :]
        if PROLOGUE == 0:
            r = _summed_input(x, x_stride, res, res_stride, rows, r_mask, ks, k_mask, HAS_RES)
            if HAS_RES and pid == 0:
                tl.store(res_out + rows[:, None] * K + ks[None, :], r.to(dtype), mask=mask)
            nw = tl.load(norm_w + ks, mask=k_mask, other=0.0).to(tl.float32)
            h = ((r * rstd[:, None]) * nw[None, :]).to(dtype)
        elif PROLOGUE == 1:  # one head per block (BK = the head's width): its norm is local
            o = tl.load(x + rows[:, None] * x_stride + ks[None, :], mask=mask, other=0.0)
            o = o.to(dtype).to(tl.float32)
            o = o / tl.sqrt(tl.sum(o * o, axis=1) / BK + eps)[:, None]
            nw = tl.load(norm_w + tl.arange(0, BK)).to(tl.float32)
            normed = (o * nw[None, :]).to(dtype).to(tl.float32)
            gt = tl.load(gate + rows[:, None] * gate_stride + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            if SWISH:
                act = (gt * tl.sigmoid(gt)).to(dtype).to(tl.float32)
            else:
                act = tl.sigmoid(gt).to(dtype).to(tl.float32)
            h = (normed * act).to(dtype)
        else:                # swiglu: x holds [gate | up], K = I columns each
            a = tl.load(x + rows[:, None] * x_stride + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            b = tl.load(x + rows[:, None] * x_stride + K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            h = ((a * tl.sigmoid(a)).to(dtype).to(tl.float32) * b).to(dtype)
        wb = tl.load(w + cols[:, None] * K + ks[None, :], mask=c_mask[:, None] & k_mask[None, :], other=0.0)
        if GEMV:     # a row or two: products and sums in registers, no tensor-core operand layout
            acc += tl.sum(h.to(tl.float32)[:, None, :] * wb.to(tl.float32)[None, :, :], axis=2)
        else:
            acc += _dot(h, wb, DOT)
    tl.store(y + rows[:, None] * y_stride + cols[None, :], acc.to(dtype),
             mask=r_mask[:, None] & c_mask[None, :])


def _dot_mode(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "ieee"
    return "emulate" if os.environ.get("TRITON_INTERPRET") == "1" else "native"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [M, K] with unit column stride (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(prologue: str, x2, w, *, res=None, res_out=None, gate=None, norm_w=None, eps=0.0,
            swish=True, block_k: int | None = None, block_n: int | None = None,
            num_stages: int | None = None, gemv: bool = False) -> torch.Tensor:
    M, N = x2.shape[0], w.shape[0]
    K = w.shape[1]
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows: the fused projection takes at most {MAX_ROWS}")
    if not w.is_contiguous():
        raise ValueError("the weight must be contiguous [N, K]")
    y = torch.empty(M, N, device=x2.device, dtype=w.dtype)
    # tl.dot takes 16 rows at least; the GEMV form holds [BM, BN, BK] products, so a row or two
    BM = triton.next_power_of_2(M) if gemv else max(16, triton.next_power_of_2(M))
    if gemv and BM > MAX_GEMV_ROWS:
        raise ValueError(f"{M} rows: the GEMV form takes at most {MAX_GEMV_ROWS}")
    BK = block_k or min(128, max(16, triton.next_power_of_2(K)))
    # one program per BN columns streams BN x K weights: narrow blocks keep more SMs busy (there
    # is no split-K, so a GDN-1.3B-width matrix still loads each program with ~180 KB)
    BN = block_n or (16 if N < 4096 else 32)
    dummy = y
    options = {"num_warps": 4} if num_stages is None else {"num_warps": 4, "num_stages": num_stages}
    _projection_kernel[(triton.cdiv(N, BN),)](
        x2, x2.stride(0), res if res is not None else dummy, res.stride(0) if res is not None else 0,
        res_out if res_out is not None else dummy, gate if gate is not None else dummy,
        gate.stride(0) if gate is not None else 0, norm_w if norm_w is not None else dummy, w, y, y.stride(0),
        M, N, K, eps, PROLOGUE=PROLOGUES[prologue], HAS_RES=res is not None, SWISH=swish,
        DOT=_dot_mode(w.dtype), GEMV=gemv, BM=BM, BN=BN, BK=BK, **options)
    return y


def norm_linear(x: torch.Tensor, norm_w: torch.Tensor, eps: float, residual: torch.Tensor | None,
                w: torch.Tensor, **blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ w.T, x + residual) for x [..., K], w [N, K]. `blocks`
    (block_k, block_n, num_stages, gemv) override the kernel's tiling, for benchmarks."""
    x2 = _rows(x)
    res2 = _rows(residual) if residual is not None else None
    summed = torch.empty_like(x2) if residual is not None else x2
    y = _launch("norm", x2, w, res=res2, res_out=summed if residual is not None else None,
                norm_w=norm_w, eps=eps, **blocks)
    return y.view(*x.shape[:-1], -1), summed.view(x.shape)


def gated_norm_linear(o: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, eps: float,
                      activation: str, w: torch.Tensor, **blocks) -> torch.Tensor:
    """(rms_norm over each head of o [..., H, V], times act(gate) [..., H*V]) @ w.T. `blocks`
    (block_n, num_stages, gemv) override the tiling; the K block is always the head width."""
    V = o.shape[-1]
    if triton.next_power_of_2(V) != V or V < 16:
        raise ValueError(f"head width {V}: the fused gated norm takes powers of two from 16")
    o2 = _rows(o.reshape(*o.shape[:-2], -1))
    y = _launch("gated_norm", o2, w, gate=_rows(gate), norm_w=norm_w, eps=eps,
                swish=activation in ("swish", "silu"), block_k=V, **blocks)
    return y.view(*o.shape[:-2], -1)


def swiglu_linear(gate_up: torch.Tensor, w: torch.Tensor, **blocks) -> torch.Tensor:
    """(silu(gate_up[..., :I]) * gate_up[..., I:]) @ w.T for w [N, I]."""
    y = _launch("swiglu", _rows(gate_up), w, **blocks)
    return y.view(*gate_up.shape[:-1], -1)
