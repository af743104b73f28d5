"""Device-resident chain drafting: the block / LiLiCorr drafter inside the speculative graph.

On a small target the host drafter, run eagerly between graph replays, costs far more than
the verification it feeds (the embedded 13M pair on an H200: 5-35 ms of drafting against a
0.185 ms graphed AR step). `DeviceChainDrafter` does the whole draft with tensor ops of
static shape, so `GraphedSpec` captures draft + verify + accept as ONE graph, as it already
does for the device oracle:

    observe   fuse the target features of the accepted path (all max_path rows of
              `spec.features`, selected by `spec.result`'s path) and their per-layer raw
              keys/values; the new window is rows a+1 .. a+W of [old W rows, new P rows],
              an index_select with a device index (no host sync, no data-dependent shape)
    propose   the block pass over the W-row window with a validity mask, then the chain:
              top-1 of every slot (block), or the LiLiCorr lattice + head + greedy walk
              (on CUDA top-k, head and walk are two Triton kernels, `kernels/triton_lilicorr.py`,
              instead of ~100 torch ops); the tokens go into `spec.tokens[0, 1:]`

The window holds n <= W valid rows right-aligned (invalid rows first). `BlockNet.forward`
places W context rows at relative positions 0..W-1, so the valid ones sit at W-n..W-1,
exactly where the host drafter, which holds only its n rows, puts them; the mask hides the
rest. The math is the host drafter's own (`net.fuse`, `raw_keys`, `net(...)`, `lattice`,
`greedy_walk`), so a chain equals `propose` for chain settings given the same accepted
history, up to float rounding of batched vs unbatched products.

`DeviceDraftDecoder` runs it: prefill, reset, a captured first draft, then step replays with
a read of the produced-token counter only every few steps (a step makes at most max_path
tokens, so replaying (n - pos) // max_path steps between reads never overshoots n). With
`use_graph=False` (the CPU) the same bodies run eagerly.
"""
from __future__ import annotations

import time

import torch

from specla.graphs.decoders import DraftRun
from specla.graphs.runtime import PackedTarget, capture, sync
from specla.graphs.spec import GraphedSpec, SpecState, phase_times
from specla.drafters.base import DraftSettings
from specla.drafters.block import BlockDrafter
from specla.drafters.lilicorr import LiLiCorrDrafter, greedy_walk, lattice
from specla.tree import DraftTree


class DeviceChainDrafter:
    """A loaded `BlockDrafter` / `LiLiCorrDrafter` drafting chains from static device buffers.

    block_size: slots of the block pass (root included; default the trained size); the
    LiLiCorr lattice spans all of them. budget: drafted chain length (default all slots).
    top_k: LiLiCorr lattice width; None or 1, or a drafter without a head, gives the block
    drafter's top-1 chain. fused_head: run the LiLiCorr head and walk as Triton kernels
    (None: wherever `kernels.triton_lilicorr.unsupported` allows, i.e. on CUDA for a
    supported head shape; True: the same, or an error saying why not; False: torch ops).
    """

    def __init__(self, drafter: BlockDrafter, block_size: int | None = None, top_k: int | None = None,
                 budget: int | None = None, compile: bool = False, fused_head: bool | None = None):
        net, c = drafter.net, drafter.net.config
        self.net, self.parts, self.feature_layers = net, drafter.parts, tuple(drafter.feature_layers)
        block_size = block_size or c.block_size
        if not 2 <= block_size <= c.block_size:
            raise ValueError(f"block size {block_size}: this drafter predicts 2..{c.block_size} tokens")
        self.slots = block_size - 1                          # slots of the block pass / lattice
        self.length = min(budget or self.slots, self.slots)  # drafted tokens per step
        lilicorr = isinstance(drafter, LiLiCorrDrafter) and net.head is not None
        self.top_k = top_k if lilicorr and top_k is not None and top_k > 1 else None
        if self.top_k is not None and self.top_k > net.head.config.max_k:
            raise ValueError(f"this LiLiCorr head takes at most {net.head.config.max_k} candidates "
                             f"per slot; top-k {self.top_k} was asked")
        self.kind = "lilicorr" if self.top_k is not None else "block"
        w = net.fc.weight
        W, dev = c.window, w.device
        self.window = W
        self.ctx = torch.zeros(W, c.width, device=dev, dtype=w.dtype)       # fused rows, oldest first
        self.valid = torch.zeros(W, dtype=torch.bool, device=dev)          # invalid rows at the front
        heads, hd = c.heads, c.width // c.heads
        self.kv = [(torch.zeros(W, heads, hd, device=dev, dtype=w.dtype),
                    torch.zeros(W, heads, hd, device=dev, dtype=w.dtype)) for _ in net.layers]
        self.arange_w = torch.arange(W, device=dev)
        self.fused_head = self._fused_head(fused_head, dev) if self.top_k is not None else None
        # Inside a CUDA graph every kernel still costs ~2 us, and a draft is a few hundred small
        # ones: torch.compile fuses them (compiled on the first, uncaptured call; the graph then
        # replays the generated kernels). Same math; fused kernels may round differently. With
        # the fused head, only the block pass is compiled (the head is one kernel already).
        self.compiled = compile
        self._observe_rows = torch.compile(self._observe_rows, dynamic=False) if compile else self._observe_rows
        self._slot_logits = self.slot_logits
        self._chain = self.chain_tokens
        if compile and self.fused_head is None:
            self._chain = torch.compile(self.chain_tokens, dynamic=False)
        elif compile:
            self._slot_logits = torch.compile(self.slot_logits, dynamic=False)

    def _fused_head(self, wanted: bool | None, device: torch.device):
        """The head as one Triton kernel, or None for the torch ops (see `fused_head`)."""
        if wanted is False:
            return None
        why = None
        if device.type != "cuda":
            why = "it needs a CUDA device"
        else:
            try:
                from kernels.triton_lilicorr import unsupported
            except ImportError as err:
                why = f"Triton is not importable ({err})"
            else:
                why = unsupported(self.net.head, self.slots, self.top_k)
        if why is None:
            from kernels.triton_lilicorr import FusedLiLiCorrHead
            return FusedLiLiCorrHead(self.net.head, self.slots, self.top_k, self.parts.embed_weight)
        if wanted:
            raise ValueError(f"the fused LiLiCorr head cannot run here: {why}")
        return None

    @classmethod
    def from_settings(cls, drafter: BlockDrafter, settings: DraftSettings, compile: bool = False,
                      fused_head: bool | None = None) -> "DeviceChainDrafter":
        """The device twin of `drafter.propose` for these (greedy chain) settings."""
        settings.validate(drafter.parts.vocab_size)
        if settings.tree != "chain" or settings.temperature > 0 or settings.prune_tau is not None:
            raise ValueError("the device drafter drafts greedy chains only (tree='chain', "
                             "temperature 0, no pruning)")
        return cls(drafter, settings.block_size, settings.top_k, settings.budget, compile, fused_head)

    def tree(self) -> DraftTree:
        """The topology of every step's draft (root + `length` drafted slots)."""
        return DraftTree.chain([0] * (self.length + 1))

    def buffers(self) -> list[torch.Tensor]:
        return [self.ctx, self.valid] + [t for kv in self.kv for t in kv]

    # -- context ----------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, features: torch.Tensor | None, spec: GraphedSpec | None = None) -> None:
        """Fill the window from the prompt's target features [T, n_layers, D] (what
        `Runtime.prefill` returns; None or empty for a one-token prompt). With `spec`, also
        draft the first chain into its token buffer (eagerly)."""
        for t in self.buffers():
            t.zero_()
        if features is not None and features.shape[0]:
            if features.shape[-2] != len(self.feature_layers):
                raise ValueError(f"expected features of {len(self.feature_layers)} layers, got "
                                 f"{features.shape[-2]}")
            rows = self.net.fuse(features[-self.window:].to(self.ctx.device))
            n = rows.shape[0]
            self.ctx[-n:] = rows
            self.valid[-n:] = True
            for (k, v), layer in zip(self.kv, self.net.layers):
                nk, nv = layer.attn.raw_keys(rows)
                k[-n:], v[-n:] = nk, nv
        if spec is not None:
            self.propose(spec)

    @torch.no_grad()
    def observe(self, spec: GraphedSpec) -> None:
        """Append the rows of the path `spec` just accepted (root included, a+1 rows) to the
        window, with static shapes: all P path rows are fused, the index picks the right ones."""
        self._observe_rows(spec.result, spec.features)

    def _observe_rows(self, result: torch.Tensor, features: torch.Tensor) -> None:
        a, path = result[:1], result[3:]
        rows = self.net.fuse(features.index_select(0, path))                 # [P, width]
        idx = a + 1 + self.arange_w                                          # rows a+1 .. a+W
        self.ctx.copy_(torch.cat([self.ctx, rows]).index_select(0, idx))
        fresh = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        self.valid.copy_(torch.cat([self.valid, fresh]).index_select(0, idx))
        for (k, v), layer in zip(self.kv, self.net.layers):
            nk, nv = layer.attn.raw_keys(rows)
            k.copy_(torch.cat([k, nk]).index_select(0, idx))
            v.copy_(torch.cat([v, nv]).index_select(0, idx))

    # -- drafting ---------------------------------------------------------------------------
    @torch.no_grad()
    def slot_logits(self, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block pass after `root` [1] over the whole window, the mask hiding the rows not
        filled yet: slot hiddens [1, S, width] and fp32 slot logits [1, S, vocab]."""
        S = self.slots
        h, logits = self.net(self.parts, root, self.ctx[None], self.valid[None],
                             [(k[None], v[None]) for k, v in self.kv])
        return h[:, :S], logits[:, :S].float()

    @torch.no_grad()
    def chain_tokens(self, root: torch.Tensor) -> torch.Tensor:
        """The drafted chain [length] after `root` [1] (a device tensor), from the window."""
        h, logits = self._slot_logits(root)
        if self.top_k is None:
            # the host takes the best of log_softmax's top-k: the same ordering, ties included
            return torch.log_softmax(logits[0], dim=-1).argmax(-1)[:self.length]
        # LiLiCorr anchors on the newest context row (zeros before there is any)
        anchor = torch.where(self.valid[-1], self.ctx[-1], torch.zeros_like(self.ctx[-1]))[None]
        if self.fused_head is not None:
            tokens = self.fused_head.draft(logits, h, anchor)[5][0]
        else:
            cand, _, start, pair = lattice(self.parts, self.net.head, logits, h, anchor, self.top_k)
            ranks = greedy_walk(start, pair)                                # [1, S]
            tokens = cand.gather(-1, ranks[..., None])[0, :, 0]
        return tokens[:self.length]

    def propose(self, spec: GraphedSpec) -> None:
        """Draft the next chain after the spec's root into `spec.tokens[0, 1:]`."""
        spec.tokens[0, 1:1 + self.length].copy_(self._chain(spec.state.root))

    def draft(self, spec: GraphedSpec) -> None:
        """`GraphedSpec`'s draft phase, right after `accept`: learn the accepted path, draft."""
        self.observe(spec)
        self.propose(spec)


class DeviceDraftDecoder:
    """Greedy speculative decoding with a `DeviceChainDrafter`: one graph per step (draft +
    verify + accept), the first draft a graph of its own; `generate` mirrors
    `GraphedDecoder.generate`."""

    def __init__(self, rt: PackedTarget, drafter: BlockDrafter, settings: DraftSettings, capacity: int,
                 deferred: bool = True, use_graph: bool | None = None, recurrence: str = "kernels",
                 split_graphs: bool = False, compile: bool = False, fused_head: bool | None = None):
        self.rt, self.settings = rt, settings
        self.drafter = DeviceChainDrafter.from_settings(drafter, settings, compile, fused_head)
        self.feature_layers = self.drafter.feature_layers
        tree = self.drafter.tree()
        self.state = SpecState(rt, max_path=len(tree), capacity=capacity)
        t0 = time.perf_counter()
        self.spec = GraphedSpec(rt, self.state, tree, mode="auto", deferred=deferred,
                                   feature_layers=self.feature_layers, use_graph=use_graph,
                                   recurrence=recurrence, split_graphs=split_graphs, drafter=self.drafter)
        self.first_graph = self._capture_first() if self.spec.use_graph else None
        self.capture_ms = 1e3 * (time.perf_counter() - t0)
        self.readbacks = 0

    @torch.no_grad()
    def _capture_first(self) -> torch.cuda.CUDAGraph:
        """The first draft of a sequence (no accepted path yet) as a graph: eagerly it is a
        few hundred launches, more than a whole graphed decode of a short answer."""
        kept = [self.spec.tokens] + self.drafter.buffers()
        with self.state.preserved():
            saved = [t.clone() for t in kept]
            graph = capture(lambda: self.drafter.propose(self.spec))
            for t, s in zip(kept, saved):
                t.copy_(s)
        return graph

    def first_draft(self) -> None:
        if self.first_graph is not None:
            self.first_graph.replay()
        else:
            self.drafter.propose(self.spec)

    @torch.no_grad()
    def start(self, prompt: list[int], prefilled=None) -> tuple:
        """Load the prefilled state and the drafter's window (untimed, like a host drafter's
        reset); returns the prefill (state, features, last hidden) for a later restart."""
        pre = prefilled or self.rt.prefill(prompt, self.feature_layers)
        state0, feats, _ = pre
        self.state.reset(state0, prompt[-1])
        self.drafter.reset(feats if len(prompt) > 1 else None)
        return pre

    @torch.no_grad()
    def generate(self, prompt: list[int], n: int, reference: list[int] | None = None,
                 prefilled=None) -> DraftRun:
        rt, st, spec = self.rt, self.state, self.spec
        if n > st.capacity:
            raise ValueError(f"{n} tokens exceed this decoder's capacity ({st.capacity})")
        pre = self.start(prompt, prefilled)
        per_step = len(self.drafter.tree())                  # most tokens one step can make
        readbacks = 0
        sync(rt.device)
        t_start = time.perf_counter()
        self.first_draft()
        t1 = time.perf_counter()
        pos = 0
        while pos < n:
            for _ in range(max(1, (n - pos) // per_step)):
                spec.step()
            pos = int(st.pos.item())                         # the only sync: a few per decode
            readbacks += 1
        sync(rt.device)
        t2 = time.perf_counter()
        ms = 1e3 * (t2 - t_start)
        phases = {"draft": 1e3 * (t1 - t_start), "graph": 1e3 * (t2 - t1)}
        phases["other"] = ms - sum(phases.values())
        self.readbacks = readbacks
        steps = int(st.step.item())
        tokens, accepted = st.output(), st.acc[:steps].tolist()
        divergence = None
        if reference is not None:
            divergence = self._divergence(prompt, pre, tokens, accepted, reference)
        graphs = int(bool(spec.graphs)) + int(self.first_graph is not None)
        return DraftRun(tokens, steps, accepted, ms, phases, 0.0, graphs, divergence)

    @torch.no_grad()
    def replay_steps(self, prompt: list[int], prefilled, steps: int) -> None:
        """Restart the sequence and replay `steps` steps (replays are deterministic)."""
        self.start(prompt, prefilled)
        self.first_draft()
        for _ in range(steps):
            self.spec.step()

    def _divergence(self, prompt, pre, tokens, accepted, reference) -> dict | None:
        """Where the output first leaves `reference`, with the target's logit gap there (a
        near-tie or a bug): the decode is replayed up to that step to read its logits."""
        p = next((i for i, (x, y) in enumerate(zip(tokens, reference)) if x != y), None)
        if p is None:
            return None
        offset = 0
        for step, a in enumerate(accepted):
            if p < offset + a + 1:
                break
            offset += a + 1
        self.replay_steps(prompt, pre, step)
        self.spec.step()
        row = self.spec.logits[p - offset]                   # chain: node j chose token j
        return {"position": p, "token": tokens[p], "reference_token": reference[p],
                "gap": float(row[tokens[p]] - row[reference[p]])}

    @torch.no_grad()
    def phase_split(self, prompt: list[int], prefilled, steps: int) -> dict:
        """Milliseconds per step of each phase (verify, accept_commit, draft) over `steps`
        steps of this prompt: the phase graphs (`split_graphs=True`) replayed with CUDA events
        between them, or host time eagerly."""
        self.start(prompt, prefilled)
        self.first_draft()
        return phase_times(self.spec, steps)


__all__ = ["DeviceChainDrafter", "DeviceDraftDecoder"]
