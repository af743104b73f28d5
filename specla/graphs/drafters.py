"""Device-resident drafters: drafting inside the speculative step graph, with static shapes.

On a small target a host drafter run eagerly between graph replays costs far more than the
verification it feeds, so these drafters do the whole draft with tensor ops of static
shape, and `GraphedSpec` captures draft + verify + accept as graphs with no host work.

A device drafter has
    feature_layers   the target layers whose outputs it reads
    template()       the draft shape the step graph is captured with (node count, chain or not)
    max_depth        the deepest draft it grows (the accepted path's longest length - 1)
    dynamic          True when each step grows a different tree (`SpecTopology.rebuild`)
    bind(log)        allocate its own per-step log beside the step log (before capture)
    reset(prompt, features, hidden)  fill its context from the prefilled prompt (eager)
    propose(spec)    write the next draft into `spec.tokens` (and the topology, if dynamic)
                     and its log row; `draft(spec)` = observe the accepted path, then propose
    buffers()        its static buffers (restored after a capture's warm-up)
    details(rows)    the per-step JSON details for the trace (`read back in batches`)

`DeviceBlockDrafter` is the block / LiLiCorr drafter: the window of fused target features
is updated with static shapes (the accepted path's rows selected by a device index), the
block pass runs over the whole window with a validity mask, and the draft is a chain (top-1,
or LiLiCorr's greedy walk) or a tree grown by `specla.graphs.trees.grow_tree`, exactly the
tree the host drafter builds from the same scores.

`DeviceEagleDrafter` is the EAGLE-style drafter: the same window of accepted rows, and the
tree grown depth by depth, the layer run over each depth's whole frontier (a static width,
dead entries masked) with tree attention over the nodes processed so far.
"""
from __future__ import annotations

import torch

from specla.drafters.base import DraftSettings
from specla.drafters.block import BlockDrafter, pack_projections, rope
from specla.drafters.eagle import EagleDrafter
from specla.drafters import ngram
from specla.drafters.lilicorr import LiLiCorrDrafter, candidates, greedy_walk, lattice, tree_rows
from specla.drafters.ngram import NgramDrafter
from specla.graphs.draft_step import block_draft_for
from specla.graphs.ngram_chain import ngram_chain_for
from specla.graphs.spec import GraphedSpec, StepLog
from specla.graphs.trees import (Frontier, GrownTree, conditional_rows, frontier_width, grow_tree, pool_size,
                                 static_rows, tree_nodes)
from specla.tree import DraftTree


class _DeviceDrafter:
    """What the device drafters share: the draft shape the step graphs are captured with, and
    writing each step's draft into the step (tokens, topology, proposal rows, log-probs)."""

    shape: str
    nodes: int
    dynamic: bool

    def template(self) -> DraftTree:
        """A chain, a preset's fixed tree, or a tree of `nodes` nodes (its parents rewritten on
        the device each step)."""
        if self.shape == "chain":
            return DraftTree.chain([0] * self.nodes)
        if getattr(self, "preset", None):
            return DraftTree.from_index_paths(self.preset, [0] * self.nodes)
        return DraftTree([0] * self.nodes, [-1] + [0] * (self.nodes - 1))

    def bind(self, log: StepLog) -> None:
        self.step_log = log

    def step_buffers(self) -> dict[str, torch.Tensor]:
        """The per-step device buffers (row s: step s) the trace's details are read from."""
        return {}

    def details(self, rows: dict[str, list], count: int) -> list[dict]:
        """Per-step JSON details of `count` steps from host copies of `step_buffers` rows."""
        return [{"drafter": self.kind} for _ in range(count)]

    def write(self, spec: GraphedSpec, grown: GrownTree, proposal: torch.Tensor | None = None) -> None:
        """The next step's draft into `spec`, and its log-probs into the step log's row."""
        if proposal is not None:
            spec.proposal[1:].copy_(proposal[:spec.proposal.shape[0] - 1])
        spec.tokens[0, 1:].copy_(grown.tokens[1:])
        if self.dynamic:
            spec.topo.rebuild(grown.parents)
        self.log_draft(spec, grown.logp)

    def log_draft(self, spec: GraphedSpec, logp: torch.Tensor) -> None:
        """The draft's log-probs ([nodes], the root's first) into the step log's row."""
        row = spec.state.log.row(spec.state.step)
        spec.state.log.draft_logp.index_copy_(0, row, _pad(logp, spec.state.log.nodes)[None])

    def draft(self, spec: GraphedSpec) -> None:
        """`GraphedSpec`'s draft phase, right after `accept`: learn the accepted path, draft."""
        self.observe(spec)
        self.propose(spec)


# Greedy best-first trees grown by `kernels.triton_draft_step._best_first_tree`: the block
# drafter's inside its persistent draft launch (on), LiLiCorr's in a launch of its own after the
# head (off: its [128, 128] compares spill 2.3 KB a thread in the sm_90 build, and neither is
# measured on a GPU yet; `benchmarks/launch_counts.py --ops fused+latticetree` times it).
TREE_KERNEL = True
LATTICE_TREE_KERNEL = False


class DeviceBlockDrafter(_DeviceDrafter):
    """A loaded `BlockDrafter` / `LiLiCorrDrafter` drafting from static device buffers.

    The settings are the host drafter's (`DraftSettings`): tree shape, top-k, node budget,
    block size, confidence pruning, temperature; or a tree preset (`preset`, index paths,
    the block drafter only): the same tree every step, the node at (r1, ..., rd) slot d's
    rank-rd candidate, as `BlockDrafter.propose_preset` drafts it. fused_head: run the LiLiCorr
    head and walk, and the block drafter's top-k, as Triton kernels (None: wherever
    `kernels.triton_lilicorr.unsupported` allows, i.e. on CUDA for a supported head shape;
    True: the same, or an error saying why not; False: torch ops). compile: `torch.compile`
    the draft's torch ops. persistent: observe + block pass + top-k (and a greedy block chain
    with its log row) as one persistent Triton launch (None: where `draft_step.block_draft_for`
    finds that it applies and agrees with the torch ops; True: the same, or an error saying
    why not; False: torch ops); `draft_note` says which. tree_kernel: grow a greedy
    best-first tree (no pruning) with `kernels.triton_draft_step._best_first_tree`, the block
    drafter's in its persistent launch and LiLiCorr's in a launch of its own on CUDA (True;
    None: as `TREE_KERNEL` and `LATTICE_TREE_KERNEL` say), or with `grow_tree`'s torch ops
    (False).
    """

    def __init__(self, drafter: BlockDrafter, settings: DraftSettings, compile: bool = False,
                 fused_head: bool | None = None, persistent: bool | None = None,
                 preset: list[list[int]] | None = None, tree_kernel: bool | None = None):
        net, c = drafter.net, drafter.net.config
        self.preset = [tuple(p) for p in preset] if preset else None
        if self.preset:
            if not drafter.static_rows:
                raise ValueError("a tree preset drafts on the device from the block drafter's slot candidates; "
                                 f"the {drafter.kind} drafter's candidates depend on the path")
            settings = settings.for_preset(self.preset)
        settings.validate(drafter.parts.vocab_size)
        self.net, self.parts, self.feature_layers = net, drafter.parts, tuple(drafter.feature_layers)
        why = _block_limits(drafter, settings)
        if why is not None:
            raise ValueError(why)
        self.settings = settings
        self.slots = settings.block_size - 1                 # slots of the block pass / lattice
        self.shape = "preset" if self.preset else settings.tree
        self.budget, self.prune_tau = settings.budget, settings.prune_tau
        # at temperature > 0 a chain is drawn from the drafter's distribution (its rows are the
        # proposal the acceptance needs); a tree keeps its top-k candidates (point masses)
        self.temperature = settings.temperature
        self.samples_chains = self.temperature > 0 and self.shape == "chain"
        # top-1 needs no head: a LiLiCorr drafter at top-k 1 drafts the block drafter's chain
        self.lilicorr = isinstance(drafter, LiLiCorrDrafter) and net.head is not None and settings.top_k > 1
        self.single_candidate = isinstance(drafter, LiLiCorrDrafter) and not self.lilicorr  # log-prob 0, as the host
        self.sharpness = getattr(drafter, "tree_sharpness", None)
        self.top_k = settings.top_k
        self.kind = "lilicorr" if self.lilicorr else "block"
        if self.preset:
            self.nodes, self.max_depth = len(self.preset) + 1, max(len(p) for p in self.preset)
        else:
            self.nodes = tree_nodes(self.shape, self.top_k, self.budget, self.slots)
            self.max_depth = min(self.slots, self.budget)           # the deepest draft it grows
        self.dynamic = self.shape not in ("chain", "preset")
        # node j + 1 of a chain or a preset is candidate flat[j] of the [slots, k] top-k table
        picks = [(len(p) - 1, p[-1]) for p in self.preset] if self.preset else [(j, 0) for j in range(self.nodes - 1)]
        self.flat = torch.tensor([slot * self.top_k + rank for slot, rank in picks], device=net.fc.weight.device)
        self.preset_parents = (torch.tensor(self.template().parents, device=net.fc.weight.device)
                               if self.preset else None)
        w = net.fc.weight
        W, dev = c.window, w.device
        self.window, self.device = W, dev
        self.ctx = torch.zeros(W, c.width, device=dev, dtype=w.dtype)       # fused rows, oldest first
        self.valid = torch.zeros(W, dtype=torch.bool, device=dev)          # invalid rows at the front
        heads, hd = c.heads, c.width // c.heads
        # per layer the raw keys and values of the window, views of one stack the kernel reads
        self.kv_stack = torch.zeros(len(net.layers), 2, W, c.width, device=dev, dtype=w.dtype)
        self.kv = [(kv[0].view(W, heads, hd), kv[1].view(W, heads, hd)) for kv in self.kv_stack]
        self.arange_w = torch.arange(W, device=dev)
        self.fused_head = self._fused_head(fused_head, dev) if self.lilicorr else None
        self.topk = self._topk(fused_head, dev)
        self.log: dict[str, torch.Tensor] = {}
        # Inside a CUDA graph every kernel still costs ~2 us, and a draft is a few hundred small
        # ones: torch.compile fuses them (compiled on the first, uncaptured call; the graph then
        # replays the generated kernels). Same math; fused kernels may round differently. The
        # fused head is one kernel already and stays out of the compiled functions.
        self.compiled = compile
        if compile:
            pack_projections(net)
        wrap = (lambda fn: torch.compile(fn, dynamic=False)) if compile else (lambda fn: fn)
        self._observe_rows = wrap(self.observe_rows)
        self._slot_logits = wrap(self.slot_logits)
        self._torch_lattice = wrap(self.torch_lattice)
        self._choose = wrap(self.choose)
        # observe + block pass + the slots' top-k as one launch where it applies (`draft_step`)
        self.no_path = torch.tensor([-1, 0, 0], device=dev)      # a result that appends nothing
        self.kernel, self.draft_note = block_draft_for(self, persistent)
        # the block drafter's greedy chain (its top-1s) and its log row, written by the kernel too
        self.kernel_chain = (self.kernel is not None and not self.lilicorr and not self.samples_chains and (
            self.shape == "preset" or (self.shape == "chain" and self.prune_tau is None)))
        # ... or its best-first tree, its topology and its log row (greedy, no pruning); LiLiCorr's
        # best-first tree (rows conditional on the parent) as one launch after the head
        greedy_tree = self.temperature == 0 and self.shape == "best-first" and self.prune_tau is None and self.nodes <= 16
        on = lambda default: tree_kernel or (tree_kernel is None and default)  # noqa: E731
        self.kernel_tree = greedy_tree and on(TREE_KERNEL) and self.kernel is not None and not self.lilicorr
        self.lattice_tree = greedy_tree and on(LATTICE_TREE_KERNEL) and self.lilicorr and dev.type == "cuda"
        if self.kernel_tree:
            self.draft_note += ", the best-first tree in the same launch"
        if self.lattice_tree:
            self.tree_logp = torch.zeros(self.nodes, device=dev)
            self.draft_note += ", LiLiCorr's best-first tree in one launch"
        if self.kernel is not None:
            self.k_h = torch.zeros(c.block_size - 1, c.width, device=dev, dtype=w.dtype)
            self.k_logits = torch.zeros(c.block_size - 1, self.parts.vocab_size, device=dev)
            self.k_cand = torch.zeros(self.slots, self.top_k, dtype=torch.long, device=dev)
            self.k_cand_logp = torch.zeros(self.slots, self.top_k, device=dev)

    def _fused_head(self, wanted: bool | None, device: torch.device):
        """The head as Triton kernels, or None for the torch ops (see `fused_head`)."""
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

    @staticmethod
    def _topk(wanted: bool | None, device: torch.device):
        """The slots' top-k: one Triton kernel on CUDA (log_softmax + topk + sort were three
        kernels and 31 us of a 139 us draft on the H200), torch's ops elsewhere or when
        the fused kernels are turned off."""
        if wanted is False or device.type != "cuda":
            return candidates
        try:
            from kernels.triton_lilicorr import lattice_topk
        except ImportError:
            return candidates
        return lambda logits, k: tuple(t[0] for t in lattice_topk(logits[None], k))

    def bind(self, log: StepLog) -> None:
        """This drafter's per-step log: the slot candidates (and LiLiCorr's scores and walk)."""
        super().bind(log)
        S, k, dev = self.slots, self.top_k, self.device
        self.log = {"cand": torch.zeros(log.steps, S, k, dtype=torch.long, device=dev),
                    "cand_logp": torch.zeros(log.steps, S, k, device=dev)}
        if self.lilicorr:
            self.log.update(start=torch.zeros(log.steps, k, device=dev),
                            pair=torch.zeros(log.steps, max(S - 1, 0), k, k, device=dev),
                            chosen=torch.zeros(log.steps, S, dtype=torch.long, device=dev))

    def buffers(self) -> list[torch.Tensor]:
        return [self.ctx, self.valid, self.kv_stack] + list(self.log.values())

    # -- context ----------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, prompt: list[int], features: torch.Tensor | None, hidden: torch.Tensor | None = None) -> None:
        """Fill the window from the prompt's target features [T, n_layers, D] (what
        `PackedTarget.prefill` returns; None or empty for a one-token prompt)."""
        for t in (self.ctx, self.valid, self.kv_stack):
            t.zero_()
        if features is None or not features.shape[0]:
            return
        if features.shape[-2] != len(self.feature_layers):
            raise ValueError(f"expected features of {len(self.feature_layers)} layers, got {features.shape[-2]}")
        rows = self.net.fuse(features[-self.window:].to(self.ctx.device))
        n = rows.shape[0]
        self.ctx[-n:] = rows
        self.valid[-n:] = True
        for (k, v), layer in zip(self.kv, self.net.layers):
            nk, nv = layer.attn.raw_keys(rows)
            k[-n:], v[-n:] = nk, nv

    def observe(self, spec: GraphedSpec) -> None:
        """Append the rows of the path `spec` just accepted (root included, a+1 rows) to the
        window, with static shapes: all P path rows are fused, the index picks the right ones."""
        self._observe_rows(spec.result, spec.features)

    @torch.no_grad()
    def observe_rows(self, result: torch.Tensor, features: torch.Tensor) -> None:
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

    def anchor(self) -> torch.Tensor:
        """LiLiCorr's anchor: the newest context row (zeros before there is any)."""
        return torch.where(self.valid[-1], self.ctx[-1], torch.zeros_like(self.ctx[-1]))[None]

    @torch.no_grad()
    def torch_lattice(self, logits: torch.Tensor, h: torch.Tensor, anchor: torch.Tensor):
        lat = lattice(self.parts, self.net.head, logits, h, anchor, self.top_k)
        return lat.cand, lat.cand_logp, lat.start, lat.pair, greedy_walk(lat.start, lat.pair)

    @torch.no_grad()
    def scores(self, root: torch.Tensor) -> dict[str, torch.Tensor]:
        """The block pass and each slot's top-k (and LiLiCorr's lattice scores and walk),
        batch dimension dropped: cand / cand_logp [S, k], start [k], pair [S-1, k, k], chosen [S];
        and the slot logits [1, S, V]."""
        h, logits = self._slot_logits(root)
        return self.lattice_scores(h, logits, None if self.lilicorr else self.topk(logits[0], self.top_k))

    @torch.no_grad()
    def kernel_scores(self, root: torch.Tensor, result: torch.Tensor, features: torch.Tensor | None):
        """`observe_rows` of `result` then `scores(root)`, the block pass and top-k in one launch."""
        self.kernel(root, result, features, self.ctx, self.valid, self.kv_stack, self.k_h, self.k_logits,
                    self.k_cand, self.k_cand_logp)
        S = self.slots
        return self.lattice_scores(self.k_h[None, :S], self.k_logits[None, :S], (self.k_cand, self.k_cand_logp))

    def lattice_scores(self, h: torch.Tensor, logits: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None):
        """`scores` from the slot hiddens and logits (and, for the block drafter, their top-k)."""
        if not self.lilicorr:
            return {"cand": top[0], "cand_logp": top[1], "logits": logits}
        if self.fused_head is not None:
            out = self.fused_head.draft(logits, h, self.anchor())
            parts = (out.cand, out.cand_logp, out.start, out.pair, out.ranks)
        else:
            parts = self._torch_lattice(logits, h, self.anchor())
        scores = dict(zip(("cand", "cand_logp", "start", "pair", "chosen"), (p[0] for p in parts)))
        return dict(scores, logits=logits)

    @torch.no_grad()
    def sampled_chain(self, root: torch.Tensor, logits: torch.Tensor,
                      scores: dict[str, torch.Tensor]) -> tuple[GrownTree, torch.Tensor]:
        """A chain drawn at the temperature (each slot from softmax(logits / T); LiLiCorr: each
        slot's candidate from softmax(row / T), the row out of the previous pick), and the
        proposal rows [S, V] it was drawn from."""
        from specla.graphs.sampling import gumbel_draw

        T, S = self.temperature, self.slots
        if not self.lilicorr:
            q = torch.softmax(logits[0] / T, dim=-1)                               # [S, V]
            tokens = torch.cat([gumbel_draw(q[s]) for s in range(S)])
        else:
            cand, start, pair = scores["cand"], scores["start"], scores["pair"]
            row, picks, qs = start.float(), [], []
            for s in range(S):
                q_s = torch.softmax(row / T, dim=-1)
                r = gumbel_draw(q_s)
                picks.append(r)
                qs.append(q_s)
                if s < S - 1:
                    row = pair[s].index_select(0, r)[0].float()
            ranks, q_k = torch.cat(picks), torch.stack(qs)                            # [S], [S, k]
            tokens = cand.gather(1, ranks[:, None])[:, 0]
            q = torch.zeros(S, logits.shape[-1], device=root.device).scatter(1, cand, q_k)
        logp = q.gather(1, tokens[:, None]).clamp_min(1e-30).log()
        grown = grow_tree(root, static_rows(tokens[:, None], logp), depth=S, shape="chain", top_k=1,
                          budget=self.budget, prune_tau=self.prune_tau)
        return grown, q

    @torch.no_grad()
    def choose(self, root: torch.Tensor, scores: dict[str, torch.Tensor]) -> GrownTree:
        """The draft from the scores: the host drafter's chain or tree for these settings."""
        cand, cand_logp = scores["cand"], scores["cand_logp"]
        if self.preset:
            dev = root.device
            return GrownTree(torch.cat([root, cand.reshape(-1).index_select(0, self.flat)]), self.preset_parents,
                             torch.cat([torch.zeros(1, device=dev), cand_logp.reshape(-1).index_select(0, self.flat)]),
                             torch.ones(self.nodes, dtype=torch.bool, device=dev))
        if self.shape == "chain" and self.prune_tau is None:
            n = self.nodes - 1
            if self.lilicorr:        # the greedy walk, with each pick's tree-search log-prob
                ranks = scores["chosen"]
                start_lp, pair_lp = tree_rows(scores["start"], scores["pair"], cand_logp, self.sharpness)
                rows = torch.cat([start_lp[None], pair_lp.gather(
                    1, ranks[:-1, None, None].expand(-1, 1, self.top_k))[:, 0]])
                tokens = cand.gather(1, ranks[:, None])[:, 0]
                logp = rows.gather(1, ranks[:, None])[:, 0]
            else:
                tokens, logp = cand[:, 0], cand_logp[:, 0] * (0.0 if self.single_candidate else 1.0)
            real = torch.ones(n + 1, dtype=torch.bool, device=root.device)
            return GrownTree(torch.cat([root, tokens[:n]]), torch.arange(-1, n, device=root.device),
                             torch.cat([torch.zeros(1, device=root.device), logp[:n]]), real)
        rows = (conditional_rows(cand, *tree_rows(scores["start"], scores["pair"], cand_logp, self.sharpness))
                if self.lilicorr else static_rows(cand, cand_logp))
        return grow_tree(root, rows, depth=self.slots, shape=self.shape, top_k=self.top_k,
                         budget=self.budget, prune_tau=self.prune_tau)

    def draft(self, spec: GraphedSpec) -> None:
        if self.kernel is None:
            super().draft(spec)
            return
        self.kernel_draft(spec, spec.result, spec.features)

    @torch.no_grad()
    def propose(self, spec: GraphedSpec) -> None:
        """Draft the next step after the spec's root into `spec.tokens` (and its topology)."""
        if self.kernel is None:
            self.propose_from(spec, self.scores(spec.state.root))
        else:
            self.kernel_draft(spec, self.no_path, None)

    @torch.no_grad()
    def kernel_draft(self, spec: GraphedSpec, result: torch.Tensor, features: torch.Tensor | None) -> None:
        """Observe `result`'s path and draft with the persistent kernel (a greedy chain or a
        best-first tree, and its log row, in the same launch; anything else from its scores)."""
        if self.kernel_tree:
            self._kernel_tree(spec, result, features)
            return
        if not self.kernel_chain:
            self.propose_from(spec, self.kernel_scores(spec.state.root, result, features))
            return
        from kernels.triton_draft_step import ChainOut
        chain = ChainOut(spec.tokens[0], self.flat, spec.state.step, self.log["cand"], self.log["cand_logp"],
                         spec.state.log.draft_logp, 0.0 if self.single_candidate else 1.0)
        self.kernel(spec.state.root, result, features, self.ctx, self.valid, self.kv_stack, self.k_h, self.k_logits,
                    self.k_cand, self.k_cand_logp, chain)

    def _kernel_tree(self, spec: GraphedSpec, result: torch.Tensor, features: torch.Tensor | None) -> None:
        """The kernel grows the best-first tree into the step's tokens, parents and conv index
        (what the persistent verification reads); torch acceptance reads the rest of the
        topology, rebuilt from those parents."""
        from kernels.triton_draft_step import TreeOut
        topo = spec.topo
        tree = TreeOut(spec.tokens[0], topo.model_topo.parents, topo.conv_index, spec.state.step, self.log["cand"],
                       self.log["cand_logp"], spec.state.log.draft_logp)
        self.kernel(spec.state.root, result, features, self.ctx, self.valid, self.kv_stack, self.k_h, self.k_logits,
                    self.k_cand, self.k_cand_logp, tree)
        if not spec.kernel_accept:
            topo.rebuild(topo.model_topo.parents)

    def _lattice_tree(self, spec: GraphedSpec, scores: dict[str, torch.Tensor]) -> None:
        """LiLiCorr's best-first tree from the head's scores in one launch, into the step's
        tokens, parents, conv index and log row (the rest of the topology as `_kernel_tree`)."""
        from kernels.triton_draft_step import best_first_tree
        k, topo = self.top_k, spec.topo
        start_lp, pair_lp = tree_rows(scores["start"], scores["pair"], scores["cand_logp"], self.sharpness)
        rows = torch.cat([start_lp.float().expand(1, k, k), pair_lp.float()])
        best_first_tree(scores["cand"], rows, self.nodes, topo.conv_index.shape[1],
                        out=(spec.tokens[0], topo.model_topo.parents, self.tree_logp, topo.conv_index))
        self.log_draft(spec, self.tree_logp)
        if not spec.kernel_accept:
            topo.rebuild(topo.model_topo.parents)

    @torch.no_grad()
    def propose_from(self, spec: GraphedSpec, scores: dict[str, torch.Tensor]) -> None:
        """The draft from the slots' scores into `spec.tokens`, its topology and the logs."""
        root = spec.state.root
        q = None
        if self.samples_chains:
            grown, q = self.sampled_chain(root, scores.pop("logits"), scores)
            self.write(spec, grown, q)
        elif self.lattice_tree:
            scores.pop("logits")
            self._lattice_tree(spec, scores)
        else:
            scores.pop("logits")
            self.write(spec, self._choose(root, scores), q)
        row = spec.state.log.row(spec.state.step)
        for name, buf in self.log.items():
            buf.index_copy_(0, row, scores[name][None].to(buf.dtype))

    # -- the trace --------------------------------------------------------------------------
    def step_buffers(self) -> dict[str, torch.Tensor]:
        return self.log

    def details(self, rows: dict[str, list], count: int) -> list[dict]:
        """The slot candidates (LiLiCorr: its lattice and walk), as the host drafter writes them."""
        out = []
        for i in range(count):
            if not self.lilicorr:
                out.append({"drafter": "block", "slots": {"candidates": rows["cand"][i],
                                                          "logprobs": rows["cand_logp"][i]}})
                continue
            out.append({"drafter": "lilicorr", "lattice": {
                "candidates": rows["cand"][i], "logprobs": rows["cand_logp"][i],
                "start": rows["start"][i], "pair": rows["pair"][i], "chosen": rows["chosen"][i],
                "top1": [0] * self.slots}})
        return out


class DeviceEagleDrafter(_DeviceDrafter):
    """A loaded `EagleDrafter` drafting greedy chains and trees from static device buffers:
    `EagleDrafter.propose` (its `_TreeSearch` over `tree_build`) as tensor ops."""

    kind = "eagle"

    def __init__(self, drafter: EagleDrafter, settings: DraftSettings, compile: bool = False):
        settings.validate(drafter.parts.vocab_size)
        net, c = drafter.net, drafter.net.config
        self.net, self.parts, self.feature_layers = net, drafter.parts, ()
        self.shape, self.budget, self.depth, self.prune_tau = settings.tree, settings.budget, settings.depth, settings.prune_tau
        self.top_k = 1 if self.shape == "chain" else settings.top_k
        self.temperature = settings.temperature
        self.samples_chains = self.temperature > 0 and self.shape == "chain"
        self.nodes = tree_nodes(self.shape, self.top_k, self.budget, self.depth)
        self.max_depth = min(self.depth, self.budget)
        self.dynamic = self.shape != "chain"
        self.width = frontier_width(self.shape, self.top_k, self.budget)
        w = net.fc.weight
        W, dev, dt = c.window, w.device, w.dtype
        heads, hd = net.layer.attn.heads, net.layer.attn.head_dim
        self.window, self.device = W, dev
        self.ctx_k = torch.zeros(W, heads, hd, device=dev, dtype=dt)     # raw keys of accepted rows
        self.ctx_v = torch.zeros(W, heads, hd, device=dev, dtype=dt)
        self.valid = torch.zeros(W, dtype=torch.bool, device=dev)         # invalid rows at the front
        self.h_last = torch.zeros(c.target_hidden, device=dev, dtype=dt)  # the hidden before the root
        self.arange_w = torch.arange(W, device=dev)
        self.compiled = compile
        if compile:
            pack_projections(net)
        wrap = (lambda fn: torch.compile(fn, dynamic=False)) if compile else (lambda fn: fn)
        self._observe_rows = wrap(self.observe_rows)
        self._grow = wrap(self.grow)

    def buffers(self) -> list[torch.Tensor]:
        return [self.ctx_k, self.ctx_v, self.valid, self.h_last]

    # -- context ----------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, prompt: list[int], features: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        """The rows of the prompt's tokens 1..T-1 (each with the hidden before it), as the host
        drafter's `reset` makes them; the last prefilled hidden is the root's."""
        for t in self.buffers():
            t.zero_()
        T = len(prompt) - 1
        if T < 1:
            return
        self.h_last.copy_(hidden[T - 1])
        if T < 2:
            return
        tokens = torch.tensor(prompt[1:T], device=self.device)[-self.window:]
        before = hidden[:T - 1][-self.window:].to(self.h_last.dtype)
        k, v = self.net.raw_kv(self.net.rows(self.parts, tokens, before))
        n = k.shape[0]
        self.ctx_k[-n:], self.ctx_v[-n:], self.valid[-n:] = k, v, True

    def observe(self, spec: GraphedSpec) -> None:
        self._observe_rows(spec.result, spec.tokens[0], spec.last_hidden)

    @torch.no_grad()
    def observe_rows(self, result: torch.Tensor, tokens: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """Rows of the accepted path (root first) with the hidden before each: all P path rows
        are built, the index keeps rows a+1 .. a+W of [old window, new rows]."""
        a, path = result[:1], result[3:]
        hid = last_hidden.index_select(0, path).to(self.h_last.dtype)              # [P, D]
        before = torch.cat([self.h_last[None], hid[:-1]])
        k, v = self.net.raw_kv(self.net.rows(self.parts, tokens.index_select(0, path), before))
        idx = a + 1 + self.arange_w
        self.ctx_k.copy_(torch.cat([self.ctx_k, k]).index_select(0, idx))
        self.ctx_v.copy_(torch.cat([self.ctx_v, v]).index_select(0, idx))
        fresh = torch.ones(k.shape[0], dtype=torch.bool, device=k.device)
        self.valid.copy_(torch.cat([self.valid, fresh]).index_select(0, idx))
        self.h_last.copy_(hid.index_select(0, a)[0])

    # -- drafting ---------------------------------------------------------------------------
    @torch.no_grad()
    def grow(self, root: torch.Tensor) -> tuple[GrownTree, torch.Tensor | None]:
        """The tree search: at each depth the layer runs over the whole frontier (queries),
        seeing the accepted rows, the processed ancestors of each query and itself. At
        temperature > 0 a chain is drawn instead: also its proposal rows [depth, V]."""
        from specla.graphs.sampling import gumbel_draw

        net, parts, W, F = self.net, self.parts, self.window, self.width
        dev = root.device
        slots = self.depth * F
        M = pool_size(self.shape, self.top_k, self.budget, self.depth)
        heads, hd = net.layer.attn.heads, net.layer.attn.head_dim
        ctx_k = rope(self.ctx_k[None], self.arange_w)
        slot_k = torch.zeros(1, slots, heads, hd, device=dev, dtype=self.ctx_k.dtype)
        slot_v = torch.zeros_like(slot_k)
        slot_hid = torch.zeros(slots, self.h_last.shape[0], device=dev, dtype=self.h_last.dtype)
        slot_anc = torch.zeros(slots, slots, dtype=torch.bool, device=dev)
        slot_of = torch.zeros(M, dtype=torch.long, device=dev)
        eye = torch.eye(F, dtype=torch.bool, device=dev)
        slot_ids = torch.arange(slots, device=dev)

        def rows(d: int, frontier: Frontier):
            if d == 0:
                hidden = self.h_last[None].expand(F, -1)
                anc = torch.zeros(F, slots, dtype=torch.bool, device=dev)
            else:
                parent = slot_of.index_select(0, frontier.parent)
                hidden = slot_hid.index_select(0, parent)
                anc = slot_anc.index_select(0, parent) | (slot_ids[None, :] == parent[:, None])
            x = net.rows(parts, frontier.token, hidden)[None]                       # [1, F, D]
            pos = torch.full((F,), W + d, device=dev)
            k, v = net.kv(x, pos)
            mask = torch.cat([self.valid[None].expand(F, W), anc, eye], dim=1)[None, None]
            o = net.attend(x, pos, torch.cat([ctx_k, slot_k, k], 1), torch.cat([self.ctx_v[None], slot_v, v], 1),
                           mask)[0]
            base = d * F
            slot_k[0, base:base + F], slot_v[0, base:base + F] = k[0], v[0]
            slot_hid[base:base + F] = parts.norm(o)
            slot_anc[base:base + F] = anc
            slot_of.index_copy_(0, frontier.idx, base + torch.arange(F, device=dev))
            ranks = torch.arange(self.top_k, device=dev).expand(F, -1)
            if self.samples_chains:          # one child drawn from softmax(logits / T)
                q = torch.softmax(parts.logits(o).float() / self.temperature, dim=-1)      # [1, V]
                token = gumbel_draw(q[0])
                proposal.append(q[0])
                return token[None], q.gather(1, token[None]).clamp_min(1e-30).log(), ranks
            top = torch.log_softmax(parts.logits(o).float(), dim=-1).topk(self.top_k, dim=-1)
            return top.indices, top.values, ranks

        proposal: list[torch.Tensor] = []
        grown = grow_tree(root, rows, depth=self.depth, shape=self.shape, top_k=self.top_k,
                          budget=self.budget, prune_tau=self.prune_tau)
        return grown, (torch.stack(proposal) if proposal else None)

    @torch.no_grad()
    def propose(self, spec: GraphedSpec) -> None:
        self.write(spec, *self._grow(spec.state.root))


class DeviceNgramDrafter(_DeviceDrafter):
    """The model-free n-gram drafter inside the step graphs: `specla.drafters.ngram`'s tensor
    core over a device history buffer, and the tree `NgramDrafter.propose` grows over the
    trie of its continuations (`grow_tree` with the trie's children, heaviest first). A chain
    is one Triton launch where `ngram_chain.ngram_chain_for` finds that the kernel applies and
    agrees with these ops (chain_kernel: None there, True the same or an error, False never);
    `draft_note` says which."""

    kind = "ngram"

    def __init__(self, drafter: NgramDrafter, settings: DraftSettings, device, compile: bool = False,
                 chain_kernel: bool | None = None):
        settings.validate(drafter.vocab_size)
        self.core = drafter
        self.feature_layers = ()
        self.shape, self.depth, self.budget, self.prune_tau = settings.tree, settings.depth, settings.budget, settings.prune_tau
        self.width = 1 if self.shape == "chain" else min(settings.top_k, drafter.pool)
        self.top_k = self.width
        self.nodes = tree_nodes(self.shape, self.width, self.budget, self.depth)
        self.max_depth = min(self.depth, self.budget)
        self.dynamic = self.shape != "chain"
        self.temperature, self.samples_chains = settings.temperature, False   # point-mass drafts
        self.device = torch.device(device)
        self.history = torch.full((drafter.capacity,), -1, dtype=torch.long, device=self.device)
        self.length = torch.zeros(1, dtype=torch.long, device=self.device)
        # the match, the trie, its weights and the tree search are a few hundred small
        # kernels: torch.compile fuses them, as it does EAGLE's `grow` (integer math and
        # comparisons: exact either way)
        self.compiled = compile
        wrap = (lambda fn: torch.compile(fn, dynamic=False)) if compile else (lambda fn: fn)
        self._grow = wrap(self.grow)
        self._extended = wrap(self.extended)
        self.kernel, self.draft_note = ngram_chain_for(self, chain_kernel)
        self.zero_logp = torch.zeros(self.nodes, device=self.device)     # a chain's: each node's weight is its parent's

    def buffers(self) -> list[torch.Tensor]:
        return [self.history, self.length]

    @torch.no_grad()
    def reset(self, prompt: list[int], features: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        """The history is the prompt, its last token (the first root) last."""
        tokens = torch.tensor(prompt[-self.history.shape[0]:], dtype=torch.long, device=self.device)
        self.history.fill_(-1)
        self.history[:tokens.shape[0]] = tokens
        self.length.fill_(tokens.shape[0])

    @torch.no_grad()
    def observe(self, spec: GraphedSpec) -> None:
        """Append the accepted drafts and the bonus token (the next root) to the history."""
        history, length = self._extended(spec.result, spec.tokens[0], self.history, self.length)
        self.history.copy_(history)
        self.length.copy_(length)

    def extended(self, result: torch.Tensor, tokens: torch.Tensor, history: torch.Tensor,
                 length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The history and its length after a step's `result` (a, end, bonus, path)."""
        a, bonus, path = result[:1], result[2:3], result[3:]
        drafted = tokens.index_select(0, path)                     # path[0] is the root: shift by one
        j = torch.arange(path.shape[0], device=path.device)
        new = torch.where(j < a, drafted.roll(-1), bonus)
        return ngram.append(history, length, new, a + 1)

    def candidates(self, history: torch.Tensor, length: torch.Tensor):
        """The trie of the history's best continuations: node tokens, weights, and each
        node's children heaviest first ([1 + W*D], [1 + W*D], [1 + W*D, W])."""
        c, W, D = self.core, self.width, self.depth
        tokens, valid, score = ngram.continuations(history, length, max_ngram=c.max_ngram,
                                                   min_ngram=c.min_ngram, width=W, depth=D, pool=c.pool,
                                                   order=c.order)
        node_tokens, parents, is_real = ngram.trie(tokens, valid)
        weight = _trie_weights(tokens, valid, score)
        return node_tokens, weight, _children_by_weight(parents, is_real, weight, W)

    @torch.no_grad()
    def grow(self, root: torch.Tensor) -> GrownTree:
        W, D = self.width, self.depth
        node_tokens, weight, kids = self.candidates(self.history, self.length)

        def rows(d: int, frontier: Frontier):
            child = kids.index_select(0, frontier.rank)                          # [F, W]
            here = weight.index_select(0, frontier.rank)[:, None]
            got = child >= 0
            w = weight.index_select(0, child.clamp(min=0).reshape(-1)).view(child.shape)
            lp = torch.where(got, (w / here.clamp_min(1e-30)).clamp_min(1e-30).log(), float("-inf"))
            toks = node_tokens.index_select(0, child.clamp(min=0).reshape(-1)).view(child.shape)
            return toks, lp, child.clamp(min=0)

        return grow_tree(root, rows, depth=D, shape=self.shape, top_k=W, budget=self.budget,
                         prune_tau=self.prune_tau)

    @torch.no_grad()
    def propose(self, spec: GraphedSpec) -> None:
        if self.kernel is None:
            self.write(spec, self._grow(spec.state.root))
            return
        self.kernel(self.history, self.length, spec.tokens[0, 1:])
        self.log_draft(spec, self.zero_logp)

    def draft(self, spec: GraphedSpec) -> None:
        if self.kernel is None:
            super().draft(spec)
            return
        self.kernel(self.history, self.length, spec.tokens[0, 1:], (spec.result, spec.tokens[0]))
        self.log_draft(spec, self.zero_logp)


def _trie_weights(tokens: torch.Tensor, valid: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Each trie node's weight: the softmax(score) weights of the rows through it (the root:
    of every row with a token), as `specla.drafters.ngram._trie_rows` computes them."""
    W, D = tokens.shape
    valid = valid.long().cumprod(-1).bool()
    finite = torch.isfinite(score)
    top = torch.where(finite, score, float("-inf")).max()
    row_w = torch.where(finite, (score - torch.where(torch.isfinite(top), top, 0.0)).exp(), 0.0)
    agree = (tokens[:, None, :] == tokens[None, :, :]) & valid[:, None, :] & valid[None, :, :]
    same = agree.long().cumprod(-1).bool()                                        # [w, w', d]
    node = (same.float() * row_w[None, :, None]).sum(1)                           # [W, D]
    root = (row_w * valid[:, 0].float()).sum().view(1)
    return torch.cat([root, node.flatten()])


def _children_by_weight(parents: torch.Tensor, is_real: torch.Tensor, weight: torch.Tensor,
                        width: int) -> torch.Tensor:
    """[N, width] the real children of every trie node, heaviest first (then by index); -1
    where there are fewer."""
    n = parents.shape[0]
    nodes = torch.arange(n, device=parents.device)
    sib = (parents[:, None] == parents[None, :]) & is_real[:, None] & is_real[None, :] & (nodes[:, None] > 0)
    ahead = (weight[None, :] > weight[:, None]) | ((weight[None, :] == weight[:, None]) & (nodes[None, :] < nodes[:, None]))
    rank = (sib & ahead).sum(1)
    keep = is_real & (nodes > 0) & (rank < width)
    slot = torch.where(keep, parents.clamp(min=0) * width + rank, n * width)
    flat = torch.full((n * width + 1,), -1, dtype=torch.long, device=parents.device)
    flat.index_copy_(0, slot, torch.where(keep, nodes, -1))
    return flat[:-1].view(n, width)


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(n - x.shape[0])]) if x.shape[0] < n else x


def device_drafter_for(drafter, settings: DraftSettings, compile: bool = False,
                       fused_head: bool | None = None, check_only: bool = False, device=None):
    """(the device twin of a host drafter for these settings, None), or (None, why not).
    With check_only, nothing is built: (None, None) means it can be."""
    if isinstance(drafter, EagleDrafter):
        why = None if settings.tree == "chain" or settings.budget + 1 <= 128 else \
            f"a tree of {settings.budget} nodes (the tree kernels hold 127)"
        if why is not None or check_only:
            return None, why
        return DeviceEagleDrafter(drafter, settings, compile), None
    if isinstance(drafter, NgramDrafter):
        why = None if settings.tree == "chain" or settings.budget + 1 <= 128 else \
            f"a tree of {settings.budget} nodes (the tree kernels hold 127)"
        if why is not None or check_only:
            return None, why
        return DeviceNgramDrafter(drafter, settings, drafter.device if device is None else device, compile), None
    preset = getattr(drafter, "paths", None)
    if preset:          # a tree preset (`specla.runner.PresetShape`): fixed trees of the block drafter's candidates
        drafter = drafter.inner
        if not getattr(drafter, "static_rows", False):
            name = getattr(drafter, "name", type(drafter).__name__)
            return None, (f"a tree preset over the {name} drafter (on the device, presets take the block "
                          "drafter's slot candidates)")
        settings = settings.for_preset(preset)
    if not isinstance(drafter, BlockDrafter):
        name = getattr(drafter, "name", type(drafter).__name__)
        return None, f"the {name} drafter has no device version yet"
    why = _block_limits(drafter, settings)
    if why is not None or check_only:
        return None, why
    return DeviceBlockDrafter(drafter, settings, compile, fused_head, preset=preset), None


def _block_limits(drafter: BlockDrafter, settings: DraftSettings) -> str | None:
    """Why a block / LiLiCorr drafter cannot draft these settings on the device, or None."""
    c = drafter.net.config
    if not 2 <= settings.block_size <= c.block_size:
        return f"block size {settings.block_size}: this drafter predicts 2..{c.block_size} tokens"
    head = drafter.net.head if isinstance(drafter, LiLiCorrDrafter) else None
    if head is not None and settings.top_k > head.config.max_k:
        return f"top-k {settings.top_k}: this LiLiCorr head takes at most {head.config.max_k} candidates"
    if settings.tree != "chain" and settings.budget + 1 > 128:
        return f"a tree of {settings.budget} nodes (the tree kernels hold 127)"
    return None


__all__ = ["DeviceBlockDrafter", "DeviceEagleDrafter", "DeviceNgramDrafter", "device_drafter_for"]
