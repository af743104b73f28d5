"""Programmatic dependent launch (Hopper's grid dependency control) for this project's kernels.

A kernel launched with it may start while the kernel before it in the stream still runs:
it is scheduled once every program of that kernel has called `gdc_launch_dependents` (or
exited), and `gdc_wait` blocks until that kernel has finished and its writes are visible.
So the launch and whatever a kernel does before `gdc_wait` overlap the previous kernel's
tail. Before `gdc_wait` a kernel may read only what no kernel writes (weights): with every
kernel signalling at its top, the kernels still running may be several launches back.

Used by the GEMV form of the fused projections (`kernels/triton_projection.py`), which
loads its first weight tile before the wait: the embedded model's AR step is 11% faster
with it on the H200 (benchmarks/results/h200/session12/). With nothing to do before the
wait (the tl.dot form at 9 rows) a kernel was slower with it, so the others launch plainly.
On by default (`use_pdl`); applies on sm_90+ with compiled Triton, not the interpreter. A
kernel takes a `PDL: tl.constexpr` and is launched with `**launch_options(device)`.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:        # an older Triton: launches stay plainly stream-ordered
    gdc_launch_dependents = gdc_wait = None

_STATE = {"enabled": True}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"     # read once, as Triton does


def use_pdl(enabled: bool) -> None:
    """Launch the kernels that take it with programmatic dependent launch, where it applies."""
    _STATE["enabled"] = bool(enabled)


def pdl_enabled() -> bool:
    return _STATE["enabled"]


def pdl_applies(device: torch.device) -> bool:
    return (_STATE["enabled"] and gdc_wait is not None and device.type == "cuda"
            and not _INTERPRETED and _capability(device) >= 9)


def launch_options(device: torch.device) -> dict:
    """The launch keywords of a kernel with a `PDL` constexpr: PDL on, or nothing."""
    return {"PDL": True, "launch_pdl": True} if pdl_applies(device) else {}


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


# A grid wait that has polled this many times gives up (and says so) instead of hanging the GPU.
GRID_SPIN_LIMIT = tl.constexpr(1 << 20)


@triton.jit
def grid_arrive(counter):
    """Count this program's arrival at a grid-wide barrier of a persistent kernel; the release
    publishes its stores (every thread's, issued before the one thread that arrives)."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")


@triton.jit
def grid_wait(counter, target, status):
    """Wait until `target` arrivals in all; the acquire makes the arrived programs' stores
    visible to every thread here. Split from the arrival so a program can start loads that
    depend on no other program (weights) before it waits. Sets `status` if it gives up."""
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")     # lowered to one ld.acquire
    spins = 0
    while (seen < target) & (spins < GRID_SPIN_LIMIT):
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.store(status, 1)
    tl.debug_barrier()


@triton.jit
def stamp(times, phase, pid, programs, TIMED: tl.constexpr):
    """(TIMED, benchmarks only) this program's end of `phase` in ns of the GPU's global timer."""
    if TIMED:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)
        tl.store(times + phase * programs + pid, now)


def phase_us(times: torch.Tensor, phases: int) -> list[float]:
    """Each phase's µs in the last timed call of a persistent kernel (`stamp`'s [phases, programs]
    ends): the last program's end of it minus the last program's end of the phase before (the
    first phase's, from the first end of all)."""
    ends = times[:phases].max(dim=1).values.double()
    starts = torch.cat([times[:phases].min().view(1).double(), ends[:-1]])
    return ((ends - starts) / 1e3).tolist()
