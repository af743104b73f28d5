"""Which recurrence verifies a layer: chain, tree-masked parallel, or hybrid.

On CPU tensors the plain-torch references in `kernels/reference.py` run; on CUDA the Triton
kernels beside them (when importable). `auto` picks per step from the topology with the
cost model in `specla.costmodel` (fitted to measurements on the GPU).
"""
from __future__ import annotations

import contextlib

import torch

from kernels import reference

MODES = ("auto", "chain", "tree", "hybrid")
_kernels_enabled = True


@contextlib.contextmanager
def reference_only():
    """Run the differentiable plain-torch references even on CUDA (training, debugging)."""
    global _kernels_enabled
    before, _kernels_enabled = _kernels_enabled, False
    try:
        yield
    finally:
        _kernels_enabled = before


def resolve_mode(mode: str, topo, device_type: str = "cuda") -> str:
    """The concrete verification mode for this draft (auto: fitted on the GPU, for `device_type`)."""
    if mode not in MODES:
        raise ValueError(f"unknown verification mode {mode!r}; choose one of {', '.join(MODES)}")
    tree = topo.tree
    if mode == "chain" and not tree.is_chain:
        raise ValueError("chain verification needs a chain draft; use tree, hybrid or auto for trees")
    if mode != "auto":
        return mode
    from specla.costmodel import choose_mode
    return choose_mode(len(tree), tree.depth, tree.is_chain, device_type)


def verify_layer(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, S0: torch.Tensor, topo,
                 pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and deltas of every node of `topo` for one layer.

    The state S0 [B,H,K,V] is written only when `pending` (k, delta, g of accepted tokens
    from the previous step, [B,P,...]) is given: those are folded into S0 in place first.
    out: (o, delta) buffers, contiguous [B,N,H,V] (delta fp32, o fp32 or the model's dtype)
    that the kernels write directly; the references copy their delta into out[1]. The delta
    returned is then out[1].
    """
    mode = resolve_mode(mode, topo, q.device.type)
    # The Triton kernels are inference-only; with autograd on (training our plain-torch model
    # on a GPU) the differentiable references run instead.
    if kernels_apply(S0) and not torch.is_grad_enabled():
        from kernels import triton_verify  # imported lazily: CPU machines need no triton
        return triton_verify.verify(mode, q, k, v, g, beta, S0, topo, pending=pending, out=out)
    o, delta = _verify_reference(mode, q, k, v, g, beta, S0, topo, pending)
    if out is None:
        return o, delta
    return o, out[1].copy_(delta)


def _verify_reference(mode, q, k, v, g, beta, S0, topo, pending):
    if pending is not None:
        commit_layer(S0, *pending)
    if mode == "chain":
        return reference.chain_verify_ref(q, k, v, g, beta, S0)
    if mode == "tree":
        return reference.tree_verify_ref(q, k, v, g, beta, S0, topo.parents, _tree_masks(topo))
    return reference.VERIFY_REFERENCES[mode](q, k, v, g, beta, S0, topo.parents)


def _tree_masks(topo) -> reference.TreeMasks:
    """The parallel form's masks, built once per topology rather than once per layer.

    The parents are part of the entry, so a topology whose tree is swapped in place (as
    specla.graphs.spec.SpecTopology.load does) never gets stale masks.
    """
    parents = tuple(topo.tree.parents)
    entry = topo.cache.get("ref_tree_masks")
    if entry is None or entry[0] != parents:
        entry = topo.cache["ref_tree_masks"] = (parents, reference.TreeMasks(topo.parents))
    return entry[1]


def kernels_apply(S: torch.Tensor) -> bool:
    """Whether the Triton kernels verify and commit a state S [B,H,K,V]: on CUDA, unless
    switched off, for the head dims they take (a tiny model's K=8 runs the references)."""
    if not (S.is_cuda and _kernels_enabled):
        return False
    from kernels import triton_verify
    return triton_verify.supports(S.shape[-2], S.shape[-1])


def commit_layer(S: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, g: torch.Tensor) -> None:
    """Fold accepted factors (k [B,P,H,K], delta [B,P,H,V], g [B,P,H]) into S, in place."""
    if kernels_apply(S):
        from kernels import triton_verify
        triton_verify.commit(S, k, delta, g)
    elif k.shape[1] > 1:
        S.copy_(reference.commit_closed_form(S, k, delta, g))
    else:  # one token (every AR step): the very operations of the AR recurrence
        S.copy_(reference.commit_ref(S, k, delta, g))
