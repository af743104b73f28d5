"""Acceptance of every drafter on the benchmark prompt sets, through the real engine.

    python -m specla.train prompts --corpus data/corpus        # the prompt sets (once)
    python benchmarks/run_acceptance.py --out benchmarks/results

Each configuration decodes every prompt of every set speculatively at temperature 0
(verified against AR: `mismatching_prompts` must be 0) and reports tau (tokens per target
forward, bonus included), the accept-length histogram and per-position acceptance. Writes
acceptance.json and acceptance.md. With --speedup it measures each row as the app does
instead (`specla.bench.e2e.pair_row`, through `specla.runner.run` on the engine: on the CPU
AR and speculation alternate three times, the fastest run of each kept) and reports the
speedup over AR. A row is `drafter:tree:top_k:budget[:option=value...]`;
options: depth (EAGLE and n-gram), sharpness (LiLiCorr trees, see
`specla.drafters.lilicorr.tree_rows`), max_ngram, min_ngram, order (n-gram), preset (a tree
preset over the drafter: JSON index paths, or `measured`, the drafter's own; the tree and
budget are then the preset's).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specla.acceptance import measure_acceptance, read_prompts  # noqa: E402
from specla import runner  # noqa: E402
from specla.bench.e2e import pair_row  # noqa: E402
from specla.checkpoint import load_model  # noqa: E402
from specla.drafters import load_drafter  # noqa: E402
from specla.drafters.base import DraftSettings  # noqa: E402
from specla.drafters.ngram import NgramDrafter  # noqa: E402
from specla.engine import Engine  # noqa: E402

ROWS = [
    "block:chain:1:7", "lilicorr:chain:4:7",
    "block:best-first:4:16", "block:best-first:4:32", "block:best-first:8:16", "block:best-first:8:32",
    "lilicorr:best-first:4:8", "lilicorr:best-first:4:16", "lilicorr:best-first:4:32",
    "lilicorr:best-first:8:16", "lilicorr:best-first:8:32", "lilicorr:beam:4:16",
    "eagle:chain:1:6", "eagle:best-first:4:8", "eagle:best-first:4:16", "eagle:best-first:4:32",
    "ngram:chain:1:8:depth=8", "ngram:best-first:4:16:depth=8", "ngram:best-first:4:32:depth=16",
]
SETS = "heldout=data/corpus/heldout_prompts.jsonl,editing=data/corpus/editing_prompts.jsonl"
NUMBER_OPTIONS = {"depth": int, "sharpness": float, "max_ngram": int, "min_ngram": int}


def parse_row(spec: str) -> dict:
    """'lilicorr:best-first:4:16:sharpness=0.5' -> a row description."""
    parts = spec.split(":")
    if len(parts) < 4:
        raise SystemExit(f"row {spec!r}: expected drafter:tree:top_k:budget[:option=value...]")
    options = {}
    for item in parts[4:]:
        key, _, value = item.partition("=")
        options[key] = NUMBER_OPTIONS.get(key, str)(value)
    return {"drafter": parts[0], "tree": parts[1], "top_k": int(parts[2]), "budget": int(parts[3]),
            "options": options}


def make_drafter(row: dict, model, drafters: Path):
    options = dict(row["options"])
    options.pop("depth", None)
    preset = options.pop("preset", None)
    if row["drafter"] == "ngram":
        return NgramDrafter(model.config.vocab_size, **options)
    drafter = load_drafter(drafters / row["drafter"], model)
    if "sharpness" in options:
        drafter.tree_sharpness = options.pop("sharpness")
    if options:
        raise SystemExit(f"options {sorted(options)} do not apply to the {row['drafter']} drafter")
    if preset is not None:
        return runner.PresetShape(drafter, runner.preset_paths(preset, drafter, row["drafter"]))
    return drafter


def row_name(row: dict) -> str:
    opts = options_text(row)
    return f"{row['drafter']} {row['tree']} k={row['top_k']} budget={row['budget']}" + (f" ({opts})" if opts else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default=SETS, help="name=path,... JSON Lines prompt files")
    ap.add_argument("--limit", type=int, default=32, help="prompts per set")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N prompts of each set "
                    "(a tuning split apart from the reported prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="acceptance", help="output files <name>.json and <name>.md")
    ap.add_argument("--drafters", default=str(ROOT / "assets" / "drafters"),
                    help="folder with one sub-folder per trained drafter kind")
    ap.add_argument("--rows", nargs="+", default=ROWS, help="rows to run (see the module docstring)")
    ap.add_argument("--speedup", action="store_true", help="time AR and speculation as the app does")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 target, the engine's CUDA graphs)")
    ap.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)   # the app measures 3 alternating runs
    args = ap.parse_args()
    # a copied tree (the GPU machine) can carry stale git metadata: SPECLA_COMMIT names the commit there
    commit = os.environ.get("SPECLA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    model, tokenizer, _ = load_model(ROOT / "assets" / "target", args.device,
                                     torch.bfloat16 if cuda else torch.float32)
    model.eval()
    sets = {}
    for item in args.sets.split(","):
        name, _, path = item.partition("=")
        sets[name] = read_prompts(path)[args.skip:args.skip + args.limit]
    tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ar_cache: dict = {}
    runtimes: dict = {}
    engine = Engine(model)      # one engine (one GraphedAR, one capture cache) for every row
    rows = []
    text = ""
    for spec in args.rows:
        row = parse_row(spec)
        settings = DraftSettings(tree=row["tree"], top_k=row["top_k"], budget=row["budget"], block_size=8,
                                 depth=row["options"].get("depth", 6))
        row["sets"] = {}
        # one drafter per row (reset by every run): the graphed engine compiles and captures once per drafter
        drafter = make_drafter(row, model, Path(args.drafters))
        if hasattr(drafter, "tree_sharpness") and row["tree"] != "chain":
            row["tree_sharpness"] = drafter.tree_sharpness
        for name, prompts in sets.items():
            start = time.perf_counter()
            if args.speedup:
                runtime = runtimes.setdefault(spec, runner.Runtime(     # the app applies a preset itself
                    model, tokenizer, {"row": getattr(drafter, "inner", drafter)}, model_name="assets/target",
                    eos_token_id=model.config.eos_token_id, engine=engine))
                app_settings = {"drafter": "row", "tree": row["tree"], "top_k": row["top_k"],
                                "budget": row["budget"], "block_size": 8, "depth": settings.depth,
                                "max_new_tokens": args.max_new_tokens, "paths": row["options"].get("preset")}
                result = pair_row(runtime, prompts, app_settings)
                result["mismatching_prompts"] = result["exact"]["diverging_prompts"]
            else:
                result = measure_acceptance(model, tokenize, prompts, drafter, settings,
                                            args.max_new_tokens, ar_cache=ar_cache)
            result["seconds"] = round(time.perf_counter() - start, 1)
            row["sets"][name] = result
            speed = f" speedup={result['speedup']:.2f}x" if args.speedup else ""
            print(f"{row_name(row):>60} {name:>8}: tau={result['tau']:.3f}{speed} "
                  f"mismatches={result['mismatching_prompts']}", flush=True)
        rows.append(row)
        report = {"command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]), "commit": commit,
                  "device": (f"{torch.cuda.get_device_name()}, bf16 target, CUDA graphs" if cuda else
                             f"CPU ({platform.processor() or platform.machine()}), 1 thread"),
                  "sets": {name: len(p) for name, p in sets.items()}, "skip": args.skip,
                  "max_new_tokens": args.max_new_tokens, "temperature": 0, "rows": rows}
        if args.speedup:
            report["repeats"] = args.repeats
        text = save_report(report, Path(args.out), args.name, args.speedup)   # after every row: a cut run keeps them
    print(text)


def save_report(report: dict, out: Path, name: str, speedup: bool) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    text = render_speedup(report) if speedup else render(report)
    (out / f"{name}.md").write_text(text)
    return text


ROW_HEAD = "| drafter | tree | top-k | budget | options | "     # every table's first five columns


def row_head(row: dict) -> str:
    """A row's first five cells, as ROW_HEAD names them."""
    return f"| {row['drafter']} | {row['tree']} | {row['top_k']} | {row['budget']} | {options_text(row)} | "


def options_text(row: dict) -> str:
    text = ", ".join(f"{k}={v}" for k, v in row["options"].items())
    if "tree_sharpness" in row and "sharpness" not in row["options"]:
        text = f"sharpness={row['tree_sharpness']} (default)" + (f", {text}" if text else "")
    return text


def render(report: dict) -> str:
    """The Markdown report: tau of every row on every set, then per-position acceptance."""
    names = list(report["sets"])
    base = {n: next((r["sets"][n]["tau"] for r in report["rows"]
                     if r["drafter"] == "block" and r["tree"] == "chain" and "preset" not in r["options"]), None)
            for n in names}
    skipped = f" (prompts {report['skip'] + 1}-{report['skip'] + max(report['sets'].values())} of each file)" \
        if report["skip"] else ""
    lines = [f"# Acceptance, {report['max_new_tokens']} new tokens, temperature 0", "",
             f"`{report['command']}` at commit {report['commit']}; {report['device']}; every run "
             "checked token for token against AR.", "",
             "Prompt sets: " + ", ".join(f"{n} ({k} prompts)" for n, k in report["sets"].items()) + skipped
             + ".", "",
             ROW_HEAD + " | ".join(f"tau {n} | vs block chain" for n in names) + " | mismatching prompts |",
             "|---|---|---|---|---|" + "---|---|" * len(names) + "---|"]
    for r in report["rows"]:
        cells = []
        for n in names:
            tau = r["sets"][n]["tau"]
            gain = f"{100 * (tau / base[n] - 1):+.1f}%" if base[n] else ""
            cells += [f"{tau:.3f}", gain]
        bad = sum(r["sets"][n]["mismatching_prompts"] or 0 for n in names)
        lines.append(row_head(r) + " | ".join(cells) + f" | {bad} |")
    for n in names:
        lines += ["", f"Per-position acceptance, {n}:", "",
                  ROW_HEAD + "per-position acceptance |",
                  "|---|---|---|---|---|---|"]
        for r in report["rows"]:
            pos = ", ".join(f"{p:.2f}" for p in r["sets"][n]["per_position_acceptance"][:8])
            lines.append(row_head(r) + f"{pos} |")
    return "\n".join(lines) + "\n"


def render_speedup(report: dict) -> str:
    """The Markdown report of a --speedup run: tau, times and speedup per row and set."""
    names = list(report["sets"])
    gpu = "CUDA" in report["device"]
    how = ("graphed AR, median of 3 runs, against the graphed speculative steps' CUDA-event times" if gpu else
           "AR and speculation alternating three times, the fastest run of each kept")
    check = ("checked token for token against AR; in bf16 a diverging prompt is excused when AR's logit gap "
             "there is within 2x the measured spec-vs-AR noise (a near-tie)" if gpu else
             "checked token for token against AR")
    lines = [f"# {'GPU' if gpu else 'CPU'} speedup over AR, {report['max_new_tokens']} new tokens, temperature 0", "",
             f"`{report['command']}` at commit {report['commit']}; {report['device']}; measured as the "
             f"app measures (`specla.runner.run`: {how}); ms/token is the median over prompts, the speedup "
             f"the ratio of the medians; every run {check}.", "",
             "Prompt sets: " + ", ".join(f"{n} ({k} prompts)" for n, k in report["sets"].items()) + ".", "",
             ROW_HEAD + " | ".join(f"{n}: tau | ms/token | AR ms/token | speedup" for n in names)
             + " | mismatching prompts |",
             "|---|---|---|---|---|" + "---|---|---|---|" * len(names) + "---|"]
    for r in report["rows"]:
        cells = []
        for n in names:
            x = r["sets"][n]
            cells += [f"{x['tau']:.2f}", f"{x['ms_per_token']['median']:.2f}",
                      f"{x['ar_ms_per_token']['median']:.2f}", f"{x['speedup']:.2f}x"]
        bad = sum(r["sets"][n]["mismatching_prompts"] for n in names)
        unexcused = sum(r["sets"][n].get("exact", {}).get("unexcused", 0) for n in names)
        lines.append(row_head(r) + " | ".join(cells) + f" | {bad}" + (f" ({unexcused} unexcused)" if gpu else "") + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
