"""Draft trees grown on the device with static shapes: `tree_build`'s search as tensor ops.

`specla.drafters.tree_build.build_tree` grows a tree on the host from conditional candidate
rows (chain, beam or best-first under a node budget, confidence pruning). A drafter that
runs inside the step graph cannot ask the host, so `grow_tree` does the same search with
tensors whose shapes depend only on the settings:

    pool       the root, then for each depth F x c children of the frontier, in the host's
               creation order (frontier order x row order), F the frontier width (1 chain,
               top_k beam, budget best-first), c the children per node (1 chain, else top_k)
    frontier   the F best children of a depth by score (cumulative log-prob), stable on ties,
               so that the host's index order breaks them the same way
    selection  the `budget` best candidates by (score desc, depth, index), then tree order
               (depth, score desc, index); fewer candidates than the budget leave dummy nodes
               (token -1, hanging off the root, last), which verification never accepts

A child never scores above its parent, so the selection is ancestor-closed, as on the host.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

SHAPES = ("chain", "beam", "best-first")

@dataclasses.dataclass
class Frontier:
    """The nodes of one depth that get children: their pool indices, ranks in their own row,
    tokens, parents' pool indices and whether they are live (dead ones pad the width)."""
    idx: torch.Tensor
    rank: torch.Tensor
    token: torch.Tensor
    parent: torch.Tensor
    alive: torch.Tensor


# rows(depth, frontier) -> the children of each frontier node, best first: tokens [F, k],
# conditional log-probs [F, k] (-inf: no such child), each child's rank in its row [F, k] (or
# any id the rows want back in the frontier)
Rows = Callable[[int, Frontier], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class GrownTree:
    tokens: torch.Tensor      # [N] root first; -1 for dummy nodes (always last)
    parents: torch.Tensor     # [N] -1 for the root; dummies hang off the root
    logp: torch.Tensor        # [N] each node's conditional draft log-prob (0 for root and dummies)
    real: torch.Tensor        # [N] bool: a drafted node (the root counts as real)


def frontier_width(shape: str, top_k: int, budget: int) -> int:
    return {"chain": 1, "beam": top_k, "best-first": budget}[shape]


def pool_size(shape: str, top_k: int, budget: int, depth: int) -> int:
    """Entries of `grow_tree`'s candidate pool, the root included (dead entries pad a pool
    smaller than the budget)."""
    c = 1 if shape == "chain" else top_k
    return 1 + max(depth * frontier_width(shape, top_k, budget) * c, budget)


def tree_nodes(shape: str, top_k: int, budget: int, depth: int) -> int:
    """Nodes of a grown tree, root included: a chain holds one node per depth."""
    return 1 + (min(budget, depth) if shape == "chain" else budget)


def grow_tree(root: torch.Tensor, rows: Rows, *, depth: int, shape: str, top_k: int, budget: int,
              prune_tau: float | None = None) -> GrownTree:
    """The tree `tree_build.build_tree` grows from the same rows, as static-shape tensor ops."""
    if shape not in SHAPES:
        raise ValueError(f"tree shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    dev = root.device
    c = 1 if shape == "chain" else top_k
    F = frontier_width(shape, top_k, budget)
    M = pool_size(shape, top_k, budget, depth)
    neg = torch.full((), float("-inf"), device=dev)
    pool_tok = torch.zeros(M, dtype=torch.long, device=dev)
    pool_tok[0] = root.view(())
    pool_parent = torch.zeros(M, dtype=torch.long, device=dev)
    pool_lp = torch.zeros(M, device=dev)
    pool_score = torch.full((M,), float("-inf"), device=dev)
    pool_depth = torch.zeros(M, dtype=torch.long, device=dev)
    pool_cand = torch.zeros(M, dtype=torch.bool, device=dev)

    f_idx = torch.zeros(F, dtype=torch.long, device=dev)
    f_score = torch.where(torch.arange(F, device=dev) == 0, 0.0, neg)
    f_rank = torch.zeros(F, dtype=torch.long, device=dev)
    f_alive = torch.arange(F, device=dev) == 0
    best = None
    for d in range(depth):
        frontier = Frontier(f_idx, f_rank, pool_tok.index_select(0, f_idx), pool_parent.index_select(0, f_idx),
                            f_alive)
        tok, lp, rank = (x[:, :c] for x in rows(d, frontier))
        alive = f_alive[:, None].expand(F, c) & (lp > float("-inf"))      # -inf: no such child
        score = torch.where(alive, f_score[:, None] + lp, neg)
        base = 1 + d * F * c
        idx = base + torch.arange(F * c, device=dev)
        pool_tok[base:base + F * c] = tok.reshape(-1)
        pool_parent[base:base + F * c] = f_idx[:, None].expand(F, c).reshape(-1)
        pool_lp[base:base + F * c] = lp.reshape(-1)
        pool_score[base:base + F * c] = score.reshape(-1)
        pool_depth[base:base + F * c] = d + 1
        if best is None:
            best = score.max()
        if prune_tau is not None:       # below the threshold: neither a candidate nor expanded
            alive = alive & (score >= best - prune_tau)
        flat_alive, flat_score = alive.reshape(-1), torch.where(alive, score, neg).reshape(-1)
        order = torch.sort(flat_score, descending=True, stable=True).indices[:F]
        kept = flat_alive.index_select(0, order)
        if shape == "best-first":       # any generated child may be a leaf
            pool_cand[base:base + F * c] = flat_alive
        else:                           # beam and chain: only the kept beam
            pool_cand.index_copy_(0, idx.index_select(0, order), kept)
        f_idx, f_rank, f_alive = idx.index_select(0, order), rank.reshape(-1).index_select(0, order), kept
        f_score = torch.where(kept, flat_score.index_select(0, order), neg)
    return _select(root, pool_tok, pool_parent, pool_lp, pool_score, pool_depth, pool_cand,
                   budget if shape != "chain" else min(budget, depth), chain=shape == "chain")


def _select(root, pool_tok, pool_parent, pool_lp, pool_score, pool_depth, pool_cand, budget: int,
            chain: bool) -> GrownTree:
    """The best `budget` candidates in tree order (see the module docstring)."""
    dev = root.device
    neg = torch.full((), float("-inf"), device=dev)
    # rank key (score desc, depth asc, index asc) over the pool without the root, by stable
    # sorts from the least significant key up
    key = torch.where(pool_cand, pool_score, neg)[1:]
    by_depth = torch.sort(pool_depth[1:], stable=True).indices
    ranked = by_depth.index_select(0, torch.sort(key.index_select(0, by_depth), descending=True,
                                                 stable=True).indices)
    sel = ranked[:budget] + 1                                            # pool indices
    real = pool_cand.index_select(0, sel)
    # tree order (depth asc, score desc, index asc), dummies last
    t_depth = torch.where(real, pool_depth.index_select(0, sel), pool_depth.numel() + 1)
    t_score = torch.where(real, pool_score.index_select(0, sel), neg)
    order = torch.sort(sel, stable=True).indices
    order = order.index_select(0, torch.sort(t_score.index_select(0, order), descending=True, stable=True).indices)
    order = order.index_select(0, torch.sort(t_depth.index_select(0, order), stable=True).indices)
    nodes, real = sel.index_select(0, order), real.index_select(0, order)
    position = torch.zeros_like(pool_tok)                                # pool index -> tree node
    position.index_copy_(0, nodes, torch.arange(1, budget + 1, device=dev))
    n = budget + 1
    if chain:   # a chain keeps its topology: missing nodes are dummies at its end
        parents = torch.arange(-1, n - 1, device=dev)
    else:
        inner = position.index_select(0, pool_parent.index_select(0, nodes))
        parents = torch.cat([torch.full((1,), -1, device=dev, dtype=torch.long),
                             torch.where(real, inner, 0)])
    tokens = torch.cat([root.view(1), torch.where(real, pool_tok.index_select(0, nodes), -1)])
    logp = torch.cat([torch.zeros(1, device=dev), torch.where(real, pool_lp.index_select(0, nodes), 0.0)])
    return GrownTree(tokens, parents, logp, torch.cat([torch.ones(1, dtype=torch.bool, device=dev), real]))


def static_rows(cand: torch.Tensor, cand_logp: torch.Tensor) -> Rows:
    """Rows that depend only on the depth (the block drafter's slot marginals [S, k])."""
    k = cand.shape[-1]
    ranks = torch.arange(k, device=cand.device)

    def rows(d: int, frontier: Frontier):
        F = frontier.idx.shape[0]
        return cand[d].expand(F, k), cand_logp[d].expand(F, k), ranks.expand(F, k)
    return rows


def conditional_rows(cand: torch.Tensor, start_lp: torch.Tensor, pair_lp: torch.Tensor) -> Rows:
    """LiLiCorr's first-order rows, from `specla.drafters.lilicorr.tree_rows`: start_lp [k]
    under the root, pair_lp[s, parent rank, :] below, each sorted best first
    (`LiLiCorrDrafter._rows` on the host)."""
    def rows(d: int, frontier: Frontier):
        F = frontier.idx.shape[0]
        row = start_lp.float().expand(F, -1) if d == 0 else pair_lp[d - 1].float().index_select(0, frontier.rank)
        lp, rank = torch.sort(row, dim=-1, descending=True, stable=True)
        return cand[d].gather(0, rank.reshape(-1)).view(F, -1), lp, rank
    return rows
