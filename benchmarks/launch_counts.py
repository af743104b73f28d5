"""Kernel launches and GPU time per kernel of one AR step and of each phase of one speculative step.

    python benchmarks/launch_counts.py --out DIR [--device cuda] [--drafter block] [--tree chain]
        [--ops fla,fused] [--speed-prompts data/corpus/heldout_prompts.jsonl]
    python benchmarks/launch_counts.py --out DIR --model gdn-1.3b-random --budget 8   # issue #16's profile

Builds the engine on the embedded pair (assets/; or the runner's other models: the GDN-1.3B
shape with the oracle drafter, where the file also holds the weights' bytes and the time
they take to read at the measured copy bandwidth), captures the graphed AR step and the
speculative decoder for the settings, then runs each body once more, uncaptured, under
torch.profiler: the kernels a body launches are the kernels its CUDA graph replays. Both
variants of the acceptance phase are counted, compiled (what the engine captures on CUDA)
and plain, so the effect of fusing it reads off one file. Several op sets (`--ops fla,fused`)
are compared in one run; with `--speed-prompts` each is also timed end to end through the
app's measurement. Every op set's AR step is also timed as graph replays back to back (its
wall time, for any model). Writes launch_counts.json: per op set and body the kernel count,
the summed kernel time, and its ten longest kernels.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels import carveout, l2_prefetch, pdl  # noqa: E402
from kernels import triton_projection as projection, triton_recurrent_step as recurrent_step  # noqa: E402
from kernels import triton_verify, triton_verify_step  # noqa: E402
from specla.graphs import ops as graph_ops  # noqa: E402
from specla.graphs import draft_step, whole_step  # noqa: E402
from specla.graphs import drafters as graph_drafters  # noqa: E402
from specla import runner  # noqa: E402
from specla.acceptance import read_prompts  # noqa: E402
from specla.bench.measure import decode_bytes  # noqa: E402
from specla.decode import DecodeSettings  # noqa: E402
from specla.drafters.base import DraftSettings  # noqa: E402
from specla.drafters.oracle import OracleDrafter  # noqa: E402
from specla.engine import Engine  # noqa: E402

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


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


def count_bodies(runtime, ops: str, args) -> tuple[dict, Engine]:
    """The kernels of each body of one step with the target's per-layer `ops`, and the engine
    that ran them."""
    device = runtime.device
    # the graphed backend's bodies; on a CPU they run uncaptured (its ops are counted instead)
    engine = Engine(runtime.target, "graphed", ops=ops, use_graph=None if device.type == "cuda" else False)
    prompt = runtime.encode(PROMPT)
    settings = DecodeSettings(max_new_tokens=64)
    draft = DraftSettings(tree=args.tree, top_k=args.top_k, budget=args.budget, block_size=8)
    drafter = drafter_for(runtime, engine, prompt, settings, args)
    list(engine.speculate(prompt, drafter, settings, draft))           # builds and captures the decoder
    ar = engine._graphed_ar(settings)
    snapshot = engine.packed.prefill(prompt)[0]
    ar.reset(snapshot, prompt[-1])
    if isinstance(drafter, OracleDrafter):      # drafted on the device by a step of its own
        spec = engine._oracle_decoder(drafter, settings, draft)["spec"]
    else:
        dec = engine.decoder(drafter, settings, draft)
        # a host drafter's decoder keeps one captured step per draft size: count the largest
        spec = dec.spec if dec.on_device else max(dec.specs.values(), key=lambda sp: sp.tokens.shape[-1])
    variant = {"ops": engine.ops_note, "verify": spec.verify_note, "accept_in_verify": spec.kernel_accept,
               "draft": getattr(spec.drafter, "draft_note", None), "dtype": str(engine.dtype).replace("torch.", ""),
               "bodies": {},
               "ar_ms_per_token": ar_wall_time(ar, snapshot, prompt[-1], settings.max_new_tokens)}
    bodies = {"ar_step": ar._step, "draft": spec.draft, "verify": spec.verify,
              "accept (compiled)" if spec.compiled else "accept": spec._accept}
    if spec.compiled:
        bodies["accept (plain ops)"] = spec.accept
    print(f"[{ops}] AR {variant['ar_ms_per_token']['median']:.4f} ms/token (graph replays)", flush=True)
    with torch.no_grad(), spec.state.preserved():
        for name, body in bodies.items():
            variant["bodies"][name] = kernels_of(body, device)
            print(f"[{ops}] {name:>20}: {variant['bodies'][name]['launches']:7.1f} launches, "
                  f"{variant['bodies'][name]['kernel_us']:8.1f} us", flush=True)
    if device.type == "cuda" and spec.use_graph and "draft" in spec.graphs:
        variant["step_loop_us"] = step_loop(spec)
        print(f"[{ops}] step loop, µs a step: {variant['step_loop_us']}", flush=True)
    return variant, engine


def step_loop(spec, steps: int = 48, repeats: int = 5) -> dict:
    """µs a step of `steps` speculative steps replayed back to back: the verify graph alone,
    the draft graph alone, both per step (as one decode runs them), both with a CUDA event
    after each phase (as the decoder marks them for its time split), the whole step captured
    as one graph, and the verify graph followed by a read of 0, 4 or 16 MB elsewhere. Medians
    of `repeats`; every run starts from the same state."""
    from specla.graphs.spec import PHASES, enqueue_phases
    from specla.graphs.runtime import PhaseClock

    if "step" not in spec.graphs:
        spec._capture("step")
    ways = {"verify": lambda: spec.run("verify"), "draft": lambda: spec.run("draft"),
            "phases": lambda: [spec.run(phase) for phase in PHASES], "step_graph": spec.step}
    # the verify graph, then a kernel that reads MB megabytes elsewhere (0: one element): how
    # much of a verification's slowdown beside the draft is lines it lost from L2
    sink = torch.zeros(1, device=spec.rt.device)
    for mb in (0, 4, 16):
        other = torch.ones(max(1, mb << 19), device=spec.rt.device, dtype=torch.bfloat16)
        ways[f"verify+read{mb}MB"] = (lambda other=other: (spec.run("verify"), sink.copy_(other.sum())))
    out = {}
    with torch.no_grad():
        for name, body in ways.items():
            out[name] = _median_us(lambda: [body() for _ in range(steps)], spec, steps, repeats)
        clock = PhaseClock(spec.rt.device)
        out["phases_marked"] = _median_us(lambda: enqueue_phases(spec, steps, clock), spec, steps, repeats)
    return out


def _median_us(run, spec, steps: int, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):                 # the first run warms
        with spec.state.preserved():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(1e3 * start.elapsed_time(end) / steps)
    return round(sorted(times[1:])[repeats // 2], 2)


def ar_wall_time(ar, snapshot, root: int, n: int, repeats: int = 5) -> dict:
    """Milliseconds per token of n AR steps replayed back to back (CUDA events; host time on
    the CPU), median of `repeats` after one warm run: the wall time the kernel counts add up to."""
    ar.timed_generate(snapshot, root, n)
    per_token = sorted(ar.timed_generate(snapshot, root, n)[1] / n for _ in range(repeats))
    return {"median": per_token[len(per_token) // 2], "min": per_token[0], "max": per_token[-1],
            "tokens": n, "repeats": repeats}


def drafter_for(runtime, engine, prompt: list[int], settings: DecodeSettings, args):
    """The drafter to count: a loaded one as is; a per-run factory (the oracle, right with
    probability --alpha) built from this prompt and the target's own continuation of it."""
    entry = runtime.drafters[args.drafter]
    if hasattr(entry, "propose"):
        if args.preset:     # a tree preset over the drafter ("measured": the drafter's own)
            return runner.PresetShape(entry, runner.preset_paths(args.preset, entry, args.drafter))
        return entry
    s = runner.normalize_settings(runtime, {"drafter": args.drafter, "oracle_alpha": args.alpha, "tree": args.tree,
                                            "budget": args.budget, "max_new_tokens": settings.max_new_tokens})
    return entry(prompt, engine.ar(prompt, settings).tokens, s)


def weight_floor(runtime) -> dict:
    """The bytes an AR step must move at least (`decode_bytes`: every weight once, one row of an
    untied embedding, the state and conv window read and written) and, on a GPU, the time
    that takes at the measured copy bandwidth: what the AR step's kernel time is held against."""
    nbytes = decode_bytes(runtime.target)
    out = {"floor_bytes": nbytes["total"], "floor_bytes_parts": nbytes}
    if runtime.device.type == "cuda":
        from benchmarks.bench_kernels import copy_bandwidth

        out["copy_GBps"] = copy_bandwidth(runtime.device)["median"]
        out["floor_us"] = nbytes["total"] / (out["copy_GBps"] * 1e3)
    return out


def speed_row(runtime, engine, texts: list[str], args) -> dict:
    """The app's own measurement (runner.run: graphed AR and speculation, warmed up) with this
    engine, on `texts`: what the op set changes end to end."""
    from specla.bench.e2e import pair_row

    row = pair_row(dataclasses.replace(runtime, engine=engine), texts,
                   {"drafter": args.drafter, "tree": args.tree, "budget": args.budget, "top_k": args.top_k,
                    "block_size": 8, "oracle_alpha": args.alpha, "max_new_tokens": args.tokens,
                    "paths": args.preset or None})
    keep = ("tau", "ms_per_token", "ar_ms_per_token", "speedup", "time_split_ms_per_step", "exact")
    return {key: row[key] for key in keep}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="the runner's model: assets/target (default), random-tiny, "
                   f"or {runner.RANDOM_1P3B} (the GDN-1.3B shape, random weights, the oracle drafter)")
    p.add_argument("--drafter", default=None, help="default: block, or the model's first drafter")
    p.add_argument("--alpha", type=float, default=0.8, help="the oracle drafter's acceptance rate")
    p.add_argument("--tree", default="chain")
    p.add_argument("--budget", type=int, default=7)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--preset", default=None, help="a tree preset: JSON index paths, or measured (the drafter's own)")
    p.add_argument("--ops", default="auto",
                   help="the target's per-layer ops, one set or several to compare: auto | fla | fused | torch; "
                        "a +nopdl suffix (fused+nopdl) launches the GEMV projections without programmatic "
                        "dependent launch (kernels/pdl.py); +nostep runs an AR token's conv and recurrence as "
                        "two launches (fla's), not one (kernels/triton_conv_gates.py); +nowhole runs "
                        "a narrow target's AR token as per-op launches, not one persistent launch "
                        "(kernels/triton_decode_step.py), +whole runs it at any width, and +pN with N programs; "
                        "+noverify verifies chains with per-op launches, not one persistent launch "
                        "(kernels/triton_verify_step.py); +nodraft drafts a block drafter's block with torch "
                        "ops, not one persistent launch (kernels/triton_draft_step.py); +notree grows a greedy best-first block "
                        "tree with torch ops after the draft's launch, not in it, and +latticetree grows LiLiCorr's "
                        "in a launch of its own (specla/graphs/drafters.py); +noaccept accepts a "
                        "chain with torch ops after its verification, not in the same launch "
                        "(kernels/triton_chain_accept.py); +noswap runs the projections of 3-16 rows of a large "
                        "narrow matrix on cuBLAS, not fused in the swapped tl.dot form (kernels/triton_projection.py); "
                        "+nogreedy takes a per-op AR step's greedy token with torch's argmax, not in one launch "
                        "(kernels/triton_greedy.py); +noconvproj runs a large-headed AR token's conv as fla's "
                        "kernel, not in the input projection's epilogue (norm_linear_conv); +norecstep runs the "
                        "per-op AR recurrence as fla's kernel, not ours (kernels/triton_recurrent_step.py), and "
                        "+recoff / +reclaunch set its PDL_MODE; +fewN.K.S gives the GEMV projections whose column "
                        "blocks do not fill the GPU N columns, K wide blocks and S split-K slices "
                        "(FEW_BLOCKS_TILING in kernels/triton_projection.py); +nopf: no kernel prefetches the next "
                        "weights into L2 (kernels/l2_prefetch.py), +pfnorec / +pfrec: the AR recurrence and the "
                        "conv + gates do not / do, +pfstart: the projections prefetch at their start, not their "
                        "end, +pfcapN: at most N MB of a matrix from a kernel of one or two rows, +pfrowsN: from "
                        "a kernel of more rows; +preload / +nopreload: the swapped projections load their inputs a "
                        "K block ahead or not (SWAP_PRELOAD), +swapwide: the swapped form for any width (the "
                        "in and gate/up projections of a verification too, not fla's norm + cuBLAS); "
                        "+gramfirst / +nogramfirst: the parallel verification builds (I + A)^-1 before it reads "
                        "the state or not (PARALLEL_GRAM_FIRST in kernels/triton_verify.py), +tf32x3: its products "
                        "on tensor cores in three tf32 passes, not in fp32 FMAs (PARALLEL_DOT_PRECISION); +inN: "
                        "the persistent verification's input projection in units of N columns (IN_PROJ_BLOCK in "
                        "kernels/triton_verify_step.py), +folda / +foldb: it folds the deferred commit by phase A's idle "
                        "programs or in phase B's units (FOLD_IN_A); +carveN: the persistent kernels prefer N%% of the "
                        "unified L1 / shared memory as shared memory, +carvedef: the driver's choice again "
                        "(kernels/carveout.py; a kernel keeps its split until another op set sets it)")
    p.add_argument("--speed-prompts", type=Path, help="also time AR and speculation per op set on these prompts")
    p.add_argument("--speed-limit", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    runtime = runner.load_runtime(model=args.model, device=args.device)
    if args.drafter is None:
        args.drafter = "block" if "block" in runtime.drafters else next(iter(runtime.drafters))
    result = {"command": " ".join(["python benchmarks/launch_counts.py"] + (argv or sys.argv[1:])),
              "commit": os.environ.get("SPECLA_COMMIT"), "device": runner.hardware_name(runtime.device),
              "model": runtime.model_name, **weight_floor(runtime),
              "settings": {"drafter": args.drafter, "tree": args.tree, "budget": args.budget, "top_k": args.top_k,
                           "preset": args.preset},
              "unit": "kernels" if runtime.device.type == "cuda" else "aten ops (CPU: no kernels to count)",
              "variants": {}}
    if args.speed_prompts:
        texts = read_prompts(args.speed_prompts, args.speed_limit)
        result["speed"] = {"prompt_file": str(args.speed_prompts), "prompts": len(texts), "new_tokens": args.tokens}
    args.out.mkdir(parents=True, exist_ok=True)
    step_max_state, greedy = graph_ops.FUSED_STEP_MAX_STATE, graph_ops.GREEDY_KERNEL
    conv_in_projection, recurrent_kernel = graph_ops.CONV_IN_PROJECTION, graph_ops.RECURRENT_STEP_KERNEL
    recurrent_pdl = recurrent_step.PDL_MODE
    whole_max_hidden = whole_step.WHOLE_STEP_MAX_HIDDEN
    swap_min_bytes, few_blocks = projection.SWAP_MIN_BYTES, projection.FEW_BLOCKS_TILING
    swap_preload, swap_max_columns = projection.SWAP_PRELOAD, projection.SWAP_MAX_COLUMNS
    prefetch_at, prefetch_max, prefetch_max_rows = l2_prefetch.AT, l2_prefetch.MAX_BYTES, l2_prefetch.MAX_BYTES_ROWS
    prefetch_state = graph_ops.L2_PREFETCH_IN_STATE_STEPS
    gram_first, dot_precision = triton_verify.PARALLEL_GRAM_FIRST, triton_verify.PARALLEL_DOT_PRECISION
    in_proj_block, fold_in_a = triton_verify_step.IN_PROJ_BLOCK, triton_verify_step.FOLD_IN_A
    for name in args.ops.split(","):
        ops, *flags = name.split("+")
        pdl.use_pdl("nopdl" not in flags)
        graph_ops.FUSED_STEP_MAX_STATE = 0 if "nostep" in flags else step_max_state
        graph_ops.GREEDY_KERNEL = greedy and "nogreedy" not in flags
        graph_ops.CONV_IN_PROJECTION = conv_in_projection and "noconvproj" not in flags
        graph_ops.RECURRENT_STEP_KERNEL = recurrent_kernel and "norecstep" not in flags
        recurrent_step.PDL_MODE = next((f[3:] for f in flags if f in ("recoff", "reclaunch")), recurrent_pdl)
        whole_step.WHOLE_STEP_MAX_HIDDEN = (0 if "nowhole" in flags else 1 << 30 if "whole" in flags
                                            else whole_max_hidden)
        whole_step.WHOLE_STEP_PROGRAMS = next((int(f[1:]) for f in flags if f[:1] == "p" and f[1:].isdigit()), None)
        whole_step.WHOLE_VERIFY = "noverify" not in flags
        draft_step.PERSISTENT_DRAFT = "nodraft" not in flags
        graph_drafters.TREE_KERNEL = "notree" not in flags
        graph_drafters.LATTICE_TREE_KERNEL = "latticetree" in flags
        whole_step.FUSED_ACCEPT = "noaccept" not in flags
        projection.SWAP_MIN_BYTES = None if "noswap" in flags else swap_min_bytes
        projection.SWAP_PRELOAD = ("preload" in flags or swap_preload) and "nopreload" not in flags
        projection.SWAP_MAX_COLUMNS = 1 << 20 if "swapwide" in flags else swap_max_columns
        triton_verify.PARALLEL_GRAM_FIRST = ("gramfirst" in flags or gram_first) and "nogramfirst" not in flags
        triton_verify.PARALLEL_DOT_PRECISION = "tf32x3" if "tf32x3" in flags else dot_precision
        triton_verify_step.IN_PROJ_BLOCK = next((int(f[2:]) for f in flags if f[:2] == "in" and f[2:].isdigit()),
                                                in_proj_block)
        triton_verify_step.FOLD_IN_A = ("folda" in flags or fold_in_a) and "foldb" not in flags
        l2_prefetch.use_l2_prefetch("nopf" not in flags)
        carveout.PREFERRED = next((-1 if f == "carvedef" else int(f[5:]) for f in flags
                                   if f == "carvedef" or (f[:5] == "carve" and f[5:].isdigit())), None)
        graph_ops.L2_PREFETCH_IN_STATE_STEPS = ("pfrec" in flags or prefetch_state) and "pfnorec" not in flags
        l2_prefetch.AT = "start" if "pfstart" in flags else prefetch_at
        l2_prefetch.MAX_BYTES = next((int(f[5:]) << 20 for f in flags if f.startswith("pfcap")), prefetch_max)
        l2_prefetch.MAX_BYTES_ROWS = next((int(f[6:]) << 20 for f in flags if f.startswith("pfrows")),
                                          prefetch_max_rows)
        projection.FEW_BLOCKS_TILING = next((tuple(int(n) for n in f[3:].split(".")) for f in flags
                                             if f.startswith("few")), few_blocks)
        try:
            variant, engine = count_bodies(runtime, ops, args)
            variant["pdl"] = pdl.pdl_applies(runtime.device)
            variant["persistent_kernels"] = {name: dict(seen) for name, seen in carveout.SEEN.items()}
            if args.speed_prompts:
                variant["speed"] = speed_row(runtime, engine, texts, args)
                print(f"[{name}] AR {variant['speed']['ar_ms_per_token']['median']:.4f} ms/token, "
                      f"speedup {variant['speed']['speedup']:.3f}x", flush=True)
        finally:
            pdl.use_pdl(True)
            graph_ops.FUSED_STEP_MAX_STATE = step_max_state
            graph_ops.GREEDY_KERNEL, graph_ops.CONV_IN_PROJECTION = greedy, conv_in_projection
            graph_ops.RECURRENT_STEP_KERNEL, recurrent_step.PDL_MODE = recurrent_kernel, recurrent_pdl
            whole_step.WHOLE_STEP_MAX_HIDDEN, whole_step.WHOLE_STEP_PROGRAMS = whole_max_hidden, None
            whole_step.WHOLE_VERIFY = draft_step.PERSISTENT_DRAFT = whole_step.FUSED_ACCEPT = True
            graph_drafters.TREE_KERNEL, graph_drafters.LATTICE_TREE_KERNEL = True, False
            projection.SWAP_MIN_BYTES, projection.FEW_BLOCKS_TILING = swap_min_bytes, few_blocks
            projection.SWAP_PRELOAD, projection.SWAP_MAX_COLUMNS = swap_preload, swap_max_columns
            l2_prefetch.use_l2_prefetch(True)
            carveout.PREFERRED = None
            graph_ops.L2_PREFETCH_IN_STATE_STEPS = prefetch_state
            l2_prefetch.AT, l2_prefetch.MAX_BYTES = prefetch_at, prefetch_max
            l2_prefetch.MAX_BYTES_ROWS = prefetch_max_rows
            triton_verify.PARALLEL_GRAM_FIRST, triton_verify.PARALLEL_DOT_PRECISION = gram_first, dot_precision
            triton_verify_step.IN_PROJ_BLOCK, triton_verify_step.FOLD_IN_A = in_proj_block, fold_in_a
        result["variants"][name] = variant
        (args.out / "launch_counts.json").write_text(json.dumps(result, indent=1))   # kept if a later set fails
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
