"""Benchmarks: `python -m specla bench [options]` (also `python -m specla.bench`).

Suites (`--suite`, default all):
  runtime     AR decode at the GDN-1.3B public shape (and a small one), random bf16 weights,
              512-token prompt: fla's model eager, fla's model in one CUDA graph, our
              GraphedAR; the memory floor; our logits and greedy tokens against fla's.
  e2e         speculative decoding against AR in the same process: the embedded target with its
              trained drafters on held-out prompts, measured through the app's own service layer
              (`specla.runner.run`, on the engine: CUDA graphs on a GPU, the eager loop on the
              CPU; a tiny random model with `--tiny`), and on CUDA the oracle drafter at
              controlled acceptance (chains and trees, GDN-1.3B shape) against GraphedAR.
  head        the LiLiCorr head's share of a decoding step next to a GDN-1.3B-shape target:
              a LiLiCorr drafter sized for it (random bf16 weights) drafting device-graphed
              chains with its head fused, as torch ops, and not at all (the block chain).
  kernels     benchmarks/bench_kernels.py (verify and commit kernels, GPU).
  acceptance  tau of the trained drafters and exactness (specla.acceptance).

Each suite writes <suite>.json into --out as it goes (a crash loses at most one variant),
then report.md (and report.html when plotly is importable) is written from all JSON files
there. Every timing is {"runs", "median", "min", "max"}; a speedup is a ratio of medians
measured in the same process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from specla.bench.common import (DEFAULT_OUT, ROOT, SUITES, Deadline, Results, _jsonable, drafter_settings, environment,
                                 guarded, load_pair)
from specla.bench.e2e import suite_e2e
from specla.bench.head import suite_head
from specla.bench.report import render
from specla.bench.runtime_suite import suite_runtime


def suite_kernels(args, env, deadline: Deadline) -> dict:
    res = Results(args.out, "kernels_run", env)
    script = ROOT / "benchmarks" / "bench_kernels.py"
    if args.device.type != "cuda":
        res["skipped"] = "the kernel benchmark needs CUDA"
        return res.data
    if not script.exists():
        res["skipped"] = f"{script.relative_to(ROOT)} is not there"
        return res.data
    cmd = [sys.executable, str(script), "--out", str(args.out)] + (["--quick"] if args.quick else [])
    timeout = None if deadline.end is None else max(30, int(deadline.left() - 15))
    print(f"[kernels] {' '.join(cmd)} (timeout {timeout})", flush=True)
    env_vars = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env_vars)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        partial = err.stdout or ""
        rc, output = "timeout", partial.decode() if isinstance(partial, bytes) else partial
    res["command"] = " ".join(cmd)
    res["returncode"] = rc
    res["seconds"] = time.perf_counter() - t0
    res["output_tail"] = output[-6000:]
    res["files"] = [p.name for p in (args.out / "kernels.json", args.out / "verify_cost.json") if p.exists()]
    print(output[-3000:], flush=True)
    return res.data


def suite_acceptance(args, env, deadline: Deadline) -> dict:
    res = Results(args.out, "acceptance", env)
    try:
        import specla.acceptance as acc
    except ImportError as err:
        res["skipped"] = f"specla.acceptance is not importable ({err})"
        return res.data
    if hasattr(acc, "bench_suite"):   # a suite entry point, if the module grows one
        res["result"] = acc.bench_suite(out=args.out, device=str(args.device), quick=args.quick)
        return res.data
    loaded, skip = load_pair(args.device, args.quick, args.prompts, args.drafters)
    if loaded is None:
        res["skipped"] = skip
        return res.data
    target, tokenizer, drafters, prompts_tok, notes = loaded
    res["notes"] = notes
    texts = acc.read_prompts(ROOT / notes["prompt_file"], args.prompts or (3 if args.quick else 8))
    n = args.tokens or (32 if args.quick else 64)
    tokenize = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    res["drafters"] = {}
    for kind, drafter in drafters.items():
        for label, settings in drafter_settings(kind, drafter):
            if not deadline.ok(10):
                continue
            guarded(res["drafters"], f"{kind}/{label}", acc.measure_acceptance, target, tokenize,
                    texts, drafter, settings, n)
            res.save()
    if deadline.ok(10):
        guarded(res.data, "exactness", acc.exactness, target, tokenize, texts[:2], ["chain", "tree"],
                [True, False], 0.0, n)
    res.save()
    return res.data


def _alphas(text: str) -> tuple[float, ...]:
    """--oracle-alphas: comma-separated acceptance rates in (0, 1]."""
    try:
        alphas = tuple(float(a) for a in text.split(",") if a.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text!r}") from None
    if not alphas or not all(0 < a <= 1 for a in alphas):
        raise argparse.ArgumentTypeError(f"acceptance rates are in (0, 1]: {text!r}")
    return alphas


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specla bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available")
    p.add_argument("--suite", choices=SUITES + ("all",), default="all")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default benchmarks/results)")
    p.add_argument("--json", action="store_true", help="print the summary JSON on the last line")
    p.add_argument("--quick", action="store_true", help="fewer variants, prompts and tokens (a smoke run)")
    p.add_argument("--tokens", type=int, help="new tokens per run (overrides the suite default)")
    p.add_argument("--prompts", type=int, help="prompts per drafter (overrides the suite default)")
    p.add_argument("--repeats", type=int, help="timed runs per variant")
    p.add_argument("--prompt-len", type=int, default=512, help="random prompt length (runtime, oracle)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds; no new variant starts after this (default: 520 on CUDA, none on CPU)")
    p.add_argument("--ops", choices=("auto", "fla", "fused", "torch"), default="auto",
                   help="per-layer ops of our runtime (fla: fla's fused kernels on CUDA; fused: those "
                        "plus the projections with their norms and SwiGLU folded in; auto: fused for "
                        "narrow targets such as the embedded model, fla for wide ones)")
    p.add_argument("--recurrence", choices=("kernels", "torch"), default="kernels",
                   help="verifier inside the speculative graphs (kernels: kernels/triton_verify)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="e2e pair: the embedded target's precision (auto: as the app picks it)")
    p.add_argument("--pair-budget", type=float, default=240.0,
                   help="seconds for the embedded pair within the CUDA e2e suite (default 240)")
    p.add_argument("--head-top-k", type=int, default=4,
                   help="head suite: LiLiCorr candidates per slot (default 4, as the measured chains)")
    p.add_argument("--pair-rows", default="",
                   help="e2e pair: only the rows whose names match these comma-separated patterns, in "
                        "this order (e.g. 'block/preset-*,ngram/chain-*'; default every row)")
    p.add_argument("--oracle-alphas", type=_alphas, default=(),
                   help="e2e on CUDA: the 1.3B oracle sweep's acceptance rates, comma-separated "
                        "(default 0.5-0.9, or 0.7,0.9 with --quick)")
    p.add_argument("--pair-only", action="store_true",
                   help="e2e on CUDA: the embedded pair only, not the 1.3B oracle sweep")
    p.add_argument("--render", action="store_true", help="only rewrite report.md/html from --out")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)   # tests: tiny random target
    p.add_argument("--drafters", type=Path, default=None, help=argparse.SUPPRESS)  # default assets/drafters
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        print(f"wrote {render(args.out)}")
        return 0
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda was asked for, but no CUDA GPU is available", file=sys.stderr)
        return 2
    args.device = torch.device(args.device)
    if args.deadline is None and args.device.type == "cuda":
        args.deadline = 520.0
    deadline = Deadline(args.deadline)
    torch.manual_seed(args.seed)
    env = environment(args.device, argv)
    print(f"bench on {env.get('gpu') or env['device']}: torch {env['torch']}, triton {env['triton']}, "
          f"fla {env['fla']}, commit {(env['git'] or {}).get('commit')}", flush=True)
    suites = SUITES if args.suite == "all" else (args.suite,)
    runners = {"runtime": suite_runtime, "e2e": suite_e2e, "head": suite_head, "kernels": suite_kernels,
               "acceptance": suite_acceptance}
    summary = {"environment": env, "suites": {}}
    for name in suites:
        t0 = time.perf_counter()
        print(f"== suite {name} ({deadline.left():.0f} s left)", flush=True)
        record: dict = {}
        guarded(record, "data", runners[name], args, env, deadline)
        data = record["data"]
        summary["suites"][name] = {"seconds": round(time.perf_counter() - t0, 1),
                                   "error": data.get("error") if isinstance(data, dict) else None}
        render(args.out)
    report = render(args.out)
    print(report.read_text()[-6000:])
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=_jsonable))
    if args.json:
        print(json.dumps(summary, default=_jsonable))
    return 0


if __name__ == "__main__":
    sys.exit(main())
