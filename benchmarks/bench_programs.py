"""The three persistent kernels of the embedded pair's step at several grid sizes: the AR
step (`triton_decode_step`), the 16-node verification with acceptance (`triton_verify_step`)
and the block draft (`triton_draft_step`), each timed in a CUDA graph in one process.

    python benchmarks/bench_programs.py --out DIR [--programs 32,64,96,132]

Why: a phase ends at a grid-wide barrier whose arrivals and polls all go to one counter, so
its cost may grow with the programs that take part, while the work of a phase of this model
(a few hundred KB of weights) may not need every SM. The AR and verification rows use random
bf16 weights of the embedded shape (speed does not depend on their values); the draft uses
the trained block drafter. Writes programs.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_verify_step import make_call, time_us  # noqa: E402
from kernels.triton_decode_step import PersistentDecodeStep  # noqa: E402
from kernels.triton_draft_step import PersistentBlockDraft  # noqa: E402
from specla import runner  # noqa: E402
from specla.drafters.base import DraftSettings  # noqa: E402
from specla.graphs.draft_step import draft_weights  # noqa: E402
from specla.graphs.drafters import DeviceBlockDrafter  # noqa: E402
from tests.test_decode_step import SHAPES, random_weights  # noqa: E402

AR_PHASES = ("A norm + in-proj", "B conv + gates + recurrence", "C gated norm + out-proj + conv shift",
             "D norm + gate/up", "E SwiGLU + down")


def ar_call(programs: int, timed: bool = False):
    """One AR token of the embedded shape with the greedy pick in the launch."""
    L, D, H, K, V, W, I, vocab = SHAPES["embedded"]
    dev = torch.device("cuda")
    step = PersistentDecodeStep(random_weights(L, D, H, K, V, W, I, vocab, torch.bfloat16, dev, False, 0),
                                H, K, V, 1e-6, programs=programs, timed=timed)
    C = H * (2 * K + V)
    cache = torch.randn(L, 1, C, W, device=dev).to(torch.bfloat16)
    S = torch.randn(L, 1, H, K, V, device=dev) * 0.1
    logits = torch.zeros(vocab, device=dev)
    token = torch.ones(1, 1, dtype=torch.long, device=dev)
    greedy = (token, torch.zeros(4096, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev))
    return step, lambda: step(token, cache, S, logits, greedy)


@functools.cache
def block_drafter():
    return runner.load_runtime(device="cuda").drafters["block"]


def draft_call(programs: int):
    """The trained block drafter's persistent draft of a chain, 3 path rows appended a call."""
    host = block_drafter()
    torch_path = DeviceBlockDrafter(host, DraftSettings(tree="chain", top_k=4, budget=7, block_size=8),
                                    compile=False, persistent=False)
    dev, c = torch_path.device, torch_path.net.config
    F, D = len(torch_path.feature_layers), torch_path.parts.hidden_size
    torch_path.reset(list(range(80)), torch.randn(80, F, D, device=dev).to(torch_path.ctx.dtype))
    features = torch.randn(8, F, D, device=dev).to(torch_path.ctx.dtype)
    result = torch.tensor([2, 0, 0] + list(range(8)), device=dev)
    root = torch.ones(1, dtype=torch.long, device=dev)
    S, k = torch_path.slots, torch_path.top_k
    out = (torch.zeros(c.block_size - 1, c.width, device=dev, dtype=torch_path.ctx.dtype),
           torch.zeros(c.block_size - 1, torch_path.parts.vocab_size, device=dev),
           torch.zeros(S, k, dtype=torch.long, device=dev), torch.zeros(S, k, device=dev))
    kernel = PersistentBlockDraft(draft_weights(torch_path.net, torch_path.parts), c.heads, c.window, c.block_size,
                                  S, k, torch_path.net.norm.eps, torch_path.parts.norm_eps, programs=programs)
    window = (torch_path.ctx, torch_path.valid, torch_path.kv_stack)
    return kernel, lambda: kernel(root, result, features, *window, *out)


def ar_phases(programs: int) -> dict:
    """The AR step's µs per phase kind, summed over the layers (one timed call after warm-up)."""
    step, call = ar_call(programs, timed=True)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    us, L = step.phase_us(), SHAPES["embedded"][0]
    split = {name: round(sum(us[5 * layer + i] for layer in range(L)), 2) for i, name in enumerate(AR_PHASES)}
    return {**split, "LM head": round(us[5 * L], 2), "greedy pick": round(us[5 * L + 1], 2),
            "total": round(sum(us), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--programs", default="32,64,96,132")
    p.add_argument("--nodes", type=int, default=16)
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grids = [min(int(g), sms) for g in args.programs.split(",")]
    result = {"command": " ".join(["python benchmarks/bench_programs.py"] + (argv or sys.argv[1:])),
              "commit": os.environ.get("SPECLA_COMMIT"), "device": torch.cuda.get_device_name(), "sms": sms,
              "nodes": args.nodes, "us_per_call": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    makers = {"ar": ar_call, "draft": draft_call,
              "verify+accept": lambda g: make_call("embedded", args.nodes, g, 4, 256, 1, accept=True)}
    for programs in grids:
        row = {}
        for name, make in makers.items():
            try:
                kernel, call = make(programs)
                us = time_us(call)
                row[name] = "a barrier gave up" if kernel.failed() else round(us, 2)
            except Exception as err:  # noqa: BLE001 - a grid that does not run is a result too
                row[name] = f"{type(err).__name__}: {str(err)[:200]}"
        if all(isinstance(row[k], float) for k in makers):
            row["draft + verify"] = round(row["draft"] + row["verify+accept"], 2)
            row["step / AR"] = round(row["draft + verify"] / row["ar"], 3)
        try:
            row["ar phases (timed call)"] = ar_phases(programs)
        except Exception as err:  # noqa: BLE001
            row["ar phases (timed call)"] = f"{type(err).__name__}: {str(err)[:200]}"
        result["us_per_call"][str(programs)] = row
        print(programs, json.dumps(row), flush=True)
        (args.out / "programs.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
