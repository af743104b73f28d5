"""The persistent kernels' preferred L1 / shared-memory split (kernels/carveout.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import carveout
from tests.test_decode_step import SHAPES, check_decode_step
from tests.test_kernels import needs_cuda


@pytest.fixture
def preferred():
    """Restores the module's setting and records after a test."""
    saved, seen, done = carveout.PREFERRED, dict(carveout.SEEN), dict(carveout._set)
    yield
    carveout.PREFERRED = saved
    carveout.SEEN.clear(), carveout.SEEN.update(seen)
    carveout._set.clear(), carveout._set.update(done)


def test_nothing_to_set_without_a_loaded_kernel(preferred, monkeypatch):
    """A launch that returns no loaded kernel (the interpreter's) is left alone; a loaded one is
    recorded, and with no preference the driver is never called."""
    monkeypatch.setattr(carveout, "_driver", lambda: pytest.fail("the driver was called"))
    carveout.PREFERRED = 100
    carveout.prefer(None)
    carveout.prefer(SimpleNamespace(function=0, name="k"))
    assert "k" not in carveout.SEEN
    carveout.PREFERRED = None
    carveout.prefer(SimpleNamespace(function=123, name="k", n_regs=40, metadata=SimpleNamespace(shared=4096)))
    assert carveout.SEEN["k"] == {"shared_bytes": 4096, "registers": 40, "carveout": None}


def test_set_once_per_kernel_and_value(preferred, monkeypatch):
    calls = []

    class Driver:
        def cuFuncSetAttribute(self, function, attribute, value):
            calls.append((function.value, attribute, value.value))
            return 0

    monkeypatch.setattr(carveout, "_driver", lambda: Driver())
    kernel = SimpleNamespace(function=77, name="k", n_regs=40, metadata=SimpleNamespace(shared=0))
    carveout.PREFERRED = 100
    carveout.prefer(kernel), carveout.prefer(kernel)
    carveout.PREFERRED = -1
    carveout.prefer(kernel)
    assert calls == [(77, 9, 100), (77, 9, -1)]
    assert carveout.SEEN["k"]["carveout"] == -1


def test_a_refused_split_raises(preferred, monkeypatch):
    monkeypatch.setattr(carveout, "_driver", lambda: SimpleNamespace(cuFuncSetAttribute=lambda *a: 1))
    carveout.PREFERRED = 50
    with pytest.raises(RuntimeError, match="CUDA error 1"):
        carveout.prefer(SimpleNamespace(function=5, name="k", n_regs=1, metadata=None))


@needs_cuda
@pytest.mark.parametrize("percent", [100, -1])
def test_decode_step_with_a_preferred_split(preferred, percent):
    """The persistent AR step runs with the split asked for and still matches its reference."""
    carveout.PREFERRED = percent
    assert not check_decode_step(*SHAPES["embedded"], torch.bfloat16, "cuda", steps=3)
    handles = [f for f, p in carveout._set.items() if p == percent]
    assert handles
    if percent >= 0:            # (what the driver reports for its own choice is not documented)
        assert all(carveout.preferred_of(f) == percent for f in handles)
