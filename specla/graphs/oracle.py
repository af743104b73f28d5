"""The oracle drafter's proposals as tensor ops (measurement only: it knows the answer)."""
from __future__ import annotations

import torch

from specla.graphs.spec import SpecTopology


class DeviceOracle:
    """`OracleDrafter`'s proposals as tensor ops, so drafting stays inside the graph.

    Same semantics: a node on the tree's main line carries the target's greedy continuation
    with probability alpha, any other node (and a corrupted main node) a uniformly random wrong
    token. The random numbers come from tables drawn once and indexed by the device step
    counter, so a run is reproducible and needs no RNG inside the graph.
    """

    def __init__(self, continuation: list[int], vocab_size: int, alpha: float, max_steps: int,
                 max_nodes: int, capacity: int, device, seed: int = 0):
        self.vocab_size, self.capacity = vocab_size, capacity
        self.cont = torch.zeros(capacity, dtype=torch.long, device=device)
        self.set_continuation(continuation)
        self.alpha = torch.full((1,), float(alpha), device=device)
        gen = torch.Generator().manual_seed(seed)
        self.u = torch.rand(max_steps, max_nodes, generator=gen).to(device)
        self.r = torch.randint(0, vocab_size - 1, (max_steps, max_nodes), generator=gen).to(device)

    def set_continuation(self, tokens: list[int], start: int = 0) -> None:
        """Write tokens at [start, ...); everything after them is unknown (zeros)."""
        tokens = list(tokens)[:max(self.capacity - start, 0)]
        self.cont[start:].zero_()
        if tokens:
            self.cont[start:start + len(tokens)] = torch.tensor(tokens, device=self.cont.device)
        self.valid = start + len(tokens)          # positions before this hold real tokens

    def set_alpha(self, alpha: float) -> None:
        self.alpha.fill_(float(alpha))

    def draft(self, tokens: torch.Tensor, topo: SpecTopology, pos: torch.Tensor, step: torch.Tensor) -> None:
        """Fill tokens[0, 1:] for the step about to run (pos tokens produced so far)."""
        n = topo.n
        s = step.clamp(max=self.u.shape[0] - 1)
        u = self.u.index_select(0, s)[0, :n]
        r = self.r.index_select(0, s)[0, :n]
        true = self.cont.index_select(0, (pos + topo.depth - 1).clamp(0, self.capacity - 1))
        wrong = (true + 1 + r) % self.vocab_size
        keep = topo.main & (u < self.alpha)
        tokens[0, 1:].copy_(torch.where(keep, true, wrong)[1:])

    def token_at(self, index: torch.Tensor) -> torch.Tensor:
        return self.cont.index_select(0, index.clamp(0, self.capacity - 1))
