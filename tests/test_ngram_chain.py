"""The n-gram drafter's chain as one Triton launch (kernels/triton_ngram.py) against its
reference (`ngram_chain_ref`), and that reference against the drafter's own tensor core
(`specla.drafters.ngram`). On the CPU the kernel runs in Triton's interpreter; run as a script
(`TRITON_INTERPRET=1 python tests/test_ngram_chain.py --interpreter`) it checks the kernel."""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from kernels.reference import ngram_chain_ref  # noqa: E402

CUDA = torch.cuda.is_available()


def repetitive(rng: random.Random, n: int, vocab: int = 12) -> list[int]:
    """Tokens that repeat as code does: copies of earlier stretches, with some noise."""
    out = [rng.randrange(vocab) for _ in range(min(n, 6))]
    while len(out) < n:
        if rng.random() < 0.6 and len(out) > 4:
            start = rng.randrange(len(out) - 3)
            out += out[start:start + rng.randrange(2, 8)]
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


def core_chain(history: list[int], new: list[int], capacity: int, max_ngram: int, min_ngram: int,
               nodes: int) -> tuple[list[int], list[int]]:
    """The same step through `specla.drafters.ngram`'s tensor core, width 1, order recency."""
    from specla.drafters import ngram
    buf = torch.full((capacity,), -1, dtype=torch.long)
    buf[:len(history)] = torch.tensor(history, dtype=torch.long)
    length = torch.tensor([len(history)])
    buf, length = ngram.append(buf, length, torch.tensor(new + [0], dtype=torch.long), torch.tensor([len(new)]))
    tokens, valid, _ = ngram.continuations(buf, length, max_ngram=max_ngram, min_ngram=min_ngram, width=1,
                                           depth=nodes, pool=min(32, capacity), order="recency")
    return buf[:int(length)].tolist(), torch.where(valid[0], tokens[0], -1).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_reference_equals_the_drafters_tensor_core(seed):
    rng = random.Random(seed)
    capacity = rng.choice([16, 40, 200])
    history = repetitive(rng, rng.randrange(1, capacity + 1))
    for _ in range(8):
        new = repetitive(rng, rng.randrange(1, 6))
        max_n = rng.choice([1, 2, 4])
        args = (capacity, max_n, rng.randrange(1, max_n + 1), rng.choice([1, 5, 8]))
        want = core_chain(history, new, *args)
        assert ngram_chain_ref(history, new, *args) == want
        history = want[0]


def test_reference_without_a_match_drafts_nothing():
    assert ngram_chain_ref([1, 2, 3], [4], 16, 4, 1, 3) == ([1, 2, 3, 4], [-1, -1, -1])
    assert ngram_chain_ref([5, 6, 5], [], 16, 4, 1, 3) == ([5, 6, 5], [6, 5, -1])   # the chain runs out


def check_kernel(device: str, steps: int = 40, seed: int = 0) -> int:
    """The kernel's history, length and chain after each of `steps` random speculative steps
    (and a first draft with nothing appended) equal the reference's; returns the steps run."""
    from kernels.triton_ngram import NgramChain
    rng = random.Random(seed)
    checked, overflowed = 0, 0
    for capacity, max_n, min_n, nodes in ((64, 4, 1, 7), (2048, 3, 2, 5), (48, 1, 1, 16)):
        kernel = NgramChain(capacity, max_n, min_n, nodes)
        history = repetitive(rng, rng.randrange(2, capacity // 2))
        buf = torch.full((capacity,), -1, dtype=torch.long, device=device)
        buf[:len(history)] = torch.tensor(history, device=device)
        length = torch.tensor([len(history)], device=device)
        chain = torch.zeros(nodes, dtype=torch.long, device=device)
        kernel(buf, length, chain)
        _, want = ngram_chain_ref(history, [], capacity, max_n, min_n, nodes)
        assert chain.tolist() == want, (chain.tolist(), want)
        N, P = 10, 9                      # a step's verified nodes and its path capacity
        for _ in range(steps):
            tokens = torch.tensor(repetitive(rng, N), device=device)
            a = rng.randrange(0, P)
            path = [0] + sorted(rng.sample(range(1, N), a)) + [0] * (P - 1 - a)
            bonus = rng.randrange(12)
            result = torch.tensor([a, path[a], bonus] + path, device=device)
            kernel(buf, length, chain, (result, tokens))
            new = [int(tokens[i]) for i in path[1:a + 1]] + [bonus]
            overflowed += len(history) + len(new) > capacity          # the oldest tokens move out
            history, want = ngram_chain_ref(history, new, capacity, max_n, min_n, nodes)
            assert int(length) == len(history) and buf[:len(history)].tolist() == history
            assert chain.tolist() == want, (chain.tolist(), want)
            checked += 1
    assert overflowed > 0
    return checked


def check_decoder(device: str, graphed: bool) -> str:
    """A random target decoded with the device n-gram drafter's chain as the kernel and as
    torch ops: the same steps, and AR's tokens (fp32). Returns the kernel path's note."""
    from specla.decode import DecodeSettings, ar_generate
    from specla.drafters import model_free_drafter
    from specla.drafters.base import DraftSettings
    from specla.graphs.decoders import GraphedDecoder
    from specla.graphs.drafters import DeviceNgramDrafter
    from specla.graphs.runtime import PackedTarget
    from tests.helpers import random_target

    target = random_target(vocab=16, hidden=64).to(device)
    rng = random.Random(3)
    prompt = repetitive(rng, 40)
    n = 48
    want = ar_generate(target, prompt, DecodeSettings(max_new_tokens=n)).tokens
    drafter = model_free_drafter("ngram", target)
    settings = DraftSettings(tree="chain", budget=6, depth=6)
    runs, note = {}, None
    for kernel in (True, False):
        dev = DeviceNgramDrafter(drafter, settings, device, chain_kernel=kernel)
        note = note or dev.draft_note
        dec = GraphedDecoder(PackedTarget(target), dev, settings, capacity=n + 16, use_graph=graphed)
        steps = list(dec.steps(prompt, n))
        tokens = [t for st in steps for t in [st.tree.tokens[i] for i in st.outcome.path[1:]] + [st.outcome.bonus]]
        assert tokens[:n] == want[:n]
        runs[kernel] = [(st.tree.tokens, st.outcome.accepted) for st in steps]
    assert runs[True] == runs[False]
    assert max(accepted for _, accepted in runs[True]) > 0          # the history's repeats were drafted
    return note


def test_kernel_refuses_bad_buffers():
    pytest.importorskip("triton")
    from kernels.triton_ngram import NgramChain
    with pytest.raises(ValueError, match="min_ngram"):
        NgramChain(64, 2, 3, 4)
    kernel = NgramChain(64, 4, 1, 4)
    with pytest.raises(ValueError, match=r"\[64\] int64"):
        kernel(torch.zeros(32, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(4, dtype=torch.long))


def test_kernel_interpreter():
    """The kernel against the reference, and a decode with it inside the device drafter."""
    from tests.test_decode_step import run_interpreted
    out = run_interpreted(__file__)
    assert "ok 36 steps" in out and "ok decoder: one Triton launch" in out, out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_kernel_matches_reference_on_the_gpu():
    assert check_kernel("cuda", steps=200) == 600


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_graphed_kernel_chain_equals_the_torch_chain_and_ar():
    assert check_decoder("cuda", graphed=True) == "one Triton launch"


def test_without_a_gpu_the_chain_stays_torch_ops():
    from specla.drafters import model_free_drafter
    from specla.drafters.base import DraftSettings
    from specla.graphs.drafters import DeviceNgramDrafter
    from tests.helpers import random_target

    drafter = model_free_drafter("ngram", random_target(vocab=16, hidden=64))
    dev = DeviceNgramDrafter(drafter, DraftSettings(tree="chain", budget=6, depth=6), "cpu")
    assert dev.kernel is None and dev.draft_note == "torch ops (it needs a CUDA device)"
    tree = DeviceNgramDrafter(drafter, DraftSettings(tree="best-first", top_k=2, budget=6, depth=6), "cpu")
    assert tree.kernel is None and "kernel drafts chains" in tree.draft_note


if __name__ == "__main__":
    if sys.argv[1:] != ["--interpreter"] or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"usage: TRITON_INTERPRET=1 python {sys.argv[0]} --interpreter")
    print(f"ok {check_kernel('cpu', steps=12)} steps")
    print(f"ok decoder: {check_decoder('cpu', graphed=False)}")
