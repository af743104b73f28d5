"""The large-headed AR recurrence step (kernels/triton_recurrent_step.py) against
`recurrent_step_ref`: the output and the state, over tokens in a row. On the GPU here; on the
CPU through Triton's interpreter, in tests/test_kernels.py's "step" group."""
from __future__ import annotations

import os

import pytest
import torch

from kernels import reference
from tests.test_kernels import RTOL, needs_cuda, rel_err


def check_recurrent_step(H: int, K: int, V: int, dtype, neg_eigval: bool, device, seed: int = 0,
                         steps: int = 3, **tile) -> list[str]:
    """`steps` tokens, q, k, v, a and b column slices of one projection row as the runtime
    passes them; the kernel's state carries over, so a wrong tile or a stale read shows later."""
    from kernels.triton_recurrent_step import recurrent_step
    gen = torch.Generator().manual_seed(seed)
    neg_A = -(torch.rand(H, generator=gen) * 2).exp().to(device)
    dt_bias = (torch.randn(H, generator=gen) * 0.5).to(device)
    S = (torch.randn(1, H, K, V, generator=gen) * 0.1).to(device)
    S_ref = S.cpu().clone()
    # fp32: rounding only; bf16: o rounds to bf16 once, and the CPU interpreter truncates
    tol = RTOL if dtype == torch.float32 else 2e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 1e-2
    problems = []
    for step in range(steps):
        row = torch.randn(1, 1, H * (2 * K + V) + 2 * H + 3, generator=gen).to(device=device, dtype=dtype)
        q, k = row[..., :H * K].unflatten(-1, (H, K)), row[..., H * K:2 * H * K].unflatten(-1, (H, K))
        v = row[..., 2 * H * K:H * (2 * K + V)].unflatten(-1, (H, V))
        a, b = row[..., -2 * H - 3:-H - 3], row[..., -H - 3:-3]
        o = recurrent_step(q, k, v, a, b, neg_A, dt_bias, S, neg_eigval, **tile)
        o_ref, S_ref = reference.recurrent_step_ref(*(t.cpu() for t in (q, k, v, a, b, neg_A, dt_bias)), S_ref,
                                                    neg_eigval)
        for name, got, want in (("o", o, o_ref), ("state", S, S_ref)):
            if not (got.shape == want.shape and got.dtype == want.dtype and rel_err(got, want) < tol):
                problems.append(f"token {step}: {name} relative error {rel_err(got, want):.2e}")
    return problems


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H,K,V,neg_eigval,tile", [
    (8, 256, 256, False, {}),                              # the GDN-1.3B shape's heads
    (8, 256, 256, True, {"block_v": 16, "num_warps": 2}),
    (3, 64, 48, False, {"block_v": 32})])                  # a masked last tile
def test_recurrent_step_matches_reference(H, K, V, neg_eigval, tile, dtype):
    assert not check_recurrent_step(H, K, V, dtype, neg_eigval, "cuda", seed=H + K, **tile)


def test_recurrent_step_rejects_bad_inputs():
    from kernels.triton_recurrent_step import recurrent_step
    H, K, V = 2, 16, 16
    q, v, ab, S = torch.zeros(1, 1, H, K), torch.zeros(1, 1, H, V), torch.zeros(1, 1, H), torch.zeros(1, H, K, V)
    with pytest.raises(ValueError, match="one token"):
        recurrent_step(torch.zeros(1, 2, H, K), q, v, ab, ab, ab[0, 0], ab[0, 0], S)
    with pytest.raises(ValueError, match="fp32"):
        recurrent_step(q, q, v, ab, ab, ab[0, 0], ab[0, 0], S.half())
    with pytest.raises(ValueError, match="follow one another"):
        recurrent_step(torch.zeros(1, 1, K, H).transpose(-1, -2), q, v, ab, ab, ab[0, 0], ab[0, 0], S)
    with pytest.raises(ValueError, match="power of two"):
        recurrent_step(q, q, v, ab, ab, ab[0, 0], ab[0, 0], S, block_v=12)
