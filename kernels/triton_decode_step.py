"""A whole AR decoding step of a Gated DeltaNet model in one persistent Triton launch:
`decode_step_ref` in `kernels/reference.py`.

Why: a small target's step is latency, not bandwidth. The embedded 13M model's weights
(26 MB) sit in the H200's L2 cache and its bytes floor is ~7 us, yet a step of 38 fused
launches takes ~85 us. Inside one launch a kernel boundary becomes a grid-wide barrier: every
program arrives on a counter in global memory and spins until all have. The barrier is split
(`kernels/pdl.py`: `grid_arrive`, `grid_wait`): a program arrives when its stores are done,
and in the next phase loads its first weight tile before it waits, so those loads overlap
the wait as PDL overlaps a launch. A barrier costs about what a PDL launch boundary does
(~1 us against ~0.7 on the H200, `benchmarks/bench_kernels.py --only barrier`), so the step's
cost is its number of dependent phases times a barrier and a phase's own round trips.

The step runs as phases separated by barriers; each phase splits its work over all
programs, and every program recomputes the small vectors it needs (a norm's mean square
over a 384-wide row) instead of waiting for one program to publish them:

    per layer  A  residual add + RMSNorm + input projection (q|k|v|gate|a|b)
               B  per (head, V tile): conv + SiLU, l2 norms, gates, the delta-rule step
               C  gated per-head norm + output projection; the conv cache's shift
               D  residual add + RMSNorm + gate/up projection
               E  SwiGLU + down projection
    then       F  residual add + final RMSNorm + LM head (fp32 logits)
               G  (greedy) program 0: argmax, the next token, its slot in the output

The arithmetic is `triton_projection`'s (its `_gemv_slice` is every projection here) and
`triton_conv_gates`' (the AR step's conv, gates and state tile), so the logits equal the
fused op set's AR forward's up to the order of fp32 sums. Every program must be resident at
once (a barrier waits for all of them): the grid is at most one program an SM, and the
kernel must not share the GPU with a kernel launched to overlap it. A wait that polls past
`GRID_SPIN_LIMIT` times gives up and sets `status` instead of hanging the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import DecodeWeights
from kernels.triton_conv_gates import (_head_queries_and_gates, _shift_window, _state_tile_step)
from kernels import carveout
from kernels.pdl import grid_arrive, grid_wait, phase_us, stamp
from kernels.triton_projection import DEFAULT_SMS, _gemv_slice

@triton.jit
def _projection_phase(src, w, y, N, K, eps, pid, programs, sync, dtype: tl.constexpr, PROLOGUE: tl.constexpr,
                      HAS_RES: tl.constexpr, SWISH: tl.constexpr, HEAD: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, VEC: tl.constexpr):
    """y = prologue(src) @ w.T [N] for one row, column blocks dealt round-robin; the block
    of column 0 also writes x + residual (PROLOGUE 0 with HAS_RES). Each program's first
    block waits at the barrier `sync` once its first weight tile is in flight; a program with
    no block waits too, or its arrivals would run ahead and count for a phase that another
    program has not finished."""
    counter, arrivals, status = sync
    blocks = tl.cdiv(N, BN)
    for blk in range(pid, blocks, programs):
        cols = blk * BN + tl.arange(0, BN)
        c_mask = cols < N
        first = (counter, tl.where(blk == pid, arrivals, 0), status)
        acc = _gemv_slice(src, w + cols[:, None] * K, c_mask, 0, K, 1, K, eps, blk == 0, dtype,
                          PROLOGUE, HAS_RES, SWISH, HEAD, 1, BN, BK, 2, VEC, first)
        tl.store(y + cols[None, :], acc.to(y.dtype.element_ty), mask=c_mask[None, :])
    if pid >= blocks:
        grid_wait(counter, arrivals, status)


@triton.jit
def _greedy_token(logits, vocab, next_token, out, count, max_out, BLOCK: tl.constexpr):
    """argmax(logits) (the first index of the maximum) -> next_token, out[count]; count += 1."""
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        chunk = tl.load(logits + offs, mask=offs < vocab, other=float("-inf"), cache_modifier=".cg")
        top = tl.max(chunk, axis=0)
        top_i = tl.min(tl.where(chunk == top, offs, vocab), axis=0)
        better = top > best
        best_i = tl.where(better, top_i, best_i)
        best = tl.where(better, top, best)
    token = best_i.to(tl.int64)
    c = tl.load(count)
    tl.store(next_token, token)
    tl.store(out + tl.minimum(c, max_out - 1), token)
    tl.store(count, c + 1)


@triton.jit
def _decode_step_kernel(
        token, embed, zeros, attn_norm, w_in, conv_w, conv_b, neg_A, dt_bias, o_norm, w_o, mlp_norm, w_gu,
        w_down, final_norm, lm_head, cache, S, logits, next_token, out, count, max_out,
        res_a, res_b, x_buf, y_in, o_buf, gu_buf, counter, status, times, eps, scale,
        L: tl.constexpr, D: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        W: tl.constexpr, I: tl.constexpr, VOCAB: tl.constexpr, HAS_BIAS: tl.constexpr,
        NEG_EIGVAL: tl.constexpr, SWISH: tl.constexpr, GREEDY: tl.constexpr,
        BN_IN: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
        BN_HEAD: tl.constexpr, BK_D: tl.constexpr, BK_O: tl.constexpr, BK_I: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr, VEC: tl.constexpr,
        TIMED: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = w_in.dtype.element_ty
    C = H * (2 * K + V)
    N_IN = C + H * V + 2 * H
    x_embed = embed + tl.load(token) * D
    # each phase's program arrives when its stores are done and waits, at its first load of
    # something another program wrote, for all arrivals of the phases before (`phase` of them
    # each). Every program waits in every phase, so the count says that every program has
    # finished the phase before, not only that enough arrivals were made.
    phase = 0
    for l in range(L):
        # A: the block input (the embedding, or the last MLP's output plus the residual)
        if l == 0:
            src = (x_embed, 0, zeros, 0, res_a, zeros, 0, attn_norm)
        else:
            src = (x_buf, 0, res_b, 0, res_a, zeros, 0, attn_norm + l * D)
        _projection_phase(src, w_in + l * N_IN * D, y_in, N_IN, D, eps, pid, programs,
                          (counter, phase * programs, status), dtype, 0, True, SWISH, 1, BN_IN, BK_D, VEC)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

        # B: the recurrence, one (head, V tile) a unit
        grid_wait(counter, phase * programs, status)
        cache_l = cache + l * C * W
        a = y_in + C + H * V
        for unit in range(pid, H * tl.cdiv(V, BV), programs):
            h = unit % H
            q, k, decay, beta = _head_queries_and_gates(
                y_in, cache_l + 1, W, conv_w + l * C * W, conv_b + l * C, a + 0, a + H, neg_A + l * H,
                dt_bias + l * H, h, scale, H, K, W, BK, BW, HAS_BIAS, NEG_EIGVAL)
            _state_tile_step(y_in, cache_l + 1, W, conv_w + l * C * W, conv_b + l * C, S + l * H * K * V,
                             o_buf, q, k, decay, beta, h, (unit // H) * BV, H, K, V, W, BK, BV, BW, HAS_BIAS)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

        # C: gated norm + output projection; every conv window has been read: shift them
        src = (o_buf, 0, zeros, 0, zeros, y_in + C, 0, o_norm + l * V)
        _projection_phase(src, w_o + l * D * H * V, x_buf, D, H * V, eps, pid, programs,
                          (counter, phase * programs, status), dtype, 1, False, SWISH, V, BN_O, BK_O, VEC)
        grid_wait(counter, phase * programs, status)       # at once for a program with no block above
        o_w = tl.arange(0, BW)
        for c0 in range(pid * BC, C, programs * BC):
            channels = c0 + tl.arange(0, BC)
            _shift_window(cache_l, W, y_in, channels, channels < C, o_w, o_w < W, W)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

        # D: residual add + norm + gate/up projection
        src = (x_buf, 0, res_a, 0, res_b, zeros, 0, mlp_norm + l * D)
        _projection_phase(src, w_gu + l * 2 * I * D, gu_buf, 2 * I, D, eps, pid, programs,
                          (counter, phase * programs, status), dtype, 0, True, SWISH, 1, BN_GU, BK_D, VEC)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

        # E: SwiGLU + down projection
        src = (gu_buf, 0, zeros, 0, zeros, zeros, 0, zeros)
        _projection_phase(src, w_down + l * D * I, x_buf, D, I, eps, pid, programs,
                          (counter, phase * programs, status), dtype, 2, False, SWISH, 1, BN_DOWN, BK_I, VEC)
        stamp(times, phase, pid, programs, TIMED)
        grid_arrive(counter)
        phase += 1

    # F: final norm + LM head, fp32 logits (the residual it sums is not needed again)
    src = (x_buf, 0, res_b, 0, res_a, zeros, 0, final_norm)
    for blk in range(pid, tl.cdiv(VOCAB, BN_HEAD), programs):
        cols = blk * BN_HEAD + tl.arange(0, BN_HEAD)
        c_mask = cols < VOCAB
        sync = (counter, tl.where(blk == pid, phase * programs, 0), status)
        acc = _gemv_slice(src, lm_head + cols[:, None] * D, c_mask, 0, D, 1, D, eps, False, dtype,
                          0, True, SWISH, 1, 1, BN_HEAD, BK_D, 2, VEC, sync)
        tl.store(logits + cols[None, :], acc, mask=c_mask[None, :])
    if pid >= tl.cdiv(VOCAB, BN_HEAD):
        grid_wait(counter, phase * programs, status)
    stamp(times, phase, pid, programs, TIMED)
    grid_arrive(counter)
    phase += 1
    if GREEDY:
        if pid == 0:
            grid_wait(counter, phase * programs, status)
            _greedy_token(logits, VOCAB, next_token, out, count, max_out, 1024)
        stamp(times, phase, pid, programs, TIMED)
    # the last arrival re-arms the counter: every program has left every wait by then
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if last == (phase + 1) * programs - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def _block_n(N: int, programs: int, block_k: int, elem: int) -> int:
    """Columns a block: about one block a program, 4 to 64 (power of two), and a weight tile
    of at most 16 KB (two of them in flight take 64 registers a thread at 4 warps)."""
    fit = max(4, 16384 // (block_k * elem))
    return max(4, min(64, fit, triton.next_power_of_2(triton.cdiv(N, programs))))


def check_decode_weights(wt: DecodeWeights, H: int, K: int, V: int, what: str) -> tuple[int, ...]:
    """(L, N_in, D, C, W, I) of stacked weights that fit heads [K, V] with an output gate, a
    power-of-two head width (the fused gated norm's) and contiguous tensors; else ValueError."""
    L, N_in, D = wt.w_in.shape
    C, W = wt.conv_w.shape[1:]
    if C != H * (2 * K + V) or N_in != C + H * V + 2 * H:
        raise ValueError(f"{what}: w_in {tuple(wt.w_in.shape)} and conv {tuple(wt.conv_w.shape)} do not "
                         f"fit H={H}, K={K}, V={V} with an output gate")
    if triton.next_power_of_2(V) != V or V < 16:
        raise ValueError(f"{what}: head width {V}: the fused gated norm takes powers of two from 16")
    for name in ("attn_norm", "w_in", "conv_w", "neg_A", "dt_bias", "o_norm", "w_o", "mlp_norm",
                 "w_gate_up", "w_down", "embed", "lm_head", "final_norm"):
        if not getattr(wt, name).is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous")
    return L, N_in, D, C, W, wt.w_down.shape[2]


def resident_programs(device: torch.device, programs: int | None) -> int:
    """A persistent kernel's grid: `programs`, at most (and by default) one an SM."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS
    return min(programs or sms, sms)


class PersistentDecodeStep:
    """One launch per AR token for a GDN model of heads [K, V] and one gated output: the
    weights, the scratch vectors and the barrier counter, made once (a CUDA graph holds
    their addresses). `programs` defaults to the device's SM count."""

    def __init__(self, weights: DecodeWeights, num_heads: int, head_dim: int, head_v_dim: int, eps: float,
                 swish: bool = True, neg_eigval: bool = False, programs: int | None = None, timed: bool = False):
        wt, dev = weights, weights.w_in.device
        H, K, V = num_heads, head_dim, head_v_dim
        L, N_in, D, C, W, I = check_decode_weights(wt, H, K, V, "decode step")
        self.programs = resident_programs(dev, programs)
        self.weights, self.device, self.dtype = wt, dev, wt.w_in.dtype
        self.shape = dict(L=L, D=D, H=H, K=K, V=V, W=W, I=I, VOCAB=wt.lm_head.shape[0])
        self.eps, self.scale, self.swish, self.neg_eigval = eps, K ** -0.5, swish, neg_eigval
        f32 = dict(device=dev, dtype=torch.float32)
        self.zeros = torch.zeros(max(D, H * V, 2 * I), device=dev, dtype=self.dtype)
        self.res_a, self.res_b, self.x = (torch.zeros(D, device=dev, dtype=self.dtype) for _ in range(3))
        self.y_in = torch.zeros(N_in, device=dev, dtype=self.dtype)
        self.o = torch.zeros(H * V, **f32)
        self.gate_up = torch.zeros(2 * I, device=dev, dtype=self.dtype)
        self.counter = torch.zeros(1, device=dev, dtype=torch.int32)
        self.status = torch.zeros(1, device=dev, dtype=torch.int32)
        # (benchmarks) when each program ends each phase: 5 a layer, the head, the greedy pick
        self.times = torch.zeros(5 * L + 2, self.programs, device=dev, dtype=torch.int64) if timed else None
        self.phases = 5 * L + 1
        P, elem = self.programs, wt.w_in.element_size()
        bk = lambda k, head=1: max(head, 16, min(triton.next_power_of_2(k), 1024 // elem))  # noqa: E731
        bn = lambda n, k: _block_n(n, P, k, elem)  # noqa: E731
        BK = triton.next_power_of_2(K)
        BK_D, BK_O, BK_I = bk(D), bk(H * V, V), bk(I)
        self.blocks = dict(
            BN_IN=bn(N_in, BK_D), BN_O=bn(D, BK_O), BN_GU=bn(2 * I, BK_D), BN_DOWN=bn(D, BK_I),
            BN_HEAD=bn(self.shape["VOCAB"], BK_D), BK_D=BK_D, BK_O=BK_O, BK_I=BK_I, BK=BK,
            BV=min(V, max(16, 4096 // BK)), BW=triton.next_power_of_2(W), BC=64, VEC=16 // elem)

    def __call__(self, token: torch.Tensor, cache: torch.Tensor, S: torch.Tensor, logits: torch.Tensor,
                 greedy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Feed `token` ([1] or [1, 1] int64): cache [L, 1, C, W] and S [L, 1, H, K, V] fp32
        are updated in place, logits ([vocab] fp32) written. `greedy` (next_token [1, 1],
        out [n], count [1], int64) also takes the argmax as the next token into next_token and
        out[count] and counts it, inside the same launch."""
        wt, s = self.weights, self.shape
        if S.dtype != torch.float32 or not (S.is_contiguous() and cache.is_contiguous()):
            raise ValueError("decode step: S must be contiguous fp32 and the conv cache contiguous")
        if logits.dtype != torch.float32 or logits.numel() != s["VOCAB"] or not logits.is_contiguous():
            raise ValueError(f"decode step: logits must be {s['VOCAB']} contiguous fp32 values")
        next_token, out, count = greedy if greedy is not None else (token, token, token)
        compiled = _decode_step_kernel[(self.programs,)](
            token, wt.embed, self.zeros, wt.attn_norm, wt.w_in, wt.conv_w,
            wt.conv_b if wt.conv_b is not None else wt.conv_w, wt.neg_A, wt.dt_bias, wt.o_norm, wt.w_o,
            wt.mlp_norm, wt.w_gate_up, wt.w_down, wt.final_norm, wt.lm_head, cache, S, logits,
            next_token, out, count, out.numel(), self.res_a, self.res_b, self.x, self.y_in, self.o,
            self.gate_up, self.counter, self.status, self.times if self.times is not None else self.counter,
            self.eps, self.scale, **s, TIMED=self.times is not None,
            HAS_BIAS=wt.conv_b is not None, NEG_EIGVAL=self.neg_eigval, SWISH=self.swish,
            GREEDY=greedy is not None, **self.blocks, num_warps=4)
        carveout.prefer(compiled)
        self.phases = 5 * s["L"] + (2 if greedy is not None else 1)

    def phase_us(self) -> list[float]:
        """(timed) Each phase's µs in the last call (`kernels.pdl.phase_us`): A-E of each layer,
        the LM head, and (greedy) the pick."""
        return phase_us(self.times, self.phases)

    def failed(self) -> bool:
        """Whether a barrier gave up waiting since this step was made (reads the device)."""
        return bool(self.status.item())
