"""Launch one fused projection of the GDN-1.3B shape a few times, for a kernel profiler to read
(Nsight Compute reads counters the events of bench_kernels.py cannot):

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:_projection_kernel \\
        python benchmarks/profile_projection.py --name out --rows 9 --tiling '{"preload": true}'

Each launch streams another copy of the weights (more copies than fit L2), as a decode step's
layers do.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_kernels import project, projection_inputs, projection_models, projection_shapes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", required=True, help="a word of the projection's name: in, up, out or down")
    p.add_argument("--rows", type=int, default=9)
    p.add_argument("--model", default="gdn-1.3b")
    p.add_argument("--tiling", default="{}", help="tiling keywords of kernels/triton_projection.py, as JSON")
    p.add_argument("--copies", type=int, default=8, help="distinct weight copies, launched in turn")
    p.add_argument("--launches", type=int, default=3)
    args = p.parse_args(argv)
    from kernels import triton_projection as tp

    config = projection_models()[args.model]
    proj, (prologue, K, N) = next((k, v) for k, v in projection_shapes(config).items() if args.name in k.split())
    device = torch.device("cuda")
    inputs = [projection_inputs(prologue, args.rows, K, N, config, device, seed=c) for c in range(args.copies)]
    blocks = json.loads(args.tiling)
    for i in range(args.copies + args.launches):      # the first copies: compile and warm up
        project(tp, prologue, inputs[i % args.copies], **blocks)
    torch.cuda.synchronize()
    head = config.head_v_dim if prologue == "gated_norm" else 0
    picked = tp.picked_tiling(args.rows, N, K, torch.bfloat16, head, device)
    print(json.dumps({"projection": proj, "M": args.rows, "K": K, "N": N, "tiling": blocks, "default": picked}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
