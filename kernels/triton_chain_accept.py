"""Greedy acceptance of a verified draft chain or tree, as one phase that ends the persistent
verification (`triton_verify_step.py`): the target's choice at every node, the accepted
path, the deferred commit, the conv window, the bookkeeping and the step log.

Why: run as torch ops after the verification, acceptance was 13 launches and ~18 us of a
~240 us speculative step on the H200, plus a launch gap each, for a few KB of work
(benchmarks/results/h200/session17/). Inside the verification's launch it costs a grid
barrier: the LM head's column units leave each row's maximum, its first column and the
block's sum of exponentials (`_head_stats`), so no phase of its own reads the logits.

Its reference is the speculative step's own torch acceptance (`GraphedSpec.accept` in
`specla/graphs/spec.py`: `greedy_accept`, `_log`, `_commit` deferred, `_conv_window`,
`_bookkeep`); the tests run both on the same logits and compare every buffer.

    LM head  per column block and node: maximum, first column holding it, sum of exponentials
    accept   every program merges the blocks into each node's argmax and finds the accepted
             path (a chain: the leading drafts equal to the target's choice at their parent;
             a tree: the walk from the root through the first child that matches) and the
             bonus token; then, dealt round-robin: the path's factors into the pending
             commit (zeros past it), the conv window shifted by its a + 1 inputs, and one
             unit of bookkeeping (the output tokens, the counters, the next root, the step
             log's row with each node's probability from the merged log-sum-exp, the result)
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl


@dataclasses.dataclass
class ChainAccept:
    """Where greedy acceptance writes (the speculative step's static buffers). `choice` and
    `prob` are [N] scratch rows; `log_*` are the step log's [steps, ...] fields;
    `oracle` (cont [capacity] int64, div, gap) is the measurement oracle's check, or None."""
    choice: torch.Tensor
    prob: torch.Tensor
    pos: torch.Tensor
    step: torch.Tensor
    out: torch.Tensor
    acc: torch.Tensor
    last: torch.Tensor
    result: torch.Tensor
    log_tokens: torch.Tensor
    log_parents: torch.Tensor
    log_choice: torch.Tensor
    log_prob: torch.Tensor
    log_result: torch.Tensor
    oracle: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def args(self) -> list:
        cont, div, gap = self.oracle if self.oracle is not None else (self.out, self.acc, self.prob)
        return [self.choice, self.prob, self.pos, self.step, self.out, self.out.numel(), self.acc,
                self.acc.numel(), self.last, self.result, self.log_tokens, self.log_parents, self.log_choice,
                self.log_prob, self.log_result, self.log_tokens.shape[0], self.log_tokens.shape[1], cont,
                cont.numel(), div, gap]

    @classmethod
    def unused(cls, buffer: torch.Tensor) -> list:
        """Placeholder arguments for a launch that does not accept (the kernel never reads them)."""
        one = buffer.view(-1)[:1].view(1, 1)
        return cls(**{f.name: one for f in dataclasses.fields(cls) if f.name != "oracle"}).args()

    def check(self, nodes: int, max_path: int) -> None:
        """ValueError unless the buffers fit a draft of `nodes` and paths of `max_path`."""
        if self.log_tokens.shape[1] < nodes or self.result.numel() != 3 + max_path or self.choice.numel() < nodes:
            raise ValueError(f"chain accept: buffers for {nodes} nodes and paths of {max_path} expected")
        if self.choice.dtype != torch.long or self.out.dtype != torch.long:
            raise ValueError("chain accept: choice and out must be int64")


def accept_tiles(nodes: int, max_path: int, heads: int, head_dim: int, head_v_dim: int,
                 head_blocks: int) -> dict[str, int]:
    """The acceptance phase's block widths (constexprs of `_accept_phase`; the conv window's
    BW is the verification's), for an LM head of `head_blocks` column blocks."""
    p2 = triton.next_power_of_2
    return dict(BB=p2(head_blocks), BNODES=p2(nodes), BP=p2(3 + max_path), BC=64,
                BHK=p2(heads * head_dim), BHV=p2(heads * head_v_dim), BH=p2(heads))


@triton.jit
def _head_stats(acc, rows, r_mask, cols, c_mask, blk, blocks, stats):
    """Block `blk` (of `blocks`) of the LM head's logits, acc [rows, BN] fp32 for the
    columns `cols`: each row's maximum, the first column holding it and sum(exp(logit -
    maximum)), into stats = (m, idx, s) at [row, blk]: what `_choices` and `_log_sum_exp`
    merge."""
    x = tl.where(c_mask[None, :], acc, float("-inf"))
    m = tl.max(x, 1)
    idx = tl.min(tl.where(x == m[:, None], cols[None, :], 2147483647), 1)
    at = rows * blocks + blk
    tl.store(stats[0] + at, m, mask=r_mask)
    tl.store(stats[1] + at, idx, mask=r_mask)
    tl.store(stats[2] + at, tl.sum(tl.exp(x - m[:, None]), 1), mask=r_mask)


@triton.jit
def _block_stats(stats, N, BLOCKS, BNODES: tl.constexpr, BB: tl.constexpr):
    """`_head_stats`' rows as [BNODES, BB] tiles (m, idx, s), node by block; -inf past them."""
    r = tl.arange(0, BNODES)
    b = tl.arange(0, BB)
    at = r[:, None] * BLOCKS + b[None, :]
    ok = (r < N)[:, None] & (b < BLOCKS)[None, :]
    m = tl.load(stats[0] + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
    idx = tl.load(stats[1] + at, mask=ok, other=2147483647, cache_modifier=".cg")
    s = tl.load(stats[2] + at, mask=ok, other=0.0, cache_modifier=".cg")
    return m, idx, s


@triton.jit
def _choices(stats, N, BLOCKS, VOCAB: tl.constexpr, BNODES: tl.constexpr, BB: tl.constexpr):
    """Each node's argmax [BNODES] int64 (the first of equal maxima, as torch's): the lowest
    column among the blocks whose maximum is the row's; 0 past the N nodes. (NaN logits,
    which match no maximum, give a token in range, not one past the vocabulary.)"""
    m, idx, _ = _block_stats(stats, N, BLOCKS, BNODES, BB)
    top = tl.max(m, 1)
    first = tl.minimum(tl.min(tl.where(m == top[:, None], idx, 2147483647), 1), VOCAB - 1).to(tl.int64)
    return tl.where(tl.arange(0, BNODES) < N, first, 0)


@triton.jit
def _log_sum_exp(stats, N, BLOCKS, BNODES: tl.constexpr, BB: tl.constexpr):
    """Each node's log-sum-exp of its logits [BNODES], the blocks' sums merged in block order."""
    m, _, s = _block_stats(stats, N, BLOCKS, BNODES, BB)
    top = tl.max(m, 1)
    return top + tl.log(tl.sum(tl.where(s > 0, s * tl.exp(m - top[:, None]), 0.0), 1))


@triton.jit
def _accepted(tokens, parents, choice, N, BN: tl.constexpr, CHAIN: tl.constexpr):
    """(a, end, bonus, path [BN]): the accepted drafts, the last accepted node, the target's
    choice there and the accepted nodes root first (0 past them), from each node's choice
    [BN]. The walk from the root takes the first child (in node order) whose token is the
    target's choice at its parent; in a chain that is the leading drafts equal to the choice
    before them."""
    o = tl.arange(0, BN)
    if CHAIN:
        drafted = tl.load(tokens + o + 1, mask=o + 1 < N, other=-1, cache_modifier=".cg")
        stops = (o + 1 >= N) | (drafted != choice)
        a = tl.min(tl.where(stops, o, BN), 0)
        end = a
        path = tl.where(o <= a, o, 0)
    else:
        par = tl.load(parents + o, mask=o < N, other=-1)
        tok = tl.load(tokens + o, mask=o < N, other=-1, cache_modifier=".cg")
        at_parent = tl.where(par >= 0, _pick(choice, o, tl.maximum(par, 0)), -1)
        match = (o > 0) & (o < N) & (par >= 0) & (tok >= 0) & (tok == at_parent)
        a = tl.zeros([], dtype=tl.int32)
        end = tl.zeros([], dtype=tl.int32)
        path = tl.zeros([BN], dtype=tl.int32)
        nxt = tl.min(tl.where(match & (par == 0), o, BN), 0)
        while nxt < BN:         # one level of the walk an iteration
            a += 1
            end = nxt
            path = tl.where(o == a, nxt, path)
            nxt = tl.min(tl.where(match & (par == end), o, BN), 0)
    bonus = tl.sum(tl.where(o == end, choice, 0), 0)
    return a, end, bonus, path


@triton.jit
def _pick(values, o, at):
    """values[at] of a register vector indexed by o, for a vector of positions `at`."""
    return tl.sum(tl.where(o[None, :] == at[:, None], values[None, :], 0), 1)


@triton.jit
def _commit_unit(k_f, g_f, delta_f, pk, pd, pg, l, j, node, a, N, P, HK: tl.constexpr, HV: tl.constexpr,
                 H: tl.constexpr, BHK: tl.constexpr, BHV: tl.constexpr, BH: tl.constexpr):
    """Pending slot j of layer l: the factors of `node`, the accepted path's j-th, for j <= a;
    zeros past the path."""
    keep = (j <= a) & (j < N)
    src, dst = l * N + node, l * P + j
    o = tl.arange(0, BHK)
    tl.store(pk + dst * HK + o, tl.load(k_f + src * HK + o, mask=keep & (o < HK), other=0.0, cache_modifier=".cg"),
             mask=o < HK)
    o = tl.arange(0, BHV)
    tl.store(pd + dst * HV + o, tl.load(delta_f + src * HV + o, mask=keep & (o < HV), other=0.0,
                                        cache_modifier=".cg"), mask=o < HV)
    o = tl.arange(0, BH)
    tl.store(pg + dst * H + o, tl.load(g_f + src * H + o, mask=keep & (o < H), other=0.0, cache_modifier=".cg"),
             mask=o < H)


@triton.jit
def _conv_unit(cache, conv_in, l, blk, a, path, o_path, N, C: tl.constexpr, W: tl.constexpr, BC: tl.constexpr,
               BW: tl.constexpr):
    """Channels blk*BC.. of layer l's conv window: slots 1..W-1 become the last W-1 inputs of
    [the old slots 1..W-1, the accepted path's conv inputs]; slot 0 is left as it is."""
    c = blk * BC + tl.arange(0, BC)
    w = tl.arange(0, BW)
    hist = W - 1
    j = a + w                                   # slot w's position in [old window, accepted inputs]
    live = (c < C)[:, None] & ((w >= 1) & (w < W))[None, :]
    old = live & (j < hist)[None, :]
    fresh = live & (j >= hist)[None, :]
    node = _pick(path, o_path, j - hist)
    row = cache + l * C * W + c[:, None] * W
    v_old = tl.load(row + (1 + j)[None, :], mask=old, other=0.0)
    v_new = tl.load(conv_in + (l * N + node)[None, :] * C + c[:, None], mask=fresh, other=0.0,
                    cache_modifier=".cg")
    tl.debug_barrier()          # every thread has read the old window before any slot is written
    tl.store(row + w[None, :], tl.where(old, v_old, v_new), mask=live)


@triton.jit
def _bookkeep_unit(tokens, parents, logits, choice, choice_s, prob_s, stats, BLOCKS, a, end, bonus, path, o_path, N,
                   VOCAB, P, pos, step, out, out_len, acc, acc_len, last, result, log_tokens, log_parents, log_choice,
                   log_prob, log_result, log_steps, log_nodes, cont, cont_len, div, gap, ORACLE: tl.constexpr,
                   BNODES: tl.constexpr, BP: tl.constexpr, BB: tl.constexpr):
    """The output tokens, counters, next root and step-log row of an accepted path; each
    node's choice, and the target's probability of each node's token at its parent (0 for a
    dummy token), into the scratch rows choice_s and prob_s too."""
    s = tl.load(step)
    p0 = tl.load(pos)
    row = tl.minimum(s, log_steps - 1)
    r = tl.arange(0, BNODES)
    node = r < N
    fits = r < log_nodes
    tok = tl.load(tokens + r, mask=node, other=-1, cache_modifier=".cg")
    par = tl.load(parents + r, mask=node, other=-1)
    tl.store(log_tokens + row * log_nodes + r, tok, mask=fits)
    tl.store(log_parents + row * log_nodes + r, tl.maximum(par, 0), mask=fits)
    tl.store(choice_s + r, choice, mask=node)
    tl.store(log_choice + row * log_nodes + r, choice, mask=fits)
    child = node & (r > 0) & (par >= 0) & (tok >= 0)
    at = tl.maximum(par, 0)
    logit = tl.load(logits + at * VOCAB + tl.maximum(tok, 0), mask=child, other=0.0, cache_modifier=".cg")
    lse = _pick(_log_sum_exp(stats, N, BLOCKS, BNODES, BB), r, at)
    prob = tl.where(child, tl.exp(logit - lse), 0.0)
    tl.store(prob_s + r, prob, mask=node & (r > 0))
    tl.store(log_prob + row * log_nodes + r, tl.where(r == 0, 1.0, prob), mask=fits)
    d = tl.arange(0, BP)                        # BP >= 3 + P: the result row fits too
    d_ok = d < P
    drafted = tl.load(tokens + _pick(path, o_path, d + 1), mask=d < a, other=0, cache_modifier=".cg")
    tl.store(out + tl.minimum(p0 + d, out_len - 1), tl.where(d < a, drafted, bonus), mask=d_ok)
    s_acc = tl.minimum(s, acc_len - 1)
    tl.store(acc + s_acc, a.to(tl.int64))
    flag = tl.zeros([], dtype=tl.int64)
    if ORACLE:
        expected = tl.load(cont + tl.minimum(tl.maximum(p0 + a, 0), cont_len - 1))
        flag = (bonus != expected).to(tl.int64)
        tl.store(div + s_acc, flag)
        end_row = logits + end * VOCAB
        tl.store(gap + s_acc, tl.load(end_row + bonus, cache_modifier=".cg") -
                 tl.load(end_row + expected, cache_modifier=".cg"))
    # result = [a, end, bonus, path...]
    a64, end64 = a.to(tl.int64), end.to(tl.int64)
    on_path = tl.where((d >= 3) & (d - 3 <= a), _pick(path, o_path, d - 3), 0).to(tl.int64)
    packed = tl.where(d == 0, a64, tl.where(d == 1, end64, tl.where(d == 2, bonus, on_path)))
    packed_ok = d < 3 + P
    tl.store(log_result + row * (3 + P) + d, packed, mask=packed_ok)
    tl.store(result + d, packed, mask=packed_ok)
    new_pos = p0 + a + 1
    tl.store(pos, new_pos)
    tl.store(step, s + 1)
    # last = [a, end, bonus, diverged, pos]
    e = tl.arange(0, 8)
    tl.store(last + e, tl.where(e == 0, a64, tl.where(e == 1, end64, tl.where(e == 2, bonus, tl.where(
        e == 3, flag, new_pos)))), mask=e < 5)


@triton.jit
def _accept_phase(tokens, parents, logits, stats, BLOCKS, root, k_f, g_f, delta_f, conv_in, pk, pd, pg, cache,
                  choice_s, prob_s, N, P, pos, step, out, out_len, acc, acc_len, last, result, log_tokens,
                  log_parents, log_choice, log_prob, log_result, log_steps, log_nodes, cont, cont_len, div, gap,
                  pid, programs, L: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  W: tl.constexpr, VOCAB: tl.constexpr, ORACLE: tl.constexpr, BNODES: tl.constexpr,
                  BP: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, BHK: tl.constexpr, BHV: tl.constexpr,
                  BH: tl.constexpr, BB: tl.constexpr, CHAIN: tl.constexpr):
    """The phase after the LM head's (whose column blocks left `_head_stats`, then a
    barrier): every program merges the blocks' maxima into the nodes' choices and finds the
    accepted path; then the commit, the conv window and the bookkeeping, units dealt
    round-robin."""
    choice = _choices(stats, N, BLOCKS, VOCAB, BNODES, BB)
    a, end, bonus, path = _accepted(tokens, parents, choice, N, BNODES, CHAIN)
    o_path = tl.arange(0, BNODES)
    C: tl.constexpr = H * (2 * K + V)
    CONV_BLOCKS: tl.constexpr = (C + BC - 1) // BC
    commits = L * P
    convs = L * CONV_BLOCKS
    for unit in range(pid, commits + convs + 1, programs):
        if unit < commits:
            j = unit % P
            node = tl.sum(tl.where(o_path == j, path, 0), 0)
            _commit_unit(k_f, g_f, delta_f, pk, pd, pg, unit // P, j, node, a, N, P, H * K, H * V, H, BHK, BHV, BH)
        elif unit < commits + convs:
            u = unit - commits
            _conv_unit(cache, conv_in, u // CONV_BLOCKS, u % CONV_BLOCKS, a, path, o_path, N, C, W, BC, BW)
        else:
            _bookkeep_unit(tokens, parents, logits, choice, choice_s, prob_s, stats, BLOCKS, a, end, bonus, path,
                           o_path, N, VOCAB, P, pos, step, out, out_len, acc, acc_len, last, result, log_tokens,
                           log_parents, log_choice, log_prob, log_result, log_steps, log_nodes, cont, cont_len, div,
                           gap, ORACLE, BNODES, BP, BB)
            tl.store(root, bonus.to(tl.int64))
