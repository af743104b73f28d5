"""One split of each SM's unified L1 / shared memory for the persistent kernels.

An SM splits its 256 KB of on-chip memory between the L1 cache and shared memory, and the
driver picks the split (the carveout) per kernel from what the kernel asks for. Where two
kernels that alternate (a speculative step's verification and draft) get different splits,
the SM is reconfigured between them, which drains it and empties L1. Giving every persistent
kernel the same preferred split (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`, a
percent of the most shared memory an SM has) removes that switch.

`PREFERRED` None leaves the driver's choice; -1 asks for it back on a kernel already set.
`prefer(compiled)` is called with the Triton kernel a launch returns; it sets the attribute
once per kernel and value, through the driver library torch loaded, and records each
kernel's shared memory and registers in `SEEN` for the benchmarks.
"""
from __future__ import annotations

import ctypes
import functools

PREFERRED: int | None = None
SEEN: dict[str, dict] = {}

_ATTR_PREFERRED_CARVEOUT = 9        # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_set: dict[int, int] = {}           # function handle -> the percent it was given


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library (libcuda), or None where there is none."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def prefer(compiled) -> None:
    """Apply `PREFERRED` to a launched Triton kernel (its `function` handle); a no-op where it
    is None, off CUDA, or already applied. A refused call raises: the split asked for was not
    set, and a benchmark that asked for it must not time the driver's choice instead."""
    function = getattr(compiled, "function", None)
    if not function:
        return
    seen = SEEN[getattr(compiled, "name", "?")] = {
        "shared_bytes": getattr(getattr(compiled, "metadata", None), "shared", None),
        "registers": getattr(compiled, "n_regs", None), "carveout": _set.get(function)}
    if PREFERRED is None or _set.get(function) == PREFERRED:
        return
    lib = _driver()
    if lib is None:
        return
    code = lib.cuFuncSetAttribute(ctypes.c_void_p(function), _ATTR_PREFERRED_CARVEOUT, ctypes.c_int(PREFERRED))
    if code != 0:
        raise RuntimeError(f"cuFuncSetAttribute(preferred carveout {PREFERRED}) returned CUDA error {code}")
    _set[function] = seen["carveout"] = PREFERRED


def preferred_of(function: int) -> int | None:
    """The preferred carveout a kernel's function handle has now (reads the driver), or None."""
    lib = _driver()
    if lib is None or not function:
        return None
    value = ctypes.c_int()
    if lib.cuFuncGetAttribute(ctypes.byref(value), _ATTR_PREFERRED_CARVEOUT, ctypes.c_void_p(function)) != 0:
        return None
    return value.value
