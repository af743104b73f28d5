"""Read a `bench_kernels.py --only gemv` run and print the launch_counts flag (`+fewN.K.S`) of
the GEMV tiling that streams the GDN-1.3B out and down projections (the matrices whose column
blocks alone do not fill the GPU) fastest together, or nothing when the default rule is.

    python benchmarks/gemv_best.py DIR/kernels.json      # -> e.g. +few16.256.8
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

FEW_BLOCK_PROJECTIONS = ("out (gated norm)", "mlp down (swiglu)")


def best_few_blocks(results: list[dict], model: str = "gdn-1.3b") -> tuple[tuple[int, int, int] | None, dict]:
    """(the fastest whole (block_n, block_k, split_k) over both projections or None for the
    default, the summed µs of each candidate with "default" for the rule's own tilings)."""
    sums: dict = defaultdict(dict)
    for r in results:
        if r.get("name") != "gemv" or r.get("model") != model or r.get("projection") not in FEW_BLOCK_PROJECTIONS:
            continue
        if "default" in r:
            key = "default"
        elif all(k in r for k in ("block_n", "block_k", "split_k")) and "packed" not in r:
            key = (r["block_n"], r["block_k"], r["split_k"])
        else:
            continue
        sums[key][r["projection"]] = r["us"]["median"]
    totals = {k: sum(v.values()) for k, v in sums.items() if len(v) == len(FEW_BLOCK_PROJECTIONS)}
    if not totals:
        raise ValueError(f"no {model} GEMV rows of {FEW_BLOCK_PROJECTIONS} with both projections timed")
    best = min(totals, key=totals.get)
    return (None if best == "default" else best), {str(k): round(v, 3) for k, v in totals.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernels_json", type=Path)
    args = p.parse_args(argv)
    best, totals = best_few_blocks(json.loads(args.kernels_json.read_text())["results"])
    print(json.dumps(totals), file=sys.stderr)
    print("" if best is None else "+few" + ".".join(map(str, best)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
