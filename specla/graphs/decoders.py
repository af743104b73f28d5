"""Decoding over the graphed step: the loop behind the engine's CUDA-graph backend.

`GraphedDecoder` decodes a prompt in one of three ways, and yields one `GraphedStep` per
target forward either way:

    device drafting   a `DeviceBlockDrafter` inside the step graphs: the host replays steps
                      in batches, with a CUDA event after each phase, and reads the step log
                      once per batch (no host work inside a batch)
    host drafting     a host drafter runs eagerly between replays (drafters or settings with
                      no device version); one graph per draft-size bucket (chains padded at
                      their end, trees with dummy nodes off the root, the topology rewritten
                      in place), all sharing one `SpecState`
    sampling          (temperature > 0) a device drafter draws its chain and the acceptance
                      samples inside the accept graph (`specla.graphs.sampling`); with a host
                      drafter the host draws the lossless rejection sample from the verified
                      logits between the verify and accept graphs

Every body also runs eagerly (`use_graph=False`, the CPU), so the tests check the logic there.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterator

import torch

from specla.accept import accept_sampling
from specla.decode import target_probs
from specla.drafters.base import Accepted, DraftContext, DraftSettings
from specla.graphs.buckets import bucket, max_path_for, padded_nodes
from specla.graphs.readback import Readback
from specla.graphs.runtime import PackedTarget, PhaseClock, StaticState, capture, sync
from specla.graphs.spec import GraphedSpec, LoggedSteps, SpecState, StepOutcome, enqueue_phases, step_times
from specla.tree import DraftTree

MAX_BATCH = 64          # device-drafted steps replayed between two readbacks
LOG_FIELDS = tuple(f.name for f in dataclasses.fields(LoggedSteps))


@dataclasses.dataclass
class Sampling:
    temperature: float
    top_p: float
    seed: int


@dataclasses.dataclass
class GraphedStep:
    """One step as the graphed backend records it (the engine turns it into a StepRecord)."""
    tree: DraftTree                 # the verified draft, dummy nodes removed
    outcome: StepOutcome
    choice: list[int]               # the target's argmax at every node
    target_prob: list[float]        # the target's probability of each node's token at its parent
    times_ms: dict                  # draft / verify / accept (CUDA events, or host time eagerly)
    details: dict                   # the drafter's JSON details (the LiLiCorr lattice)
    mode: str = "tree"              # the verification mode that ran


class GraphedDecoder:
    """Speculative decoding over captured steps with a device drafter or a host drafter.

    packed: the target; drafter: a host drafter (`specla.drafters.base.Drafter`) or a device
    drafter (`specla.graphs.drafters.DeviceBlockDrafter`); settings: the draft settings (for
    a host drafter); capacity: most tokens one decode makes; sampling: host acceptance;
    max_drafted: the most nodes a host drafter drafts a step (default the budget).
    """

    def __init__(self, packed: PackedTarget, drafter, settings: DraftSettings, capacity: int,
                 deferred: bool = True, mode: str = "auto", use_graph: bool | None = None,
                 recurrence: str = "kernels", sampling: Sampling | None = None, max_graphs: int = 16,
                 max_drafted: int | None = None):
        self.packed, self.drafter, self.settings = packed, drafter, settings
        self.on_device = hasattr(drafter, "template")
        self.deferred, self.mode, self.recurrence, self.sampling = deferred, mode, recurrence, sampling
        self.use_graph = packed.device.type == "cuda" if use_graph is None else use_graph
        self.max_graphs, self.specs = max_graphs, {}
        self.feature_layers = tuple(drafter.feature_layers)
        self.capture_ms = 0.0
        if self.on_device:
            template = drafter.template()
            self.state = SpecState(packed, max_path=drafter.max_depth + 1, capacity=capacity,
                                   max_nodes=len(template))
            drafter.bind(self.state.log)
            drafter_rows = drafter.step_buffers()
            if set(drafter_rows) & set(LOG_FIELDS):
                raise ValueError(f"{type(drafter).__name__}'s step buffers reuse a step-log name")
            self.readback = Readback({**self.state.log.named(), **drafter_rows}, MAX_BATCH)
            # a device-grown tree is verified by the tree kernels, which read the topology from
            # the device; on the CPU the torch recurrence reads the rebuilt masks
            recurrence = "torch" if drafter.dynamic and packed.device.type != "cuda" else recurrence
            t0 = time.perf_counter()
            # sampling: the drafter draws on the device and the acceptance samples there too
            self.spec = GraphedSpec(packed, self.state, template, mode="tree" if drafter.dynamic else mode,
                                    deferred=deferred, feature_layers=self.feature_layers,
                                    use_graph=self.use_graph, recurrence=recurrence, drafter=drafter,
                                    sampling=None if sampling is None else (sampling.temperature, sampling.top_p),
                                    compile=getattr(drafter, "compiled", False))
            self.first_graph = self._capture_first() if self.spec.use_graph else None
            self.capture_ms = 1e3 * (time.perf_counter() - t0)
        else:
            # a host draft has at most `max_drafted` nodes besides the root; the pending commit
            # is padded to its longest path (a padded entry folds as a no-op)
            drafted = max_drafted or settings.budget
            self.state = SpecState(packed, max_path=max_path_for(drafted), capacity=capacity,
                                   max_nodes=padded_nodes(drafted))

    @property
    def graphs(self) -> int:
        if self.on_device:
            return len(self.spec.graphs) + int(self.first_graph is not None)
        return sum(len(s.graphs) for s in self.specs.values())

    # -- set-up -------------------------------------------------------------------------------
    @torch.no_grad()
    def _capture_first(self) -> torch.cuda.CUDAGraph:
        """The first draft of a sequence (no accepted path yet) as a graph of its own."""
        kept = [self.spec.tokens] + self.drafter.buffers()
        with self.state.preserved():
            saved = [t.clone() for t in kept]
            graph = capture(lambda: self.drafter.propose(self.spec))
            for t, s in zip(kept, saved):
                t.copy_(s)
        return graph

    def _spec_for(self, tree: DraftTree) -> tuple[GraphedSpec, DraftTree]:
        key, padded = bucket(tree)
        spec = self.specs.get(key)
        if spec is None:
            graphed = self.use_graph and len(self.specs) < self.max_graphs
            t0 = time.perf_counter()
            spec = GraphedSpec(self.packed, self.state, padded, mode=self.mode, deferred=self.deferred,
                               feature_layers=self.feature_layers, use_graph=graphed,
                               recurrence=self.recurrence, dynamic=True,
                               host_accept=self.sampling is not None)
            self.capture_ms += 1e3 * (time.perf_counter() - t0)
            self.specs[key] = spec
        return spec, padded

    @torch.no_grad()
    def start(self, prompt: list[int], prefilled=None):
        """Load the prefilled state (prefilling if not given) and reset the drafter; returns
        the prefill (state, features, last hidden) so a later decode can reuse it."""
        pre = prefilled or self.packed.prefill(prompt, self.feature_layers)
        state0, feats, hidden = pre
        self.state.reset(state0, prompt[-1])
        self.drafter.reset(prompt, feats if len(prompt) > 1 else None, hidden)
        return pre

    # -- decoding -----------------------------------------------------------------------------
    @torch.no_grad()
    def steps(self, prompt: list[int], n: int, prefilled=None) -> Iterator[GraphedStep]:
        """Decode until at least n tokens are made; one GraphedStep per target forward."""
        if n > self.state.capacity:
            raise ValueError(f"{n} tokens exceed this decoder's capacity ({self.state.capacity})")
        self.start(prompt, prefilled)
        if self.sampling is not None:       # the device's draws, reproducible from the seed
            torch.manual_seed(self.sampling.seed)
        if self.on_device:
            yield from self._device_steps(n)
        else:
            yield from self._host_steps(prompt, n)

    def _device_steps(self, n: int) -> Iterator[GraphedStep]:
        """Device-drafted steps in batches, each queued once the one before it has been copied
        back and its accepted counts read, so the device runs a batch while the host turns the
        last one into records. A batch is
        sized to finish the decode at the tokens per step seen so far (before any is read, at
        the most a step can make, so the first batch never runs past n); the steps a batch
        runs past n are not yielded. The first step of a batch carries the time the device
        waited for it (`idle`), so the steps' times add up to the device's wall time."""
        st, spec, P, clock = self.state, self.spec, self.state.max_path, PhaseClock(self.packed.device)
        first_draft = [clock.stamp()]
        if self.first_graph is not None:
            self.first_graph.replay()
        else:
            self.drafter.propose(spec)
        first_draft.append(clock.stamp())
        last_mark, draft_ms = first_draft[-1], None
        launched = made = read = produced = 0

        def launch() -> list | None:
            nonlocal launched
            tau = made / read if read else P
            count = min(MAX_BATCH, math.ceil((n - made) / tau), st.log.steps - 1 - launched)
            if count <= 0:
                return None
            marks = enqueue_phases(spec, count, clock)
            self.readback.enqueue(launched, count)
            launched += count
            return marks

        self.readback.discard()                           # a batch an abandoned decode left queued
        marks = launch()
        while marks is not None:
            rows = self.readback.take()
            made += sum(r[0] + 1 for r in rows["result"])
            read += len(rows["result"])
            # the next batch is queued before this one's rows become records, so the device
            # waits for the host only while this batch's results are read
            batch_marks, marks = marks, launch()
            if draft_ms is None:
                draft_ms = clock.gaps(first_draft)[0]
            gaps = clock.gaps([last_mark] + batch_marks)  # the device's wait, then each phase
            last_mark = batch_marks[-1]
            logged = LoggedSteps(**{f: rows[f] for f in LOG_FIELDS})
            times = step_times(gaps[1:])
            details = self.drafter.details(rows, len(times))
            for step in logged_steps(logged, times, draft_ms, details, spec.mode, idle_ms=gaps[0]):
                produced += step.outcome.accepted + 1
                yield step
                if produced >= n:
                    return
            draft_ms = times[-1][2]

    def _host_steps(self, prompt: list[int], n: int) -> Iterator[GraphedStep]:
        st, dev = self.state, self.packed.device
        gen = torch.Generator().manual_seed(self.sampling.seed if self.sampling else 0)
        settings = self.settings
        if self.sampling:
            settings = dataclasses.replace(settings, temperature=self.sampling.temperature)
        root, produced, index = prompt[-1], 0, 0
        while produced < n:
            t0 = time.perf_counter()
            draft = self.drafter.propose(DraftContext(root, settings, gen))
            if draft.tree.tokens[0] != root:
                raise RuntimeError("drafter returned a tree whose root is not the current token")
            spec, padded = self._spec_for(draft.tree)
            spec.load_tree(padded)
            sync(dev)
            t1 = time.perf_counter()
            spec.run("verify")
            sync(dev)
            t2 = time.perf_counter()
            host_probs = None
            if self.sampling:
                real = len(draft.tree)
                logits = spec.logits[:real]
                acc = accept_sampling(draft.tree, logits, self.sampling.temperature, self.sampling.top_p,
                                      draft.proposal, gen)
                spec.set_outcome(StepOutcome(len(acc.path) - 1, acc.path[-1], acc.bonus, acc.path))
                host_probs = target_probs(draft.tree, logits, self.sampling.temperature)
            spec.run("accept")
            logged = st.log.read(index, index + 1)
            t3 = time.perf_counter()
            step = _from_log(logged, 0, {}, draft.details, spec.mode, tree=draft.tree)
            if host_probs is not None:
                step.target_prob = host_probs
            nodes = step.outcome.path
            idx = torch.tensor(nodes, device=dev)
            self.drafter.observe(Accepted(
                tokens=[padded.tokens[i] for i in nodes],
                features=None if spec.features is None else spec.features.index_select(0, idx),
                last_hidden=spec.last_hidden.index_select(0, idx), bonus_token=step.outcome.bonus))
            t4 = time.perf_counter()
            step.times_ms = {"draft": 1e3 * ((t1 - t0) + (t4 - t3)), "verify": 1e3 * (t2 - t1),
                             "accept": 1e3 * (t3 - t2)}
            produced += step.outcome.accepted + 1
            root, index = step.outcome.bonus, index + 1
            yield step

    # -- exactness helpers ----------------------------------------------------------------------
    @torch.no_grad()
    def replay_logits(self, prompt: list[int], prefilled, steps: int) -> torch.Tensor:
        """The target's logits [N, V] at step `steps` of a device-drafted decode (replays are
        deterministic): where an output left AR's, they give the logit gap there."""
        self.start(prompt, prefilled)
        if self.first_graph is not None:
            self.first_graph.replay()
        else:
            self.drafter.propose(self.spec)
        for _ in range(steps):
            self.spec.step()
        self.spec.run("verify")
        return self.spec.logits.clone()

    def state_after(self) -> StaticState:
        """The decoded state with the pending commit folded in (the live state untouched): after
        every step run, those of a batch that ran past the decode's end included."""
        return self.state.folded_copy()


def logged_steps(logged: LoggedSteps, times: list[tuple[float, float, float]], draft_ms: float,
                 details: list[dict], mode: str, idle_ms: float | None = None) -> list[GraphedStep]:
    """The steps of a batch of step-log rows, with their phase times from `replay_phases`
    (each step's draft was timed at the end of the step before; the first one's is
    `draft_ms`, and the first one also carries `idle_ms` where given)."""
    drafts = [draft_ms] + [t[2] for t in times[:-1]]
    steps = [_from_log(logged, i, {"draft": drafts[i], "verify": t[0], "accept": t[1]}, details[i], mode)
             for i, t in enumerate(times)]
    if steps and idle_ms is not None:
        steps[0].times_ms["idle"] = idle_ms
    return steps


def _from_log(logged, i: int, times_ms: dict, details: dict, mode: str,
              tree: DraftTree | None = None) -> GraphedStep:
    """Step i of a batch of log rows; dummy nodes (token -1) dropped (they are always last)."""
    outcome = StepOutcome.unpack(logged.result[i])
    if tree is None:
        tokens, parents = logged.tokens[i], logged.parents[i]
        n = next((j for j, t in enumerate(tokens) if t < 0), len(tokens))
        logp = logged.draft_logp[i][:n]
        tree = DraftTree(tokens[:n], [-1] + parents[1:n], logprobs=logp)
    n = len(tree)
    return GraphedStep(tree, outcome, logged.choice[i][:n], logged.target_prob[i][:n], times_ms, details, mode)
