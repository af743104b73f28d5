"""The persistent block draft (kernels/triton_draft_step.py) with the embedded block drafter:
its time per call in a CUDA graph for several tilings, beside the torch path it replaces
(observe + block pass + top-k, torch ops, compiled as the engine compiles them).

    python benchmarks/bench_draft_step.py --out DIR [--variants 4,8:BH=64]

A variant is num_warps, then any tile overrides (4:BH=64:BN_HEAD=64). Writes draft_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_verify_step import time_us  # noqa: E402
from kernels.triton_draft_step import PersistentBlockDraft  # noqa: E402
from specla import runner  # noqa: E402
from specla.drafters.base import DraftSettings  # noqa: E402
from specla.graphs.draft_step import draft_weights  # noqa: E402
from specla.graphs.drafters import DeviceBlockDrafter  # noqa: E402


def parse_variant(text: str) -> tuple[int, dict[str, int]]:
    warps, *tiles = text.split(":")
    return int(warps), {k: int(v) for k, v in (t.split("=") for t in tiles)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="8,4,8:BH=64,8:BN_HEAD=64")
    p.add_argument("--accepted", type=int, default=3, help="path rows appended each call")
    args = p.parse_args(argv)
    runtime = runner.load_runtime(device="cuda")
    host = runtime.drafters["block"]
    settings = DraftSettings(tree="chain", top_k=4, budget=7, block_size=8)
    torch_path = DeviceBlockDrafter(host, settings, compile=True, persistent=False)
    dev, c = torch_path.device, torch_path.net.config
    F, D = len(torch_path.feature_layers), torch_path.parts.hidden_size
    features = torch.randn(8, F, D, device=dev).to(torch_path.ctx.dtype)
    result = torch.tensor([args.accepted - 1, 0, 0] + list(range(8)), device=dev)
    root = torch.ones(1, dtype=torch.long, device=dev)
    torch_path.reset(list(range(80)), torch.randn(80, F, D, device=dev).to(torch_path.ctx.dtype))

    def torch_call():
        torch_path._observe_rows(result, features)
        torch_path.scores(root)

    rows = {"torch ops (compiled), observe + block pass + top-k": time_us(torch_call)}
    S, k = torch_path.slots, torch_path.top_k
    out = (torch.zeros(c.block_size - 1, c.width, device=dev, dtype=torch_path.ctx.dtype),
           torch.zeros(c.block_size - 1, torch_path.parts.vocab_size, device=dev),
           torch.zeros(S, k, dtype=torch.long, device=dev), torch.zeros(S, k, device=dev))
    window = (torch_path.ctx, torch_path.valid, torch_path.kv_stack)
    for text in args.variants.split(","):
        warps, tiles = parse_variant(text)
        kernel = PersistentBlockDraft(draft_weights(torch_path.net, torch_path.parts), c.heads, c.window,
                                      c.block_size, S, k, torch_path.net.norm.eps, torch_path.parts.norm_eps,
                                      num_warps=warps, blocks=tiles)
        rows[f"persistent {text}"] = time_us(lambda: kernel(root, result, features, *window, *out))
        if kernel.failed():
            rows[f"persistent {text}"] = "a barrier gave up"
    for name, us in rows.items():
        print(f"{name:60s} {us if isinstance(us, str) else f'{us:8.1f} us'}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_step.json").write_text(json.dumps({
        "command": " ".join(["python benchmarks/bench_draft_step.py"] + (argv or sys.argv[1:])),
        "commit": os.environ.get("SPECLA_COMMIT"), "device": torch.cuda.get_device_name(),
        "drafter": "assets/drafters/block", "accepted_rows": args.accepted, "us_per_call": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
