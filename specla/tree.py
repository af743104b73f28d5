"""Draft trees: one structure for chains and trees.

Node 0 is the root: the last token already chosen but not yet fed to the target (the
previous step's bonus token). Every other node is a drafted candidate whose parent comes
before it (topological order). A chain is a tree in which every node has one child.

    tokens   [5, 9, 7, 3]          root 5; 9 and 3 are candidates after 5; 7 follows 9
    parents  [-1, 0, 1, 0]
    index paths (Medusa style, sibling ranks from the root): [[0], [0, 0], [1]]
"""
from __future__ import annotations

import dataclasses
from functools import cached_property

import torch

MAX_TREE_NODES = 256


class TreeError(ValueError):
    """A malformed draft tree."""


@dataclasses.dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    # Draft log-probability of each node given its parent (0 for the root); optional.
    logprobs: list[float] | None = None
    # Nodes the drafter proposed but confidence pruning removed (kept for the views only).
    pruned: list[dict] = dataclasses.field(default_factory=list)
    # Drafts are capped; long chains built by the runtime itself (prefill, training) are not.
    max_nodes: int = dataclasses.field(default=MAX_TREE_NODES, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens = [int(t) for t in self.tokens]
        self.parents = [int(p) for p in self.parents]
        self.validate(self.max_nodes)

    def validate(self, max_nodes: int = MAX_TREE_NODES) -> None:
        n = len(self.tokens)
        if n == 0:
            raise TreeError("empty draft tree: it needs at least the root node")
        if len(self.parents) != n:
            raise TreeError(f"{n} tokens but {len(self.parents)} parents")
        if n > max_nodes:
            raise TreeError(f"draft tree has {n} nodes; the limit is {max_nodes}")
        if self.parents[0] != -1:
            raise TreeError("node 0 must be the root (parent -1)")
        for i, p in enumerate(self.parents[1:], start=1):
            if p == i:
                raise TreeError(f"node {i} is its own parent (a cycle)")
            if p < 0:
                raise TreeError(f"node {i} has no parent: only node 0 may be a root")
            if p > i:
                raise TreeError(f"node {i} comes before its parent {p}: nodes must be in "
                                "topological order (a parent after its child, or a cycle)")
        if self.logprobs is not None and len(self.logprobs) != n:
            raise TreeError(f"{n} tokens but {len(self.logprobs)} log-probs")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], logprobs: list[float] | None = None,
              max_nodes: int = MAX_TREE_NODES) -> "DraftTree":
        return cls(tokens=list(tokens), parents=list(range(-1, len(tokens) - 1)), logprobs=logprobs,
                   max_nodes=max_nodes)

    @cached_property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids

    @cached_property
    def depths(self) -> list[int]:
        depth = [0] * len(self)
        for i, p in enumerate(self.parents[1:], start=1):
            depth[i] = depth[p] + 1
        return depth

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path_to(self, node: int) -> list[int]:
        """Root-to-node path of node indices, root first."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        return [i for i, kids in enumerate(self.children) if not kids]

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] = j is a proper ancestor of i."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], start=1):
            mask[i] = mask[p]
            mask[i, p] = True
        return mask

    def conv_window_index(self, width: int) -> torch.Tensor:
        """[N, width] gather index for the short conv of every node along its own path
        (`kernels.reference.tree_conv_index`)."""
        from kernels.reference import tree_conv_index
        return tree_conv_index(self.parents, width)

    def to_index_paths(self) -> list[list[int]]:
        """Medusa-style shape: for each non-root node, the sibling ranks along its path."""
        rank = {kid: r for kids in self.children for r, kid in enumerate(kids)}
        return [[rank[n] for n in self.path_to(i)[1:]] for i in range(1, len(self))]

    @classmethod
    def from_index_paths(cls, paths: list[list[int]], tokens: list[int]) -> "DraftTree":
        """Build a tree from index paths (root excluded) and one token per node, root first.

        `tokens[0]` is the root; `tokens[i + 1]` belongs to `paths[i]`. Paths must be listed
        parents first, as Medusa presets are.
        """
        if len(tokens) != len(paths) + 1:
            raise TreeError(f"{len(paths)} index paths need {len(paths) + 1} tokens, got {len(tokens)}")
        node_of: dict[tuple[int, ...], int] = {(): 0}
        parents = [-1]
        for i, path in enumerate(paths, start=1):
            key = tuple(path)
            if not key or key in node_of:
                raise TreeError(f"index path {path} is empty or repeated")
            if key[:-1] not in node_of:
                raise TreeError(f"index path {path} comes before its parent {list(key[:-1])}")
            node_of[key] = i
            parents.append(node_of[key[:-1]])
        return cls(tokens=list(tokens), parents=parents)

    def to_networkx(self):
        import networkx as nx

        graph = nx.DiGraph()
        for i, token in enumerate(self.tokens):
            graph.add_node(i, token=token, depth=self.depths[i],
                           logprob=None if self.logprobs is None else self.logprobs[i])
        graph.add_edges_from((p, i) for i, p in enumerate(self.parents) if p >= 0)
        return graph

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "parents": self.parents, "logprobs": self.logprobs,
                "pruned": self.pruned}
