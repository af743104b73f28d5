"""Reading a batch of steps' records back while the device runs the next batch.

A plain `.tolist()` of a device buffer waits for everything queued on the stream, so reading
batch k after queueing batch k+1 would wait for k+1 too. Instead the rows of batch k are
copied into pinned host memory right behind its steps, on the same stream, and the host
waits only for those copies (an event recorded after them).
"""
from __future__ import annotations

import torch


class Readback:
    """Host mirrors of per-step device buffers (row s: step s), `rows` rows deep.

    `enqueue(start, count)` queues the copy of rows start..start+count-1 behind the work
    queued so far; `take()` waits for that copy alone and returns the rows as lists. One copy
    is in flight at a time: take it before queueing the next.
    """

    def __init__(self, buffers: dict[str, torch.Tensor], rows: int):
        self.buffers = buffers
        self.cuda = any(b.is_cuda for b in buffers.values())
        self.host = {name: torch.empty((rows,) + tuple(b.shape[1:]), dtype=b.dtype, pin_memory=self.cuda)
                     for name, b in buffers.items()}
        self.pending: tuple[int, torch.cuda.Event | None] | None = None

    @property
    def rows(self) -> int:
        return next(iter(self.host.values())).shape[0] if self.host else 0

    def enqueue(self, start: int, count: int) -> None:
        if self.pending is not None:
            raise RuntimeError("the previous batch's rows were not taken")
        if count > self.rows:
            raise ValueError(f"{count} rows exceed the readback's {self.rows}")
        for name, buf in self.buffers.items():
            self.host[name][:count].copy_(buf[start:start + count], non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending = (count, event)

    def discard(self) -> None:
        """Forget a queued copy (its rows are not wanted)."""
        self.pending = None

    def take(self) -> dict[str, list]:
        if self.pending is None:
            raise RuntimeError("no rows were queued")
        (count, event), self.pending = self.pending, None
        if event is not None:
            event.synchronize()
        return {name: t[:count].tolist() for name, t in self.host.items()}
