"""Micro-benchmark of the fused LiLiCorr head (kernels/triton_lilicorr.py), on a GPU.

    python kernels/bench_lilicorr.py --out DIR [--baseline OLD_triton_lilicorr.py]

For the embedded drafter's head shape and the same head in front of a GDN-1.3B-sized pair
(2048-wide inputs), each with bf16 random weights and a random lattice of 7 slots x 4 and
x 8 candidates, times:
  torch      the module (`LiLiCorrHead.forward`) + `greedy_walk`
  fused      the launch options (per-head attention with 8 warps, the default; stacked with
             4): the input launch alone, the head launch alone, and both; registers and spills
  layers     the head launch of the same head with 1 lattice layer instead of 2 (a layer's
             cost is the difference)
  baseline   `--baseline`: an earlier triton_lilicorr.py (e.g. `git show 2ff23d5:kernels/
             triton_lilicorr.py`), its whole forward, for a same-process before / after
Each call is captured 20 times in one CUDA graph; a sample is one replay over 20, the figure
the median of 30 samples. Writes DIR/lilicorr_head_kernels.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import traceback
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.triton_lilicorr import FusedLiLiCorrHead  # noqa: E402
from specla import cuda_graphs as cg  # noqa: E402
from specla.drafters.lilicorr import HeadConfig, LiLiCorrHead, greedy_walk  # noqa: E402

SHAPES = {  # name: HeadConfig fields (S = 7 slots, k = 8 candidates, as the embedded drafter)
    "embedded": dict(drafter_width=256, target_hidden=384, width=128, heads=4, layers=2, mlp_hidden=256,
                     max_slots=7, max_k=8),
    "gdn-1.3b": dict(drafter_width=2048, target_hidden=2048, width=128, heads=4, layers=2, mlp_hidden=256,
                     max_slots=7, max_k=8),
}
SLOTS, TOP_KS, VOCAB = 7, (4, 8), 4096     # the measured LiLiCorr chains draft from top-4 lattices
OPTIONS = [dict(stacked_heads=False, num_warps=8), dict(stacked_heads=True, num_warps=4)]


def graph_ms(fn, inner: int = 20, repeats: int = 30) -> dict:
    graph = cg.capture(lambda: [fn() for _ in range(inner)])
    samples = []
    for _ in range(repeats):
        with cg.Stopwatch(torch.device("cuda")) as sw:
            graph.replay()
        samples.append(sw.ms / inner)
    samples.sort()
    return {"median": samples[len(samples) // 2], "min": samples[0], "max": samples[-1], "runs": repeats}


def lattice_inputs(fields: dict, top_k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.randperm(VOCAB, generator=gen)[:SLOTS * top_k].view(SLOTS, top_k)])
    logp = torch.log_softmax(torch.randn(1, SLOTS, 4 * top_k, generator=gen) * 3, -1).topk(top_k, -1).values
    hidden = torch.randn(1, SLOTS, fields["drafter_width"], generator=gen)
    anchor = torch.randn(1, fields["drafter_width"], generator=gen)
    embed = torch.randn(VOCAB, fields["target_hidden"], generator=gen) * 0.02
    dev, bf16 = "cuda", torch.bfloat16
    return (cand.to(dev), logp.to(dev), hidden.to(dev, bf16), anchor.to(dev, bf16)), embed.to(dev, bf16)


def random_head(fields: dict, seed: int = 0) -> LiLiCorrHead:
    torch.manual_seed(seed)
    head = LiLiCorrHead(HeadConfig(**fields))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3 if p.dim() < 2 else p.shape[-1] ** -0.5)
    return head.to("cuda", torch.bfloat16).eval()


def guarded(out: dict, key: str, fn) -> None:
    try:
        out[key] = fn()
    except Exception as err:  # noqa: BLE001 - one failing variant is a result, the rest still run
        out[key] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
    print(f"{key}: {json.dumps(out[key])[:200]}", flush=True)


def bench_shape(fields: dict, top_k: int, baseline) -> dict:
    head = random_head(fields)
    (cand, logp, hidden, anchor), embed = lattice_inputs(fields, top_k)
    out: dict = {"config": fields, "slots": SLOTS, "top_k": top_k}

    def torch_head():
        start, pair = head(embed[cand], logp, hidden, anchor)
        return greedy_walk(start, pair)

    with torch.no_grad():
        guarded(out, "torch_ms", lambda: graph_ms(torch_head))
        for options in OPTIONS:
            name = "fused_" + "_".join(f"{k}{int(v)}" for k, v in options.items())

            def variant(options=options):
                fused = FusedLiLiCorrHead(head, SLOTS, top_k, embed, **options)
                ranks = fused(cand, logp, hidden, anchor)[2]
                proj = fused.inputs(cand, hidden, anchor)
                return {"call_ms": graph_ms(lambda: fused(cand, logp, hidden, anchor)),
                        "inputs_ms": graph_ms(lambda: fused.inputs(cand, hidden, anchor)),
                        "body_ms": graph_ms(lambda: fused.body(cand, logp, *proj)),
                        "registers": fused.registers(),
                        "walk_equal_to_torch": bool(torch.equal(ranks, torch_head()))}
            guarded(out, name, variant)
        def one_layer():
            small = random_head({**fields, "layers": 1})
            fused = FusedLiLiCorrHead(small, SLOTS, top_k, embed)
            proj = fused.inputs(cand, hidden, anchor)
            return {"body_ms": graph_ms(lambda: fused.body(cand, logp, *proj))}
        guarded(out, "layers1", one_layer)
        if baseline is not None:
            def old():
                fused = baseline.FusedLiLiCorrHead(head, SLOTS, top_k, embed)
                return {"call_ms": graph_ms(lambda: fused(cand, logp, hidden, anchor))}
            guarded(out, "baseline", old)
    return out


def markdown(results: dict) -> str:
    lines = ["| shape | variant | call ms | inputs ms | head ms | registers (spills) |", "|---|---|---|---|---|---|"]
    for shape, r in results["shapes"].items():
        for key, v in r.items():
            if not isinstance(v, dict) or "error" in v or key == "config":
                continue
            if key == "torch_ms":
                lines.append(f"| {shape} | torch module + walk | {v['median']:.4f} | | | |")
                continue
            med = lambda name: f"{v[name]['median']:.4f}" if name in v else ""   # noqa: E731
            regs = "; ".join(f"{n} {x['registers']} ({x['spills']})" for n, x in v.get("registers", {}).items())
            lines.append(f"| {shape} | {key} | {med('call_ms')} | {med('inputs_ms')} | {med('body_ms')} | {regs} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--baseline", type=Path, help="an earlier triton_lilicorr.py to time beside this one")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_lilicorr", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "baseline": str(args.baseline) if args.baseline else None, "shapes": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for top_k in TOP_KS:
        for name, fields in SHAPES.items():
            print(f"== {name}, top-{top_k}", flush=True)
            results["shapes"][f"{name}, top-{top_k}"] = bench_shape(fields, top_k, baseline)
            (args.out / "lilicorr_head_kernels.json").write_text(json.dumps(results, indent=1, default=str))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
