"""Where a speculative decode's GPU time goes between the kernels: the embedded pair decoded
through the engine (as `runner.run` does) under the PyTorch profiler, on held-out prompts.

    python benchmarks/bench_step_gaps.py --out DIR [--prompts 2] [--rows "block/preset-*,ngram/chain-*"]

For each row it reports, per prompt: the steps and tokens; the time the engine reports (the
sum of the steps' CUDA-event phases, what `runner.run` turns into the speedup); the host's
wall clock around the same decode (synchronised, so every host readback and launch counts);
and from the profiler's kernel timeline, the kernel time, the idle time between kernels and
the longest idle gaps, with the kernels' names, counts and mean durations. AR is measured
the same way. Writes step_gaps.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specla import runner  # noqa: E402
from specla.acceptance import read_prompts  # noqa: E402
from specla.bench.e2e import PROMPT_FILES, chosen_rows, pair_rows  # noqa: E402


def kernel_timeline(trace_path: Path) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every GPU kernel in a chrome trace, by start."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = [(e["ts"], e["dur"], e["name"]) for e in events if e.get("cat") == "kernel"]
    return sorted(kernels)


def timeline_summary(kernels: list[tuple[float, float, str]], top: int = 8) -> dict:
    if not kernels:
        return {"kernels": 0}
    busy = sum(d for _, d, _ in kernels)
    span = max(s + d for s, d, _ in kernels) - kernels[0][0]
    gaps = [(b[0] - (a[0] + a[1]), a[2][:60], b[2][:60]) for a, b in zip(kernels, kernels[1:])]
    by_name: dict[str, list[float]] = defaultdict(list)
    for _, d, name in kernels:
        by_name[name[:80]].append(d)
    names = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {"kernels": len(kernels), "span_us": round(span, 1), "busy_us": round(busy, 1),
            "idle_us": round(span - busy, 1),
            "idle_over_2us": round(sum(g for g, _, _ in gaps if g > 2), 1),
            "gaps_over_20us": sum(g > 20 for g, _, _ in gaps),
            "gaps_over_20us_by_pair": sorted(((round(sum(g for g, x, y in gaps if (x, y) == pair and g > 20), 1),
                                               sum(1 for g, x, y in gaps if (x, y) == pair and g > 20), *pair)
                                              for pair in {(a, b) for g, a, b in gaps if g > 20}), reverse=True),
            "longest_gaps": [{"us": round(g, 1), "after": a, "before": b}
                             for g, a, b in sorted(gaps, reverse=True)[:top]],
            "by_kernel": [{"name": n, "count": len(ds), "mean_us": round(sum(ds) / len(ds), 2),
                           "total_us": round(sum(ds), 1)} for n, ds in names[:top]]}


def profiled(fn) -> tuple[object, dict]:
    """fn() under the profiler (CUDA activity only) -> (its result, the timeline summary)."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = fn()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(path))
        return out, timeline_summary(kernel_timeline(path))


def host_profile(fn, top: int = 30) -> str:
    """fn() under cProfile: the host functions by cumulative time (waits for the GPU included)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def walled(fn) -> tuple[object, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, 1e3 * (time.perf_counter() - t0)


def measure_row(runtime, text: str, settings: dict) -> dict:
    final = None
    for update in runner.run(runtime, text, settings):      # warms, captures and checks exactness
        if isinstance(update, dict):
            final = update
    s = runner.normalize_settings(runtime, settings)
    tokens = runner.encode_prompt(runtime, text)
    engine, eos = runtime.engine, runtime.eos_token_id
    decode, ds = runner._decode_settings(s, runtime), runner._draft_settings(s)
    ar_tokens = engine.ar(tokens, decode, eos).tokens
    drafter = runner._drafter_for_run(runtime, s, tokens, ar_tokens)

    def spec():
        return list(engine.speculate(tokens, drafter, decode, ds, eos))

    spec()                        # this drafter's decoder captured here, not in the timed run
    records, wall_ms = walled(spec)
    made = sum(len(r.new_tokens) for r in records)
    event_ms = sum(r.elapsed_ms for r in records)
    _, timeline = profiled(spec)
    host = host_profile(spec)
    ar, ar_wall_ms = walled(lambda: engine.ar(tokens, decode, eos))
    _, ar_timeline = profiled(lambda: engine.ar(tokens, decode, eos))
    return {"steps": len(records), "tokens": made, "tau": made / max(len(records), 1),
            "run_speedup": final["summary"]["speedup"],
            "spec_event_ms_per_token": event_ms / made,
            "idle_ms_per_token": sum(r.times_ms.get("idle", 0.0) for r in records) / made, "spec_wall_ms_per_token": wall_ms / made,
            "ar_event_ms_per_token": ar.ms_per_token, "ar_wall_ms_per_token": ar_wall_ms / len(ar.tokens),
            "spec_timeline": timeline, "host_profile": host, "ar_timeline": ar_timeline,
            "time_split_ms": {k: sum(r.times_ms.get(k, 0.0) for r in records) / len(records)
                              for k in ("draft", "verify", "accept")}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rows", default="block/preset-*,ngram/chain-*")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runtime = runner.load_runtime(device="cuda")
    prompt_file = next(p for p in PROMPT_FILES if p.exists())
    texts = read_prompts(prompt_file, args.prompts)
    results = {"prompt_file": str(prompt_file), "commit": os.environ.get("SPECLA_COMMIT"),
               "device": torch.cuda.get_device_name(), "rows": {}}
    for name, settings in chosen_rows(pair_rows(runtime, quick=False), args.rows):
        settings = dict(settings, max_new_tokens=args.tokens)
        results["rows"][name] = [measure_row(runtime, text, settings) for text in texts]
        for i, r in enumerate(results["rows"][name]):
            t, a = r["spec_timeline"], r["ar_timeline"]
            print(f"{name} p{i}: {r['steps']} steps tau {r['tau']:.2f} | spec ms/token event "
                  f"{r['spec_event_ms_per_token']:.4f} wall {r['spec_wall_ms_per_token']:.4f} | AR event "
                  f"{r['ar_event_ms_per_token']:.4f} wall {r['ar_wall_ms_per_token']:.4f} | spec span "
                  f"{t.get('span_us')} busy {t.get('busy_us')} idle {t.get('idle_us')} (>20us gaps "
                  f"{t.get('gaps_over_20us')}) | AR span {a.get('span_us')} busy {a.get('busy_us')}", flush=True)
    (args.out / "step_gaps.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
