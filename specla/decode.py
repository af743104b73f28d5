"""The decoding loop: draft -> tree -> verify -> accept -> commit -> trace record.

`speculative_steps` is a generator of step records, so the explorer can stream a run and a
CLI can simply drain it. `ar_generate` is the baseline: the same runtime with a one-token
step (a one-node "tree"), so a speedup compares like with like. This is the engine's eager
backend (`specla.engine`): the CPU path, and the reference the CUDA-graph backend
(`specla.graphs`) is tested against.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import torch

from specla.accept import Acceptance, accept_greedy, accept_sampling, sample, target_distribution
from specla.drafters.base import Accepted, DraftContext, Drafter, DraftSettings
from specla.model import GDNForCausalLM, InferenceState, Topology, commit, flush
from specla.tree import DraftTree

MAX_NEW_TOKENS = 4096


@dataclasses.dataclass
class DecodeSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    mode: str = "auto"           # verification: auto | chain | tree | hybrid
    deferred: bool = True        # fold the commit into the next verification
    seed: int = 0
    stop_at_eos: bool = False

    def validate(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class StepRecord:
    index: int
    tree: DraftTree
    acceptance: Acceptance
    mode: str
    draft_probs: list[float]     # drafter's probability of each node given its parent
    target_probs: list[float]    # target's probability of each node's token at its parent
    commit: dict
    times_ms: dict
    details: dict
    new_tokens: list[int]        # accepted drafts + bonus, cut at max_new_tokens / eos
    elapsed_ms: float = 0.0      # the time the step took (the engine fills it)
    backend: str = "eager"       # eager | graphed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Wall-clock phases of a step; synchronises the GPU so the phases are real."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, {}

    def __call__(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                _sync(timer.device)
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                _sync(timer.device)
                timer.times[name] = timer.times.get(name, 0.0) + 1e3 * (time.perf_counter() - self.start)

        return _Phase()


def check_prompt(tokens: list[int], vocab_size: int, max_len: int) -> None:
    if not tokens:
        raise ValueError("the prompt is empty: type at least one character")
    if len(tokens) > max_len:
        raise ValueError(f"the prompt is {len(tokens)} tokens long; the limit is {max_len}")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise ValueError("the prompt has token ids outside the model's vocabulary")


@torch.inference_mode()
def prefill(target: GDNForCausalLM, tokens: list[int], feature_layers: tuple[int, ...] = (),
            chunk: int = 64) -> tuple[InferenceState, torch.Tensor | None, torch.Tensor]:
    """Feed all but the last prompt token; return the state and their features.

    The last prompt token becomes the first root, so every step (AR or speculative) starts
    by feeding one not-yet-seen token.
    """
    state = target.new_state()
    feats, hiddens = [], []
    body = tokens[:-1]
    for start in range(0, len(body), chunk):
        piece = torch.tensor([body[start:start + chunk]], device=target.device)
        out = target(piece, state, Topology.chain(piece.shape[1], target.config.conv_size, target.device),
                     mode="tree", feature_layers=feature_layers)
        commit(state, out.factors, list(range(piece.shape[1])))
        hiddens.append(out.last_hidden[0])
        if out.features is not None:
            feats.append(out.features[0])
    D = target.config.hidden_size
    hidden = torch.cat(hiddens) if hiddens else torch.zeros(0, D, device=target.device)
    features = torch.cat(feats) if feats else None
    return state, features, hidden


def commit_info(config, dtype: torch.dtype, nodes: int, path_len: int, pending_before: int,
                deferred: bool) -> dict:
    """What a step's commit wrote: tokens folded now or in the next verification, bytes of
    factors (k, delta, g fp32 per head, the conv inputs) against dense per-node snapshots."""
    c = config
    per_token_layer = 4 * c.num_heads * (c.head_dim + c.head_v_dim + 1) + c.conv_channels * dtype.itemsize
    dense_per_node = c.state_bytes() // c.num_hidden_layers + c.conv_channels * (c.conv_size - 1) * 4
    return {
        "deferred": deferred,
        "accepted_tokens": path_len,
        "folded_now": 0 if deferred else pending_before + path_len,
        "folded_in_verify": pending_before,
        "pending_after": path_len if deferred else 0,
        "factor_bytes": path_len * per_token_layer * c.num_hidden_layers,
        "factor_bytes_all_nodes": nodes * per_token_layer * c.num_hidden_layers,
        "dense_snapshot_bytes": nodes * dense_per_node * c.num_hidden_layers,
        "layers": c.num_hidden_layers,
    }


@torch.inference_mode()
def speculative_steps(target: GDNForCausalLM, drafter: Drafter, prompt: list[int],
                      settings: DecodeSettings, draft_settings: DraftSettings,
                      eos_token_id: int | None = None,
                      state_out: list | None = None) -> Iterator[StepRecord]:
    """Decode `prompt` speculatively; yield one record per target forward.

    If `state_out` is a list, the final state (deferred commit flushed) is appended to it,
    so tests can compare it with a replay.
    """
    settings.validate()
    draft_settings.validate(target.config.vocab_size)
    draft_settings.temperature = settings.temperature
    device = target.device
    generator = torch.Generator().manual_seed(settings.seed)
    state, features, hidden = prefill(target, prompt, drafter.feature_layers)
    drafter.reset(prompt, features, hidden)
    root, produced, index = prompt[-1], 0, 0
    while produced < settings.max_new_tokens:
        timer = Timer(device)
        with timer("draft"):
            draft = drafter.propose(DraftContext(root, draft_settings, generator))
        tree = draft.tree
        if tree.tokens[0] != root:
            raise RuntimeError("drafter returned a tree whose root is not the current token")
        topo = target.topology(tree)
        from specla.verify import resolve_mode
        mode = resolve_mode(settings.mode, topo, torch.device(device).type)
        pending_before = 0 if state.pending is None else state.pending.num_tokens
        with timer("verify"):
            tokens = torch.tensor([tree.tokens], device=device)
            out = target(tokens, state, topo, mode=mode, feature_layers=drafter.feature_layers)
        with timer("accept"):
            logits = out.logits[0]
            if settings.temperature == 0:
                acc = accept_greedy(tree, logits)
            else:
                acc = accept_sampling(tree, logits, settings.temperature, settings.top_p,
                                      draft.proposal, generator)
        with timer("commit"):
            commit(state, out.factors, acc.path, deferred=settings.deferred)
        path = torch.tensor(acc.path, device=device)
        drafter.observe(Accepted(
            tokens=[tree.tokens[n] for n in acc.path],
            features=None if out.features is None else out.features[0, path],
            last_hidden=out.last_hidden[0, path], bonus_token=acc.bonus))
        new_tokens = (acc.tokens + [acc.bonus])[:settings.max_new_tokens - produced]
        if settings.stop_at_eos and eos_token_id is not None and eos_token_id in new_tokens:
            new_tokens = new_tokens[:new_tokens.index(eos_token_id) + 1]
        record = StepRecord(
            index=index, tree=tree, acceptance=acc, mode=mode,
            draft_probs=_draft_probs(tree),
            target_probs=target_probs(tree, logits, settings.temperature),
            commit=commit_info(target.config, out.factors.conv_in.dtype, len(tree), len(acc.path),
                               pending_before, settings.deferred),
            times_ms=timer.times, details=draft.details, new_tokens=new_tokens)
        produced += len(new_tokens)
        index += 1
        root = acc.bonus
        yield record
        if settings.stop_at_eos and eos_token_id in new_tokens:
            break
    flush(state)
    if state_out is not None:
        state_out.append(state)


def _draft_probs(tree: DraftTree) -> list[float]:
    if tree.logprobs is None:
        return [1.0] * len(tree)
    return torch.tensor(tree.logprobs).exp().tolist()   # one op, not one per node


def target_probs(tree: DraftTree, logits: torch.Tensor, temperature: float) -> list[float]:
    """The target's probability of each node's token at its parent (the root: 1), at the
    sampling temperature (1 when greedy)."""
    temperature = temperature if temperature > 0 else 1.0
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    parents = torch.tensor([max(p, 0) for p in tree.parents], device=logits.device)
    tokens = torch.tensor(tree.tokens, device=logits.device)
    out = probs[parents, tokens].tolist()
    out[0] = 1.0
    return out


@dataclasses.dataclass
class ARResult:
    tokens: list[int]
    seconds: float
    state: InferenceState


@torch.inference_mode()
def ar_generate(target: GDNForCausalLM, prompt: list[int], settings: DecodeSettings,
                eos_token_id: int | None = None) -> ARResult:
    """The baseline: one token per target forward, same runtime, same sampling rule."""
    settings.validate()
    device = target.device
    generator = torch.Generator().manual_seed(settings.seed)
    state, _, _ = prefill(target, prompt)
    topo = Topology.chain(1, target.config.conv_size, device)
    root, out_tokens = prompt[-1], []
    _sync(device)
    start = time.perf_counter()
    while len(out_tokens) < settings.max_new_tokens:
        out = target(torch.tensor([[root]], device=device), state, topo, mode="chain")
        commit(state, out.factors, [0])
        logits = out.logits[0, 0]
        if settings.temperature == 0:
            root = int(logits.argmax())
        else:
            root = sample(target_distribution(logits, settings.temperature, settings.top_p).cpu(), generator)
        out_tokens.append(root)
        if settings.stop_at_eos and root == eos_token_id:
            break
    _sync(device)
    return ARResult(out_tokens, time.perf_counter() - start, state)


def replay_state(target: GDNForCausalLM, tokens: list[int]) -> InferenceState:
    """The state after feeding `tokens` one at a time (the reference a commit must match)."""
    state = target.new_state()
    topo = Topology.chain(1, target.config.conv_size, target.device)
    with torch.inference_mode():
        for token in tokens:
            out = target(torch.tensor([[token]], device=target.device), state, topo, mode="chain")
            commit(state, out.factors, [0])
    return state
