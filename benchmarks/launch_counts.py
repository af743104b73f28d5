"""Kernel launches and GPU time per kernel of one AR step and of each phase of one speculative step.

    python benchmarks/launch_counts.py --out DIR [--device cuda] [--drafter block] [--tree chain]

Builds the engine on the embedded pair (assets/), captures the graphed AR step and the
speculative decoder for the settings, then runs each body once more, uncaptured, under
torch.profiler: the kernels a body launches are the kernels its CUDA graph replays. Both
variants of the acceptance phase are counted, compiled (what the engine captures on CUDA)
and plain, so the effect of fusing it reads off one file. Writes launch_counts.json: per
body the kernel count, the summed kernel time, and its ten longest kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specla import runner  # noqa: E402
from specla.decode import DecodeSettings  # noqa: E402
from specla.drafters.base import DraftSettings  # noqa: E402
from specla.engine import Engine  # noqa: E402


def kernels_of(body, device: torch.device, repeats: int = 3) -> dict:
    """Kernel launches (GPU) or aten ops (CPU) of one run of `body`, and where the time goes."""
    body()                                                  # warm: compiles, autotunes
    if device.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            body()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if device.type == "cuda":
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        time_of = lambda e: e.device_time  # noqa: E731
    else:
        events = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        time_of = lambda e: e.cpu_time  # noqa: E731
    total: Counter = Counter()
    calls: Counter = Counter()
    for e in events:
        total[e.name[:90]] += time_of(e) / repeats
        calls[e.name[:90]] += 1
    return {"launches": round(len(events) / repeats, 2), "kernel_us": round(sum(total.values()), 2),
            "top": [{"name": n, "us": round(us, 2), "per_step": calls[n] / repeats}
                    for n, us in total.most_common(10)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--drafter", default="block")
    p.add_argument("--tree", default="chain")
    p.add_argument("--budget", type=int, default=7)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--ops", default="auto", help="the target's per-layer ops: auto | fla | fused | torch")
    args = p.parse_args(argv)
    runtime = runner.load_runtime(device=args.device)
    device = runtime.device
    # the graphed backend's bodies; on a CPU they run uncaptured (its ops are counted instead)
    engine = (Engine(runtime.target, "graphed", ops=args.ops) if device.type == "cuda" else
              Engine(runtime.target, "graphed", ops=args.ops, use_graph=False))
    prompt = runtime.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    settings = DecodeSettings(max_new_tokens=64)
    draft = DraftSettings(tree=args.tree, top_k=args.top_k, budget=args.budget, block_size=8)
    drafter = runtime.drafters[args.drafter]
    list(engine.speculate(prompt, drafter, settings, draft))           # builds and captures the decoder
    dec = engine.decoder(drafter, settings, draft)
    ar = engine._graphed_ar(settings)
    ar.reset(engine.packed.prefill(prompt)[0], prompt[-1])
    spec = dec.spec
    result = {"command": " ".join(["python benchmarks/launch_counts.py"] + (argv or sys.argv[1:])),
              "commit": os.environ.get("SPECLA_COMMIT"), "device": runner.hardware_name(device),
              "dtype": str(engine.dtype).replace("torch.", ""), "ops": engine.ops_note,
              "settings": {"drafter": args.drafter, "tree": args.tree, "budget": args.budget, "top_k": args.top_k},
              "unit": "kernels" if device.type == "cuda" else "aten ops (CPU: no kernels to count)",
              "bodies": {}}
    bodies = {"ar_step": ar._step, "draft": spec.draft, "verify": spec.verify,
              "accept (compiled)" if spec.compiled else "accept": spec._accept}
    if spec.compiled:
        bodies["accept (plain ops)"] = spec.accept
    with torch.no_grad(), spec.state.preserved():
        for name, body in bodies.items():
            result["bodies"][name] = kernels_of(body, device)
            print(f"{name:>20}: {result['bodies'][name]['launches']:7.1f} launches, "
                  f"{result['bodies'][name]['kernel_us']:8.1f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_counts.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
