"""Block drafter (DFlash-style): one parallel pass drafts a whole block of future tokens.

    context   target features of the last W accepted positions, from several target layers,
              concatenated -> fc -> RMSNorm: one row per position ("fused" rows)
    block     [root token, MASK x (B-1)]: the root through the target's (frozen) embedding and
              a linear map to the drafter width, the masks a learned vector
    layers    a few non-causal transformer layers; every block row attends to all block rows
              and to the context rows, which are extra keys/values (they make no queries)
    output    slot hidden h_s -> linear to the target width -> target final norm -> target
              LM head (both frozen, read from the target, never stored in the checkpoint)

Positions are relative to the root (RoPE): context rows sit at W-n..W-1, the block at W...
The drafter keeps only fused rows of accepted positions: `reset` fills them from the prompt,
`observe` appends the accepted tokens' rows (the root's included), and nothing of a draft is
ever written back. Slot s of the block draft is the token s steps after the root.

This file also holds the pieces the other drafters share: `TargetParts`, RoPE attention,
the transformer layer.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla.cpu_linear import Linear, linear
from specla.drafters import tree_build
from specla.drafters.base import Accepted, Draft, DraftContext, DraftSettings
from specla.model import RMSNorm, inference_cache
from specla.tree import DraftTree


class TargetParts:
    """The target's frozen embedding, final norm and LM head, borrowed by reference.

    Works for our runtime (`specla.model.GDNForCausalLM`) and for fla's
    `GatedDeltaNetForCausalLM`: both name them model.embeddings, model.norm and lm_head.
    The tensors are plain attributes, so they never enter a drafter's state_dict.
    """

    def __init__(self, target: nn.Module):
        self.embed_weight = target.model.embeddings.weight.detach()
        self.norm_weight = target.model.norm.weight.detach()
        self.norm_eps = float(getattr(target.model.norm, "eps", 1e-6))
        self.lm_weight = target.lm_head.weight.detach()

    @property
    def vocab_size(self) -> int:
        return self.lm_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed_weight.shape[1]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm (fp32 inside, as the runtime computes it)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (x32 * self.norm_weight.float()).to(x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Target norm + LM head over drafter outputs already at the target width."""
        return linear(self.norm(x).to(self.lm_weight.dtype), self.lm_weight)


Positions = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def rope(x: torch.Tensor, pos: Positions, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding. x [..., T, H, Dh]; pos [T] or [..., T] integer positions, or a
    (cos, sin) table from `rope_table`."""
    half = x.shape[-1] // 2
    cos, sin = pos if isinstance(pos, tuple) else _cos_sin(pos, half, base)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _cos_sin(pos: torch.Tensor, half: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = base ** (-torch.arange(half, device=pos.device, dtype=torch.float32) / half)
    ang = pos.to(torch.float32)[..., None] * inv                  # [..., T, half]
    return ang.cos()[..., None, :], ang.sin()[..., None, :]       # broadcast over heads


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(start: int, stop: int, head_dim: int, device: torch.device,
               base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) of positions start..stop-1, built once: a block pass uses the same
    positions every step, and rebuilding them cost ~10 small ops per rotation (a sixth of the
    pass on the CPU, and as many kernels inside a CUDA graph). Same values as `rope(x, pos)`.
    Tables made under inference mode are kept apart: autograd may not save those."""
    if torch.compiler.is_compiling():
        # traced, the table is a few pointwise ops the compiler folds into the rotation, and
        # the inference-mode query of the key would split the compiled draft into 6 graphs
        return _cos_sin(torch.arange(start, stop, device=device), head_dim // 2, base)
    key = (start, stop, head_dim // 2, str(device), base, torch.is_inference_mode_enabled())
    table = _ROPE_TABLES.get(key)
    if table is None:
        pos = torch.arange(start, stop, device=device)
        table = _ROPE_TABLES[key] = _cos_sin(pos, head_dim // 2, base)
    return table


def _packed_weight(owner: nn.Module, name: str) -> torch.Tensor:
    """The weights of `owner.PACKS[name]` concatenated (rows), kept until they change."""
    weights = [getattr(owner, layer).weight for layer in owner.PACKS[name]]
    return inference_cache(owner, name, weights, lambda: torch.cat(weights))


def project(owner: nn.Module, x: torch.Tensor, name: str) -> list[torch.Tensor]:
    """x through the bias-free linear layers `owner.PACKS[name]`, which share it. At
    inference: one matmul over their weights concatenated once (one weight read and one
    launch instead of several; the drafter's pass is ~20 small matmuls, each a kernel on a
    GPU). Under autograd: each layer, so training sees the plain modules."""
    layers = [getattr(owner, layer) for layer in owner.PACKS[name]]
    if torch.is_grad_enabled():
        return [layer(x) for layer in layers]
    return list(linear(x, _packed_weight(owner, name)).split([l.out_features for l in layers], dim=-1))


@torch.no_grad()
def pack_projections(net: nn.Module) -> None:
    """Build every packed weight `project` reads in `net`, now: a function torch.compile
    traces before an eager call has built one would concatenate it in its graph, every call."""
    for module in net.modules():
        for name in getattr(module, "PACKS", ()):
            _packed_weight(module, name)


class Attention(nn.Module):
    """Multi-head attention with QK-norm and RoPE; queries and keys may be different rows."""

    PACKS = {"qkv": ("q_proj", "k_proj", "v_proj"), "kv": ("k_proj", "v_proj")}   # see `project`

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of {heads} heads")
        self.heads, self.head_dim = heads, width // heads
        self.q_proj = Linear(width, width, bias=False)
        self.k_proj = Linear(width, width, bias=False)
        self.v_proj = Linear(width, width, bias=False)
        self.o_proj = Linear(width, width, bias=False)
        self.q_norm = RMSNorm(self.head_dim, 1e-6)
        self.k_norm = RMSNorm(self.head_dim, 1e-6)

    def raw_keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, not yet rotated keys and values of rows x [..., T, width]: [..., T, H, Dh].

        They do not depend on the rows' positions, so a drafter can keep them for the rows
        it holds and only rotate them at each step's relative positions.
        """
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        k, v = project(self, x, "kv")
        return self.k_norm(k.view(shape)), v.view(shape)

    def keys(self, x: torch.Tensor, pos: Positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values of rows x [..., T, width]: each [..., T, H, Dh]."""
        k, v = self.raw_keys(x)
        return rope(k, pos), v

    def qkv(self, x: torch.Tensor, pos: Positions) -> tuple[torch.Tensor, ...]:
        """Rotated queries and keys, and values, of the same rows x [..., T, width] (one
        matmul at inference): each [..., T, H, Dh]."""
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        q, k, v = project(self, x, "qkv")
        return (rope(self.q_norm(q.view(shape)), pos), rope(self.k_norm(k.view(shape)), pos),
                v.view(shape))

    def attend(self, x: torch.Tensor, pos: Positions, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Queries from x [N, T, width]; k, v [N, S, H, Dh]; mask [N|1, 1|H, T, S] (True = see)."""
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        return self.attend_rotated(rope(self.q_norm(self.q_proj(x).view(shape)), pos), k, v, mask)

    def attend_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor:
        """`attend` from rotated queries q [N, T, H, Dh]."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype),
                                             v.transpose(1, 2).to(q.dtype), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class SwiGLU(nn.Module):
    PACKS = {"gate_up": ("gate_proj", "up_proj")}     # see `project`

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(width, hidden, bias=False)
        self.up_proj = Linear(width, hidden, bias=False)
        self.down_proj = Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, x, "gate_up")
        return self.down_proj(F.silu(gate) * up)


class Layer(nn.Module):
    """Pre-norm transformer layer whose attention reads an arbitrary key/value set."""

    def __init__(self, width: int, heads: int, mlp_hidden: int):
        super().__init__()
        self.attn_norm = RMSNorm(width, 1e-6)
        self.attn = Attention(width, heads)
        self.mlp_norm = RMSNorm(width, 1e-6)
        self.mlp = SwiGLU(width, mlp_hidden)

    def forward(self, x: torch.Tensor, pos: Positions, mem: torch.Tensor | None,
                mem_pos: Positions | None, mask: torch.Tensor | None,
                mem_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [N, T, width] attends to [mem rows (as they are); its own normed rows].

        mem_kv, if given, is `self.attn.raw_keys(mem)` computed earlier (a drafter's cache).
        """
        q, k, v = self.attn.qkv(self.attn_norm(x), pos)
        if mem is not None and mem.shape[1]:
            mk, mv = mem_kv if mem_kv is not None else self.attn.raw_keys(mem)
            k, v = torch.cat([rope(mk, mem_pos), k], dim=1), torch.cat([mv, v], dim=1)
        x = x + self.attn.attend_rotated(q, k, v, mask)
        return x + self.mlp(self.mlp_norm(x))


@dataclasses.dataclass
class BlockConfig:
    target_hidden: int
    vocab_size: int
    feature_layers: tuple[int, ...]
    block_size: int = 8            # root + 7 drafted slots
    width: int = 256
    heads: int = 4
    layers: int = 2
    mlp_hidden: int = 768
    window: int = 64               # accepted positions kept as context

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(l) for l in self.feature_layers)
        if not self.feature_layers:
            raise ValueError("a block drafter needs at least one target feature layer")
        if self.block_size < 2:
            raise ValueError(f"block size must be at least 2, got {self.block_size}")


class BlockNet(nn.Module):
    """The block drafter's weights (plus an optional LiLiCorr head in `self.head`)."""

    def __init__(self, config: BlockConfig, head: nn.Module | None = None):
        super().__init__()
        c = self.config = config
        self.fc = Linear(len(c.feature_layers) * c.target_hidden, c.width, bias=False)
        self.ctx_norm = RMSNorm(c.width, 1e-6)
        self.in_proj = Linear(c.target_hidden, c.width, bias=False)
        self.mask_emb = nn.Parameter(torch.randn(c.width) * 0.02)
        self.layers = nn.ModuleList(Layer(c.width, c.heads, c.mlp_hidden) for _ in range(c.layers))
        self.norm = RMSNorm(c.width, 1e-6)
        self.out_proj = Linear(c.width, c.target_hidden, bias=False)
        self.head = head

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., n_layers, D] -> fused context rows [..., width]."""
        return self.ctx_norm(self.fc(features.flatten(-2).to(self.fc.weight.dtype)))

    def forward(self, parts: TargetParts, root: torch.Tensor, ctx: torch.Tensor,
                ctx_valid: torch.Tensor | None = None,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block pass.

        root [N] tokens, ctx [N, n, width] fused rows (oldest first, n <= window), ctx_valid
        [N, n] bool; ctx_kv optionally each layer's `raw_keys(ctx)`, kept by the caller.
        Returns slot hiddens h [N, B-1, width] and logits [N, B-1, vocab].
        """
        c = self.config
        N, n = ctx.shape[:2]
        B = c.block_size
        dev = ctx.device
        x = torch.cat([self.in_proj(parts.embed(root).to(self.in_proj.weight.dtype))[:, None],
                       self.mask_emb.to(self.in_proj.weight.dtype).expand(N, B - 1, c.width)], dim=1)
        head_dim = c.width // c.heads
        pos = rope_table(c.window, c.window + B, head_dim, dev)
        ctx_pos = rope_table(c.window - n, c.window, head_dim, dev)
        mask = None
        if ctx_valid is not None:
            see = torch.cat([ctx_valid, torch.ones(N, B, dtype=torch.bool, device=dev)], dim=1)
            mask = see[:, None, None, :]
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, ctx, ctx_pos, mask, None if ctx_kv is None else ctx_kv[i])
        h = self.norm(x)[:, 1:]
        return h, parts.logits(self.out_proj(h))


class BlockDrafter:
    """The plain block drafter: trees from the slot marginals (each slot independent)."""

    kind = "block"
    # a node's children are its depth's slot candidates whatever its path: a tree preset's
    # index path (r1, ..., rd) is slot d's rank-rd candidate (`propose_preset`)
    static_rows = True

    def __init__(self, net: BlockNet, parts: TargetParts, train_top_k: int | None = None):
        self.net = net.eval()
        self.parts = parts
        self.train_top_k = train_top_k
        self.name = self.kind
        self.feature_layers = net.config.feature_layers
        self.ctx = self._empty()
        self.ctx_kv = self._empty_kv()

    # -- state: fused rows of accepted positions only ----------------------------------
    def _empty(self) -> torch.Tensor:
        w = self.net.fc.weight
        return torch.zeros(0, self.net.config.width, device=w.device, dtype=w.dtype)

    def _empty_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the raw keys/values of the context rows (see `Attention.raw_keys`):
        the rows only change when tokens are accepted, so they are projected once, not at
        every draft."""
        with torch.no_grad():
            return [layer.attn.raw_keys(self.ctx) for layer in self.net.layers]

    def _append(self, features: torch.Tensor | None) -> None:
        if features is None:
            raise ValueError("the block drafter needs target features (feature_layers "
                             f"{self.feature_layers}); the engine passed none")
        if features.shape[-2] != len(self.feature_layers):
            raise ValueError(f"expected features of {len(self.feature_layers)} layers, got "
                             f"{features.shape[-2]}")
        window = self.net.config.window
        with torch.no_grad():
            rows = self.net.fuse(features[-window:].to(self.ctx.device))
            new_kv = [layer.attn.raw_keys(rows) for layer in self.net.layers]
        self.ctx = torch.cat([self.ctx, rows])[-window:]
        self.ctx_kv = [(torch.cat([k, nk])[-window:], torch.cat([v, nv])[-window:])
                       for (k, v), (nk, nv) in zip(self.ctx_kv, new_kv)]

    def reset(self, prompt_tokens: list[int], features: torch.Tensor | None,
              last_hidden: torch.Tensor) -> None:
        self.ctx = self._empty()
        self.ctx_kv = self._empty_kv()
        if len(prompt_tokens) > 1:
            self._append(features)

    def observe(self, accepted: Accepted) -> None:
        self._append(accepted.features)

    def context_state(self) -> dict[str, torch.Tensor]:
        return {"ctx": self.ctx.clone()}

    # -- drafting -----------------------------------------------------------------------
    def _check(self, settings: DraftSettings) -> int:
        settings.validate(self.parts.vocab_size)
        trained = self.net.config.block_size
        if settings.block_size > trained:
            raise ValueError(f"this drafter predicts blocks of at most {trained} tokens "
                             f"(root included); block size {settings.block_size} was asked")
        return settings.block_size - 1

    @torch.no_grad()
    def _slots(self, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        h, logits = self.net(self.parts, torch.tensor([root], device=dev), self.ctx[None],
                             ctx_kv=[(k[None], v[None]) for k, v in self.ctx_kv])
        return h[0], logits[0].float()

    def propose(self, ctx: DraftContext) -> Draft:
        S = self._check(ctx.settings)
        h, logits = self._slots(ctx.root_token)
        return self._draft_from_slots(ctx, h[:S], logits[:S])

    def propose_preset(self, ctx: DraftContext, paths: list[list[int]]) -> Draft:
        """The tree of a preset's index paths (parents first): the node at (r1, ..., rd) is
        slot d's rank-rd candidate with its marginal log-prob, every node present."""
        settings = ctx.settings.for_preset(paths)
        S = self._check(settings)
        _, logits = self._slots(ctx.root_token)
        top = torch.log_softmax(logits[:S], dim=-1).topk(settings.top_k, dim=-1)
        vals, ids = top.values.cpu().tolist(), top.indices.cpu().tolist()
        tokens = [ctx.root_token] + [ids[len(p) - 1][p[-1]] for p in paths]
        tree = DraftTree.from_index_paths(paths, tokens)
        tree.logprobs = [0.0] + [vals[len(p) - 1][p[-1]] for p in paths]
        return Draft(tree=tree, details={"drafter": self.kind, "slots": {"candidates": ids, "logprobs": vals}})

    def _draft_from_slots(self, ctx: DraftContext, h: torch.Tensor, logits: torch.Tensor) -> Draft:
        s = ctx.settings
        S = logits.shape[0]
        if s.temperature > 0 and s.tree == "chain":
            probs = torch.softmax(logits / s.temperature, dim=-1)
            tokens = torch.multinomial(probs.cpu(), 1, generator=ctx.generator)[:, 0]
            logp = probs.cpu().gather(1, tokens[:, None])[:, 0].clamp_min(1e-30).log()
            rows = [[(int(tokens[d]), float(logp[d]), d)] for d in range(S)]
            proposal_rows = probs
        else:
            proposal_rows = None
        # The top-k of every slot marginal: the tree's rows, and a table for the views.
        logp = torch.log_softmax(logits, dim=-1)
        top = logp.topk(min(s.top_k, logp.shape[-1]), dim=-1)
        vals, ids = top.values.cpu().tolist(), top.indices.cpu().tolist()
        if proposal_rows is None:
            rows = [[(ids[d][j], vals[d][j], d) for j in range(len(ids[d]))] for d in range(S)]
        tree, nodes = tree_build.build_tree(
            ctx.root_token, tree_build.static_rows(rows), shape=s.tree, top_k=s.top_k,
            budget=s.budget, max_depth=S, prune_tau=s.prune_tau)
        proposal = None
        if proposal_rows is not None:
            proposal = torch.zeros(len(tree), proposal_rows.shape[-1], dtype=torch.float32,
                                   device=proposal_rows.device)
            for i, node in enumerate(nodes[1:], start=1):
                proposal[i] = proposal_rows[node.payload].float()
        return Draft(tree=tree, proposal=proposal, details={
            "drafter": self.kind, "slots": {"candidates": ids, "logprobs": vals}})

    # -- checkpoint -------------------------------------------------------------------------
    def checkpoint_meta(self) -> dict:
        c = self.net.config
        return {"config": dataclasses.asdict(c), "feature_layers": list(c.feature_layers),
                "block_size": c.block_size, "top_k": self.train_top_k, "window": c.window}


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def default_feature_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """Layers spread over the depth, the top block included (its output is the most
    predictive of the next token); the first block is skipped when the target is deep."""
    lo = 1 if num_layers >= 4 else 0
    hi = num_layers - 1
    if count <= 1 or hi == lo:
        return (hi,)
    picks = {round(lo + (hi - lo) * i / (count - 1)) for i in range(count)}
    return tuple(sorted(picks))


def slot_weights(num_slots: int, gamma: float, device=None) -> torch.Tensor:
    """DFlash's per-slot loss weights: exp(-(k-1)/gamma) for slot k = 1..num_slots."""
    k = torch.arange(num_slots, device=device, dtype=torch.float32)
    return torch.exp(-k / gamma)


def default_gamma(block_size: int) -> float:
    """gamma 7 for B=16 and 4 for B=8 (DFlash's choices), interpolated linearly in between."""
    return max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0)


__all__ = ["BlockConfig", "BlockNet", "BlockDrafter", "TargetParts", "Layer", "RMSNorm", "rope",
           "param_count", "default_feature_layers", "slot_weights", "default_gamma"]
