"""The Gated DeltaNet target, in plain torch, with the state that speculation needs.

Parameter names match fla's `GatedDeltaNetForCausalLM`, so fla checkpoints load as they
are. What fla's model does not give us, and this runtime does:

* an explicit inference state (per layer: fp32 recurrent state [B, H, K, V] and the
  short-conv window of the last `conv_size - 1` pre-conv q/k/v inputs);
* a forward over a *draft tree* from that state: every node sees only its own ancestors
  in the conv and in the recurrence, and the state is never written;
* per-node factors (k, delta, g, conv inputs) from which `commit` rebuilds the state at
  the end of the accepted path.

One layer, per head (fla's conventions):
    q, k = l2norm(silu(conv(x W_q))), l2norm(silu(conv(x W_k)));  q *= K**-0.5
    v    = silu(conv(x W_v));  g = -exp(A_log) softplus(x W_a + dt_bias);  beta = sigmoid(x W_b)
    S_t  = exp(g) S_{t-1} + k delta^T,  delta = beta (v - (exp(g) S_{t-1})^T k),  o = S_t^T q
    out  = W_o rmsnorm_gated(o, x W_g)
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla.config import GDNConfig
from specla.cpu_linear import Linear, linear
from specla.tree import DraftTree


def inference_cache(owner: nn.Module, name: str, params: list[torch.Tensor], build):
    """`build()` once per set of weights at inference, kept on `owner`; rebuilt on every call
    under autograd.

    Keyed by the weights' storage and version counters, so a reload, a device move or an
    in-place update (an optimizer step between held-out evals) rebuilds it; with autograd
    on (training) it is rebuilt on each call so gradients reach the parameters. On the
    small CPU model the per-call concatenations cost as much as the matmuls they feed.
    Traced by torch.compile, the entry an eager call left is read as it is (the version
    query would break the graph), or built in the graph if there is none.
    """
    if torch.is_grad_enabled():
        return build()
    cached = owner.__dict__.get("_cache_" + name)
    if torch.compiler.is_compiling():
        return build() if cached is None else cached[1]
    # storage and version: an optimizer step writes the weights in place (same storage),
    # and a held-out eval between steps must not see the previous step's concatenation
    key = tuple((p.data_ptr(), 0 if p.is_inference() else p._version) for p in params)
    if cached is None or cached[0] != key:
        cached = owner.__dict__["_cache_" + name] = (key, build())
    return cached[1]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


@dataclasses.dataclass
class InferenceState:
    """What the target carries between steps, for B sequences."""
    recurrent: torch.Tensor          # [L, B, H, K, V] fp32
    conv: torch.Tensor               # [L, B, C, W-1] pre-conv q|k|v inputs, oldest first
    pending: "Factors | None" = None  # accepted factors not yet folded in (deferred commit)

    def clone(self) -> "InferenceState":
        return InferenceState(self.recurrent.clone(), self.conv.clone(),
                              None if self.pending is None else self.pending.clone())


@dataclasses.dataclass
class Factors:
    """Per-node, per-layer factors recorded during verification.

    k [L, B, N, H, K], delta [L, B, N, H, V], g [L, B, N, H] fp32; conv_in [L, B, N, C].
    """
    k: torch.Tensor
    delta: torch.Tensor
    g: torch.Tensor
    conv_in: torch.Tensor

    def select(self, nodes: torch.Tensor | list[int]) -> "Factors":
        idx = torch.as_tensor(nodes, dtype=torch.long, device=self.k.device)
        return Factors(*(t.index_select(2, idx) for t in (self.k, self.delta, self.g, self.conv_in)))

    def clone(self) -> "Factors":
        return Factors(*(t.clone() for t in (self.k, self.delta, self.g, self.conv_in)))

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    def nbytes_per_token_layer(self) -> int:
        return sum(t[0, :, 0].numel() * t.element_size()
                   for t in (self.k, self.delta, self.g, self.conv_in))


@dataclasses.dataclass
class Topology:
    """A draft tree prepared for the forward: parents and conv taps as tensors."""
    tree: DraftTree
    parents: torch.Tensor            # [N] long
    conv_index: torch.Tensor         # [N, W] long
    # Per-backend precomputed tensors (e.g. the hybrid's chain schedule), built once per tree
    # so that a captured CUDA graph never needs the host.
    cache: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, tree: DraftTree, conv_size: int, device: torch.device | str = "cpu") -> "Topology":
        return cls(tree, torch.tensor(tree.parents, device=device),
                   tree.conv_window_index(conv_size).to(device))

    @classmethod
    def chain(cls, n: int, conv_size: int, device: torch.device | str = "cpu") -> "Topology":
        return cls.of(DraftTree.chain([0] * n, max_nodes=max(n, 1)), conv_size, device)


@dataclasses.dataclass
class ForwardOutput:
    logits: torch.Tensor             # [B, N, vocab] fp32
    factors: Factors
    features: torch.Tensor | None    # [B, N, len(feature_layers), D] outputs of chosen layers
    last_hidden: torch.Tensor        # [B, N, D] after the final norm (what the LM head reads)


class GatedDeltaNetMixer(nn.Module):
    """fla's `GatedDeltaNet` layer, split into the pieces the verifier needs."""

    def __init__(self, config: GDNConfig):
        super().__init__()
        c = config
        self.config = c
        self.q_proj = Linear(c.hidden_size, c.key_dim, bias=False)
        self.k_proj = Linear(c.hidden_size, c.key_dim, bias=False)
        self.v_proj = Linear(c.hidden_size, c.value_dim, bias=False)
        self.a_proj = Linear(c.hidden_size, c.num_heads, bias=False)
        self.b_proj = Linear(c.hidden_size, c.num_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(c.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(c.num_heads))
        for name, dim in (("q_conv1d", c.key_dim), ("k_conv1d", c.key_dim), ("v_conv1d", c.value_dim)):
            setattr(self, name, nn.Conv1d(dim, dim, c.conv_size, groups=dim, bias=c.conv_bias))
        if c.use_gate:
            self.g_proj = Linear(c.hidden_size, c.value_dim, bias=False)
        self.o_norm = RMSNorm(c.head_v_dim, c.norm_eps)
        self.o_proj = Linear(c.value_dim, c.hidden_size, bias=False)

    def conv_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Depthwise conv taps of q|k|v as one [C, W] matrix (and bias [C])."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)

        def build():
            weight = torch.cat([c.weight.squeeze(1) for c in convs])
            bias = torch.cat([c.bias for c in convs]) if self.config.conv_bias else None
            return weight, bias
        return inference_cache(self, "conv", [c.weight for c in convs], build)

    def tree_conv(self, x: torch.Tensor, window: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Short causal conv along each node's ancestor path. x [B,N,C], window [B,C,W-1]."""
        weight, bias = self.conv_weight()
        history = torch.cat([window.transpose(1, 2).to(x.dtype), x], dim=1)   # [B, W-1+N, C]
        B, N, C = x.shape
        # one flat gather and a multiply-add over the W taps: on the CPU the advanced index
        # and the einsum (a permuted bmm) cost several times more for these tiny shapes
        taps = history.index_select(1, index.flatten()).view(B, N, index.shape[1], C)
        out = (taps * weight.t().to(x.dtype)).sum(2)
        if bias is not None:
            out = out + bias
        return F.silu(out)

    def input_projection(self, h: torch.Tensor) -> torch.Tensor:
        """q|k|v|a|b(|g) projections as one matmul (one weight read per step, not six)."""
        parts = [self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj]
        if self.config.use_gate:
            parts.append(self.g_proj)
        weights = [p.weight for p in parts]
        return linear(h, inference_cache(self, "in_proj", weights, lambda: torch.cat(weights)))

    def qkv_gates(self, h: torch.Tensor, window: torch.Tensor, topo: Topology):
        """Everything of the layer that comes before the recurrence, and the output gate."""
        c = self.config
        B, N, _ = h.shape
        sizes = [2 * c.key_dim + c.value_dim, c.num_heads, c.num_heads]
        if c.use_gate:
            sizes.append(c.value_dim)
        conv_in, a, b, *gate = self.input_projection(h).split(sizes, dim=-1)
        qkv = self.tree_conv(conv_in, window, topo.conv_index)
        q, k, v = qkv.float().split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = l2norm(q.reshape(B, N, c.num_heads, c.head_dim)) * c.head_dim ** -0.5
        k = l2norm(k.reshape(B, N, c.num_heads, c.head_dim))
        v = v.reshape(B, N, c.num_heads, c.head_v_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = b.float().sigmoid()
        if c.allow_neg_eigval:
            beta = beta * 2
        return q, k, v, g, beta, conv_in, (gate[0] if gate else None)

    def output(self, o: torch.Tensor, h: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        B, N = h.shape[:2]
        c = self.config
        o = self.o_norm(o.to(h.dtype) if h.dtype != torch.float32 else o)
        if gate is not None:
            gate = gate.reshape(B, N, c.num_heads, c.head_v_dim)
            o = o * (F.silu(gate) if c.output_gate_activation in ("swish", "silu") else gate.sigmoid())
        return self.o_proj(o.reshape(B, N, c.value_dim).to(h.dtype))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # fla's kernels: x / sqrt(sum(x^2) + 1e-6)
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedMLP(nn.Module):
    def __init__(self, config: GDNConfig):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.mlp_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.mlp_size, bias=False)
        self.down_proj = Linear(config.mlp_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: GDNConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = GatedDeltaNetMixer(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = GatedMLP(config)


class Backbone(nn.Module):
    def __init__(self, config: GDNConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)


class GDNForCausalLM(nn.Module):
    def __init__(self, config: GDNConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_state(self, batch: int = 1) -> InferenceState:
        c = self.config
        return InferenceState(
            recurrent=torch.zeros(c.num_hidden_layers, batch, c.num_heads, c.head_dim, c.head_v_dim,
                                  device=self.device, dtype=torch.float32),
            conv=torch.zeros(c.num_hidden_layers, batch, c.conv_channels, c.conv_size - 1,
                             device=self.device, dtype=self.dtype))

    def topology(self, tree: DraftTree) -> Topology:
        return Topology.of(tree, self.config.conv_size, self.device)

    def forward(self, tokens: torch.Tensor, state: InferenceState, topo: Topology,
                mode: str = "tree", feature_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Run N nodes (tokens [B, N]) arranged as `topo` from `state`, without writing it.

        If `state.pending` holds deferred factors they are folded into the state first, layer
        by layer, inside the same pass (that is the deferred commit), and cleared.
        """
        from specla.verify import verify_layer  # the recurrence dispatch (references or kernels)

        x = self.model.embeddings(tokens)
        pending, state.pending = state.pending, None
        ks, deltas, gs, conv_ins, feats = [], [], [], [], []
        for layer_idx, block in enumerate(self.model.layers):
            layer_pending = None
            if pending is not None:
                fold_conv_window(state, pending, layer_idx)
                layer_pending = (pending.k[layer_idx], pending.delta[layer_idx], pending.g[layer_idx])
            h = block.attn_norm(x)
            q, k, v, g, beta, conv_in, gate = block.attn.qkv_gates(h, state.conv[layer_idx], topo)
            # With a pending commit the verifier first folds it into the state (written once),
            # then verifies from the folded state: the deferred commit rides on this pass.
            o, delta = verify_layer(mode, q, k, v, g, beta, state.recurrent[layer_idx], topo,
                                    pending=layer_pending)
            x = x + block.attn.output(o, h, gate)
            x = x + block.mlp(block.mlp_norm(x))
            ks.append(k), deltas.append(delta), gs.append(g), conv_ins.append(conv_in)
            if layer_idx in feature_layers:
                feats.append(x)
        last_hidden = self.model.norm(x)
        logits = self.lm_head(last_hidden).float()
        factors = Factors(torch.stack(ks), torch.stack(deltas), torch.stack(gs), torch.stack(conv_ins))
        features = torch.stack(feats, dim=2) if feats else None
        return ForwardOutput(logits, factors, features, last_hidden)


def fold_pending(state: InferenceState, factors: Factors, layer_idx: int) -> None:
    """Apply one layer's accepted factors (in path order) to the state, in place."""
    from specla.verify import commit_layer

    l = layer_idx
    commit_layer(state.recurrent[l], factors.k[l], factors.delta[l], factors.g[l])
    fold_conv_window(state, factors, l)


def fold_conv_window(state: InferenceState, factors: Factors, l: int) -> None:
    """The new conv window: the last W-1 pre-conv inputs along the accepted path."""
    hist = state.conv.shape[-1]
    window = torch.cat([state.conv[l], factors.conv_in[l].transpose(1, 2).to(state.conv.dtype)], dim=-1)
    state.conv[l] = window[..., -hist:]


def commit(state: InferenceState, factors: Factors, path: list[int], deferred: bool = False) -> None:
    """Make the accepted path part of the state: now, or pending until the next forward."""
    accepted = factors.select(path)
    if state.pending is not None:  # an earlier deferred commit comes first
        accepted = Factors(*(torch.cat([a, b], dim=2) for a, b in zip(
            (state.pending.k, state.pending.delta, state.pending.g, state.pending.conv_in),
            (accepted.k, accepted.delta, accepted.g, accepted.conv_in))))
        state.pending = None
    if deferred:
        state.pending = accepted
        return
    for layer_idx in range(state.recurrent.shape[0]):
        fold_pending(state, accepted, layer_idx)


def flush(state: InferenceState) -> None:
    """Fold any deferred commit in now (end of generation, or before a plain AR step)."""
    if state.pending is not None:
        pending, state.pending = state.pending, None
        for layer_idx in range(state.recurrent.shape[0]):
            fold_pending(state, pending, layer_idx)


def init_like_fla(model: GDNForCausalLM, seed: int = 0) -> GDNForCausalLM:
    """Random weights drawn the way fla initialises a fresh GatedDeltaNet (std 0.02 linears,
    A in U(0, 16), dt in [1e-3, 0.1]), so decays and logits have realistic scales."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen, device=p.device).mul(16).clamp_min(1e-4).log())
            elif name.endswith("dt_bias"):
                u = torch.rand(p.shape, generator=gen, device=p.device)
                dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))       # inverse softplus
            elif "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def random_gdn(config: GDNConfig, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, seed: int = 0) -> GDNForCausalLM:
    """A random-weight target built directly on `device` (a 1.3B model inits in a second on GPU)."""
    with torch.device(device):
        model = GDNForCausalLM(config)
    init_like_fla(model, seed)
    return model.to(dtype).eval()
