"""Prefetch of the next kernel's weights into L2 (Hopper's bulk prefetch), so that HBM keeps
streaming across a kernel boundary.

Why: at batch 1 a large model's step is a chain of weight-streaming kernels, and each costs
1.4-3.6 us more than its bytes at the copy rate whatever its tiling (the GDN-1.3B shape on
the H100, benchmarks/results/h100/session26/): the last programs of one kernel drain, the next
kernel's programs wait for its end, then reload their input before their weight loads start,
and HBM idles meanwhile. The next kernel's weights depend on nothing, so the programs of the
kernel before it can ask for them once their own loads are issued: one thread a program issues
`cp.async.bulk.prefetch.L2` for its share of the next matrix (no registers, no shared memory,
no wait), and the next kernel then reads those bytes from L2.

A prefetch is only a hint: it changes no value, so a kernel computes the same bits with or
without it. Applies on sm_90+ with compiled Triton; elsewhere the kernels take PREFETCH 0.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.pdl import _capability

_STATE = {"enabled": True}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# One bulk prefetch asks for at most this many bytes (the PTX ISA gives no limit but a u32);
# a program's share is a few of them.
CHUNK_BYTES = tl.constexpr(32 << 10)
# Where a projection issues its share: "end" (once its own weight loads are issued, so the
# prefetch fills the kernel's drain and the boundary) or "start".
AT = "end"
# At most this many bytes of the next matrix are prefetched (its first rows) by a kernel of one
# AR row (MAX_BYTES) or of a verification's rows (MAX_BYTES_ROWS). 1.3B shape on the H100
# (benchmarks/results/h100/session28/): 24 MB made AR 11% slower (1.527 against 1.373 ms/token),
# 4 MB 2.9% faster (1.327 against 1.367); 8 MB took the 9-node verification from 1930 to 1838 us
# of kernels but made AR's replay slower than 4 MB did.
MAX_BYTES = 4 << 20
MAX_BYTES_ROWS = 8 << 20


def use_l2_prefetch(enabled: bool) -> None:
    _STATE["enabled"] = bool(enabled)


def l2_prefetch_applies(device: torch.device) -> bool:
    return (_STATE["enabled"] and device.type == "cuda" and not _INTERPRETED
            and _capability(device) >= 9)


def prefetch_args(nxt: torch.Tensor | None, device: torch.device,
                  rows: int = 1) -> tuple[torch.Tensor | None, int, int]:
    """A kernel's (pointer, bytes, PREFETCH mode) for prefetching the first bytes of `nxt` (up to
    MAX_BYTES for a kernel of one or two rows, MAX_BYTES_ROWS for more): mode 0 (nothing to
    prefetch, or no bulk prefetch here), 1 at the program's start, 2 at its end."""
    if nxt is None or not l2_prefetch_applies(device):
        return None, 0, 0
    nbytes = min(nxt.numel() * nxt.element_size(), MAX_BYTES if rows <= 2 else MAX_BYTES_ROWS) // 16 * 16
    return nxt, nbytes, 1 if AT == "start" else 2


@triton.jit
def _bulk_prefetch(addr, size):
    """Thread 0 of the program asks L2 for `size` bytes (a multiple of 16) from `addr` (16-byte
    aligned); nothing waits for them."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_lines(ptrs):
    """Ask L2 for the cache line of each pointer of the block `ptrs` (scattered rows, where a
    bulk prefetch wants one contiguous range); nothing waits for them."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_share(base, nbytes, part, parts):
    """Program `part` of `parts` prefetches its 16-byte-aligned share of [base, base + nbytes)."""
    share = tl.cdiv(tl.cdiv(nbytes, parts), 16) * 16
    lo = part * share
    hi = tl.minimum(nbytes, lo + share)
    addr = base.to(tl.int64)
    for off in range(lo, hi, CHUNK_BYTES):
        _bulk_prefetch(addr + off, tl.minimum(hi - off, CHUNK_BYTES).to(tl.int32))
