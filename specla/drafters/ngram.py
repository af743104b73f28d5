"""Model-free drafting: continue the context the way it continued before.

Prompt lookup / suffix matching as serving engines ship it. The last n tokens of the
history (prompt + output so far, the current root last) are looked up in the history
itself; what followed each earlier occurrence is a candidate continuation. Longer
matches rank first (n from `max_ngram` down to `min_ngram`), then, by `order`, the most
recent occurrence or the continuation seen most often. The best `width` distinct
continuations, merged on their shared prefixes, are the draft tree; width 1 is a chain.
It needs no weights and no target features, so it drafts for any target.

The core is pure tensor functions with static shapes and no host synchronisation (no
.item(), no data-dependent shapes, no Python branching on tensor values), so the same
code runs eagerly here and inside a CUDA graph:

    append(history [L], length [1], tokens [M], count [1]) -> (history [L], length [1])
    continuations(history [L], length [1], *, max_ngram, min_ngram, width, depth, pool, order)
        -> tokens [width, depth] long, valid [width, depth] bool, score [width] float
    trie(tokens [W, D], valid [W, D], root [1] | None)
        -> node_tokens [1 + W*D] long, parents [1 + W*D] long, is_real [1 + W*D] bool

`history` is a fixed-capacity buffer whose first `length` entries are the tokens, oldest
first; `append` keeps the most recent L. Node (w, d) of the trie is index 1 + w*D + d,
so row w's chain is contiguous and a width-1 trie is a chain in order. A node whose
prefix an earlier row already has is a dummy: token -1, parent 0 (the root), is_real
False. The verifier never accepts a -1 token, so a device step can verify the static
trie as is; `NgramDrafter` drops the dummies.

DraftSettings, read for this drafter:
    tree     chain -> width 1; beam / best-first -> width `top_k`, grown by `tree_build`
             over the trie (best-first keeps the `budget` heaviest nodes, beam the `top_k`
             heaviest per depth)
    depth    the longest continuation drafted (the maximum tree depth)
    budget   the most draft nodes, root excluded
    prune_tau  as for every drafter, on the log-prob-like scores below
Row weights are softmax(score); a node's weight is the sum of the weights of the rows
through it, and its draft "log-prob" is log(weight / parent weight): only the views and
the tree search read it, acceptance does not (drafts are point-mass proposals).
"""
from __future__ import annotations

import math

import torch

from specla.drafters import tree_build
from specla.drafters.base import Accepted, Draft, DraftContext, DraftSettings

ORDERS = ("recency", "frequency")


# ---------------------------------------------------------------------------------------
# the tensor core (static shapes, no host synchronisation)


def append(history: torch.Tensor, length: torch.Tensor, tokens: torch.Tensor,
           count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The history with tokens[:count] appended, the oldest tokens dropped past capacity.

    history [L] long, length [1] long (<= L), tokens [M] long, count [1] long (<= M).
    Entries at or past the new length are unspecified.
    """
    L, M = history.shape[0], tokens.shape[0]
    j = torch.arange(M, device=history.device)
    room = torch.cat([history, history.new_full((M + 1,), -1)])           # slot L+M: a dump
    room = room.scatter(0, torch.where(j < count, length + j, L + M), tokens)
    total = length + count
    shift = (total - L).clamp(min=0)
    return room[shift + torch.arange(L, device=history.device)], total - shift


def match_lengths(history: torch.Tensor, length: torch.Tensor, max_ngram: int) -> torch.Tensor:
    """[L] long: how many tokens ending at position p equal the last tokens of the history,
    at most `max_ngram`; 0 for p >= length - 1 (the suffix does not match itself)."""
    L = history.shape[0]
    pos = torch.arange(L, device=history.device)
    last = length - 1
    running = torch.ones(L, dtype=torch.bool, device=history.device)
    matched = torch.zeros(L, dtype=torch.long, device=history.device)
    for i in range(max_ngram):
        mine = history[(pos - i).clamp(min=0)]
        theirs = history[(last - i).clamp(min=0)]
        running = running & (pos - i >= 0) & (last - i >= 0) & (mine == theirs)
        matched = matched + running.long()
    return torch.where(pos < last, matched, 0)


def _covers(tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[K, K] bool: covers[a, b] = row b has row a's tokens wherever row a is valid."""
    agree = (tokens[:, None, :] == tokens[None, :, :]) & valid[None, :, :]
    return (agree | ~valid[:, None, :]).all(-1)


def continuations(history: torch.Tensor, length: torch.Tensor, *, max_ngram: int, min_ngram: int,
                  width: int, depth: int, pool: int = 32, order: str = "recency",
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best `width` distinct continuations of the history's last tokens.

    A candidate is an earlier position p whose last n tokens (min_ngram <= n <= max_ngram,
    as many as match) equal the history's last n; its continuation is history[p+1 : p+1+depth],
    valid while inside the history. The `pool` candidates with the longest match, then the
    most recent, are kept; they are ranked by (match length, most recent) for order
    'recency', by (match length, how many pool candidates continue the same way, most
    recent) for 'frequency'; a candidate that a better one covers (same tokens wherever it is
    valid) is dropped. Returns tokens [width, depth] long (-1 where not valid), valid
    [width, depth] bool (a prefix in every row; a row with no candidate is all False) and
    score [width] float: the match length (+ log of the count for 'frequency'), -inf for
    an empty row.
    """
    L = history.shape[0]
    _check_args(L, max_ngram=max_ngram, min_ngram=min_ngram, width=width, depth=depth,
                pool=pool, order=order)
    dev = history.device
    pos = torch.arange(L, device=dev)
    matched = match_lengths(history, length, max_ngram)
    key = torch.where(matched >= min_ngram, matched * L + pos, -1)
    pool_key, pool_pos = key.topk(pool)                                   # [K], best first
    present = pool_key >= 0
    n = torch.where(present, pool_key // L, 0)
    idx = pool_pos[:, None] + 1 + torch.arange(depth, device=dev)         # [K, D]
    valid = present[:, None] & (idx < length)
    tokens = torch.where(valid, history[idx.clamp(max=L - 1)], -1)
    covers = _covers(tokens, valid)                                       # [K, K]
    count = ((covers | covers.T) & present[None, :]).sum(-1)              # itself included
    if order == "frequency":
        rank = (n * (pool + 1) + count) * L + pool_pos
    else:
        rank = n * L + pool_pos
    rank = torch.where(present & valid[:, 0], rank, -1)
    better = rank[None, :] > rank[:, None]                                # [a, b]: b ranks above a
    duplicate = (covers & better & (rank[None, :] >= 0)).any(-1)
    best_rank, best = torch.where(duplicate, -1, rank).topk(width)
    kept = best_rank >= 0
    valid = valid[best] & kept[:, None]
    score = n[best].float()
    if order == "frequency":
        score = score + count[best].float().log()
    score = torch.where(kept, score, -math.inf)
    return torch.where(valid, tokens[best], -1), valid, score


def trie(tokens: torch.Tensor, valid: torch.Tensor, root: torch.Tensor | None = None,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge rows [W, D] on their shared prefixes into one static tree of 1 + W*D nodes.

    Node 0 is the root (token `root`, or -1 for the caller to fill in); node (w, d) is
    1 + w*D + d. It is real when row w is valid at d and no earlier row has the same
    prefix up to d; its parent is then the real node of its prefix up to d-1 (the root at
    d = 0). Every other node is a dummy: token -1, parent 0, is_real False.
    """
    W, D = tokens.shape
    dev = tokens.device
    valid = valid.long().cumprod(-1).bool()
    agree = (tokens[:, None, :] == tokens[None, :, :]) & valid[:, None, :] & valid[None, :, :]
    same_prefix = agree.long().cumprod(-1).bool()                         # [a, b, d]
    rows = torch.arange(W, device=dev)
    first = torch.where(same_prefix, rows[None, :, None], W).amin(1)      # [W, D]
    real = valid & (first == rows[:, None])
    d = torch.arange(D, device=dev)
    up = 1 + first[:, :-1] * D + d[None, :-1]                             # node of the prefix to d-1
    parent = torch.cat([torch.zeros(W, 1, dtype=torch.long, device=dev), up], dim=1)
    parent = torch.where(real, parent, 0)
    head = root.reshape(1).long() if root is not None else torch.full((1,), -1, device=dev)
    node_tokens = torch.cat([head, torch.where(real, tokens, -1).flatten()])
    parents = torch.cat([torch.full((1,), -1, device=dev), parent.flatten()])
    is_real = torch.cat([torch.ones(1, dtype=torch.bool, device=dev), real.flatten()])
    return node_tokens, parents, is_real


def _check_args(capacity: int, *, max_ngram: int, min_ngram: int, width: int, depth: int,
                pool: int, order: str) -> None:
    """Static arguments only (shapes and settings, never tensor values)."""
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got min {min_ngram}, "
                         f"max {max_ngram}")
    if depth < 1:
        raise ValueError(f"continuation depth must be at least 1, got {depth}")
    if not 1 <= width <= pool <= capacity:
        raise ValueError(f"need 1 <= width <= pool <= history capacity, got width {width}, "
                         f"pool {pool}, capacity {capacity}")
    if order not in ORDERS:
        raise ValueError(f"n-gram order must be one of {', '.join(ORDERS)}, got {order!r}")


# ---------------------------------------------------------------------------------------
# the Drafter around it


class NgramDrafter:
    """Drafts from the prompt and the output so far; no weights, no target features.

    The history buffer holds every token fed or chosen so far, the current root last:
    `reset` fills it with the prompt, `observe` appends the accepted drafts and the bonus.
    """

    kind = "ngram"
    label = "n-gram (model-free)"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, *, max_ngram: int = 4, min_ngram: int = 1,
                 order: str = "recency", pool: int = 32, capacity: int = 8192,
                 device: torch.device | str = "cpu"):
        _check_args(capacity, max_ngram=max_ngram, min_ngram=min_ngram, width=1, depth=1,
                    pool=pool, order=order)
        self.name = self.kind
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram, self.order, self.pool = max_ngram, min_ngram, order, pool
        self.capacity, self.device = capacity, torch.device(device)
        self._clear()

    def settings_key(self) -> tuple:
        """What a drafter built from these settings drafts from besides its sequence: two
        drafters with equal keys draft alike, so a captured decoder serves both."""
        return (self.vocab_size, self.max_ngram, self.min_ngram, self.order, self.pool, self.capacity,
                str(self.device))

    def _clear(self) -> None:
        # new tensors, never written in place: a shallow copy of the drafter (one per app run)
        # must not share its sequence with the original
        self.history = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)
        self.length = torch.zeros(1, dtype=torch.long, device=self.device)
        self.last_token: int | None = None

    def _extend(self, tokens: list[int]) -> None:
        if not tokens:
            return
        new = torch.tensor(tokens[-len(self.history):], dtype=torch.long, device=self.history.device)
        count = torch.full((1,), len(new), dtype=torch.long, device=new.device)
        self.history, self.length = append(self.history, self.length, new, count)
        self.last_token = int(tokens[-1])

    def reset(self, prompt_tokens: list[int], features: torch.Tensor | None,
              last_hidden: torch.Tensor) -> None:
        self._clear()
        self._extend(list(prompt_tokens))

    def observe(self, accepted: Accepted) -> None:
        self._extend(list(accepted.tokens[1:]) + [accepted.bonus_token])

    def context_state(self) -> dict[str, torch.Tensor]:
        return {"history": self.history.clone(), "length": self.length.clone()}

    def propose(self, ctx: DraftContext) -> Draft:
        s: DraftSettings = ctx.settings
        s.validate(self.vocab_size)
        if self.last_token != ctx.root_token:
            raise RuntimeError(f"the n-gram history ends with {self.last_token}, but the root is "
                               f"{ctx.root_token}: reset/observe were not called in step")
        width = 1 if s.tree == "chain" else min(s.top_k, self.pool)
        tokens, valid, score = continuations(
            self.history, self.length, max_ngram=self.max_ngram, min_ngram=self.min_ngram,
            width=width, depth=s.depth, pool=self.pool, order=self.order)
        node_tokens, parents, is_real = trie(tokens, valid)
        expand = _trie_rows(tokens.tolist(), valid.tolist(), score.tolist(), node_tokens.tolist(),
                            parents.tolist(), is_real.tolist())
        tree, _ = tree_build.build_tree(ctx.root_token, expand, shape=s.tree, top_k=width,
                                        budget=s.budget, max_depth=s.depth, prune_tau=s.prune_tau)
        rows = [[t for t, ok in zip(row, oks) if ok] for row, oks in zip(tokens.tolist(), valid.tolist())]
        return Draft(tree=tree, details={"drafter": self.kind,
                                         "continuations": [r for r in rows if r],
                                         "scores": [x for x in score.tolist() if math.isfinite(x)]})


def _trie_rows(tokens: list[list[int]], valid: list[list[bool]], score: list[float],
               node_tokens: list[int], parents: list[int], is_real: list[bool]) -> tree_build.Expand:
    """`tree_build` rows over the trie: a node's children, heaviest first, with
    log(child weight / node weight), where a row weighs softmax(score) and a node the sum of
    the rows through it."""
    finite = [x for x in score if math.isfinite(x)]
    top = max(finite, default=0.0)
    row_weight = [math.exp(x - top) if math.isfinite(x) else 0.0 for x in score]
    D = len(tokens[0]) if tokens else 0
    weight = [0.0] * len(node_tokens)
    children: dict[int, list[int]] = {}
    for node in range(1, len(node_tokens)):
        if is_real[node]:
            children.setdefault(parents[node], []).append(node)
    for w, row in enumerate(tokens):
        node = 0
        weight[0] += row_weight[w] if valid[w][0] else 0.0
        for d in range(D):
            if not valid[w][d]:
                break
            node = next(c for c in children.get(node, []) if node_tokens[c] == row[d])
            weight[node] += row_weight[w]
    for kids in children.values():
        kids.sort(key=lambda c: (-weight[c], c))

    def expand(nodes: list[tree_build.Node]) -> list[list[tuple[int, float, int]]]:
        out = []
        for node in nodes:
            at = 0 if node.payload is None else node.payload
            out.append([(node_tokens[c], math.log(weight[c] / weight[at]), c)
                        for c in children.get(at, [])])
        return out
    return expand
