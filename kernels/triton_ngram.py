"""The model-free n-gram drafter's chain (prompt lookup) in one Triton launch:
`ngram_chain_ref` in `kernels/reference.py`.

Why: on a GPU the n-gram drafter needs no network, so its draft can cost next to nothing
beside a verification, yet as static-shape torch ops (a match over the whole history, a
top-k pool, a trie, a tree search) it is dozens of launches a step. A chain needs none of
the pool's machinery: the best candidate is the largest key (match length, then position)
over the history. So one program does the whole step:

    append   the last step's accepted drafts and bonus token (its result row: a, end,
             bonus, path) at the history's end; past capacity the oldest tokens drop out
             (moved down in place, in ascending blocks: every source lies ahead of the
             blocks already stored)
    match    per position p < last: how many of the tokens ending at p equal the history's
             last tokens, up to MAX_N; key = n * capacity + p where n >= MIN_N
    chain    the NODES tokens after the best key's position, -1 past the history's end or
             without a match, written as the draft's nodes 1..NODES

One program because the history (8192 tokens at most) is a few KB and the step's phases
depend on each other; a grid would need a barrier between the append and the match.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _append(history, length, result, tokens, L, P, BLOCK: tl.constexpr, BP: tl.constexpr):
    """history[:length] += the step's accepted drafts and bonus; returns the new length."""
    n = tl.load(length)
    a = tl.load(result)                 # accepted drafts; -1 appends nothing
    j = tl.arange(0, BP)
    nxt = tl.load(result + 3 + j + 1, mask=(j < a) & (j + 1 < P), other=0)    # path[j + 1]
    drafted = tl.load(tokens + nxt, mask=(j < a) & (j + 1 < P), other=0)
    new = tl.where(j < a, drafted, tl.load(result + 2))
    count = a + 1
    shift = tl.maximum(n + count - L, 0)
    if shift > 0:
        for b0 in range(0, L, BLOCK):
            offs = b0 + tl.arange(0, BLOCK)
            keep = (offs < L) & (offs + shift < n)
            moved = tl.load(history + offs + shift, mask=keep, other=-1)
            tl.debug_barrier()
            tl.store(history + offs, moved, mask=keep)
    tl.store(history + n - shift + j, new, mask=j < count)
    n = n + count - shift
    tl.store(length, n)
    tl.debug_barrier()                  # the match below reads what every thread stored
    return n


@triton.jit
def _ngram_chain_kernel(history, length, result, tokens, chain, L, P, APPEND: tl.constexpr,
                        MAX_N: tl.constexpr, MIN_N: tl.constexpr, NODES: tl.constexpr, BN: tl.constexpr,
                        BLOCK: tl.constexpr, BP: tl.constexpr):
    if APPEND:
        n = _append(history, length, result, tokens, L, P, BLOCK, BP)
    else:
        n = tl.load(length)
    last = n - 1
    best = tl.full([], -1, tl.int64)
    for b0 in range(0, last, BLOCK):
        pos = b0 + tl.arange(0, BLOCK)
        running = pos < last
        matched = tl.zeros([BLOCK], dtype=tl.int64)
        for i in tl.static_range(MAX_N):
            ok = running & (pos - i >= 0)
            mine = tl.load(history + pos - i, mask=ok, other=-1)
            theirs = tl.load(history + tl.maximum(last - i, 0))
            running = ok & (mine == theirs)
            matched += running.to(tl.int64)
        key = tl.where(matched >= MIN_N, matched * L + pos, -1)
        best = tl.maximum(best, tl.max(key, axis=0))
    d = tl.arange(0, BN)
    follow = best % L + 1 + d
    live = (best >= 0) & (d < NODES) & (follow < n)
    tl.store(chain + d, tl.load(history + follow, mask=live, other=-1), mask=d < NODES)


class NgramChain:
    """The n-gram drafter's chain of `nodes` tokens for a history buffer of `capacity` tokens
    (the drafter's `max_ngram`, `min_ngram`; order "recency": ties of match length go to the
    latest position)."""

    def __init__(self, capacity: int, max_ngram: int, min_ngram: int, nodes: int):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram chain: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if nodes < 1 or capacity < 2:
            raise ValueError(f"n-gram chain: {nodes} nodes over a history of {capacity}")
        self.capacity, self.max_ngram, self.min_ngram, self.nodes = capacity, max_ngram, min_ngram, nodes

    def __call__(self, history: torch.Tensor, length: torch.Tensor, chain: torch.Tensor,
                 step: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Write the chain into `chain` ([nodes] int64). history [capacity] and length [1]
        int64 are the drafter's buffers; `step` (result [3 + P], the verified tokens [N],
        int64, as the speculative step writes them) is first appended to them."""
        if history.shape != (self.capacity,) or history.dtype != torch.long or length.dtype != torch.long:
            raise ValueError(f"n-gram chain: history must be [{self.capacity}] int64 and length int64")
        if chain.numel() < self.nodes or not chain.is_contiguous():
            raise ValueError(f"n-gram chain: chain must hold {self.nodes} contiguous tokens")
        result, tokens = step if step is not None else (length, history)
        P = result.numel() - 3
        _ngram_chain_kernel[(1,)](
            history, length, result, tokens, chain, self.capacity, P, APPEND=step is not None,
            MAX_N=self.max_ngram, MIN_N=self.min_ngram, NODES=self.nodes,
            BN=triton.next_power_of_2(self.nodes), BLOCK=BLOCK, BP=triton.next_power_of_2(max(P, 2)),
            num_warps=4)
