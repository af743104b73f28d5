"""A draft chain's (or tree's) whole verification forward of a narrow GDN target in one
persistent Triton launch: `chain_verify_step_ref` in `kernels/reference.py`.

Why: verifying the embedded model's chain of 8 nodes took 45 launches and ~168 us on the
H200, 2 AR steps, where the bytes it moves take a few microseconds
(benchmarks/results/h200/session15/). The persistent AR step (`triton_decode_step.py`)
showed the launch boundary is not the only cost: every dependent phase is. So this kernel
keeps the AR step's phase structure and runs it over all N nodes at once, with the
recurrence in the parallel (tree-masked UT) form, so N nodes cost one phase. A tree's
parents and conv windows are read from the device at every call (a graph serves every tree
of its size). The tiles hold 16 rows either way, so a tree of 16 nodes took 168 us with
acceptance on the H200 against 158 for a chain of 8 (benchmarks/results/h200/session18/, 19/):

    first      the nodes' embeddings (the root read from the device)
    per layer  A   residual add + RMSNorm + input projection, N rows (tl.dot); a unit holds
                   a block of q, k or v columns for every node, so it runs their conv along
                   the chain and SiLU itself (the raw conv inputs go straight into the commit
                   buffers), and the unit of a and b the gates; the feature rows of the layer
                   before
                   (FOLD_IN_A) the programs with no unit fold the deferred commit into the
                   layer's state, one (head, V tile) a unit
               B   per (head, V tile): the l2 norms of the head's q and k rows, and the
                   parallel form over the N nodes (outputs and the delta and key factors)
               C   gated per-head norm + output projection
               D   residual add + RMSNorm + gate/up projection
               E   SwiGLU + down projection
    then       F   residual add + final RMSNorm + LM head (fp32 logits), the normed rows and
                   the last layer's feature rows
    (greedy)   F's column units also leave each row's block maxima; one phase of acceptance
               (`triton_chain_accept.py`)

On the H200 (benchmarks/results/h200/session16/) a chain of 8 took ~150 us in one launch
against ~169 us for the 45 per-op launches: each phase cost 3-6 us, about what a launch did,
so what is left to win is fewer phases a layer, not cheaper boundaries: the conv and gates
run in the input projection's units, and cost no barrier of their own.

The arithmetic is the per-op verification's (`triton_projection._dot_slice`, the conv and
gates of `triton_conv_gates._conv_gates_node` over a tile of nodes, `triton_verify._parallel_tile`),
so the logits equal the fused op set's tree forward's up to the order of fp32 sums. The state
is written only by the pending fold, as the per-op verifiers do; without acceptance the conv
cache is not written (acceptance shifts it).
Barriers, residency and the give-up flag as in the persistent AR step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import carveout
from kernels.pdl import grid_arrive, grid_wait, phase_us, stamp
from kernels.reference import DecodeWeights
from kernels.triton_chain_accept import ChainAccept, _accept_phase, _head_stats, accept_tiles
from kernels.triton_conv_gates import _log_decay_and_beta
from kernels.triton_decode_step import check_decode_weights, resident_programs
from kernels.triton_projection import (_dot_mode, _dot_slice, _input_block, _row_rstd, _split_reduce,
                                       _summed_input)
from kernels.triton_verify import PARALLEL_MAX_NODES, _fold_pending, _parallel_config, _parallel_tile

MAX_NODES = PARALLEL_MAX_NODES      # the parallel form's [16, 16] tiles, and 16-row projections
# K slice of the output and down projections: every program recomputes the gated norm or the
# SwiGLU over the columns it multiplies, so a whole K a program (1024 at the embedded down
# projection) cost ~24 us a layer on the H200 (benchmarks/results/h200/session16/)
SPLIT_K = 128
# Columns a unit of the input projection takes (None: `in_proj_block`'s fewest). A unit
# once held a whole head (its q, k and v l2 norms need it): the embedded model's phase A had
# 25 units of 64 columns for 132 programs; the norms now wait for phase B
IN_PROJ_BLOCK: int | None = None
# The deferred commit folded by the programs phase A leaves idle (97 units for 132 programs at
# the embedded shape), not at the head of the recurrence's units in phase B, whose every
# layer waits on the fold's loads and store before its own: the embedded verification alone
# 154 us against 161 (False: fold in phase B; benchmarks/results/h100/session37/)
FOLD_IN_A = True


@triton.jit
def _rows_phase(src, w, y, y_stride, M, N, K, eps, pid, programs, sync, dtype: tl.constexpr,
                PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, SWISH: tl.constexpr, HEAD: tl.constexpr,
                DOT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                SPLIT: tl.constexpr, split_sums, STATS: tl.constexpr = False, stats=None):
    """y[:M] = prologue(src) @ w.T [M, N], units of (column block, K slice) dealt round-robin;
    the column-0 block also writes x + residual (PROLOGUE 0 with HAS_RES, each K slice its
    part). A program's first unit loads its first weight tile, then waits at the barrier
    `sync`; a program with no unit waits too (else its arrivals would count for a phase
    others have not finished). SPLIT > 1: K slices of BK columns, whose fp32 partials the
    last slice of a column block to finish sums in slice order (`_split_reduce`, with
    `split_sums` = (partials, counters)); each program then recomputes the prologue over
    BK columns, not K: the prologue, redone by every program, is what a wide K costs.
    STATS (SPLIT 1): each column block's row maxima for the acceptance (`_head_stats`)."""
    rows = tl.arange(0, BM)
    blocks = tl.cdiv(N, BN)
    for unit in range(pid, blocks * SPLIT, programs):
        blk = unit // SPLIT
        part = unit % SPLIT
        cols = blk * BN + tl.arange(0, BN)
        c_mask = cols < N
        first = (sync[0], tl.where(unit == pid, sync[1], 0), sync[2])
        k_lo = part * BK if SPLIT > 1 else 0
        k_hi = tl.minimum(k_lo + BK, K) if SPLIT > 1 else K
        acc = _dot_slice(src, w + cols[:, None] * K, c_mask, k_lo, k_hi, M, K, eps, blk == 0, dtype,
                         PROLOGUE, HAS_RES, SWISH, HEAD, DOT, BM, BN, BK, 2, first)
        out_mask = (rows < M)[:, None] & c_mask[None, :]
        y_ptrs = y + rows[:, None] * y_stride + cols[None, :]
        if SPLIT == 1:
            tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=out_mask)
            if STATS:
                _head_stats(acc, rows, rows < M, cols, c_mask, blk, blocks, stats)
        else:
            _split_reduce(acc, split_sums[0], split_sums[1] + blk, y_ptrs, rows[:, None] * N + cols[None, :],
                          out_mask, part, M * N, SPLIT)
    if pid >= blocks * SPLIT:
        grid_wait(sync[0], sync[1], sync[2])


@triton.jit
def _conv_tile(x, window, index, weight, bias, rows, r_mask, cols, c_mask, dtype: tl.constexpr, W: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """SiLU(conv) [BM, BN] of the nodes `rows` for channels `cols` (fp32, rounded once to
    dtype, as `triton_conv_gates._node_conv`): x [BM, BN] holds the nodes' conv inputs (the
    projection's tile, rounded to dtype), window [C, W] the committed slots 1..W-1, index
    [N, W] each node's positions in [slots 1..W-1, nodes]. A tap's input from another node is
    picked from x by a 0/1 product, exact in fp32, so the tile takes no round trip through
    memory; the window's loads depend on nothing this launch writes."""
    out = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    for w in tl.static_range(W):
        pos = tl.load(index + rows * W + w, mask=r_mask, other=0)[:, None]
        in_window = pos < W - 1
        old = tl.load(window + cols[None, :] * W + 1 + pos, mask=r_mask[:, None] & c_mask[None, :] & in_window,
                      other=0.0)
        pick = (pos - (W - 1) == rows[None, :]).to(tl.float32)
        new = tl.dot(pick, x, input_precision="ieee")
        tap = tl.load(weight + cols * W + w, mask=c_mask, other=0.0).to(tl.float32)
        out += tl.where(in_window, old.to(tl.float32), new) * tap[None, :]
    if HAS_BIAS:
        out += tl.load(bias + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    out = out * tl.sigmoid(out)
    return out.to(dtype).to(tl.float32)


@triton.jit
def _in_proj_units(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BN: tl.constexpr):
    """Phase A's unit count: the conv channels' BN-column blocks, the output gate's, and one
    for a and b. Programs past it have no phase A work: they fold the deferred commit."""
    return H * (2 * K + V) // BN + (H * V + BN - 1) // BN + 1


@triton.jit
def _in_proj_conv_phase(src, w_in, y_in, N_IN, M, D, eps, pid, programs, sync, window, index, conv_w, conv_b,
                        neg_A, dt_bias, q_raw, k_raw, v_s, g_f, beta_s, conv_in, features, feat_row, F,
                        dtype: tl.constexpr, SWISH: tl.constexpr, DOT: tl.constexpr, H: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                        NEG_EIGVAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        BD: tl.constexpr, BH: tl.constexpr):
    """Phase A: residual add + RMSNorm + the input projection, then each unit's share of the
    conv and gates over the chain, so they need no phase of their own. A unit is a BN-column
    block of the conv channels (its conv inputs go to `conv_in`, the factor a commit needs;
    conv and SiLU, per channel, into q_raw, k_raw or v_s: phase B takes q's and k's l2 norms,
    so a unit need not hold a whole head), a BN-column block of the output gate (into y_in for
    phase C), or a and b (g and beta per node and head). The first unit also writes
    x + residual and (feat_row >= 0) copies it into features."""
    C: tl.constexpr = H * (2 * K + V)
    CONV_BLOCKS: tl.constexpr = C // BN
    AB_UNIT = _in_proj_units(H, K, V, BN) - 1      # the last unit: a and b
    rows = tl.arange(0, BM)
    r_mask = rows < M
    for unit in range(pid, AB_UNIT + 1, programs):
        if unit < AB_UNIT:
            col0 = unit * BN
            width = tl.minimum(BN, C + H * V - col0)
        else:
            col0, width = C + H * V, 2 * H
        o_n = tl.arange(0, BN)
        cols = col0 + o_n
        c_mask = o_n < width
        first = (sync[0], tl.where(unit == pid, sync[1], 0), sync[2])
        acc = _dot_slice(src, w_in + cols[:, None] * D, c_mask, 0, D, M, D, eps, unit == 0, dtype, 0, True, SWISH,
                         1, DOT, BM, BN, BK, 2, first)
        tile = r_mask[:, None] & c_mask[None, :]
        if unit < CONV_BLOCKS:        # conv inputs, then the conv over the chain (blocks never straddle q, k, v)
            tl.store(conv_in + rows[:, None] * C + cols[None, :], acc.to(dtype), mask=tile)
            x = _conv_tile(acc.to(dtype).to(tl.float32), window, index, conv_w, conv_b, rows, r_mask, cols, c_mask,
                           dtype, W, HAS_BIAS)
            if col0 < H * K:
                tl.store(q_raw + rows[:, None] * H * K + cols[None, :], x, mask=tile)
            elif col0 < 2 * H * K:
                tl.store(k_raw + rows[:, None] * H * K + (cols - H * K)[None, :], x, mask=tile)
            else:
                tl.store(v_s + rows[:, None] * H * V + (cols - 2 * H * K)[None, :], x, mask=tile)
        else:
            tl.store(y_in + rows[:, None] * N_IN + cols[None, :], acc.to(dtype), mask=tile)
            if unit == AB_UNIT:     # a and b: the log decay and beta of every node and head
                tl.debug_barrier()
                heads = tl.minimum(tl.arange(0, BH), H - 1)[None, :]
                row_ptr = y_in + tl.minimum(rows, M - 1)[:, None] * N_IN + C + H * V
                g, beta = _log_decay_and_beta(row_ptr, row_ptr + H, neg_A, dt_bias, heads, NEG_EIGVAL)
                out = r_mask[:, None] & (tl.arange(0, BH) < H)[None, :]
                tl.store(g_f + rows[:, None] * H + heads, g, mask=out)
                tl.store(beta_s + rows[:, None] * H + heads, beta, mask=out)
        if unit == 0:
            if feat_row >= 0:   # this layer's input rows, written above by this program: a drafter's features
                tl.debug_barrier()
                _copy_rows(src[4], features + feat_row * D, F * D, M, 0, 1, D, BD)


@triton.jit
def _fold_phase(S, pk, pd, pg, P, pid, programs, units, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BV: tl.constexpr):
    """The deferred commit folded into one layer's state [H, K, V], one (head, BV columns)
    tile a unit, by the programs past phase A's `units` (which have none there). The state and
    the pending factors were written before this launch, so a fold waits at no barrier, and
    the recurrence after it reads a folded state."""
    tiles: tl.constexpr = V // BV
    ks = tl.arange(0, K)
    for unit in range(pid, units + H * tiles, programs):
        if unit >= units:
            i_h = (unit - units) // tiles
            o_v = ((unit - units) % tiles) * BV + tl.arange(0, BV)
            p_S = S + i_h * K * V + ks[:, None] * V + o_v[None, :]
            tl.store(p_S, _fold_pending(tl.load(p_S), pk, pd, pg, 0, i_h, P, ks, o_v, H, K, V))


@triton.jit
def _copy_rows(src, dst, dst_stride, M, pid, programs, D: tl.constexpr, BD: tl.constexpr):
    """dst[r, :D] = src[r, :D] for r < M, rows dealt round-robin (src rows contiguous)."""
    o_d = tl.arange(0, BD)
    for r in range(pid, M, programs):
        tl.store(dst + r * dst_stride + o_d, tl.load(src + r * D + o_d, mask=o_d < D), mask=o_d < D)


@triton.jit
def _chain_verify_kernel(
        tokens, root, embed, zeros, attn_norm, w_in, conv_w, conv_b, neg_A, dt_bias, o_norm, w_o, mlp_norm,
        w_gu, w_down, final_norm, lm_head, cache, S, pk, pd, pg, P, index, parents, feat_slot,
        logits, hidden, features, k_f, g_f, delta_f, conv_in_f, stat_m, stat_i, stat_s,
        x_emb, res_a, res_b, x_buf, y_in, q_raw, k_raw, v_s, beta_s, o_buf, gu_buf, partials, block_counters, counter, status,
        times, N, eps, scale,
        choice_s, prob_s, pos, step, out, out_len, acc, acc_len, last, result, log_tokens, log_parents,
        log_choice, log_prob, log_result, log_steps, log_nodes, cont, cont_len, div, gap,
        L: tl.constexpr, D: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        W: tl.constexpr, I: tl.constexpr, VOCAB: tl.constexpr, F: tl.constexpr, HAS_BIAS: tl.constexpr,
        NEG_EIGVAL: tl.constexpr, SWISH: tl.constexpr, HAS_PENDING: tl.constexpr, DOT: tl.constexpr,
        BM: tl.constexpr, BN_IN: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
        BN_HEAD: tl.constexpr, BK_D: tl.constexpr, BK_O: tl.constexpr, BK_I: tl.constexpr, BD: tl.constexpr,
        BK_IN: tl.constexpr, BH_IN: tl.constexpr, BW: tl.constexpr, PBK: tl.constexpr, PBV: tl.constexpr,
        SPLIT_O: tl.constexpr, SPLIT_DOWN: tl.constexpr, TIMED: tl.constexpr, ACCEPT: tl.constexpr,
        ORACLE: tl.constexpr, BB: tl.constexpr, BNODES: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr,
        BHK: tl.constexpr, BHV: tl.constexpr, BH: tl.constexpr, CHAIN: tl.constexpr, FOLD_IN_A: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = w_in.dtype.element_ty
    C = H * (2 * K + V)
    N_IN = C + H * V + 2 * H
    A_UNITS = _in_proj_units(H, K, V, BN_IN)
    sums = (partials, block_counters)
    # the embeddings: row 0 is the root the last step (or the prefill) left on the device
    o_d = tl.arange(0, BD)
    for r in range(pid, N, programs):
        tok = tl.maximum(tl.where(r == 0, tl.load(root), tl.load(tokens + r)), 0)
        tl.store(x_emb + r * D + o_d, tl.load(embed + tok * D + o_d, mask=o_d < D), mask=o_d < D)
    if pid == 0:
        tl.store(tokens, tl.load(root))       # acceptance reads the verified tokens, root included
    stamp(times, 0, pid, programs, TIMED)
    grid_arrive(counter)
    # each phase's programs arrive when their stores are done; the next phase waits for all
    # arrivals so far (`phase` of them each), as in the persistent AR step
    phase = 1
    for l in range(L):
        # A: the block input (the embeddings, or the last MLP's output plus the residual), the input
        # projection, and the conv + gates of every node; the residual rows are layer l-1's output
        if l == 0:
            src = (x_emb, D, zeros, 0, res_a, zeros, 0, attn_norm)
        else:
            src = (x_buf, D, res_b, D, res_a, zeros, 0, attn_norm + l * D)
        feat_row = tl.load(feat_slot + l - 1) if l > 0 else -1
        _in_proj_conv_phase(src, w_in + l * N_IN * D, y_in, N_IN, N, D, eps, pid, programs,
                            (counter, phase * programs, status), cache + l * C * W, index, conv_w + l * C * W,
                            conv_b + l * C, neg_A + l * H, dt_bias + l * H, q_raw, k_raw, v_s,
                            g_f + l * N * H, beta_s, conv_in_f + l * N * C, features, feat_row, F, dtype,
                            SWISH, DOT, H, K, V, W, HAS_BIAS, NEG_EIGVAL, BM, BN_IN, BK_IN, BD, BH_IN)
        if HAS_PENDING and FOLD_IN_A:
            _fold_phase(S + l * H * K * V, pk + l * P * H * K, pd + l * P * H * V, pg + l * P * H, P, pid,
                        programs, A_UNITS, H, K, V, PBV)
        if pid >= A_UNITS:
            grid_wait(counter, phase * programs, status)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

        # B: (without FOLD_IN_A) the deferred commit, and the recurrence over the chain, per (head,
        # V tile), from the raw q and k rows (normed here; V tile 0 writes the normed keys, the
        # commit's factors)
        grid_wait(counter, phase * programs, status)
        tiles = V // PBV
        for unit in range(pid, H * tiles, programs):
            _parallel_tile(q_raw, k_raw, v_s, g_f + l * N * H, beta_s, parents, S + l * H * K * V,
                           o_buf, delta_f + l * N * H * V, H * K * V, K * V, V, 1,
                           pk + l * P * H * K, pd + l * P * H * V, pg + l * P * H, P, N,
                           unit % tiles, unit // tiles, H, K, V, 16, PBK, PBV, CHAIN, HAS_PENDING and not FOLD_IN_A,
                           "ieee",
                           False, False, True, scale, k_f + l * N * H * K)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

        # C: gated norm + output projection
        src = (o_buf, H * V, zeros, 0, zeros, y_in + C, N_IN, o_norm + l * V)
        _rows_phase(src, w_o + l * D * H * V, x_buf, D, N, D, H * V, eps, pid, programs,
                    (counter, phase * programs, status), dtype, 1, False, SWISH, V, DOT, BM, BN_O, BK_O, SPLIT_O, sums)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

        # D: residual add + norm + gate/up projection
        src = (x_buf, D, res_a, D, res_b, zeros, 0, mlp_norm + l * D)
        _rows_phase(src, w_gu + l * 2 * I * D, gu_buf, 2 * I, N, 2 * I, D, eps, pid, programs,
                    (counter, phase * programs, status), dtype, 0, True, SWISH, 1, DOT, BM, BN_GU, BK_D, 1, sums)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

        # E: SwiGLU + down projection
        src = (gu_buf, 2 * I, zeros, 0, zeros, zeros, 0, zeros)
        _rows_phase(src, w_down + l * D * I, x_buf, D, N, D, I, eps, pid, programs,
                    (counter, phase * programs, status), dtype, 2, False, SWISH, 1, DOT, BM, BN_DOWN, BK_I, SPLIT_DOWN, sums)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

    # F: final norm + LM head (fp32 logits); the normed rows and the last layer's features
    src = (x_buf, D, res_b, D, res_a, zeros, 0, final_norm)
    stats = (stat_m, stat_i, stat_s)
    _rows_phase(src, lm_head, logits, VOCAB, N, VOCAB, D, eps, pid, programs,
                (counter, phase * programs, status), dtype, 0, True, SWISH, 1, DOT, BM, BN_HEAD, BK_D, 1, sums,
                ACCEPT, stats)
    last_slot = tl.load(feat_slot + L - 1)
    for r in range(pid, N, programs):
        row = r + tl.arange(0, 1)
        ok = row < N
        d_mask = o_d < D
        rstd = _row_rstd(src, row, ok, D, eps, True, 1, BD)
        h = _input_block(src, rstd, eps, row, ok, o_d, d_mask, D, False, dtype, 0, True, SWISH, 1, 1, BD)
        tl.store(hidden + r * D + o_d[None, :], h, mask=d_mask[None, :])
        if last_slot >= 0:
            summed = _summed_input(src, row, ok, o_d, d_mask, True)
            tl.store(features + (r * F + last_slot) * D + o_d[None, :], summed.to(dtype), mask=d_mask[None, :])
    stamp(times, phase, pid, programs, TIMED)
    if ACCEPT:      # greedy acceptance (`triton_chain_accept.py`): one more phase
        grid_arrive(counter)
        phase += 1
        grid_wait(counter, phase * programs, status)
        _accept_phase(tokens, parents, logits, stats, tl.cdiv(VOCAB, BN_HEAD), root, k_f, g_f, delta_f, conv_in_f,
                      pk, pd, pg, cache, choice_s, prob_s, N, P, pos, step, out, out_len, acc, acc_len, last, result,
                      log_tokens, log_parents, log_choice, log_prob, log_result, log_steps, log_nodes, cont, cont_len,
                      div, gap, pid, programs, L, H, K, V, W, VOCAB, ORACLE, BNODES, BP, BC, BW, BHK, BHV, BH, BB,
                      CHAIN)
        stamp(times, phase, pid, programs, TIMED)
    # the last arrival re-arms the counter: every program has left every wait by then
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if last == (phase + 1) * programs - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def in_proj_block(H: int, K: int, V: int) -> int | None:
    """Columns a unit of the input projection takes: the fewest (16 at least, tl.dot's
    smallest) that hold a and b and tile the q, k and v columns without straddling them;
    None if no width does."""
    bn = max(16, triton.next_power_of_2(2 * H))
    while bn <= H * min(K, V):
        if (H * K) % bn == 0 and (H * V) % bn == 0:
            return bn
        bn *= 2
    return None


def check_in_proj_block(bn: int | None, H: int, K: int, V: int) -> None:
    """ValueError unless units of `bn` columns hold a and b and tile q, k and v."""
    if bn is None or triton.next_power_of_2(bn) != bn or bn < max(16, 2 * H) or (H * K) % bn or (H * V) % bn:
        raise ValueError(f"chain verify: BN_IN {bn}: a unit of the input projection takes a power of two from "
                         f"{max(16, 2 * H)} (a and b) that divides the q, k and v widths {H * K} and {H * V}")


def _dot_block_n(N: int, programs: int) -> int:
    """Columns a block of the tl.dot form: about one block a program, 16 to 64."""
    return max(16, min(64, triton.next_power_of_2(triton.cdiv(N, programs))))


class PersistentChainVerify:
    """One launch verifies a draft chain (or tree) of `nodes` tokens for a GDN model of heads [K, V]
    and one gated output: the weights, the scratch rows and the barrier counter, made once
    (a CUDA graph holds their addresses). `feature_layers` are the layers whose outputs a
    drafter reads (in layer order); `programs` defaults to the device's SM count. The
    projections' K blocks are at most `block_k` wide, and `blocks` overrides any tile
    (benchmarks sweep them); `timed` records when each program ends each phase (`phase_us`)."""

    def __init__(self, weights: DecodeWeights, num_heads: int, head_dim: int, head_v_dim: int, eps: float,
                 nodes: int, feature_layers: tuple[int, ...] = (), swish: bool = True, neg_eigval: bool = False,
                 programs: int | None = None, num_warps: int = 4, block_k: int = 256, num_stages: int = 1,
                 timed: bool = False, blocks: dict[str, int] | None = None):
        wt, dev = weights, weights.w_in.device
        H, K, V = num_heads, head_dim, head_v_dim
        L, N_in, D, C, W, I = check_decode_weights(wt, H, K, V, "chain verify")
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"chain verify: {nodes} nodes; the parallel form takes 1 to {MAX_NODES}")
        if triton.next_power_of_2(K) != K or K < 16:
            raise ValueError(f"chain verify: key width {K}: the parallel form takes powers of two from 16")
        if sorted(set(feature_layers)) != list(feature_layers) or any(not 0 <= f < L for f in feature_layers):
            raise ValueError(f"chain verify: feature layers {feature_layers} must be distinct layers 0..{L - 1}, "
                             "in order")
        self.programs = resident_programs(dev, programs)
        self.weights, self.device, self.dtype, self.nodes = wt, dev, wt.w_in.dtype, nodes
        self.feature_layers = tuple(feature_layers)
        self.shape = dict(L=L, D=D, H=H, K=K, V=V, W=W, I=I, VOCAB=wt.lm_head.shape[0], F=max(1, len(feature_layers)))
        self.eps, self.scale, self.swish, self.neg_eigval = eps, K ** -0.5, swish, neg_eigval
        n, f32 = nodes, dict(device=dev, dtype=torch.float32)
        rows = lambda width, **kw: torch.zeros(n, width, **(kw or dict(device=dev, dtype=self.dtype)))  # noqa: E731
        self.zeros = torch.zeros(max(D, H * V, 2 * I), device=dev, dtype=self.dtype)
        self.x_emb, self.res_a, self.res_b, self.x = rows(D), rows(D), rows(D), rows(D)
        self.y_in, self.gate_up = rows(N_in), rows(2 * I)
        self.q, self.k, self.v = rows(H * K, **f32), rows(H * K, **f32), rows(H * V, **f32)    # q, k raw
        self.beta, self.o = rows(H, **f32), rows(H * V, **f32)
        self.index = (torch.arange(n)[:, None] + torch.arange(W)[None, :]).to(dev)    # the chain's conv windows
        self.parents = torch.arange(-1, n - 1, device=dev)
        slots = [-1] * L
        for i, layer in enumerate(self.feature_layers):
            slots[layer] = i
        self.feat_slot = torch.tensor(slots, dtype=torch.int32, device=dev)
        self.counter = torch.zeros(1, device=dev, dtype=torch.int32)
        self.status = torch.zeros(1, device=dev, dtype=torch.int32)
        # the [16, BK] fp32 prologue block of the dot form stays at <= 32 registers a thread
        bk = lambda k, head=1: max(head, 16, min(triton.next_power_of_2(k), block_k))  # noqa: E731
        bn = lambda cols, split=1: _dot_block_n(cols * split, self.programs)  # noqa: E731
        par = _parallel_config(n, K, V)
        # the output and down projections are split over K in slices of SPLIT_K columns
        bk_o, bk_i = max(V, min(SPLIT_K, H * V)), min(SPLIT_K, I)
        self.blocks = dict(
            BM=16, BN_IN=IN_PROJ_BLOCK or in_proj_block(H, K, V), BK_IN=min(bk(D), 128), BN_O=bn(D, triton.cdiv(H * V, bk_o)), BN_GU=bn(2 * I),
            BN_DOWN=bn(D, triton.cdiv(I, bk_i)), BN_HEAD=bn(self.shape["VOCAB"]), BK_D=bk(D), BK_O=bk_o, BK_I=bk_i,
            BD=triton.next_power_of_2(D), BH_IN=triton.next_power_of_2(H), BW=triton.next_power_of_2(W),
            PBK=par["BK"], PBV=par["BV"])
        unknown = set(blocks or ()) - set(self.blocks)
        if unknown:
            raise ValueError(f"chain verify: no tiles named {sorted(unknown)}")
        self.blocks.update(blocks or {})
        check_in_proj_block(self.blocks["BN_IN"], H, K, V)
        if self.blocks["BK_O"] % V:
            raise ValueError(f"chain verify: BK_O {self.blocks['BK_O']}: the gated norm's K slices are whole heads")
        self.blocks["SPLIT_O"] = triton.cdiv(H * V, self.blocks["BK_O"])
        self.blocks["SPLIT_DOWN"] = triton.cdiv(I, self.blocks["BK_I"])
        split = max(self.blocks["SPLIT_O"], self.blocks["SPLIT_DOWN"])
        self.partials = torch.zeros(split * n * D, **f32)
        self.block_counters = torch.zeros(triton.cdiv(D, 16), device=dev, dtype=torch.int32)
        # the LM head's column blocks' row maxima, first columns and sums (`_head_stats`)
        self.head_blocks = triton.cdiv(self.shape["VOCAB"], self.blocks["BN_HEAD"])
        self.stats = (torch.zeros(n, self.head_blocks, **f32), torch.zeros(n, self.head_blocks, device=dev,
                      dtype=torch.int32), torch.zeros(n, self.head_blocks, **f32))
        self.dot = _dot_mode(self.dtype)
        self.launch = dict(num_warps=num_warps, num_stages=num_stages)
        self.times = torch.zeros(5 * L + 3, self.programs, device=dev, dtype=torch.int64) if timed else None
        self.phases = 5 * L + 2             # the last call's (one more with acceptance)

    def __call__(self, tokens: torch.Tensor, root: torch.Tensor, cache: torch.Tensor, S: torch.Tensor,
                 pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, logits: torch.Tensor,
                 hidden: torch.Tensor, features: torch.Tensor | None,
                 factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                 accept: ChainAccept | None = None,
                 tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Verify tokens [1, N] (int64; tokens[0, 0] is overwritten with root [1]) from cache
        [L, 1, C, W] and S [L, 1, H, K, V] fp32, folding `pending` (k [L,1,P,H,K], delta
        [L,1,P,H,V], g [L,1,P,H] fp32) into S first. Writes logits [N, vocab] fp32, hidden
        [N, D], features [N, F, D] (if feature layers were given) and the factors (k, g,
        delta, conv_in: [L,1,N,H,K], [L,1,N,H], [L,1,N,H,V] fp32, [L,1,N,C]).

        With `accept`, the same launch then accepts greedily: the accepted path's factors
        become the pending commit (which must be given), the conv cache shifts, `root`
        becomes the bonus token, and `accept`'s counters, output and step log advance.

        With `tree` = (parents [N] int64, -1 at the root, in topological order; conv_index
        [N, W], `DraftTree.conv_window_index`), both read on the device at every call, the
        nodes are a tree's: the recurrence takes the tree-masked parallel form, each node's
        conv its own path, and acceptance walks the tree."""
        s, n = self.shape, self.nodes
        k_f, g_f, delta_f, conv_in_f = factors
        L, H, K, V, D = s["L"], s["H"], s["K"], s["V"], s["D"]
        C = H * (2 * K + V)
        expected = {"tokens": (tokens, (1, n)), "k": (k_f, (L, 1, n, H, K)), "g": (g_f, (L, 1, n, H)),
                    "delta": (delta_f, (L, 1, n, H, V)), "conv_in": (conv_in_f, (L, 1, n, C)),
                    "logits": (logits, (n, s["VOCAB"])), "hidden": (hidden, (n, D)), "S": (S, (L, 1, H, K, V))}
        for name, (t, shape) in expected.items():
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"chain verify: {name} must be contiguous of shape {shape}, got {tuple(t.shape)}")
        if S.dtype != torch.float32 or logits.dtype != torch.float32 or not cache.is_contiguous():
            raise ValueError("chain verify: S and logits must be fp32 and the conv cache contiguous")
        if self.feature_layers and (features is None or tuple(features.shape) != (n, len(self.feature_layers), D)):
            raise ValueError(f"chain verify: features must be [{n}, {len(self.feature_layers)}, {D}]")
        if pending is not None:
            P = pending[0].shape[2]
            for t, width in zip(pending, (K, V, None)):
                want = (L, 1, P, H) + ((width,) if width else ())
                if tuple(t.shape) != want or t.dtype != torch.float32 or not t.is_contiguous():
                    raise ValueError(f"chain verify: pending factors must be contiguous fp32 {want}")
        parents, index = tree if tree is not None else (self.parents, self.index)
        if tree is not None and (tuple(parents.shape) != (n,) or parents.dtype != torch.long
                                 or tuple(index.shape) != tuple(self.index.shape) or not index.is_contiguous()):
            raise ValueError(f"chain verify: a tree's parents must be int64 [{n}] and its conv index "
                             f"contiguous {tuple(self.index.shape)}")
        pk, pd, pg = pending if pending is not None else (k_f, delta_f, g_f)
        if accept is not None:
            if pending is None:
                raise ValueError("chain verify: acceptance in the launch defers its commit: give the pending buffers")
            accept.check(n, pk.shape[2])
        tiles = accept_tiles(n, pk.shape[2], H, K, V, self.head_blocks)
        accept_args = accept.args() if accept is not None else ChainAccept.unused(self.counter)
        self.phases = 5 * L + 2 + (1 if accept is not None else 0)
        wt = self.weights
        compiled = _chain_verify_kernel[(self.programs,)](
            tokens, root, wt.embed, self.zeros, wt.attn_norm, wt.w_in, wt.conv_w,
            wt.conv_b if wt.conv_b is not None else wt.conv_w, wt.neg_A, wt.dt_bias, wt.o_norm, wt.w_o,
            wt.mlp_norm, wt.w_gate_up, wt.w_down, wt.final_norm, wt.lm_head, cache, S, pk, pd, pg,
            pk.shape[2] if pending is not None else 0, index, parents, self.feat_slot,
            logits, hidden, features if features is not None else hidden, k_f, g_f, delta_f, conv_in_f, *self.stats,
            self.x_emb, self.res_a, self.res_b, self.x, self.y_in, self.q, self.k, self.v, self.beta, self.o,
            self.gate_up, self.partials, self.block_counters, self.counter, self.status,
            self.times if self.times is not None else self.counter,
            n, self.eps, self.scale, *accept_args, **s, HAS_BIAS=wt.conv_b is not None, NEG_EIGVAL=self.neg_eigval,
            SWISH=self.swish, HAS_PENDING=pending is not None, FOLD_IN_A=FOLD_IN_A, DOT=self.dot, **self.blocks,
            TIMED=self.times is not None, ACCEPT=accept is not None,
            ORACLE=accept is not None and accept.oracle is not None, **tiles, CHAIN=tree is None, **self.launch)
        carveout.prefer(compiled)

    def phase_us(self) -> list[float]:
        """(timed) Each phase's µs in the last call (`kernels.pdl.phase_us`)."""
        return phase_us(self.times, self.phases)

    def failed(self) -> bool:
        """Whether a barrier gave up waiting since this step was made (reads the device)."""
        return bool(self.status.item())
