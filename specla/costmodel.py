"""Pick a verification mode from the draft's shape.

On CUDA the thresholds come from `benchmarks/results/verify_cost.json` (measured on the H200
by `python -m specla bench --suite kernels`). Until a fit exists the defaults below are
used: chains go to the chain kernels (`triton_verify` picks the walk or the one-launch
parallel form by size), trees of up to 16 nodes to the one-launch parallel form, larger
deep narrow trees to the hybrid, larger wide ones to the tree-masked parallel form.

On the CPU every draft goes to the tree-masked parallel form: the plain-torch walks issue
~20 tiny ops per node and layer, the parallel form ~25 per layer whatever the shape, so it
wins from two nodes on (the measurement: `benchmarks/results/cpu/NOTES.md`).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

FIT_FILE = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "verify_cost.json"


@lru_cache(maxsize=1)
def _fit() -> dict:
    try:
        return json.loads(FIT_FILE.read_text()).get("auto_rule", {})
    except (OSError, ValueError):
        return {}


def choose_mode(num_nodes: int, depth: int, is_chain: bool, device_type: str = "cuda") -> str:
    if device_type != "cuda":
        return "tree"
    fit = _fit()
    if is_chain:
        return "chain" if num_nodes <= fit.get("chain_max_nodes", 64) else "tree"
    from kernels.triton_verify import PARALLEL_MAX_NODES
    if num_nodes <= PARALLEL_MAX_NODES:
        # the one-launch parallel form: 6-10 us a layer against the hybrid's 9-25 at N 4-16
        # (H200, benchmarks/results/h200/session12/)
        return "tree"
    # depth/size close to 1 means most nodes lie on one long chain: the hybrid walks it
    # serially with few boundary states; bushy trees profit from the parallel form.
    if depth + 1 >= fit.get("hybrid_min_depth_ratio", 0.5) * num_nodes:
        return "hybrid"
    return "tree"
