"""The n-gram drafter's chain as one Triton launch (`kernels/triton_ngram.py`).

`ngram_chain_for` builds the kernel for a chain-shaped `DeviceNgramDrafter` where it applies
and checks it against the drafter's torch path first (the same histories, the same
chains), so a kernel that disagrees is never used; the note says which path drafts and why.
"""
from __future__ import annotations

import os

import torch

from specla.graphs.draft_step import kernel_or_note

# Draft n-gram chains in one launch wherever the kernel applies.
NGRAM_CHAIN_KERNEL = True


def _why_not(drafter, wanted: bool | None) -> str | None:
    """None if the kernel can draft for this drafter (on CUDA; wanted=True also in Triton's
    interpreter), else why not."""
    if drafter.shape != "chain":
        return f"a {drafter.shape} tree (the kernel drafts chains)"
    if drafter.core.order != "recency":
        return f"order {drafter.core.order} (the kernel ranks by recency)"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if drafter.device.type != "cuda" and not (wanted and interpreted):
        return "it needs a CUDA device"
    try:
        import kernels.triton_ngram  # noqa: F401
    except ImportError as err:
        return f"Triton is not importable ({err})"
    return None


def ngram_chain_for(drafter, wanted: bool | None = None):
    """(NgramChain, note) for a `DeviceNgramDrafter`, or (None, why not) (`kernel_or_note`;
    wanted=True also runs it in Triton's interpreter)."""
    def build():
        from kernels.triton_ngram import NgramChain
        c = drafter.core
        return NgramChain(drafter.history.shape[0], c.max_ngram, c.min_ngram, drafter.nodes - 1)
    return kernel_or_note(wanted, NGRAM_CHAIN_KERNEL, "n-gram chain kernel", _why_not(drafter, wanted), build,
                          lambda kernel: check_ngram_chain(drafter, kernel), "one Triton launch")


@torch.no_grad()
def check_ngram_chain(drafter, kernel, steps: int = 6) -> str | None:
    """The kernel against the drafter's torch path over a few steps from a repetitive random
    history: each step appends a path of the step's tokens, then drafts. The drafter's
    buffers are put back."""
    dev = drafter.device
    gen = torch.Generator().manual_seed(0)
    n = min(drafter.history.shape[0] // 2, 96)
    start = torch.randint(0, 6, (n,), generator=gen).to(dev)
    saved = [t.clone() for t in drafter.buffers()]
    history, length = drafter.history.clone(), drafter.length.clone()
    history[:n] = start
    length.fill_(n)
    ours = (history.clone(), length.clone())
    chain = torch.zeros(drafter.nodes - 1, dtype=torch.long, device=dev)
    root = torch.zeros(1, dtype=torch.long, device=dev)
    try:
        for step in range(steps):
            if step:
                tokens = torch.randint(0, 6, (drafter.nodes,), generator=gen).to(dev)
                result = torch.tensor([step % drafter.nodes, 0, step % 6] + list(range(drafter.nodes)), device=dev)
                history, length = drafter.extended(result, tokens, history, length)
                kernel(*ours, chain, (result, tokens))
            else:
                kernel(*ours, chain)
            drafter.history.copy_(history)
            drafter.length.copy_(length)
            want = drafter.grow(root).tokens[1:]
            n = int(length)
            if int(ours[1]) != n or not torch.equal(ours[0][:n], history[:n]):
                return "the kernel's history is not the torch path's"
            if not torch.equal(chain, want):
                return f"the kernel's chain {chain.tolist()} is not the torch path's {want.tolist()}"
    except Exception as err:  # noqa: BLE001 - a kernel that does not run is a reason, not a crash
        return f"{type(err).__name__}: {str(err)[:200]}"
    finally:
        for t, s in zip(drafter.buffers(), saved):
            t.copy_(s)
    return None
