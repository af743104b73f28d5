"""The AR token's input projection with the conv step in its epilogue
(kernels/triton_projection.py: `norm_linear_conv`) against `norm_linear_conv_ref`: the output
(conv columns and the rest), the residual and the shifted cache. On the GPU here; on the CPU
through Triton's interpreter, in tests/test_kernels.py's "step" group. The runtime's side (the
AR forward that takes it) is checked with torch ops on the CPU."""
from __future__ import annotations

import os

import pytest
import torch

from kernels import reference
from tests.test_kernels import RTOL, needs_cuda, rel_err


def check_norm_linear_conv(K: int, N: int, C: int, W: int, dtype, bias: bool, device, seed: int = 0,
                           steps: int = 3, **blocks) -> list[str]:
    """`steps` tokens in a row through the kernel, each against the reference from the cache
    the kernel left: the cache's older W-1 entries must be the previous ones shifted, bit for
    bit, and the newest (the projection's output) and the outputs within rounding."""
    from kernels.triton_projection import norm_linear_conv
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    w, norm_w = rnd(N, K, scale=K ** -0.5), rnd(K, scale=0.1) + 1
    conv_w, conv_b = rnd(C, W, scale=0.5), rnd(C, scale=0.1) if bias else None
    cache = rnd(1, C, W)
    # fp32: rounding only; bf16: one ulp (2^-8) of the projection or the conv, and Triton's CPU
    # interpreter truncates where the GPU rounds to nearest
    tol = RTOL if dtype == torch.float32 else 2e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 1e-2
    problems = []
    for step in range(steps):
        x, res = rnd(1, 1, K), rnd(1, 1, K)
        before = cache.cpu().clone()
        y, summed = norm_linear_conv(x, norm_w, 1e-6, res, w, cache, conv_w, conv_b, **blocks)
        want = reference.norm_linear_conv_ref(*(t.cpu() if torch.is_tensor(t) else t for t in (
            x, norm_w, 1e-6, res, w, before, conv_w, conv_b)))
        for name, got, ref in (("conv columns", y[..., :C], want[0][..., :C]),
                               ("other columns", y[..., C:], want[0][..., C:]), ("residual", summed, want[1]),
                               ("newest cache entry", cache[..., -1], want[2][..., -1])):
            if not (got.shape == ref.shape and rel_err(got, ref) < tol):
                problems.append(f"token {step}: {name} relative error {rel_err(got, ref):.2e}")
        if not torch.equal(cache[..., :-1].cpu(), before[..., 1:]):
            problems.append(f"token {step}: the cache's older entries are not the previous ones shifted")
    return problems


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("K,N,C,W,bias,blocks", [
    (2048, 8208, 6144, 4, False, {}),                    # the GDN-1.3B shape's input projection
    (384, 1164, 768, 4, True, {}),                       # the embedded model's
    (256, 200, 100, 4, False, {"block_n": 16, "block_k": 64, "split_k": 4}),   # split-K asked: ignored
    (128, 72, 64, 2, True, {"gemv": True, "block_n": 4, "block_k": 128})])
def test_norm_linear_conv_matches_reference(K, N, C, W, bias, blocks, dtype):
    assert not check_norm_linear_conv(K, N, C, W, dtype, bias, "cuda", seed=K + N, **blocks)


def test_norm_linear_conv_rejects_bad_inputs():
    """Two rows, a cache of the wrong shape or dtype, or a conv width that is not a power of
    two: a clear error before any launch."""
    from kernels.triton_projection import norm_linear_conv
    K, N, C, W = 32, 40, 24, 4
    w, nw, conv_w = torch.zeros(N, K), torch.ones(K), torch.zeros(C, W)
    one = torch.zeros(1, 1, K)
    with pytest.raises(ValueError, match="one row"):
        norm_linear_conv(torch.zeros(1, 2, K), nw, 1e-6, None, w, torch.zeros(1, C, W), conv_w, None)
    with pytest.raises(ValueError, match="one row"):
        norm_linear_conv(one, nw, 1e-6, None, w, torch.zeros(1, C + 1, W), conv_w, None)
    with pytest.raises(ValueError, match="power of two"):
        norm_linear_conv(one, nw, 1e-6, None, w, torch.zeros(1, C, 3), torch.zeros(C, 3), None)
    with pytest.raises(ValueError, match="cache dtype"):
        norm_linear_conv(one, nw, 1e-6, None, w, torch.zeros(1, C, W).half(), conv_w, None)


def test_ar_forward_with_the_conv_in_the_projection_equals_the_plain_step():
    """The AR forward's other branch (the GDN-1.3B shape's on CUDA): torch ops that say they
    take the conv inside the input projection give the logits, states and caches of the
    plain step, token for token."""
    from specla.graphs import ops as graph_ops
    from specla.graphs.runtime import PackedTarget, StaticState
    from tests.helpers import random_target

    class ConvInProjection(graph_ops.TorchOps):
        def conv_in_projection(self, config) -> bool:
            return True

    target = random_target(vocab=64, hidden=64, std=0.2)
    runs = []
    for ops in (graph_ops.TorchOps(), ConvInProjection()):
        packed = PackedTarget(target, ops="torch")
        packed.ops = ops
        state = StaticState(packed.config, packed.device, packed.dtype)
        logits = [packed.ar_forward(torch.tensor([[t]]), state) for t in (3, 17, 5, 60)]
        runs.append((torch.stack(logits), state.recurrent.clone(), state.conv.clone()))
    assert ConvInProjection().conv_in_projection(target.config)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
