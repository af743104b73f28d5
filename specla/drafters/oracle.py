"""Measurement drafters, labelled as such: they know the target's answer.

`OracleDrafter` proposes the target's own greedy continuation and corrupts each drafted
token with probability 1 - alpha, so the engine can be measured at a controlled acceptance
on a random-weight model of any size. Trees put the true token among `top_k` siblings with
probability alpha; shape 'random' draws random trees (for exactness tests). It is not
a real drafter: it exists to measure and to test the engine.
"""
from __future__ import annotations

import random

from specla.drafters.base import Accepted, Draft, DraftContext
from specla.tree import DraftTree


class OracleDrafter:
    name = "oracle"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, continuation: list[int], vocab_size: int, alpha: float = 0.8,
                 seed: int = 0, shape: str = "chain"):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"oracle acceptance alpha must be in [0, 1], got {alpha}")
        if shape not in ("chain", "tree", "random"):
            raise ValueError(f"oracle shape must be chain, tree or random, got {shape!r}")
        self.continuation = list(continuation)
        self.vocab_size = vocab_size
        self.alpha = alpha
        self.shape = shape
        self.rng = random.Random(seed)
        self.generated = 0

    def reset(self, prompt_tokens, features, last_hidden) -> None:
        self.generated = 0

    def observe(self, accepted: Accepted) -> None:
        self.generated += len(accepted.tokens)   # accepted drafts + the previous root's slot

    def _true(self, offset: int) -> int:
        i = self.generated + offset
        return self.continuation[i] if i < len(self.continuation) else 0

    def _wrong(self, token: int) -> int:
        return (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def _maybe_corrupt(self, token: int) -> int:
        return token if self.rng.random() < self.alpha else self._wrong(token)

    def propose(self, ctx: DraftContext) -> Draft:
        s = ctx.settings
        if self.shape == "chain":
            tokens = [ctx.root_token] + [self._maybe_corrupt(self._true(d)) for d in range(s.budget)]
            return Draft(DraftTree.chain(tokens))
        if self.shape == "random":
            return Draft(self._random_tree(ctx.root_token, s.budget))
        return Draft(self._sibling_tree(ctx.root_token, s.budget, s.top_k))

    def _sibling_tree(self, root: int, budget: int, width: int) -> DraftTree:
        """Levels of `width` siblings along the main path; the true token is among them with
        probability alpha, and the path continues from it (else from the first sibling)."""
        tokens, parents, main, depth = [root], [-1], 0, 0
        while len(tokens) - 1 < budget:
            true = self._true(depth)
            level = [self._wrong(true) for _ in range(width)]
            has_true = self.rng.random() < self.alpha
            slot = self.rng.randrange(width)
            if has_true:
                level[slot] = true
            first = len(tokens)
            for token in level[:budget - (len(tokens) - 1)]:
                tokens.append(token)
                parents.append(main)
            main = first + slot if has_true and first + slot < len(tokens) else first
            depth += 1
        return DraftTree(tokens, parents)

    def _random_tree(self, root: int, budget: int) -> DraftTree:
        """Random parents; a node on the true path gets the true token with prob. alpha."""
        tokens, parents, depth_of, on_true = [root], [-1], [0], [True]
        for i in range(1, budget + 1):
            p = self.rng.randrange(i)
            d = depth_of[p]
            true = self._true(d)
            token = true if on_true[p] and self.rng.random() < self.alpha else self._wrong(true)
            tokens.append(token)
            parents.append(p)
            depth_of.append(d + 1)
            on_true.append(on_true[p] and token == true)
        return DraftTree(tokens, parents)

