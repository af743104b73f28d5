"""The draft kernel's best-first tree (`_best_first_tree`, kernels/triton_draft_step.py)
against its reference, `grow_tree` over the slots' static rows (the block drafter's) or
conditional rows (LiLiCorr's), and the conv window index `SpecTopology.rebuild` derives
from its parents: candidate tables with tied log-probs, with impossible (-inf) candidates,
and with too few live candidates for the budget (dummy nodes). On the GPU, and on the CPU
through Triton's interpreter."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.test_decode_step import run_interpreted
from tests.test_kernels import needs_cuda

CONV = 4
CASES = [  # (slots, top_k, nodes, what the table holds)
    (7, 8, 16, "ties"), (7, 8, 16, "dead"), (7, 4, 16, "ties"), (3, 2, 16, "few"), (5, 4, 9, "ties"),
    (7, 8, 16, "one"),
]
COND_CASES = [(7, 8, 16, "ties"), (7, 8, 16, "dead"), (7, 4, 9, "ties"), (3, 2, 16, "few"), (6, 5, 16, "plain")]


def table(slots: int, k: int, kind: str, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cand [slots, k] and their log-probs, best first per slot."""
    gen = torch.Generator().manual_seed(seed)
    cand = torch.randint(0, 500, (slots, k), generator=gen)
    logp = -(torch.rand(slots, k, generator=gen) * 3)
    if kind in ("ties", "few"):            # quarter steps: many equal scores along different paths
        logp = (logp * 4).round() / 4
    if kind == "dead":                     # the tail of some slots impossible
        logp[torch.rand(slots, k, generator=gen) < 0.3] = float("-inf")
    if kind == "one":                      # a certain top-1 (log-prob 0) everywhere
        logp[:, 0] = 0.0
    logp = logp.sort(dim=1, descending=True).values
    return cand.to(device), logp.to(device)


def conditional_table(slots: int, k: int, kind: str, seed: int, device):
    """cand [slots, k] and LiLiCorr-like rows: the root's [k] and each slot's [k, k] under a
    parent of each candidate, in candidate order (not sorted)."""
    gen = torch.Generator().manual_seed(100 + seed)
    cand = torch.randint(0, 500, (slots, k), generator=gen)
    start, pair = -(torch.rand(k, generator=gen) * 3), -(torch.rand(slots - 1, k, k, generator=gen) * 3)
    if kind in ("ties", "few"):
        start, pair = (start * 4).round() / 4, (pair * 4).round() / 4
    if kind == "dead":
        pair[torch.rand(slots - 1, k, k, generator=gen) < 0.3] = float("-inf")
    return cand.to(device), start.to(device), pair.to(device)


def reference(cand: torch.Tensor, cand_logp: torch.Tensor, nodes: int, pair: torch.Tensor | None = None):
    """grow_tree's tree and SpecTopology's conv index: static rows cand_logp [slots, k], or
    (`pair` given) conditional rows with the root's row cand_logp [k]."""
    from specla.graphs.spec import SpecTopology
    from specla.graphs.trees import conditional_rows, grow_tree, static_rows
    from specla.tree import DraftTree
    slots, k = cand.shape
    root = torch.zeros(1, dtype=torch.long, device=cand.device)
    rows = static_rows(cand, cand_logp) if pair is None else conditional_rows(cand, cand_logp, pair)
    grown = grow_tree(root, rows, depth=slots, shape="best-first", top_k=k, budget=nodes - 1)
    topo = SpecTopology(DraftTree([0] * nodes, [-1] + [0] * (nodes - 1)), CONV, slots + 1, cand.device)
    topo.rebuild(grown.parents)
    return grown.tokens, grown.parents, grown.logp, topo.conv_index


def check_trees(device) -> list[str]:
    from kernels.triton_draft_step import best_first_tree
    problems = []
    runs = [(f"static {kind}", slots, k, nodes, *table(slots, k, kind, seed, device), None)
            for seed, (slots, k, nodes, kind) in enumerate(CASES)]
    runs += [(f"conditional {kind}", slots, k, nodes, *conditional_table(slots, k, kind, seed, device))
             for seed, (slots, k, nodes, kind) in enumerate(COND_CASES)]
    for what, slots, k, nodes, cand, lp, pair in runs:
        rows = lp if pair is None else torch.cat([lp.expand(1, k, k), pair])
        got = best_first_tree(cand, rows, nodes, CONV)
        want = reference(cand, lp, nodes, pair)
        for name, g, w in zip(("tokens", "parents", "logp", "conv index"), got, want):
            g, w = (g[1:], w[1:]) if name == "tokens" else (g, w)
            if not torch.equal(g.cpu(), w.cpu()):
                problems.append(f"{what} {slots}x{k}, {nodes} nodes: {name} {g.tolist()} != {w.tolist()}")
    return problems


@needs_cuda
def test_best_first_tree_matches_grow_tree():
    assert not check_trees("cuda")


def test_best_first_tree_bad_input():
    pytest.importorskip("triton")
    from kernels.triton_draft_step import best_first_tree
    for nodes in (1, 17):
        with pytest.raises(ValueError, match="grows 2 to 16"):
            best_first_tree(torch.zeros(7, 8, dtype=torch.long), torch.zeros(7, 8), nodes, CONV)
    with pytest.raises(ValueError, match="rows"):
        best_first_tree(torch.zeros(7, 8, dtype=torch.long), torch.zeros(7, 4), 16, CONV)


def test_best_first_tree_interpreter():
    """One program through Triton's CPU interpreter."""
    assert run_interpreted(__file__).count("ok") == 1


if __name__ == "__main__":
    if sys.argv[1:] != ["--interpreter"] or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"usage: TRITON_INTERPRET=1 python {sys.argv[0]} --interpreter")
    problems = check_trees("cpu")
    print("ok" if not problems else "FAILED " + "; ".join(problems))
    sys.exit(1 if problems else 0)
