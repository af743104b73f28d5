"""The static pieces every captured graph shares: the packed target and its forwards, the
static recurrent + conv state, and the capture / timing helpers."""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from specla.config import GDNConfig
from specla.graphs.ops import PackedLayer, make_ops, pack_layer
from specla.graphs.whole_step import chain_verify_for, whole_step_for
from specla.model import Factors, GDNForCausalLM, InferenceState, Topology


class StaticState:
    """Recurrent state [L,1,H,K,V] fp32 and conv cache [L,1,C,W] (the last W pre-conv inputs,
    newest last, fla's layout; `conv[..., 1:]` is `InferenceState.conv`), allocated once."""

    def __init__(self, config: GDNConfig, device, dtype):
        c = config
        self.recurrent = torch.zeros(c.num_hidden_layers, 1, c.num_heads, c.head_dim, c.head_v_dim,
                                     device=device, dtype=torch.float32)
        self.conv = torch.zeros(c.num_hidden_layers, 1, c.conv_channels, c.conv_size,
                                device=device, dtype=dtype)

    def copy_(self, other: "StaticState | InferenceState") -> "StaticState":
        if isinstance(other, InferenceState):
            if other.pending is not None:
                raise ValueError("flush the deferred commit before loading an InferenceState")
            self.recurrent.copy_(other.recurrent)
            self.conv[..., 1:].copy_(other.conv)
            self.conv[..., 0].zero_()
        else:
            self.recurrent.copy_(other.recurrent)
            self.conv.copy_(other.conv)
        return self

    def clone(self) -> "StaticState":
        new = StaticState.__new__(StaticState)
        new.recurrent, new.conv = self.recurrent.clone(), self.conv.clone()
        return new

    def to_inference_state(self) -> InferenceState:
        return InferenceState(self.recurrent.clone(), self.conv[..., 1:].clone())


class PackedTarget:
    """The target packed for decoding, with the forwards both graphs capture."""

    def __init__(self, target: GDNForCausalLM, ops: str = "auto"):
        c = self.config = target.config
        self.target, self.device, self.dtype = target, target.device, target.dtype
        self.ops, self.ops_note = make_ops(ops, c, self.device, self.dtype)
        with torch.no_grad():
            self.layers = [pack_layer(block, c) for block in target.model.layers]
            self.embed = target.model.embeddings.weight.detach()
            self.norm_w = target.model.norm.weight.detach()
            self.lm_head = target.lm_head.weight.detach()
        self.ops.plan_l2_prefetch([w for layer in self.layers for w in (layer.w_in, layer.w_o, layer.w_gate_up,
                                                                         layer.w_down)] + [self.lm_head])
        G = c.value_dim if c.use_gate else 0
        C = c.conv_channels
        self.splits = (C, G, c.num_heads, c.num_heads)
        self.index1 = torch.arange(c.conv_size, device=self.device).view(1, -1)
        self.head_fp32 = self._probe_fp32_head()
        self.whole_step, note = whole_step_for(self)
        if self.whole_step is not None:
            self.ops_note += "; " + note
        self._chain_verifiers: dict[tuple, tuple] = {}

    def chain_verifier(self, nodes: int, feature_layers: tuple[int, ...], deferred: bool):
        """(the persistent chain verification for chains of `nodes`, note), or (None, why not);
        built and checked once a shape (graphs of one shape share it: one stream replays them)."""
        key = (nodes, tuple(feature_layers), deferred)
        if key not in self._chain_verifiers:
            self._chain_verifiers[key] = chain_verify_for(self, nodes, tuple(feature_layers), deferred)
        return self._chain_verifiers[key]

    def _probe_fp32_head(self) -> bool:
        """bf16 GEMM with fp32 output for the LM head where cuBLAS offers it: logits keep their
        precision (bf16 logits tie exactly for ~8% of top-2 pairs, a needless source of flips)."""
        if self.device.type != "cuda" or self.dtype == torch.float32:
            return False
        try:
            h = torch.randn(2, self.config.hidden_size, device=self.device, dtype=self.dtype)
            out = torch.mm(h, self.lm_head.t(), out_dtype=torch.float32)
            ref = F.linear(h, self.lm_head).float()
            return bool(out.dtype == torch.float32 and (out - ref).abs().max() < 0.05)
        except Exception:  # noqa: BLE001 - older torch: plain bf16 head
            return False

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = h.reshape(-1, h.shape[-1])
        if self.head_fp32:
            return torch.mm(h, self.lm_head.t(), out_dtype=torch.float32)
        return F.linear(h, self.lm_head).float()

    # pieces shared by the AR step and the tree forward
    def split_in(self, y):
        C, G, H, _ = self.splits
        conv_in = y[..., :C]
        gate = y[..., C:C + G] if G else None
        return conv_in, gate, y[..., C + G:C + G + H], y[..., C + G + H:C + G + 2 * H]

    def attn_out(self, o, gate, layer: PackedLayer):
        c = self.config
        return self.ops.gated_norm_linear(o, gate, layer.o_norm, c.norm_eps, c.output_gate_activation, layer.w_o)

    def mlp(self, x, residual, layer: PackedLayer):
        """The MLP block's output and the residual stream before it."""
        gu, residual = self.ops.norm_linear(x, layer.mlp_norm, self.config.norm_eps, residual, layer.w_gate_up)
        return self.ops.swiglu_linear(gu, layer.w_down), residual

    def ar_forward(self, token: torch.Tensor, state: StaticState) -> torch.Tensor:
        """One token [1,1] -> logits [1, vocab] fp32; the state is updated in place."""
        c, ops = self.config, self.ops
        x, residual = F.embedding(token, self.embed), None
        for l, layer in enumerate(self.layers):
            if ops.conv_in_projection(c):
                y, residual = ops.norm_linear_conv(x, layer.attn_norm, c.norm_eps, residual, layer.w_in,
                                                   state.conv[l], layer, self.index1)
                qkv, gate, a, b = self.split_in(y)
                q, k, v = qkv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
                o = ops.recurrent_step(q.unflatten(-1, (c.num_heads, c.head_dim)),
                                       k.unflatten(-1, (c.num_heads, c.head_dim)),
                                       v.unflatten(-1, (c.num_heads, c.head_v_dim)), a, b, state.recurrent[l],
                                       layer, c)
            else:
                y, residual = ops.norm_linear(x, layer.attn_norm, c.norm_eps, residual, layer.w_in)
                conv_in, gate, a, b = self.split_in(y)
                o = ops.conv_recurrent_step(conv_in, state.conv[l], a, b, state.recurrent[l], layer, c,
                                            self.index1)
            x, residual = self.mlp(self.attn_out(o, gate, layer), residual, layer)
        return ops.norm_logits(x, self.norm_w, c.norm_eps, residual, self.lm_head, self.head)

    def tree_forward(self, tokens: torch.Tensor, state: StaticState, conv_index: torch.Tensor,
                     verify_fn: Callable, factors: Factors | None = None,
                     feature_layers: tuple[int, ...] = ()):
        """All nodes of a draft tree (tokens [1,N], -1 = dummy) from `state`, which only
        `verify_fn(layer, q, k, v, g, beta, S, out)` may write (to fold a pending commit in);
        `out` is None or the (o, delta) buffers it may fill and return.

        Returns logits [N, vocab] fp32, last hidden [N, D], features [N, F, D] or None; the
        factors of every node are written into `factors` ([L,1,N,...] buffers).
        """
        c, ops = self.config, self.ops
        x, residual, feats = F.embedding(tokens.clamp(min=0), self.embed), None, []
        for l, layer in enumerate(self.layers):
            y, residual = ops.norm_linear(x, layer.attn_norm, c.norm_eps, residual, layer.w_in)
            if l > 0 and l - 1 in feature_layers:
                # block l-1's output as the model returns it (residual + x), which this norm
                # has just summed: no separate add
                feats.append(residual)
            conv_in, gate, a, b = self.split_in(y)
            out = None if factors is None else (factors.k[l], factors.g[l], factors.conv_in[l])
            q, k, v, g, beta = ops.conv_gates(conv_in, a, b, state.conv[l][..., 1:], conv_index,
                                              layer, c, out)
            # the deltas are factors: the kernels write them straight into the commit buffer;
            # the outputs in the model's dtype, the gated norm's input (no conversion launch)
            out = None if factors is None else (torch.empty_like(factors.delta[l], dtype=self.dtype),
                                                factors.delta[l])
            o, delta = verify_fn(l, q, k, v, g, beta, state.recurrent[l], out)
            if factors is not None and delta is not factors.delta[l]:
                factors.delta[l].copy_(delta)
            x, residual = self.mlp(self.attn_out(o, gate, layer), residual, layer)
        h, residual = ops.rms_norm(x, self.norm_w, c.norm_eps, residual)
        if len(self.layers) - 1 in feature_layers:
            feats.append(residual)
        features = torch.stack(feats, dim=2)[0] if feats else None
        return self.head(h), h[0], features

    def new_factors(self, n: int) -> Factors:
        c, L = self.config, self.config.num_hidden_layers
        z = dict(device=self.device, dtype=torch.float32)
        return Factors(torch.zeros(L, 1, n, c.num_heads, c.head_dim, **z),
                       torch.zeros(L, 1, n, c.num_heads, c.head_v_dim, **z),
                       torch.zeros(L, 1, n, c.num_heads, **z),
                       torch.zeros(L, 1, n, c.conv_channels, device=self.device, dtype=self.dtype))

    @torch.no_grad()
    def prefill(self, tokens: list[int], feature_layers: tuple[int, ...] = (), chunk: int = 64):
        """Eager chunked prefill of all but the last token through the tree forward (so real
        drafters get the prompt's features). Returns (StaticState, features, last_hidden)."""
        from specla.verify import commit_layer, verify_layer

        state = StaticState(self.config, self.device, self.dtype)
        body, feats, hiddens = tokens[:-1], [], []
        hist = self.config.conv_size - 1
        for start in range(0, len(body), chunk):
            piece = torch.tensor([body[start:start + chunk]], device=self.device)
            n = piece.shape[1]
            topo = Topology.chain(n, self.config.conv_size, self.device)
            factors = self.new_factors(n)

            def verify(l, q, k, v, g, beta, S, out, topo=topo):
                return verify_layer("chain", q, k, v, g, beta, S, topo, out=out)

            _, hidden, f = self.tree_forward(piece, state, topo.conv_index, verify, factors, feature_layers)
            for l in range(self.config.num_hidden_layers):
                commit_layer(state.recurrent[l], factors.k[l], factors.delta[l], factors.g[l])
                window = torch.cat([state.conv[l][..., 1:], factors.conv_in[l].transpose(1, 2)], dim=-1)
                state.conv[l][..., 1:] = window[..., -hist:]
            hiddens.append(hidden)
            if f is not None:
                feats.append(f)
        if not hiddens:
            hiddens = [torch.zeros(0, self.config.hidden_size, device=self.device, dtype=self.dtype)]
        hidden = torch.cat(hiddens)
        return state, (torch.cat(feats) if feats else None), hidden


def capture(fn: Callable[[], None], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (Triton compiles and autotunes there), then capture once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Elapsed milliseconds of a region: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = 1e3 * (time.perf_counter() - self.t0)


class PhaseClock:
    """Per-phase milliseconds of replays, with no host sync until they are read.

    A mark is a CUDA event (on the CPU a perf_counter reading, the eager body having run to
    completion). `stamp()` makes one; `gaps(marks)` waits for the last of them and returns
    the milliseconds between consecutive ones. `mark()` keeps its stamp, and `read()` returns
    the gaps between the marks kept since the previous read.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []
        self.mark()

    def stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self) -> None:
        self.marks.append(self.stamp())

    def restart(self) -> None:
        """Start counting from now (host work since the last mark is not a phase)."""
        self.marks = []
        self.mark()

    def gaps(self, marks: list) -> list[float]:
        if self.cuda:
            marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        return [1e3 * (b - a) for a, b in zip(marks, marks[1:])]

    def read(self) -> list[float]:
        marks, self.marks = self.marks, self.marks[-1:]
        return self.gaps(marks)
