"""Linear layers for CPU inference: oneDNN with the weight packed once.

The embedded pair is small enough that its matmuls, not FLOPs or Python, set the pace on the
CPU, and PyTorch's default fp32 path (MKL sgemm) is slow for the few-row products decoding
makes. oneDNN with a pre-packed (blocked) weight is faster for them, so AR decoding and
verification both get faster, the verification of a draft most (the measurement:
`benchmarks/results/cpu/NOTES.md`).

`linear(x, weight)` takes that path for fp32 CPU tensors when autograd is off (inference),
and is `F.linear` everywhere else (training, CUDA, other dtypes, builds without oneDNN).
Results equal `F.linear` up to fp32 rounding (a different summation order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

# The packing is tuned for a batch of this many rows; any row count works.
PACK_ROWS = 8
# private ops of PyTorch's oneDNN backend (inductor uses them): without either, plain F.linear
_ENABLED = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
# the overload itself: a few microseconds less per call than resolving the packet each time
_OP = torch.ops.mkldnn._linear_pointwise.default if _ENABLED else None


# weight -> (its version when packed, packed weight); entries go with their weights. A side
# table rather than an attribute on the tensor, so models and weights still deep-copy
# (an opaque oneDNN tensor cannot be copied).
_PACKED = WeakIdKeyDictionary()


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout, packed once and again only when the weight is
    modified in place (its version moves)."""
    # inference tensors (e.g. weights concatenated under inference_mode) have no version
    # counter; they are never written in place here
    version = 0 if weight.is_inference() else weight._version
    cached = _PACKED.get(weight)
    if cached is None or cached[0] != version:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        cached = _PACKED[weight] = (version, packed)
    return cached[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through packed oneDNN weights at fp32 CPU inference."""
    # under torch.compile, F.linear: inductor picks (and packs) its own kernels
    if (not _ENABLED or torch.is_grad_enabled() or torch.compiler.is_compiling() or x.device.type != "cpu"
            or x.dtype != torch.float32 or weight.dtype != torch.float32):
        return F.linear(x, weight, bias)
    return _OP(x.contiguous(), _packed(weight), bias, "none", [], "")


class Linear(torch.nn.Linear):
    """`nn.Linear` (same parameters, same state_dict) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
