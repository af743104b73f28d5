"""CUDA-graph runtime: the AR baseline and the speculative step, each one graph replay.

Eager PyTorch spends far more time launching kernels than a GDN-1.3B decode step needs on
the GPU (DESIGN.md section 7: ~35-67 ms eager against ~2 ms in one graph), so both sides of
every speedup run here as captured graphs over static buffers allocated once:

* `Runtime`: the target's weights packed for decoding (q|k|v|gate|a|b as one matrix,
  gate|up as one) and the per-layer ops: fla's fused Triton kernels on CUDA (`FlaOps`), plain
  torch elsewhere (`TorchOps`, operation for operation what `specla.model` computes).
* `GraphedAR`: one token per replay. The greedy argmax is written back into the static input
  token buffer and appended to a device buffer at a device counter, so `generate` replays
  with no host sync until it reads the tokens once at the end.
* `GraphedSpec`: one speculative step per replay for one draft topology. Verify all nodes from
  the static state (the previous step's deferred commit folded in by the verifier), greedy
  acceptance with tensor ops, the accepted path's factors copied into pending buffers padded
  to the longest path (a padded entry k=0, delta=0, g=0 is an exact no-op), and, with the
  `DeviceOracle` or a device drafter (`specla.device_drafter`), the next draft: a whole
  decode then needs no host work at all.
* fla baselines: fla's own `GatedDeltaNetForCausalLM` eager with its cache (`FlaAR.eager_*`)
  and the same model captured in one graph with a static cache (`FlaAR.capture`).

Every body also runs eagerly (`use_graph=False`), on the CPU too: the tests check the logic
there, and a failed capture can fall back to it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from kernels import reference
from specla.config import GDNConfig
from specla.model import Factors, GDNForCausalLM, InferenceState, Topology, l2norm
from specla.tree import DraftTree


# --------------------------------------------------------------------------- random targets

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


def random_target(config: GDNConfig, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, seed: int = 0) -> GDNForCausalLM:
    """A random-weight target built directly on `device` (a 1.3B model inits in a second on GPU)."""
    with torch.device(device):
        model = GDNForCausalLM(config)
    init_like_fla(model, seed)
    return model.to(dtype).eval()


# --------------------------------------------------------------------------- packed weights

@dataclasses.dataclass
class PackedLayer:
    attn_norm: torch.Tensor
    w_in: torch.Tensor        # [C + G + 2H, D]: q|k|v (conv inputs), output gate (G rows), a, b
    conv_w: torch.Tensor      # [C, W]
    conv_b: torch.Tensor | None
    A_log: torch.Tensor       # fp32 [H] (the checkpoint's values, as fla reads them)
    neg_A: torch.Tensor       # fp32 -exp(A_log), computed once instead of every step
    dt_bias: torch.Tensor     # fp32 [H]
    o_norm: torch.Tensor
    w_o: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor   # [2I, D]
    w_down: torch.Tensor


def pack_layer(block, config: GDNConfig) -> PackedLayer:
    attn, mlp = block.attn, block.mlp
    mats = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    if config.use_gate:
        mats.append(attn.g_proj.weight)
    mats += [attn.a_proj.weight, attn.b_proj.weight]
    conv_w, conv_b = attn.conv_weight()
    A_log = attn.A_log.detach().float().contiguous()
    return PackedLayer(
        attn_norm=block.attn_norm.weight.detach(),
        w_in=torch.cat([m.detach() for m in mats]).contiguous(),
        conv_w=conv_w.detach().contiguous(),
        conv_b=None if conv_b is None else conv_b.detach().contiguous(),
        A_log=A_log, neg_A=-A_log.exp(),
        dt_bias=attn.dt_bias.detach().float().contiguous(),
        o_norm=attn.o_norm.weight.detach(),
        w_o=attn.o_proj.weight.detach(),
        mlp_norm=block.mlp_norm.weight.detach(),
        w_gate_up=torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).contiguous(),
        w_down=mlp.down_proj.weight.detach())


# --------------------------------------------------------------------------- per-layer ops

def gdn_gates(q, k, v, a, b, layer: PackedLayer, config: GDNConfig):
    """q, k, v raw conv outputs [B,N,H,*]; a, b raw projections [B,N,H] -> recurrence inputs,
    with the model's arithmetic (`GatedDeltaNetMixer.qkv_gates`)."""
    q = l2norm(q.float()) * config.head_dim ** -0.5
    k = l2norm(k.float())
    g = layer.neg_A * F.softplus(a.float() + layer.dt_bias)
    beta = b.float().sigmoid()
    if config.allow_neg_eigval:
        beta = beta * 2
    return q, k, v.float(), g, beta


class TorchOps:
    """Plain torch, operation for operation what `specla.model` computes (the CPU path, and
    the reference the fused kernels are checked against)."""
    name = "torch"

    def rms_norm(self, x, weight, eps, residual=None):
        """(norm(residual + x), residual + x): the residual add rides on the norm."""
        if residual is not None:
            x = residual + x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * weight.float()).to(x.dtype), x

    def gated_norm(self, o, gate, weight, eps, activation):
        dtype = weight.dtype if gate is None else gate.dtype
        y, _ = self.rms_norm(o.to(dtype), weight, eps)
        if gate is None:
            return y
        return y * (F.silu(gate) if activation in ("swish", "silu") else gate.sigmoid())

    def swiglu(self, gate, up):
        return F.silu(gate) * up

    def conv(self, x, window, index, weight, bias):
        """Short conv along each node's ancestor path: x [1,N,C], window [1,C,W-1] (oldest
        first), index [N,W] into concat(window, x). `GatedDeltaNetMixer.tree_conv`'s arithmetic."""
        history = torch.cat([window.transpose(1, 2).to(x.dtype), x], dim=1)
        out = (history[:, index] * weight.t().to(x.dtype)).sum(2)
        if bias is not None:
            out = out + bias
        return F.silu(out)

    def conv_gates(self, x, a, b, window, index, layer: "PackedLayer", config: GDNConfig, out=None):
        """Conv of x [1,N,C] along each node's path, then the recurrence inputs (q, k, v, g,
        beta) with the gate and beta projections a, b [1,N,H]. `out`
        (k [1,N,H,K], g [1,N,H], x [1,N,C] buffers, or None) receives the commit factors;
        the k and g returned are those buffers then."""
        C = config.conv_channels
        H, K = config.num_heads, config.head_dim
        qkv = self.conv(x, window, index, layer.conv_w, layer.conv_b)
        q, k, v = qkv[..., :H * K], qkv[..., H * K:2 * H * K], qkv[..., 2 * H * K:C]
        N = x.shape[1]
        q, k, v, g, beta = gdn_gates(q.view(1, N, H, K), k.view(1, N, H, K),
                                     v.view(1, N, H, config.head_v_dim), a, b, layer, config)
        if out is not None:
            k_out, g_out, x_out = out
            k_out.copy_(k), g_out.copy_(g), x_out.copy_(x)
            k, g = k_out, g_out
        return q, k, v, g, beta

    def conv_step(self, x, cache, weight, bias, index1):
        """One token: x [1,1,C]; cache [1,C,W] holds the last W inputs (newest last), updated
        in place."""
        y = self.conv(x, cache[..., 1:], index1, weight, bias)
        cache.copy_(torch.cat([cache[..., 1:], x.transpose(1, 2).to(cache.dtype)], dim=-1))
        return y

    def recurrent_step(self, q, k, v, a, b, S, layer: PackedLayer, config: GDNConfig):
        """One token of the gated delta rule, S [1,H,K,V] fp32 updated in place with the ops of
        `kernels.reference.gated_delta_step` (so the state equals a factor commit bit for bit)."""
        q, k, v, g, beta = gdn_gates(q, k, v, a, b, layer, config)
        q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
        S.mul_(g.exp()[..., None, None])
        delta = beta[..., None] * (v - (S * k[..., None]).sum(-2))
        S.add_(k[..., :, None] * delta[..., None, :])
        return (S * q[..., None]).sum(-2)[:, None]


class FlaOps(TorchOps):
    """fla's fused Triton kernels: residual add + RMSNorm in one kernel, the conv update in
    place on the cache, the whole recurrence (l2norm, gates, beta, state update) in one
    kernel writing the state in place, gated RMSNorm and SwiGLU in one kernel each."""
    name = "fla"

    def __init__(self):
        from fla.modules.activations import swiglu
        from fla.modules.causal_conv1d.ops import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.modules.norm.layernorm import rms_norm
        from fla.ops.gated_delta_rule import fused_recurrent

        self._rms_norm, self._rms_norm_gated, self._swiglu = rms_norm, rms_norm_gated, swiglu
        self._conv_update = causal_conv1d_update
        self._recurrent = fused_recurrent.fused_recurrent_gated_delta_rule
        self._recurrent_kernel = fused_recurrent.fused_recurrent_gated_delta_rule_fwd_kernel
        # fla's wrapper allocates a new final state each call; launching its kernel with
        # h0 = ht = S updates the state in place (each program owns one [K, BV] tile). The
        # self-check turns this off if the launch does not match the wrapper.
        self.inplace_recurrent = True
        # the verify forward's conv + gates in one kernel; off if its self-check fails
        self.fused_conv_gates = True

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is None:
            return self._rms_norm(x, weight, None, eps=eps), x
        y, res = self._rms_norm(x, weight, None, residual=residual, eps=eps, prenorm=True)
        return y, res

    def gated_norm(self, o, gate, weight, eps, activation):
        if gate is None:
            return self._rms_norm(o.to(weight.dtype), weight, None, eps=eps)
        return self._rms_norm_gated(o.to(gate.dtype), gate, weight, None, activation=activation, eps=eps)

    def swiglu(self, gate, up):
        return self._swiglu(gate, up)

    def conv(self, x, window, index, weight, bias):
        # fp32 accumulation and one rounding, as fla's conv update kernel does for AR steps
        return reference.tree_conv_ref(x, window, index, weight, bias)

    def conv_gates(self, x, a, b, window, index, layer: "PackedLayer", config: GDNConfig, out=None):
        """`TorchOps.conv_gates` in one Triton launch (`kernels/triton_conv_gates.py`), which
        writes the factors into `out` itself."""
        if not self.fused_conv_gates:
            return super().conv_gates(x, a, b, window, index, layer, config, out)
        from kernels.triton_conv_gates import conv_gates

        k_out, g_out, x_out = out if out is not None else (None, None, None)
        return conv_gates(x, window, index, layer.conv_w, layer.conv_b, a, b, layer.neg_A,
                          layer.dt_bias, config.head_dim, config.head_v_dim, config.allow_neg_eigval,
                          k_out=k_out, g_out=g_out, x_out=x_out)

    def conv_step(self, x, cache, weight, bias, index1):
        y, _ = self._conv_update(x=x, cache=cache, weight=weight, bias=bias, activation="silu")
        return y

    def recurrent_step(self, q, k, v, a, b, S, layer: PackedLayer, config: GDNConfig):
        scale = config.head_dim ** -0.5
        if not self.inplace_recurrent:
            o, ht = self._recurrent(
                q=q, k=k, v=v, g=a, beta=b, scale=scale, initial_state=S, output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=layer.A_log,
                dt_bias=layer.dt_bias, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=config.allow_neg_eigval)
            S.copy_(ht)
            return o
        return self.recurrent_inplace(q, k, v, a, b, S, layer.A_log, layer.dt_bias, scale,
                                      config.allow_neg_eigval)

    def recurrent_inplace(self, q, k, v, a, b, S, A_log, dt_bias, scale, neg_eigval):
        import triton

        B, T, H, K = k.shape
        V = v.shape[-1]
        o = torch.empty(v.shape, dtype=v.dtype, device=v.device)   # dense [B,T,H,V]
        BK, BV = triton.next_power_of_2(K), min(8, triton.next_power_of_2(V))
        grid = (triton.cdiv(V, BV) * B * H,)
        self._recurrent_kernel[grid](
            q=q, k=k, v=v, g=a, gk=None, gv=None, beta=b, A_log=A_log, dt_bias=dt_bias, o=o,
            h0=S, ht=S, cu_seqlens=None, scale=scale, T=T, H=H, HV=H, K=K, V=V, BK=BK, BV=BV,
            IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=True,
            ALLOW_NEG_EIGVAL=neg_eigval, STATE_V_FIRST=False, num_warps=1, num_stages=3)
        return o


def check_ops(ops: TorchOps, config: GDNConfig, device, dtype, seed: int = 0) -> list[str]:
    """Compare every op of `ops` with TorchOps on random data; returns the failures."""
    ref, failures = TorchOps(), []
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    def close(name, got, want, tol):
        err = (got.float() - want.float()).abs().max().item()
        if not err <= tol * (1 + want.float().abs().max().item()):
            failures.append(f"{name}: max abs err {err:.3g}")

    H, K, Vh = config.num_heads, config.head_dim, config.head_v_dim
    D, W = config.hidden_size, config.conv_size
    C = config.conv_channels
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    x, res, w = rnd(1, 3, D), rnd(1, 3, D), rnd(D, scale=0.1) + 1
    for with_res in (False, True):
        got = ops.rms_norm(x, w, config.norm_eps, res if with_res else None)
        want = ref.rms_norm(x, w, config.norm_eps, res if with_res else None)
        close(f"rms_norm(res={with_res})", got[0], want[0], tol)
        close(f"rms_norm residual(res={with_res})", got[1], want[1], tol)
    o, gate, wo = rnd(1, 3, H, Vh, dt=torch.float32), rnd(1, 3, H, Vh), rnd(Vh, scale=0.1) + 1
    act = config.output_gate_activation
    close("gated_norm", ops.gated_norm(o, gate, wo, config.norm_eps, act),
          ref.gated_norm(o, gate, wo, config.norm_eps, act), tol)
    gu = rnd(1, 3, 64)
    close("swiglu", ops.swiglu(gu[..., :32], gu[..., 32:]), ref.swiglu(gu[..., :32], gu[..., 32:]), tol)
    xin, cw = rnd(1, 1, C), rnd(C, W, scale=0.5)
    cache1, cache2 = rnd(1, C, W), None
    cache2 = cache1.clone()
    index1 = torch.arange(W, device=device).view(1, W)
    close("conv_step", ops.conv_step(xin, cache1, cw, None, index1),
          ref.conv_step(xin, cache2, cw, None, index1), tol)
    close("conv_step cache", cache1, cache2, tol)
    layer = PackedLayer(attn_norm=w, w_in=w, conv_w=cw, conv_b=None,
                        A_log=(torch.rand(H, generator=gen) * 2).to(device),
                        neg_A=None, dt_bias=(torch.randn(H, generator=gen) * 0.5).to(device),
                        o_norm=wo, w_o=wo, mlp_norm=w, w_gate_up=w, w_down=w)
    layer.neg_A = -layer.A_log.exp()
    q, k, v, a, b = rnd(1, 1, H, K), rnd(1, 1, H, K), rnd(1, 1, H, Vh), rnd(1, 1, H), rnd(1, 1, H)
    S1 = torch.randn(1, H, K, Vh, generator=gen).to(device) * 0.1
    S2 = S1.clone()
    close("recurrent_step", ops.recurrent_step(q, k, v, a, b, S1, layer, config),
          ref.recurrent_step(q, k, v, a, b, S2, layer, config), tol)
    close("recurrent_step state", S1, S2, 1e-4 if dtype == torch.float32 else 2e-3)
    # the verify forward's conv + gates: 5 nodes of a small tree, projections strided as
    # slices of one matrix product's output
    N, G = 5, 2 * H + 3
    proj = rnd(1, N, C + G)
    xs, a5, b5 = proj[..., :C], proj[..., C:C + H], proj[..., C + H:C + 2 * H]
    window = rnd(1, C, W)[..., 1:]
    parents = [-1, 0, 1, 0, 3]
    index = torch.zeros(N, W, dtype=torch.long)
    for n in range(N):       # a node's window: the committed tail, then its ancestors, then itself
        path, p = [], n
        while p >= 0:
            path.append(W - 1 + p)
            p = parents[p]
        index[n] = torch.tensor((list(range(W - 1)) + path[::-1])[-W:])
    index = index.to(device)
    buffers = [(torch.zeros(1, N, H, K, device=device), torch.zeros(1, N, H, device=device),
                torch.zeros(1, N, C, device=device, dtype=dtype)) for _ in range(2)]
    try:
        got = ops.conv_gates(xs, a5, b5, window, index, layer, config, buffers[0])
    except Exception as err:  # noqa: BLE001 - a kernel that does not compile fails its check
        failures.append(f"conv_gates: {type(err).__name__}: {err}")
        return failures
    want = ref.conv_gates(xs, a5, b5, window, index, layer, config, buffers[1])
    for name, x1, x2 in zip(("q", "k", "v", "g", "beta"), got, want):
        close(f"conv_gates {name}", x1, x2, tol)
    for name, x1, x2 in zip(("k", "g", "x"), *buffers):
        close(f"conv_gates factor {name}", x1, x2, tol)
    return failures


def make_ops(name: str, config: GDNConfig, device, dtype) -> tuple[TorchOps, str]:
    """The op set for `name` (auto | fla | torch) and a note saying what was chosen and why."""
    device = torch.device(device)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchOps(), "torch ops" + ("" if name == "torch" else " (no CUDA)")
    try:
        ops = FlaOps()
        # the in-place launch of fla's recurrent kernel must match fla's own wrapper
        probe = check_ops(ops, config, device, dtype)
        if any(f.startswith("recurrent") for f in probe):
            ops.inplace_recurrent = False
            probe = check_ops(ops, config, device, dtype)
        if any(f.startswith("conv_gates") for f in probe):
            ops.fused_conv_gates = False
            probe = check_ops(ops, config, device, dtype)
        if probe:
            raise RuntimeError("; ".join(probe))
        note = ("fla fused kernels" + ("" if ops.inplace_recurrent else " (recurrent state copied back)")
                + ("" if ops.fused_conv_gates else " (conv + gates unfused: its kernel failed its check)"))
        return ops, note
    except Exception as err:  # noqa: BLE001 - any failure means: use the plain-torch ops
        if name == "fla":
            raise
        return TorchOps(), f"torch ops (fla kernels unusable: {type(err).__name__}: {err})"


# --------------------------------------------------------------------------- static state

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


# --------------------------------------------------------------------------- the runtime

class Runtime:
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
        G = c.value_dim if c.use_gate else 0
        C = c.conv_channels
        self.splits = (C, G, c.num_heads, c.num_heads)
        self.index1 = torch.arange(c.conv_size, device=self.device).view(1, -1)
        self.head_fp32 = self._probe_fp32_head()

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

    def split_qkv(self, qkv):
        c = self.config
        B, N = qkv.shape[:2]
        q = qkv[..., :c.key_dim].view(B, N, c.num_heads, c.head_dim)
        k = qkv[..., c.key_dim:2 * c.key_dim].view(B, N, c.num_heads, c.head_dim)
        v = qkv[..., 2 * c.key_dim:].view(B, N, c.num_heads, c.head_v_dim)
        return q, k, v

    def attn_out(self, o, gate, layer: PackedLayer):
        c = self.config
        B, N = o.shape[:2]
        if gate is not None:
            gate = gate.view(B, N, c.num_heads, c.head_v_dim)
        o = self.ops.gated_norm(o, gate, layer.o_norm, c.norm_eps, c.output_gate_activation)
        return F.linear(o.reshape(B, N, c.value_dim).to(self.dtype), layer.w_o)

    def mlp(self, h, layer: PackedLayer):
        I = self.config.mlp_size
        gu = F.linear(h, layer.w_gate_up)
        return F.linear(self.ops.swiglu(gu[..., :I], gu[..., I:]), layer.w_down)

    def ar_forward(self, token: torch.Tensor, state: StaticState) -> torch.Tensor:
        """One token [1,1] -> logits [1, vocab] fp32; the state is updated in place."""
        c, ops = self.config, self.ops
        x, residual = F.embedding(token, self.embed), None
        for l, layer in enumerate(self.layers):
            h, residual = ops.rms_norm(x, layer.attn_norm, c.norm_eps, residual)
            conv_in, gate, a, b = self.split_in(F.linear(h, layer.w_in))
            qkv = ops.conv_step(conv_in, state.conv[l], layer.conv_w, layer.conv_b, self.index1)
            q, k, v = self.split_qkv(qkv)
            o = ops.recurrent_step(q, k, v, a, b, state.recurrent[l], layer, c)
            x = self.attn_out(o, gate, layer)
            h, residual = ops.rms_norm(x, layer.mlp_norm, c.norm_eps, residual)
            x = self.mlp(h, layer)
        h, _ = ops.rms_norm(x, self.norm_w, c.norm_eps, residual)
        return self.head(h)

    def tree_forward(self, tokens: torch.Tensor, state: StaticState, conv_index: torch.Tensor,
                     verify_fn: Callable, factors: Factors | None = None,
                     feature_layers: tuple[int, ...] = ()):
        """All nodes of a draft tree (tokens [1,N], -1 = dummy) from `state`, which only
        `verify_fn(layer, q, k, v, g, beta, S)` may write (to fold a pending commit in).

        Returns logits [N, vocab] fp32, last hidden [N, D], features [N, F, D] or None; the
        factors of every node are written into `factors` ([L,1,N,...] buffers).
        """
        c, ops = self.config, self.ops
        x, residual, feats = F.embedding(tokens.clamp(min=0), self.embed), None, []
        for l, layer in enumerate(self.layers):
            h, residual = ops.rms_norm(x, layer.attn_norm, c.norm_eps, residual)
            conv_in, gate, a, b = self.split_in(F.linear(h, layer.w_in))
            out = None if factors is None else (factors.k[l], factors.g[l], factors.conv_in[l])
            q, k, v, g, beta = ops.conv_gates(conv_in, a, b, state.conv[l][..., 1:], conv_index,
                                              layer, c, out)
            o, delta = verify_fn(l, q, k, v, g, beta, state.recurrent[l])
            if factors is not None:
                factors.delta[l].copy_(delta)
            x = self.attn_out(o, gate, layer)
            h, residual = ops.rms_norm(x, layer.mlp_norm, c.norm_eps, residual)
            x = self.mlp(h, layer)
            if l in feature_layers:
                feats.append(residual + x)        # the block's output, as the model returns it
        h, _ = ops.rms_norm(x, self.norm_w, c.norm_eps, residual)
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

            def verify(l, q, k, v, g, beta, S, topo=topo):
                return verify_layer("chain", q, k, v, g, beta, S, topo)

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


# --------------------------------------------------------------------------- graph helpers

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


# --------------------------------------------------------------------------- AR baseline

class GraphedAR:
    """The AR baseline: one target token per graph replay, no host sync until the end."""

    @torch.no_grad()
    def __init__(self, target_or_runtime: GDNForCausalLM | Runtime, max_len: int = 4096,
                 ops: str = "auto", use_graph: bool | None = None, temperature: float = 0.0):
        rt = target_or_runtime if isinstance(target_or_runtime, Runtime) else Runtime(target_or_runtime, ops)
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
        logits = self.rt.ar_forward(self.token, self.state)
        if self.temperature > 0:
            # Gumbel-max sampling without a host sync: argmax(p / Exp(1)) ~ Categorical(p)
            probs = torch.softmax(logits / self.temperature, dim=-1)
            nxt = (probs / torch.empty_like(probs).exponential_()).argmax(-1, keepdim=True)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        self.token.copy_(nxt)
        self.out.index_copy_(0, self.count.clamp(max=self.out.numel() - 1), nxt.view(1))
        self.count.add_(1)
        self.logits.copy_(logits)

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
        return self.out[:n].tolist()

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
        return self.out[:n].tolist(), sw.ms

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


# --------------------------------------------------------------------------- speculative step

class SpecTopology:
    """A draft tree's shape as static device tensors: everything verification, acceptance,
    commit and the device oracle need, so none of them asks the host during a replay.

    `load(tree)` rewrites them in place for another tree of the same node count: a graph
    captured with "tree" verification (whose kernels read the parents from the device) then
    serves every tree of that size (`pad_tree` fills smaller ones with dummy nodes).
    """

    def __init__(self, tree: DraftTree, conv_size: int, max_path: int, device):
        self.conv_size, self.max_path, self.n = conv_size, max_path, len(tree)
        host = self._host(tree)
        self.model_topo = Topology(tree, host.pop("parents_raw").to(device),
                                   host.pop("conv_index").to(device))
        self.conv_index = self.model_topo.conv_index
        for name, value in host.items():
            setattr(self, name, value.to(device))
        self.tree = tree
        self.arange_p = torch.arange(max_path, device=device)

    def _host(self, tree: DraftTree) -> dict[str, torch.Tensor]:
        n, P = len(tree), self.max_path
        if n != self.n:
            raise ValueError(f"a topology of {self.n} nodes cannot hold a tree of {n}")
        if tree.depth + 1 > P:
            raise ValueError(f"tree depth {tree.depth} needs paths of {tree.depth + 1} > {P}")
        anc = tree.ancestor_mask()
        earlier = torch.zeros(n, n)
        for kids in tree.children:
            for r, i in enumerate(kids):
                earlier[i, kids[:r]] = 1.0
        path = torch.zeros(n, P, dtype=torch.long)
        for i in range(n):
            nodes = tree.path_to(i)
            path[i, :len(nodes)] = torch.tensor(nodes)
        # the "main line": root, then each main node's first child (the device oracle puts the
        # true continuation only there; for a chain every node is on it)
        main = [True] + [False] * (n - 1)
        for i in range(1, n):
            p = tree.parents[i]
            main[i] = main[p] and tree.children[p][0] == i
        return {"parents_raw": torch.tensor(tree.parents),
                "conv_index": tree.conv_window_index(self.conv_size),
                "parent": torch.tensor([max(p, 0) for p in tree.parents]),
                "anc": anc.float(),
                "anc_or_self": (anc | torch.eye(n, dtype=torch.bool)).float(),
                "earlier_sibling": earlier,
                "is_root": torch.arange(n) == 0,
                "depth": torch.tensor(tree.depths),
                "path_table": path,
                "main": torch.tensor(main)}

    def load(self, tree: DraftTree) -> None:
        """Rewrite every tensor in place for `tree` (same node count; no reallocation)."""
        host = self._host(tree)
        self.model_topo.parents.copy_(host.pop("parents_raw"))
        self.conv_index.copy_(host.pop("conv_index"))
        for name, value in host.items():
            getattr(self, name).copy_(value)
        self.tree = self.model_topo.tree = tree


class SpecState:
    """The static decoding state that speculative graphs share: recurrent + conv state, the
    deferred commit's pending factors padded to `max_path`, and the device-side bookkeeping
    (next root, tokens produced, step count, output tokens, per-step records)."""

    def __init__(self, rt: Runtime, max_path: int, capacity: int):
        c, dev, L = rt.config, rt.device, rt.config.num_hidden_layers
        self.rt, self.max_path, self.capacity = rt, max_path, capacity
        self.cache = StaticState(c, dev, rt.dtype)
        z = dict(device=dev, dtype=torch.float32)
        self.pk = torch.zeros(L, 1, max_path, c.num_heads, c.head_dim, **z)
        self.pd = torch.zeros(L, 1, max_path, c.num_heads, c.head_v_dim, **z)
        self.pg = torch.zeros(L, 1, max_path, c.num_heads, **z)
        i64 = dict(device=dev, dtype=torch.long)
        self.root, self.pos, self.step = (torch.zeros(1, **i64) for _ in range(3))
        self.out = torch.zeros(capacity + 2 * max_path + 2, **i64)
        self.acc = torch.zeros(capacity + 1, **i64)           # accepted drafts per step
        self.div = torch.zeros(capacity + 1, **i64)           # 1 where bonus != oracle's token
        self.gap = torch.zeros(capacity + 1, **z)             # logit gap at that bonus
        self.last = torch.zeros(5, **i64)                     # a, end node, bonus, diverged, pos

    def buffers(self) -> list[torch.Tensor]:
        return [self.cache.recurrent, self.cache.conv, self.pk, self.pd, self.pg, self.root,
                self.pos, self.step, self.out, self.acc, self.div, self.gap, self.last]

    @torch.no_grad()
    def reset(self, state: StaticState | InferenceState, root: int) -> None:
        self.cache.copy_(state)
        for t in (self.pk, self.pd, self.pg, self.pos, self.step, self.acc, self.div, self.gap):
            t.zero_()
        self.root.fill_(root)

    @contextlib.contextmanager
    def preserved(self):
        """Restore every buffer afterwards (a capture's warm-up runs the step for real)."""
        saved = [t.clone() for t in self.buffers()]
        try:
            yield
        finally:
            for t, s in zip(self.buffers(), saved):
                t.copy_(s)

    @torch.no_grad()
    def flush(self) -> None:
        """Fold the pending commit into the state now (end of decoding, or before AR)."""
        from specla.verify import commit_layer

        for l in range(self.pk.shape[0]):
            commit_layer(self.cache.recurrent[l], self.pk[l], self.pd[l], self.pg[l])
        self.pk.zero_(), self.pd.zero_(), self.pg.zero_()

    @torch.no_grad()
    def folded_copy(self) -> StaticState:
        """A copy of the state with the pending commit folded in (the live state untouched)."""
        from specla.verify import commit_layer

        copy = self.cache.clone()
        for l in range(self.pk.shape[0]):
            commit_layer(copy.recurrent[l], self.pk[l], self.pd[l], self.pg[l])
        return copy

    def output(self) -> list[int]:
        return self.out[:int(self.pos.item())].tolist()


class DeviceOracle:
    """`OracleDrafter`'s proposals as tensor ops, so drafting stays inside the graph.

    Same semantics: a node on the tree's main line carries the target's greedy continuation
    with probability alpha, any other node (and a corrupted main node) a uniformly random wrong
    token. The random numbers come from tables drawn once and indexed by the device step
    counter, so a run is reproducible and needs no RNG inside the graph.
    """

    def __init__(self, continuation: list[int], vocab_size: int, alpha: float, max_steps: int,
                 max_nodes: int, capacity: int, device, seed: int = 0):
        self.vocab_size, self.capacity = vocab_size, capacity
        self.cont = torch.zeros(capacity, dtype=torch.long, device=device)
        self.set_continuation(continuation)
        self.alpha = torch.full((1,), float(alpha), device=device)
        gen = torch.Generator().manual_seed(seed)
        self.u = torch.rand(max_steps, max_nodes, generator=gen).to(device)
        self.r = torch.randint(0, vocab_size - 1, (max_steps, max_nodes), generator=gen).to(device)

    def set_continuation(self, tokens: list[int], start: int = 0) -> None:
        """Write tokens at [start, ...); everything after them is unknown (zeros)."""
        tokens = list(tokens)[:max(self.capacity - start, 0)]
        self.cont[start:].zero_()
        if tokens:
            self.cont[start:start + len(tokens)] = torch.tensor(tokens, device=self.cont.device)
        self.valid = start + len(tokens)          # positions before this hold real tokens

    def set_alpha(self, alpha: float) -> None:
        self.alpha.fill_(float(alpha))

    def draft(self, tokens: torch.Tensor, topo: SpecTopology, pos: torch.Tensor, step: torch.Tensor) -> None:
        """Fill tokens[0, 1:] for the step about to run (pos tokens produced so far)."""
        n = topo.n
        s = step.clamp(max=self.u.shape[0] - 1)
        u = self.u.index_select(0, s)[0, :n]
        r = self.r.index_select(0, s)[0, :n]
        true = self.cont.index_select(0, (pos + topo.depth - 1).clamp(0, self.capacity - 1))
        wrong = (true + 1 + r) % self.vocab_size
        keep = topo.main & (u < self.alpha)
        tokens[0, 1:].copy_(torch.where(keep, true, wrong)[1:])

    def token_at(self, index: torch.Tensor) -> torch.Tensor:
        return self.cont.index_select(0, index.clamp(0, self.capacity - 1))


def greedy_accept(topo: SpecTopology, tokens: torch.Tensor, logits: torch.Tensor):
    """`specla.accept.accept_greedy`'s walk as tensor ops: no host sync, no data-dependent shape.

    tokens [N] (-1 = dummy), logits [N, V]. Returns a [1] accepted drafts, end [1] the last
    accepted node, path [P] its root-to-node path (padded), valid [P] path mask, bonus [1].
    """
    choice = logits.argmax(-1)                                                  # [N]
    match = (tokens == choice.index_select(0, topo.parent)) | topo.is_root
    # the walk takes the first matching child; a later duplicate sibling never counts
    first = match & ((topo.earlier_sibling @ match.float()) == 0)
    good = (topo.anc_or_self @ (~first).float()) == 0                           # on the walk
    end = (good.float() * (topo.depth + 1).float()).argmax().view(1)            # its deepest node
    a = topo.depth.index_select(0, end)
    path = topo.path_table.index_select(0, end)[0]
    return a, end, path, topo.arange_p <= a, choice.index_select(0, end)


def torch_tree_verify(q, k, v, g, beta, S0, topo: SpecTopology, pending=None):
    """Graph-safe torch fallback of the verifier (the tree-masked UT form of
    `kernels.reference.tree_verify_ref` with the masks precomputed on the device)."""
    if pending is not None:
        pk, pd, pg = pending
        for t in range(pk.shape[1]):                      # serial, as commit_ref folds
            S0.mul_(pg[:, t].exp()[..., None, None])
            S0.add_(pk[:, t][..., :, None] * pd[:, t][..., None, :])
    anc, anc_or_self = topo.anc.bool(), topo.anc_or_self.bool()
    G = torch.einsum("ij,bjh->bhi", topo.anc_or_self, g.float())          # [B,H,N] path decay
    diff = G[..., :, None] - G[..., None, :]
    decay = torch.where(anc_or_self, diff, torch.full_like(diff, float("-inf"))).exp()
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    bh = beta.transpose(1, 2)[..., None]
    A = bh * decay * (kh @ kh.transpose(-1, -2)) * anc
    rhs = bh * (vh - G.exp()[..., None] * (kh @ S0))
    eye = torch.eye(q.shape[1], dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    o = G.exp()[..., None] * (qh @ S0) + (decay * (qh @ kh.transpose(-1, -2))) @ u
    return o.transpose(1, 2), u.transpose(1, 2)


class GraphedSpec:
    """One speculative step for one draft topology, captured as CUDA graphs.

    Phases (each also captured alone, so their GPU time can be measured with events between
    replays): `verify` (tree forward; folds the pending commit), `accept` (greedy acceptance,
    commit or defer, conv window, bookkeeping), `draft` (the device oracle, or a device-resident
    `drafter` such as `specla.device_drafter.DeviceChainDrafter`, if any). `step()` replays all
    three as one graph.

    A `drafter` is any object with `draft(spec)`, which reads this step's `result` and
    `features` and writes the next step's `tokens[0, 1:]` with tensor ops only; its static
    buffers (`buffers()`, if it has that method) are restored after each capture's warm-up.
    """

    @torch.no_grad()
    def __init__(self, rt: Runtime, state: SpecState, tree: DraftTree, mode: str = "auto",
                 deferred: bool = True, oracle: DeviceOracle | None = None,
                 feature_layers: tuple[int, ...] = (), use_graph: bool | None = None,
                 recurrence: str = "kernels", split_graphs: bool = False, dynamic: bool = False,
                 drafter=None):
        from specla.verify import resolve_mode

        if oracle is not None and drafter is not None:
            raise ValueError("a speculative step drafts with the device oracle or a device drafter, not both")
        self.rt, self.state, self.oracle, self.drafter = rt, state, oracle, drafter
        self.deferred, self.feature_layers, self.recurrence = deferred, tuple(feature_layers), recurrence
        self.topo = SpecTopology(tree, rt.config.conv_size, state.max_path, rt.device)
        self.mode = resolve_mode(mode, self.topo.model_topo, rt.device.type)
        # A graph that serves every tree of its size must not bake in a host-built schedule:
        # only the tree kernels read the topology from the device.
        self.dynamic = dynamic and not tree.is_chain
        if self.dynamic:
            self.mode = "tree"
        n, dev, c = len(tree), rt.device, rt.config
        self.tokens = torch.tensor([tree.tokens], dtype=torch.long, device=dev)
        self.factors = rt.new_factors(n)
        self.logits = torch.zeros(n, c.vocab_size, device=dev)
        self.last_hidden = torch.zeros(n, c.hidden_size, device=dev, dtype=rt.dtype)
        self.features = (torch.zeros(n, len(self.feature_layers), c.hidden_size, device=dev, dtype=rt.dtype)
                         if self.feature_layers else None)
        self.result = torch.zeros(3 + state.max_path, dtype=torch.long, device=dev)  # a, end, bonus, path
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.capture_ms = 0.0
        if self.use_graph:
            self._capture("step")
            if split_graphs:
                drafts = oracle is not None or drafter is not None
                for phase in ("verify", "accept") + (("draft",) if drafts else ()):
                    self._capture(phase)

    # ---- phases
    def _verify_layer(self, l, q, k, v, g, beta, S):
        from specla.verify import verify_layer

        st = self.state
        pending = (st.pk[l], st.pd[l], st.pg[l]) if self.deferred else None
        if self.recurrence == "torch":
            return torch_tree_verify(q, k, v, g, beta, S, self.topo, pending)
        return verify_layer(self.mode, q, k, v, g, beta, S, self.topo.model_topo, pending=pending)

    def verify(self) -> None:
        self.tokens[0, :1].copy_(self.state.root)
        logits, hidden, feats = self.rt.tree_forward(self.tokens, self.state.cache, self.topo.conv_index,
                                                     self._verify_layer, self.factors, self.feature_layers)
        self.logits.copy_(logits)
        self.last_hidden.copy_(hidden)
        if feats is not None:
            self.features.copy_(feats)

    def accept(self) -> None:
        """Greedy acceptance on the device, then the commit (now or deferred) and bookkeeping."""
        tok = self.tokens[0]
        a, end, path, valid, bonus = greedy_accept(self.topo, tok, self.logits)
        self._commit(path, valid)
        self._conv_window(path, a)
        self._bookkeep(tok, path, a, bonus, end)

    def _commit(self, path, valid) -> None:
        st, f = self.state, self.factors
        k = torch.where(valid[None, None, :, None, None], f.k.index_select(2, path), 0.0)
        d = torch.where(valid[None, None, :, None, None], f.delta.index_select(2, path), 0.0)
        g = torch.where(valid[None, None, :, None], f.g.index_select(2, path), 0.0)
        if self.deferred:
            st.pk.copy_(k), st.pd.copy_(d), st.pg.copy_(g)
            return
        from specla.verify import commit_layer

        for l in range(k.shape[0]):
            commit_layer(st.cache.recurrent[l], k[l], d[l], g[l])

    def _conv_window(self, path, a) -> None:
        """New window = the last W-1 of [old window, conv inputs along the accepted path]."""
        conv = self.state.cache.conv                                      # [L,1,C,W]
        hist = conv.shape[-1] - 1
        src = torch.cat([conv[..., 1:].transpose(-1, -2), self.factors.conv_in], dim=2)
        j = a + 1 + torch.arange(hist, device=a.device)                   # seq positions
        node = path.index_select(0, (j - hist).clamp(0, path.numel() - 1))
        idx = torch.where(j < hist, j, hist + node)
        conv[..., 1:].copy_(src.index_select(2, idx).transpose(-1, -2))

    def _bookkeep(self, tok, path, a, bonus, end) -> None:
        st, P = self.state, self.state.max_path
        d = self.topo.arange_p
        drafted = tok.index_select(0, path.index_select(0, (d + 1).clamp(max=P - 1)))
        new = torch.where(d < a, drafted, bonus)
        st.out.index_copy_(0, (st.pos + d).clamp(max=st.out.numel() - 1), new)
        s = st.step.clamp(max=st.acc.numel() - 1)
        st.acc.index_copy_(0, s, a)
        div = torch.zeros_like(a)
        if self.oracle is not None:
            # did the target leave the oracle's continuation here (a bf16 near-tie, usually)?
            expected = self.oracle.token_at(st.pos + a)
            div = (bonus != expected).long()
            row = self.logits.index_select(0, end)[0]
            st.div.index_copy_(0, s, div)
            st.gap.index_copy_(0, s, row.index_select(0, bonus) - row.index_select(0, expected))
        st.pos.add_(a + 1)
        st.root.copy_(bonus)
        st.step.add_(1)
        st.last.copy_(torch.cat([a, end, bonus, div, st.pos]))
        self.result.copy_(torch.cat([a, end, bonus, path]))

    def draft(self) -> None:
        if self.drafter is not None:
            self.drafter.draft(self)
        elif self.oracle is not None:
            self.oracle.draft(self.tokens, self.topo, self.state.pos, self.state.step)

    def _body(self, phase: str) -> Callable[[], None]:
        return {"verify": self.verify, "accept": self.accept, "draft": self.draft,
                "step": lambda: (self.verify(), self.accept(), self.draft())}[phase]

    def _capture(self, phase: str) -> None:
        t0 = time.perf_counter()
        # the warm-up runs the body for real: every static buffer it writes is put back
        extra = [self.tokens] + list(getattr(self.drafter, "buffers", list)())
        with self.state.preserved():
            saved = [t.clone() for t in extra]
            self.graphs[phase] = capture(self._body(phase))
            for t, s in zip(extra, saved):
                t.copy_(s)
        self.capture_ms += 1e3 * (time.perf_counter() - t0)

    # ---- running
    def run(self, phase: str = "step") -> None:
        graph = self.graphs.get(phase)
        if graph is not None:
            graph.replay()
        else:
            self._body(phase)()

    def step(self) -> None:
        self.run("step")

    @torch.no_grad()
    def load_tree(self, tree: DraftTree) -> None:
        """The next step's draft from a host drafter (already padded to this graph's size)."""
        if self.dynamic:
            self.topo.load(tree)
        elif tree.parents != self.topo.tree.parents:
            raise ValueError("this graph was captured for another topology")
        self.set_draft(tree.tokens)

    @torch.no_grad()
    def set_draft(self, tokens: list[int]) -> None:
        """Drafted tokens for the next step from a host drafter (node 0, the root, is set by
        the graph from the previous bonus)."""
        if len(tokens) != self.topo.n:
            raise ValueError(f"{len(tokens)} tokens for a topology of {self.topo.n} nodes")
        self.tokens[0, 1:].copy_(torch.tensor(tokens[1:], dtype=torch.long), non_blocking=True)


TREE_BUCKETS = (8, 16, 32, 64, 127)      # drafted nodes; the tree kernels hold <= 128 nodes


def pad_tree(tree: DraftTree, buckets: tuple[int, ...] = TREE_BUCKETS) -> DraftTree:
    """A tree padded with dummy nodes hanging off the root (token -1: never accepted) to the
    next bucket size. Cross-branch entries of the tree-masked verifier are exactly zero, so a
    dummy changes no other node's output, and its factors are never selected."""
    drafted = len(tree) - 1
    size = next((b for b in buckets if b >= drafted), drafted)
    extra = size - drafted
    return DraftTree(tree.tokens + [-1] * extra, tree.parents + [0] * extra)


def bucket(tree: DraftTree) -> tuple[tuple, DraftTree]:
    """(graph key, padded tree): chains by padded length, other trees by padded size."""
    if tree.is_chain:
        padded = pad_chain(tree)
        return ("chain", len(padded)), padded
    padded = pad_tree(tree)
    return ("tree", len(padded)), padded


def comb_tree(width: int, budget: int) -> DraftTree:
    """Levels of `width` siblings, each level hanging off the first node of the previous one
    (the shape of `OracleDrafter`'s sibling trees with the true slot first): `budget` nodes."""
    tokens, parents, main = [0], [-1], 0
    while len(tokens) - 1 < budget:
        first = len(tokens)
        for _ in range(min(width, budget - (len(tokens) - 1))):
            tokens.append(0)
            parents.append(main)
        main = first
    return DraftTree(tokens, parents)


CHAIN_BUCKETS = (4, 8, 16, 32, 64)


def max_path_for(budget: int) -> int:
    """Longest accepted path (root included) any bucketed draft of `budget` nodes can have."""
    return next((b for b in CHAIN_BUCKETS if b >= budget), budget) + 1


def pad_chain(tree: DraftTree, buckets: tuple[int, ...] = CHAIN_BUCKETS) -> DraftTree:
    """A chain padded with dummy nodes (token -1, never accepted: no argmax equals it) to the
    next bucket length, so chains of similar length share one graph. Dummies sit at the end:
    only their own (ignored) outputs depend on them."""
    if not tree.is_chain:
        return tree
    drafted = len(tree) - 1
    size = next((b for b in buckets if b >= drafted), drafted)
    return DraftTree.chain(tree.tokens + [-1] * (size - drafted))


# --------------------------------------------------------------------------- host drafters

@dataclasses.dataclass
class DraftRun:
    tokens: list[int]
    steps: int
    accepted: list[int]
    ms: float                       # decode wall time (prefill and graph captures excluded)
    phases_ms: dict                 # draft | graph (verify+accept+readback) | observe | other
    capture_ms: float
    graphs: int
    divergence: dict | None         # first position where the output leaves `reference`


class GraphedDecoder:
    """Speculative decoding with a real (host) drafter: the drafter runs eagerly between
    graph replays, one graph per topology bucket (chains padded at their end; trees padded
    with dummy nodes off the root, verified in "tree" mode with the topology rewritten in
    place), all sharing one `SpecState`."""

    def __init__(self, rt: Runtime, drafter, settings, max_path: int, capacity: int,
                 deferred: bool = True, use_graph: bool | None = None,
                 recurrence: str = "kernels", max_graphs: int = 16):
        self.rt, self.drafter, self.settings = rt, drafter, settings
        self.state = SpecState(rt, max_path, capacity)
        self.deferred, self.use_graph, self.recurrence = deferred, use_graph, recurrence
        self.max_graphs, self.specs = max_graphs, {}
        self.capture_ms = 0.0

    def _spec_for(self, tree: DraftTree) -> tuple[GraphedSpec, DraftTree]:
        key, padded = bucket(tree)
        spec = self.specs.get(key)
        if spec is None:
            graphed = self.use_graph if len(self.specs) < self.max_graphs else False
            t0 = time.perf_counter()
            spec = GraphedSpec(self.rt, self.state, padded, mode="auto", deferred=self.deferred,
                               feature_layers=self.drafter.feature_layers, use_graph=graphed,
                               recurrence=self.recurrence, dynamic=True)
            self.capture_ms += 1e3 * (time.perf_counter() - t0)
            self.specs[key] = spec
        return spec, padded

    @torch.no_grad()
    def generate(self, prompt: list[int], n: int, reference: list[int] | None = None,
                 prefilled=None) -> DraftRun:
        from specla.drafters.base import Accepted, DraftContext

        rt, st = self.rt, self.state
        state0, feats, hidden = prefilled or rt.prefill(prompt, self.drafter.feature_layers)
        self.drafter.reset(prompt, feats, hidden)
        st.reset(state0, prompt[-1])
        gen = torch.Generator().manual_seed(0)
        root, out, accepted, divergence = prompt[-1], [], [], None
        phases = {"draft": 0.0, "graph": 0.0, "observe": 0.0}
        capture_before = self.capture_ms
        sync(rt.device)
        t_start = time.perf_counter()
        while len(out) < n:
            t0 = time.perf_counter()
            draft = self.drafter.propose(DraftContext(root, self.settings, gen))
            t1 = time.perf_counter()
            spec, padded = self._spec_for(draft.tree)
            t2 = time.perf_counter()
            spec.load_tree(padded)
            spec.step()
            a, end, bonus, *path = spec.result.tolist()          # the one sync of the step
            t3 = time.perf_counter()
            nodes = path[:a + 1]
            idx = torch.tensor(nodes, device=rt.device)
            self.drafter.observe(Accepted(
                tokens=[padded.tokens[i] for i in nodes],
                features=None if spec.features is None else spec.features.index_select(0, idx),
                last_hidden=spec.last_hidden.index_select(0, idx), bonus_token=bonus))
            t4 = time.perf_counter()
            new = [padded.tokens[i] for i in nodes[1:]] + [bonus]
            if reference is not None and divergence is None:
                divergence = _first_divergence(spec, nodes, new, reference, len(out))
            out += new
            accepted.append(a)
            root = bonus
            phases["draft"] += 1e3 * (t1 - t0)
            phases["graph"] += 1e3 * (t3 - t2)
            phases["observe"] += 1e3 * (t4 - t3)
        sync(rt.device)
        captured = self.capture_ms - capture_before
        ms = 1e3 * (time.perf_counter() - t_start) - captured
        phases["other"] = ms - sum(phases.values())
        return DraftRun(out, len(accepted), accepted, ms, phases, captured,
                        sum(1 for s in self.specs.values() if s.graphs), divergence)


def _first_divergence(spec: GraphedSpec, nodes: list[int], new: list[int], reference: list[int],
                      offset: int) -> dict | None:
    """Where this step's tokens leave the reference: the target's logit gap there (between its
    own pick and the reference token, at the node that chose) tells a near-tie apart."""
    for j, token in enumerate(new):
        pos = offset + j
        if pos >= len(reference):
            return None
        if token != reference[pos]:
            row = spec.logits[nodes[j]]
            return {"position": pos, "token": token, "reference_token": reference[pos],
                    "gap": float(row[token] - row[reference[pos]])}
    return None


# --------------------------------------------------------------------------- oracle decoding

@dataclasses.dataclass
class OracleRun:
    tokens: list[int]
    steps: int
    accepted: list[int]                      # accepted drafts per step
    ms: float
    divergences: list[dict] = dataclasses.field(default_factory=list)


@torch.no_grad()
def oracle_calibrate(spec: GraphedSpec, ar: GraphedAR, snapshot: StaticState, root: int,
                     n: int, max_steps: int | None = None) -> OracleRun:
    """Decode n tokens step by step (one host read per step), keeping the oracle on the
    speculative decoder's own greedy trajectory.

    The oracle drafts the AR greedy continuation. In bf16 the speculative forward and the AR
    step round differently, so at a near-tie the target's argmax can leave that continuation
    (a divergence, recorded with the target's logit gap). The step is then undone and redone
    with the continuation realigned: the target's own token at that position, then AR's
    continuation after it. The result is what an oracle that knew the target's output would
    do. Graph replays are deterministic, so a timed run with the final continuation
    reproduces this trajectory step for step with no host work.
    """
    st, oracle = spec.state, spec.oracle
    st.reset(snapshot, root)
    spec.draft()
    divergences, steps = [], 0
    t0 = time.perf_counter()
    while int(st.pos.item()) < n and steps < (max_steps or 4 * n + 8):
        saved = [t.clone() for t in st.buffers()] + [spec.tokens.clone()]
        pos_before, root_before = int(st.pos.item()), int(st.root.item())
        spec.step()
        steps += 1
        for _ in range(st.max_path + 2):              # each redo gets strictly further
            a, end, bonus, div, pos = st.last.tolist()
            p = pos - 1                               # the bonus token's position
            if not div or p >= n:
                break
            if p < oracle.valid:                      # else: the continuation just ran out
                divergences.append({"position": p, "step": steps - 1,
                                    "gap": float(st.gap[steps - 1].item()), "target_token": bonus,
                                    "oracle_token": int(oracle.cont[p].item())})
            accepted = st.out[pos_before:p].tolist()
            for t, s in zip(st.buffers() + [spec.tokens], saved):
                t.copy_(s)
            # a bounded tail: if a later step runs past it, the same path extends it
            need = min(n - p + 2 * st.max_path + 2, 64 + 2 * st.max_path, ar.out.numel(),
                       oracle.capacity - p - 1)
            tail = ar.continue_after(st.folded_copy(), root_before, accepted + [bonus], need)
            oracle.set_continuation([bonus] + tail, start=p)
            spec.draft()
            spec.step()
    ms = 1e3 * (time.perf_counter() - t0)
    return OracleRun(st.output(), steps, st.acc[:steps].tolist(), ms, divergences)


@torch.no_grad()
def oracle_timed(spec: GraphedSpec, snapshot: StaticState, root: int, n: int, steps: int) -> OracleRun:
    """`steps` replays back to back (the count a calibration found), timed with events; the
    initial draft is inside the timing. Extra host-checked steps only if n was not reached."""
    st = spec.state
    st.reset(snapshot, root)
    sync(spec.rt.device)
    with Stopwatch(spec.rt.device) as sw:
        spec.draft()
        for _ in range(steps):
            spec.step()
    ms, extra = sw.ms, 0
    while int(st.pos.item()) < n and extra < 4 * n:
        with Stopwatch(spec.rt.device) as sw2:
            spec.step()
        ms += sw2.ms
        extra += 1
    total = steps + extra
    return OracleRun(st.output(), total, st.acc[:total].tolist(), ms)


@torch.no_grad()
def oracle_split(spec: GraphedSpec, snapshot: StaticState, root: int, steps: int) -> dict:
    """GPU time per phase: the three phase graphs replayed with events between them."""
    spec.state.reset(snapshot, root)
    spec.draft()
    return phase_times(spec, steps)


@torch.no_grad()
def phase_times(spec: GraphedSpec, steps: int) -> dict:
    """Milliseconds per step of each phase (verify, accept_commit, draft) over `steps` steps
    from the spec's current state: the phase graphs (`split_graphs=True`) replayed with CUDA
    events between them, or host time eagerly."""
    names = (("verify", "verify"), ("accept", "accept_commit"), ("draft", "draft"))
    totals = {key: 0.0 for _, key in names}
    cuda = spec.rt.device.type == "cuda"
    marks = []
    sync(spec.rt.device)
    for _ in range(steps):
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
            ev[0].record()
            for i, (phase, _) in enumerate(names):
                spec.run(phase)
                ev[i + 1].record()
            marks.append(ev)
        else:
            for phase, key in names:
                t0 = time.perf_counter()
                spec.run(phase)
                totals[key] += 1e3 * (time.perf_counter() - t0)
    sync(spec.rt.device)
    for ev in marks:
        for i, (_, key) in enumerate(names):
            totals[key] += ev[i].elapsed_time(ev[i + 1])
    return {key: value / max(steps, 1) for key, value in totals.items()}


@torch.no_grad()
def spec_vs_ar_noise(rt: Runtime, ar: GraphedAR, snapshot: StaticState, root: int,
                     continuation: list[int], n: int = 16, recurrence: str = "kernels") -> float:
    """Max |logit difference| between one speculative chain forward and AR steps over the
    same tokens from the same state: the rounding noise a greedy flip must be within."""
    n = min(n, len(continuation))
    forced = continuation[:n - 1]
    ar_logits = ar.logits_along(snapshot, root, forced)                   # [n, V]
    state = SpecState(rt, max_path=n, capacity=n + 4)
    spec = GraphedSpec(rt, state, DraftTree.chain([root] + forced), mode="auto", use_graph=False,
                       recurrence=recurrence)
    state.reset(snapshot, root)
    spec.verify()
    return float((spec.logits - ar_logits).abs().max().item())


# --------------------------------------------------------------------------- fla baselines

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


# --------------------------------------------------------------------------- measurements

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
