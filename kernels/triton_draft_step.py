"""A block drafter's whole draft in one persistent Triton launch.

The reference is the device block drafter's torch path (`specla.graphs.drafters.
DeviceBlockDrafter`: `observe_rows`, `slot_logits` and the slots' top-k), the trained module
itself, as for the LiLiCorr head's kernels.

Why: on the embedded pair a draft was 68 launches and ~105 us on the H200, more than the AR
step it races (benchmarks/results/h200/session16/). Inside one launch each dependency is a
grid-wide barrier (`kernels/pdl.py`), so the draft is laid out as few dependent phases,
every program recomputing the small row vectors it needs (a norm over a 256-wide row):

    0  the accepted path's fused context rows (fc, from the verification's feature rows);
       the block input: the root's embedding through in_proj, then the mask rows
    1  the fused rows' norm, their raw keys and values for every layer, each written into
       the shifted window (a second copy: programs still read the old one); layer 0's block
       queries, keys and values (norms and RoPE in the same unit)
    per layer l (2 + 3l ...)
       att  per head: attention of the block rows over the window and the block, and that
            head's share of the output projection (fp32 partials); (l = 0) the new window
            copied back
       mlp  per slice of the MLP's hidden columns: residual + norm + gate/up + SwiGLU and
            its share of the down projection (fp32 partials)
       qkv  (l > 0 at the top of the layer) the next layer's block queries, keys, values
    out    final norm (the slot hiddens) + out_proj to the target width
    head   the target's final norm + its LM head over the slots
    top-k  per slot: log-softmax and the top-k candidates; for a greedy chain, the chain
           itself and its row of the step log; for a best-first tree, the last slot's
           program to finish grows it from every slot's candidates (`_best_first_tree`)

A unit's weight tile is loaded before it waits at its phase's barrier. Partials are summed
in a fixed order, so a draft's bits do not depend on which program finished first. Row
values are rounded to the weights' dtype where the torch path's ops round them, so the two
differ by the order of fp32 sums only. The block's rows and the path's rows are at most 16
(tl.dot's smallest tile).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import carveout
from kernels.pdl import grid_arrive, grid_wait
from kernels.triton_chain_accept import _pick
from kernels.triton_decode_step import resident_programs
from kernels.triton_lilicorr import _slot_topk
from kernels.triton_projection import _dot, _dot_mode

MAX_ROWS = 16       # block rows and accepted-path rows: one [16, *] tl.dot tile


@dataclasses.dataclass
class BlockDraftWeights:
    """A block drafter's weights, its layers stacked, and the target parts it borrows.
    Shapes: WD drafter width, D target width, LD layers, MH MLP width, HD head width."""
    fc: torch.Tensor            # [WD, F*D]
    ctx_norm: torch.Tensor      # [WD]
    in_proj: torch.Tensor       # [WD, D]
    mask_emb: torch.Tensor      # [WD]
    attn_norm: torch.Tensor     # [LD, WD]
    w_qkv: torch.Tensor         # [LD, 3*WD, WD]   q | k | v rows
    qk_norm: torch.Tensor       # [LD, 2, HD]      q_norm, k_norm
    w_o: torch.Tensor           # [LD, WD, WD]
    mlp_norm: torch.Tensor      # [LD, WD]
    w_gate_up: torch.Tensor     # [LD, 2*MH, WD]  gate | up rows
    w_down: torch.Tensor        # [LD, WD, MH]
    norm: torch.Tensor          # [WD]
    out_proj: torch.Tensor      # [D, WD]
    embed: torch.Tensor         # [vocab, D] (the target's)
    final_norm: torch.Tensor    # [D]        (the target's)
    lm_head: torch.Tensor       # [vocab, D] (the target's)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x rounded to the weights' dtype, kept in fp32 (where the torch path stores a row)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """a [M, R] @ b [R, N] in `_dot`'s precision modes."""
    return _dot(a, tl.trans(b), DOT)


@triton.jit
def _rms(x, w_ptr, cols, eps, WIDTH: tl.constexpr):
    """RMSNorm (fp32) of rows x [M, BW] whose columns past WIDTH are zero, times its weight."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / WIDTH + eps)
    return x * rstd[:, None] * tl.load(w_ptr + cols, mask=cols < WIDTH, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _stream(x, parts, n_parts, dtype: tl.constexpr, B: tl.constexpr, BM: tl.constexpr, WD: tl.constexpr):
    """The block's residual stream: rows x [BM, WD] plus the fp32 partials [n_parts, BM, WD]
    of the projection before, summed in order and rounded as the torch path's add rounds."""
    rows = tl.arange(0, BM)
    offs = rows[:, None] * WD + tl.arange(0, WD)[None, :]
    live = (rows < B)[:, None]
    acc = tl.zeros([BM, WD], dtype=tl.float32)
    for i in range(n_parts):
        acc += tl.load(parts + i * BM * WD + offs, mask=live, other=0.0, cache_modifier=".cg")
    return _round(tl.load(x + offs, mask=live, other=0.0, cache_modifier=".cg") + _round(acc, dtype), dtype)


@triton.jit
def _wait_first(first, sync):
    if first:
        grid_wait(sync[0], sync[1], sync[2])


@triton.jit
def _end_phase(pid, units, counter, target, status):
    """Arrive at the barrier after a phase of `units` units. A program that had none waits
    first: else its arrival could count for a phase other programs have not finished."""
    if pid >= units:
        grid_wait(counter, target, status)
    grid_arrive(counter)


@triton.jit
def _shift_rows(src, dst, a, W, stride, cols, c_ok, BW: tl.constexpr):
    """dst rows j = src rows j + a + 1 (the window's oldest a + 1 rows drop out)."""
    j = tl.arange(0, BW)
    keep = (j + a + 1 < W)[:, None] & c_ok[None, :]
    v = tl.load(src + (j + a + 1)[:, None] * stride + cols[None, :], mask=keep, other=0.0, cache_modifier=".cg")
    tl.store(dst + j[:, None] * stride + cols[None, :], v, mask=keep)


# ---- phase 0 ------------------------------------------------------------------------------
@triton.jit
def _fc_unit(features, result, P, fc, fc_out, blk, dtype: tl.constexpr, FD: tl.constexpr,
             WD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
    """Columns blk*BN.. of fc over the accepted path's feature rows (path rows 0..a)."""
    a = tl.load(result)
    rows = tl.arange(0, BM)
    r_ok = (rows <= a) & (rows < P)
    node = tl.load(result + 3 + rows, mask=r_ok, other=0)
    cols = blk * BN + tl.arange(0, BN)
    offs = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, FD, BK):
        ks = k0 + offs
        k_ok = ks < FD
        w = tl.load(fc + cols[:, None] * FD + ks[None, :], mask=k_ok[None, :], other=0.0)
        x = tl.load(features + node[:, None] * FD + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _dot(x.to(w.dtype), w, DOT)
    tl.store(fc_out + rows[:, None] * WD + cols[None, :], _round(acc, dtype))


@triton.jit
def _block_input_unit(root, embed, in_proj, mask_emb, x_a, blk, dtype: tl.constexpr, D: tl.constexpr,
                      WD: tl.constexpr, B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """Columns blk*BN.. of the block input: in_proj(embed(root)) in row 0, the mask rows after."""
    cols = blk * BN + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    d_ok = o_d < D
    e = tl.load(embed + tl.load(root) * D + o_d, mask=d_ok, other=0.0).to(in_proj.dtype.element_ty).to(tl.float32)
    w = tl.load(in_proj + cols[:, None] * D + o_d[None, :], mask=d_ok[None, :], other=0.0).to(tl.float32)
    tl.store(x_a + cols, _round(tl.sum(w * e[None, :], axis=1), dtype))
    rows = tl.arange(0, BM)
    m = tl.load(mask_emb + cols).to(dtype).to(tl.float32)
    tl.store(x_a + rows[:, None] * WD + cols[None, :], tl.broadcast_to(m[None, :], (BM, BN)),
             mask=((rows >= 1) & (rows < B))[:, None])


# ---- phase 1 ------------------------------------------------------------------------------
@triton.jit
def _fresh_rows(fc_out, ctx_norm, eps, dtype: tl.constexpr, WD: tl.constexpr, BM: tl.constexpr):
    cols = tl.arange(0, WD)
    x = tl.load(fc_out + tl.arange(0, BM)[:, None] * WD + cols[None, :], cache_modifier=".cg")
    return _round(_rms(x, ctx_norm, cols, eps, WD), dtype)


@triton.jit
def _window_kv_unit(fc_out, ctx_norm, w_qkv, qk_norm, kv, kv_next, result, l, kind, h, first, sync, eps,
                    dtype: tl.constexpr, WD: tl.constexpr, HD: tl.constexpr, W: tl.constexpr,
                    BM: tl.constexpr, BW: tl.constexpr, DOT: tl.constexpr):
    """Layer l's raw keys (kind 0: k_proj + k_norm) or values (kind 1) of head h for the fresh
    rows, written after the shifted window into `kv_next`."""
    o_hd = tl.arange(0, HD)
    w = tl.load(w_qkv + (l * 3 * WD + (1 + kind) * WD + h * HD + o_hd)[:, None] * WD + tl.arange(0, WD)[None, :])
    _wait_first(first, sync)
    a = tl.load(result)
    x = _fresh_rows(fc_out, ctx_norm, eps, dtype, WD, BM)
    y = _round(_dot(x.to(w.dtype), w, DOT), dtype)
    if kind == 0:
        y = _round(_rms(y, qk_norm + (l * 2 + 1) * HD, o_hd, eps, HD), dtype)
    plane = (l * 2 + kind) * W * WD + h * HD
    _shift_rows(kv + plane, kv_next + plane, a, W, WD, o_hd, o_hd < HD, BW)
    rows = tl.arange(0, BM)
    tl.store(kv_next + plane + (W - a - 1 + rows)[:, None] * WD + o_hd[None, :], y.to(dtype),
             mask=(rows <= a)[:, None])


@triton.jit
def _window_ctx_unit(fc_out, ctx_norm, ctx, ctx_next, valid, valid_next, result, first, sync, eps,
                     dtype: tl.constexpr, WD: tl.constexpr, W: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr):
    """The fused rows and their validity, shifted, into `ctx_next` / `valid_next`."""
    _wait_first(first, sync)
    a = tl.load(result)
    cols = tl.arange(0, WD)
    _shift_rows(ctx, ctx_next, a, W, WD, cols, cols < WD, BW)
    rows = tl.arange(0, BM)
    x = _fresh_rows(fc_out, ctx_norm, eps, dtype, WD, BM)
    tl.store(ctx_next + (W - a - 1 + rows)[:, None] * WD + cols[None, :], x.to(dtype), mask=(rows <= a)[:, None])
    j = tl.arange(0, BW)
    old = tl.load(valid + j + a + 1, mask=j + a + 1 < W, other=1)
    tl.store(valid_next + j, old, mask=j < W)


@triton.jit
def _block_qkv_unit(x_src, parts, n_parts, x_keep, keep, attn_norm, w_qkv, qk_norm, rope_cos, rope_sin, qkv,
                    l, kind, h, first, sync, eps, dtype: tl.constexpr, WD: tl.constexpr, HD: tl.constexpr,
                    W: tl.constexpr, B: tl.constexpr, BM: tl.constexpr, DOT: tl.constexpr):
    """Layer l's block queries (kind 0), keys (1) or values (2) of head h, from the stream x
    plus the partials before (`keep`: this unit also stores that stream at `x_keep`).
    Queries and keys are normed and rotated to the block's positions W.. (RoPE by halves)."""
    HALF: tl.constexpr = HD // 2
    o_h = tl.arange(0, HALF)
    cols = tl.arange(0, WD)
    w_rows = w_qkv + (l * 3 * WD + kind * WD + h * HD) * WD
    w1 = tl.load(w_rows + o_h[:, None] * WD + cols[None, :])
    w2 = tl.load(w_rows + (HALF + o_h)[:, None] * WD + cols[None, :])
    _wait_first(first, sync)
    rows = tl.arange(0, BM)
    x = _stream(x_src, parts, n_parts, dtype, B, BM, WD)
    if keep:
        tl.store(x_keep + rows[:, None] * WD + cols[None, :], x)
    xn = _round(_rms(x, attn_norm + l * WD, cols, eps, WD), dtype)
    y1 = _round(_dot(xn.to(dtype), w1, DOT), dtype)
    y2 = _round(_dot(xn.to(dtype), w2, DOT), dtype)
    if kind < 2:
        norm_w = qk_norm + (l * 2 + kind) * HD
        rstd = tl.rsqrt((tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)) / HD + eps)[:, None]
        n1 = _round(y1 * rstd * tl.load(norm_w + o_h).to(tl.float32)[None, :], dtype)
        n2 = _round(y2 * rstd * tl.load(norm_w + HALF + o_h).to(tl.float32)[None, :], dtype)
        t = (W + rows)[:, None] * HALF + o_h[None, :]
        cos = tl.load(rope_cos + t, mask=(rows < B)[:, None], other=0.0)
        sin = tl.load(rope_sin + t, mask=(rows < B)[:, None], other=0.0)
        y1 = _round(n1 * cos - n2 * sin, dtype)
        y2 = _round(n1 * sin + n2 * cos, dtype)
    out = qkv + rows[:, None] * 3 * WD + kind * WD + h * HD + o_h[None, :]
    tl.store(out, y1)
    tl.store(out + HALF, y2)


# ---- per layer ----------------------------------------------------------------------------
@triton.jit
def _attention_unit(qkv, kv_next, valid_next, rope_cos, rope_sin, w_o, part_o, l, h, first, sync, scale,
                    dtype: tl.constexpr, WD: tl.constexpr, HD: tl.constexpr, W: tl.constexpr, B: tl.constexpr,
                    BM: tl.constexpr, BW: tl.constexpr, DOT: tl.constexpr):
    """Head h of layer l: the block rows attend to the valid window rows (keys rotated to
    positions 0..W-1 here) and to all block rows; then the head's share of o_proj."""
    HALF: tl.constexpr = HD // 2
    o_h = tl.arange(0, HALF)
    o_hd = tl.arange(0, HD)
    cols = tl.arange(0, WD)
    wo = tl.load(w_o + l * WD * WD + cols[:, None] * WD + (h * HD + o_hd)[None, :])       # [WD, HD]
    _wait_first(first, sync)
    rows = tl.arange(0, BM)
    j = tl.arange(0, BW)
    j_ok = j < W
    blk = rows[:, None] * 3 * WD + h * HD + o_h[None, :]
    q1 = tl.load(qkv + blk, cache_modifier=".cg").to(dtype)
    q2 = tl.load(qkv + blk + HALF, cache_modifier=".cg").to(dtype)
    k1 = tl.load(qkv + blk + WD, cache_modifier=".cg").to(dtype)
    k2 = tl.load(qkv + blk + WD + HALF, cache_modifier=".cg").to(dtype)
    vb = tl.load(qkv + rows[:, None] * 3 * WD + 2 * WD + h * HD + o_hd[None, :], cache_modifier=".cg").to(dtype)
    keys = kv_next + l * 2 * W * WD + h * HD + j[:, None] * WD
    c1 = tl.load(keys + o_h[None, :], mask=j_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
    c2 = tl.load(keys + HALF + o_h[None, :], mask=j_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
    t = j[:, None] * HALF + o_h[None, :]
    cos = tl.load(rope_cos + t, mask=j_ok[:, None], other=0.0)
    sin = tl.load(rope_sin + t, mask=j_ok[:, None], other=0.0)
    r1 = (c1 * cos - c2 * sin).to(dtype)
    r2 = (c1 * sin + c2 * cos).to(dtype)
    vc = tl.load(keys + W * WD + o_hd[None, :], mask=j_ok[:, None], other=0.0, cache_modifier=".cg").to(dtype)
    s_c = (_dot(q1, r1, DOT) + _dot(q2, r2, DOT)) * scale                                 # [BM, BW]
    s_b = (_dot(q1, k1, DOT) + _dot(q2, k2, DOT)) * scale                                 # [BM, BM]
    seen = tl.load(valid_next + j, mask=j_ok, other=0, cache_modifier=".cg") != 0
    s_c = tl.where(seen[None, :], s_c, float("-inf"))
    s_b = tl.where((rows < B)[None, :], s_b, float("-inf"))
    m = tl.maximum(tl.max(s_c, axis=1), tl.max(s_b, axis=1))
    p_c = tl.exp(s_c - m[:, None])
    p_b = tl.exp(s_b - m[:, None])
    den = tl.sum(p_c, axis=1) + tl.sum(p_b, axis=1)
    o = (_mm(p_c.to(dtype), vc, DOT) + _mm(p_b.to(dtype), vb, DOT)) / den[:, None]
    part = _dot(o.to(dtype), wo, DOT)                                                      # [BM, WD]
    tl.store(part_o + h * BM * WD + rows[:, None] * WD + cols[None, :], part)


@triton.jit
def _mlp_unit(x_src, part_o, NH: tl.constexpr, x_keep, keep, mlp_norm, w_gate_up, w_down, part_d, l, u, first,
              sync, eps, dtype: tl.constexpr, WD: tl.constexpr, MH: tl.constexpr, B: tl.constexpr,
              BM: tl.constexpr, BH: tl.constexpr, DOT: tl.constexpr):
    """Hidden columns u*BH.. of layer l's MLP: stream + attention partials, norm, gate/up,
    SwiGLU, and their share of the down projection (an fp32 partial)."""
    hid = u * BH + tl.arange(0, BH)
    cols = tl.arange(0, WD)
    gu = w_gate_up + l * 2 * MH * WD
    wg = tl.load(gu + hid[:, None] * WD + cols[None, :])
    wu = tl.load(gu + (MH + hid)[:, None] * WD + cols[None, :])
    _wait_first(first, sync)
    rows = tl.arange(0, BM)
    x = _stream(x_src, part_o, NH, dtype, B, BM, WD)
    if keep:
        tl.store(x_keep + rows[:, None] * WD + cols[None, :], x)
    xn = _round(_rms(x, mlp_norm + l * WD, cols, eps, WD), dtype).to(dtype)
    gate = _round(_dot(xn, wg, DOT), dtype)
    up = _round(_dot(xn, wu, DOT), dtype)
    act = (_round(gate * tl.sigmoid(gate), dtype) * up).to(dtype)
    wd = tl.load(w_down + l * WD * MH + cols[:, None] * MH + hid[None, :])                  # [WD, BH]
    tl.store(part_d + u * BM * WD + rows[:, None] * WD + cols[None, :], _dot(act, wd, DOT))


# ---- the slots' logits ----------------------------------------------------------------------
@triton.jit
def _out_unit(x_src, part_d, n_parts, norm, out_proj, h_out, y_buf, blk, first, sync, eps, dtype: tl.constexpr,
              WD: tl.constexpr, D: tl.constexpr, B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              DOT: tl.constexpr):
    """The final norm (block 0 also stores the slot hiddens) and columns blk*BN.. of out_proj."""
    cols_d = blk * BN + tl.arange(0, BN)
    cols = tl.arange(0, WD)
    w = tl.load(out_proj + cols_d[:, None] * WD + cols[None, :], mask=(cols_d < D)[:, None], other=0.0)
    _wait_first(first, sync)
    rows = tl.arange(0, BM)
    hn = _round(_rms(_stream(x_src, part_d, n_parts, dtype, B, BM, WD), norm, cols, eps, WD), dtype)
    if blk == 0:
        slot = (rows >= 1) & (rows < B)
        tl.store(h_out + (rows - 1)[:, None] * WD + cols[None, :], hn.to(dtype), mask=slot[:, None])
    y = _round(_dot(hn.to(dtype), w, DOT), dtype)
    tl.store(y_buf + rows[:, None] * D + cols_d[None, :], y, mask=(cols_d < D)[None, :])


@triton.jit
def _head_unit(y_buf, final_norm, lm_head, logits, blk, first, sync, eps, VOCAB, dtype: tl.constexpr,
               D: tl.constexpr, B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
               DOT: tl.constexpr):
    """Vocabulary columns blk*BN.. of the slots' logits: the target's final norm + LM head."""
    voc = blk * BN + tl.arange(0, BN)
    v_ok = voc < VOCAB
    o_d = tl.arange(0, BD)
    d_ok = o_d < D
    w = tl.load(lm_head + voc[:, None] * D + o_d[None, :], mask=v_ok[:, None] & d_ok[None, :], other=0.0)
    _wait_first(first, sync)
    rows = tl.arange(0, BM)
    slot = (rows >= 1) & (rows < B)
    y = tl.load(y_buf + rows[:, None] * D + o_d[None, :], mask=slot[:, None] & d_ok[None, :], other=0.0,
                cache_modifier=".cg")
    yn = _rms(y, final_norm, o_d, eps, D).to(dtype)
    out = _round(_dot(yn, w, DOT), dtype)
    tl.store(logits + (rows - 1)[:, None] * VOCAB + voc[None, :], out, mask=slot[:, None] & v_ok[None, :])


@triton.jit
def _chain_out(cand, cand_logp, r, slots, chain, n_chain, flat, step, log_cand, log_cand_logp, log_draft_logp,
               log_steps, log_nodes, logp_scale, TOPK: tl.constexpr, BK: tl.constexpr, BNODES: tl.constexpr):
    """(greedy chains and fixed trees) The draft nodes that take one of slot r's candidates:
    node j + 1 of `chain` is candidate flat[j] of the [slots, k] table (a chain's node j + 1
    is slot j's top-1); and the step log's row: the slot's candidates and those nodes'
    log-probs (times logp_scale), as the drafter's torch ops write them."""
    tl.debug_barrier()      # cand rows were stored by other threads of this program
    row = tl.minimum(tl.load(step), log_steps - 1)
    o_k = tl.arange(0, BK)
    k_ok = o_k < TOPK
    tl.store(log_cand + (row * slots + r) * TOPK + o_k, tl.load(cand + r * TOPK + o_k, mask=k_ok), mask=k_ok)
    tl.store(log_cand_logp + (row * slots + r) * TOPK + o_k, tl.load(cand_logp + r * TOPK + o_k, mask=k_ok),
             mask=k_ok)
    j = tl.arange(0, BNODES)
    f = tl.load(flat + j, mask=j < n_chain, other=-1)
    mine = (j < n_chain) & (f >= r * TOPK) & (f < (r + 1) * TOPK)
    tl.store(chain + 1 + j, tl.load(cand + f, mask=mine), mask=mine)
    tl.store(log_draft_logp + row * log_nodes + 1 + j, tl.load(cand_logp + f, mask=mine) * logp_scale, mask=mine)
    if r == 0:      # the root's log-prob and the padding past the draft
        tl.store(log_draft_logp + row * log_nodes + j, tl.zeros([BNODES], dtype=tl.float32),
                 mask=((j == 0) | (j > n_chain)) & (j < log_nodes))


@triton.jit
def _best_first_tree(cand, rows, slots, pairs, tokens, parents, conv_index, draft_logp, logp_scale,
                     TOPK: tl.constexpr, NODES: tl.constexpr, CONV: tl.constexpr, BF: tl.constexpr,
                     BC: tl.constexpr, COND: tl.constexpr = False, BK: tl.constexpr = 1):
    """`specla.graphs.trees.grow_tree`'s best-first search with NODES - 1 nodes, in one
    program, over the slots' top-TOPK candidates cand [slots, TOPK]: the tree's tokens (node
    0, the root, not written; -1 for a dummy node), parents (-1 at the root), the conv window
    index `SpecTopology.rebuild` derives from them, and each node's log-prob times
    logp_scale into the step log's row draft_logp. The rows are static (`static_rows`: rows
    [slots, TOPK], best first: the block drafter's) or, with COND, conditional on the
    parent's candidate (`conditional_rows`: rows [slots, TOPK, TOPK], row [d, c] the
    children's log-probs under a parent that is candidate c of slot d - 1, in candidate
    order, row [0, c] the root's for every c: LiLiCorr's `tree_rows`), each ordered here by
    counting as grow_tree sorts it (descending, stable).

    A depth's children are the frontier's B = NODES - 1 slots times TOPK, in grow_tree's pool
    order; a child's rank among them (score desc, then index) gives the next frontier, and
    merged with the selection so far (earlier depths first on equal scores) the best B of
    everything grown, kept in rank order. Every rank is a count of the entries that beat an
    entry ([BC, BC] compares), so no sort is needed. Only the children of the flat indices
    `pairs` (f * TOPK + c, frontier slot f, place c in its row; -1 past them: `tree_pairs`)
    are compared. Static rows trim them: the frontier is in rank order and every row is the
    same best-first row, so child (f, c) is beaten by every (f' <= f, c' <= c), and only
    those with (f + 1)(c + 1) <= B can rank among the best B."""
    B: tl.constexpr = NODES - 1
    NEG: tl.constexpr = float("-inf")
    fq = tl.arange(0, BF)                       # frontier and selection slots
    f_score = tl.where(fq == 0, 0.0, NEG)       # the root, pool index 0, starts the frontier
    f_alive = fq == 0
    f_pool = tl.zeros([BF], dtype=tl.int32)
    s_score = tl.full([BF], NEG, tl.float32)     # the selection, in rank order
    s_depth = tl.zeros([BF], dtype=tl.int32)
    s_pool = tl.zeros([BF], dtype=tl.int32)
    s_parent = tl.zeros([BF], dtype=tl.int32)
    s_tok = tl.zeros([BF], dtype=tl.int64)
    s_lp = tl.zeros([BF], dtype=tl.float32)
    s_alive = tl.zeros([BF], dtype=tl.int32)
    f_cand = tl.zeros([BF], dtype=tl.int32)     # (COND) each frontier node's candidate index in its slot
    i = tl.load(pairs + tl.arange(0, BC))       # a depth's children: frontier slot i // TOPK, place i % TOPK
    child = i >= 0
    f_of = tl.where(child, i // TOPK, BF)
    c_of = tl.where(child, i % TOPK, 0)
    for d in range(slots):
        if COND:    # the parent's row, then the candidate at place c_of of its descending order
            kk = tl.arange(0, BK)
            parent_cand = _pick(f_cand, fq, f_of)
            vals = tl.load(rows + (d * TOPK + parent_cand)[:, None] * TOPK + kk[None, :],
                           mask=child[:, None] & (kk < TOPK)[None, :], other=NEG, cache_modifier=".cg")
            ahead = ((vals[:, :, None] > vals[:, None, :])
                     | ((vals[:, :, None] == vals[:, None, :]) & (kk[:, None] < kk[None, :])[None, :, :]))
            placed = tl.sum(ahead.to(tl.int32), 1) == c_of[:, None]            # [child, candidate]
            c_idx = tl.sum(tl.where(placed, kk[None, :], 0), 1)
            lp = tl.sum(tl.where(placed, vals, 0.0), 1)
        else:
            c_idx = c_of
            lp = tl.load(rows + d * TOPK + c_of, mask=child, other=NEG, cache_modifier=".cg")
        tok = tl.load(cand + d * TOPK + c_idx, mask=child, other=0, cache_modifier=".cg")
        alive = child & (_pick(f_alive.to(tl.int32), fq, f_of) != 0) & (lp > NEG)
        score = tl.where(alive, _pick(f_score, fq, f_of) + lp, NEG)
        pool = 1 + d * B * TOPK + i
        parent = _pick(f_pool, fq, f_of)
        # rank among the depth's children: j beats i on a higher score, or an equal one earlier
        beats = child[:, None] & ((score[:, None] > score[None, :])
                                  | ((score[:, None] == score[None, :]) & (i[:, None] < i[None, :])))
        rank = tl.sum(beats.to(tl.int32), 0)
        # the next frontier: slot q takes the child of rank q (dead children pad it)
        take = rank[None, :] == fq[:, None]
        f_alive = (tl.sum(tl.where(take & alive[None, :], 1, 0), 1) > 0) & (fq < B)
        f_score = tl.where(f_alive, tl.sum(tl.where(take, score[None, :], 0.0), 1), NEG)
        f_pool = tl.sum(tl.where(take, pool[None, :], 0), 1)
        f_cand = tl.sum(tl.where(take, c_idx[None, :], 0), 1)
        # merged ranks: a kept entry (an earlier depth) beats a child on an equal score
        kept = (fq < B) & (d > 0)
        g_child = rank + tl.sum((kept[:, None] & (s_score[:, None] >= score[None, :])).to(tl.int32), 0)
        g_kept = fq + tl.sum((child[None, :] & (score[None, :] > s_score[:, None])).to(tl.int32), 1)
        k_take = kept[None, :] & (g_kept[None, :] == fq[:, None])           # [slot, kept entry]
        c_take = child[None, :] & (g_child[None, :] == fq[:, None])         # [slot, child]
        s_score = (tl.sum(tl.where(k_take, s_score[None, :], 0.0), 1)
                   + tl.sum(tl.where(c_take, score[None, :], 0.0), 1))
        s_depth = tl.sum(tl.where(k_take, s_depth[None, :], 0), 1) + tl.sum(tl.where(c_take, d + 1, 0), 1)
        s_pool = tl.sum(tl.where(k_take, s_pool[None, :], 0), 1) + tl.sum(tl.where(c_take, pool[None, :], 0), 1)
        s_parent = (tl.sum(tl.where(k_take, s_parent[None, :], 0), 1)
                    + tl.sum(tl.where(c_take, parent[None, :], 0), 1))
        s_tok = tl.sum(tl.where(k_take, s_tok[None, :], 0), 1) + tl.sum(tl.where(c_take, tok[None, :], 0), 1)
        s_lp = tl.sum(tl.where(k_take, s_lp[None, :], 0.0), 1) + tl.sum(tl.where(c_take, lp[None, :], 0.0), 1)
        s_alive = (tl.sum(tl.where(k_take, s_alive[None, :], 0), 1)
                   + tl.sum(tl.where(c_take, alive.to(tl.int32)[None, :], 0), 1))
    # tree order: depth, then score desc, then pool index; dummies (dead entries) last
    real = (s_alive != 0) & (fq < B)
    t_depth = tl.where(real, s_depth, 1 << 20)
    t_score = tl.where(real, s_score, NEG)
    before = (fq < B)[:, None] & ((t_depth[:, None] < t_depth[None, :])
                                  | ((t_depth[:, None] == t_depth[None, :]) & (t_score[:, None] > t_score[None, :]))
                                  | ((t_depth[:, None] == t_depth[None, :]) & (t_score[:, None] == t_score[None, :])
                                     & (s_pool[:, None] < s_pool[None, :])))
    out = fq < B
    node = tl.where(out, 1 + tl.sum(before.to(tl.int32), 0), -1)           # [slot]; -1 past the B kept
    # a parent's node: the root (pool index 0) or the selected entry of that pool index
    par = tl.where(real, _pick(node, tl.where(out, s_pool, -1), s_parent), 0)
    tl.store(tokens + node, tl.where(real, s_tok, -1), mask=out)
    tl.store(parents + node, par.to(tl.int64), mask=out)
    tl.store(draft_logp + node, tl.where(real, s_lp, 0.0) * logp_scale, mask=out)
    # node-indexed parents and depths (a dummy hangs off the root: depth 1), then the conv index
    n = tl.arange(0, BF)
    n_par = _pick(par, node, n)                                           # the root: 0
    n_depth = tl.where(n == 0, 0, _pick(tl.where(real, s_depth, 1), node, n))
    tl.store(parents, -1)
    hop = n
    for h in tl.static_range(CONV):             # tap CONV - 1 - h: h generations up, or a window slot
        w = CONV - 1 - h
        col = tl.where(n_depth >= h, CONV - 1 + hop, n_depth + w)
        tl.store(conv_index + n * CONV + w, col.to(tl.int64), mask=n < NODES)
        hop = _pick(n_par, n, hop)


@triton.jit
def _block_draft_kernel(
        root, result, P, features, fc, ctx_norm, in_proj, mask_emb, attn_norm, w_qkv, qk_norm, w_o, mlp_norm,
        w_gate_up, w_down, norm, out_proj, embed, final_norm, lm_head, rope_cos, rope_sin,
        ctx, valid, kv, ctx_next, valid_next, kv_next, fc_out, x_a, x_b, qkv, part_o, part_d, y_buf,
        h_out, logits, cand, cand_logp, counter, status, slots, VOCAB, eps, target_eps, scale,
        chain, n_chain, flat, step, log_cand, log_cand_logp, log_draft_logp, log_steps, log_nodes, logp_scale,
        parents, conv_index, pair_index, tree_counter,
        D: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr,
        LD: tl.constexpr, MH: tl.constexpr, W: tl.constexpr, B: tl.constexpr, TOPK: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
        BH: tl.constexpr, BN_HEAD: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, CHAIN: tl.constexpr,
        BK_TOP: tl.constexpr, BNODES: tl.constexpr, TREE: tl.constexpr = False, TREE_NODES: tl.constexpr = 1,
        CONV: tl.constexpr = 1, BF: tl.constexpr = 1, BC: tl.constexpr = 1):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = fc.dtype.element_ty
    MLP_UNITS: tl.constexpr = MH // BH

    # 0: fc over the accepted path's features; the block input. Reads only the last launch's.
    for unit in range(pid, 2 * (WD // BN), programs):
        if unit < WD // BN:
            _fc_unit(features, result, P, fc, fc_out, unit, dtype, FD, WD, BM, BN, BK, DOT)
        else:
            _block_input_unit(root, embed, in_proj, mask_emb, x_a, unit - WD // BN, dtype, D, WD, B, BM, BN, BD)
    grid_arrive(counter)

    # 1: the window (raw keys and values of the fresh rows, shifted in) and layer 0's block q, k, v
    sync = (counter, programs, status)
    kv_units = LD * 2 * NH
    units = kv_units + 1 + 3 * NH
    for unit in range(pid, units, programs):
        if unit < kv_units:
            _window_kv_unit(fc_out, ctx_norm, w_qkv, qk_norm, kv, kv_next, result, unit // (2 * NH),
                            (unit // NH) % 2, unit % NH, unit == pid, sync, eps, dtype, WD, HD, W, BM, BW, DOT)
        elif unit == kv_units:
            _window_ctx_unit(fc_out, ctx_norm, ctx, ctx_next, valid, valid_next, result, unit == pid, sync, eps,
                             dtype, WD, W, BM, BW)
        else:
            u = unit - kv_units - 1
            _block_qkv_unit(x_a, part_d, 0, x_a, False, attn_norm, w_qkv, qk_norm, rope_cos, rope_sin, qkv,
                            0, u // NH, u % NH, unit == pid, sync, eps, dtype, WD, HD, W, B, BM, DOT)
    _end_phase(pid, units, counter, programs, status)

    phase = 2
    for l in range(LD):
        if l > 0:   # the block's q, k, v: stream (x_b) + the MLP's partials, kept in x_a
            sync = (counter, phase * programs, status)
            for unit in range(pid, 3 * NH, programs):
                _block_qkv_unit(x_b, part_d, MLP_UNITS, x_a, unit == 0, attn_norm, w_qkv, qk_norm, rope_cos,
                                rope_sin, qkv, l, unit // NH, unit % NH, unit == pid, sync, eps, dtype, WD, HD,
                                W, B, BM, DOT)
            _end_phase(pid, 3 * NH, counter, phase * programs, status)
            phase += 1

        # attention per head; (l = 0) the new window copied back over the old
        sync = (counter, phase * programs, status)
        copies = (2 * LD + 1) if l == 0 else 0
        for unit in range(pid, NH + copies, programs):
            if unit < NH:
                _attention_unit(qkv, kv_next, valid_next, rope_cos, rope_sin, w_o, part_o, l, unit,
                                unit == pid, sync, scale, dtype, WD, HD, W, B, BM, BW, DOT)
            else:
                _wait_first(unit == pid, sync)
                c = unit - NH
                cols = tl.arange(0, WD)
                if c < 2 * LD:
                    _shift_rows(kv_next + c * W * WD, kv + c * W * WD, -1, W, WD, cols, cols < WD, BW)
                else:
                    _shift_rows(ctx_next, ctx, -1, W, WD, cols, cols < WD, BW)
                    j = tl.arange(0, BW)
                    tl.store(valid + j, tl.load(valid_next + j, mask=j < W, cache_modifier=".cg"), mask=j < W)
        _end_phase(pid, NH + copies, counter, phase * programs, status)
        phase += 1

        # MLP per hidden slice: the stream x_a + attention partials, kept in x_b
        sync = (counter, phase * programs, status)
        for unit in range(pid, MLP_UNITS, programs):
            _mlp_unit(x_a, part_o, NH, x_b, unit == 0, mlp_norm, w_gate_up, w_down, part_d, l, unit, unit == pid,
                      sync, eps, dtype, WD, MH, B, BM, BH, DOT)
        _end_phase(pid, MLP_UNITS, counter, phase * programs, status)
        phase += 1

    # out: final norm + out_proj
    sync = (counter, phase * programs, status)
    out_units = tl.cdiv(D, BN)
    for unit in range(pid, out_units, programs):
        _out_unit(x_b, part_d, MLP_UNITS, norm, out_proj, h_out, y_buf, unit, unit == pid, sync, eps, dtype, WD, D,
                  B, BM, BN, DOT)
    _end_phase(pid, out_units, counter, phase * programs, status)
    phase += 1

    # head: the target's norm + LM head
    sync = (counter, phase * programs, status)
    head_units = tl.cdiv(VOCAB, BN_HEAD)
    for unit in range(pid, head_units, programs):
        _head_unit(y_buf, final_norm, lm_head, logits, unit, unit == pid, sync, target_eps, VOCAB, dtype, D, B,
                   BM, BN_HEAD, BD, DOT)
    _end_phase(pid, head_units, counter, phase * programs, status)
    phase += 1

    # top-k per slot
    grid_wait(counter, phase * programs, status)
    for r in range(pid, slots, programs):
        _slot_topk(logits, cand, cand_logp, r, VOCAB, TOPK, BV)
        if CHAIN:
            _chain_out(cand, cand_logp, r, slots, chain, n_chain, flat, step, log_cand, log_cand_logp, log_draft_logp,
                       log_steps, log_nodes, logp_scale, TOPK, BK_TOP, BNODES)
        if TREE:    # the last slot to finish grows the tree from every slot's candidates
            tl.debug_barrier()
            if tl.atomic_add(tree_counter, 1, sem="acq_rel", scope="gpu") == slots - 1:
                row = tl.minimum(tl.load(step), log_steps - 1)
                _best_first_tree(cand, cand_logp, slots, pair_index, chain, parents, conv_index,
                                 log_draft_logp + row * log_nodes, logp_scale, TOPK, TREE_NODES, CONV, BF, BC)
                tl.store(tree_counter, 0)       # re-armed for the next launch
    # the last arrival re-arms the counter: every program has left every wait by then
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if last == (phase + 1) * programs - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def unsupported(widths: dict[str, int]) -> str | None:
    """Why the kernel cannot draft for a drafter of these widths (WD, NH, HD, MH, W, B, F, D),
    or None."""
    WD, HD, MH, W, B = (widths[k] for k in ("WD", "HD", "MH", "W", "B"))
    if triton.next_power_of_2(WD) != WD or WD < 32:
        return f"drafter width {WD}: the kernel takes powers of two from 32"
    if triton.next_power_of_2(HD) != HD or HD < 32:
        return f"head width {HD}: the kernel takes powers of two from 32 (RoPE by 16-wide halves)"
    if MH % 32:
        return f"MLP width {MH}: the kernel takes multiples of 32"
    if B > MAX_ROWS:
        return f"block size {B}: the kernel takes at most {MAX_ROWS} rows"
    if W < B:
        return f"window {W}: the kernel appends an accepted path (up to {B} rows) to a window at least as long"
    return None


def rope_tables(positions: int, head_dim: int, device: torch.device,
                base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim // 2] fp32 of the block drafter's RoPE (halves rotated)."""
    half = head_dim // 2
    inv = base ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    ang = torch.arange(positions, device=device, dtype=torch.float32)[:, None] * inv
    return ang.cos().contiguous(), ang.sin().contiguous()


class ChainOut(NamedTuple):
    """Where a greedy chain or a fixed tree goes: tokens [drafted + 1] (node 0, the root,
    not written; node j + 1 is candidate flat[j] of the [slots, k] top-k table, int64), and
    the step log's row `step` (clamped to the last): cand / cand_logp [steps, slots, k] and
    draft_logp [steps, nodes] (the nodes' log-probs times logp_scale, 0 past the draft)."""
    tokens: torch.Tensor
    flat: torch.Tensor
    step: torch.Tensor
    cand: torch.Tensor
    cand_logp: torch.Tensor
    draft_logp: torch.Tensor
    logp_scale: float = 1.0

    @staticmethod
    def chain_map(drafted: int, top_k: int, device) -> torch.Tensor:
        """The `flat` of a greedy chain: node j + 1 is slot j's top-1."""
        return torch.arange(drafted, device=device) * top_k


class TreeOut(NamedTuple):
    """Where a best-first tree over the slots' candidates goes (`_best_first_tree`): tokens,
    parents [nodes] and conv_index [nodes, conv] (int64, as `SpecTopology` holds them; node
    0, the root: its token is not written), and the step log's rows as `ChainOut`'s."""
    tokens: torch.Tensor
    parents: torch.Tensor
    conv_index: torch.Tensor
    step: torch.Tensor
    cand: torch.Tensor
    cand_logp: torch.Tensor
    draft_logp: torch.Tensor
    logp_scale: float = 1.0


def tree_pairs(nodes: int, top_k: int, device, static: bool = True) -> torch.Tensor:
    """The children `_best_first_tree` compares at each depth: the flat indices f * top_k + c
    (frontier slot f, place c in its row) that can rank among the best nodes - 1, in order,
    -1 after them up to a power of two (int32). Static rows: (f + 1)(c + 1) <= nodes - 1;
    conditional ones: c < nodes - 1 (only its earlier siblings surely beat a child)."""
    B = nodes - 1
    flat = [f * top_k + c for f in range(B) for c in range(top_k) if ((f + 1) * (c + 1) if static else c + 1) <= B]
    width = triton.next_power_of_2(len(flat))
    return torch.tensor(flat + [-1] * (width - len(flat)), dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _cached_pairs(nodes: int, top_k: int, device: torch.device, static: bool) -> torch.Tensor:
    """`tree_pairs`, made once (a launch inside a CUDA graph capture cannot copy it over)."""
    return tree_pairs(nodes, top_k, device, static)


def tree_tiles(nodes: int, pairs: torch.Tensor) -> dict[str, int]:
    """`_best_first_tree`'s widths: the frontier / selection slots and the children compared."""
    return dict(BF=triton.next_power_of_2(nodes), BC=pairs.numel())


@triton.jit
def _best_first_tree_kernel(cand, rows, slots, pairs, tokens, parents, conv_index, logp, TOPK: tl.constexpr,
                            NODES: tl.constexpr, CONV: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr,
                            COND: tl.constexpr, BK: tl.constexpr):
    _best_first_tree(cand, rows, slots, pairs, tokens, parents, conv_index, logp, 1.0, TOPK, NODES, CONV, BF, BC,
                     COND, BK)


def best_first_tree(cand: torch.Tensor, rows: torch.Tensor, nodes: int, conv: int,
                    out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """`_best_first_tree` as a launch of its own, one program: the best-first tree of `nodes`
    nodes over cand [slots, k] with static rows [slots, k] (best first) or conditional rows
    [slots, k, k] (LiLiCorr's `tree_rows`, stacked). Fills `out` = (tokens, parents, logp
    [nodes], conv_index [nodes, conv]; int64 but logp fp32), or new tensors (the root's token
    0), and returns them. Its reference is `grow_tree` over `static_rows` or
    `conditional_rows`."""
    S, k = cand.shape
    dev = cand.device
    if not 2 <= nodes <= MAX_ROWS:
        raise ValueError(f"best-first tree: {nodes} nodes; the kernel grows 2 to {MAX_ROWS}")
    if tuple(rows.shape) not in ((S, k), (S, k, k)):
        raise ValueError(f"best-first tree: rows {tuple(rows.shape)} for candidates [{S}, {k}]: "
                         f"[{S}, {k}] or [{S}, {k}, {k}]")
    cond = rows.dim() == 3
    if out is None:
        long = dict(dtype=torch.long, device=dev)
        out = (torch.zeros(nodes, **long), torch.zeros(nodes, **long), torch.zeros(nodes, device=dev),
               torch.zeros(nodes, conv, **long))
    tokens, parents, logp, index = out
    pairs = _cached_pairs(nodes, k, dev, not cond)
    _best_first_tree_kernel[(1,)](cand.contiguous(), rows.float().contiguous(), S, pairs, tokens, parents, index, logp,
                                  TOPK=k, NODES=nodes, CONV=conv, **tree_tiles(nodes, pairs), COND=cond,
                                  BK=triton.next_power_of_2(k), num_warps=8)
    return out


class PersistentBlockDraft:
    """One launch per draft of a block drafter of `heads` heads, `window` context rows and
    blocks of `block` rows (root included): the weights, the second window and the scratch
    rows, made once (a CUDA graph holds their addresses). `programs` defaults to the SM count.
    `blocks` overrides tiles (benchmarks)."""

    def __init__(self, weights: BlockDraftWeights, heads: int, window: int, block: int, slots: int, top_k: int,
                 eps: float, target_eps: float, programs: int | None = None, num_warps: int = 8,
                 blocks: dict[str, int] | None = None):
        wt, dev = weights, weights.fc.device
        LD, three_wd, WD = wt.w_qkv.shape
        D, MH, HD = wt.in_proj.shape[1], wt.w_down.shape[2], WD // heads
        self.widths = dict(WD=WD, HD=HD, MH=MH, W=window, B=block, D=D, F=wt.fc.shape[1] // D, NH=heads, LD=LD)
        why = unsupported(self.widths)
        if why is None and not 1 <= slots < block:
            why = f"{slots} slots: a block of {block} rows drafts 1..{block - 1}"
        if why is not None:
            raise ValueError(f"block draft: {why}")
        for name, t in vars(wt).items():
            if not t.is_contiguous():
                raise ValueError(f"block draft: {name} must be contiguous")
        self.weights, self.device, self.dtype = wt, dev, wt.fc.dtype
        self.programs = resident_programs(dev, programs)
        self.slots, self.top_k, self.eps, self.target_eps = slots, top_k, eps, target_eps
        self.vocab = wt.lm_head.shape[0]
        f32 = dict(device=dev, dtype=torch.float32)
        BM = MAX_ROWS
        self.ctx_next = torch.zeros(window, WD, device=dev, dtype=self.dtype)
        self.valid_next = torch.zeros(window, device=dev, dtype=torch.uint8)
        self.kv_next = torch.zeros(LD, 2, window, WD, device=dev, dtype=self.dtype)
        self.fc_out, self.x_a, self.x_b = (torch.zeros(BM, WD, **f32) for _ in range(3))
        self.qkv = torch.zeros(BM, 3 * WD, **f32)
        self.part_o = torch.zeros(heads, BM, WD, **f32)
        self.y = torch.zeros(BM, D, **f32)
        self.rope_cos, self.rope_sin = rope_tables(window + block, HD, dev)
        self.counter = torch.zeros(1, device=dev, dtype=torch.int32)
        self.tree_counter = torch.zeros(1, device=dev, dtype=torch.int32)      # slots done (a best-first tree)
        self.status = torch.zeros(1, device=dev, dtype=torch.int32)
        self.blocks = dict(BN=32, BK=128, BH=32, BN_HEAD=32)
        unknown = set(blocks or ()) - set(self.blocks)
        if unknown:
            raise ValueError(f"block draft: no tiles named {sorted(unknown)}")
        self.blocks.update(blocks or {})
        if MH % self.blocks["BH"] or WD % self.blocks["BN"]:
            raise ValueError(f"block draft: BH {self.blocks['BH']} / BN {self.blocks['BN']} do not divide "
                             f"{MH} / {WD}")
        self.part_d = torch.zeros(MH // self.blocks["BH"], BM, WD, **f32)
        self.dot = _dot_mode(self.dtype)
        self.num_warps = num_warps

    def __call__(self, root: torch.Tensor, result: torch.Tensor, features: torch.Tensor | None, ctx: torch.Tensor,
                 valid: torch.Tensor, kv: torch.Tensor, h: torch.Tensor, logits: torch.Tensor, cand: torch.Tensor,
                 cand_logp: torch.Tensor, chain: ChainOut | TreeOut | None = None) -> None:
        """Append the accepted path (result: a, end, bonus, path... as the speculative step
        writes it; a = -1 appends nothing) of `features` [nodes, F, D] to the window ctx
        [W, WD], valid [W] (bool) and kv [LD, 2, W, WD] (raw keys, values), then draft after
        `root` [1]: slot hiddens h [block-1, WD], fp32 logits [block-1, vocab], and the first
        `slots` slots' top-k cand [slots, k] (int64) and cand_logp [slots, k] (fp32). With
        `chain`, the greedy chain of the slots' top-1 (or a fixed tree's picks) and its
        step-log row are written too; with a `TreeOut`, the best-first tree over the slots'
        candidates (`_best_first_tree`) and its row."""
        w, dev = self.widths, self.device
        S, k = self.slots, self.top_k
        expected = {"ctx": (ctx, (w["W"], w["WD"])), "valid": (valid, (w["W"],)),
                    "kv": (kv, (w["LD"], 2, w["W"], w["WD"])), "h": (h, (w["B"] - 1, w["WD"])),
                    "logits": (logits, (w["B"] - 1, self.vocab)), "cand": (cand, (S, k)),
                    "cand_logp": (cand_logp, (S, k))}
        for name, (t, shape) in expected.items():
            if tuple(t.shape) != shape or not t.is_contiguous() or t.device != dev:
                raise ValueError(f"block draft: {name} must be contiguous of shape {shape} on {dev}, "
                                 f"got {tuple(t.shape)}")
        if logits.dtype != torch.float32 or valid.dtype != torch.bool or cand.dtype != torch.long:
            raise ValueError("block draft: logits must be fp32, valid bool and cand int64")
        P = result.numel() - 3
        if not 0 <= P <= min(MAX_ROWS, w["W"]):
            raise ValueError(f"block draft: a path of {P} rows; the kernel appends at most {min(MAX_ROWS, w['W'])}")
        if features is None:
            features = ctx          # not read: a result with a = -1 appends nothing
        elif tuple(features.shape[1:]) != (w["F"], w["D"]) or not features.is_contiguous():
            raise ValueError(f"block draft: features must be contiguous [nodes, {w['F']}, {w['D']}]")
        tree = chain if isinstance(chain, TreeOut) else None
        chain_args = self._tree_args(tree, cand) if tree is not None else self._chain_args(chain, cand)
        pairs = _cached_pairs(tree.tokens.numel(), k, self.device, True) if tree is not None else None
        tree_meta = dict(TREE=True, TREE_NODES=tree.tokens.numel(), CONV=tree.conv_index.shape[1],
                         **tree_tiles(tree.tokens.numel(), pairs)) if tree is not None else {}
        wt, b = self.weights, self.blocks
        compiled = _block_draft_kernel[(self.programs,)](
            root, result, P, features, wt.fc, wt.ctx_norm, wt.in_proj, wt.mask_emb, wt.attn_norm, wt.w_qkv,
            wt.qk_norm, wt.w_o, wt.mlp_norm, wt.w_gate_up, wt.w_down, wt.norm, wt.out_proj, wt.embed,
            wt.final_norm, wt.lm_head, self.rope_cos, self.rope_sin, ctx, valid.view(torch.uint8), kv,
            self.ctx_next, self.valid_next, self.kv_next, self.fc_out, self.x_a, self.x_b, self.qkv, self.part_o,
            self.part_d, self.y, h, logits, cand, cand_logp, self.counter, self.status, S, self.vocab,
            self.eps, self.target_eps, w["HD"] ** -0.5, *chain_args,
            *((tree.parents, tree.conv_index, pairs, self.tree_counter) if tree is not None
              else (cand, cand, self.counter, self.counter)),
            D=w["D"], FD=w["F"] * w["D"], WD=w["WD"], NH=w["NH"], HD=w["HD"], LD=w["LD"], MH=w["MH"], W=w["W"],
            B=w["B"], TOPK=k, BM=MAX_ROWS, BN=b["BN"], BK=b["BK"], BD=triton.next_power_of_2(w["D"]),
            BW=max(16, triton.next_power_of_2(w["W"])), BH=b["BH"], BN_HEAD=b["BN_HEAD"],
            BV=triton.next_power_of_2(self.vocab), DOT=self.dot, CHAIN=chain is not None,
            BK_TOP=triton.next_power_of_2(k), BNODES=triton.next_power_of_2(chain_args[-2]), **tree_meta,
            num_warps=self.num_warps)
        carveout.prefer(compiled)

    def _chain_args(self, chain: ChainOut | None, cand: torch.Tensor) -> tuple:
        """The kernel's chain arguments (placeholders without a chain), checked."""
        if chain is None:
            return (cand, 0, cand, cand, cand, cand, cand, 1, 1, 0.0)
        steps, nodes = self._check_logs(chain, (chain.tokens, chain.flat), "chain")
        drafted = chain.flat.numel()
        # (the candidates' range is the caller's to check: reading them back here would sync a capture)
        if not 1 <= drafted or chain.tokens.numel() != drafted + 1 or nodes <= drafted or chain.flat.dtype != torch.long:
            raise ValueError(f"block draft: {drafted} drafted tokens (int64 candidate indices) into "
                             f"{chain.tokens.numel()} tokens and log rows of {nodes}")
        return (chain.tokens, drafted, chain.flat, chain.step, chain.cand, chain.cand_logp, chain.draft_logp, steps,
                nodes, chain.logp_scale)

    def _check_logs(self, out: ChainOut | TreeOut, buffers: tuple, what: str) -> tuple[int, int]:
        """(steps, nodes) of a chain's or tree's step log, after checking its candidate logs'
        shapes and that every buffer is contiguous on the kernel's device."""
        S, k = self.slots, self.top_k
        steps, nodes = out.draft_logp.shape
        if tuple(out.cand.shape) != (steps, S, k) or tuple(out.cand_logp.shape) != (steps, S, k):
            raise ValueError(f"block draft: the candidate logs must be [{steps}, {S}, {k}]")
        for t in buffers + (out.cand, out.cand_logp, out.draft_logp):
            if not t.is_contiguous() or t.device != self.device:
                raise ValueError(f"block draft: the {what}'s buffers must be contiguous on the kernel's device")
        return steps, nodes

    def _tree_args(self, tree: TreeOut, cand: torch.Tensor) -> tuple:
        """The kernel's chain arguments for a best-first tree (the log rows; no chain picks), checked."""
        steps, log_nodes = self._check_logs(tree, (tree.tokens, tree.parents, tree.conv_index), "tree")
        n = tree.tokens.numel()
        if not 2 <= n <= min(log_nodes, MAX_ROWS):
            raise ValueError(f"block draft: a best-first tree of {n} nodes into log rows of {log_nodes} "
                             f"(the kernel grows 2 to {MAX_ROWS})")
        if tuple(tree.parents.shape) != (n,) or tree.conv_index.dim() != 2 or tree.conv_index.shape[0] != n:
            raise ValueError(f"block draft: a tree of {n} nodes needs parents [{n}] and conv_index [{n}, conv]")
        if tree.parents.dtype != torch.long or tree.conv_index.dtype != torch.long:
            raise ValueError("block draft: the tree's parents and conv index must be int64")
        return (tree.tokens, 0, tree.tokens, tree.step, tree.cand, tree.cand_logp, tree.draft_logp, steps, log_nodes,
                tree.logp_scale)

    def failed(self) -> bool:
        """Whether a barrier gave up waiting since this draft was made (reads the device)."""
        return bool(self.status.item())
