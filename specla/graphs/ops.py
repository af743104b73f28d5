"""The target's weights packed for decoding, and the per-layer ops the captured forwards call.

`TorchOps` is plain torch, operation for operation what `specla.model` computes (the CPU
path, and the reference every fused op is checked against); `FlaOps` runs fla's fused Triton
kernels and this project's fused conv + gates kernel on CUDA; `FusedOps` also folds the norms
and SwiGLU into the projections (`kernels/triton_projection.py`). `make_ops` picks one after
checking it against `TorchOps` on random data: "auto" takes `FusedOps` for narrow,
launch-bound targets and `FlaOps` for wide ones.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kernels import reference
from specla.config import GDNConfig
from specla.model import l2norm


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
        return reference.rms_norm_ref(x, weight, eps, residual)

    def gated_norm(self, o, gate, weight, eps, activation):
        """o [..., H, V] normed over each head, times act(gate [..., H, V]) (None: no gate)."""
        return reference.gated_norm_ref(o, gate, weight, eps, activation)

    def swiglu(self, gate, up):
        return reference.swiglu_ref(gate, up)

    # each projection with the op in front of it: separate kernels here, one in FusedOps
    def norm_linear(self, x, weight, eps, residual, w):
        """(rms_norm(residual + x) @ w.T, residual + x)."""
        h, residual = self.rms_norm(x, weight, eps, residual)
        return F.linear(h, w), residual

    def norm_logits(self, x, weight, eps, residual, lm_head, head):
        """fp32 logits [M, vocab] of the final norm of residual + x: `head` (the runtime's
        LM head product) of the normed rows."""
        return head(self.rms_norm(x, weight, eps, residual)[0])

    def plan_l2_prefetch(self, weights: list[torch.Tensor]) -> None:
        """The weight matrices in the order a step reads them (FusedOps' kernels prefetch the
        next one into L2 as they end); plain ops have nothing to do with it."""

    def _prefetch(self, w: torch.Tensor) -> dict:
        """The keywords that make a kernel ask L2 for the matrix read after `w`: none here."""
        return {}

    def greedy_take(self, logits, next_token, out, count):
        """argmax(logits [1, vocab] fp32) -> next_token [1, 1] and out[count]; count += 1."""
        reference.greedy_take_ref(logits, next_token, out, count)

    def gated_norm_linear(self, o, gate, weight, eps, activation, w):
        """o [B,N,H,V] normed per head times act(gate [B,N,H*V] or None), projected by w."""
        if gate is not None:
            gate = gate.unflatten(-1, o.shape[-2:])
        y = self.gated_norm(o, gate, weight, eps, activation)
        return F.linear(y.flatten(-2).to(w.dtype), w)

    def swiglu_linear(self, gate_up, w):
        """(silu(gate_up[..., :I]) * gate_up[..., I:]) @ w.T, I = w's input width."""
        I = w.shape[1]
        return F.linear(self.swiglu(gate_up[..., :I], gate_up[..., I:]), w)

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

    def conv_in_projection(self, config: GDNConfig) -> bool:
        """Whether the AR step takes its conv inside the input projection (`norm_linear_conv`)."""
        return False

    def norm_linear_conv(self, x, weight, eps, residual, w, cache, layer: PackedLayer, index1):
        """`norm_linear` of one token, then the conv step of its first C columns (the q | k | v
        conv inputs; cache [1,C,W] shifted in place): (y with those columns silu(conv), x +
        residual)."""
        y, residual = self.norm_linear(x, weight, eps, residual, w)
        C = layer.conv_w.shape[0]
        conv = self.conv_step(y[..., :C], cache, layer.conv_w, layer.conv_b, index1)
        return torch.cat([conv, y[..., C:]], dim=-1), residual

    def recurrent_step(self, q, k, v, a, b, S, layer: PackedLayer, config: GDNConfig):
        """One token of the gated delta rule, S [1,H,K,V] fp32 updated in place with the ops of
        `kernels.reference.gated_delta_step` (so the state equals a factor commit bit for bit)."""
        q, k, v, g, beta = gdn_gates(q, k, v, a, b, layer, config)
        q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
        S.mul_(g.exp()[..., None, None])
        delta = beta[..., None] * (v - (S * k[..., None]).sum(-2))
        S.add_(k[..., :, None] * delta[..., None, :])
        return (S * q[..., None]).sum(-2)[:, None]

    def conv_recurrent_step(self, x, cache, a, b, S, layer: PackedLayer, config: GDNConfig, index1):
        """One AR token from the conv inputs x [1,1,C] to the recurrence output [1,1,H,V]: the
        conv step (cache [1,C,W] shifted in place) then the recurrence step (S in place)."""
        H, K = config.num_heads, config.head_dim
        qkv = self.conv_step(x, cache, layer.conv_w, layer.conv_b, index1)
        q, k, v = qkv.split([H * K, H * K, H * config.head_v_dim], dim=-1)
        return self.recurrent_step(q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)),
                                   v.unflatten(-1, (H, config.head_v_dim)), a, b, S, layer, config)


# Heads up to this many state values (K x V) take the one-launch AR step: one program a head
# then holds its state in a few register tiles. The GDN-1.3B shape's 256 x 256 heads keep
# fla's kernels, whose grid spreads a head's V columns over many programs. A step with one
# program a (V tile, head), the last tile of a head shifting its conv window, took 149.3 us
# a step against their 146.2 (H100, benchmarks/results/h100/session25/) and was dropped.
FUSED_STEP_MAX_STATE = 128 * 128
# Heads past FUSED_STEP_MAX_STATE: the AR step's conv in the input projection's epilogue
# (kernels/triton_projection.py `norm_linear_conv`), so only the recurrence is left between
# it and the output projection (launch_counts.py +noconvproj). 1.3B AR on the H100, one run:
# 125 launches and 1.3805 ms/token against 149 and 1.4138 (benchmarks/results/h100/session26/).
CONV_IN_PROJECTION = True
# FusedOps' AR recurrence in kernels/triton_recurrent_step.py (fla's arithmetic; its PDL_MODE
# lets the output projection be scheduled during it), not fla's kernel (launch_counts.py
# +norecstep). 1.3B AR on the H100, one run: 1.3558 ms/token against 1.3833 (session26/).
RECURRENT_STEP_KERNEL = True
# Whether the AR recurrence and a verification's conv + gates also ask L2 for their layer's
# output projection (kernels/l2_prefetch.py, which use_l2_prefetch turns off for every kernel;
# launch_counts.py +nopf, +pfrec). With 24 MB prefetches the conv + gates went from 98 to 161 us
# a step, and AR was 1.2% slower with the recurrence's (H100, benchmarks/results/h100/session28/);
# at the verification's 8 MB cap the conv + gates alone still went from 98.6 to 160.7 us, and the
# output projection it prefetched gained nothing (2.681x against 2.758x, h100/session29/).
L2_PREFETCH_IN_STATE_STEPS = False
# The AR step's greedy token in one launch (kernels/triton_greedy.py), not torch's argmax and
# two more launches to store it (launch_counts.py +nogreedy times them against each other).
GREEDY_KERNEL = True


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
        # the AR step's greedy token in one kernel; off if its self-check fails
        self.greedy_kernel = True

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
                          k_out=k_out, g_out=g_out, x_out=x_out,
                          **(self._prefetch(layer.w_in) if L2_PREFETCH_IN_STATE_STEPS else {}))

    def conv_step(self, x, cache, weight, bias, index1):
        y, _ = self._conv_update(x=x, cache=cache, weight=weight, bias=bias, activation="silu")
        return y

    def conv_recurrent_step(self, x, cache, a, b, S, layer: PackedLayer, config: GDNConfig, index1):
        """Small heads (a launch-bound step): the conv, the gates and the recurrence in one
        launch (`kernels.triton_conv_gates.conv_recurrent_step`), against fla's two."""
        if config.head_dim * config.head_v_dim > FUSED_STEP_MAX_STATE:
            return super().conv_recurrent_step(x, cache, a, b, S, layer, config, index1)
        from kernels.triton_conv_gates import conv_recurrent_step

        return conv_recurrent_step(x, cache, layer.conv_w, layer.conv_b, a, b, layer.neg_A, layer.dt_bias,
                                   S, config.head_dim, config.head_v_dim, config.allow_neg_eigval)

    def greedy_take(self, logits, next_token, out, count):
        if not (GREEDY_KERNEL and self.greedy_kernel):
            return super().greedy_take(logits, next_token, out, count)
        from kernels.triton_greedy import greedy_take
        greedy_take(logits, next_token, out, count)

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


class FusedOps(FlaOps):
    """FlaOps with each projection and the op in front of it in one Triton kernel
    (`kernels/triton_projection.py`): residual add + RMSNorm into the input and MLP
    projections, the gated norm into the output projection, SwiGLU into the down projection.
    Four fewer launches per layer; rows beyond the kernel's limit (long prefill chunks), several
    rows of a large matrix (`fused_projection_fits`) and shapes it does not take use FlaOps'
    separate kernels."""
    name = "fused"

    def __init__(self):
        super().__init__()
        from kernels import triton_projection
        self._projection = triton_projection
        # the AR step's conv in the input projection, and its recurrence in this project's
        # kernel; each off if its self-check fails
        self.fused_conv_projection = self.recurrent_kernel = True
        self._next_weight: dict[int, torch.Tensor] = {}

    def plan_l2_prefetch(self, weights: list[torch.Tensor]) -> None:
        """Each fused projection of a matrix in `weights` (the step's order) asks L2 for the
        next matrix once its own weight loads are issued, where that one is large enough to be
        streamed from HBM (`kernels/l2_prefetch.py`); the AR recurrence and a verification's
        conv + gates for their layer's output projection."""
        big = self._projection.LATENCY_BOUND_BYTES
        self._next_weight = {w.data_ptr(): nxt for w, nxt in zip(weights, weights[1:])
                             if nxt.numel() * nxt.element_size() >= big}

    def _prefetch(self, w: torch.Tensor) -> dict:
        nxt = self._next_weight.get(w.data_ptr())
        return {} if nxt is None else {"prefetch": nxt}

    def _fits(self, x, w) -> bool:
        rows = x.numel() // x.shape[-1]
        fits = fused_projection_fits(rows, w.numel(), self._projection.MAX_ROWS, self._projection.MAX_GEMV_ROWS)
        swapped = self._projection.swaps(rows, w.shape[0], w.numel() * w.element_size())
        return x.is_cuda and (fits or swapped)

    def norm_linear(self, x, weight, eps, residual, w):
        if not self._fits(x, w):
            return super().norm_linear(x, weight, eps, residual, w)
        return self._projection.norm_linear(x, weight, eps, residual, w, **self._prefetch(w))

    def norm_logits(self, x, weight, eps, residual, lm_head, head):
        """A latency-bound LM head (a small model's, one row or two) with the final norm in
        front, fp32 out: one launch instead of two. A large head keeps cuBLAS, which streams it
        faster than the GEMV form (the GDN-1.3B shape's 131 MB: 34 us, H200 session 12)."""
        rows = x.numel() // x.shape[-1]
        if (rows > self._projection.MAX_GEMV_ROWS or not x.is_cuda
                or lm_head.numel() * lm_head.element_size() > self._projection.LATENCY_BOUND_BYTES):
            return super().norm_logits(x, weight, eps, residual, lm_head, head)
        logits, _ = self._projection.norm_linear(x, weight, eps, residual, lm_head, out_dtype=torch.float32)
        return logits.reshape(rows, -1)

    def gated_norm_linear(self, o, gate, weight, eps, activation, w):
        V = o.shape[-1]
        if gate is None or not self._fits(gate, w) or V < 16 or V & (V - 1):
            return super().gated_norm_linear(o, gate, weight, eps, activation, w)
        return self._projection.gated_norm_linear(o, gate, weight, eps, activation, w, **self._prefetch(w))

    def swiglu_linear(self, gate_up, w):
        if not self._fits(gate_up, w):
            return super().swiglu_linear(gate_up, w)
        return self._projection.swiglu_linear(gate_up, w, **self._prefetch(w))

    def recurrent_step(self, q, k, v, a, b, S, layer: PackedLayer, config: GDNConfig):
        """One token's recurrence in this project's kernel (`kernels/triton_recurrent_step.py`,
        which lets the next kernel be scheduled during it), where fla's kernel would run."""
        if not (RECURRENT_STEP_KERNEL and self.recurrent_kernel and q.is_cuda and q.shape[1] == 1):
            return super().recurrent_step(q, k, v, a, b, S, layer, config)
        from kernels.triton_recurrent_step import recurrent_step
        return recurrent_step(q, k, v, a, b, layer.neg_A, layer.dt_bias, S, config.allow_neg_eigval,
                              **(self._prefetch(layer.w_in) if L2_PREFETCH_IN_STATE_STEPS else {}))

    def conv_in_projection(self, config: GDNConfig) -> bool:
        """Heads too large for the one-launch conv + recurrence step: the conv goes into the
        input projection instead, one launch fewer a layer."""
        return (CONV_IN_PROJECTION and self.fused_conv_projection
                and config.head_dim * config.head_v_dim > FUSED_STEP_MAX_STATE)

    def norm_linear_conv(self, x, weight, eps, residual, w, cache, layer: PackedLayer, index1):
        C, W = layer.conv_w.shape
        if (not x.is_cuda or x.numel() != x.shape[-1] or cache.dtype != w.dtype or W & (W - 1)
                or not cache.is_contiguous()):
            return super().norm_linear_conv(x, weight, eps, residual, w, cache, layer, index1)
        return self._projection.norm_linear_conv(x, weight, eps, residual, w, cache, layer.conv_w, layer.conv_b,
                                                 **self._prefetch(w))


# From this many weights on, rows beyond the GEMV form go to cuBLAS (or, for 3-16 rows of a
# narrow matrix, the swapped form: `triton_projection.swaps`): at the GDN-1.3B widths the fused
# tl.dot form took 30 us a projection for a 9-node verify against cuBLAS's ~13, while the GEMV
# form for one row matched cuBLAS + the norm kernel (H200, session 10's launch counts). The
# 1.3B out projection has exactly this many; fused at 17 nodes, it made the oracle tree of 16
# 10% slower a step than fla's (H100, benchmarks/results/h100/session25/).
MAX_DOT_WEIGHTS = 1 << 22


def fused_projection_fits(rows: int, weights: int, max_rows: int, max_gemv_rows: int) -> bool:
    """Whether FusedOps runs a projection of `rows` rows and `weights` weights fused."""
    return rows <= max_gemv_rows or (rows <= max_rows and weights < MAX_DOT_WEIGHTS)


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
    # the projections with their prologues, at the model's widths (3 rows: a short draft)
    w_in, w_out, w_down = rnd(2 * D, D, scale=D ** -0.5), rnd(D, H * Vh, scale=0.1), rnd(D, 32, scale=0.2)
    for with_res in (False, True):
        got = ops.norm_linear(x, w, config.norm_eps, res if with_res else None, w_in)
        want = ref.norm_linear(x, w, config.norm_eps, res if with_res else None, w_in)
        close(f"norm_linear(res={with_res})", got[0], want[0], tol)
        close(f"norm_linear residual(res={with_res})", got[1], want[1], tol)
    lm = rnd(64, D, scale=D ** -0.5)      # the final norm + LM head of one AR row, fp32 out
    head = lambda h: F.linear(h.reshape(-1, D).float(), lm.float())  # noqa: E731
    close("norm_logits", ops.norm_logits(x[:, :1], w, config.norm_eps, res[:, :1], lm, head),
          ref.norm_logits(x[:, :1], w, config.norm_eps, res[:, :1], lm, head), tol)
    flat_gate = gate.flatten(-2)
    close("gated_norm_linear", ops.gated_norm_linear(o, flat_gate, wo, config.norm_eps, act, w_out),
          ref.gated_norm_linear(o, flat_gate, wo, config.norm_eps, act, w_out), tol)
    close("swiglu_linear", ops.swiglu_linear(gu, w_down), ref.swiglu_linear(gu, w_down), tol)
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
    a1, b1, cache3 = rnd(1, 1, H), rnd(1, 1, H), rnd(1, C, W)
    w_in3 = rnd(C + 2 * H + 8, D, scale=D ** -0.5)
    cache4 = cache3.clone()
    close("conv_recurrent_step", ops.conv_recurrent_step(xin, cache3, a1, b1, S1, layer, config, index1),
          ref.conv_recurrent_step(xin, cache4, a1, b1, S2, layer, config, index1), tol)
    # bf16: a conv output one rounding away from the reference's (its 4-term sum in another
    # order) moves that column of the state by beta * one ulp of v: the projections' tolerance
    close("conv_recurrent_step state", S1, S2, tol)
    close("conv_recurrent_step cache", cache3, cache4, tol)
    if ops.conv_in_projection(config):      # the AR token's input projection with its conv
        got = ops.norm_linear_conv(x[:, :1], w, config.norm_eps, res[:, :1], w_in3, cache3, layer, index1)
        want = ref.norm_linear_conv(x[:, :1], w, config.norm_eps, res[:, :1], w_in3, cache4, layer, index1)
        close("norm_linear_conv", got[0], want[0], tol)
        close("norm_linear_conv residual", got[1], want[1], tol)
        close("norm_linear_conv cache", cache3, cache4, tol)
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
    failures += _check_greedy_take(ops, ref, device, gen)
    return failures


def _check_greedy_take(ops: TorchOps, ref: TorchOps, device, gen: torch.Generator) -> list[str]:
    """Two AR tokens through `ops.greedy_take` and the reference, into a 2-slot buffer: a
    random row, then one whose maximum is tied at two places (the first index must win)."""
    vocab = 5000
    rows = torch.randn(2, 1, vocab, generator=gen).to(device)
    rows[1, 0, [1234, 4321]] = 10.0
    taken = []
    for o in (ops, ref):
        token, out, count = (torch.zeros(1, 1, dtype=torch.long, device=device),
                             torch.zeros(2, dtype=torch.long, device=device),
                             torch.zeros(1, dtype=torch.long, device=device))
        try:
            for row in rows:
                o.greedy_take(row, token, out, count)
        except Exception as err:  # noqa: BLE001 - a kernel that does not compile fails its check
            return [f"greedy_take: {type(err).__name__}: {err}"]
        taken.append((token.item(), out.tolist(), count.item()))
    return [] if taken[0] == taken[1] else [f"greedy_take: (token, out, count) {taken[0]}, want {taken[1]}"]


# "auto" fuses the projections for targets up to this width (the widths measured). The
# embedded model (384 wide) is launch-bound: fused, its AR step went from 69 launches and
# 0.168 ms/token to 45 and 0.113 (H200, one run, benchmarks/results/h200/session10/). At the
# GDN-1.3B width, in one H100 run on held-out prompts (h100/session25/), the fused set's AR
# took 1.424 ms/token against fla's 1.667 and its oracle chain of 8 at alpha 0.8 0.500 ms a
# token against 0.517: 2.85x over the faster AR with it, 2.75x with fla's.
FUSED_AUTO_MAX_HIDDEN = 2048


def auto_ops_name(config: GDNConfig, device) -> str:
    """What "auto" resolves to: torch ops off CUDA, fused projections up to the widths
    measured, fla's kernels past them."""
    if torch.device(device).type != "cuda":
        return "torch"
    return "fused" if config.hidden_size <= FUSED_AUTO_MAX_HIDDEN else "fla"


def make_ops(name: str, config: GDNConfig, device, dtype) -> tuple[TorchOps, str]:
    """The op set for `name` (auto | fla | fused | torch) and a note saying what was chosen
    and why (`auto_ops_name` picks for auto; an auto choice that fails its check falls back
    to fla's kernels, then to torch ops)."""
    device = torch.device(device)
    wanted = auto_ops_name(config, device) if name == "auto" else name
    if wanted == "torch":
        return TorchOps(), "torch ops" + ("" if name == "torch" else " (no CUDA)")
    try:
        return _checked_ops(wanted, config, device, dtype)
    except Exception as err:  # noqa: BLE001 - any failure means: the next simpler op set
        if name != "auto":
            raise
        why = f"{type(err).__name__}: {err}"
    if wanted == "fused":
        try:
            ops, note = _checked_ops("fla", config, device, dtype)
            return ops, f"{note} (fused projections unusable: {why})"
        except Exception as err:  # noqa: BLE001
            why = f"{type(err).__name__}: {err}"
    return TorchOps(), f"torch ops (fla kernels unusable: {why})"


# (a failed check's name prefix, the switch that turns its kernel off), tried in this order: our
# recurrence, then the in-place launch of fla's (which must match fla's own wrapper), ...
_FALLBACKS = (("recurrent", "recurrent_kernel"), ("recurrent", "inplace_recurrent"),
              ("conv_gates", "fused_conv_gates"), ("greedy_take", "greedy_kernel"),
              ("norm_linear_conv", "fused_conv_projection"))


def _checked_ops(name: str, config: GDNConfig, device, dtype) -> tuple[TorchOps, str]:
    """FlaOps or FusedOps, checked against TorchOps on random data (raises if it fails)."""
    ops = FusedOps() if name == "fused" else FlaOps()
    probe = check_ops(ops, config, device, dtype)
    for prefix, switch in _FALLBACKS:
        if getattr(ops, switch, False) and any(f.startswith(prefix) for f in probe):
            setattr(ops, switch, False)
            probe = check_ops(ops, config, device, dtype)
    if probe:
        raise RuntimeError("; ".join(probe))
    note = ("fla fused kernels" + ("" if ops.inplace_recurrent else " (recurrent state copied back)")
            + ("" if ops.fused_conv_gates else " (conv + gates unfused: its kernel failed its check)")
            + ("" if ops.greedy_kernel else " (greedy token by torch ops: its kernel failed its check)")
            + ("" if getattr(ops, "fused_conv_projection", True) else " (AR conv unfused: its kernel failed its check)")
            + ("" if getattr(ops, "recurrent_kernel", True) else " (fla's AR recurrence: ours failed its check)")
            + (" + fused projections (norm, gated norm, SwiGLU inside the projection)" if name == "fused" else ""))
    return ops, note
