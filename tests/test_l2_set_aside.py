"""The L2 set-aside for a small target's weights (specla/graphs/l2_set_aside.py) and the
evict_last priority of the persistent kernels' weight loads that it serves."""
from __future__ import annotations

import os

import pytest
import torch

from tests.test_kernels import needs_cuda

compiles = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                              reason="the check compiles; the interpreter does not")


def test_no_set_aside_off_cuda():
    from specla.graphs.l2_set_aside import set_aside
    assert set_aside(torch.device("cpu"), 8 << 20) == 0


@compiles
def test_only_the_persistent_kernels_load_weights_with_evict_last():
    """Compiled for sm_90 on the CPU: the persistent AR step's weight loads carry the L2
    evict_last policy; the per-op GEMV projection's (a large model's, streamed) do not."""
    pytest.importorskip("triton")
    from benchmarks import ptxas_check
    from kernels import triton_decode_step as ds, triton_projection as tp
    from tests.test_decode_step import SHAPES, random_weights
    bf, z = torch.bfloat16, torch.zeros
    L, D, H, K, V, W, I, vocab = SHAPES["tiny"]
    step = ds.PersistentDecodeStep(random_weights(L, D, H, K, V, W, I, vocab, bf, "cpu", False, 0), H, K, V, 1e-6,
                                   programs=132)
    C = H * (2 * K + V)
    persistent = ptxas_check.recorded_launches(
        lambda: step(torch.ones(1, dtype=torch.long), z(L, 1, C, W, dtype=bf), z(L, 1, H, K, V), z(vocab)),
        ["_decode_step_kernel"], ds)[0]
    x, w = z(1, 512, dtype=bf), z(1024, 512, dtype=bf)
    per_op = ptxas_check.recorded_launches(lambda: tp.norm_linear(x, torch.ones(512, dtype=bf), 1e-6, x, w),
                                           ["_projection_kernel"], tp)[0]
    assert "L2::evict_last" in ptxas_check.compile_sm90(*persistent).asm["ptx"]
    assert "evict_last" not in ptxas_check.compile_sm90(*per_op).asm["ptx"]


@needs_cuda
def test_set_aside_is_set_and_given_back():
    from specla.graphs.l2_set_aside import set_aside
    device = torch.device("cuda")
    got = set_aside(device, 8 << 20)
    if got == 0:
        pytest.skip("this device or runtime sets no L2 aside")
    assert 0 < got <= 8 << 20
    assert set_aside(device, 1 << 40) >= got          # capped at the device's maximum
    assert set_aside(device, 0) == 0
