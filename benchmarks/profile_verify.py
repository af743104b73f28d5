"""Launch the parallel form of one layer's verification at the GDN-1.3B head shape a few
times, for a kernel profiler to read (Nsight Compute reads what bench_kernels.py's events
cannot):

    ncu --clock-control none --launch-skip 8 --launch-count 1 -k regex:_parallel_kernel \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \\
        python benchmarks/profile_verify.py --nodes 9 --pending 8 --config '{"gram_first": true}'

Each launch reads another layer's state (more states than fit L2), as a verification's
layers do.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_kernels import B, H, K, V, Topo, chain, factors, node_inputs, random_tree  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=9)
    p.add_argument("--pending", type=int, default=8, help="deferred-commit factors folded in (0: none)")
    p.add_argument("--tree", action="store_true", help="a random tree of --nodes instead of a chain")
    p.add_argument("--config", default="{}", help="keywords of kernels.triton_verify.verify, as JSON")
    p.add_argument("--states", type=int, default=16, help="distinct layer states, launched in turn")
    p.add_argument("--launches", type=int, default=3)
    args = p.parse_args(argv)
    from kernels import triton_verify

    device = torch.device("cuda")
    x = node_inputs(args.nodes, device, seed=args.nodes)
    pending = factors(args.pending, device, seed=1) if args.pending else None
    parents = random_tree(args.nodes) if args.tree else chain(args.nodes)
    mode = "tree" if args.tree else "chain"
    topo = Topo(parents, device)
    states = torch.randn(args.states, B, H, K, V, device=device)
    config = json.loads(args.config)
    for i in range(args.states + args.launches):           # the first round: compile and warm up
        triton_verify.verify(mode, x["q"], x["k"], x["v"], x["g"], x["beta"], states[i % args.states], topo,
                             pending=pending, form="parallel", **config)
    torch.cuda.synchronize()
    print(json.dumps({"mode": mode, "N": args.nodes, "P": args.pending, "config": config}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
