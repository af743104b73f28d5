"""The end-to-end suite: speculative decoding against AR, measured in one process.

    pair     the embedded target with each trained drafter on held-out prompts, measured
             through the app's own service layer (`specla.runner.run`, on the engine's backend
             for the device: CUDA graphs on a GPU, the eager loop on the CPU), so a row is the
             number the app shows for the same settings
    oracle   (CUDA) the oracle drafter at controlled acceptance on the GDN-1.3B public shape
             with random bf16 weights, chains and trees, all on the device
"""
from __future__ import annotations

import dataclasses
import fnmatch
import statistics

import torch

from specla.bench.common import (PROMPT_FILES, ROOT, Deadline, Results, _hist, drafter_settings, free_cuda, guarded,
                                 random_prompt, small_config, stat, timing, tqdm)
from specla.bench.measure import oracle_split
from specla.graphs.ar import GraphedAR
from specla.graphs.buckets import comb_tree
from specla.graphs.oracle import DeviceOracle, oracle_calibrate, oracle_timed
from specla.graphs.runtime import PackedTarget
from specla.graphs.spec import GraphedSpec, SpecState, spec_vs_ar_noise
from specla.model import random_gdn


def oracle_topologies(quick: bool):
    from specla.tree import DraftTree

    chains = (8,) if quick else (4, 8, 16)
    trees = ((4, 16),) if quick else ((2, 16), (4, 16), (4, 32))
    out = [(f"chain-{b}", DraftTree.chain([0] * (b + 1))) for b in chains]
    out += [(f"tree-w{w}-b{b}", comb_tree(w, b)) for w, b in trees]
    return out


def suite_e2e(args, env, deadline: Deadline) -> dict:
    res = Results(args.out, "e2e", env)
    # the embedded pair first, capped, so the 1.3B oracle sweep keeps most of the time
    pair_deadline = Deadline(min(deadline.left(), args.pair_budget)) if args.device.type == "cuda" else deadline
    guarded(res.data, "pair_status", e2e_pair, args, res, pair_deadline)
    res.save()
    free_cuda()
    if args.device.type == "cuda":
        if args.pair_only:
            res.data["oracle_status"] = "skipped (--pair-only)"
        else:
            guarded(res.data, "oracle_status", e2e_oracle_gpu, args, res, deadline)
    res.save()
    return res.data


# --------------------------------------------------------------------------- the pair

def pair_runtime(args):
    """(runtime, prompt texts, notes): the embedded model and drafters with held-out prompts,
    or (`--tiny`, or no assets) the tiny random demo model with the oracle drafter."""
    from specla import runner
    from specla.acceptance import read_prompts

    if not args.tiny and (ROOT / "assets" / "target" / "config.json").exists():
        runtime = runner.load_runtime(None, str(args.drafters) if args.drafters else None, args.device.type,
                                      getattr(args, "dtype", "auto"))
        prompt_file = next(p for p in PROMPT_FILES if p.exists())
        texts = read_prompts(prompt_file, args.prompts or (3 if args.quick else 8))
        return runtime, texts, {"prompt_file": str(prompt_file.relative_to(ROOT)), "model": runtime.model_name}
    runtime = runner.tiny_random_runtime(device=args.device.type)
    texts = [f"def f{i}(x):\n    return x * {i} + " for i in range(args.prompts or (2 if args.quick else 4))]
    return runtime, texts, {"prompt_file": None, "model": runtime.model_name,
                            "why_tiny": "--tiny" if args.tiny else "no embedded model in assets/"}


def pair_rows(runtime, quick: bool) -> list[tuple[str, dict]]:
    """(row name, the app's settings) for every drafter the runtime has."""
    from specla import runner

    rows = []
    for kind, drafter in runtime.drafters.items():
        if kind == runner.ORACLE:
            if len(runtime.drafters) == 1:      # the tiny demo: the oracle is all there is
                rows += [(f"oracle/chain-{b}/alpha-{a}", {"drafter": kind, "tree": "chain", "budget": b,
                                                          "oracle_alpha": a})
                         for b in (4,) + (() if quick else (8,)) for a in (0.8,) + (() if quick else (0.6,))]
            continue
        for label, ds in drafter_settings(kind, drafter):
            rows.append((f"{kind}/{label}", {"drafter": kind, "tree": ds.tree, "top_k": ds.top_k,
                                             "budget": ds.budget, "block_size": ds.block_size,
                                             "depth": ds.depth}))
            preset = runner.tree_preset_of(drafter)
            if label == "chain" and preset:      # the drafter's measured fixed tree, beside its chain
                rows.append((f"{kind}/preset-{len(preset['paths'])}", dict(rows[-1][1], paths=runner.MEASURED)))
    return rows


def chosen_rows(rows: list[tuple[str, dict]], patterns: str) -> list[tuple[str, dict]]:
    """The rows whose names match the comma-separated shell patterns, pattern by pattern (so a
    short run measures the rows it names first); every row when there are none. A pattern
    that matches nothing is an error naming the rows there are."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    if not wanted:
        return rows
    chosen: list[tuple[str, dict]] = []
    for pattern in wanted:
        hits = [row for row in rows if fnmatch.fnmatchcase(row[0], pattern) and row not in chosen]
        if not hits and not any(fnmatch.fnmatchcase(name, pattern) for name, _ in rows):
            raise ValueError(f"--pair-rows: {pattern!r} matches no row; the rows are "
                             f"{', '.join(name for name, _ in rows)}")
        chosen += hits
    return chosen


def e2e_pair(args, res: Results, deadline: Deadline) -> str:
    from specla import runner

    runtime, texts, notes = pair_runtime(args)
    n = args.tokens or (64 if args.quick else 128)
    engine = runtime.engine
    out = res.data["pair"] = {"new_tokens": n, "prompts": len(texts), "device": args.device.type,
                              "backend": engine.backend, "ops": engine.ops_note,
                              "dtype": str(engine.dtype).replace("torch.", ""),
                              "measured_through": "specla.runner.run (the app's service layer)", **notes,
                              "rows": []}
    for name, settings in chosen_rows(pair_rows(runtime, args.quick), getattr(args, "pair_rows", "")):
        row = {"name": name, "kind": "oracle" if settings["drafter"] == runner.ORACLE else "drafter",
               "drafter": settings["drafter"], "settings": name.split("/", 1)[1], "app_settings": settings}
        if not deadline.ok(20):
            out["rows"].append({**row, "skipped": "deadline"})
            continue
        guarded(row, "result", pair_row, runtime, texts, dict(settings, max_new_tokens=n))
        if isinstance(row["result"], dict) and "error" not in row["result"]:
            row.update(row.pop("result"))
            print(f"[e2e] {name}: tau {row['tau']:.2f}, {row['ms_per_token']['median']:.3f} ms/token, "
                  f"speedup {row['speedup']:.2f}x ({row['engine']['drafting']} drafting)", flush=True)
        out["rows"].append(row)
        res.save()
    return "ok"


def final_trace(updates) -> dict:
    """The complete trace at the end of a `runner.run` (the last update)."""
    trace = None
    for update in updates:
        if isinstance(update, dict):
            trace = update
    return trace


def pair_row(runtime, texts: list[str], settings: dict) -> dict:
    """Every prompt through `runner.run` with these settings: the app's own measurement (AR
    and speculation on the engine's backend, warmed up; see runner.run). The row keeps each
    prompt's speedup and pools the rest: ms/token medians, tau, the GPU time split."""
    from specla import runner

    traces = [final_trace(runner.run(runtime, text, settings)) for text in texts]
    spec_ms = [1e3 / t["summary"]["tokens_per_s"] for t in traces]
    ar_ms = [1e3 / t["baseline"]["tokens_per_s"] for t in traces]
    tokens = sum(t["summary"]["new_tokens"] for t in traces)
    steps = sum(t["summary"]["target_forwards"] for t in traces)
    split: dict[str, float] = {}
    for t in traces:
        for k, v in t["summary"]["time_ms"].items():
            split[k] = split.get(k, 0.0) + v / steps
    diverging = [{"prompt": i, **t["exactness"]["first_divergence"]} for i, t in enumerate(traces)
                 if t["exactness"].get("first_divergence")]
    t_ar, t_spec = statistics.median(ar_ms), statistics.median(spec_ms)
    tau = tokens / steps
    return {"tokens": tokens, "target_forwards": steps, "tau": tau,
            "ms_per_token": stat(spec_ms), "tokens_per_s": stat([1e3 / x for x in spec_ms]),
            "ar_ms_per_token": stat(ar_ms), "speedup": t_ar / t_spec,
            "speedup_per_prompt": [t["summary"]["speedup"] for t in traces],
            "bound": tau * t_ar / split["verify"] if split.get("verify") else None,
            "time_split_ms_per_step": split, "engine": traces[0]["engine"],
            "exact": {"prompts": len(traces), "diverging_prompts": len(diverging), "divergences": diverging,
                      "unexcused": sum(not d["near_tie"] for d in diverging),
                      "rule": "a divergence is excused when AR's logit gap between its token and the output's "
                              "is <= 2 x the measured spec-vs-AR logit noise (a near-tie that rounding flips)"}}


# --------------------------------------------------------------------------- the oracle sweep

def e2e_oracle_gpu(args, res: Results, deadline: Deadline) -> dict:
    """Oracle drafter at controlled acceptance on the GDN-1.3B public shape, all on device."""
    from specla.config import PUBLIC_1P3B

    config = small_config() if args.tiny else PUBLIC_1P3B
    n = args.tokens or (96 if args.quick else 256)
    repeats = args.repeats or 3
    alphas = (0.7, 0.9) if args.quick else (0.5, 0.6, 0.7, 0.8, 0.9)
    alphas = getattr(args, "oracle_alphas", ()) or alphas
    topologies = oracle_topologies(args.quick)
    max_path = max(t.depth + 1 for _, t in topologies)
    out = res.data["oracle"] = {"config": dataclasses.asdict(config), "new_tokens": n,
                                "prompt_tokens": args.prompt_len, "alphas": list(alphas), "rows": []}
    print("[e2e] oracle: building random bf16 target", flush=True)
    target = random_gdn(config, args.device, torch.bfloat16, seed=args.seed)
    prompt = random_prompt(config.vocab_size, args.prompt_len, args.seed)
    root = prompt[-1]
    rt = PackedTarget(target, args.ops)
    out["ops"], out["fp32_logits"] = rt.ops_note, rt.head_fp32
    capacity = n + 2 * max_path + 8
    ar = GraphedAR(rt, max_len=capacity + max_path + 8)
    ar.prefill(prompt)
    snap = ar.state.clone()

    def ar_baseline():
        ar.timed_generate(snap, root, n)
        runs = [ar.timed_generate(snap, root, n) for _ in range(max(repeats, 5))]
        return timing([ms for _, ms in runs], n)

    out["ar"] = ar_baseline()
    res.save()
    t_ar = out["ar"]["ms_per_token"]["median"]
    cont = ar.timed_generate(snap, root, capacity)[0]
    ar_tokens = cont[:n]
    noise = guarded(out, "spec_vs_ar_logit_noise", spec_vs_ar_noise, rt, ar, snap, root, cont,
                    16, args.recurrence)
    threshold = 2 * noise if isinstance(noise, float) else 0.0
    out["excuse_threshold"] = threshold
    print(f"[e2e] AR {t_ar:.3f} ms/token; spec-vs-AR logit noise {noise}", flush=True)

    def run_config(name, tree, alphas_here, deferred=True):
        state = SpecState(rt, max_path=tree.depth + 1, capacity=capacity, max_nodes=len(tree))
        oracle = DeviceOracle(cont, config.vocab_size, 0.0, max_steps=capacity + 1,
                              max_nodes=len(tree), capacity=capacity + 2 * max_path + 8,
                              device=args.device, seed=args.seed)
        # acceptance compiled as the engine's oracle and device drafters have it
        spec = GraphedSpec(rt, state, tree, mode="auto", deferred=deferred, oracle=oracle,
                           recurrence=args.recurrence, compile=args.device.type == "cuda")
        for alpha in alphas_here:
            if not deadline.ok(20):
                out["rows"].append({"name": name, "alpha": alpha, "skipped": "deadline"})
                continue
            row = {"name": name, "kind": "oracle", "topology": name, "nodes": len(tree),
                   "depth": tree.depth, "mode": spec.mode, "alpha": alpha, "deferred": deferred,
                   "capture_ms": spec.capture_ms, "accept_compiled": spec.compiled,
                   **({"compile_error": spec.compile_error} if spec.compile_error else {})}
            guarded(row, "result", oracle_row, spec, ar, snap, root, n, alpha, cont, ar_tokens,
                    repeats, t_ar, threshold)
            if isinstance(row.get("result"), dict) and "error" not in row["result"]:
                row.update(row.pop("result"))
            out["rows"].append(row)
            res.save()
            r = row
            if "speedup" in r:
                print(f"[e2e] {name} alpha={alpha}: tau {r['tau']:.2f}, {r['ms_per_token']['median']:.3f} "
                      f"ms/token, speedup {r['speedup']:.2f}x (bound {r['bound']:.2f})", flush=True)
        return "ok"

    def topology(name, tree, alphas_here, deferred=True):
        failure: dict = {}
        if guarded(failure, "result", run_config, name, tree, alphas_here, deferred) is None:
            out["rows"].append({"name": name, **failure["result"]})
        free_cuda()

    for name, tree in tqdm(topologies, desc="oracle topologies"):
        if not deadline.ok(30):
            out["rows"].append({"name": name, "skipped": "deadline"})
            continue
        topology(name, tree, alphas)
    # the deferred commit's share: the longest chain again with the commit done immediately
    chain = max((t for t in topologies if t[0].startswith("chain")), key=lambda t: len(t[1]))
    if deadline.ok(30):
        topology(chain[0] + "-immediate", chain[1], (0.8,), False)
    out["ar_after"] = ar_baseline()
    res.save()
    return "ok"


def oracle_row(spec, ar, snap, root, n, alpha, cont, ar_tokens, repeats, t_ar, threshold) -> dict:
    spec.oracle.set_alpha(alpha)
    spec.oracle.set_continuation(cont)
    cal = oracle_calibrate(spec, ar, snap, root, n)
    runs = [oracle_timed(spec, snap, root, n, cal.steps) for _ in range(repeats)]
    split = oracle_split(spec, snap, root, cal.steps)
    tokens = runs[0].tokens
    per_token = [r.ms / len(r.tokens) for r in runs]
    step_ms = [r.ms / r.steps for r in runs]
    tau = len(tokens) / runs[0].steps
    t_spec = statistics.median(per_token)
    first = next((i for i, (a, b) in enumerate(zip(tokens, ar_tokens)) if a != b), None)
    divs = [{**d, "excused": d["gap"] <= threshold} for d in cal.divergences]
    return {
        "tokens": len(tokens), "target_forwards": runs[0].steps, "tau": tau,
        "ms_per_token": stat(per_token), "tokens_per_s": stat([1e3 / x for x in per_token]),
        "step_ms": stat(step_ms), "ar_ms_per_token": t_ar,
        # bound: the speedup if drafting, acceptance and commit cost nothing (verify only)
        "speedup": t_ar / t_spec, "bound": tau * t_ar / split["verify"],
        "time_split_ms_per_step": {**split,
                                   "graph_launch_and_gaps": statistics.median(step_ms) - sum(split.values())},
        "accepted_hist": _hist(runs[0].accepted),
        "exact": {"checked_tokens": min(n, len(tokens)), "equal_to_ar": first is None,
                  "first_mismatch": first, "divergences": divs,
                  "unexcused": sum(not d["excused"] for d in divs),
                  "reproduced_in_timed_runs": all(r.tokens == cal.tokens for r in runs),
                  "rule": "a divergence is where the target's greedy token left AR's (same prefix); "
                          "the step was redone with the target's token; excused if the gap <= 2 * "
                          "the measured spec-vs-AR logit noise"},
    }
