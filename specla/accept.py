"""Acceptance: which drafted tokens the target keeps, exactly as AR decoding would.

Greedy (temperature 0): walk down from the root, always to the child whose token equals the
target's argmax at the current node; the argmax at the last accepted node is the bonus
token. Sampling: at each node, decide among its children with a rejection rule whose output
is distributed exactly as the target's next-token distribution p:

* one child drawn from a known proposal q (a sampled chain): accept with min(1, p/q), else
  draw from norm(max(0, p - q))  (Leviathan et al. / Chen et al.);
* otherwise (any candidate set, e.g. top-k children): try the children in order as point
  masses: accept child c with probability p(c), else zero p(c), renormalise and go on; when
  none is left draw from what remains. P(c) = p(c) for every token, so it is lossless for
  any way the candidates were chosen.
"""
from __future__ import annotations

import dataclasses

import torch

from specla.tree import DraftTree


@dataclasses.dataclass
class Acceptance:
    path: list[int]            # accepted node indices, root first
    tokens: list[int]          # accepted drafted tokens (path minus the root), in order
    bonus: int                 # the token the target adds after the path (next root)
    target_choice: list[int]   # target argmax at every node (what greedy would pick next)


def target_distribution(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution AR sampling draws from: softmax(logits / T), nucleus-filtered."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p      # keep the smallest nucleus
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    choice = logits.argmax(-1).tolist()                       # one device->host copy
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == choice[node]), None)
        if nxt is None:
            break
        node = nxt
        path.append(node)
    return Acceptance(path, [tree.tokens[n] for n in path[1:]], choice[node], choice)


def accept_sampling(tree: DraftTree, logits: torch.Tensor, temperature: float, top_p: float,
                    proposal: torch.Tensor | None, generator: torch.Generator | None) -> Acceptance:
    probs = target_distribution(logits, temperature, top_p).cpu()
    q_rows = proposal.float().cpu() if proposal is not None else None
    node, path = 0, [0]
    while True:
        p = probs[node].clone()
        kids = tree.children[node]
        picked = None
        if len(kids) == 1 and q_rows is not None:
            child = kids[0]
            token, q = tree.tokens[child], q_rows[child]
            if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
                picked = child
            else:
                residual = (p - q).clamp_min(0)
                p = residual / residual.sum() if residual.sum() > 0 else p
        else:
            for child in kids:
                token = tree.tokens[child]
                if float(torch.rand((), generator=generator)) < float(p[token]):
                    picked = child
                    break
                p[token] = 0.0
                if p.sum() <= 0:
                    break
                p = p / p.sum()
        if picked is None:
            bonus = sample(p, generator)
            break
        node = picked
        path.append(node)
    return Acceptance(path, [tree.tokens[n] for n in path[1:]], bonus, logits.argmax(-1).tolist())
