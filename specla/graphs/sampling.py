"""Lossless rejection sampling on the device: `specla.accept.accept_sampling` as tensor ops.

The output of a step is distributed exactly as the target's next-token distribution p
(temperature, nucleus) along the accepted path, whatever the draft:

    a chain drawn from a proposal q (rows `proposal`): at each node accept the drafted
    token x with min(1, p(x) / q(x)), else draw from norm(max(0, p - q)) and stop
    any other candidate set (top-k children): try the children in order as point masses,
    accept child c with probability p(c), else zero p(c) and renormalise; when none is
    left draw from what remains

Static shapes: the walk is a loop over the path's depth and over `max_children` sibling
slots, every iteration a few tensor ops on a one-node "cursor"; random numbers come from
torch's CUDA generator, which CUDA graphs capture. Draws use the Gumbel-max trick.
"""
from __future__ import annotations

import torch

from specla.graphs.spec import SpecTopology


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T), nucleus-filtered (`specla.accept.target_distribution`), [N, V]."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def gumbel_draw(p: torch.Tensor) -> torch.Tensor:
    """One index drawn from p [V] (unnormalised, >= 0) as a [1] tensor."""
    u = torch.rand_like(p).clamp_(1e-20, 1.0)
    return (p.clamp_min(0).log() - (-u.log()).log()).argmax().view(1)


def children_table(topo: SpecTopology, max_children: int) -> torch.Tensor:
    """[N, max_children] children of every node in sibling order (-1 where none)."""
    n = topo.n
    rank = topo.earlier_sibling.sum(1).long()                                  # among siblings
    table = torch.full((n, max_children), -1, dtype=torch.long, device=rank.device)
    nodes = torch.arange(n, device=rank.device)
    keep = (nodes > 0) & (rank < max_children)
    idx = (topo.parent * max_children + rank.clamp(max=max_children - 1)).masked_fill(~keep, n * max_children)
    flat = torch.cat([table.view(-1), table.new_full((1,), -1)])
    flat.index_copy_(0, idx, torch.where(keep, nodes, -1))
    return flat[:-1].view(n, max_children)


def sample_accept(topo: SpecTopology, tokens: torch.Tensor, probs: torch.Tensor, max_children: int,
                  proposal: torch.Tensor | None = None):
    """The accepted path of one step and its bonus token, drawn on the device.

    tokens [N] (-1 = dummy), probs [N, V] the target's distribution at every node, proposal
    [N, V] the distribution each node's token was drawn from (a sampled chain), or None
    (point-mass children). Returns what `greedy_accept` returns: a [1], end [1], path [P],
    valid [P], bonus [1].
    """
    P = topo.max_path
    kids = children_table(topo, max_children)
    cur = torch.zeros(1, dtype=torch.long, device=tokens.device)
    active = torch.ones(1, dtype=torch.bool, device=tokens.device)
    bonus = torch.zeros(1, dtype=torch.long, device=tokens.device)
    path = torch.zeros(P, dtype=torch.long, device=tokens.device)
    depth = torch.zeros(1, dtype=torch.long, device=tokens.device)
    for d in range(P):
        p = probs.index_select(0, cur)[0]
        picked = torch.full((1,), -1, dtype=torch.long, device=tokens.device)
        if proposal is not None:                      # a sampled chain: the q / p rule
            child = kids.index_select(0, cur)[0, :1]
            raw = tokens.index_select(0, child.clamp(min=0))
            live = active & (child >= 0) & (raw >= 0)
            token = raw.clamp(min=0)
            q = proposal.index_select(0, child.clamp(min=0))[0]
            ok = live & (torch.rand(1, device=p.device) * q.index_select(0, token) < p.index_select(0, token))
            picked = torch.where(ok, child, picked)
            residual = (p - q).clamp_min(0)
            rejected = live & ~ok
            p = torch.where(rejected & (residual.sum() > 0), residual, p)
        else:                                          # point masses, siblings in order
            for j in range(max_children):
                child = kids.index_select(0, cur)[0, j:j + 1]
                token = tokens.index_select(0, child.clamp(min=0))
                live = active & (picked < 0) & (child >= 0) & (token >= 0) & (p.sum() > 0)
                mass = p.index_select(0, token.clamp(min=0)) / p.sum().clamp_min(1e-30)
                ok = live & (torch.rand(1, device=p.device) < mass)
                picked = torch.where(ok, child, picked)
                p = torch.where(live & ~ok, p.index_fill(0, token.clamp(min=0), 0.0), p)
        stop = active & (picked < 0)
        bonus = torch.where(stop, gumbel_draw(p), bonus)
        go = active & (picked >= 0)
        cur = torch.where(go, picked, cur)
        depth = depth + go.long()
        path.index_copy_(0, depth.clamp(max=P - 1), torch.where(go, cur, path.index_select(0, depth.clamp(max=P - 1))))
        active = go
    return depth, cur, path, topo.arange_p <= depth, bonus
