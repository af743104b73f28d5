"""Reading a batch of steps' records back while the device runs the next batch.

A plain `.tolist()` of a device buffer waits for everything queued on the stream, so reading
batch k after queueing batch k+1 would wait for k+1 too. Instead the rows of batch k are
copied into pinned host memory right behind its steps, on the same stream, and the host
waits only for those copies (an event recorded after them). Two batches' copies may be in
flight, each into its own host mirrors, so the host can queue batch k+1 as soon as batch k's
copy has landed and turn batch k's rows into lists while the device runs k+1.
"""
from __future__ import annotations

import collections
from collections.abc import Mapping

import torch

DEPTH = 2       # batches whose copies may be queued and not taken yet


class Readback:
    """Host mirrors of per-step device buffers (row s: step s), `rows` rows deep, two sets.

    `enqueue(start, count)` queues the copy of rows start..start+count-1 behind the work
    queued so far; `take()` waits for the oldest queued copy alone and returns its rows
    (`TakenRows`, each field turned into lists when first read). At most two copies are
    queued and not taken; the rows a `take` returned stay readable until the second
    `enqueue` after that take reuses their mirrors.
    """

    def __init__(self, buffers: dict[str, torch.Tensor], rows: int):
        self.buffers = buffers
        self.cuda = any(b.is_cuda for b in buffers.values())
        self.host = [{name: torch.empty((rows,) + tuple(b.shape[1:]), dtype=b.dtype, pin_memory=self.cuda)
                      for name, b in buffers.items()} for _ in range(DEPTH)]
        self.writes = [0] * DEPTH                 # copies queued into each set of mirrors so far
        self.next = 0
        self.pending: collections.deque[tuple[int, int, torch.cuda.Event | None]] = collections.deque()

    @property
    def rows(self) -> int:
        return next(iter(self.host[0].values())).shape[0] if self.buffers else 0

    def enqueue(self, start: int, count: int) -> None:
        if len(self.pending) == DEPTH:
            raise RuntimeError(f"{DEPTH} batches' rows are queued and were not taken")
        if count > self.rows:
            raise ValueError(f"{count} rows exceed the readback's {self.rows}")
        mirror, self.next = self.next, (self.next + 1) % DEPTH
        self.writes[mirror] += 1
        for name, buf in self.buffers.items():
            self.host[mirror][name][:count].copy_(buf[start:start + count], non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((mirror, count, event))

    def discard(self) -> None:
        """Forget every queued copy (their rows are not wanted)."""
        self.pending.clear()

    def take(self) -> TakenRows:
        if not self.pending:
            raise RuntimeError("no rows were queued")
        mirror, count, event = self.pending.popleft()
        if event is not None:
            event.synchronize()
        return TakenRows(self, mirror, count)


class TakenRows(Mapping):
    """One taken batch's rows by field name, each field's lists made when it is first read."""

    def __init__(self, readback: Readback, mirror: int, count: int):
        self.readback, self.mirror, self.count = readback, mirror, count
        self.write = readback.writes[mirror]
        self.lists: dict[str, list] = {}

    def __getitem__(self, name: str) -> list:
        if name not in self.lists:
            if self.readback.writes[self.mirror] != self.write:
                raise RuntimeError("these rows' host mirrors were reused by a later batch's copy")
            self.lists[name] = self.readback.host[self.mirror][name][:self.count].tolist()
        return self.lists[name]

    def __iter__(self):
        return iter(self.readback.buffers)

    def __len__(self) -> int:
        return len(self.readback.buffers)
