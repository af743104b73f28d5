"""The persistent chain verification (kernels/triton_verify_step.py) at the embedded shape:
its time per call in a CUDA graph for several launch settings, and where each setting's time
goes phase by phase (each program stamps the GPU's global timer as it ends a phase).

    python benchmarks/bench_verify_step.py --out DIR [--nodes 8] [--variants 4/256/1,8/256/1]

A variant is warps/block_k/stages, then any tile overrides (4/256/1:BK_I=128:BN_DOWN=32). Random bf16 weights (speed does not depend on their values).
`--accept` adds greedy acceptance to the launch. Writes verify_step.json (verify_step_accept.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.triton_verify_step import PersistentChainVerify  # noqa: E402
from tests.test_decode_step import SHAPES, random_weights  # noqa: E402

PHASES = ("A in-proj + conv/gates", "B recurrence", "C out-proj", "D gate/up", "E down")
ACCEPT_PHASES = ("accept: choices + commit + bookkeeping",)


def make_call(shape: str, nodes: int, programs: int | None, warps: int, block_k: int, stages: int,
              timed: bool = False, blocks: dict[str, int] | None = None, accept: bool = False):
    L, D, H, K, V, W, I, vocab = SHAPES[shape]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    wt = random_weights(L, D, H, K, V, W, I, vocab, dtype, dev, False, 0)
    features = (1, 3, L - 1) if L > 3 else (L - 1,)
    verify = PersistentChainVerify(wt, H, K, V, 1e-6, nodes, features, programs=programs, num_warps=warps,
                                   block_k=block_k, num_stages=stages, timed=timed, blocks=blocks)
    C, P, n = H * (2 * K + V), 8, nodes
    f32 = dict(device=dev, dtype=torch.float32)
    factors = (torch.zeros(L, 1, n, H, K, **f32), torch.zeros(L, 1, n, H, **f32), torch.zeros(L, 1, n, H, V, **f32),
               torch.zeros(L, 1, n, C, device=dev, dtype=dtype))
    pending = (torch.zeros(L, 1, P, H, K, **f32), torch.zeros(L, 1, P, H, V, **f32), torch.zeros(L, 1, P, H, **f32))
    args = (torch.randint(2, vocab, (1, n), device=dev), torch.ones(1, dtype=torch.long, device=dev),
            torch.randn(L, 1, C, W, device=dev).to(dtype), torch.randn(L, 1, H, K, V, **f32) * 0.1, pending,
            torch.zeros(n, vocab, **f32), torch.zeros(n, D, device=dev, dtype=dtype),
            torch.zeros(n, len(features), D, device=dev, dtype=dtype), factors)
    chain_accept = accept_buffers(n, P, dev) if accept else None
    return verify, lambda: verify(*args, accept=chain_accept)


def accept_buffers(nodes: int, max_path: int, dev, steps: int = 4096):
    """Where a greedy acceptance in the launch writes (a step log of `steps` rows; the step
    counter clamps at its last row, so replays stay in bounds)."""
    from kernels.triton_chain_accept import ChainAccept
    i64 = dict(device=dev, dtype=torch.long)
    return ChainAccept(choice=torch.zeros(nodes, **i64), prob=torch.zeros(nodes, device=dev),
                       pos=torch.zeros(1, **i64), step=torch.zeros(1, **i64),
                       out=torch.zeros(steps, **i64), acc=torch.zeros(steps, **i64), last=torch.zeros(5, **i64),
                       result=torch.zeros(3 + max_path, **i64), log_tokens=torch.zeros(steps, nodes, **i64),
                       log_parents=torch.zeros(steps, nodes, **i64), log_choice=torch.zeros(steps, nodes, **i64),
                       log_prob=torch.zeros(steps, nodes, device=dev),
                       log_result=torch.zeros(steps, 3 + max_path, **i64))


def time_us(call, inner: int = 20, repeats: int = 15) -> float:
    """Median µs a call over graph replays of `inner` calls back to back."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return sorted(times)[len(times) // 2]


def phase_split(verify, call, L: int) -> dict:
    """One timed call (after warm-up): µs per phase, summed over the layers, and the first
    layer's and the tail's separately."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    us = verify.phase_us()
    split = {"embeddings": us[0], "final norm + LM head": us[1 + len(PHASES) * L]}
    for i, name in enumerate(PHASES):
        split[name + " (all layers)"] = sum(us[1 + len(PHASES) * l + i] for l in range(L))
    for i, name in enumerate(ACCEPT_PHASES[:len(us) - 2 - len(PHASES) * L]):
        split[name] = us[2 + len(PHASES) * L + i]
    # when each program ended layer 0's phases, from the last end of the phase before: a
    # straggler and a phase whose every program is slow look different here
    ends = verify.times.double()
    layer0 = {name: ((ends[1 + i] - ends[i].max()) / 1e3).round(decimals=2).tolist() for i, name in enumerate(PHASES)}
    return {"total_us": sum(us), "per_phase_us": {k: round(v, 2) for k, v in split.items()},
            "every_phase_us": [round(u, 2) for u in us], "layer0_program_ends_us": layer0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="embedded", choices=list(SHAPES))
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--programs", type=int, default=None)
    p.add_argument("--variants", default="4/256/1,4/256/1:BK_IN=64,4/256/1:BK_IN=256,8/256/1")
    p.add_argument("--accept", action="store_true", help="with greedy acceptance in the launch")
    args = p.parse_args(argv)
    L = SHAPES[args.shape][0]
    result = {"command": " ".join(["python benchmarks/bench_verify_step.py"] + (argv or sys.argv[1:])),
              "commit": os.environ.get("SPECLA_COMMIT"), "device": torch.cuda.get_device_name(),
              "shape": args.shape, "nodes": args.nodes, "dtype": "bfloat16", "accept": args.accept, "variants": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        settings, *tiles = variant.split(":")
        warps, block_k, stages = (int(x) for x in settings.split("/"))
        blocks = {name: int(value) for name, value in (t.split("=") for t in tiles)}
        try:
            verify, call = make_call(args.shape, args.nodes, args.programs, warps, block_k, stages, blocks=blocks,
                                     accept=args.accept)
            row = {"us_per_call": round(time_us(call), 2), "programs": verify.programs, "failed": verify.failed()}
            timed, timed_call = make_call(args.shape, args.nodes, args.programs, warps, block_k, stages,
                                          timed=True, blocks=blocks, accept=args.accept)
            row.update(phase_split(timed, timed_call, L))
            row["failed"] |= timed.failed()
        except Exception as err:  # noqa: BLE001 - a variant that does not compile is a result too
            row = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        result["variants"][variant] = row
        print(variant, json.dumps(row)[:400], flush=True)
        (args.out / ("verify_step_accept.json" if args.accept else "verify_step.json")).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
