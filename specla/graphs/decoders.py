"""Decode loops over the graphed step: a host drafter between replays (`GraphedDecoder`)."""
from __future__ import annotations

import dataclasses
import time

import torch

from specla.graphs.buckets import bucket
from specla.graphs.runtime import PackedTarget, sync
from specla.graphs.spec import GraphedSpec, SpecState
from specla.tree import DraftTree


@dataclasses.dataclass
class DraftRun:
    tokens: list[int]
    steps: int
    accepted: list[int]
    ms: float                       # decode wall time (prefill and graph captures excluded)
    phases_ms: dict                 # draft | graph (verify+accept+readback) | observe | other
    capture_ms: float
    graphs: int
    divergence: dict | None         # first position where the output leaves `reference`


class GraphedDecoder:
    """Speculative decoding with a real (host) drafter: the drafter runs eagerly between
    graph replays, one graph per topology bucket (chains padded at their end; trees padded
    with dummy nodes off the root, verified in "tree" mode with the topology rewritten in
    place), all sharing one `SpecState`."""

    def __init__(self, rt: PackedTarget, drafter, settings, max_path: int, capacity: int,
                 deferred: bool = True, use_graph: bool | None = None,
                 recurrence: str = "kernels", max_graphs: int = 16):
        self.rt, self.drafter, self.settings = rt, drafter, settings
        self.state = SpecState(rt, max_path, capacity)
        self.deferred, self.use_graph, self.recurrence = deferred, use_graph, recurrence
        self.max_graphs, self.specs = max_graphs, {}
        self.capture_ms = 0.0

    def _spec_for(self, tree: DraftTree) -> tuple[GraphedSpec, DraftTree]:
        key, padded = bucket(tree)
        spec = self.specs.get(key)
        if spec is None:
            graphed = self.use_graph if len(self.specs) < self.max_graphs else False
            t0 = time.perf_counter()
            spec = GraphedSpec(self.rt, self.state, padded, mode="auto", deferred=self.deferred,
                               feature_layers=self.drafter.feature_layers, use_graph=graphed,
                               recurrence=self.recurrence, dynamic=True)
            self.capture_ms += 1e3 * (time.perf_counter() - t0)
            self.specs[key] = spec
        return spec, padded

    @torch.no_grad()
    def generate(self, prompt: list[int], n: int, reference: list[int] | None = None,
                 prefilled=None) -> DraftRun:
        from specla.drafters.base import Accepted, DraftContext

        rt, st = self.rt, self.state
        state0, feats, hidden = prefilled or rt.prefill(prompt, self.drafter.feature_layers)
        self.drafter.reset(prompt, feats, hidden)
        st.reset(state0, prompt[-1])
        gen = torch.Generator().manual_seed(0)
        root, out, accepted, divergence = prompt[-1], [], [], None
        phases = {"draft": 0.0, "graph": 0.0, "observe": 0.0}
        capture_before = self.capture_ms
        sync(rt.device)
        t_start = time.perf_counter()
        while len(out) < n:
            t0 = time.perf_counter()
            draft = self.drafter.propose(DraftContext(root, self.settings, gen))
            t1 = time.perf_counter()
            spec, padded = self._spec_for(draft.tree)
            t2 = time.perf_counter()
            spec.load_tree(padded)
            spec.step()
            a, end, bonus, *path = spec.result.tolist()          # the one sync of the step
            t3 = time.perf_counter()
            nodes = path[:a + 1]
            idx = torch.tensor(nodes, device=rt.device)
            self.drafter.observe(Accepted(
                tokens=[padded.tokens[i] for i in nodes],
                features=None if spec.features is None else spec.features.index_select(0, idx),
                last_hidden=spec.last_hidden.index_select(0, idx), bonus_token=bonus))
            t4 = time.perf_counter()
            new = [padded.tokens[i] for i in nodes[1:]] + [bonus]
            if reference is not None and divergence is None:
                divergence = _first_divergence(spec, nodes, new, reference, len(out))
            out += new
            accepted.append(a)
            root = bonus
            phases["draft"] += 1e3 * (t1 - t0)
            phases["graph"] += 1e3 * (t3 - t2)
            phases["observe"] += 1e3 * (t4 - t3)
        sync(rt.device)
        captured = self.capture_ms - capture_before
        ms = 1e3 * (time.perf_counter() - t_start) - captured
        phases["other"] = ms - sum(phases.values())
        return DraftRun(out, len(accepted), accepted, ms, phases, captured,
                        sum(1 for s in self.specs.values() if s.graphs), divergence)


def _first_divergence(spec: GraphedSpec, nodes: list[int], new: list[int], reference: list[int],
                      offset: int) -> dict | None:
    """Where this step's tokens leave the reference: the target's logit gap there (between its
    own pick and the reference token, at the node that chose) tells a near-tie apart."""
    for j, token in enumerate(new):
        pos = offset + j
        if pos >= len(reference):
            return None
        if token != reference[pos]:
            row = spec.logits[nodes[j]]
            return {"position": pos, "token": token, "reference_token": reference[pos],
                    "gap": float(row[token] - row[reference[pos]])}
    return None
