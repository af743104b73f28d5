"""The AR baseline as one CUDA graph per token."""
from __future__ import annotations

import torch

from specla.graphs.runtime import PackedTarget, StaticState, Stopwatch, capture, sync
from specla.model import GDNForCausalLM, InferenceState


class GraphedAR:
    """The AR baseline: one target token per graph replay, no host sync until the end."""

    @torch.no_grad()
    def __init__(self, target_or_runtime: GDNForCausalLM | PackedTarget, max_len: int = 4096,
                 ops: str = "auto", use_graph: bool | None = None, temperature: float = 0.0):
        rt = target_or_runtime if isinstance(target_or_runtime, PackedTarget) else PackedTarget(target_or_runtime, ops)
        self.rt, dev = rt, rt.device
        self.state = StaticState(rt.config, dev, rt.dtype)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(max_len, dtype=torch.long, device=dev)
        self.count = torch.zeros(1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(1, rt.config.vocab_size, device=dev)
        self.temperature = temperature
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        self.graph = capture(self._step) if self.use_graph else None
        self.reset()

    def _step(self) -> None:
        if self.rt.whole_step is not None:
            # one launch: the forward and, greedy, the argmax into token, out and count
            greedy = (self.token, self.out, self.count) if self.temperature == 0 else None
            self.rt.whole_step(self.token, self.state.conv, self.state.recurrent, self.logits.view(-1), greedy)
            if greedy is None:
                self._take(self.logits)
            return
        logits = self.rt.ar_forward(self.token, self.state)
        self._take(logits)
        self.logits.copy_(logits)

    def _take(self, logits: torch.Tensor) -> None:
        """The next token from logits [1, vocab] fp32 into token, out[count]; count += 1."""
        if self.temperature > 0:
            # Gumbel-max sampling without a host sync: argmax(p / Exp(1)) ~ Categorical(p)
            probs = torch.softmax(logits / self.temperature, dim=-1)
            logits = probs / torch.empty_like(probs).exponential_()
        self.rt.ops.greedy_take(logits, self.token, self.out, self.count)

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()

    @torch.no_grad()
    def reset(self, state: StaticState | InferenceState | None = None, root: int = 0) -> None:
        """Load a state (zeros if None) and the next token to feed; clear the token buffer."""
        if state is None:
            self.state.recurrent.zero_(), self.state.conv.zero_()
        else:
            self.state.copy_(state)
        self.token.fill_(root)
        self.count.zero_()

    @torch.no_grad()
    def prefill(self, prompt: list[int], record_last: int = 0) -> torch.Tensor | None:
        """Teacher-forced replays of all but the last prompt token; the last one is left in the
        token buffer. Returns the logits after each of the last `record_last` fed tokens."""
        dev = self.rt.device
        self.reset()
        body = torch.tensor(prompt[:-1], dtype=torch.long, device=dev).view(-1, 1, 1)
        kept = []
        for i in range(body.shape[0]):
            self.token.copy_(body[i])
            self.replay()
            if i >= body.shape[0] - record_last:
                kept.append(self.logits.clone())
        self.token.fill_(prompt[-1])
        self.count.zero_()
        return torch.cat(kept) if kept else None

    @torch.no_grad()
    def generate(self, prompt_tokens: list[int], n: int) -> list[int]:
        """Greedy (or sampled) continuation of a prompt: prefill, then `decode(n)`."""
        self.prefill(prompt_tokens)
        return self.decode(n)

    @torch.no_grad()
    def decode(self, n: int) -> list[int]:
        """n tokens from the current state and token buffer; one host sync, at the end."""
        if n > self.out.numel():
            raise ValueError(f"{n} tokens exceed the buffer ({self.out.numel()})")
        self.count.zero_()
        for _ in range(n):
            self.replay()
        return self._read(n)

    def _read(self, n: int) -> list[int]:
        """The first n tokens of the output buffer, refused if the persistent step's grid
        barrier gave up (its programs could not all be resident: the tokens are wrong)."""
        tokens = self.out[:n].tolist()
        if self.rt.whole_step is not None and self.rt.whole_step.failed():
            raise RuntimeError("the persistent AR step timed out at a grid barrier (other work held the "
                               "GPU's SMs), so its tokens were not kept")
        return tokens

    @torch.no_grad()
    def continue_after(self, state: StaticState, root: int, forced: list[int], n: int) -> list[int]:
        """The n greedy tokens after root + forced, fed from `state` (teacher-forced replays)."""
        self.reset(state, root)
        for token in forced:
            self.replay()
            self.token.fill_(token)
        return self.decode(n)

    @torch.no_grad()
    def timed_generate(self, state: StaticState, root: int, n: int) -> tuple[list[int], float]:
        """(tokens, milliseconds) of n steps from `state`; the load is outside the timing."""
        self.reset(state, root)
        sync(self.rt.device)
        with Stopwatch(self.rt.device) as sw:
            for _ in range(n):
                self.replay()
        return self._read(n), sw.ms

    @torch.no_grad()
    def logits_along(self, state: StaticState, root: int, tokens: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(tokens)+1, V]: after feeding root, then each of tokens."""
        self.reset(state, root)
        rows = []
        forced = torch.tensor(tokens, dtype=torch.long, device=self.rt.device).view(-1, 1, 1)
        for i in range(len(tokens) + 1):
            self.replay()
            rows.append(self.logits.clone())
            if i < len(tokens):
                self.token.copy_(forced[i])
        return torch.cat(rows)
