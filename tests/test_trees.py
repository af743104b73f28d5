"""Trees grown on the device (static shapes) equal the trees the host grows from the same rows.

`specla.graphs.trees.grow_tree` is `specla.drafters.tree_build.build_tree` as tensor ops: for
random candidate rows, every shape (chain, beam, best-first), budget and pruning threshold,
both give the same tokens, parents and log-probs, in the same node order.
"""
from __future__ import annotations

import random

import pytest
import torch

from specla.drafters import tree_build
from specla.drafters.lilicorr import LiLiCorrDrafter, tree_rows
from specla.graphs.trees import conditional_rows, grow_tree, static_rows, tree_nodes


def real_nodes(grown):
    keep = grown.real.tolist()
    pick = lambda xs: [x for x, k in zip(xs, keep) if k]  # noqa: E731
    return pick(grown.tokens.tolist()), pick(grown.parents.tolist()), pick(grown.logp.tolist())


@pytest.mark.parametrize("rows_kind", ["block", "lilicorr"])
def test_device_trees_equal_host_trees(rows_kind):
    for trial in range(150):
        rng = random.Random(trial)
        S, k = rng.randint(1, 7), rng.randint(1, 5)
        gen = torch.Generator().manual_seed(trial)
        top = torch.log_softmax(torch.randn(S, 50, generator=gen) * 2, -1).topk(k, -1)
        cand, logp = top.indices, top.values
        shape = rng.choice(["chain", "beam", "best-first"])
        budget, tau = rng.randint(1, 20), rng.choice([None, 0.5, 2.0, 5.0])
        if rows_kind == "block":
            rows = [[(int(cand[d][j]), float(logp[d][j]), d) for j in range(k)] for d in range(S)]
            expand, device_rows = tree_build.static_rows(rows), static_rows(cand, logp)
        else:
            start, pair = torch.randn(k, generator=gen), torch.randn(max(S - 1, 0), k, k, generator=gen)
            start_lp, pair_lp = tree_rows(start, pair, logp)
            expand = LiLiCorrDrafter._rows(cand.tolist(), start_lp, pair_lp)
            device_rows = conditional_rows(cand, start_lp, pair_lp)
        want, _ = tree_build.build_tree(7, expand, shape=shape, top_k=k, budget=budget, max_depth=S, prune_tau=tau)
        grown = grow_tree(torch.tensor([7]), device_rows, depth=S, shape=shape, top_k=k, budget=budget,
                          prune_tau=tau)
        assert len(grown.tokens) == tree_nodes(shape, k, budget, S), "static size"
        tokens, parents, lps = real_nodes(grown)
        assert (tokens, parents) == (want.tokens, want.parents), (trial, shape, budget, tau)
        assert max(abs(a - b) for a, b in zip(lps, want.logprobs)) < 1e-5
        dummies = (~grown.real).tolist()
        assert dummies == sorted(dummies), "dummy nodes come last"
        assert all(t == -1 for t, d in zip(grown.tokens.tolist(), dummies) if d)
