"""How much a tree over the LiLiCorr lattice could gain: accepted length against the
lattice's oracle prefix, step by step, on the held-out prompts.

    python benchmarks/lattice_headroom.py --out benchmarks/results

At every step of a real speculative run (the LiLiCorr drafter, best-first, temperature 0)
the oracle prefix is how many of the next slots have the target's own next token among
their k candidates, all in a row: no tree drawn from this lattice can accept more. Reports
the mean accepted length + 1 (tau) and the mean oracle prefix + 1 over the same steps, for
each lattice width k. Writes lattice_headroom.json and lattice_headroom.md.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specla.acceptance import read_prompts  # noqa: E402
from specla.checkpoint import load_model  # noqa: E402
from specla.decode import DecodeSettings, ar_generate, speculative_steps  # noqa: E402
from specla.drafters import load_drafter  # noqa: E402
from specla.drafters.base import DraftSettings  # noqa: E402
from specla.drafters.lilicorr import TREE_SHARPNESS  # noqa: E402


def oracle_prefix(candidates: list[list[int]], future: list[int]) -> int:
    n = 0
    for slot, tokens in enumerate(candidates):
        if slot >= len(future) or future[slot] not in tokens:
            break
        n += 1
    return n


def headroom(model, tokenize, prompts: list[str], drafter, settings: DraftSettings, max_new_tokens: int) -> dict:
    accepted, oracle, steps, mismatches = 0, 0, 0, 0
    for prompt in prompts:
        tokens = tokenize(prompt)
        decode = DecodeSettings(max_new_tokens=max_new_tokens)
        # AR runs past the end by a block, so the last step's slots have their true tokens too
        ar = ar_generate(model, tokens, DecodeSettings(max_new_tokens=max_new_tokens + 16)).tokens
        done = 0
        out = []
        for record in speculative_steps(model, drafter, tokens, decode, settings):
            future = ar[done:]
            accepted += len(record.acceptance.tokens)
            oracle += oracle_prefix(record.details["lattice"]["candidates"], future)
            steps += 1
            done += len(record.new_tokens)
            out += record.new_tokens
        mismatches += out != ar[:max_new_tokens]
    return {"steps": steps, "tau": round(1 + accepted / steps, 4),
            "oracle_tau": round(1 + oracle / steps, 4), "mismatching_prompts": mismatches}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="data/corpus/heldout_prompts.jsonl")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--skip", type=int, default=0, help="skip the first N prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default="4:16,4:32,8:16,8:32", help="top_k:budget,... best-first trees")
    ap.add_argument("--sharpness", type=float, default=TREE_SHARPNESS, help="LiLiCorr tree sharpness")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="lattice_headroom", help="output files <name>.json and <name>.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(ROOT / "assets" / "target")
    prompts = read_prompts(args.prompts)[args.skip:args.skip + args.limit]
    tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    rows = []
    for config in args.configs.split(","):
        k, budget = (int(x) for x in config.split(":"))
        drafter = load_drafter(ROOT / "assets" / "drafters" / "lilicorr", model)
        drafter.tree_sharpness = args.sharpness
        settings = DraftSettings(tree="best-first", top_k=k, budget=budget, block_size=8)
        row = {"top_k": k, "budget": budget, "sharpness": args.sharpness,
               **headroom(model, tokenize, prompts, drafter, settings, args.max_new_tokens)}
        rows.append(row)
        print(row, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    report = {"command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]), "commit": commit,
              "device": f"CPU ({platform.processor() or platform.machine()}), 1 thread",
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": rows}
    out = Path(args.out)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    lines = [f"# LiLiCorr lattice headroom, {len(prompts)} held-out prompts, {args.max_new_tokens} new tokens",
             "", f"`{report['command']}` at commit {commit}; every run checked against AR.", "",
             "tau: the run's accepted length + 1 per step; oracle tau: over the same steps, the "
             "longest prefix of the target's next tokens inside the lattice + 1 (no tree drawn from "
             "the lattice accepts more).", "",
             "| top-k | best-first budget | sharpness | steps | tau | oracle tau | mismatching prompts |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['top_k']} | {r['budget']} | {r['sharpness']} | {r['steps']} | {r['tau']:.3f} | "
                     f"{r['oracle_tau']:.3f} | {r['mismatching_prompts']} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
