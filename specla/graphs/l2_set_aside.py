"""A part of L2 set aside for a small target's weights, so that the other kernel of a
speculative step (the draft) does not evict them.

The persistent kernels load their weight tiles with the `evict_last` priority
(`kernels/triton_projection._weight_tile`). That priority keeps lines only inside the part of
L2 a process sets aside for persisting accesses (`cudaLimitPersistingL2CacheSize`), which is
0 unless asked for; torch has no call for it, so the CUDA runtime that torch loaded is called
through ctypes. The set-aside is the device's, for the whole process; the engine asks for one
(the target's weights' bytes) when `specla.graphs.whole_step.L2_SET_ASIDE` is on.
"""
from __future__ import annotations

import ctypes
import functools

import torch

_LIMIT_PERSISTING_L2 = 6            # cudaLimitPersistingL2CacheSize
_ATTR_MAX_PERSISTING_L2 = 108       # cudaDevAttrMaxPersistingL2CacheSize


@functools.lru_cache(maxsize=None)
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            loaded = [line.split()[-1] for line in maps if "libcudart" in line]
    except OSError:
        loaded = []
    for name in loaded[:1] + ["libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def set_aside(device: torch.device, nbytes: int) -> int:
    """Set aside up to `nbytes` of `device`'s L2 for persisting accesses (at most the device's
    maximum; 0 gives the set-aside back). Returns the bytes set aside now, or 0 where it
    cannot be done (not CUDA, no runtime library found, a call refused)."""
    if device.type != "cuda":
        return 0
    torch.cuda.init()
    lib = _cudart()
    if lib is None:
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        most = ctypes.c_int()
        if lib.cudaDeviceGetAttribute(ctypes.byref(most), _ATTR_MAX_PERSISTING_L2, index) != 0:
            return 0
        if lib.cudaDeviceSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(min(max(nbytes, 0), most.value))) != 0:
            return 0
        now = ctypes.c_size_t()
        if lib.cudaDeviceGetLimit(ctypes.byref(now), _LIMIT_PERSISTING_L2) != 0:
            return 0
        return now.value
