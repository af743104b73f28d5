"""The head suite: LiLiCorr's head as a share of a decoding step next to a GDN-1.3B-shape target."""
from __future__ import annotations

import dataclasses
import statistics

import torch

from specla.bench.common import Deadline, Results, guarded, random_prompt, small_config, stat
from specla.decode import DecodeSettings
from specla.engine import Engine
from specla.graphs.drafters import DeviceBlockDrafter
from specla.graphs.runtime import Stopwatch, capture
from specla.model import random_gdn

DEVICE_LABEL = "chain (device-graphed)"
FUSED_SUFFIX = ", fused head"                           # LiLiCorr's head as Triton kernels


def engine_chain_row(engine: Engine, drafter, settings, prompts: list[list[int]], n: int) -> dict:
    """A drafter's device-graphed chains through the engine, each prompt after its AR baseline
    (median of 3 graphed runs); the first prompt is decoded once more to warm (captures).
    Step times are CUDA events (host time eagerly); divergences from AR must be near-ties."""
    decode = DecodeSettings(max_new_tokens=n)
    ar_ms, spec_ms, step_ms, divs, tokens, steps, split = [], [], [], [], 0, 0, {}
    for i, prompt in enumerate(prompts):
        ar = engine.ar(prompt, decode, repeats=3)
        if i == 0:
            for _ in engine.speculate(prompt, drafter, decode, settings):
                pass
        records = list(engine.speculate(prompt, drafter, decode, settings))
        out = [t for r in records for t in r.new_tokens]
        elapsed = [r.elapsed_ms for r in records]
        ar_ms.append(ar.ms_per_token)
        spec_ms.append(sum(elapsed) / len(out))
        step_ms.extend(elapsed)
        tokens, steps = tokens + len(out), steps + len(records)
        for r in records:
            for k, v in r.times_ms.items():
                split[k] = split.get(k, 0.0) + v
        first = next((j for j, (a, b) in enumerate(zip(out, ar.tokens)) if a != b), None)
        if first is not None:
            divs.append({"prompt": i, **engine.divergence(prompt, out, first, ar.tokens[first])})
    t_ar, t_spec = statistics.median(ar_ms), statistics.median(spec_ms)
    split = {k: v / steps for k, v in split.items()}
    return {"tokens": tokens, "target_forwards": steps, "tau": tokens / steps,
            "ms_per_token": stat(spec_ms), "ar_ms_per_token": stat(ar_ms), "speedup": t_ar / t_spec,
            "step_ms": stat(step_ms), "gpu_step_ms": sum(split.values()), "time_split_ms_per_step": split,
            "exact": {"prompts": len(prompts), "diverging_prompts": len(divs), "divergences": divs,
                      "unexcused": sum(not d["near_tie"] for d in divs)}}


def head_share(rows: list[dict], label: str = DEVICE_LABEL, block_label: str | None = None) -> dict:
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
    from specla.drafters.lilicorr import candidates, greedy_walk, lattice

    dev = DeviceBlockDrafter(drafter, settings, fused_head=True)
    _, feats, hidden = rt.prefill(prompt, tuple(drafter.feature_layers))
    dev.reset(prompt, feats, hidden)
    root = torch.tensor([prompt[-1]], device=rt.device)
    with torch.no_grad():
        h, logits = dev.slot_logits(root)
        anchor = dev.anchor().clone()
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
    torch ops; each share is the step difference over the LiLiCorr step (`head_share`).
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
    engines = {fused: Engine(target, "graphed", args.ops, compile_drafter=False, fused_head=fused,
                             recurrence=args.recurrence) for fused in ((False, True) if cuda else (False,))}
    res["ops"] = engines[False].ops_note
    chain = DraftSettings(tree="chain", block_size=SCALE_BLOCK, top_k=args.head_top_k, budget=SCALE_BLOCK - 1)
    if cuda:
        guarded(res.data, "head_alone", head_alone_cost, engines[False].packed, drafter, chain, prompts[0])
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
        guarded(row, "result", engine_chain_row, engines[fused], drafter, settings, prompts, n)
        if isinstance(row["result"], dict) and "error" not in row["result"]:
            row.update(row.pop("result"))
            print(f"[head] {row['name']}: step {row['step_ms']['median']:.3f} ms", flush=True)
        res["rows"].append(row)
        res.save()
    for key, label in (("share_fused", HEAD_FUSED_LABEL), ("share_torch", DEVICE_LABEL)):
        if cuda or label == DEVICE_LABEL:
            guarded(res.data, key, head_share, res["rows"], label, DEVICE_LABEL)
    res.save()
    return res.data
