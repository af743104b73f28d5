"""The runtime suite: AR decode at the GDN-1.3B public shape, the embedded model and a small
one; fla's model eager and in one CUDA graph against our graphed AR; the memory floor."""
from __future__ import annotations

import dataclasses

import torch

from specla.bench.common import (PROMPT_FILES, ROOT, Deadline, Results, free_cuda, guarded, random_prompt, ratio,
                                 small_config, stat, timing)
from specla.bench.measure import FlaAR, build_fla_model, copy_bandwidth, decode_bytes
from specla.graphs.ar import GraphedAR
from specla.graphs.runtime import PackedTarget
from specla.model import random_gdn


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
