"""Greedy acceptance of a verified draft chain, as two phases that end the persistent chain
verification (`triton_verify_step.py`): the target's choice at every node, the accepted
drafts, the deferred commit, the conv window, the bookkeeping and the step log.

Why: run as torch ops after the verification, acceptance was 13 launches and ~18 us of a
~240 us speculative step on the H200, plus a launch gap each, for a few KB of work
(benchmarks/results/h200/session17/). Inside the verification's launch it costs two grid
barriers.

Its reference is the speculative step's own torch acceptance (`GraphedSpec.accept` in
`specla/graphs/spec.py`: `greedy_accept`, `_log`, `_commit` deferred, `_conv_window`,
`_bookkeep`) for a chain; the tests run both on the same logits and compare every buffer.

    phase 1  per node r: the argmax of its logits, and from their log-sum-exp the target's
             probability of node r + 1's token
    phase 2  every program finds the accepted length a (the leading drafts equal to the
             target's choice at their parent) and the bonus token; then, dealt round-robin:
             the accepted path's factors into the pending commit (zeros past it), the conv
             window shifted by a + 1 inputs, and one unit of bookkeeping (the output tokens,
             the counters, the next root, the step log's row, the result)
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
        """ValueError unless the buffers fit a chain of `nodes` and paths of `max_path`."""
        if self.log_tokens.shape[1] < nodes or self.result.numel() != 3 + max_path or self.choice.numel() < nodes:
            raise ValueError(f"chain accept: buffers for {nodes} nodes and paths of {max_path} expected")
        if self.choice.dtype != torch.long or self.out.dtype != torch.long:
            raise ValueError("chain accept: choice and out must be int64")


def accept_tiles(nodes: int, max_path: int, heads: int, head_dim: int, head_v_dim: int,
                 vocab: int) -> dict[str, int]:
    """The acceptance phases' block widths (constexprs of `_node_stats` and `_accept_phase`;
    the conv window's BW is the verification's)."""
    p2 = triton.next_power_of_2
    return dict(BVOC=min(p2(vocab), 1024), BNODES=p2(nodes), BP=p2(3 + max_path), BC=64,
                BHK=p2(heads * head_dim), BHV=p2(heads * head_v_dim), BH=p2(heads))


@triton.jit
def _node_stats(logits, tokens, choice_s, prob_s, r, N, VOCAB: tl.constexpr, BVOC: tl.constexpr):
    """Node r's argmax (the first of equal maxima, as torch's), and the target's probability
    of node r + 1's token (0 for a dummy token) from the row's log-sum-exp."""
    o = tl.arange(0, BVOC)
    row = logits + r * VOCAB
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    best = tl.zeros([], dtype=tl.int64)
    for start in range(0, VOCAB, BVOC):
        x = tl.load(row + start + o, mask=start + o < VOCAB, other=float("-inf"), cache_modifier=".cg")
        top = tl.max(x, 0)
        best = tl.where(top > m, (start + tl.argmax(x, 0, tie_break_left=True)).to(tl.int64), best)
        new_m = tl.maximum(m, top)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
        m = new_m
    lse = m + tl.log(s)
    tl.store(choice_s + r, best)
    if r + 1 < N:
        tok = tl.load(tokens + r + 1)
        logit = tl.load(row + tl.maximum(tok, 0), cache_modifier=".cg")
        tl.store(prob_s + r + 1, tl.where(tok < 0, 0.0, tl.exp(logit - lse)))


@triton.jit
def _accepted(tokens, choice_s, N, BN: tl.constexpr):
    """(a, bonus): the number of leading drafts that equal the target's choice at their
    parent, and the target's choice after them."""
    o = tl.arange(0, BN)
    choice = tl.load(choice_s + o, mask=o < N, other=0, cache_modifier=".cg")
    drafted = tl.load(tokens + o + 1, mask=o + 1 < N, other=-1, cache_modifier=".cg")
    stops = (o + 1 >= N) | (drafted != choice)
    a = tl.min(tl.where(stops, o, BN), 0)
    bonus = tl.sum(tl.where(o == a, choice, 0), 0)
    return a, bonus


@triton.jit
def _commit_unit(k_f, g_f, delta_f, pk, pd, pg, l, j, a, N, P, HK: tl.constexpr, HV: tl.constexpr,
                 H: tl.constexpr, BHK: tl.constexpr, BHV: tl.constexpr, BH: tl.constexpr):
    """Pending slot j of layer l: node j's factors if it is on the accepted path, else zeros."""
    keep = (j <= a) & (j < N)
    src, dst = l * N + j, l * P + j
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
def _conv_unit(cache, conv_in, l, blk, a, N, C: tl.constexpr, W: tl.constexpr, BC: tl.constexpr,
               BW: tl.constexpr):
    """Channels blk*BC.. of layer l's conv window: slots 1..W-1 become the last W-1 inputs of
    [the old slots 1..W-1, the accepted nodes' conv inputs]; slot 0 is left as it is."""
    c = blk * BC + tl.arange(0, BC)
    w = tl.arange(0, BW)
    hist = W - 1
    j = a + w                                   # slot w's position in [old window, accepted inputs]
    live = (c < C)[:, None] & ((w >= 1) & (w < W))[None, :]
    old = live & (j < hist)[None, :]
    fresh = live & (j >= hist)[None, :]
    row = cache + l * C * W + c[:, None] * W
    v_old = tl.load(row + (1 + j)[None, :], mask=old, other=0.0)
    v_new = tl.load(conv_in + (l * N + j - hist)[None, :] * C + c[:, None], mask=fresh, other=0.0,
                    cache_modifier=".cg")
    tl.debug_barrier()          # every thread has read the old window before any slot is written
    tl.store(row + w[None, :], tl.where(old, v_old, v_new), mask=live)


@triton.jit
def _bookkeep_unit(tokens, logits, choice_s, prob_s, a, bonus, N, VOCAB, P, pos, step, out, out_len, acc,
                   acc_len, last, result, log_tokens, log_parents, log_choice, log_prob, log_result, log_steps,
                   log_nodes, cont, cont_len, div, gap, ORACLE: tl.constexpr, BNODES: tl.constexpr,
                   BP: tl.constexpr):
    """The output tokens, counters, next root and step-log row of an accepted chain."""
    s = tl.load(step)
    p0 = tl.load(pos)
    row = tl.minimum(s, log_steps - 1)
    r = tl.arange(0, BNODES)
    node = r < N
    fits = r < log_nodes
    tok = tl.load(tokens + r, mask=node, other=-1, cache_modifier=".cg")
    tl.store(log_tokens + row * log_nodes + r, tok, mask=fits)
    tl.store(log_parents + row * log_nodes + r, tl.where(node, tl.maximum(r - 1, 0), 0), mask=fits)
    tl.store(log_choice + row * log_nodes + r, tl.load(choice_s + r, mask=node, other=0, cache_modifier=".cg"),
             mask=fits)
    prob = tl.load(prob_s + r, mask=node & (r > 0), other=0.0, cache_modifier=".cg")
    tl.store(log_prob + row * log_nodes + r, tl.where(r == 0, 1.0, prob), mask=fits)
    d = tl.arange(0, BP)                        # BP >= 3 + P: the result row fits too
    d_ok = d < P
    drafted = tl.load(tokens + d + 1, mask=d < a, other=0, cache_modifier=".cg")
    tl.store(out + tl.minimum(p0 + d, out_len - 1), tl.where(d < a, drafted, bonus), mask=d_ok)
    s_acc = tl.minimum(s, acc_len - 1)
    tl.store(acc + s_acc, a.to(tl.int64))
    flag = tl.zeros([], dtype=tl.int64)
    if ORACLE:
        expected = tl.load(cont + tl.minimum(tl.maximum(p0 + a, 0), cont_len - 1))
        flag = (bonus != expected).to(tl.int64)
        tl.store(div + s_acc, flag)
        end_row = logits + a * VOCAB
        tl.store(gap + s_acc, tl.load(end_row + bonus, cache_modifier=".cg") -
                 tl.load(end_row + expected, cache_modifier=".cg"))
    # result = [a, end, bonus, path...]; for a chain the end node is a and the path 0..a
    a64 = a.to(tl.int64)
    packed = tl.where(d == 0, a64, tl.where(d == 1, a64, tl.where(d == 2, bonus, tl.where(d - 3 <= a, d - 3, 0))))
    packed_ok = d < 3 + P
    tl.store(log_result + row * (3 + P) + d, packed, mask=packed_ok)
    tl.store(result + d, packed, mask=packed_ok)
    new_pos = p0 + a + 1
    tl.store(pos, new_pos)
    tl.store(step, s + 1)
    # last = [a, end, bonus, diverged, pos]
    e = tl.arange(0, 8)
    tl.store(last + e, tl.where(e < 2, a64, tl.where(e == 2, bonus, tl.where(e == 3, flag, new_pos))), mask=e < 5)


@triton.jit
def _accept_phase(tokens, logits, root, k_f, g_f, delta_f, conv_in, pk, pd, pg, cache, choice_s, prob_s, N, P,
                  pos, step, out, out_len, acc, acc_len, last, result, log_tokens, log_parents, log_choice,
                  log_prob, log_result, log_steps, log_nodes, cont, cont_len, div, gap, pid, programs,
                  L: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                  VOCAB: tl.constexpr, ORACLE: tl.constexpr, BNODES: tl.constexpr, BP: tl.constexpr,
                  BC: tl.constexpr, BW: tl.constexpr, BHK: tl.constexpr, BHV: tl.constexpr, BH: tl.constexpr):
    """Phase 2 (after phase 1's `_node_stats` and a barrier): the acceptance, the commit,
    the conv window and the bookkeeping, units dealt round-robin."""
    a, bonus = _accepted(tokens, choice_s, N, BNODES)
    C: tl.constexpr = H * (2 * K + V)
    CONV_BLOCKS: tl.constexpr = (C + BC - 1) // BC
    commits = L * P
    convs = L * CONV_BLOCKS
    for unit in range(pid, commits + convs + 1, programs):
        if unit < commits:
            _commit_unit(k_f, g_f, delta_f, pk, pd, pg, unit // P, unit % P, a, N, P, H * K, H * V, H, BHK, BHV, BH)
        elif unit < commits + convs:
            u = unit - commits
            _conv_unit(cache, conv_in, u // CONV_BLOCKS, u % CONV_BLOCKS, a, N, C, W, BC, BW)
        else:
            _bookkeep_unit(tokens, logits, choice_s, prob_s, a, bonus, N, VOCAB, P, pos, step, out, out_len, acc,
                           acc_len, last, result, log_tokens, log_parents, log_choice, log_prob, log_result,
                           log_steps, log_nodes, cont, cont_len, div, gap, ORACLE, BNODES, BP)
            tl.store(root, bonus.to(tl.int64))
