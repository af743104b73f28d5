"""The oracle drafter on the device (measurement only: it knows the answer), and decoding
with it on the speculative decoder's own greedy trajectory."""
from __future__ import annotations

import dataclasses
import time

import torch

from specla.graphs.ar import GraphedAR
from specla.graphs.runtime import StaticState, Stopwatch, sync
from specla.graphs.spec import GraphedSpec, SpecTopology


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


@dataclasses.dataclass
class OracleRun:
    tokens: list[int]
    steps: int
    accepted: list[int]                      # accepted drafts per step
    ms: float
    divergences: list[dict] = dataclasses.field(default_factory=list)


@torch.no_grad()
def oracle_calibrate(spec: GraphedSpec, ar: GraphedAR, snapshot: StaticState, root: int,
                     n: int, max_steps: int | None = None) -> OracleRun:
    """Decode n tokens step by step (one host read per step), keeping the oracle on the
    speculative decoder's own greedy trajectory.

    The oracle drafts the AR greedy continuation. In bf16 the speculative forward and the AR
    step round differently, so at a near-tie the target's argmax can leave that continuation
    (a divergence, recorded with the target's logit gap). The step is then undone and redone
    with the continuation realigned: the target's own token at that position, then AR's
    continuation after it. The result is what an oracle that knew the target's output would
    do. Graph replays are deterministic, so a timed run with the final continuation
    reproduces this trajectory step for step with no host work.
    """
    st, oracle = spec.state, spec.oracle
    st.reset(snapshot, root)
    spec.draft()
    divergences, steps = [], 0
    t0 = time.perf_counter()
    while int(st.pos.item()) < n and steps < (max_steps or 4 * n + 8):
        saved = [t.clone() for t in st.buffers()] + [spec.tokens.clone()]
        pos_before, root_before = int(st.pos.item()), int(st.root.item())
        spec.step()
        steps += 1
        for _ in range(st.max_path + 2):              # each redo gets strictly further
            a, end, bonus, div, pos = st.last.tolist()
            p = pos - 1                               # the bonus token's position
            if not div or p >= n:
                break
            if p < oracle.valid:                      # else: the continuation just ran out
                divergences.append({"position": p, "step": steps - 1,
                                    "gap": float(st.gap[steps - 1].item()), "target_token": bonus,
                                    "oracle_token": int(oracle.cont[p].item())})
            accepted = st.out[pos_before:p].tolist()
            for t, s in zip(st.buffers() + [spec.tokens], saved):
                t.copy_(s)
            # a bounded tail: if a later step runs past it, the same path extends it
            need = min(n - p + 2 * st.max_path + 2, 64 + 2 * st.max_path, ar.out.numel(),
                       oracle.capacity - p - 1)
            tail = ar.continue_after(st.folded_copy(), root_before, accepted + [bonus], need)
            oracle.set_continuation([bonus] + tail, start=p)
            spec.draft()
            spec.step()
    ms = 1e3 * (time.perf_counter() - t0)
    return OracleRun(st.output(), steps, st.acc[:steps].tolist(), ms, divergences)


@torch.no_grad()
def oracle_timed(spec: GraphedSpec, snapshot: StaticState, root: int, n: int, steps: int) -> OracleRun:
    """`steps` replays back to back (the count a calibration found), timed with events; the
    initial draft is inside the timing. Extra host-checked steps only if n was not reached."""
    st = spec.state
    st.reset(snapshot, root)
    sync(spec.rt.device)
    with Stopwatch(spec.rt.device) as sw:
        spec.draft()
        for _ in range(steps):
            spec.step()
    ms, extra = sw.ms, 0
    while int(st.pos.item()) < n and extra < 4 * n:
        with Stopwatch(spec.rt.device) as sw2:
            spec.step()
        ms += sw2.ms
        extra += 1
    total = steps + extra
    return OracleRun(st.output(), total, st.acc[:total].tolist(), ms)
