"""The LiLiCorr head as Triton kernels. Two launches:
- `_head_prologue_kernel`: what needs no candidates' rows, in parallel programs. That is each
  slot's top-k (log_softmax + top-k), the projections of the wide inputs (slot hiddens, the
  anchor row) in column strips, and a read of the head's packed weights into L2.
- `_lilicorr_head_kernel`: the rest in one program per lattice. That is the features, the
  lattice transformer, fusion with the anchor row, every adjacent pair score and the greedy walk.
A candidate's token projection token_proj(E[c]) is a row of token_proj(E), computed once.
`lattice_topk` (`_lattice_topk_kernel`) is the top-k alone.

The reference is `specla.drafters.lilicorr.LiLiCorrHead.forward` + `greedy_walk`: plain torch,
the trained module itself.

Why kernels: the head is tiny (a 7 x 4 or 7 x 8 lattice, width 128, 2 layers). As torch ops it
is about 100 launches inside a CUDA graph; here it is two.

What costs inside a decoding step is what the target's weights evict from L2: the head's
weights and the head program's own instructions, each fetched once from HBM by one SM. Hence
the L2 read in the prologue, and runtime loops (layers, heads, walk slots) instead of unrolled
ones, which halve the instructions. The head program holds [BL, w] fp32 tiles next to bf16
weight tiles at up to 255 registers a thread (`benchmarks/ptxas_check.py` counts instructions,
registers and spills for sm_90 without a GPU); to keep it from spilling:
- attention runs head by head, with the other heads' columns zeroed;
- q, k and v are kept in the operand dtype;
- the pair scores are computed slot by slot from a scratch copy of the factors, not as one
  [BL, BL] product.
Measured timings live in benchmarks/results/ (`python -m specla bench --suite head`,
`benchmarks/bench_lilicorr.py`).

Arithmetic:
- Activations and accumulators are fp32. Matmul operands are rounded to the weight dtype.
  On the GPU that is bf16, so the scores differ from the bf16 module's by bf16 rounding.
  fp32 weights use tf32x3 products and match the module to ~1e-5.
- The pair scores are fp32 FMA sums, like the module's fp32 product.
- The walk is `greedy_walk` on the kernel's own scores: the start argmax, then the argmax of
  the row out of the previous pick, first index on ties (as torch.argmax).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def _dot(a, w, PREC: tl.constexpr):
    """fp32 activations a [M, R] @ w [R, C] with a rounded to w's dtype, fp32 accumulation.
    PREC "emulate": the same product in fp32 (Triton 3.7's CPU interpreter gets bf16 dots
    wrong; the values are those of a bf16 dot, bar the order of the sums)."""
    if PREC == "emulate":
        return tl.dot(a.to(w.dtype).to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(w.dtype), w, input_precision=PREC)


@triton.jit
def _mm(a, w_ptr, row_stride, rows, cols, PREC: tl.constexpr):
    """a [M, R] fp32 @ W[rows, cols] of a row-major [in, out] weight -> fp32 [M, C]."""
    return _dot(a, tl.load(w_ptr + rows[:, None] * row_stride + cols[None, :]), PREC)


@triton.jit
def _vec(w_ptr, offs):
    return tl.load(w_ptr + offs).to(tl.float32)


@triton.jit
def _layer_norm(x, w_ptr, b_ptr, offs_w, WIDTH: tl.constexpr, eps):
    mean = tl.sum(x, axis=1) / WIDTH
    xc = x - mean[:, None]
    var = tl.sum(xc * xc, axis=1) / WIDTH
    return xc * tl.rsqrt(var + eps)[:, None] * _vec(w_ptr, offs_w)[None, :] + _vec(b_ptr, offs_w)[None, :]


@triton.jit
def _normalize_rows(x):
    """F.normalize: x / max(||x||, 1e-12)."""
    return x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)[:, None]


@triton.jit
def _rows_mm(row_ptrs, row_ok, w_ptr, cols, DEPTH: tl.constexpr, WIDTH: tl.constexpr, ROWS: tl.constexpr,
             BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """Rows gathered through `row_ptrs` [ROWS] (DEPTH values each) @ columns `cols` of a
    row-major [DEPTH, WIDTH] weight -> fp32 [ROWS, BN]."""
    offs_d = tl.arange(0, BD)
    acc = tl.zeros([ROWS, BN], dtype=tl.float32)
    for d0 in tl.range(0, DEPTH, BD):
        d = d0 + offs_d
        x = tl.load(row_ptrs[:, None] + d[None, :], mask=row_ok[:, None] & (d[None, :] < DEPTH), other=0.0)
        w = tl.load(w_ptr + d[:, None] * WIDTH + cols[None, :], mask=d[:, None] < DEPTH, other=0.0)
        acc += _dot(x, w, PREC)
    return acc


@triton.jit
def _slot_topk(logits, cand, cand_logp, r, V, K: tl.constexpr, BV: tl.constexpr):
    """Row r's top-K tokens and log-probs (log_softmax values, best first; the first index on
    ties): the row sits in registers, K max-and-mask passes."""
    offs = tl.arange(0, BV)
    x = tl.load(logits + r * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
    for j in tl.range(0, K):
        val, idx = tl.max(x, axis=0, return_indices=True)
        tl.store(cand + r * K + j, idx)
        tl.store(cand_logp + r * K + j, val - lse)
        x = tl.where(offs == idx, float("-inf"), x)


@triton.jit
def _lattice_topk_kernel(logits, cand, cand_logp, V, K: tl.constexpr, BV: tl.constexpr):
    """One slot's top-K per program."""
    _slot_topk(logits, cand, cand_logp, tl.program_id(0), V, K, BV)


@triton.jit
def _head_prologue_kernel(logits, cand, cand_logp, V, topk_rows, slot_hidden, anchor, hid_w, anc_w,
                          hid_out, anc_out, warm, warm_numel, warm_sink, N,
                          K: tl.constexpr, BV: tl.constexpr, S: tl.constexpr, BS: tl.constexpr,
                          DW: tl.constexpr, WIDTH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                          WARM_BLOCK: tl.constexpr, PREC: tl.constexpr):
    """Everything of the head that does not need the lattice's rows, as independent programs
    of one launch. Programs, in order:
    - `topk_rows` (N * S, or 0 when the caller brings candidates): one slot's top-k each;
    - 2 * N * WIDTH / BN: one BN-column strip of hidden_proj(h) for the S slots (a slot's K
      rows share it) or of anchor_proj(anchor) without its bias (one row), so the wide
      [DW, WIDTH] weights are read by many SMs at once;
    - the rest read WARM_BLOCK elements each of the head's packed weights and discard them:
      the head program, one SM's latency-bound walk through them, then finds them in L2.
      Inside a decoding step the target's and the drafter's weights have evicted them."""
    pid = tl.program_id(0)
    STRIPS: tl.constexpr = WIDTH // BN
    projections = 2 * N * STRIPS
    if pid < topk_rows:
        _slot_topk(logits, cand, cand_logp, pid, V, K, BV)
    elif pid < topk_rows + projections:
        j = pid - topk_rows
        cols = (j % STRIPS) * BN + tl.arange(0, BN)
        n = (j // STRIPS) % N
        rows = tl.arange(0, BS)
        if j < N * STRIPS:
            ok = rows < S
            x = _rows_mm(slot_hidden + (n * S + rows) * DW, ok, hid_w, cols, DW, WIDTH, BS, BN, BD, PREC)
            tl.store(hid_out + (n * S + rows[:, None]) * WIDTH + cols[None, :], x, mask=ok[:, None])
        else:
            ok = rows < 1
            x = _rows_mm(anchor + n * DW + rows, ok, anc_w, cols, DW, WIDTH, BS, BN, BD, PREC)
            tl.store(anc_out + n * WIDTH + rows[:, None] + cols[None, :], x, mask=ok[:, None])
    else:
        j = pid - topk_rows - projections
        offs = j * WARM_BLOCK + tl.arange(0, WARM_BLOCK)
        w = tl.load(warm + offs, mask=offs < warm_numel, other=0.0)
        tl.store(warm_sink + j, tl.sum(w.to(tl.float32), axis=0))     # a use, so the load stays


@triton.jit
def _row_times(v, w_ptr, row0, offs_w, WIDTH: tl.constexpr):
    """One row v [WIDTH] @ rows row0 .. row0+WIDTH of a row-major [in, WIDTH] weight -> [WIDTH]."""
    w = tl.load(w_ptr + (row0 + offs_w[:, None]) * WIDTH + offs_w[None, :]).to(tl.float32)
    return tl.sum(v[:, None] * w, axis=0)


@triton.jit
def _attention_per_head(q, k, v, rel_bias, same_bias, K: tl.constexpr, L: tl.constexpr, BL: tl.constexpr,
                        WIDTH: tl.constexpr, HEADS: tl.constexpr, MAX_SLOTS: tl.constexpr, PREC: tl.constexpr):
    """Multi-head attention over the lattice rows, q fp32 / k, v operand-dtype [BL, WIDTH]:
    head h attends with the columns of the other heads zeroed (whole-width products: a few
    more tensor-core MACs than [BL, HD] slices, but no per-head weight loads)."""
    HD: tl.constexpr = WIDTH // HEADS
    offs_l = tl.arange(0, BL)
    slot = offs_l // K
    col_ok = (offs_l < L)[None, :]
    rel = slot[None, :] - slot[:, None] + MAX_SLOTS - 1
    same = (slot[None, :] == slot[:, None]) & (offs_l[None, :] != offs_l[:, None])
    col_head = tl.arange(0, WIDTH) // HD
    attn = tl.zeros([BL, WIDTH], dtype=tl.float32)
    for h in tl.range(0, HEADS):
        in_h = (col_head == h)[None, :]
        s = _dot(tl.where(in_h, q, tl.zeros_like(q)), tl.trans(k), PREC) * (1.0 / math.sqrt(HD))
        s += tl.load(rel_bias + h * (2 * MAX_SLOTS - 1) + rel, mask=(offs_l < L)[:, None] & col_ok,
                     other=0.0).to(tl.float32)
        s += tl.where(same, tl.load(same_bias + h).to(tl.float32), 0.0)
        s = tl.where(col_ok, s, float("-inf"))
        p = tl.exp(s - tl.max(s, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        attn += _dot(p, tl.where(in_h, v, tl.zeros_like(v)), PREC)
    return attn


@triton.jit
def _lilicorr_head_kernel(
        cand, cand_logp, token_table, hid_x, anc_x, anc_b, factors,
        feat_ln_w, feat_ln_b, f1_w, f1_b, f2_w, f2_b, slot_emb, rank_emb,
        ln1_w, ln1_b, qkv_w, qkv_b, o_w, o_b, ln2_w, ln2_b, m1_w, m1_b, m2_w, m2_b,
        rel_bias, same_bias, fuse_w, fuse_b, out_w, in_w, a_w,
        start_out, pair_out, ranks_out, tokens_out,
        eps, feat_eps, scale,
        S: tl.constexpr, K: tl.constexpr, BL: tl.constexpr,
        WIDTH: tl.constexpr, HEADS: tl.constexpr, LAYERS: tl.constexpr,
        MLP: tl.constexpr, BM: tl.constexpr, MAX_SLOTS: tl.constexpr, RANK_DEN: tl.constexpr,
        BK: tl.constexpr, PREC: tl.constexpr):
    n = tl.program_id(0)
    L: tl.constexpr = S * K
    offs_l = tl.arange(0, BL)                      # lattice row = slot * K + rank
    l_mask = offs_l < L
    slot = offs_l // K
    rank = offs_l % K
    offs_w = tl.arange(0, WIDTH)
    OP: tl.constexpr = f2_w.dtype.element_ty      # matmul operand dtype: the weights'
    offs_m = tl.arange(0, BM)

    # -- per-candidate input: token_proj(E[c]) is a row of the projected table, hidden_proj(h)
    # comes from the prologue; then feat_mlp and the embeddings
    tok = tl.load(cand + n * L + offs_l, mask=l_mask, other=0)
    row_w = offs_l[:, None] * WIDTH + offs_w[None, :]
    tok_row = tok.to(tl.int32) * WIDTH             # 32-bit offsets: 64-bit ones cost registers
    x = tl.load(token_table + tok_row[:, None] + offs_w[None, :], mask=l_mask[:, None], other=0.0).to(tl.float32)
    x += tl.load(hid_x + (n * S + slot[:, None]) * WIDTH + offs_w[None, :], mask=l_mask[:, None], other=0.0)

    # the five log-prob features, LayerNorm(5), Linear(5, w) as five outer products, SiLU
    logp = tl.maximum(tl.load(cand_logp + n * L + offs_l, mask=l_mask, other=0.0).to(tl.float32), -30.0)
    best = tl.maximum(tl.load(cand_logp + n * L + slot * K, mask=l_mask, other=0.0).to(tl.float32), -30.0)
    f0 = logp
    f1 = tl.exp(logp)
    f2 = logp - best
    f3 = rank.to(tl.float32) / RANK_DEN
    f4 = (rank == 0).to(tl.float32)
    mean = (f0 + f1 + f2 + f3 + f4) / 5.0
    var = ((f0 - mean) * (f0 - mean) + (f1 - mean) * (f1 - mean) + (f2 - mean) * (f2 - mean)
           + (f3 - mean) * (f3 - mean) + (f4 - mean) * (f4 - mean)) / 5.0
    inv = tl.rsqrt(var + feat_eps)
    hid = tl.zeros([BL, WIDTH], dtype=tl.float32) + _vec(f1_b, offs_w)[None, :]
    hid += (((f0 - mean) * inv * tl.load(feat_ln_w + 0) + tl.load(feat_ln_b + 0))[:, None]
            * _vec(f1_w + 0 * WIDTH, offs_w)[None, :])
    hid += (((f1 - mean) * inv * tl.load(feat_ln_w + 1) + tl.load(feat_ln_b + 1))[:, None]
            * _vec(f1_w + 1 * WIDTH, offs_w)[None, :])
    hid += (((f2 - mean) * inv * tl.load(feat_ln_w + 2) + tl.load(feat_ln_b + 2))[:, None]
            * _vec(f1_w + 2 * WIDTH, offs_w)[None, :])
    hid += (((f3 - mean) * inv * tl.load(feat_ln_w + 3) + tl.load(feat_ln_b + 3))[:, None]
            * _vec(f1_w + 3 * WIDTH, offs_w)[None, :])
    hid += (((f4 - mean) * inv * tl.load(feat_ln_w + 4) + tl.load(feat_ln_b + 4))[:, None]
            * _vec(f1_w + 4 * WIDTH, offs_w)[None, :])
    hid = hid * tl.sigmoid(hid)
    x += _mm(hid, f2_w, WIDTH, offs_w, offs_w, PREC) + _vec(f2_b, offs_w)[None, :]
    x += tl.load(slot_emb + slot[:, None] * WIDTH + offs_w[None, :], mask=l_mask[:, None], other=0.0).to(tl.float32)
    x += tl.load(rank_emb + rank[:, None] * WIDTH + offs_w[None, :]).to(tl.float32)

    # -- the lattice transformer: relative-slot + same-slot biases, padded columns masked
    # runtime loops here, over heads and over the walk's slots, not unrolled ones: each
    # instruction runs once and is fetched cold inside a decoding step, so fewer instructions
    # and no spills pay more than unrolling (benchmarks/ptxas_check.py counts both)
    for li in tl.range(0, LAYERS):
        xn = _layer_norm(x, ln1_w + li * WIDTH, ln1_b + li * WIDTH, offs_w, WIDTH, eps)
        qkv = qkv_w + li * WIDTH * 3 * WIDTH
        # q, k, v in the operand dtype: the products round them to it anyway
        q = (_mm(xn, qkv, 3 * WIDTH, offs_w, offs_w, PREC) + _vec(qkv_b + li * 3 * WIDTH, offs_w)[None, :]).to(OP)
        k = (_mm(xn, qkv, 3 * WIDTH, offs_w, WIDTH + offs_w, PREC)
             + _vec(qkv_b + li * 3 * WIDTH, WIDTH + offs_w)[None, :]).to(OP)
        v = (_mm(xn, qkv, 3 * WIDTH, offs_w, 2 * WIDTH + offs_w, PREC)
             + _vec(qkv_b + li * 3 * WIDTH, 2 * WIDTH + offs_w)[None, :]).to(OP)
        attn = _attention_per_head(q, k, v, rel_bias, same_bias, K, L, BL, WIDTH, HEADS, MAX_SLOTS, PREC)
        x += _mm(attn, o_w + li * WIDTH * WIDTH, WIDTH, offs_w, offs_w, PREC) + _vec(o_b + li * WIDTH, offs_w)[None, :]
        xn = _layer_norm(x, ln2_w + li * WIDTH, ln2_b + li * WIDTH, offs_w, WIDTH, eps)
        y = tl.zeros([BL, WIDTH], dtype=tl.float32)
        for m0 in tl.static_range(0, MLP, BM):
            mid = _mm(xn, m1_w + li * WIDTH * MLP, MLP, offs_w, m0 + offs_m, PREC)
            mid += _vec(m1_b + li * MLP, m0 + offs_m)[None, :]
            mid = 0.5 * mid * (1.0 + tl.math.erf(mid * 0.7071067811865476))      # exact GELU
            y += _mm(mid, m2_w + li * MLP * WIDTH, WIDTH, m0 + offs_m, offs_w, PREC)
        x += y + _vec(m2_b + li * WIDTH, offs_w)[None, :]

    # -- fusion with the anchor row a: F = silu(W [x; a; x*a]). a is one row, so its part of
    # the product (and w_a's) is a vector-matrix product; normalised out / in factors
    a = (tl.load(anc_x + n * WIDTH + offs_w) + _vec(anc_b, offs_w)).to(OP).to(tl.float32)   # as the module's
    f = (_mm(x, fuse_w, WIDTH, offs_w, offs_w, PREC)
         + _mm(x * a[None, :], fuse_w, WIDTH, 2 * WIDTH + offs_w, offs_w, PREC)
         + (_row_times(a, fuse_w, WIDTH, offs_w, WIDTH) + _vec(fuse_b, offs_w))[None, :])
    f = f * tl.sigmoid(f)
    out = _normalize_rows(_mm(f, out_w, WIDTH, offs_w, offs_w, PREC))
    inn = _normalize_rows(_mm(f, in_w, WIDTH, offs_w, offs_w, PREC))
    aq = _row_times(a, a_w, 0, offs_w, WIDTH)
    aq = aq / tl.maximum(tl.sqrt(tl.sum(aq * aq, axis=0)), 1e-12)

    # -- scores and the greedy walk, slot by slot. The factors go to a scratch buffer and
    # come back as each slot's [K, w] rows (an L1 round trip): a [BL, BL] product of all rows
    # in registers, of which only the (s, s+1) blocks are wanted, made this kernel spill
    # heavily at every precision tried, and cutting a row out of it cost two block reductions
    offs_k = tl.arange(0, BK)
    k_ok = offs_k < K
    scratch = factors + n * 2 * L * WIDTH
    tl.store(scratch + row_w, out, mask=l_mask[:, None])
    tl.store(scratch + L * WIDTH + row_w, inn, mask=l_mask[:, None])
    tl.debug_barrier()                           # the stores above are visible to every thread
    kw = offs_k[:, None] * WIDTH + offs_w[None, :]
    nxt = tl.load(scratch + L * WIDTH + kw, mask=k_ok[:, None], other=0.0)        # slot 0's in rows
    start = scale * tl.sum(nxt * aq[None, :], axis=1)                             # [BK]
    tl.store(start_out + n * K + offs_k, start, mask=k_ok)
    pick = tl.argmax(tl.where(k_ok, start, float("-inf")), axis=0)
    tl.store(ranks_out + n * S, pick)
    tl.store(tokens_out + n * S, tl.load(cand + n * L + pick))
    both = k_ok[:, None] & k_ok[None, :]
    for s_i in tl.range(1, S):
        prev = tl.load(scratch + (s_i - 1) * K * WIDTH + kw, mask=k_ok[:, None], other=0.0)
        nxt = tl.load(scratch + L * WIDTH + s_i * K * WIDTH + kw, mask=k_ok[:, None], other=0.0)
        block = scale * tl.sum(prev[:, None, :] * nxt[None, :, :], axis=2)        # [BK, BK] fp32
        tl.store(pair_out + n * (S - 1) * K * K + (s_i - 1) * K * K + offs_k[:, None] * K + offs_k[None, :],
                 block, mask=both)
        row = tl.sum(tl.where(offs_k[:, None] == pick, block, 0.0), axis=0)
        pick = tl.argmax(tl.where(k_ok, row, float("-inf")), axis=0)
        tl.store(ranks_out + n * S + s_i, pick)
        tl.store(tokens_out + n * S + s_i, tl.load(cand + n * L + s_i * K + pick))


MAX_TOPK_VOCAB = 65536        # a row in one program's registers; larger vocabularies use torch


def lattice_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`specla.drafters.lilicorr.candidates` as one kernel: logits [N, S, V] (fp32) ->
    tokens [N, S, k] (int64) and their log-probs [N, S, k] (fp32)."""
    N, S, V = logits.shape
    if V > MAX_TOPK_VOCAB:
        top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return top.indices, top.values
    logits = logits.float().contiguous()
    cand = torch.empty(N, S, k, device=logits.device, dtype=torch.int64)
    cand_logp = torch.empty(N, S, k, device=logits.device, dtype=torch.float32)
    _lattice_topk_kernel[(N * S,)](logits, cand, cand_logp, V, K=k, BV=triton.next_power_of_2(V),
                                   num_warps=8 if V > 8192 else 4)
    return cand, cand_logp


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


MAX_FP32_WIDTH = 64      # fp32 operand tiles at width 128 spill registers (see `unsupported`)


def unsupported(head: nn.Module, slots: int, top_k: int) -> str | None:
    """Why this head / lattice cannot run fused (None when it can)."""
    c = head.config
    hd = c.width // c.heads
    if not (_pow2(c.width) and _pow2(hd) and c.width % c.heads == 0):
        return f"width {c.width} / {c.heads} heads: the kernel needs power-of-two widths of 16 or more"
    if c.mlp_hidden & -c.mlp_hidden < 16:
        return f"mlp hidden {c.mlp_hidden}: the kernel needs a multiple of 16"
    if not (2 <= slots <= c.max_slots and 1 <= top_k <= c.max_k):
        return f"lattice {slots} x {top_k} outside the head's {c.max_slots} x {c.max_k}"
    if (head.token_proj.weight.dtype == torch.float32 and c.width > MAX_FP32_WIDTH
            and os.environ.get("TRITON_INTERPRET") != "1"):
        return (f"fp32 weights at width {c.width}: on an H200 this variant did not finish compiling "
                f"in 95 s (measured up to width {MAX_FP32_WIDTH}); cast the drafter to bf16")
    return None


class HeadDraft(NamedTuple):
    """What `FusedLiLiCorrHead.draft` returns (the reference's `Lattice` + the walk)."""
    cand: torch.Tensor          # [N, S, k] each slot's top-k tokens, best first
    cand_logp: torch.Tensor     # [N, S, k] their log-probs
    start: torch.Tensor         # [N, k]
    pair: torch.Tensor          # [N, S-1, k, k]
    ranks: torch.Tensor         # [N, S] the greedy walk's pick at each slot
    tokens: torch.Tensor        # [N, S] the walk's tokens


class FusedLiLiCorrHead:
    """A `LiLiCorrHead`'s weights, packed once, and the fused forward in two launches:
    `_head_prologue_kernel` (top-k, the wide input projections, an L2 warm-up of the weights)
    and `_lilicorr_head_kernel` (the rest of the head and the walk).

    - `draft(logits, slot_hidden, anchor)`: slot logits -> candidates, their log-probs,
      fp32 start [N, k], fp32 pair [N, S-1, k, k], the greedy walk's ranks [N, S] and its
      tokens [N, S].
    - `__call__(cand, cand_logp, slot_hidden, anchor)`: the same from given candidates.

    At construction the weights are transposed to [in, out] and packed into one buffer, and
    token_proj is applied to the whole (frozen) embedding table: a candidate's token
    projection is then a row gather, the module's own bf16 row. Rebuild after the head's
    weights change. num_warps and mlp_block (the MLP's hidden columns per product; default
    all of them up to 256) change the speed, not the result.
    """

    def __init__(self, head: nn.Module, slots: int, top_k: int, embed_weight: torch.Tensor,
                 num_warps: int = 8, mlp_block: int | None = None):
        why = unsupported(head, slots, top_k)
        if why:
            raise ValueError(f"the fused LiLiCorr head cannot run this lattice: {why}")
        c = self.config = head.config
        self.slots, self.top_k = slots, top_k
        self.mlp_block = mlp_block or min(c.mlp_hidden & -c.mlp_hidden, 256)   # largest pow2 divisor
        if not (_pow2(self.mlp_block) and c.mlp_hidden % self.mlp_block == 0):
            raise ValueError(f"mlp_block {self.mlp_block}: needs a power of two >= 16 dividing {c.mlp_hidden}")
        self.num_warps = num_warps
        self.rows = max(16, triton.next_power_of_2(slots * top_k))    # lattice rows, padded
        self.compiled: dict = {}
        self.dtype = head.token_proj.weight.dtype
        t = lambda lin: lin.weight.detach().t()                                   # noqa: E731
        stack = lambda f: torch.stack([f(layer).detach() for layer in head.layers])  # noqa: E731
        self.hid_w, self.anc_w = (t(head.hidden_proj).contiguous(), t(head.anchor_proj).contiguous())
        self.packed, self.weights = _pack([
            head.feat_norm.weight, head.feat_norm.bias,
            t(head.feat_mlp[0]), head.feat_mlp[0].bias, t(head.feat_mlp[2]), head.feat_mlp[2].bias,
            head.slot_emb.weight, head.rank_emb.weight,
            stack(lambda l: l.attn_norm.weight), stack(lambda l: l.attn_norm.bias),
            stack(lambda l: l.qkv.weight.t()), stack(lambda l: l.qkv.bias),
            stack(lambda l: l.o_proj.weight.t()), stack(lambda l: l.o_proj.bias),
            stack(lambda l: l.mlp_norm.weight), stack(lambda l: l.mlp_norm.bias),
            stack(lambda l: l.mlp[0].weight.t()), stack(lambda l: l.mlp[0].bias),
            stack(lambda l: l.mlp[2].weight.t()), stack(lambda l: l.mlp[2].bias),
            head.rel_slot_bias, head.same_slot_bias,
            t(head.fuse), head.fuse.bias, t(head.w_out), t(head.w_in), t(head.w_a)], self.dtype)
        self.anc_b = head.anchor_proj.bias.detach().contiguous()
        self.token_table = _token_table(head.token_proj, embed_weight)
        self.warm_block = 8192
        self.warm_programs = triton.cdiv(self.packed.numel(), self.warm_block)
        self.warm_sink = torch.empty(self.warm_programs, device=self.packed.device, dtype=torch.float32)
        self.layers = len(head.layers)
        # fp32 weights: tf32x3 products (fp32-accurate on tensor cores; plain tf32 would cost
        # ~1e-3, and IEEE FMA dots made this kernel slow to compile and run); bf16: bf16 dots
        self.precision = "tf32x3" if self.dtype == torch.float32 else "tf32"
        if os.environ.get("TRITON_INTERPRET") == "1" and self.dtype != torch.float32:
            self.precision = "emulate"
        self.eps = head.layers[0].attn_norm.eps
        self.feat_eps = head.feat_norm.eps

    def __call__(self, cand: torch.Tensor, cand_logp: torch.Tensor, slot_hidden: torch.Tensor,
                 anchor: torch.Tensor):
        S, k = self.slots, self.top_k
        if cand.shape[1:] != (S, k) or cand_logp.shape != cand.shape:
            raise ValueError(f"expected a lattice [N, {S}, {k}], got {tuple(cand.shape)}")
        return self.body(cand, cand_logp, *self.inputs(slot_hidden, anchor)[2:])

    def draft(self, logits: torch.Tensor, slot_hidden: torch.Tensor, anchor: torch.Tensor) -> HeadDraft:
        """Slot logits [N, S, V] -> the lattice, its scores and the greedy walk:
        `specla.drafters.lilicorr.lattice` + `greedy_walk` in two launches."""
        if logits.shape[1] != self.slots:
            raise ValueError(f"expected logits [N, {self.slots}, V], got {tuple(logits.shape)}")
        if logits.shape[-1] > MAX_TOPK_VOCAB:
            cand, cand_logp = lattice_topk(logits, self.top_k)
            return HeadDraft(cand, cand_logp, *self(cand, cand_logp, slot_hidden, anchor))
        cand, cand_logp, hid_x, anc_x = self.inputs(slot_hidden, anchor, logits)
        return HeadDraft(cand, cand_logp, *self.body(cand, cand_logp, hid_x, anc_x))

    def inputs(self, slot_hidden: torch.Tensor, anchor: torch.Tensor, logits: torch.Tensor | None = None):
        """The first launch -> (candidates and log-probs [N, S, k], or None without logits;
        fp32 hidden_proj(h) [N, S, w] and anchor_proj(anchor) without its bias [N, w]). It
        also reads the packed weights into L2."""
        c, S, k = self.config, self.slots, self.top_k
        N, W, dev = slot_hidden.shape[0], c.width, slot_hidden.device
        f32 = dict(device=dev, dtype=torch.float32)
        hid_x, anc_x = torch.empty(N, S, W, **f32), torch.empty(N, W, **f32)
        cand = cand_logp = None
        V = topk_rows = 0
        if logits is not None:
            logits = logits.float().contiguous()
            V, topk_rows = logits.shape[-1], N * S
            cand = torch.empty(N, S, k, device=dev, dtype=torch.int64)
            cand_logp = torch.empty(N, S, k, **f32)
        BN = 16 if c.drafter_width > 512 else min(W, 32)         # wide inputs: more, narrower strips
        grid = topk_rows + 2 * N * (W // BN) + self.warm_programs
        self.compiled["inputs"] = _head_prologue_kernel[(grid,)](
            logits if logits is not None else hid_x, cand if cand is not None else hid_x,
            cand_logp if cand_logp is not None else hid_x, V, topk_rows,
            slot_hidden.to(self.dtype).contiguous(), anchor.to(self.dtype).contiguous(), self.hid_w, self.anc_w,
            hid_x, anc_x, self.packed, self.packed.numel(), self.warm_sink, N,
            K=k, BV=triton.next_power_of_2(max(V, 16)), S=S, BS=max(16, triton.next_power_of_2(S)),
            DW=c.drafter_width, WIDTH=W, BN=BN, BD=128, WARM_BLOCK=self.warm_block,
            PREC=self.precision, num_warps=8 if V > 8192 else 4)
        return cand, cand_logp, hid_x, anc_x

    def body(self, cand: torch.Tensor, cand_logp: torch.Tensor, hid_x: torch.Tensor, anc_x: torch.Tensor):
        """The second launch: the rest of the head and the walk -> start, pair, ranks, tokens."""
        c, S, k = self.config, self.slots, self.top_k
        N, dev = cand.shape[0], cand.device
        start = torch.empty(N, k, device=dev, dtype=torch.float32)
        pair = torch.empty(N, S - 1, k, k, device=dev, dtype=torch.float32)
        ranks = torch.empty(N, S, device=dev, dtype=torch.int64)
        tokens = torch.empty(N, S, device=dev, dtype=torch.int64)
        factors = torch.empty(N, 2, S * k, c.width, device=dev, dtype=torch.float32)   # scratch
        self.compiled["body"] = _lilicorr_head_kernel[(N,)](
            cand.contiguous(), cand_logp.float().contiguous(), self.token_table, hid_x, anc_x, self.anc_b,
            factors, *self.weights, start, pair, ranks, tokens,
            self.eps, self.feat_eps, float(c.scale),
            S=S, K=k, BL=self.rows, WIDTH=c.width, HEADS=c.heads, LAYERS=self.layers, MLP=c.mlp_hidden,
            BM=self.mlp_block, MAX_SLOTS=c.max_slots, RANK_DEN=max(k - 1, 1),
            BK=triton.next_power_of_2(k), PREC=self.precision,
            num_warps=self.num_warps)
        return start, pair, ranks, tokens

    def registers(self) -> dict:
        """Registers and spilled registers per thread of each compiled launch (after a call on
        the GPU; the interpreter compiles nothing)."""
        return {name: {"registers": getattr(kern, "n_regs", None), "spills": getattr(kern, "n_spills", None)}
                for name, kern in self.compiled.items()}


def _pack(tensors: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One contiguous buffer holding every tensor (each 64-element aligned) and views of it
    in the tensors' shapes: the prologue warms them all with one flat read."""
    sizes = [(t.numel() + 63) // 64 * 64 for t in tensors]
    packed = torch.zeros(sum(sizes), device=tensors[0].device, dtype=dtype)
    views, offset = [], 0
    for t, size in zip(tensors, sizes):
        view = packed[offset:offset + t.numel()].view(t.shape)
        view.copy_(t.detach())
        views.append(view)
        offset += size
    return packed, views


@torch.no_grad()
def _token_table(token_proj: nn.Linear, embed_weight: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """token_proj over every row of the embedding [V, d] -> [V, w] in the weight dtype: the
    rows the module computes for its candidates, each a row of this table."""
    dtype = token_proj.weight.dtype
    return torch.cat([token_proj(embed_weight[i:i + chunk].detach().to(dtype))
                      for i in range(0, embed_weight.shape[0], chunk)]).contiguous()


__all__ = ["FusedLiLiCorrHead", "lattice_topk", "unsupported"]
