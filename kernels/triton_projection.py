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

Each program owns BN output columns for all rows and a range of the input dimension K; its
prologue recomputes the scaled input block by block (the norm's mean square in a first pass
over the whole row), which costs a re-read of x: a few KB against the weights' hundreds. The
arithmetic rounds where the plain-torch ops of `kernels/reference.py` round (x + residual and
every op's output in the input dtype), with fp32 products accumulated in fp32;
`reference.norm_linear_ref` and friends are the spec.

A decode step is bound by streaming the weights, so the tiling is about bytes in flight:

- GEMV form (`gemv=True`, a row or two): each thread sums its 16 bytes of a weight row into
  a [BN, BK / 8] fp32 register accumulator inside the loop (its lanes summed across threads
  once after it), and the next weight tile is loaded before the current one is used, so each
  program keeps two tiles of loads outstanding and never waits on a cross-thread reduction
  inside the loop. No tensor-core operand layout.
- dot form (up to 64 rows): tl.dot on a 16-row (or wider) block, pipelined by `num_stages`.
- split-K (`split_k`): when N has too few column blocks to fill the GPU, SPLIT programs per
  column block each take a slice of K and write fp32 partials; the last program of a column
  block to arrive sums them in the fixed order 0..SPLIT-1, so the result has the same bits on
  every run (a CUDA-graph replay must match an eager run token for token).

The gated norm's K blocks are whole heads (one or several): each head's norm is local to
its block. With no tiling keywords `_launch` picks a tiling from M, N and K (`_tiling`).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from kernels.l2_prefetch import l2_prefetch_share, prefetch_args
from kernels.pdl import gdc_launch_dependents, gdc_wait, grid_wait, launch_options

PROLOGUES = {"norm": 0, "gated_norm": 1, "swiglu": 2}
MAX_ROWS = 64              # [BM, BK] input blocks live in registers
MAX_GEMV_ROWS = 2          # the GEMV form: one [BN, BK] accumulator a row
MAX_SPLIT = 16
# Below this many weight bytes a projection is latency-bound at batch 1 (the embedded
# model's are 0.3-1.5 MB): the time goes to dependent round trips, not bytes in flight, so
# its default tiling trades grid size for fewer of them (`_latency_bound_tiling`).
LATENCY_BOUND_BYTES = 4 << 20
DEFAULT_SMS = 132          # an H200's, where the device cannot be asked (the interpreter)
# The swapped tl.dot form (`_swapped_tiling`) is the default for 3 to SWAP_MAX_ROWS rows of a
# matrix of at least SWAP_MIN_BYTES weight bytes and at most SWAP_MAX_COLUMNS output columns
# (None: never). H100 sweep at 9 rows of the GDN-1.3B shape (benchmarks/results/h100/session23/):
# the 2048-column out and down projections took 10.4 and 12.3 us a layer against 10.9 and 14.4
# for fla's norm or SwiGLU kernel + cuBLAS, the 8208- and 11264-column in and up 25.6 and 27.9
# against cuBLAS's 15.5 and 20.1.
SWAP_MIN_BYTES: int | None = LATENCY_BOUND_BYTES
SWAP_MAX_ROWS = 16
SWAP_MAX_COLUMNS = 4096
# shared memory the swapped form's pipeline may take: sm_90 has 227 KB a block, and Triton
# buffers num_stages - 1 pairs of weight and input tiles (ptxas-free check: a 4-stage
# [64, 256] fp32 tile with 16 input rows asked for 240 KB + a few for barriers)
SWAP_SHARED_BYTES = 192 << 10
# whether the swapped form's default tiling for the gated norm loads each K block's inputs into
# registers a block ahead (`_dot_slice`'s PRELOAD) and splits K down to one block a slice. H100
# sweep at 9 rows of the 1.3B out projection (benchmarks/results/h100/session30/): 7.31 us a
# layer against 10.40 for the tiling without it (Triton's pipeliner then stages the inputs in
# shared memory beside the weights: 213 KB, one program an SM, by ncu); the SwiGLU down
# projection got slower with it (14.27 against 12.24), so it keeps the plain form.
SWAP_PRELOAD = True
# (block_n, block_k, split_k) of the GEMV form where the column blocks alone do not fill the
# GPU (the 1.3B shape's out and down projections); None: `_tiling`'s rule. An H100 sweep of six
# (benchmarks/gemv_best.py) found none better than the rule: 17.79-18.11 us for the two against
# its 17.94, and AR 1.4105 ms/token with the best against 1.4111 (h100/session26/).
FEW_BLOCKS_TILING: tuple[int, int, int] | None = None


def swaps(M: int, N: int, weight_bytes: int) -> bool:
    """Whether a call of M rows and N output columns with no tiling keywords runs the
    swapped tl.dot form."""
    return (MAX_GEMV_ROWS < M <= SWAP_MAX_ROWS and N <= SWAP_MAX_COLUMNS and SWAP_MIN_BYTES is not None
            and weight_bytes >= SWAP_MIN_BYTES)


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
def _dot_swapped(h, w, DOT: tl.constexpr):
    """w[BN, BK] @ h[BM, BK].T -> [BN, BM]: `_dot` with the weight tile as the MMA's M side.
    Hopper's warpgroup MMA takes 64 rows or more on that side; 16 input rows alone get the
    small synchronous MMA."""
    if DOT == "ieee":
        return tl.dot(w, tl.trans(h), input_precision="ieee")
    if DOT == "emulate":
        return tl.dot(w.to(tl.float32), tl.trans(h.to(tl.float32)), input_precision="ieee")
    return tl.dot(w, tl.trans(h))


@triton.jit
def _raw_block(src, rows, r_mask, ks, k_mask, K, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):
    """The two [BM, BK] tiles the prologue reads for one input block, as loaded: (x,
    residual) for the norm (x twice without one), (o, gate) for the gated norm, (gate, up)
    for SwiGLU. Split from the arithmetic so a loop can issue the next block's loads before
    it works on this one (`_dot_slice`'s PRELOAD)."""
    x, x_stride, res, res_stride, gate, gate_stride = src[0], src[1], src[2], src[3], src[5], src[6]
    mask = r_mask[:, None] & k_mask[None, :]
    first = tl.load(x + rows[:, None] * x_stride + ks[None, :], mask=mask, other=0.0)
    if PROLOGUE == 0:
        if HAS_RES:
            second = tl.load(res + rows[:, None] * res_stride + ks[None, :], mask=mask, other=0.0)
        else:
            second = first
    elif PROLOGUE == 1:
        second = tl.load(gate + rows[:, None] * gate_stride + ks[None, :], mask=mask, other=0.0)
    else:
        second = tl.load(x + rows[:, None] * x_stride + K + ks[None, :], mask=mask, other=0.0)
    return first, second


@triton.jit
def _summed(first, second, HAS_RES: tl.constexpr):
    """x + residual from `_raw_block`'s tiles, rounded to x's dtype as a torch add is; fp32."""
    r = first
    if HAS_RES:
        r = (first.to(tl.float32) + second.to(tl.float32)).to(first.dtype)
    return r.to(tl.float32)


@triton.jit
def _summed_input(src, rows, r_mask, ks, k_mask, HAS_RES: tl.constexpr):
    """x + residual for one [BM, BK] block, rounded to x's dtype as a torch add is; fp32.
    `src` is the kernel's inputs (x, x_stride, res, res_stride, res_out, gate, gate_stride,
    norm_w)."""
    first, second = _raw_block(src, rows, r_mask, ks, k_mask, 0, 0, HAS_RES)
    return _summed(first, second, HAS_RES)


@triton.jit
def _row_rstd(src, rows, r_mask, K, eps, HAS_RES: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """1 / rms of each row of x + residual over all K columns (every K slice needs it)."""
    ss = tl.zeros([BM, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        r = _summed_input(src, rows, r_mask, ks, ks < K, HAS_RES)
        ss += r * r
    return 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _input_block(src, rstd, eps, rows, r_mask, ks, k_mask, K, write_res, dtype: tl.constexpr,
                 PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, SWISH: tl.constexpr,
                 HEAD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """The prologue's output for one [BM, BK] block of the matrix's input, in `dtype`."""
    first, second = _raw_block(src, rows, r_mask, ks, k_mask, K, PROLOGUE, HAS_RES)
    return _prologue(first, second, src, rstd, eps, rows, r_mask, ks, k_mask, K, write_res, dtype,
                     PROLOGUE, HAS_RES, SWISH, HEAD, BM, BK)


@triton.jit
def _prologue(first, second, src, rstd, eps, rows, r_mask, ks, k_mask, K, write_res, dtype: tl.constexpr,
              PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, SWISH: tl.constexpr,
              HEAD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """`_input_block`'s arithmetic on the tiles `_raw_block` loaded for it."""
    res_out, norm_w = src[4], src[7]
    mask = r_mask[:, None] & k_mask[None, :]
    if PROLOGUE == 0:
        r = _summed(first, second, HAS_RES)
        if HAS_RES:
            if write_res:
                tl.store(res_out + rows[:, None] * K + ks[None, :], r.to(dtype), mask=mask)
        nw = tl.load(norm_w + ks, mask=k_mask, other=0.0).to(tl.float32)
        h = ((r * rstd[:, None]) * nw[None, :]).to(dtype)
    elif PROLOGUE == 1:  # BK / HEAD whole heads (the K slices start on head boundaries)
        o = tl.reshape(first.to(dtype).to(tl.float32), [BM, BK // HEAD, HEAD])
        o = o / tl.sqrt(tl.sum(o * o, axis=2) / HEAD + eps)[:, :, None]
        nw = tl.load(norm_w + tl.arange(0, BK) % HEAD).to(tl.float32)
        normed = (tl.reshape(o, [BM, BK]) * nw[None, :]).to(dtype).to(tl.float32)
        gt = second.to(tl.float32)
        if SWISH:
            act = (gt * tl.sigmoid(gt)).to(dtype).to(tl.float32)
        else:
            act = tl.sigmoid(gt).to(dtype).to(tl.float32)
        h = (normed * act).to(dtype)
    else:                # swiglu: x holds [gate | up], K = I columns each
        a = first.to(tl.float32)
        h = ((a * tl.sigmoid(a)).to(dtype).to(tl.float32) * second.to(tl.float32)).to(dtype)
    return h


@triton.jit
def _packed_products(w_tile, h, BN: tl.constexpr, BK: tl.constexpr, VEC: tl.constexpr):
    """w_tile * h [1, BK] summed over each run of VEC columns -> [BN, BK // VEC] fp32. A thread
    holds VEC consecutive columns of a row (one 16-byte load), so the sum stays in the thread
    and the accumulator takes BK / VEC registers a row instead of BK (the 1.3B in-projection:
    105 registers a thread against 205, ptxas sm_90): more programs fit an SM and more weight
    loads are in flight. VEC = 1 is a plain [BN, BK] accumulator."""
    return tl.sum(tl.reshape(w_tile.to(tl.float32) * h.to(tl.float32), [BN, BK // VEC, VEC]), axis=2)


@triton.jit
def _gemv_slice(src, w_rows, c_mask, k_lo, k_hi, M, K, eps, write_res, dtype: tl.constexpr,
                PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, SWISH: tl.constexpr, HEAD: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WAIT: tl.constexpr, VEC: tl.constexpr,
                sync):
    """[BM, BN] fp32 products over the K columns [k_lo, k_hi), for one or two rows. Each row
    has its own [BN, BK // VEC] accumulator in the weight tile's own register layout (a
    [BM, BN, BK] one would move every tile through shared memory to a 3-D layout), summed
    across threads once after the loop; the next tile is loaded before this one's products,
    so each program keeps two tiles of loads outstanding. The first tile is loaded before
    anything written by another kernel or program is read: WAIT 1 then waits for the
    previous kernel (programmatic dependent launch), WAIT 2 for a grid barrier of a
    persistent kernel, `sync` = (counter, arrivals, status) as `grid_wait` takes them."""
    offs = tl.arange(0, BK)
    wb = tl.load(w_rows + k_lo + offs[None, :], mask=c_mask[:, None] & (k_lo + offs < k_hi)[None, :], other=0.0)
    if WAIT == 1:
        gdc_wait()
    if WAIT == 2:
        grid_wait(sync[0], sync[1], sync[2])
    row0 = tl.arange(0, 1)
    row1 = row0 + 1
    rstd0 = tl.zeros([1], dtype=tl.float32)
    rstd1 = tl.zeros([1], dtype=tl.float32)
    if PROLOGUE == 0:
        rstd0 = _row_rstd(src, row0, row0 < M, K, eps, HAS_RES, 1, BK)
        if BM == 2:
            rstd1 = _row_rstd(src, row1, row1 < M, K, eps, HAS_RES, 1, BK)
    acc0 = tl.zeros([BN, BK // VEC], dtype=tl.float32)
    acc1 = tl.zeros([BN, BK // VEC], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + offs
        nks = ks + BK
        w_next = tl.load(w_rows + nks[None, :], mask=c_mask[:, None] & (nks < k_hi)[None, :], other=0.0)
        h0 = _input_block(src, rstd0, eps, row0, row0 < M, ks, ks < k_hi, K, write_res, dtype,
                          PROLOGUE, HAS_RES, SWISH, HEAD, 1, BK)
        acc0 += _packed_products(wb, h0, BN, BK, VEC)
        if BM == 2:
            h1 = _input_block(src, rstd1, eps, row1, row1 < M, ks, ks < k_hi, K, write_res, dtype,
                              PROLOGUE, HAS_RES, SWISH, HEAD, 1, BK)
            acc1 += _packed_products(wb, h1, BN, BK, VEC)
        wb = w_next
    acc = tl.sum(acc0, axis=1)[None, :]
    if BM == 2:
        acc = tl.where(tl.arange(0, BM)[:, None] == 0, acc, tl.sum(acc1, axis=1)[None, :])
    return acc


@triton.jit
def _dot_slice(src, w_rows, c_mask, k_lo, k_hi, M, K, eps, write_res, dtype: tl.constexpr,
               PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, SWISH: tl.constexpr, HEAD: tl.constexpr,
               DOT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WAIT: tl.constexpr,
               sync, SWAP: tl.constexpr = False, PRELOAD: tl.constexpr = False, RSTD_BK: tl.constexpr = 0):
    """[BM, BN] fp32 products over the K columns [k_lo, k_hi) by tl.dot (num_stages
    pipelines the weight loads). WAIT 2: inside a persistent kernel, the first weight tile
    is loaded before the grid barrier `sync` (as `_gemv_slice` does) and each next tile
    before the current one's product. SWAP: the products as w @ h.T ([BN, BM], transposed
    once at the end), so a block of 64 or more weight rows fills the MMA's M side. PRELOAD
    (not with WAIT 2): the prologue's input tiles of the next K block are loaded before
    this block's arithmetic, so their round trip overlaps it instead of following it; the
    norm's mean square then sums RSTD_BK columns a step, not BK (fewer dependent loads)."""
    tl.static_assert(not (PRELOAD and WAIT == 2), "preload prefetches inputs; a persistent phase prefetches weights")
    rows = tl.arange(0, BM)
    r_mask = rows < M
    offs = tl.arange(0, BK)
    if WAIT == 2:
        wb = tl.load(w_rows + k_lo + offs[None, :], mask=c_mask[:, None] & (k_lo + offs < k_hi)[None, :], other=0.0)
        grid_wait(sync[0], sync[1], sync[2])
    rstd = tl.zeros([BM], dtype=tl.float32)
    if PROLOGUE == 0:
        if PRELOAD:
            rstd = _row_rstd(src, rows, r_mask, K, eps, HAS_RES, BM, RSTD_BK)
        else:
            rstd = _row_rstd(src, rows, r_mask, K, eps, HAS_RES, BM, BK)
    if SWAP:
        acc_t = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    if PRELOAD:
        first, second = _raw_block(src, rows, r_mask, k_lo + offs, k_lo + offs < k_hi, K, PROLOGUE, HAS_RES)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + offs
        k_mask = ks < k_hi
        if PRELOAD:
            nks = ks + BK
            next_first, next_second = _raw_block(src, rows, r_mask, nks, nks < k_hi, K, PROLOGUE, HAS_RES)
            h = _prologue(first, second, src, rstd, eps, rows, r_mask, ks, k_mask, K, write_res, dtype,
                          PROLOGUE, HAS_RES, SWISH, HEAD, BM, BK)
            first, second = next_first, next_second
        else:
            h = _input_block(src, rstd, eps, rows, r_mask, ks, k_mask, K, write_res, dtype,
                             PROLOGUE, HAS_RES, SWISH, HEAD, BM, BK)
        if WAIT == 2:
            nks = ks + BK
            w_next = tl.load(w_rows + nks[None, :], mask=c_mask[:, None] & (nks < k_hi)[None, :], other=0.0)
        else:
            wb = tl.load(w_rows + ks[None, :], mask=c_mask[:, None] & k_mask[None, :], other=0.0)
        if SWAP:
            acc_t += _dot_swapped(h, wb, DOT)
        else:
            acc += _dot(h, wb, DOT)
        if WAIT == 2:
            wb = w_next
    if SWAP:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def _conv_epilogue(y_row, cols, mask, cache, cache_stride, conv_w, conv_b,
                   W: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr):
    """One AR token's causal conv on a block of projection outputs y_row [1, BN] (already
    rounded to the output dtype): each column's cache row (the last W inputs, newest last)
    shifts by one with y newest, and the result is silu(window . conv_w + conv_b) in fp32,
    the arithmetic of fla's conv update (fp32 sum, one rounding by the caller)."""
    x = tl.reshape(y_row, [BN])
    taps = tl.arange(0, W)[None, :]
    rows = cache + cols[:, None] * cache_stride
    older = tl.load(rows + taps + 1, mask=mask[:, None] & (taps + 1 < W), other=0.0)
    window = tl.where(taps == W - 1, x[:, None].to(older.dtype), older)
    wt = tl.load(conv_w + cols[:, None] * W + taps, mask=mask[:, None], other=0.0).to(tl.float32)
    out = tl.sum(window.to(x.dtype).to(tl.float32) * wt, axis=1)
    if HAS_BIAS:
        out += tl.load(conv_b + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(rows + taps, window, mask=mask[:, None])
    return tl.reshape(out * tl.sigmoid(out), [1, BN])


@triton.jit
def _projection_kernel(x, x_stride, res, res_stride, res_out, gate, gate_stride, norm_w, w, y, y_stride,
                       partials, counters, M, N, K, K_SLICE, eps, conv_cache, conv_stride, conv_w, conv_b, C,
                       pf, pf_bytes,
                       PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, SWISH: tl.constexpr,
                       DOT: tl.constexpr, GEMV: tl.constexpr, SPLIT: tl.constexpr, HEAD: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False,
                       VEC: tl.constexpr = 1, SWAP: tl.constexpr = False, CONV_W: tl.constexpr = 0,
                       CONV_BIAS: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                       PRELOAD: tl.constexpr = False, RSTD_BK: tl.constexpr = 0):
    """y[:, BN columns] (or, split, one K slice's share of it) for all M rows.

    PDL (the GEMV form only): the first weight tile, which no kernel writes, is read before
    `gdc_wait`; the inputs, the split-K partials and counters, and every store after it.
    CONV_W > 0 (one row, no split): columns below C leave through `_conv_epilogue`.
    PREFETCH 1 / 2: at its start / once its weight loads are issued, each program asks L2 for
    its share of the pf_bytes at `pf` (the next kernel's weights, `kernels/l2_prefetch.py`)."""
    tl.static_assert(GEMV or not PDL, "programmatic dependent launch is for the GEMV form")
    if PDL:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    if PREFETCH == 1:
        l2_prefetch_share(pf, pf_bytes, pid_n * SPLIT + pid_s, tl.num_programs(0) * SPLIT)
    cols = pid_n * BN + tl.arange(0, BN)
    c_mask = cols < N
    k_lo = pid_s * K_SLICE
    k_hi = tl.minimum(K, k_lo + K_SLICE)
    src = (x, x_stride, res, res_stride, res_out, gate, gate_stride, norm_w)
    write_res = pid_n == 0     # one column block writes x + residual, each K slice its part
    w_rows = w + cols[:, None] * K
    if GEMV:
        acc = _gemv_slice(src, w_rows, c_mask, k_lo, k_hi, M, K, eps, write_res, w.dtype.element_ty,
                          PROLOGUE, HAS_RES, SWISH, HEAD, BM, BN, BK, 1 if PDL else 0, VEC,
                          (counters, 0, counters))    # no grid barrier: WAIT is not 2
    else:
        acc = _dot_slice(src, w_rows, c_mask, k_lo, k_hi, M, K, eps, write_res, w.dtype.element_ty,
                         PROLOGUE, HAS_RES, SWISH, HEAD, DOT, BM, BN, BK, 0, (counters, 0, counters), SWAP,
                         PRELOAD, RSTD_BK)
    if PREFETCH == 2:
        l2_prefetch_share(pf, pf_bytes, pid_n * SPLIT + pid_s, tl.num_programs(0) * SPLIT)
    rows = tl.arange(0, BM)
    out_mask = (rows < M)[:, None] & c_mask[None, :]
    y_ptrs = y + rows[:, None] * y_stride + cols[None, :]
    if SPLIT == 1:
        out = acc.to(y.dtype.element_ty)
        if CONV_W > 0:
            conv = _conv_epilogue(out, cols, c_mask & (cols < C), conv_cache, conv_stride, conv_w, conv_b,
                                  CONV_W, CONV_BIAS, BN)
            out = tl.where((cols < C)[None, :], conv.to(y.dtype.element_ty), out)
        tl.store(y_ptrs, out, mask=out_mask)
    else:
        _split_reduce(acc, partials, counters + pid_n, y_ptrs, rows[:, None] * N + cols[None, :], out_mask,
                      pid_s, M * N, SPLIT)


@triton.jit
def _split_reduce(acc, partials, counter, y_ptrs, offs, out_mask, pid_s, plane, SPLIT: tl.constexpr):
    """Publish this K slice's fp32 partial; the column block's last arriver sums all SPLIT
    partials in slice order (fixed, so the bits do not depend on which program came last),
    writes y and re-arms the counter for the next call. Nobody waits: fine in the interpreter,
    which runs the programs one after another."""
    tl.store(partials + pid_s * plane + offs, acc, mask=out_mask)
    # every thread's partial is stored before one thread's release publishes the arrival
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        # .cg: from L2, past this SM's L1, which other SMs' stores do not update
        total = tl.load(partials + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            total += tl.load(partials + s * plane + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=out_mask)
        tl.store(counter, 0)       # the next launch is stream-ordered after this one


@dataclasses.dataclass(frozen=True)
class Tiling:
    gemv: bool
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int | None = None
    packed: bool = True        # GEMV: each thread's 16 bytes of a row summed inside the K loop
    swap: bool = False         # tl.dot: the weight tile on the MMA's M side (`_dot_swapped`)
    preload: bool = False      # tl.dot: the next K block's input tiles loaded a block ahead


def _split_parts(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(slices actually used, columns a slice) for split_k slices of whole K blocks: a split
    that would leave a slice empty is reduced, so every program has work."""
    k_blocks = triton.cdiv(K, block_k)
    per = triton.cdiv(k_blocks, max(1, min(split_k, k_blocks, MAX_SPLIT)))
    return triton.cdiv(k_blocks, per), per * block_k


def _gemv_warps(block_k: int, elem: int) -> int:
    """Warps that give each thread one 16-byte load per weight row of a K block. Triton then
    lays the input row [1, BK] out as it lays the weight tile (in ptxas-checked sm_90 builds);
    with more warps the row gets 8-byte pieces, and the whole tile is converted to the row's
    layout through shared memory on every step."""
    return max(1, min(8, block_k * elem // 512))


def _tiling(M: int, N: int, K: int, elem: int, head: int, sms: int, gemv: bool | None = None,
            block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
            num_stages: int | None = None, num_warps: int | None = None,
            packed: bool | None = None, swap: bool | None = None, preload: bool | None = None) -> Tiling:
    """The caller's keywords, the rest chosen for a weight-streaming step: at least 2
    programs an SM, each streaming 1 KB of each weight row a K step (GEMV: 8 rows for one
    input row, 8 KB a tile; 4 rows for two; 2 KB a row where the column blocks alone do not
    fill the GPU) or 512 B
    (tl.dot: 16 rows, 8 KB), with the next tile in flight. Too few column blocks -> split K
    while each slice keeps >= 2 K blocks (so the GEMV prefetch overlaps), then narrower GEMV
    blocks, then single-block slices, then smaller K blocks (a small matrix is latency-bound:
    more programs with less each beat fewer with more)."""
    if (swap or preload) and gemv:
        raise ValueError("swap and preload are options of the tl.dot projection, not of the GEMV one")
    asked = (gemv, block_n, block_k, split_k, num_stages, num_warps, packed, swap)    # preload: not a form
    if all(a is None for a in asked) and swaps(M, N, N * K * elem):
        swap = True
    gemv = M <= MAX_GEMV_ROWS if gemv is None else gemv
    kpow = triton.next_power_of_2(K)
    bm = triton.next_power_of_2(M) if gemv else max(16, triton.next_power_of_2(M))
    if swap:
        return _swapped_tiling(M, N, K, elem, head, sms, block_n, block_k, split_k, num_stages, num_warps,
                               bool(head) and SWAP_PRELOAD if preload is None else preload)
    chosen = (block_n, block_k, split_k, num_stages, num_warps, packed)
    if all(c is None for c in chosen) and N * K * elem <= LATENCY_BOUND_BYTES:
        return _latency_bound_tiling(N, K, elem, head, sms, gemv, bm)
    # the dot form's [BM, BK] fp32 prologue block stays at <= 32 registers a thread
    bk = block_k or max(head, 16, min(kpow, 1024 // elem if gemv else min(512 // elem, 4096 // bm)))
    bn = block_n or (max(4, 8 // bm) if gemv else 16)
    if gemv and block_k is None and triton.cdiv(N, bn) < 2 * sms:
        if FEW_BLOCKS_TILING is not None and block_n is None and split_k is None:
            bn, bk, split = FEW_BLOCKS_TILING
            bk = max(head, bk)
            return Tiling(True, bn, bk, _split_parts(K, bk, split)[0], num_warps or _gemv_warps(bk, elem),
                          num_stages, packed is not False)
        # few column blocks (the 1.3B shape's out and down projections): 2 KB of a weight row
        # a tile, then split K. The H200 sweep of session 13: 5.8 and 9.9 us a layer against
        # 7.6 and 14.1 with 1 KB tiles (benchmarks/results/h200/session13/)
        bk = max(head, 16, min(kpow, 2048 // elem))
    min_bk = max(head, 512 // elem if gemv else 256 // elem)   # GEMV: one warp of 16-byte loads
    split = split_k or 1
    while split_k is None and triton.cdiv(N, bn) * split < 2 * sms:
        k_blocks = triton.cdiv(K, bk)
        if k_blocks >= 4 * split and split < MAX_SPLIT:
            split *= 2
        elif gemv and block_n is None and bn > 4:
            bn //= 2
        elif k_blocks >= 2 * split and split < MAX_SPLIT:
            split *= 2
        elif block_k is None and bk > min_bk:
            bk //= 2
        else:
            break
    # a whole 256-wide head at 64 rows (32 in fp32): the pipeliner buffers the prologue's
    # [BM, BK] loads too, 232 KB of shared memory at 3 stages (over sm_90's 227 KB), and the
    # block spills at 4 warps
    big = not gemv and bm * bk * elem > 16384
    warps = num_warps or (_gemv_warps(bk, elem) if gemv else 8 if big else 4)
    stages = num_stages or (2 if big else None)
    return Tiling(gemv, bn, bk, _split_parts(K, bk, split)[0], warps, stages, packed is not False,
                  preload=bool(preload) and not gemv)


def _swapped_tiling(M: int, N: int, K: int, elem: int, head: int, sms: int, block_n: int | None,
                    block_k: int | None, split_k: int | None, num_stages: int | None,
                    num_warps: int | None, preload: bool) -> Tiling:
    """The tl.dot form with the weight tile on the MMA's M side: 64 weight rows by 64 columns
    a tile (whole heads for the gated norm), K split until the column blocks fill the GPU
    once while each slice keeps two K blocks (the H100 sweep's best at the 1.3B shape's
    down projection: split 8), and as many stages (up to 4) as SWAP_SHARED_BYTES holds.
    With `preload` a slice may keep a single K block and the weights take two stages (the
    sweep's best at the out projection: split 8)."""
    bn = block_n or 64
    bk = block_k or max(head, 16, min(triton.next_power_of_2(K), 64))
    split = split_k or 1
    per_slice = 1 if preload else 2        # K blocks a slice keeps after a doubling
    while split_k is None and triton.cdiv(N, bn) * split < sms and triton.cdiv(K, bk) >= 2 * per_slice * split \
            and split < MAX_SPLIT:
        split *= 2
    bm = max(16, triton.next_power_of_2(M))
    stages = num_stages or (2 if preload else max(1, min(4, 1 + SWAP_SHARED_BYTES // ((bn + bm) * bk * elem))))
    return Tiling(False, bn, bk, _split_parts(K, bk, split)[0], num_warps or 4, stages, swap=True,
                  preload=preload)


def _latency_bound_tiling(N: int, K: int, elem: int, head: int, sms: int, gemv: bool, bm: int) -> Tiling:
    """The default for a small matrix. A split-K slice adds a round trip through L2 (the
    partials, then the last arriver's sums), ~1 us, more than the parallelism it buys, and
    each extra K step of a program waits on its loads. So (H200 sweep of the embedded
    widths, benchmarks/results/h200/session11/):
    - GEMV: one program a 4-column block over the whole of K (up to 2 KB of a weight row),
      no split: 2.3 us a call where the grid-filling default took 3.1-3.4;
    - dot form, a wide matrix with K in one or two blocks: no split, pipelined (4.8 us
      against 5.9);
    - dot form otherwise: 32-column blocks, one K block each (split-K), unpipelined (3.9 and
      5.1 us against 5.2 and 6.2)."""
    if gemv:
        bk = max(head, min(triton.next_power_of_2(K), 2048 // elem))
        return Tiling(True, 4, bk, _split_parts(K, bk, 1)[0], _gemv_warps(bk, elem))
    bk = max(head, min(triton.next_power_of_2(K), 512 // elem, 4096 // bm))
    k_blocks = triton.cdiv(K, bk)
    if k_blocks <= 2 and triton.cdiv(N, 16) >= sms // 2:
        return Tiling(False, 16, bk, 1, 4, 3)
    if k_blocks > 2:
        bk = max(head, min(bk, 256 // elem))
    split = _split_parts(K, bk, triton.cdiv(K, bk))[0]
    return Tiling(False, 32, bk, split, 4, 1)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def picked_tiling(M: int, N: int, K: int, dtype: torch.dtype, head: int = 0,
                  device: torch.device | None = None) -> dict:
    """The tiling a call with no tiling keywords runs, as keywords (for benchmark records)."""
    elem = torch.empty((), dtype=dtype).element_size()
    sms = _sm_count(torch.device(device)) if device is not None else DEFAULT_SMS
    return dataclasses.asdict(_tiling(M, N, K, elem, head, sms))


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, split: int, M: int, N: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials [SPLIT, M, N] fp32 and one arrival counter a column block, made once
    a (shape, device) and kept for good: a captured CUDA graph holds their addresses, and
    the counters are zeroed only here (each call leaves them at zero). Calls of one shape
    share them, so they must not overlap in time (one stream, as the decoder runs). Made
    on the first call, which the decoder's eager warm-up before a capture is; made inside a
    capture instead, the zeroing is captured ahead of the kernel and holds once replayed."""
    key = (device, split, M, N, n_blocks)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(split * M * N, device=device, dtype=torch.float32),
                         torch.zeros(n_blocks, device=device, dtype=torch.int32))
    return _SCRATCH[key]


def _dot_mode(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "ieee"
    return "emulate" if os.environ.get("TRITON_INTERPRET") == "1" else "native"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [M, K] with unit column stride (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check(M: int, head: int, t: Tiling) -> None:
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows: the fused projection takes at most {MAX_ROWS}")
    if t.gemv and M > MAX_GEMV_ROWS:
        raise ValueError(f"{M} rows: the GEMV form takes at most {MAX_GEMV_ROWS}")
    if head and t.block_k % head:
        raise ValueError(f"block_k {t.block_k}: the gated norm's K block is whole heads of {head}")
    if triton.next_power_of_2(t.block_k) != t.block_k or triton.next_power_of_2(t.block_n) != t.block_n:
        raise ValueError(f"block_k {t.block_k}, block_n {t.block_n}: powers of two")
    if not t.gemv and min(t.block_k, t.block_n) < 16:
        raise ValueError(f"block_k {t.block_k}, block_n {t.block_n}: tl.dot takes 16 at least")


def _launch(prologue: str, x2: torch.Tensor, w: torch.Tensor, *, res: torch.Tensor | None = None,
            res_out: torch.Tensor | None = None, gate: torch.Tensor | None = None,
            norm_w: torch.Tensor | None = None, eps: float = 0.0, swish: bool = True, head: int = 0,
            block_k: int | None = None, block_n: int | None = None, num_stages: int | None = None,
            gemv: bool | None = None, split_k: int | None = None, num_warps: int | None = None,
            packed: bool | None = None, swap: bool | None = None, preload: bool | None = None,
            out_dtype: torch.dtype | None = None, conv: tuple | None = None,
            prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """y = prologue(x2) @ w.T for x2 [M, K*] and w [N, K], in out_dtype (default w's);
    tiling keywords left None are chosen by `_tiling` (head: the gated norm's head width, 0
    for the others); conv = (cache [C, W], conv_w [C, W], conv_b [C] or None): the first C
    columns of one row through an AR token's conv step (split-K off); prefetch: the next
    kernel's weights, whose first bytes the programs ask L2 for (`kernels/l2_prefetch.py`)."""
    M, (N, K) = x2.shape[0], w.shape
    if not w.is_contiguous():
        raise ValueError("the weight must be contiguous [N, K]")
    t = _tiling(M, N, K, w.element_size(), head, _sm_count(w.device), gemv, block_n, block_k,
                1 if conv is not None else split_k, num_stages, num_warps, packed, swap, preload)
    _check(M, head, t)
    BM = triton.next_power_of_2(M) if t.gemv else max(16, triton.next_power_of_2(M))
    split, k_slice = _split_parts(K, t.block_k, t.split_k)
    n_blocks = triton.cdiv(N, t.block_n)
    y = torch.empty(M, N, device=x2.device, dtype=out_dtype or w.dtype)
    partials, counters = _scratch(w.device, split, M, N, n_blocks) if split > 1 else (y, y)
    options = {"num_warps": t.num_warps}
    if t.gemv:      # kernels/pdl.py: its first weight tile loads before the wait
        options.update(launch_options(w.device))
    if t.num_stages is not None:
        options["num_stages"] = t.num_stages
    pf, pf_bytes, pf_mode = prefetch_args(prefetch, w.device, M)

    def launch(**stages) -> None:
        _projection_kernel[(n_blocks, split)](
            x2, x2.stride(0), res if res is not None else y, res.stride(0) if res is not None else 0,
            res_out if res_out is not None else y, gate if gate is not None else y,
            gate.stride(0) if gate is not None else 0, norm_w if norm_w is not None else y, w, y, y.stride(0),
            partials, counters, M, N, K, k_slice, eps, *_conv_args(conv, y), pf if pf is not None else w, pf_bytes,
            PROLOGUE=PROLOGUES[prologue], PREFETCH=pf_mode,
            HAS_RES=res is not None,
            SWISH=swish, DOT=_dot_mode(w.dtype), GEMV=t.gemv, SPLIT=split, HEAD=max(head, 1),
            BM=BM, BN=t.block_n, BK=t.block_k, VEC=min(t.block_k, 16 // w.element_size()) if t.packed else 1,
            SWAP=t.swap, PRELOAD=t.preload, RSTD_BK=max(t.block_k, min(triton.next_power_of_2(K), 4096 // BM)) if t.preload else 0,
            CONV_W=0 if conv is None else conv[0].shape[-1],
            CONV_BIAS=conv is not None and conv[2] is not None, **options, **stages)

    key = (w.device, prologue, max(head, 1), conv is not None, BM, w.dtype, x2.dtype, out_dtype, t, pf_mode)
    _launch_fitting(launch, key, options.pop("num_stages", None))
    return y


# pipeline depth that fit shared memory, per kernel variant (device, prologue, head, conv, rows, dtypes,
# tiling) that asked for more
_FITTED_STAGES: dict[tuple, int] = {}


def _launch_fitting(launch, key: tuple, num_stages: int | None) -> None:
    """launch(num_stages=...) with the tiling's pipeline depth or, where the compiled kernel asks
    for more shared memory than the GPU has (Triton's OutOfResources, raised before it runs),
    with one stage fewer at a time: the stage rule only estimates what Triton buffers (an H100
    refused the swapped form's 4 stages at 17 rows of a 256-wide gated-norm head, 240 KB asked).
    The depth that fit is kept for the next call of the key, so a CUDA-graph capture after the
    eager warm-up launches it at once."""
    stages = _FITTED_STAGES.get(key, num_stages)
    while True:
        try:
            launch(**({} if stages is None else {"num_stages": stages}))
            return
        except triton.runtime.errors.OutOfResources:
            tried = 3 if stages is None else stages        # Triton's default depth on sm_80+
            if tried <= 1:
                raise
            stages = _FITTED_STAGES[key] = tried - 1


def _conv_args(conv: tuple | None, y: torch.Tensor) -> tuple:
    """The kernel's (cache, cache row stride, conv_w, conv_b, C) for `_launch`'s conv."""
    if conv is None:
        return y, 0, y, y, 0
    cache, conv_w, conv_b = conv
    return cache, cache.stride(0), conv_w, conv_b if conv_b is not None else conv_w, cache.shape[0]


def norm_linear(x: torch.Tensor, norm_w: torch.Tensor, eps: float, residual: torch.Tensor | None,
                w: torch.Tensor, **blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ w.T, x + residual) for x [..., K], w [N, K]. `blocks`
    (block_k, block_n, num_stages, gemv, split_k, swap) override the kernel's tiling; out_dtype
    (say fp32 logits from an LM head) that of the product, w's by default."""
    x2 = _rows(x)
    res2 = _rows(residual) if residual is not None else None
    summed = torch.empty_like(x2) if residual is not None else x2
    y = _launch("norm", x2, w, res=res2, res_out=summed if residual is not None else None,
                norm_w=norm_w, eps=eps, **blocks)
    return y.view(*x.shape[:-1], -1), summed.view(x.shape)


def norm_linear_conv(x: torch.Tensor, norm_w: torch.Tensor, eps: float, residual: torch.Tensor | None,
                     w: torch.Tensor, cache: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
                     **blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_linear` of one token whose first C output columns (a GDN layer's q | k | v conv
    inputs) then take their conv step in the same launch: cache [1, C, W] (the last W inputs,
    newest last) shifts in place, and those columns of the output are silu(conv), as
    `reference.norm_linear_conv_ref`. Split-K is off (the conv needs a column's whole sum)."""
    C, W = conv_w.shape
    if x.numel() != x.shape[-1] or cache.shape[-2:] != (C, W) or cache.stride(-1) != 1 or C > w.shape[0]:
        raise ValueError(f"norm_linear_conv takes one row and a [1, {C}, {W}] cache with unit last stride, "
                         f"got x {tuple(x.shape)}, cache {tuple(cache.shape)}")
    if triton.next_power_of_2(W) != W or cache.dtype != w.dtype or not conv_w.is_contiguous():
        raise ValueError(f"conv width {W} (a power of two), cache dtype {cache.dtype} (the weights' "
                         f"{w.dtype}) and a contiguous conv weight")
    x2 = _rows(x)
    res2 = _rows(residual) if residual is not None else None
    summed = torch.empty_like(x2) if residual is not None else x2
    y = _launch("norm", x2, w, res=res2, res_out=summed if residual is not None else None,
                norm_w=norm_w, eps=eps, conv=(cache.view(C, W), conv_w, conv_b), **blocks)
    return y.view(*x.shape[:-1], -1), summed.view(x.shape)


def gated_norm_linear(o: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, eps: float,
                      activation: str, w: torch.Tensor, **blocks) -> torch.Tensor:
    """(rms_norm over each head of o [..., H, V], times act(gate) [..., H*V]) @ w.T. `blocks`
    (block_k, block_n, num_stages, gemv, split_k, swap) override the tiling; block_k must be a
    multiple of the head width V."""
    V = o.shape[-1]
    if triton.next_power_of_2(V) != V or V < 16:
        raise ValueError(f"head width {V}: the fused gated norm takes powers of two from 16")
    o2 = _rows(o.reshape(*o.shape[:-2], -1))
    y = _launch("gated_norm", o2, w, gate=_rows(gate), norm_w=norm_w, eps=eps,
                swish=activation in ("swish", "silu"), head=V, **blocks)
    return y.view(*o.shape[:-2], -1)


def swiglu_linear(gate_up: torch.Tensor, w: torch.Tensor, **blocks) -> torch.Tensor:
    """(silu(gate_up[..., :I]) * gate_up[..., I:]) @ w.T for w [N, I]; `blocks` as above."""
    y = _launch("swiglu", _rows(gate_up), w, **blocks)
    return y.view(*gate_up.shape[:-1], -1)
