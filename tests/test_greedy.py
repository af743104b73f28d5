"""The greedy token in one launch (kernels/triton_greedy.py: `greedy_take`) against
`greedy_take_ref`: the token, the output buffer and the count. On the GPU here; on the CPU
through Triton's interpreter, in tests/test_kernels.py's "step" group."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.test_kernels import needs_cuda


def greedy_rows(vocab: int, chunk: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Logits rows [1, vocab] that catch a wrong reduction: random; the maximum tied across
    two chunks and inside one (the first index must win); the maximum in the masked tail of
    the last chunk; every logit equal."""
    gen = torch.Generator().manual_seed(seed)
    chunk = min(chunk, vocab // 2)       # a vocabulary in one chunk: the ties are in that one
    rnd = lambda: torch.randn(1, vocab, generator=gen)  # noqa: E731
    across, inside, tail = rnd(), rnd(), rnd()
    across[0, [chunk + 3, 3]] = 9.0
    inside[0, [chunk + 7, chunk + 5]] = 9.0
    tail[0, vocab - 1] = 9.0
    return [("random", rnd()), ("tie across chunks", across), ("tie inside a chunk", inside),
            ("last logit", tail), ("all equal", torch.zeros(1, vocab))]


def check_greedy_take(vocab: int, chunk: int, device, seed: int = 0, slots: int = 3) -> list[str]:
    """Every row of `greedy_rows` in turn into a buffer of `slots` (fewer than the rows: the
    count runs past it and the last slot takes the overflow, as the reference's clamp), the
    scratch counter re-armed between launches."""
    from kernels.triton_greedy import greedy_take
    bufs = [(torch.zeros(1, 1, dtype=torch.long), torch.zeros(slots, dtype=torch.long),
             torch.zeros(1, dtype=torch.long)) for _ in range(2)]
    got = [t.to(device) for t in bufs[0]]
    problems = []
    for name, row in greedy_rows(vocab, chunk, seed):
        greedy_take(row.to(device), *got, chunk=chunk)
        reference.greedy_take_ref(row, *bufs[1])
        if got[0].item() != bufs[1][0].item():
            problems.append(f"{name}: token {got[0].item()}, want {bufs[1][0].item()}")
    for name, g, w in zip(("out", "count"), got[1:], bufs[1][1:]):
        if not torch.equal(g.cpu(), w):
            problems.append(f"{name} {g.tolist()}, want {w.tolist()}")
    return problems


@needs_cuda
@pytest.mark.parametrize("vocab,chunk", [(32000, 2048), (4096, 2048), (5000, 1024), (100, 2048)])
def test_greedy_take_matches_reference(vocab, chunk):
    assert not check_greedy_take(vocab, chunk, "cuda", seed=vocab)


def test_greedy_take_rejects_bad_input():
    from kernels.triton_greedy import greedy_take
    token, out, count = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                         torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="fp32 row"):
        greedy_take(torch.zeros(2, 10), token, out, count)
    with pytest.raises(ValueError, match="fp32 row"):
        greedy_take(torch.zeros(1, 10, dtype=torch.bfloat16), token, out, count)
    with pytest.raises(ValueError, match="count must be int64"):
        greedy_take(torch.zeros(1, 10), token, out, torch.zeros(1, dtype=torch.int32))
