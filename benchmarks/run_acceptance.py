"""Acceptance of every shipped drafter on the held-out prompts, through the real engine.

    python benchmarks/run_acceptance.py --prompts data/corpus/heldout_prompts.jsonl --out benchmarks/results

Each configuration decodes every prompt speculatively at temperature 0 (verified against AR:
`mismatching_prompts` must be 0) and reports tau (tokens per target forward, bonus
included), the accept-length histogram and per-position acceptance. Writes
acceptance.json and acceptance.md.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specla.acceptance import measure_acceptance, read_prompts  # noqa: E402
from specla.checkpoint import load_model  # noqa: E402
from specla.drafters import load_drafter  # noqa: E402
from specla.drafters.base import DraftSettings  # noqa: E402

CONFIGS = [
    ("block", "chain", 1, 7), ("lilicorr", "chain", 4, 7),
    ("block", "best-first", 4, 16), ("lilicorr", "best-first", 4, 8),
    ("lilicorr", "best-first", 4, 16), ("lilicorr", "best-first", 4, 32), ("lilicorr", "beam", 4, 16),
    ("eagle", "chain", 1, 6), ("eagle", "best-first", 4, 8), ("eagle", "best-first", 4, 16),
    ("eagle", "best-first", 4, 32),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="data/corpus/heldout_prompts.jsonl")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--drafters", default=str(ROOT / "assets" / "drafters"),
                    help="folder with one sub-folder per drafter kind")
    ap.add_argument("--only", default=None, help="comma-separated drafter:tree:top_k:budget rows to run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(ROOT / "assets" / "target")
    prompts = read_prompts(args.prompts, args.limit)
    tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    rows = []
    configs = CONFIGS
    if args.only:
        configs = [(k, t, int(top), int(b)) for k, t, top, b in (c.split(":") for c in args.only.split(","))]
    for kind, tree, top_k, budget in configs:
        drafter = load_drafter(Path(args.drafters) / kind, model)
        settings = DraftSettings(tree=tree, top_k=top_k, budget=budget, block_size=8, depth=6)
        start = time.perf_counter()
        result = measure_acceptance(model, tokenize, prompts, drafter, settings, args.max_new_tokens)
        result.update(drafter=kind, tree=tree, top_k=top_k, budget=budget,
                      seconds=round(time.perf_counter() - start, 1))
        rows.append(result)
        print(f"{kind:>8} {tree:>10} k={top_k} budget={budget:>2}: tau={result['tau']:.3f} "
              f"mismatches={result['mismatching_prompts']}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    report = {"command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]), "commit": commit,
              "device": f"CPU ({platform.processor() or platform.machine()}), 1 thread",
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "temperature": 0,
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(report, indent=1))
    base = {r["drafter"]: r["tau"] for r in rows if r["tree"] == "chain"}
    lines = [f"# Acceptance on {len(prompts)} held-out prompts, {args.max_new_tokens} new tokens, "
             "temperature 0", "", f"`{report['command']}` at commit {commit}; every run checked "
             "token for token against AR.", "",
             "| drafter | tree | top-k | budget | tau | vs block chain | mismatching prompts | per-position acceptance |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gain = f"{100 * (r['tau'] / base['block'] - 1):+.1f}%" if "block" in base else ""
        pos = ", ".join(f"{p:.2f}" for p in r["per_position_acceptance"][:8])
        lines.append(f"| {r['drafter']} | {r['tree']} | {r['top_k']} | {r['budget']} | {r['tau']:.3f} | "
                     f"{gain} | {r['mismatching_prompts']} | {pos} |")
    (out / "acceptance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
