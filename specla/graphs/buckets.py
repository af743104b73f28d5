"""Draft shapes padded to a few sizes, so that similar drafts share one captured graph."""
from __future__ import annotations

from specla.tree import DraftTree


TREE_BUCKETS = (8, 16, 32, 64, 127)      # drafted nodes; the tree kernels hold <= 128 nodes


def pad_tree(tree: DraftTree, buckets: tuple[int, ...] = TREE_BUCKETS) -> DraftTree:
    """A tree padded with dummy nodes hanging off the root (token -1: never accepted) to the
    next bucket size. Cross-branch entries of the tree-masked verifier are exactly zero, so a
    dummy changes no other node's output, and its factors are never selected."""
    drafted = len(tree) - 1
    size = next((b for b in buckets if b >= drafted), drafted)
    extra = size - drafted
    return DraftTree(tree.tokens + [-1] * extra, tree.parents + [0] * extra)


def bucket(tree: DraftTree) -> tuple[tuple, DraftTree]:
    """(graph key, padded tree): chains by padded length, other trees by padded size."""
    if tree.is_chain:
        padded = pad_chain(tree)
        return ("chain", len(padded)), padded
    padded = pad_tree(tree)
    return ("tree", len(padded)), padded


def comb_tree(width: int, budget: int) -> DraftTree:
    """Levels of `width` siblings, each level hanging off the first node of the previous one
    (the shape of `OracleDrafter`'s sibling trees with the true slot first): `budget` nodes."""
    tokens, parents, main = [0], [-1], 0
    while len(tokens) - 1 < budget:
        first = len(tokens)
        for _ in range(min(width, budget - (len(tokens) - 1))):
            tokens.append(0)
            parents.append(main)
        main = first
    return DraftTree(tokens, parents)


CHAIN_BUCKETS = (4, 8, 16, 32, 64)


def max_path_for(budget: int) -> int:
    """Longest accepted path (root included) any bucketed draft of `budget` nodes can have."""
    return next((b for b in CHAIN_BUCKETS if b >= budget), budget) + 1


def pad_chain(tree: DraftTree, buckets: tuple[int, ...] = CHAIN_BUCKETS) -> DraftTree:
    """A chain padded with dummy nodes (token -1, never accepted: no argmax equals it) to the
    next bucket length, so chains of similar length share one graph. Dummies sit at the end:
    only their own (ignored) outputs depend on them."""
    if not tree.is_chain:
        return tree
    drafted = len(tree) - 1
    size = next((b for b in buckets if b >= drafted), drafted)
    return DraftTree.chain(tree.tokens + [-1] * (size - drafted))


def padded_nodes(drafted: int) -> int:
    """Nodes (root included) of the largest padded draft of at most `drafted` drafted nodes."""
    sizes = [next((x for x in buckets if x >= drafted), drafted) for buckets in (CHAIN_BUCKETS, TREE_BUCKETS)]
    return 1 + max(sizes)
