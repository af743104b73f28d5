"""How steady the app's on-screen speedup is: the same run, several times in a row.

    python benchmarks/app_repeat.py --out benchmarks/results/cpu [--runs 3] [--drafter block]

Runs the first example prompt through `specla.runner.run` (what the app's Run does) with the
same settings `--runs` times and writes app_repeat.json: each run's speedup, its spread over
the alternating AR / speculation measurements, tau, and the largest deviation from the median.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from specla import explorer, runner

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--drafter", default="block")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    runtime = runner.load_runtime(device=args.device)
    prompt = explorer.load_examples()[0][0][0]
    settings = {"drafter": args.drafter, "max_new_tokens": args.max_new_tokens}
    runs = []
    for _ in range(args.runs):
        trace = [u for u in runner.run(runtime, prompt, settings) if isinstance(u, dict)][-1]
        s = trace["summary"]
        runs.append({"speedup": s["speedup"], "speedup_spread": s.get("speedup_spread"), "tau": s["tau"],
                     "tokens_per_s": s["tokens_per_s"], "ar_tokens_per_s": trace["baseline"]["tokens_per_s"]})
        print(runs[-1], flush=True)
    mid = statistics.median(r["speedup"] for r in runs)
    commit = os.environ.get("SPECLA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"command": " ".join(["python benchmarks/app_repeat.py"] + (argv or sys.argv[1:])),
              "commit": commit, "device": runner.hardware_name(runtime.device), "machine": platform.machine(),
              "prompt": prompt, "settings": settings, "runs": runs, "median_speedup": mid,
              "largest_deviation_from_median": max(abs(r["speedup"] / mid - 1) for r in runs)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "app_repeat.json").write_text(json.dumps(result, indent=1))
    print(f"median {mid:.3f}x, largest deviation {result['largest_deviation_from_median']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
