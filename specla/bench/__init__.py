"""Benchmarks: `python -m specla bench [options]` (also `python -m specla.bench`).

Suites (`--suite`, default all):
  runtime     AR decode at the GDN-1.3B public shape (and a small one), random bf16 weights,
              512-token prompt: fla's model eager, fla's model in one CUDA graph, our
              GraphedAR; the memory floor; our logits and greedy tokens against fla's.
  e2e         speculative decoding against GraphedAR in the same process: the oracle drafter
              at controlled acceptance (chains and trees, GDN-1.3B shape) and the embedded
              target with its trained drafters. `--device cpu`: the eager loop
              (specla.decode) on the embedded pair, or a tiny random target with `--tiny`.
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
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from specla.bench.measure import FlaAR, build_fla_model, copy_bandwidth, decode_bytes, oracle_calibrate, oracle_split, oracle_timed, spec_vs_ar_noise
from specla.graphs.ar import GraphedAR
from specla.graphs.buckets import comb_tree, max_path_for
from specla.graphs.decoders import GraphedDecoder
from specla.graphs.oracle import DeviceOracle
from specla.graphs.runtime import PackedTarget, Stopwatch, capture
from specla.graphs.spec import GraphedSpec, SpecState
from specla.model import random_gdn

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"
SUITES = ("runtime", "e2e", "head", "kernels", "acceptance")
PROMPT_FILES = (ROOT / "data" / "corpus" / "heldout_prompts.jsonl", ROOT / "examples" / "prompts.jsonl")

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety
    def tqdm(it, **kw):
        return it


# --------------------------------------------------------------------------- small helpers

def stat(values) -> dict:
    """Run count, median, min, max (and the values) of a list of numbers."""
    values = [float(v) for v in values]
    if not values:
        return {"runs": 0, "median": None, "min": None, "max": None, "values": []}
    return {"runs": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values), "values": [round(v, 6) for v in values]}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


class Deadline:
    """Wall-clock budget: suites stop starting new variants once it is spent."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def ok(self, need: float = 0.0) -> bool:
        return self.left() > need


class Results:
    """One suite's JSON, rewritten after every change so a crash loses at most one variant."""

    def __init__(self, out: Path, name: str, env: dict):
        self.path = out / f"{name}.json"
        self.data = {"suite": name, "environment": env}

    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, value):
        self.data[key] = value
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        tmp.replace(self.path)


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return repr(x)


def guarded(record: dict, key: str, fn, *args, **kwargs):
    """Run one variant; on failure keep the traceback in the results and go on."""
    try:
        value = fn(*args, **kwargs)
        record[key] = value
        return value
    except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others
        record[key] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        print(f"  ! {key} failed: {type(err).__name__}: {err}", flush=True)
        if torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a sticky CUDA error: nothing more to save
                pass
        return None


def git_commit() -> dict:
    """Commit and dirtiness from git, or from .git itself when the git binary is missing, or
    from SPECLA_COMMIT where the tree was copied without .git (the GPU machine)."""
    if os.environ.get("SPECLA_COMMIT"):
        return {"commit": os.environ["SPECLA_COMMIT"], "dirty": None, "source": "SPECLA_COMMIT"}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                                   text=True, timeout=10).stdout.strip() != ""
            return {"commit": head.stdout.strip(), "dirty": dirty, "source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    git = ROOT / ".git"
    try:
        ref = (git / "HEAD").read_text().strip()
        if not ref.startswith("ref:"):
            return {"commit": ref, "dirty": None, "source": ".git/HEAD"}
        name = ref.split(None, 1)[1]
        if (git / name).exists():
            return {"commit": (git / name).read_text().strip(), "ref": name, "dirty": None, "source": ".git"}
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + name):
                return {"commit": line.split()[0], "ref": name, "dirty": None, "source": "packed-refs"}
    except OSError:
        pass
    return {"commit": None, "dirty": None, "source": "unknown"}


def environment(device: torch.device, argv: list[str]) -> dict:
    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: say so
            return None

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python -m specla bench"] + list(argv)),
           "device": str(device), "python": platform.python_version(),
           "torch": torch.__version__, "triton": version("triton"), "fla": version("fla"),
           "transformers": version("transformers"), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "git": git_commit()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), sm_count=props.multi_processor_count, cuda=torch.version.cuda,
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return env


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def timing(runs_ms: list[float], tokens: int, bytes_per_step: int | None = None,
           floor_ms: float | None = None) -> dict:
    """ms/token and tokens/s stats of runs that each produced `tokens` tokens."""
    per_token = [ms / tokens for ms in runs_ms]
    out = {"tokens_per_run": tokens, "ms_per_token": stat(per_token),
           "tokens_per_s": stat([1e3 / x for x in per_token])}
    med = out["ms_per_token"]["median"]
    if bytes_per_step and med:
        out["achieved_GBps"] = bytes_per_step / (med * 1e6)   # bytes per ms -> GB/s
    if floor_ms and med:
        out["fraction_of_floor"] = floor_ms / med
    return out


def fmt(s: dict | None, digits: int = 3) -> str:
    """'median (min-max, n=R)' of a stat dict."""
    if not isinstance(s, dict) or s.get("median") is None:
        return "-"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])}, n={s['runs']})"


def num(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def free_cuda() -> None:
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- runtime suite

def small_config():
    from specla.config import GDNConfig
    return GDNConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_heads=4,
                     head_dim=128, expand_v=2.0)


def suite_runtime(args, env, deadline: Deadline) -> dict:
    from specla.config import PUBLIC_1P3B

    res = Results(args.out, "runtime", env)
    if args.device.type != "cuda":
        res["skipped"] = "the runtime suite compares CUDA-graph runtimes: run it with --device cuda"
        return res.data
    res["copy_bandwidth_GBps"] = stat(copy_bandwidth(args.device))
    print(f"copy bandwidth {res['copy_bandwidth_GBps']['median']:.0f} GB/s", flush=True)
    res["models"] = {}
    random_model = lambda config: lambda: (  # noqa: E731
        random_gdn(config, args.device, torch.bfloat16, seed=args.seed),
        random_prompt(config.vocab_size, args.prompt_len, args.seed))
    models = (("gdn-1.3b-public", random_model(PUBLIC_1P3B)), ("embedded", lambda: embedded_model(args)),
              ("small", random_model(small_config())))
    for name, make in models:
        if not deadline.ok(60):
            res["models"][name] = {"skipped": "deadline"}
            continue
        entry = res["models"][name] = {}
        guarded(entry, "status", runtime_for_model, name, make, args, res, deadline)
        res.save()
        free_cuda()
    return res.data


def embedded_model(args) -> tuple:
    """The embedded target in bf16 and a prompt of real text: the example prompts, joined and
    cut to --prompt-len tokens."""
    from specla.acceptance import read_prompts
    from specla.checkpoint import load_model

    target, tokenizer, _ = load_model(ROOT / "assets" / "target", device=args.device, dtype=torch.bfloat16)
    prompt_file = next(p for p in PROMPT_FILES if p.exists())
    text = "\n".join(read_prompts(prompt_file, None))
    return target, tokenizer.encode(text, add_special_tokens=False)[:args.prompt_len]


def runtime_for_model(name, make_target, args, res: Results, deadline: Deadline) -> dict:

    dev = args.device
    n = args.tokens or (64 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 5)
    n_eager, repeats_eager = (8, 2) if args.quick else (16, 3)
    compare_last = 32
    print(f"[runtime] {name}: building the bf16 target", flush=True)
    target, prompt = make_target()
    config = target.config
    root = prompt[-1]
    nbytes = decode_bytes(target)
    bw = res["copy_bandwidth_GBps"]["median"]
    out = {"config": dataclasses.asdict(config), "prompt_tokens": len(prompt), "new_tokens": n,
           "parameters": sum(p.numel() for p in target.parameters()),
           "bytes_per_step": nbytes, "memory_floor_ms": nbytes["total"] / (bw * 1e6),
           "variants": {}}
    res["models"][name]["result"] = out
    variants = out["variants"]
    floor = out["memory_floor_ms"]
    ours = {}

    def ours_graph(ops):
        rt = PackedTarget(target, ops)
        ar = GraphedAR(rt, max_len=n + 8)
        last = ar.prefill(prompt, record_last=compare_last)
        snap = ar.state.clone()
        ar.timed_generate(snap, root, n)                     # warm-up run
        runs = [ar.timed_generate(snap, root, n) for _ in range(repeats)]
        tokens = runs[0][0]
        if "tokens" not in ours:
            ours.update(tokens=tokens, last=last, rt=rt, snap=snap)
        v = timing([ms for _, ms in runs], n, nbytes["total"], floor)
        v.update(ops=rt.ops_note, fp32_logits=rt.head_fp32, graph=True,
                 deterministic=all(t == tokens for t, _ in runs))
        return v

    for ops in ("auto", "torch"):
        key = "ours_graph" if ops == "auto" else "ours_graph_torch_ops"
        print(f"[runtime] {name}: {key}", flush=True)
        guarded(variants, key, ours_graph, ops)
        res.save()

    def ours_eager():
        ar = GraphedAR(ours["rt"], max_len=n_eager + 2, use_graph=False)
        ar.timed_generate(ours["snap"], root, 2)
        runs = [ar.timed_generate(ours["snap"], root, n_eager)[1] for _ in range(repeats_eager)]
        return {**timing(runs, n_eager, nbytes["total"], floor), "graph": False, "ops": ours["rt"].ops_note}

    if "rt" in ours:
        print(f"[runtime] {name}: ours_eager", flush=True)
        guarded(variants, "ours_eager", ours_eager)
        res.save()

    fla = {}

    def fla_setup():
        ar = FlaAR(build_fla_model(target), max_len=n + 8)
        fla["prefill_logits"] = ar.prefill(prompt)
        fla["ar"] = ar
        return {"prefill": "fla forward in pieces of 64 tokens with its cache"}

    def fla_eager():
        ar = fla["ar"]
        ar.eager_generate(2)
        runs = [ar.eager_generate(n_eager) for _ in range(repeats_eager)]
        fla["eager_tokens"] = runs[0][0]
        return {**timing([ms for _, ms in runs], n_eager, nbytes["total"], floor), "graph": False}

    def fla_graph():
        ar = fla["ar"]
        mode = ar.capture()
        ar.graph_generate(n)
        runs = [ar.graph_generate(n) for _ in range(repeats)]
        fla["graph_tokens"] = runs[0][0]
        return {**timing([ms for _, ms in runs], n, nbytes["total"], floor), "graph": True,
                "capture": mode, "capture_errors": ar.capture_error,
                "deterministic": all(t == runs[0][0] for t, _ in runs)}

    print(f"[runtime] {name}: fla", flush=True)
    guarded(out, "fla_setup", fla_setup)
    if "ar" in fla:
        guarded(variants, "fla_eager", fla_eager)
        res.save()
        guarded(variants, "fla_graph", fla_graph)
        res.save()
        if "tokens" in ours:
            guarded(out, "correctness", runtime_correctness, fla, ours, prompt, n, compare_last)
    med = lambda key: (variants.get(key) or {}).get("ms_per_token", {}).get("median")  # noqa: E731
    out["speedups"] = {"ours_graph_vs_fla_graph": ratio(med("fla_graph"), med("ours_graph")),
                       "ours_graph_vs_fla_eager": ratio(med("fla_eager"), med("ours_graph")),
                       "fla_graph_vs_fla_eager": ratio(med("fla_eager"), med("fla_graph")),
                       "ours_fla_ops_vs_torch_ops": ratio(med("ours_graph_torch_ops"), med("ours_graph"))}
    res.save()
    return "ok"


def runtime_correctness(fla: dict, ours: dict, prompt: list[int], n: int, compare_last: int) -> dict:
    """Our logits vs fla's at the prompt's last positions, then our greedy tokens judged by fla
    teacher-forced on them: a divergence is excused only if fla's own logit gap between its
    pick and ours is within twice the measured logit difference (each logit moves by at most
    that much, so a flip needs gap <= 2 * diff)."""
    ours_last, fla_last = ours["last"], fla["prefill_logits"][-compare_last:]
    diff = ours_last - fla_last
    max_abs = float(diff.abs().max())
    out = {"compared_positions": compare_last, "max_abs_logit_diff": max_abs,
           "rel_logit_diff": float(diff.norm() / fla_last.norm()),
           "top1_agreement": float((ours_last.argmax(-1) == fla_last.argmax(-1)).float().mean())}
    tokens = ours["tokens"]
    rows = fla["ar"].full_logits(prompt + tokens[:-1])[len(prompt) - 1:]
    picks = rows.argmax(-1).tolist()
    threshold = 2 * max_abs
    divs = []
    for i, (mine, theirs) in enumerate(zip(tokens, picks)):
        if mine != theirs:
            gap = float(rows[i, theirs] - rows[i, mine])
            divs.append({"position": i, "ours": mine, "fla": theirs, "gap": gap, "excused": gap <= threshold})
    out.update(greedy_tokens=n, teacher_forced_divergences=divs, excuse_threshold=threshold,
               unexcused=sum(not d["excused"] for d in divs),
               rule="fla teacher-forced on our greedy tokens; excused if fla's gap <= 2 * max_abs_logit_diff")
    for key in ("graph_tokens", "eager_tokens"):
        if key in fla:
            theirs = fla[key]
            first = next((i for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b), None)
            out[f"first_divergence_vs_fla_{key.split('_')[0]}"] = first
    if "graph_tokens" in fla and "eager_tokens" in fla:
        e, g = fla["eager_tokens"], fla["graph_tokens"]
        out["fla_graph_equals_fla_eager_prefix"] = e == g[:len(e)]
    return out


# --------------------------------------------------------------------------- e2e suite

def oracle_topologies(quick: bool):
    from specla.tree import DraftTree

    chains = (8,) if quick else (4, 8, 16)
    trees = ((4, 16),) if quick else ((2, 16), (4, 16), (4, 32))
    out = [(f"chain-{b}", DraftTree.chain([0] * (b + 1))) for b in chains]
    out += [(f"tree-w{w}-b{b}", comb_tree(w, b)) for w, b in trees]
    return out


def suite_e2e(args, env, deadline: Deadline) -> dict:
    res = Results(args.out, "e2e", env)
    if args.device.type == "cuda":
        # the embedded pair first, capped, so the 1.3B oracle sweep keeps most of the time
        guarded(res.data, "pair_status", e2e_pair_gpu, args, res, deadline)
        res.save()
        free_cuda()
        if args.pair_only:
            res.data["oracle_status"] = "skipped (--pair-only)"
        else:
            guarded(res.data, "oracle_status", e2e_oracle_gpu, args, res, deadline)
    else:
        guarded(res.data, "pair_status", e2e_cpu, args, res, deadline)
    res.save()
    return res.data


def e2e_oracle_gpu(args, res: Results, deadline: Deadline) -> dict:
    """Oracle drafter at controlled acceptance on the GDN-1.3B public shape, all on device."""
    from specla.config import PUBLIC_1P3B

    config = small_config() if args.tiny else PUBLIC_1P3B
    n = args.tokens or (96 if args.quick else 256)
    repeats = args.repeats or 3
    alphas = (0.7, 0.9) if args.quick else (0.5, 0.6, 0.7, 0.8, 0.9)
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
        spec = GraphedSpec(rt, state, tree, mode="auto", deferred=deferred, oracle=oracle,
                              recurrence=args.recurrence, split_graphs=True)
        for alpha in alphas_here:
            if not deadline.ok(20):
                out["rows"].append({"name": name, "alpha": alpha, "skipped": "deadline"})
                continue
            row = {"name": name, "kind": "oracle", "topology": name, "nodes": len(tree),
                   "depth": tree.depth, "mode": spec.mode, "alpha": alpha, "deferred": deferred,
                   "capture_ms": spec.capture_ms}
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


def _hist(values) -> dict:
    out = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def drafter_settings(kind: str, drafter):
    """The draft shapes measured for each kind of trained drafter."""
    from specla.drafters.base import DraftSettings

    if kind in ("block", "lilicorr"):
        block = getattr(getattr(getattr(drafter, "net", None), "config", None), "block_size", 8) or 8
        return [("chain", DraftSettings(tree="chain", block_size=block, top_k=4, budget=block - 1)),
                ("best-first-10", DraftSettings(tree="best-first", block_size=block, top_k=4, budget=10)),
                ("best-first-16", DraftSettings(tree="best-first", block_size=block, top_k=4, budget=16))]
    return [("best-first-10", DraftSettings(tree="best-first", top_k=4, budget=10, depth=6)),
            ("best-first-16", DraftSettings(tree="best-first", top_k=4, budget=16, depth=6)),
            ("chain-6", DraftSettings(tree="chain", top_k=1, budget=6, depth=6))]


def load_pair(device, quick: bool, limit: int | None, drafters_dir: Path | None = None):
    """(target, tokenizer, {kind: drafter}, prompts as token lists, notes) or a skip reason."""
    from specla.checkpoint import load_model
    from specla.drafters import load_drafter

    target_dir = ROOT / "assets" / "target"
    if not (target_dir / "config.json").exists():
        return None, f"no embedded target at {target_dir}"
    target, tokenizer, _ = load_model(target_dir, device=device)
    if tokenizer is None:
        return None, f"{target_dir} has no tokenizer"
    drafters, notes = {}, []
    for folder in sorted(Path(drafters_dir or ROOT / "assets" / "drafters").glob("*")):
        if folder.is_dir():
            try:
                drafters[folder.name] = load_drafter(folder, target)
            except Exception as err:  # noqa: BLE001 - report the drafter, go on with the rest
                notes.append(f"{folder.name}: {type(err).__name__}: {err}")
    prompt_file = next((p for p in PROMPT_FILES if p.exists()), None)
    if prompt_file is None:
        return None, "no prompt file (data/corpus/heldout_prompts.jsonl or examples/prompts.jsonl)"
    from specla.acceptance import read_prompts

    texts = read_prompts(prompt_file, limit or (3 if quick else 8))
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    prompts = [p for p in prompts if len(p) >= 2]
    return (target, tokenizer, drafters, prompts, {"prompt_file": str(prompt_file.relative_to(ROOT)),
                                                   "drafter_notes": notes}), None


DEVICE_LABEL = "chain (device-graphed)"
COMPILED_LABEL = "chain (device-graphed, compiled)"   # the draft's ops fused by torch.compile
FUSED_SUFFIX = ", fused head"                           # LiLiCorr's head as one Triton kernel


def device_variants(kinds, compile_too: bool) -> list[tuple[str, bool, bool, str]]:
    """(kind, compiled, fused head, label) of the device-graphed rows: LiLiCorr with its head
    as torch ops and as the fused kernel, the block chain (the head share's baseline)."""
    out = []
    for compiled in (False, True) if compile_too else (False,):
        base = COMPILED_LABEL if compiled else DEVICE_LABEL
        # the block row first: every head share needs it
        for kind, fused in (("block", False), ("lilicorr", True), ("lilicorr", False)):
            if kind in kinds:
                out.append((kind, compiled, fused, base[:-1] + FUSED_SUFFIX + ")" if fused else base))
    return out


class PairReference:
    """The AR side of every pair row, per prompt and feature layers: the prefill (the drafters'
    features included), AR's greedy tokens and median ms/token (GraphedAR, this process), and
    the speculative-vs-AR logit noise (measured once) that excuses bf16 near-tie flips."""

    def __init__(self, rt, ar, prompts: list[list[int]], n: int, recurrence: str = "kernels"):
        self.rt, self.ar, self.prompts, self.n, self.recurrence = rt, ar, prompts, n, recurrence
        self.cache: dict = {}
        self._noise: float | None = None

    def __call__(self, i: int, feature_layers) -> tuple:
        """(prefill, AR tokens, AR ms/token) of prompt i."""
        key = (i, tuple(feature_layers))
        if key not in self.cache:
            prompt, n = self.prompts[i], self.n
            pre = self.rt.prefill(prompt, tuple(feature_layers))
            self.ar.timed_generate(pre[0], prompt[-1], n)                   # warm
            runs = [self.ar.timed_generate(pre[0], prompt[-1], n) for _ in range(3)]
            self.cache[key] = (pre, runs[0][0], statistics.median(ms for _, ms in runs) / n)
        return self.cache[key]

    def noise(self, i: int, feature_layers) -> float:
        if self._noise is None:

            pre, ref, _ = self(i, feature_layers)
            self._noise = spec_vs_ar_noise(self.rt, self.ar, pre[0], self.prompts[i][-1], ref, 16,
                                              self.recurrence)
        return self._noise


def device_chain_row(rt, drafter, settings, prompts: list[list[int]], n: int, ref: PairReference,
                     recurrence: str = "kernels", compile: bool = False, fused_head: bool = False) -> dict:
    """A trained block / LiLiCorr drafter drafting greedy chains on the device, inside the
    step graph (`specla.graphs.drafters`): each prompt decoded once to warm (the first only)
    and once timed against AR's tokens, then its steps replayed phase by phase for the GPU
    split (verify / accept + commit / draft)."""
    from specla.graphs.drafters import DeviceDraftDecoder

    dec = DeviceDraftDecoder(rt, drafter, settings, capacity=n + settings.block_size + 8,
                             recurrence=recurrence, split_graphs=True, compile=compile,
                             fused_head=fused_head)
    noise = ref.noise(0, dec.feature_layers)
    ar_ms, spec_ms, step_ms, readbacks, divs = [], [], [], [], []
    tokens, steps, split = 0, 0, {}
    for i, prompt in enumerate(prompts):
        pre, want, t_ar = ref(i, dec.feature_layers)
        if i == 0:
            dec.generate(prompt, n, prefilled=pre)                     # warm-up
        run = dec.generate(prompt, n, reference=want, prefilled=pre)
        ar_ms.append(t_ar)
        spec_ms.append(run.ms / len(run.tokens))
        step_ms.append(run.ms / run.steps)
        readbacks.append(dec.readbacks)
        tokens, steps = tokens + len(run.tokens), steps + run.steps
        for k, v in dec.phase_split(prompt, pre, run.steps).items():
            split[k] = split.get(k, 0.0) + v * run.steps
        if run.divergence:
            divs.append({"prompt": i, **run.divergence, "excused": run.divergence["gap"] <= 2 * noise})
    t_ar, t_spec = statistics.median(ar_ms), statistics.median(spec_ms)
    tau = tokens / steps
    split = {k: v / steps for k, v in split.items()}
    gpu_step = sum(split.values())
    return {"tokens": tokens, "target_forwards": steps, "tau": tau,
            "ms_per_token": stat(spec_ms), "tokens_per_s": stat([1e3 / x for x in spec_ms]),
            "ar_ms_per_token": stat(ar_ms), "speedup": t_ar / t_spec,
            # bound: the speedup if drafting, acceptance and commit cost nothing (verify only)
            "bound": tau * t_ar / split["verify"],
            "step_ms": stat(step_ms), "gpu_step_ms": gpu_step,
            # the phases as separate graphs; what the one-graph step spends beyond them
            # (launch, the few counter reads) is the rest of the measured step
            "time_split_ms_per_step": {**split, "launch_and_readbacks": statistics.median(step_ms) - gpu_step},
            "readbacks_per_decode": stat(readbacks), "graphs": 2, "capture_ms": dec.capture_ms,
            "exact": {"prompts": len(prompts), "diverging_prompts": len(divs),
                      "unexcused": sum(not d["excused"] for d in divs), "divergences": divs,
                      "excuse_threshold": 2 * noise}}


def device_head_share(rows: list[dict], label: str = DEVICE_LABEL, block_label: str | None = None) -> dict:
    """The LiLiCorr head's share of a graphed step: the LiLiCorr chain step (`label`) against
    the block chain step (`block_label`, default the same label): same block pass and
    verification, so the head (top-k, head, walk) is the difference."""
    block_label = block_label or label
    lil = next((r for r in rows if r.get("settings") == label and r.get("drafter") == "lilicorr"
                and "step_ms" in r), None)
    blk = next((r for r in rows if r.get("settings") == block_label and r.get("drafter") == "block"
                and "step_ms" in r), None)
    if lil is None or blk is None:
        return {"skipped": f"needs measured lilicorr '{label}' and block '{block_label}' rows"}
    l_ms, b_ms = lil["step_ms"]["median"], blk["step_ms"]["median"]
    l_draft, b_draft = (r["time_split_ms_per_step"]["draft"] for r in (lil, blk))
    return {"lilicorr_step_ms": l_ms, "block_step_ms": b_ms,
            "head_share_of_graphed_step": (l_ms - b_ms) / l_ms,
            "lilicorr_draft_ms": l_draft, "block_draft_ms": b_draft,
            "head_share_of_gpu_step": (l_draft - b_draft) / lil["gpu_step_ms"]}


HEAD_SHARES = [  # (result key, LiLiCorr row label), each against the block row of its kind
    ("lilicorr_head_device", DEVICE_LABEL),
    ("lilicorr_head_device_fused", DEVICE_LABEL[:-1] + FUSED_SUFFIX + ")"),
    ("lilicorr_head_device_compiled", COMPILED_LABEL),
    ("lilicorr_head_device_compiled_fused", COMPILED_LABEL[:-1] + FUSED_SUFFIX + ")"),
]


# launch options of the fused head timed beside its defaults (per-head attention, num_warps 8,
# the widest MLP block)
HEAD_KERNEL_VARIANTS = ({"num_warps": 4},)


def head_alone_cost(rt, drafter, settings, prompt: list[int], inner: int = 20, repeats: int = 30,
                    variants: tuple[dict, ...] = HEAD_KERNEL_VARIANTS) -> dict:
    """GPU ms of the LiLiCorr head's work in one device draft, on a real lattice (the block
    pass after `prompt`): the torch ops (top-k, head, walk, gather) against the fused kernels
    (top-k, then head + walk), next to the block chain's own pick (log_softmax + argmax) and the
    block pass. Each is captured `inner` times in one graph, so the per-call figure carries
    no replay launch; medians of `repeats` replays. `variants`: other launch options of the
    fused kernel (`FusedLiLiCorrHead`'s num_warps / mlp_block), timed the same way."""
    from kernels.triton_lilicorr import FusedLiLiCorrHead
    from specla.graphs.drafters import DeviceChainDrafter
    from specla.drafters.lilicorr import candidates, greedy_walk, lattice

    dev = DeviceChainDrafter.from_settings(drafter, settings, fused_head=True)
    dev.reset(rt.prefill(prompt, tuple(drafter.feature_layers))[1])
    root = torch.tensor([prompt[-1]], device=rt.device)
    with torch.no_grad():
        h, logits = dev.slot_logits(root)
        anchor = dev.ctx[-1:].clone()
        cand, cand_logp = candidates(logits, dev.top_k)

        def torch_head():
            c, _, start, pair = lattice(dev.parts, dev.net.head, logits, h, anchor, dev.top_k)
            return c.gather(-1, greedy_walk(start, pair)[..., None])

        calls = {"block_pass": lambda: dev.slot_logits(root),
                 "block_pick": lambda: torch.log_softmax(logits[0], dim=-1).argmax(-1),
                 "torch_head": torch_head,
                 "fused_head": lambda: dev.fused_head.draft(logits, h, anchor),
                 "fused_kernel_only": lambda: dev.fused_head(cand, cand_logp, h, anchor)}
        out = {"slots": dev.slots, "top_k": dev.top_k, "inner": inner, "repeats": repeats,
               "kernel_defaults": {"num_warps": dev.fused_head.num_warps, "mlp_block": dev.fused_head.mlp_block}}
        for options in variants:
            label = "fused_kernel_" + "_".join(f"{k}{v}" for k, v in options.items())
            try:
                fused = FusedLiLiCorrHead(dev.net.head, dev.slots, dev.top_k, dev.parts.embed_weight, **options)
                same = torch.equal(fused(cand, cand_logp, h, anchor)[2], dev.fused_head(cand, cand_logp, h, anchor)[2])
                out[f"{label}_walk_equal_to_default"] = same           # (the call also compiles it)
                calls[label] = lambda fused=fused: fused(cand, cand_logp, h, anchor)
            except Exception as err:  # noqa: BLE001 - a variant that does not build is a result
                out[f"{label}_ms"] = {"error": f"{type(err).__name__}: {err}"}
        for name, fn in calls.items():
            try:
                graph = capture(lambda fn=fn: [fn() for _ in range(inner)])
            except Exception as err:  # noqa: BLE001
                out[f"{name}_ms"] = {"error": f"{type(err).__name__}: {err}"}
                continue
            samples = []
            for _ in range(repeats):
                with Stopwatch(rt.device) as sw:
                    graph.replay()
                samples.append(sw.ms / inner)
            out[f"{name}_ms"] = stat(samples)
        ranks = dev.fused_head(cand, cand_logp, h, anchor)[2]
        _, _, start, pair = lattice(dev.parts, dev.net.head, logits, h, anchor, dev.top_k)
        out["walk_equal_to_torch_head"] = bool(torch.equal(ranks, greedy_walk(start, pair)))
    pick = out["block_pick_ms"]["median"]
    out["head_extra_torch_ms"] = out["torch_head_ms"]["median"] - pick
    out["head_extra_fused_ms"] = out["fused_head_ms"]["median"] - pick
    return out


# A LiLiCorr drafter sized for the GDN-1.3B shape: two layers at the target's width (DFlash
# drafts with a few target-width layers) and the embedded drafter's head (width 128, 2 layers,
# a 7 x 8 lattice); `--tiny`: a CPU-sized one for the tests
SCALE_DRAFTER = {"width": 2048, "heads": 16, "layers": 2, "mlp_hidden": 5632, "window": 64,
                 "head": {"width": 128, "heads": 4, "layers": 2, "mlp_hidden": 256}}
TINY_DRAFTER = {"width": 32, "heads": 2, "layers": 1, "mlp_hidden": 64, "window": 8,
                "head": {"width": 32, "heads": 2, "layers": 1, "mlp_hidden": 64}}
SCALE_BLOCK = 8
HEAD_FUSED_LABEL = DEVICE_LABEL[:-1] + FUSED_SUFFIX + ")"


def suite_head(args, env, deadline: Deadline) -> dict:
    """The LiLiCorr head's share of a decoding step next to a GDN-1.3B-shape target (random
    bf16 weights: the time of a step does not depend on them). One LiLiCorr drafter sized for
    that target drafts device-graphed chains three ways: its top-1 chain (the block drafter's:
    same block pass and verification, no head), with the head fused, and with the head as
    torch ops; each share is the step difference over the LiLiCorr step (`device_head_share`).
    Random drafts are rarely accepted, so tau is ~1; a chain step's cost does not depend on it
    (static shapes: every step verifies the whole chain). The lattice is 7 slots x
    `--head-top-k` (default 4, the setting of the measured LiLiCorr chains)."""
    from specla.config import PUBLIC_1P3B
    from specla.drafters import new_drafter
    from specla.drafters.base import DraftSettings

    res = Results(args.out, "head", env)
    if args.head_top_k < 2:
        res["error"] = f"--head-top-k {args.head_top_k}: a LiLiCorr lattice needs at least 2 candidates a slot"
        return res.data
    cuda = args.device.type == "cuda"
    if not (cuda or args.tiny):
        res["skipped"] = "the head suite times CUDA graphs: it needs a GPU (--tiny runs it eagerly on the CPU)"
        return res.data
    config = small_config() if args.tiny else PUBLIC_1P3B
    shape = TINY_DRAFTER if args.tiny else SCALE_DRAFTER
    n = args.tokens or (16 if args.tiny else 64)
    count = args.prompts or 2
    dtype = torch.bfloat16 if cuda else torch.float32
    res.data.update(config=dataclasses.asdict(config), drafter=shape, block_size=SCALE_BLOCK,
                    top_k=args.head_top_k, new_tokens=n, prompts=count, prompt_tokens=args.prompt_len, rows=[])
    print(f"[head] building the random {config.hidden_size}-wide target and its LiLiCorr drafter", flush=True)
    target = random_gdn(config, args.device, dtype, seed=args.seed)
    torch.manual_seed(args.seed)
    drafter = new_drafter("lilicorr", target, block_size=SCALE_BLOCK, top_k=max(args.head_top_k, 8),
                          **{k: dict(v) if isinstance(v, dict) else v for k, v in shape.items()})
    res["drafter_params"] = sum(p.numel() for p in drafter.net.parameters())
    res["head_params"] = sum(p.numel() for p in drafter.net.head.parameters())
    prompts = [random_prompt(config.vocab_size, args.prompt_len, args.seed + i) for i in range(count)]
    rt = PackedTarget(target, args.ops)
    res["ops"] = rt.ops_note
    ref = PairReference(rt, GraphedAR(rt, max_len=n + 64), prompts, n, args.recurrence)
    chain = DraftSettings(tree="chain", block_size=SCALE_BLOCK, top_k=args.head_top_k, budget=SCALE_BLOCK - 1)
    if cuda:
        guarded(res.data, "head_alone", head_alone_cost, rt, drafter, chain, prompts[0])
        res.save()
    variants = [("block", dataclasses.replace(chain, top_k=1), False, DEVICE_LABEL),
                ("lilicorr", chain, False, DEVICE_LABEL)]
    if cuda:
        variants.insert(1, ("lilicorr", chain, True, HEAD_FUSED_LABEL))
    for kind, settings, fused, label in variants:
        row = {"name": f"{kind}/{label}", "kind": "drafter", "drafter": kind, "settings": label,
               "draft_settings": dataclasses.asdict(settings)}
        if not deadline.ok(30):
            res["rows"].append({**row, "skipped": "deadline"})
            continue
        guarded(row, "result", device_chain_row, rt, drafter, settings, prompts, n, ref, args.recurrence,
                False, fused)
        if isinstance(row["result"], dict) and "error" not in row["result"]:
            row.update(row.pop("result"))
            print(f"[head] {row['name']}: step {row['step_ms']['median']:.3f} ms", flush=True)
        res["rows"].append(row)
        res.save()
    for key, label in (("share_fused", HEAD_FUSED_LABEL), ("share_torch", DEVICE_LABEL)):
        if cuda or label == DEVICE_LABEL:
            guarded(res.data, key, device_head_share, res["rows"], label, DEVICE_LABEL)
    res.save()
    return res.data


def e2e_pair_gpu(args, res: Results, deadline: Deadline) -> dict:
    """The embedded target with each trained drafter: first block and LiLiCorr chains drafted
    on the device inside the step graph, then every drafter eager between graph replays."""

    loaded, skip = load_pair(args.device, args.quick, args.prompts, args.drafters)
    if loaded is None:
        res.data["pair"] = {"skipped": skip}
        return "skipped"
    target, _, drafters, prompts, notes = loaded
    n = args.tokens or (64 if args.quick else 128)
    out = res.data["pair"] = {"new_tokens": n, "prompts": len(prompts), **notes, "rows": []}
    if not drafters:
        out["skipped"] = "no loadable drafters in assets/drafters"
        return "skipped"
    rt = PackedTarget(target, args.ops)
    out["ops"] = rt.ops_note
    ar = GraphedAR(rt, max_len=n + 64)
    # the pair's own budget starts after the set-up (its Triton compiles are not a variant)
    deadline = Deadline(min(deadline.left(), args.pair_budget))
    ar_for = PairReference(rt, ar, prompts, n, args.recurrence)

    # the device-graphed chains first: they are what a 13M target can gain from
    compile_too = getattr(args, "compile_drafter", False)
    if "lilicorr" in drafters:
        guarded(out, "lilicorr_head_alone", head_alone_cost, rt, drafters["lilicorr"],
                dict(drafter_settings("lilicorr", drafters["lilicorr"]))["chain"], prompts[0])
        res.save()
    for kind, compiled, fused, label in device_variants(drafters, compile_too):
        settings = dict(drafter_settings(kind, drafters[kind]))["chain"]
        row = {"name": f"{kind}/{label}", "kind": "drafter", "drafter": kind,
               "settings": label, "draft_settings": dataclasses.asdict(settings)}
        if not deadline.ok(30):
            out["rows"].append({**row, "skipped": "deadline"})
            continue
        guarded(row, "result", device_chain_row, rt, drafters[kind], settings, prompts, n, ar_for,
                args.recurrence, compiled, fused)
        if isinstance(row["result"], dict) and "error" not in row["result"]:
            row.update(row.pop("result"))
            print(f"[e2e] {row['name']}: tau {row['tau']:.2f}, {row['ms_per_token']['median']:.3f} ms/token, "
                  f"speedup {row['speedup']:.2f}x", flush=True)
        out["rows"].append(row)
        res.save()
    for key, label in HEAD_SHARES:
        if label.startswith(COMPILED_LABEL[:-1]) and not compile_too:
            continue
        guarded(out, key, device_head_share, out["rows"], label,
                COMPILED_LABEL if label.startswith(COMPILED_LABEL[:-1]) else DEVICE_LABEL)
    res.save()
    if getattr(args, "device_rows_only", False):
        return "ok"
    # LiLiCorr first (its head cost is measured after its rows), EAGLE last: its eager tree
    # drafting is the slowest, the deadline should cut it first
    for kind, drafter in sorted(drafters.items(), key=lambda item: (item[0] == "eagle", item[0] != "lilicorr")):
        for label, settings in drafter_settings(kind, drafter):
            if not deadline.ok(30):
                out["rows"].append({"drafter": kind, "settings": label, "skipped": "deadline"})
                continue
            row = {"name": f"{kind}/{label}", "kind": "drafter", "drafter": kind, "settings": label,
                   "draft_settings": dataclasses.asdict(settings)}

            def measure():
                max_path = max_path_for(settings.budget)
                dec = GraphedDecoder(rt, drafter, settings, max_path=max_path, capacity=n + max_path + 8,
                                        recurrence=args.recurrence)
                ar_ms, spec_ms, tokens, steps, divs, phases = [], [], 0, 0, [], {}
                for i in range(len(prompts)):
                    pre, ref, t_ar = ar_for(i, drafter.feature_layers)
                    noise = ar_for.noise(i, drafter.feature_layers)
                    if i == 0:
                        dec.generate(prompts[i], n, prefilled=pre)        # warm-up: captures, compiles
                    run = dec.generate(prompts[i], n, reference=ref, prefilled=pre)
                    ar_ms.append(t_ar)
                    spec_ms.append(run.ms / len(run.tokens))
                    tokens += len(run.tokens)
                    steps += run.steps
                    for k, v in run.phases_ms.items():
                        phases[k] = phases.get(k, 0.0) + v
                    if run.divergence:
                        divs.append({"prompt": i, **run.divergence,
                                     "excused": run.divergence["gap"] <= 2 * noise})
                t_ar, t_spec = statistics.median(ar_ms), statistics.median(spec_ms)
                tau = tokens / steps
                t_graph = phases["graph"] / steps          # verify + accept + the readback
                return {"tokens": tokens, "target_forwards": steps, "tau": tau,
                        "ms_per_token": stat(spec_ms), "tokens_per_s": stat([1e3 / x for x in spec_ms]),
                        "ar_ms_per_token": stat(ar_ms), "speedup": t_ar / t_spec,
                        "bound": tau * t_ar / t_graph,
                        "time_split_ms_per_step": {k: v / steps for k, v in phases.items()},
                        "graphs": len(dec.specs), "capture_ms": dec.capture_ms,
                        "exact": {"prompts": len(prompts), "diverging_prompts": len(divs),
                                  "unexcused": sum(not d["excused"] for d in divs), "divergences": divs,
                                  "excuse_threshold": 2 * noise}}

            guarded(row, "result", measure)
            if isinstance(row["result"], dict) and "error" not in row["result"]:
                row.update(row.pop("result"))
            out["rows"].append(row)
            res.save()
        if kind == "lilicorr":
            guarded(out, "lilicorr_head", lilicorr_head_overhead, drafter, out["rows"])
            res.save()
    return "ok"


def lilicorr_head_overhead(drafter, rows: list[dict]) -> dict:
    """The head's GPU time as a share of a LiLiCorr chain step: of the step as measured (the
    drafter runs eagerly between graph replays, so the step is mostly launch overhead), and
    of the step as it would be with every part graph-replayed (block pass + head + the
    target's verify/accept graph)."""
    from specla.drafters.base import DraftSettings

    row = next((r for r in rows if r.get("drafter") == "lilicorr" and "tau" in r
                and r.get("settings") == "chain"), None)
    if row is None:
        return {"skipped": "no measured lilicorr/chain row"}
    settings = DraftSettings(**row["draft_settings"])
    cost = lilicorr_head_cost(drafter, settings)
    step_ms = row["tau"] * row["ms_per_token"]["median"]
    cost["measured_step_ms"] = step_ms
    for how in ("graph", "eager"):
        if f"head_{how}_ms" in cost:
            cost[f"head_{how}_share_of_measured_step"] = cost[f"head_{how}_ms"]["median"] / step_ms
    target_graph = row.get("time_split_ms_per_step", {}).get("graph")
    if target_graph is not None and "head_graph_ms" in cost:
        graphed = cost["block_pass_graph_ms"]["median"] + cost["head_graph_ms"]["median"] + target_graph
        cost.update(graphed_step_ms=graphed,
                    head_share_of_graphed_step=cost["head_graph_ms"]["median"] / graphed)
    return cost


def lilicorr_head_cost(drafter, settings, repeats: int = 50) -> dict:
    """GPU ms of the LiLiCorr head's own work in one draft step (top-k of the slot logits,
    the lattice transformer, all pair scores) next to the block pass it rides on, both
    eager and as CUDA-graph replays, timed with events over `repeats` calls after warm-up."""
    from specla.drafters.lilicorr import lattice

    dev = drafter.ctx.device
    S, k = settings.block_size - 1, settings.top_k
    if len(drafter.ctx) == 0:
        raise ValueError("the drafter has no context yet: run it on a prompt first")
    root = torch.tensor([1], device=dev)
    with torch.no_grad():
        h, logits = drafter.net(drafter.parts, root, drafter.ctx[None])
    h, logits = h[:, :S].contiguous(), logits[:, :S].contiguous()
    anchor = drafter.ctx[-1:]
    calls = {"block_pass": lambda: drafter.net(drafter.parts, root, drafter.ctx[None]),
             "head": lambda: lattice(drafter.parts, drafter.net.head, logits, h, anchor, k)}
    out = {"slots": S, "top_k": k, "repeats": repeats}
    with torch.no_grad():
        for name, fn in calls.items():
            for _ in range(5):
                fn()
            samples = []
            for _ in range(repeats):
                with Stopwatch(dev) as sw:
                    fn()
                samples.append(sw.ms)
            out[f"{name}_eager_ms"] = stat(samples)
            if dev.type != "cuda":
                continue
            graph = capture(fn)
            samples = []
            for _ in range(repeats):
                with Stopwatch(dev) as sw:
                    graph.replay()
                samples.append(sw.ms)
            out[f"{name}_graph_ms"] = stat(samples)
    return out


def e2e_cpu(args, res: Results, deadline: Deadline) -> dict:
    """The eager loop (specla.decode) on the CPU: the embedded pair, or a tiny random target
    with the oracle drafter (`--tiny`, or when the assets are absent)."""
    loaded, skip = (None, "--tiny") if args.tiny else load_pair(args.device, args.quick, args.prompts, args.drafters)
    if loaded is None:
        out = e2e_cpu_tiny(args, res, deadline)
        out["why_tiny"] = skip
        return "ok"
    target, _, drafters, prompts, notes = loaded
    n = args.tokens or (64 if args.quick else 128)
    out = res.data["pair"] = {"new_tokens": n, "prompts": len(prompts), "device": "cpu", **notes, "rows": []}
    if not drafters:
        out["skipped"] = "no loadable drafters in assets/drafters"
        return "skipped"
    for kind, drafter in drafters.items():
        for label, settings in drafter_settings(kind, drafter):
            if not deadline.ok(10):
                out["rows"].append({"drafter": kind, "settings": label, "skipped": "deadline"})
                continue
            row = {"name": f"{kind}/{label}", "kind": "drafter", "drafter": kind, "settings": label,
                   "draft_settings": dataclasses.asdict(settings)}
            guarded(row, "result", eager_pair_row, target, prompts, lambda i, ref, d=drafter: d,
                    settings, n, args.repeats or (1 if args.quick else 3))
            if isinstance(row["result"], dict) and "error" not in row["result"]:
                row.update(row.pop("result"))
            out["rows"].append(row)
            res.save()
    return "ok"


def e2e_cpu_tiny(args, res: Results, deadline: Deadline) -> dict:
    from specla.config import GDNConfig
    from specla.drafters.base import DraftSettings
    from specla.drafters.oracle import OracleDrafter

    config = GDNConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=2,
                       head_dim=32, expand_v=1.0)
    target = random_gdn(config, "cpu", torch.float32, seed=args.seed)
    n = args.tokens or (32 if args.quick else 64)
    k = args.prompts or (2 if args.quick else 4)
    prompts = [random_prompt(config.vocab_size, 24, args.seed + i) for i in range(k)]
    alphas = (0.8,) if args.quick else (0.6, 0.9)
    shapes = [("chain-4", "chain", DraftSettings(budget=4))] + (
        [] if args.quick else [("chain-8", "chain", DraftSettings(budget=8))]) + [
        ("tree-w2-b8", "tree", DraftSettings(budget=8, top_k=2))]
    out = res.data["pair"] = {"new_tokens": n, "prompts": len(prompts), "device": "cpu",
                              "target": "tiny random (oracle drafter)", "config": dataclasses.asdict(config),
                              "rows": []}
    for label, shape, settings in shapes:
        for alpha in alphas:
            if not deadline.ok(5):
                out["rows"].append({"name": f"oracle/{label}", "alpha": alpha, "skipped": "deadline"})
                continue
            row = {"name": f"oracle/{label}", "kind": "oracle", "drafter": "oracle", "settings": label,
                   "alpha": alpha}

            def make(i, ref, alpha=alpha, shape=shape):
                return OracleDrafter(ref + [0] * 64, config.vocab_size, alpha=alpha, seed=i, shape=shape)

            guarded(row, "result", eager_pair_row, target, prompts, make, settings, n)
            if isinstance(row["result"], dict) and "error" not in row["result"]:
                row.update(row.pop("result"))
            out["rows"].append(row)
            res.save()
    return out


class _StartClock:
    """Wraps a drafter to note when decoding starts: the first propose comes right after the
    prefill, so spec time and AR time (`ar_generate` also excludes its prefill) compare."""

    def __init__(self, drafter):
        self.drafter, self.start = drafter, None
        self.name, self.feature_layers = drafter.name, drafter.feature_layers

    def reset(self, *a):
        self.drafter.reset(*a)

    def propose(self, ctx):
        if self.start is None:
            self.start = time.perf_counter()
        return self.drafter.propose(ctx)

    def observe(self, accepted):
        self.drafter.observe(accepted)


def eager_pair_row(target, prompts, make_drafter, settings, n: int, repeats: int = 1) -> dict:
    """AR and speculative decoding of every prompt through specla.decode (the eager loop).

    Each prompt is decoded `repeats` times, AR and speculation alternating, and each side keeps
    its fastest run: on a shared CPU a neighbour's burst slows single runs by 20% or more, and
    alternating puts AR and speculation under the same drift.
    """
    from specla.decode import DecodeSettings, ar_generate, speculative_steps

    ar_ms, spec_ms, tokens, steps, mismatches = [], [], 0, 0, []
    phases: dict[str, float] = {}
    # warm-up, not recorded: first calls pay for allocations and lazy imports
    warm = DecodeSettings(max_new_tokens=min(n, 8), mode="auto", deferred=True)
    ref = ar_generate(target, prompts[0], warm).tokens
    for _ in speculative_steps(target, make_drafter(0, ref), prompts[0], warm, dataclasses.replace(settings)):
        pass
    for i, prompt in enumerate(prompts):
        ds = DecodeSettings(max_new_tokens=n, mode="auto", deferred=True)
        best_ar = best_spec = None
        for _ in range(max(1, repeats)):
            ar = ar_generate(target, prompt, ds)
            best_ar = min(best_ar or ar.seconds, ar.seconds)
            drafter = _StartClock(make_drafter(i, ar.tokens))
            records = list(speculative_steps(target, drafter, prompt, ds, dataclasses.replace(settings)))
            wall = 1e3 * (time.perf_counter() - drafter.start)
            if best_spec is None or wall < best_spec[0]:
                best_spec = (wall, records)
        wall, records = best_spec
        out = [t for r in records for t in r.new_tokens]
        ar_ms.append(1e3 * best_ar / len(ar.tokens))
        spec_ms.append(wall / len(out))
        tokens += len(out)
        steps += len(records)
        for r in records:
            for k, v in r.times_ms.items():
                phases[k] = phases.get(k, 0.0) + v
        phases["host_other"] = phases.get("host_other", 0.0) + wall - sum(
            sum(r.times_ms.values()) for r in records)
        if out != ar.tokens:
            first = next((j for j, (a, b) in enumerate(zip(out, ar.tokens)) if a != b), None)
            mismatches.append({"prompt": i, "first_mismatch": first})
    t_ar, t_spec = statistics.median(ar_ms), statistics.median(spec_ms)
    tau = tokens / steps
    return {"tokens": tokens, "target_forwards": steps, "tau": tau, "repeats": max(1, repeats),
            "ms_per_token": stat(spec_ms), "tokens_per_s": stat([1e3 / x for x in spec_ms]),
            "ar_ms_per_token": stat(ar_ms), "speedup": t_ar / t_spec,
            "bound": tau * t_ar / (phases.get("verify", 0.0) / steps) if phases.get("verify") else None,
            "time_split_ms_per_step": {k: v / steps for k, v in phases.items()},
            "exact": {"prompts": len(prompts), "mismatching_prompts": len(mismatches),
                      "mismatches": mismatches}}


# --------------------------------------------------------------------------- kernels, acceptance

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


# --------------------------------------------------------------------------- report

def render(out: Path) -> Path:
    """report.md (and report.html if plotly imports) from the suite JSON files in `out`."""
    data = {}
    for name in ("runtime", "e2e", "head", "kernels_run", "acceptance"):
        path = out / f"{name}.json"
        if path.exists():
            data[name] = json.loads(path.read_text())
    lines = ["# SpecLA benchmark report", ""]
    env = next((d.get("environment") for d in data.values() if d.get("environment")), {})
    if env:
        git = env.get("git") or {}
        lines += [f"- device: {env.get('gpu') or env.get('device')} ({env.get('device')})",
                  f"- torch {env.get('torch')}, triton {env.get('triton')}, fla {env.get('fla')}, "
                  f"transformers {env.get('transformers')}, python {env.get('python')}",
                  f"- commit {git.get('commit')} (dirty: {git.get('dirty')})",
                  f"- command: `{env.get('command')}`", f"- date: {env.get('date')}", ""]
    lines += ["Timings: median (min-max, n=runs). Speedups are ratios of medians from one process.", ""]
    if "runtime" in data:
        lines += _md_runtime(data["runtime"])
    if "e2e" in data:
        lines += _md_e2e(data["e2e"])
    if "head" in data:
        lines += _md_head(data["head"])
    if "kernels_run" in data:
        k = data["kernels_run"]
        lines += ["## Kernels", "", k.get("skipped") or f"`{k.get('command')}`: return code "
                  f"{k.get('returncode')}, {num(k.get('seconds'), 0)} s; files: {', '.join(k.get('files', []))} "
                  "(see kernels.json, verify_cost.json)", ""]
    if "acceptance" in data:
        lines += _md_acceptance(data["acceptance"])
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    _html(out, data)
    return path


def _md_runtime(r: dict) -> list[str]:
    lines = ["## Runtime: AR decode, ours vs fla", ""]
    if r.get("skipped"):
        return lines + [r["skipped"], ""]
    bw = r.get("copy_bandwidth_GBps")
    lines += [f"Device copy bandwidth: {fmt(bw, 0)} GB/s (read + write).", ""]
    for name, m in (r.get("models") or {}).items():
        m = m.get("result", m)
        if "error" in m or "skipped" in m:
            lines += [f"### {name}", "", f"{m.get('error') or m.get('skipped')}", ""]
            continue
        lines += [f"### {name}: {m.get('parameters', 0) / 1e6:.0f}M parameters, prompt {m.get('prompt_tokens')}, "
                  f"{m.get('new_tokens')} new tokens", "",
                  f"Memory floor {num(m.get('memory_floor_ms'))} ms/token "
                  f"({m['bytes_per_step']['total'] / 1e9:.3f} GB per step at the measured copy rate).", "",
                  "| variant | ms/token | tokens/s | GB/s | floor / time |", "|---|---|---|---|---|"]
        for key, v in m.get("variants", {}).items():
            if "error" in v:
                lines.append(f"| {key} | failed: {v['error'][:80]} | | | |")
                continue
            lines.append(f"| {key} | {fmt(v['ms_per_token'])} | {fmt(v['tokens_per_s'], 0)} | "
                         f"{num(v.get('achieved_GBps'), 0)} | {num(v.get('fraction_of_floor'), 2)} |")
        s = m.get("speedups", {})
        lines += ["", "Speedups: " + ", ".join(f"{k} {num(v, 2)}x" for k, v in s.items()), ""]
        c = m.get("correctness")
        if isinstance(c, dict) and "error" not in c:
            lines += [f"Correctness: logits at the last {c['compared_positions']} prompt positions differ by "
                      f"max {c['max_abs_logit_diff']:.4f} (relative {c['rel_logit_diff']:.2e}, top-1 agreement "
                      f"{c['top1_agreement']:.3f}); {c['greedy_tokens']} greedy tokens, fla teacher-forced: "
                      f"{len(c['teacher_forced_divergences'])} divergences, {c['unexcused']} not excused "
                      f"(gap > {c['excuse_threshold']:.4f}); first free-running divergence vs fla graph: "
                      f"{c.get('first_divergence_vs_fla_graph')}.", ""]
    return lines


def _md_e2e(e: dict) -> list[str]:
    lines = ["## End to end", ""]
    o = e.get("oracle")
    if isinstance(o, dict) and o.get("rows") is not None:
        lines += [f"### Oracle drafter, {o['config'].get('hidden_size')}-wide {o['config'].get('num_hidden_layers')}"
                  f"-layer target, {o['new_tokens']} tokens, ops: {o.get('ops')}", "",
                  f"AR (GraphedAR): {fmt(o.get('ar', {}).get('ms_per_token'))} ms/token; after the sweep "
                  f"{fmt((o.get('ar_after') or {}).get('ms_per_token'))}.", "",
                  "| topology | mode | alpha | tau | ms/token | speedup | bound | verify / accept+commit / draft / gaps (ms/step) | exact |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in o["rows"]:
            lines.append(_md_row(r))
        lines.append("")
    elif isinstance(o, dict) and o.get("error"):
        lines += ["### Oracle drafter", "", f"failed: {o['error']}", ""]
    p = e.get("pair")
    if isinstance(p, dict):
        lines += [f"### {'Trained drafters' if p.get('rows') and p['rows'][0].get('kind') == 'drafter' else 'Pair'}"
                  f" ({p.get('device', 'cuda')}, {p.get('prompts')} prompts, {p.get('new_tokens')} tokens)", ""]
        if p.get("skipped") or p.get("error"):
            lines += [str(p.get("skipped") or p.get("error")), ""]
        else:
            lines += ["| drafter / settings | alpha | tau | ms/token | AR ms/token | speedup | split (ms/step) | exact |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in p.get("rows", []):
                if "tau" not in r:
                    name = r.get('name') or f"{r.get('drafter')}/{r.get('settings')}"
                    lines.append(f"| {name} | {r.get('alpha', '')} | {r.get('skipped') or (r.get('result') or {}).get('error', '')} | | | | | |")
                    continue
                split = ", ".join(f"{k} {v:.3f}" for k, v in r["time_split_ms_per_step"].items())
                ex = r["exact"]
                bad = ex.get("mismatching_prompts", ex.get("unexcused"))
                lines.append(f"| {r['name']} | {r.get('alpha', '')} | {r['tau']:.2f} | {fmt(r['ms_per_token'])} | "
                             f"{fmt(r['ar_ms_per_token'])} | {r['speedup']:.2f}x | {split} | "
                             f"{bad} bad of {ex['prompts']} |")
            head = p.get("lilicorr_head") or {}
            if "head_graph_ms" in head:
                lines += ["", f"LiLiCorr head (top-{head['top_k']} x {head['slots']} slots), CUDA graph: "
                          f"{fmt(head['head_graph_ms'])} ms; block pass {fmt(head['block_pass_graph_ms'])} ms; "
                          f"share of a fully graphed step {num(head.get('head_share_of_graphed_step'))}, "
                          f"of the measured step {num(head.get('head_graph_share_of_measured_step'))}."]
            alone = p.get("lilicorr_head_alone") or {}
            if "torch_head_ms" in alone:
                lines += ["", f"LiLiCorr head alone (top-{alone['top_k']} x {alone['slots']} slots, each call "
                          f"{alone['inner']}x in one CUDA graph): torch ops {fmt(alone['torch_head_ms'])} ms, "
                          f"fused kernel with top-k {fmt(alone['fused_head_ms'])} ms (kernel only "
                          f"{fmt(alone['fused_kernel_only_ms'])}), the block chain's pick {fmt(alone['block_pick_ms'])} ms, "
                          f"block pass {fmt(alone['block_pass_ms'])} ms."]
            for key, how in (("lilicorr_head_device", "device-graphed"),
                             ("lilicorr_head_device_fused", "device-graphed, fused head"),
                             ("lilicorr_head_device_compiled", "device-graphed, compiled"),
                             ("lilicorr_head_device_compiled_fused", "device-graphed, compiled, fused head")):
                dev = p.get(key) or {}
                if "head_share_of_graphed_step" in dev:
                    lines += ["", f"LiLiCorr head inside the {how} step: LiLiCorr chain step "
                              f"{num(dev['lilicorr_step_ms'])} ms, block chain step {num(dev['block_step_ms'])} ms, "
                              f"head share {num(dev['head_share_of_graphed_step'])} (from the GPU draft "
                              f"phases, {num(dev['lilicorr_draft_ms'])} vs {num(dev['block_draft_ms'])} ms: "
                              f"{num(dev['head_share_of_gpu_step'])} of the GPU step)."]
            lines.append("")
    return lines + _md_targets(e)


# issue #6's targets, all at temperature 0 and exact: the 1.3B shape with the oracle drafter at
# acceptance 0.8, and the embedded pair with its best real drafter on the H200 and the CPU
TARGETS = {"oracle": 2.5, "pair_cuda": 2.5, "pair_cpu": 1.5}


def _exact(r: dict) -> bool:
    ex = r.get("exact") or {}
    return ex.get("mismatching_prompts", ex.get("unexcused", 1)) == 0


def targets(e: dict) -> list[dict]:
    """Each target against the best exact row that it applies to: met or missed by how much,
    the row's time split, and the speedup it would have if drafting cost nothing (tau x t_AR
    over the step without its draft phase), which says whether a better drafter could meet it."""
    out = []
    o, p = e.get("oracle") or {}, e.get("pair") or {}
    groups = [("oracle", "1.3B shape, oracle drafter at alpha 0.8",
               [r for r in o.get("rows") or [] if r.get("alpha") == 0.8]),
              (f"pair_{p.get('device', 'cuda')}", f"embedded pair, best real drafter ({p.get('device', 'cuda')})",
               p.get("rows") or [])]
    for key, what, rows in groups:
        rows = [r for r in rows if "speedup" in r and _exact(r)]
        if not rows or key not in TARGETS:
            continue
        best = max(rows, key=lambda r: r["speedup"])
        split = best["time_split_ms_per_step"]
        no_draft = sum(v for k, v in split.items() if k != "draft")
        t_ar = best["ar_ms_per_token"]
        t_ar = t_ar["median"] if isinstance(t_ar, dict) else t_ar     # the oracle rows keep one AR figure
        goal = TARGETS[key]
        out.append({"target": key, "what": what, "goal": goal, "row": best.get("name"),
                    "speedup": best["speedup"], "met": best["speedup"] >= goal,
                    "missed_by": None if best["speedup"] >= goal else goal / best["speedup"],
                    "split_ms_per_step": split,
                    "free_draft_bound": best["tau"] * t_ar / no_draft if no_draft > 0 else None})
    return out


def _md_targets(e: dict) -> list[str]:
    found = targets(e)
    if not found:
        return []
    lines = ["### Targets (exact rows only)", ""]
    for t in found:
        split = ", ".join(f"{k} {v:.3f}" for k, v in t["split_ms_per_step"].items())
        verdict = "met" if t["met"] else f"missed by a factor of {t['missed_by']:.2f}"
        lines.append(f"- {t['what']}: target {t['goal']}x, best {t['speedup']:.2f}x ({t['row']}), {verdict}. "
                     f"Its step (ms): {split}; with a free draft it would make {num(t['free_draft_bound'], 2)}x.")
    return lines + [""]


def _md_head(h: dict) -> list[str]:
    lines = ["## The LiLiCorr head's share of a decoding step at scale", ""]
    if h.get("skipped") or h.get("error"):
        return lines + [str(h.get("skipped") or h.get("error")), ""]
    c, d = h.get("config") or {}, h.get("drafter") or {}
    lines += [f"Target {c.get('hidden_size')} wide, {c.get('num_hidden_layers')} layers, random weights; "
              f"drafter {d.get('layers')} layers x {d.get('width')} ({h.get('drafter_params')} params) with a "
              f"width-{(d.get('head') or {}).get('width')} head ({h.get('head_params')} params) over a "
              f"{h.get('block_size', 0) - 1} x {h.get('top_k')} lattice; {h.get('prompts')} prompts x "
              f"{h.get('new_tokens')} tokens, every chain step device-graphed.", "",
              "| row | step ms | GPU step ms | draft ms | exact |", "|---|---|---|---|---|"]
    for r in h.get("rows") or []:
        if "step_ms" not in r:
            lines.append(f"| {r.get('name')} | {r.get('skipped') or (r.get('result') or {}).get('error', '')} | | | |")
            continue
        bad = r["exact"].get("unexcused")
        lines.append(f"| {r['name']} | {fmt(r['step_ms'])} | {num(r['gpu_step_ms'])} | "
                     f"{num(r['time_split_ms_per_step']['draft'])} | {bad} bad of {r['exact']['prompts']} |")
    lines.append("")
    for key, how in (("share_fused", "fused"), ("share_torch", "as torch ops")):
        s = h.get(key) or {}
        if "head_share_of_graphed_step" in s:
            lines.append(f"- Head {how}: {num(s['head_share_of_graphed_step'])} of the step "
                         f"({num(s['lilicorr_step_ms'])} vs {num(s['block_step_ms'])} ms); from the GPU "
                         f"draft phases {num(s['head_share_of_gpu_step'])}.")
    alone = h.get("head_alone") or {}
    if "fused_kernel_only_ms" in alone:
        variants = ", ".join(f"{k[len('fused_kernel_'):-3]} {fmt(v)}" for k, v in alone.items()
                             if k.startswith("fused_kernel_") and k != "fused_kernel_only_ms"
                             and isinstance(v, dict) and "median" in v)
        lines.append(f"- Head alone, in one graph: torch ops {fmt(alone['torch_head_ms'])} ms, fused with top-k "
                     f"{fmt(alone['fused_head_ms'])} ms, kernels only {fmt(alone['fused_kernel_only_ms'])} ms "
                     f"({alone.get('kernel_defaults')}); other launch options: {variants or 'none'}.")
    return lines + [""]


def _md_row(r: dict) -> str:
    if "tau" not in r:
        why = r.get("skipped") or (r.get("result") or {}).get("error", "")
        return f"| {r.get('name')} | | {r.get('alpha', '')} | {why} | | | | | |"
    s = r["time_split_ms_per_step"]
    ex = r["exact"]
    exact = "equal" if ex["equal_to_ar"] else f"{len(ex['divergences'])} div ({ex['unexcused']} unexcused)"
    return (f"| {r['name']} | {r['mode']} | {r['alpha']} | {r['tau']:.2f} | {fmt(r['ms_per_token'])} | "
            f"{r['speedup']:.2f}x | {r['bound']:.2f}x | {s['verify']:.3f} / {s['accept_commit']:.3f} / "
            f"{s['draft']:.3f} / {s['graph_launch_and_gaps']:.3f} | {exact} |")


def _md_acceptance(a: dict) -> list[str]:
    lines = ["## Acceptance", ""]
    if a.get("skipped"):
        return lines + [a["skipped"], ""]
    lines += ["| drafter / settings | tau | forwards | mismatching prompts |", "|---|---|---|---|"]
    for name, d in (a.get("drafters") or {}).items():
        if "error" in d:
            lines.append(f"| {name} | failed: {d['error'][:80]} | | |")
        else:
            lines.append(f"| {name} | {d['tau']} | {d['target_forwards']} | {d.get('mismatching_prompts')} |")
    ex = a.get("exactness")
    if isinstance(ex, dict) and "error" not in ex:
        lines += ["", f"Exactness (oracle, chain/tree x deferred/immediate): {ex['mismatches']} mismatches, "
                  f"{ex['near_ties']} near-ties."]
    return lines + [""]


def _html(out: Path, data: dict) -> None:
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        return
    rows = ((data.get("e2e") or {}).get("oracle") or {}).get("rows") or []
    runtime = (data.get("runtime") or {}).get("models") or {}
    fig = make_subplots(rows=1, cols=2, subplot_titles=("AR ms/token", "oracle speedup vs alpha"))
    for name, m in runtime.items():
        m = m.get("result", m)
        variants = {k: v for k, v in (m.get("variants") or {}).items() if "ms_per_token" in v}
        medians = [v["ms_per_token"]["median"] for v in variants.values()]
        fig.add_trace(go.Bar(name=name, x=list(variants), y=medians), row=1, col=1)
    by_topo: dict[str, list] = {}
    for r in rows:
        if "speedup" in r:
            by_topo.setdefault(r["name"], []).append((r["alpha"], r["speedup"]))
    for name, pts in by_topo.items():
        pts.sort()
        fig.add_trace(go.Scatter(name=name, x=[a for a, _ in pts], y=[s for _, s in pts],
                                 mode="lines+markers"), row=1, col=2)
    fig.update_layout(title="SpecLA benchmarks", height=500)
    (out / "report.html").write_text(fig.to_html(include_plotlyjs=True, full_html=True))


# --------------------------------------------------------------------------- main

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
    p.add_argument("--ops", choices=("auto", "fla", "torch"), default="auto",
                   help="per-layer ops of our runtime (auto: fla's fused kernels on CUDA)")
    p.add_argument("--recurrence", choices=("kernels", "torch"), default="kernels",
                   help="verifier inside the speculative graphs (kernels: kernels/triton_verify)")
    p.add_argument("--pair-budget", type=float, default=150.0,
                   help="seconds for the embedded pair within the CUDA e2e suite (default 150)")
    p.add_argument("--compile-drafter", action="store_true",
                   help="e2e pair: also the device-graphed chains with the draft fused by torch.compile")
    p.add_argument("--device-rows-only", action="store_true",
                   help="e2e pair: only the device-graphed chains, not the eager-drafter rows")
    p.add_argument("--head-top-k", type=int, default=4,
                   help="head suite: LiLiCorr candidates per slot (default 4, as the measured chains)")
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
