"""Measurement-only machinery: the oracle sweep's phase split, fla's own model as a baseline,
and bandwidth probes."""
from __future__ import annotations

import time

import torch

from specla.config import GDNConfig
from specla.graphs.runtime import StaticState, Stopwatch, capture, sync
from specla.graphs.spec import GraphedSpec, phase_times
from specla.model import GDNForCausalLM


@torch.no_grad()
def oracle_split(spec: GraphedSpec, snapshot: StaticState, root: int, steps: int) -> dict:
    """GPU time per phase: the three phase graphs replayed with events between them."""
    spec.state.reset(snapshot, root)
    spec.draft()
    return phase_times(spec, steps)


def fla_config(config: GDNConfig):
    from fla.models import GatedDeltaNetConfig

    raw = config.to_dict()
    for key in ("model_type", "architectures", "conv_bias"):
        raw.pop(key, None)
    raw.update(fuse_cross_entropy=False, use_cache=True)
    return GatedDeltaNetConfig(**raw)


def build_fla_model(target: GDNForCausalLM):
    """fla's `GatedDeltaNetForCausalLM` holding the same weights (parameter names are equal)."""
    from fla.models import GatedDeltaNetForCausalLM

    if target.config.conv_bias:
        raise ValueError("fla's GatedDeltaNet layer has no conv bias; cannot mirror this target")
    with torch.device(target.device):
        model = GatedDeltaNetForCausalLM(fla_config(target.config))
    model = model.to(target.dtype)
    missing, unexpected = model.load_state_dict(target.state_dict(), strict=False)
    missing = [m for m in missing if not (target.config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"fla model does not mirror ours: missing {missing}, unexpected {unexpected}")
    return model.eval()


class FlaAR:
    """fla's model decoding one token per forward, eagerly with its cache, or captured in one
    CUDA graph with that cache made static.

    fla's cache updates the conv window in place but returns a *new* recurrent-state tensor
    each step, so a captured step would read one tensor and write another. The captured step
    therefore copies the new state back into the tensor it read and points the cache at it
    again (an extra read+write of the state per step, ~1% of a GDN-1.3B step). If capturing
    fla's model fails, `capture` falls back to fla's layer ops called one by one on static
    buffers (`mode == "layer-ops"`), the same kernels without the HF wrapper.
    """

    def __init__(self, model, max_len: int = 4096):
        self.model, self.device = model, next(model.parameters()).device
        self.max_len = max_len
        self.cache, self.graph, self.mode, self.capture_error = None, None, None, None

    def _forward_pieces(self, tokens: list[int], chunk: int):
        """fla forward over `tokens` in pieces of `chunk` carried by its cache (pieces of <= 64
        tokens take fla's fused recurrent path, as its decode does). -> (logits [T,V], cache)"""
        cache, rows = None, []
        for start in range(0, len(tokens), chunk):
            ids = torch.tensor([tokens[start:start + chunk]], device=self.device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0].float())
        return torch.cat(rows), cache

    @torch.no_grad()
    def prefill(self, prompt: list[int], chunk: int = 64) -> torch.Tensor:
        """fla forward over all but the last prompt token; returns its logits [T-1, V]."""
        logits, self.cache = self._forward_pieces(prompt[:-1], chunk)
        self.first = prompt[-1]
        self.prefill_snap = self.snapshot()
        return logits

    @torch.no_grad()
    def full_logits(self, tokens: list[int], chunk: int = 64) -> torch.Tensor:
        """Teacher-forced logits [T, V] over `tokens` (row t predicts token t+1)."""
        return self._forward_pieces(tokens, chunk)[0]

    def _layer_states(self):
        L = len(self.model.model.layers)
        return [self.cache[l] for l in range(L)]

    def snapshot(self):
        return [(s["recurrent_state"].clone(), tuple(t.clone() for t in s["conv_state"]))
                for s in self._layer_states()]

    def restore(self, snap) -> None:
        for s, (rec, conv) in zip(self._layer_states(), snap):
            s["recurrent_state"].copy_(rec)
            for dst, src in zip(s["conv_state"], conv):
                dst.copy_(src)

    @torch.no_grad()
    def eager_generate(self, n: int) -> tuple[list[int], float]:
        """HF-style loop: one forward with the cache per token (launch-bound), from the
        prefilled state."""
        self.restore(self.prefill_snap)
        ids = torch.tensor([[self.first]], device=self.device)
        toks = []
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
            self.cache = out.past_key_values
            ids = out.logits[:, -1:].argmax(-1)
            toks.append(ids)
        sync(self.device)
        ms = 1e3 * (time.perf_counter() - t0)
        return torch.cat(toks).view(-1).tolist(), ms

    # ---- graph
    def _static_buffers(self):
        dev = self.device
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(self.max_len, dtype=torch.long, device=dev)
        self.count = torch.zeros(1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(1, self.model.config.vocab_size, device=dev)
        self.recurrent = [s["recurrent_state"] for s in self._layer_states()]

    def _point_to_static(self) -> None:
        """Make the cache hold the tensors the graph reads (an eager step replaces them)."""
        for state, static in zip(self._layer_states(), self.recurrent):
            state["recurrent_state"] = static

    def _finish(self, logits) -> None:
        nxt = logits.argmax(-1, keepdim=True)
        self.ids.copy_(nxt)
        self.out.index_copy_(0, self.count.clamp(max=self.out.numel() - 1), nxt.view(1))
        self.count.add_(1)
        self.logits.copy_(logits.float())

    def _model_step(self) -> None:
        out = self.model(input_ids=self.ids, past_key_values=self.cache, use_cache=True)
        for state, static in zip(self._layer_states(), self.recurrent):
            if state["recurrent_state"] is not static:
                static.copy_(state["recurrent_state"])
                state["recurrent_state"] = static
        self._finish(out.logits[:, -1])

    def _layer_ops_step(self) -> None:
        """fla's GatedDeltaNet block, written out with its own modules on static buffers."""
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        m = self.model.model
        x = m.embeddings(self.ids)
        for layer, state, static in zip(m.layers, self._layer_states(), self.recurrent):
            attn = layer.attn
            residual, h = x, layer.attn_norm(x)
            cq, ck, cv = state["conv_state"]
            q, _ = attn.q_conv1d(x=attn.q_proj(h), cache=cq, output_final_state=True)
            k, _ = attn.k_conv1d(x=attn.k_proj(h), cache=ck, output_final_state=True)
            v, _ = attn.v_conv1d(x=attn.v_proj(h), cache=cv, output_final_state=True)
            q = q.view(1, 1, attn.num_heads, attn.head_k_dim)
            k = k.view(1, 1, attn.num_heads, attn.head_k_dim)
            v = v.view(1, 1, attn.num_v_heads, attn.head_v_dim)
            o, ht = fused_recurrent_gated_delta_rule(
                q=q, k=k, v=v, g=attn.a_proj(h), beta=attn.b_proj(h), initial_state=static,
                output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=attn.A_log, dt_bias=attn.dt_bias, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=attn.allow_neg_eigval, state_v_first=True)
            static.copy_(ht)
            if attn.use_gate:
                o = attn.o_norm(o, attn.g_proj(h).view(1, 1, attn.num_v_heads, attn.head_v_dim))
            else:
                o = attn.o_norm(o)
            o = attn.o_proj(o.reshape(1, 1, -1))
            if self.model.config.fuse_norm:
                h, residual = layer.mlp_norm(x=o, residual=residual, prenorm=True)
            else:
                residual = residual + o
                h = layer.mlp_norm(residual)
            x = residual + layer.mlp(h)
        self._finish(self.model.lm_head(m.norm(x))[:, -1])

    @torch.no_grad()
    def capture(self) -> str:
        """Capture one decode step (after `prefill`); returns the mode that worked."""
        self.restore(self.prefill_snap)
        self._static_buffers()
        snap = self.prefill_snap
        errors = []
        for mode, fn in (("model", self._model_step), ("layer-ops", self._layer_ops_step)):
            try:
                self.graph = capture(fn)
                self.mode, self._fn = mode, fn
                break
            except Exception as err:  # noqa: BLE001 - record and try the next way
                errors.append(f"{mode}: {type(err).__name__}: {err}")
                torch.cuda.synchronize()
                self._point_to_static()          # a failed step may have swapped the tensors
                self.restore(snap)
        self.capture_error = "; ".join(errors) or None
        self.restore(snap)
        if self.graph is None:
            raise RuntimeError(f"could not capture fla's decode step ({self.capture_error})")
        return self.mode

    @torch.no_grad()
    def graph_generate(self, n: int) -> tuple[list[int], float]:
        """n graph replays from the prefilled state (restored first), timed with events."""
        self._point_to_static()
        self.restore(self.prefill_snap)
        self.ids.fill_(self.first)
        self.count.zero_()
        sync(self.device)
        with Stopwatch(self.device) as sw:
            for _ in range(n):
                self.graph.replay()
        return self.out[:n].tolist(), sw.ms


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 10) -> list[float]:
    """Device-to-device copy rate in GB/s (bytes read + bytes written), random data."""
    n = nbytes // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    rates = []
    for _ in range(repeats):
        sync(device)
        with Stopwatch(device) as sw:
            dst.copy_(src)
        rates.append(2 * nbytes / (sw.ms * 1e6))
    return rates


def decode_bytes(target: GDNForCausalLM) -> dict:
    """Bytes one AR step must move at least: every weight once (one embedding row), the
    recurrent state read and written, the conv window read and written."""
    c = target.config
    params = sum(p.numel() * p.element_size() for p in target.parameters())
    emb = target.model.embeddings.weight
    if not c.tie_word_embeddings:
        params -= emb.numel() * emb.element_size() - c.hidden_size * emb.element_size()
    state = c.state_bytes()
    conv = c.num_hidden_layers * c.conv_channels * c.conv_size * emb.element_size()
    return {"weights": params, "state_rw": 2 * state, "conv_rw": 2 * conv,
            "total": params + 2 * state + 2 * conv}
