"""The one-launch AR step of a small-headed layer (kernels/triton_conv_gates.py:
`conv_recurrent_step`) against `conv_recurrent_step_ref`: the output, the state and the
shifted conv cache. On the GPU here; on the CPU through Triton's interpreter, in
tests/test_kernels.py's "step" group."""
from __future__ import annotations

import os

import pytest
import torch

from kernels import reference
from tests.test_kernels import RTOL, needs_cuda, rel_err


def check_conv_recurrent_step(H: int, K: int, V: int, W: int, dtype, bias: bool, neg_eigval: bool,
                              device, seed: int = 0, block_v: int | None = None, steps: int = 3) -> list[str]:
    """`steps` tokens in a row through the kernel and the reference, x, a and b column slices
    of one projection row as the runtime passes them; the kernel's state and cache carry over
    between tokens, so a wrong shift or a stale read shows in the later outputs."""
    from kernels.triton_conv_gates import conv_recurrent_step
    gen = torch.Generator().manual_seed(seed)
    C = H * (2 * K + V)
    cache = torch.randn(1, C, W, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(C, W, generator=gen) * 0.5).to(device=device, dtype=dtype)
    conv_b = (torch.randn(C, generator=gen) * 0.1).to(device=device, dtype=dtype) if bias else None
    neg_A = -(torch.rand(H, generator=gen) * 2).exp().to(device)
    dt_bias = (torch.randn(H, generator=gen) * 0.5).to(device)
    S = (torch.randn(1, H, K, V, generator=gen) * 0.1).to(device)
    S_ref, cache_ref = S.cpu().clone(), cache.cpu().clone()      # the kernel writes S and cache in place
    problems = []
    for step in range(steps):
        proj = torch.randn(1, 1, C + 2 * H + 5, generator=gen).to(device=device, dtype=dtype)
        x, a, b = proj[..., :C], proj[..., C + 1:C + 1 + H], proj[..., C + 1 + H:C + 1 + 2 * H]
        o = conv_recurrent_step(x, cache, weight, conv_b, a, b, neg_A, dt_bias, S, K, V, neg_eigval,
                                block_v=block_v)
        o_ref, S_ref, cache_ref = reference.conv_recurrent_step_ref(
            *(t.cpu() if torch.is_tensor(t) else t for t in (x, cache_ref, weight, conv_b, a, b, neg_A, dt_bias,
                                                             S_ref, K, V, neg_eigval)))
        # fp32: rounding only; bf16: the conv output is rounded to bf16 once (one ulp, 2^-8),
        # and Triton's CPU interpreter truncates where the GPU rounds to nearest
        tol = RTOL if dtype == torch.float32 else 2e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 1e-2
        for name, got, want in (("o", o, o_ref), ("state", S, S_ref)):
            if not (got.shape == want.shape and rel_err(got, want) < tol):
                problems.append(f"token {step}: {name} relative error {rel_err(got, want):.2e}")
        if not torch.equal(cache.cpu(), cache_ref):
            problems.append(f"token {step}: the conv cache is not the reference's shift")
    return problems


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H,K,V,W,bias,neg_eigval,block_v", [
    (6, 64, 64, 4, False, False, None),      # the embedded model's heads
    (4, 128, 256, 4, True, True, None),      # V in tiles of 32
    (2, 16, 32, 3, False, False, 16),
    (8, 256, 256, 4, False, False, None)])   # the 1.3B shape's: the kernel takes it, the engine does not
def test_conv_recurrent_step_matches_reference(H, K, V, W, bias, neg_eigval, block_v, dtype):
    assert not check_conv_recurrent_step(H, K, V, W, dtype, bias, neg_eigval, "cuda", seed=H + K, block_v=block_v)


def test_conv_recurrent_step_rejects_bad_shapes():
    from kernels.triton_conv_gates import conv_recurrent_step
    H, K, V, W = 2, 16, 16, 4
    C = H * (2 * K + V)
    x, cache, weight = torch.zeros(1, 1, C), torch.zeros(1, C, W), torch.zeros(C, W)
    ab, neg_A, dt = torch.zeros(1, 1, H), torch.zeros(H), torch.zeros(H)
    with pytest.raises(ValueError, match="fp32"):
        conv_recurrent_step(x, cache, weight, None, ab, ab, neg_A, dt, torch.zeros(1, H, K, V).half(), K, V)
    with pytest.raises(ValueError, match="do not fit"):
        conv_recurrent_step(x[..., :-1], cache, weight, None, ab, ab, neg_A, dt, torch.zeros(1, H, K, V), K, V)
