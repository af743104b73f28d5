"""One decoding API over two backends; the app, the CLI and the bench all decode through it.

    engine = Engine(target)                              # backend "auto": graphed on CUDA
    ar = engine.ar(prompt, settings)                     # the AR baseline, timed
    for record in engine.speculate(prompt, drafter, settings, draft_settings):
        ...                                              # one StepRecord per target forward

Backends:
    eager     `specla.decode`: plain PyTorch, one Python loop; the CPU path and the reference
    graphed   `specla.graphs`: CUDA graphs over static buffers; the AR baseline one graph a
              token, the speculative step three (verify, accept, draft). Block, LiLiCorr and
              EAGLE drafts (chains and trees, greedy or sampled) are drafted inside the graphs
              and accepted there; other drafters (a tree preset, the model-free one) run on the
              host between replays (`plan` says which, and why)

Both yield the same `StepRecord`s, so a trace does not depend on the backend that made it;
`elapsed_ms` is the time the step took (wall time eagerly, CUDA events when graphed).
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Iterator

import torch

from specla.accept import Acceptance
from specla.decode import (DecodeSettings, StepRecord, ar_generate, commit_info, speculative_steps)
from specla.drafters.base import DraftSettings
from specla.tree import DraftTree

BACKENDS = ("auto", "eager", "graphed")
CACHED_DECODERS = 8           # captured decoders kept per engine (one per settings bucket)


@dataclasses.dataclass
class Plan:
    """How a speculative decode will run, and why where it is not all on the device."""
    backend: str                  # eager | graphed
    drafting: str                 # device (inside the step graphs) | host (between replays) | eager
    acceptance: str               # device | host
    note: str | None = None


@dataclasses.dataclass
class ARRun:
    tokens: list[int]
    ms_per_token: float           # median over the timed runs
    runs_ms_per_token: list[float]


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "graphed" if device.type == "cuda" else "eager"
    return backend


class Engine:
    """A target and the backend that decodes it (`BACKENDS`; "auto": graphed on CUDA).

    compile_drafter: `torch.compile` the device drafters' ops and the device oracle's acceptance
    before capture (None: on CUDA);
    fused_head: LiLiCorr's head as Triton kernels where supported (None: wherever it can).
    use_graph: capture the graphed backend's bodies (None: on CUDA; False runs the same
    bodies eagerly, which is how the CPU tests check them).
    """

    def __init__(self, target, backend: str = "auto", ops: str = "auto", compile_drafter: bool | None = None,
                 fused_head: bool | None = None, use_graph: bool | None = None, recurrence: str = "kernels"):
        self.target = target
        self.device = target.device
        self.backend = resolve_backend(backend, self.device)
        self.use_graph = use_graph
        self.recurrence = recurrence
        c = target.config
        if recurrence == "kernels" and self.device.type == "cuda" and not _verify_kernels_take(c):
            # the device-grown trees then read their topology through the torch recurrence
            self.recurrence = "torch"
        self.compile_drafter = (self.device.type == "cuda") if compile_drafter is None else compile_drafter
        if self.compile_drafter:
            # every settings bucket compiles the same drafter methods for another instance:
            # dynamo's default of 8 versions a function would fall back to eager drafting
            import torch._dynamo
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 4096)
        self.fused_head = fused_head
        self.packed = None
        self.ops_note = "plain-torch reference ops"
        if self.backend == "graphed":
            from specla.graphs.runtime import PackedTarget
            self.packed = PackedTarget(target, ops)
            self.ops_note = self.packed.ops_note
            if self.recurrence != recurrence:
                self.ops_note += (f"; the recurrence in torch ops (head dims {c.head_dim} / {c.head_v_dim} are "
                                  "outside the verify kernels' powers of two from 16)")
        self._ar = None
        self._decoders: collections.OrderedDict = collections.OrderedDict()
        self.capture_ms = 0.0             # graph captures and compiles of the last decode's decoder
        self.graphs = 0                   # CUDA graphs behind the last decode
        self._failures: dict[tuple, str] = {}   # settings whose device drafter failed: drafted on the host

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    # -- AR -----------------------------------------------------------------------------------
    def ar(self, prompt: list[int], settings: DecodeSettings, eos_token_id: int | None = None,
           repeats: int = 1, prefilled=None) -> ARRun:
        """The AR baseline: `repeats` timed runs after one warm-up (graphed), median ms/token."""
        settings.validate()
        if self.backend == "eager":
            runs = [ar_generate(self.target, prompt, settings, eos_token_id) for _ in range(repeats)]
            times = [1e3 * r.seconds / max(1, len(r.tokens)) for r in runs]
            return ARRun(runs[0].tokens, statistics.median(times), times)
        ar = self._graphed_ar(settings)
        state0 = (prefilled or self.packed.prefill(prompt))[0]
        n = settings.max_new_tokens
        ar.timed_generate(state0, prompt[-1], n)                       # warm
        runs = [ar.timed_generate(state0, prompt[-1], n) for _ in range(max(1, repeats))]
        tokens = runs[0][0]
        if settings.stop_at_eos and eos_token_id in tokens:
            tokens = tokens[:tokens.index(eos_token_id) + 1]
        times = [ms / n for _, ms in runs]
        return ARRun(tokens, statistics.median(times), times)

    def _graphed_ar(self, settings: DecodeSettings):
        from specla.graphs.ar import GraphedAR

        need = settings.max_new_tokens + 64
        if (self._ar is None or self._ar.out.numel() < need or self._ar.temperature != settings.temperature):
            self._ar = GraphedAR(self.packed, max_len=max(need, 1024), use_graph=self.use_graph,
                                 temperature=settings.temperature)
        return self._ar

    @torch.no_grad()
    def divergence(self, prompt: list[int], tokens: list[int], position: int, ar_token: int) -> dict:
        """Where an output left AR's (same prefix, another token at `position`): the target's
        logits there as the AR step computes them, so a near-tie shows as a tiny gap."""
        forced = tokens[:position]
        if self.backend == "graphed":
            ar = self._graphed_ar(DecodeSettings(max_new_tokens=max(1, position + 1)))
            row = ar.logits_along(self.packed.prefill(prompt)[0], prompt[-1], forced)[-1].float()
        else:
            from specla.decode import replay_state
            from specla.model import Topology, commit
            state = replay_state(self.target, prompt[:-1])
            topo = Topology.chain(1, self.target.config.conv_size, self.device)
            for token in [prompt[-1]] + forced:
                out = self.target(torch.tensor([[token]], device=self.device), state, topo, mode="chain")
                commit(state, out.factors, [0])
            row = out.logits[0, 0].float()
        top2 = row.topk(2).values
        gap = float(row[ar_token] - row[tokens[position]])
        # measured over the output's first tokens (`noise` takes up to 16), not only those before
        # the divergence: one or two forced tokens can show no rounding difference at all
        noise = self.noise(prompt, tokens)
        # each of the two logits moves by at most `noise` between the two paths: a flip needs
        # gap <= 2 x noise (the rule the bench's oracle rows use too)
        return {"position": position, "token": tokens[position], "ar_token": ar_token,
                "logit_gap": round(gap, 6), "top2_gap": round(float(top2[0] - top2[1]), 6),
                "noise": round(noise, 6), "near_tie": gap <= 2 * noise}

    @torch.no_grad()
    def noise(self, prompt: list[int], tokens: list[int], n: int = 16) -> float:
        """The largest logit difference between a speculative forward and AR steps over the same
        tokens (0 eagerly: the very same operations)."""
        if self.backend == "eager" or not tokens:
            return 0.0
        from specla.graphs.spec import spec_vs_ar_noise

        ar = self._graphed_ar(DecodeSettings(max_new_tokens=n + 1))
        state0 = self.packed.prefill(prompt)[0]
        return spec_vs_ar_noise(self.packed, ar, state0, prompt[-1], tokens[:n], n, self.recurrence)

    # -- speculation -----------------------------------------------------------------------
    def verification_note(self) -> str | None:
        """How the last graphed decode verified its drafts (one persistent launch or per-op
        launches, and why); None before the first."""
        if not self._decoders:
            return None
        dec = next(reversed(self._decoders.values()))
        if isinstance(dec, dict):
            spec = dec["spec"]
        else:
            spec = dec.spec if dec.on_device else next(reversed(dec.specs.values()), None)
        return getattr(spec, "verify_note", None)

    def drafting_note(self) -> str | None:
        """How the last graphed decode's device drafter drafts (one persistent launch or torch
        ops, and why); None before the first or where the drafter has no such choice."""
        if not self._decoders:
            return None
        dec = next(reversed(self._decoders.values()))
        drafter = None if isinstance(dec, dict) or not dec.on_device else dec.drafter
        return getattr(drafter, "draft_note", None)

    def plan(self, drafter, settings: DecodeSettings, draft_settings: DraftSettings) -> Plan:
        """Where each part of a step will run for these settings (without building anything)."""
        if self.backend == "eager":
            return Plan("eager", "eager", "eager")
        from specla.graphs.drafters import device_drafter_for

        why = _device_blocker(drafter, settings, draft_settings) or self._failures.get(
            self._key(drafter, settings, draft_settings))
        if why is None:
            dev, why = device_drafter_for(drafter, _draft_settings(settings, draft_settings), compile=False,
                                          fused_head=False, check_only=True)
        if why is None:
            return Plan("graphed", "device", "device")
        acceptance = "host" if settings.temperature > 0 else "device"
        what = "drafting runs on the host between graph replays"
        if acceptance == "host":
            what += "; rejection sampling runs on the host"
        return Plan("graphed", "host", acceptance, f"{what}: {why}")

    def speculate(self, prompt: list[int], drafter, settings: DecodeSettings, draft_settings: DraftSettings,
                  eos_token_id: int | None = None) -> Iterator[StepRecord]:
        """Decode `prompt` speculatively; one StepRecord per target forward (the first call
        also captures the graphs for these settings: `capture_ms` tells how long)."""
        settings.validate()
        if self.backend == "eager":
            yield from self._eager(prompt, drafter, settings, draft_settings, eos_token_id)
            return
        yield from self._graphed(prompt, drafter, settings, draft_settings, eos_token_id)

    def _eager(self, prompt, drafter, settings, draft_settings, eos) -> Iterator[StepRecord]:
        steps = speculative_steps(self.target, drafter, prompt, settings, draft_settings, eos)
        while True:
            start = time.perf_counter()
            record = next(steps, None)
            if record is None:
                return
            # the first record also prefilled: count only its measured phases
            wall = 1e3 * (time.perf_counter() - start)
            record.elapsed_ms = wall if record.index else sum(record.times_ms.values())
            yield record

    def decoder(self, drafter, settings: DecodeSettings, draft_settings: DraftSettings):
        """The captured decoder for these settings (built and captured on first use)."""
        from specla.graphs.decoders import GraphedDecoder, Sampling
        from specla.graphs.drafters import device_drafter_for

        ds = _draft_settings(settings, draft_settings)
        capacity = _capacity(settings.max_new_tokens)
        plan = self.plan(drafter, settings, draft_settings)
        key = (plan.drafting,) + self._key(drafter, settings, draft_settings)
        dec = self._decoders.get(key)
        start = time.perf_counter()
        if dec is None:
            sampling = (Sampling(settings.temperature, settings.top_p, settings.seed)
                        if settings.temperature > 0 else None)
            if plan.drafting == "device":
                try:
                    dev, _ = device_drafter_for(drafter, ds, compile=self.compile_drafter,
                                                fused_head=self.fused_head, device=self.device)
                    dec = GraphedDecoder(self.packed, dev, ds, capacity, settings.deferred, settings.mode,
                                         self.use_graph, self.recurrence, sampling=sampling)
                except Exception as err:  # noqa: BLE001 - a draft that does not capture still runs
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    self._failures[key[1:]] = f"the device drafter did not build or capture ({type(err).__name__}: {err})"
                    return self.decoder(drafter, settings, draft_settings)
            else:
                dec = GraphedDecoder(self.packed, drafter, ds, capacity, settings.deferred, settings.mode,
                                     self.use_graph, self.recurrence, sampling=sampling,
                                     max_drafted=max(ds.budget, _preset_size(drafter)))
            self._decoders[key] = dec
            self._evict()
        self._decoders.move_to_end(key)
        self.graphs = dec.graphs
        if not dec.on_device:
            dec.drafter = drafter                 # a host drafter's per-run copy
        if dec.sampling is not None:              # the same graphs, this run's seed
            dec.sampling = Sampling(settings.temperature, settings.top_p, settings.seed)
        dec.plan = plan
        self.capture_ms = 1e3 * (time.perf_counter() - start)
        return dec

    @staticmethod
    def _key(drafter, settings: DecodeSettings, draft_settings: DraftSettings) -> tuple:
        """What a captured decoder depends on besides where it drafts."""
        net = getattr(getattr(drafter, "inner", drafter), "net", None)
        if net is not None:
            ident = id(net)
        else:   # a model-free drafter: the app's per-run copy of it must not capture again
            ident = drafter.settings_key() if hasattr(drafter, "settings_key") else id(drafter)
        return (type(drafter).__name__, ident,
                dataclasses.astuple(_draft_settings(settings, draft_settings)), settings.mode, settings.deferred,
                _capacity(settings.max_new_tokens), settings.temperature, settings.top_p,
                tuple(map(tuple, getattr(drafter, "paths", None) or ())))

    def _graphed(self, prompt, drafter, settings, draft_settings, eos) -> Iterator[StepRecord]:
        from specla.drafters.oracle import OracleDrafter

        if isinstance(drafter, OracleDrafter) and drafter.shape != "random" and settings.temperature == 0:
            yield from self._records(self._oracle_steps(prompt, drafter, settings, draft_settings), settings, eos)
            return
        dec = self.decoder(drafter, settings, draft_settings)
        before = dec.capture_ms
        yield from self._records(dec.steps(prompt, settings.max_new_tokens), settings, eos)
        # captures inside the decode (a host drafter's new bucket) are reported, never timed
        self.capture_ms += dec.capture_ms - before

    def _records(self, steps, settings: DecodeSettings, eos) -> Iterator[StepRecord]:
        """StepRecords from the graphed backend's steps, cut at max_new_tokens and eos."""
        c = self.target.config
        produced, pending, n = 0, 0, settings.max_new_tokens
        for index, step in enumerate(steps):
            tree, out = step.tree, step.outcome
            acc = Acceptance(out.path, [tree.tokens[i] for i in out.path[1:]], out.bonus, step.choice)
            new_tokens = (acc.tokens + [acc.bonus])[:n - produced]
            if settings.stop_at_eos and eos is not None and eos in new_tokens:
                new_tokens = new_tokens[:new_tokens.index(eos) + 1]
            record = StepRecord(
                index=index, tree=tree, acceptance=acc, mode=step.mode,
                draft_probs=_probs(tree), target_probs=step.target_prob,
                commit=commit_info(c, self.dtype, len(tree), len(out.path), pending, settings.deferred),
                times_ms=step.times_ms, details=step.details, new_tokens=new_tokens)
            record.elapsed_ms = sum(step.times_ms.values())
            record.backend = "graphed"
            pending = len(out.path) if settings.deferred else 0
            produced += len(new_tokens)
            yield record
            if produced >= n or (settings.stop_at_eos and eos in new_tokens):
                break

    def _oracle_steps(self, prompt, oracle, settings: DecodeSettings, draft_settings: DraftSettings):
        """The oracle drafter on the device (`DeviceOracle`): drafting AR's continuation at
        acceptance alpha, realigned wherever the target leaves it (a bf16 near-tie), first
        calibrated step by step, then replayed and timed with events per phase (the bench's
        oracle rows, step by step)."""
        from specla.graphs.decoders import logged_steps
        from specla.graphs.oracle import oracle_calibrate
        from specla.graphs.runtime import PhaseClock
        from specla.graphs.spec import replay_phases

        n = settings.max_new_tokens
        run = self._oracle_decoder(oracle, settings, draft_settings)
        spec, ar, st = run["spec"], run["ar"], run["spec"].state
        state0, root = self.packed.prefill(prompt)[0], prompt[-1]
        cont = ar.timed_generate(state0, root, min(run["capacity"], ar.out.numel()))[0]
        spec.oracle.set_continuation(cont)
        spec.oracle.set_alpha(oracle.alpha)
        steps = oracle_calibrate(spec, ar, state0, root, n).steps
        st.reset(state0, root)
        clock = PhaseClock(self.device)
        spec.draft()
        clock.mark()
        draft_ms = clock.read()[0]
        times = replay_phases(spec, steps, clock)
        yield from logged_steps(st.log.read(0, steps), times, draft_ms, [{"drafter": "oracle"}] * steps, spec.mode)

    def _oracle_decoder(self, oracle, settings: DecodeSettings, draft_settings: DraftSettings) -> dict:
        """The captured oracle step for these settings: a chain of `budget` drafts, or levels
        of `top_k` siblings (the true token first) up to `budget` nodes."""
        from specla.graphs.ar import GraphedAR
        from specla.graphs.buckets import comb_tree
        from specla.graphs.oracle import DeviceOracle
        from specla.graphs.spec import GraphedSpec, SpecState

        ds = draft_settings
        tree = (DraftTree.chain([0] * (ds.budget + 1)) if oracle.shape == "chain"
                else comb_tree(max(2, ds.top_k), ds.budget))
        capacity = _capacity(settings.max_new_tokens)
        key = ("oracle", tuple(tree.parents), settings.deferred, settings.mode, capacity)
        run = self._decoders.get(key)
        if run is None:
            P = tree.depth + 1
            start = time.perf_counter()
            state = SpecState(self.packed, max_path=P, capacity=capacity + 2 * P + 8, max_nodes=len(tree))
            device_oracle = DeviceOracle([], self.target.config.vocab_size, oracle.alpha,
                                         max_steps=capacity + 2 * P + 9, max_nodes=len(tree),
                                         capacity=capacity + 4 * P + 16, device=self.device, seed=0)
            spec = GraphedSpec(self.packed, state, tree, mode=settings.mode, deferred=settings.deferred,
                               oracle=device_oracle, use_graph=self.use_graph, recurrence=self.recurrence,
                               compile=self.compile_drafter)
            ar = GraphedAR(self.packed, max_len=capacity + 4 * P + 16, use_graph=self.use_graph)
            run = self._decoders[key] = {"spec": spec, "ar": ar, "capacity": capacity + 2 * P + 8}
            self._evict()
            self.capture_ms = 1e3 * (time.perf_counter() - start)
        self._decoders.move_to_end(key)
        self.graphs = len(run["spec"].graphs) + (1 if run["ar"].graph is not None else 0)
        return run

    def _evict(self) -> None:
        while len(self._decoders) > CACHED_DECODERS:
            self._decoders.popitem(last=False)


def _device_blocker(drafter, settings: DecodeSettings, draft_settings: DraftSettings) -> str | None:
    """Why these settings cannot draft on the device (None: they can)."""
    tree = draft_settings.tree != "chain" or getattr(drafter, "paths", None)
    if settings.mode not in ("auto", "chain", "tree") and tree:
        return f"verification mode {settings.mode!r} (a device-grown tree is verified in tree mode)"
    return None


def _draft_settings(settings: DecodeSettings, draft_settings: DraftSettings) -> DraftSettings:
    return dataclasses.replace(draft_settings, temperature=settings.temperature)


def _capacity(n: int) -> int:
    """Tokens a decoder is built for: powers of two from 256, so a few sizes share graphs."""
    size = 256
    while size < n + 8:
        size *= 2
    return size


def _preset_size(drafter) -> int:
    paths = getattr(drafter, "paths", None)
    return len(paths) if paths else 0


def _probs(tree: DraftTree) -> list[float]:
    if tree.logprobs is None:
        return [1.0] * len(tree)
    return torch.tensor(tree.logprobs).exp().tolist()


def _verify_kernels_take(config) -> bool:
    from kernels import triton_verify
    return triton_verify.supports(config.head_dim, config.head_v_dim)
