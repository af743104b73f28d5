"""What every drafter gives the engine, and what the engine tells it back.

A step goes: `propose(ctx)` -> the engine verifies the returned tree against the target ->
`observe(accepted)` with the target's features of the nodes that were accepted (the root
included, since the root was fed to the target in this step). A drafter keeps only state
built from accepted tokens: nothing of a rejected branch may leak into the next step.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from specla.tree import MAX_TREE_NODES, DraftTree


@dataclasses.dataclass
class DraftSettings:
    top_k: int = 4              # candidates per slot / children per node
    budget: int = 16            # max nodes in the tree, root excluded
    block_size: int = 8         # block drafter: root + (block_size - 1) predicted slots
    depth: int = 6              # EAGLE-style drafter: max tree depth
    tree: str = "chain"         # chain | beam | best-first
    prune_tau: float | None = None  # confidence pruning: keep cum. logprob >= best - tau
    temperature: float = 0.0

    def for_preset(self, paths) -> "DraftSettings":
        """These settings widened for a tree preset (index paths, parents first): top-k,
        depth, budget and block size that hold every path."""
        s, deepest = dataclasses.replace(self), max(len(p) for p in paths)
        s.top_k = max(s.top_k, 1 + max(max(p) for p in paths))
        s.depth = max(s.depth, deepest)
        s.budget = min(MAX_TREE_NODES - 1, max(s.budget, len(paths)))
        s.block_size = max(s.block_size, 1 + deepest)
        return s

    def validate(self, vocab_size: int) -> None:
        if not 1 <= self.top_k <= vocab_size:
            raise ValueError(f"top-k must be between 1 and the vocabulary size ({vocab_size}), got {self.top_k}")
        if self.budget < 1:
            raise ValueError(f"node budget must be at least 1, got {self.budget}")
        if self.block_size < 2:
            raise ValueError(f"block size must be at least 2 (the root and one predicted slot), got {self.block_size}")
        if self.depth < 1:
            raise ValueError(f"depth must be at least 1, got {self.depth}")
        if self.tree not in ("chain", "beam", "best-first"):
            raise ValueError(f"tree shape must be chain, beam or best-first, got {self.tree!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.prune_tau is not None and self.prune_tau < 0:
            raise ValueError(f"pruning tau must be >= 0, got {self.prune_tau}")


@dataclasses.dataclass
class DraftContext:
    root_token: int                       # last chosen token, not yet fed to the target
    settings: DraftSettings
    generator: torch.Generator | None = None  # for sampled drafting (temperature > 0)


@dataclasses.dataclass
class Draft:
    tree: DraftTree
    # Proposal distribution each node was drawn from (over the vocabulary, [N, vocab], row 0
    # unused), when the drafter sampled it: the lossless chain rejection sampler needs q.
    # None for deterministic (top-k / argmax) drafts: the acceptor then treats every child
    # as a point-mass proposal, which is lossless for any candidate set.
    proposal: torch.Tensor | None = None
    # JSON-able details for the explorer's views (e.g. the LiLiCorr lattice); see trace.py.
    details: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Accepted:
    tokens: list[int]                     # root first, then the accepted drafted tokens
    features: torch.Tensor | None         # [len(tokens), n_feature_layers, D] target features
    last_hidden: torch.Tensor             # [len(tokens), D] target hidden after final norm
    bonus_token: int                      # next root


class Drafter(Protocol):
    name: str
    feature_layers: tuple[int, ...]       # target layers whose outputs the drafter reads

    def reset(self, prompt_tokens: list[int], features: torch.Tensor | None,
              last_hidden: torch.Tensor) -> None:
        """Start a sequence: the prompt minus its last token was prefilled into the target.

        features [T, n_feature_layers, D] and last_hidden [T, D] are for those T tokens.
        """

    def propose(self, ctx: DraftContext) -> Draft: ...

    def observe(self, accepted: Accepted) -> None: ...
