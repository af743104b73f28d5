"""The greedy next token of one logits row in one launch: `greedy_take_ref` in
`kernels/reference.py`.

Why: the per-op AR step of a wide target took its token with torch's argmax (a single
block reducing 32000 fp32 logits, 10 us on the H100 at the GDN-1.3B shape), then two more
launches to store it in the output buffer and advance the count. Here each program reduces
one chunk of the row to its (maximum, first index), and the last program to arrive reduces
those partials and writes the token, its slot in the output and the count.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 2048          # logits a program (8 KB of fp32): 16 programs at a 32000-token vocabulary


@triton.jit
def _greedy_take_kernel(logits, vocab, part_max, part_idx, counter, next_token, out, count, max_out,
                        BLOCK: tl.constexpr, PARTS: tl.constexpr, BPARTS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits + offs, mask=offs < vocab, other=float("-inf"))
    top = tl.max(x, axis=0)
    tl.store(part_max + pid, top)
    tl.store(part_idx + pid, tl.min(tl.where(x == top, offs, vocab), axis=0))
    # every thread's partial is stored before one thread's release publishes the arrival
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == PARTS - 1:
        p = tl.arange(0, BPARTS)
        # .cg: from L2, past this SM's L1, which other SMs' stores do not update
        m = tl.load(part_max + p, mask=p < PARTS, other=float("-inf"), cache_modifier=".cg")
        i = tl.load(part_idx + p, mask=p < PARTS, other=vocab, cache_modifier=".cg")
        best = tl.max(m, axis=0)
        # the first index of the maximum, as torch.argmax; clamped so that a row with no
        # maximum (NaN) still yields a token the embedding can read
        token = tl.minimum(tl.min(tl.where(m == best, i, vocab), axis=0), vocab - 1).to(tl.int64)
        c = tl.load(count)
        tl.store(next_token, token)
        tl.store(out + tl.minimum(c, max_out - 1), token)
        tl.store(count, c + 1)
        tl.store(counter, 0)       # re-armed: the next launch is stream-ordered after this one


@functools.lru_cache(maxsize=None)
def _scratch(device: torch.device, parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial maxima, their indices and the arrival counter, made once a (device, size) and
    kept: a captured CUDA graph holds their addresses."""
    return (torch.empty(parts, device=device, dtype=torch.float32),
            torch.empty(parts, device=device, dtype=torch.int32),
            torch.zeros(1, device=device, dtype=torch.int32))


def greedy_take(logits: torch.Tensor, next_token: torch.Tensor, out: torch.Tensor, count: torch.Tensor,
                chunk: int = CHUNK) -> None:
    """argmax(logits [1, vocab] fp32) -> next_token (one int64), out[min(count, len(out) - 1)];
    count += 1. No host sync: the step can be captured in a CUDA graph."""
    if logits.dim() != 2 or logits.shape[0] != 1 or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"greedy_take takes one contiguous fp32 row of logits [1, vocab], got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    for name, t in (("next_token", next_token), ("out", out), ("count", count)):
        if t.dtype != torch.int64 or t.device != logits.device:
            raise ValueError(f"greedy_take: {name} must be int64 on {logits.device}, got {t.dtype} on {t.device}")
    vocab = logits.shape[1]
    block = min(triton.next_power_of_2(vocab), chunk)
    parts = triton.cdiv(vocab, block)
    part_max, part_idx, counter = _scratch(logits.device, parts)
    _greedy_take_kernel[(parts,)](logits, vocab, part_max, part_idx, counter, next_token, out, count, out.numel(),
                                  BLOCK=block, PARTS=parts, BPARTS=triton.next_power_of_2(parts),
                                  num_warps=4)
