"""Grow a draft tree from conditional candidate rows, under a node budget.

Every drafter describes its candidates the same way: `expand(nodes)` gets a batch of tree
nodes of one depth and returns, for each, its children as (token, log-prob, payload)
sorted best first. The log-prob is the draft's *conditional* log-prob of the child given
its path; a node's score is the cumulative log-prob of its path. Where the rows come from:

    block drafter   slot marginals: the same top-k row for every node of a depth
    LiLiCorr        log_softmax(start) for the root's children,
                    log_softmax(pair[s, parent rank, :]) below (a first-order chain)
    EAGLE-style     a drafter forward over the frontier (one call per depth)

Shapes (settings.tree):
    chain       one child per node: the greedy path (or the sampled path, when the
                drafter's `expand` samples)
    beam        per depth keep the `top_k` best nodes by score; each gets `top_k` children
    best-first  the `budget` nodes of highest score among all paths. Expanding the best
                `budget` nodes of each depth is enough to find them exactly: a child never
                scores above its parent, so a node outside the best `budget` of its depth
                has at least `budget` better nodes and none of its descendants can enter.

Then confidence pruning keeps the nodes whose score is >= best - tau (best = the best
non-root score; ancestor-closed, since scores only fall along a path), and the budget
keeps the highest-scoring nodes, parents before children. Nodes that pruning or the budget
removed go to `DraftTree.pruned` (for the views); the tree is never padded.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specla.tree import DraftTree

SHAPES = ("chain", "beam", "best-first")


@dataclasses.dataclass
class Node:
    index: int            # position in the candidate pool (the root is 0)
    token: int
    parent: int           # pool index of the parent, -1 for the root
    logprob: float        # conditional draft log-prob given the parent (0 for the root)
    score: float          # cumulative path log-prob
    depth: int
    payload: Any = None   # whatever the drafter needs to expand the node (a rank, a row id)


Expand = Callable[[list[Node]], list[list[tuple[int, float, Any]]]]


def build_tree(root_token: int, expand: Expand, *, shape: str, top_k: int, budget: int,
               max_depth: int, prune_tau: float | None = None, root_payload: Any = None,
               max_pruned_records: int = 64) -> tuple[DraftTree, list[Node]]:
    """The draft tree, and its nodes in tree order (node 0 is the root)."""
    if shape not in SHAPES:
        raise ValueError(f"tree shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if top_k < 1:
        raise ValueError(f"top-k must be at least 1, got {top_k}")
    if budget < 1:
        raise ValueError(f"node budget must be at least 1, got {budget}")
    children_per_node = 1 if shape == "chain" else top_k
    width = {"chain": 1, "beam": top_k, "best-first": budget}[shape]

    root = Node(0, int(root_token), -1, 0.0, 0.0, 0, root_payload)
    pool: list[Node] = [root]
    candidates: list[int] = []          # pool indices that may enter the tree
    frontier = [root]
    best: float | None = None           # best non-root score: always reached at depth 1
    for depth in range(1, max_depth + 1):
        if not frontier:
            break
        rows = expand(frontier)
        if len(rows) != len(frontier):
            raise RuntimeError(f"expand returned {len(rows)} rows for {len(frontier)} nodes")
        born: list[Node] = []
        for parent, row in zip(frontier, rows):
            for token, logprob, payload in list(row)[:children_per_node]:
                node = Node(len(pool), int(token), parent.index, float(logprob),
                            parent.score + float(logprob), depth, payload)
                pool.append(node)
                born.append(node)
        if not born:
            break
        if best is None:
            best = max(n.score for n in born)
        born.sort(key=lambda n: (-n.score, n.index))
        kept = born[:width]
        # best-first may take any generated child as a leaf; beam and chain only their beam.
        candidates.extend(n.index for n in (born if shape == "best-first" else kept))
        if prune_tau is not None:  # a node below the threshold has no descendant above it
            kept = [n for n in kept if n.score >= best - prune_tau]
        if shape == "best-first":
            kept = _within_budget(kept, [pool[i] for i in candidates], budget)
        frontier = kept

    return _select(pool, candidates, best, budget, prune_tau, max_pruned_records)


def _rank_key(node: Node) -> tuple:
    """The order in which `_select` takes candidates (best score, then shallow, then first)."""
    return (-node.score, node.depth, node.index)


def _within_budget(frontier: list[Node], candidates: list[Node], budget: int) -> list[Node]:
    """The frontier nodes that can still be in the best-first tree.

    `_select` takes the first `budget` candidates in `_rank_key` order. A node with `budget`
    candidates already ahead of it can never get there (later candidates only push it down)
    and its descendants rank after it, so expanding it is wasted: for a drafter that runs a
    network per depth (EAGLE) the frontier shrinks from `budget` nodes to the few that can
    still make it, and the tree is the same. Only the views' list of pruned nodes is shorter
    (descendants that were never generated are not listed).
    """
    if len(candidates) <= budget:
        return frontier
    cutoff = sorted(_rank_key(n) for n in candidates)[budget - 1]
    return [n for n in frontier if _rank_key(n) <= cutoff]


def _select(pool: list[Node], candidates: list[int], best: float | None, budget: int,
            prune_tau: float | None, max_records: int) -> tuple[DraftTree, list[Node]]:
    """Confidence pruning, then the budget, both ancestor-closed; then the tree."""
    order = sorted(candidates, key=lambda i: _rank_key(pool[i]))
    chosen: set[int] = {0}
    selected: list[int] = []
    dropped: list[tuple[int, str]] = []
    for i in order:
        node = pool[i]
        if prune_tau is not None and best is not None and node.score < best - prune_tau:
            dropped.append((i, "confidence"))
        elif len(selected) >= budget or node.parent not in chosen:
            dropped.append((i, "budget"))
        else:
            chosen.add(i)
            selected.append(i)
    # Tree order: by depth, then best first; a parent always has a smaller depth.
    selected.sort(key=lambda i: (pool[i].depth, -pool[i].score, i))
    nodes = [pool[0]] + [pool[i] for i in selected]
    tree_index = {node.index: t for t, node in enumerate(nodes)}
    pruned = []
    for i, reason in dropped[:max_records]:
        node = pool[i]
        pruned.append({"token": node.token, "parent": tree_index.get(node.parent, -1),
                       "parent_token": pool[node.parent].token, "depth": node.depth,
                       "logprob": node.logprob, "cum_logprob": node.score, "reason": reason})
    tree = DraftTree(tokens=[n.token for n in nodes],
                     parents=[-1] + [tree_index[n.parent] for n in nodes[1:]],
                     logprobs=[n.logprob for n in nodes], pruned=pruned)
    return tree, nodes


def static_rows(rows: list[list[tuple[int, float, Any]]]) -> Expand:
    """An `expand` whose children depend only on the depth (e.g. block-drafter marginals)."""
    def expand(nodes: list[Node]) -> list[list[tuple[int, float, Any]]]:
        return [rows[node.depth] if node.depth < len(rows) else [] for node in nodes]
    return expand
