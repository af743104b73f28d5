"""The block draft kernel's best-first tree (`_best_first_tree`, kernels/triton_draft_step.py)
against its reference, `grow_tree` over the slots' static rows and the conv window index
`SpecTopology.rebuild` derives from its parents: candidate tables with tied log-probs, with
impossible (-inf) candidates, and with too few live candidates for the budget (dummy nodes).
On the GPU, and on the CPU through Triton's interpreter."""
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


def reference(cand: torch.Tensor, cand_logp: torch.Tensor, nodes: int):
    from specla.graphs.spec import SpecTopology
    from specla.graphs.trees import grow_tree, static_rows
    from specla.tree import DraftTree
    slots, k = cand.shape
    root = torch.zeros(1, dtype=torch.long, device=cand.device)
    grown = grow_tree(root, static_rows(cand, cand_logp), depth=slots, shape="best-first", top_k=k,
                      budget=nodes - 1)
    topo = SpecTopology(DraftTree([0] * nodes, [-1] + [0] * (nodes - 1)), CONV, slots + 1, cand.device)
    topo.rebuild(grown.parents)
    return grown.tokens, grown.parents, grown.logp, topo.conv_index


def check_trees(device) -> list[str]:
    from kernels.triton_draft_step import best_first_tree
    problems = []
    for seed, (slots, k, nodes, kind) in enumerate(CASES):
        cand, logp = table(slots, k, kind, seed, device)
        got = best_first_tree(cand, logp, nodes, CONV)
        want = reference(cand, logp, nodes)
        for name, g, w in zip(("tokens", "parents", "logp", "conv index"), got, want):
            g, w = (g[1:], w[1:]) if name == "tokens" else (g, w)
            if not torch.equal(g.cpu(), w.cpu()):
                problems.append(f"{kind} {slots}x{k}, {nodes} nodes: {name} {g.tolist()} != {w.tolist()}")
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


def test_best_first_tree_interpreter():
    """One program through Triton's CPU interpreter."""
    assert run_interpreted(__file__).count("ok") == 1


if __name__ == "__main__":
    if sys.argv[1:] != ["--interpreter"] or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"usage: TRITON_INTERPRET=1 python {sys.argv[0]} --interpreter")
    problems = check_trees("cpu")
    print("ok" if not problems else "FAILED " + "; ".join(problems))
    sys.exit(1 if problems else 0)
