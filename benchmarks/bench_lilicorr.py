"""Micro-benchmark of the fused LiLiCorr head (kernels/triton_lilicorr.py), on a GPU.

    python benchmarks/bench_lilicorr.py --out DIR [--baseline OLD_triton_lilicorr.py]
        [--shape embedded gdn-1.3b] [--top-k 4 8] [--options default warps4]

For the embedded drafter's head shape and the same head in front of a GDN-1.3B-sized pair
(2048-wide inputs, a 32000-token vocabulary), each with bf16 random weights and a random
lattice of 7 slots x 4 or x 8 candidates, times:
  torch      the module (`LiLiCorrHead.forward`) + `greedy_walk`
  fused      each launch option (8 warps, the default; 4 warps): `draft` from slot logits
             (top-k included), warm and with L2 flushed before every call (as inside a
             decoding step, where the target's weights evict the head's); the call on given
             candidates; the prologue and head launches alone; registers and spills
  layers     the head launch of the same head with 1 lattice layer instead of 2 (a layer's
             cost is the difference)
  baseline   `--baseline`: an earlier triton_lilicorr.py (e.g. `git show 9779ca8:kernels/
             triton_lilicorr.py`), its `draft` warm and cold, for a same-process before / after
Each call is captured 20 times in one CUDA graph; a sample is one replay over 20, the figure
the median of 30 samples. Cold figures subtract a graph of the flushes alone. Writes
DIR/lilicorr_head_kernels.json and prints a Markdown table.
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
from specla.drafters.lilicorr import HeadConfig, LiLiCorrHead, greedy_walk  # noqa: E402
from specla.graphs.runtime import Stopwatch, capture  # noqa: E402

SHAPES = {  # name: HeadConfig fields (S = 7 slots, k = 8 candidates, as the embedded drafter)
    "embedded": dict(drafter_width=256, target_hidden=384, width=128, heads=4, layers=2, mlp_hidden=256,
                     max_slots=7, max_k=8),
    "gdn-1.3b": dict(drafter_width=2048, target_hidden=2048, width=128, heads=4, layers=2, mlp_hidden=256,
                     max_slots=7, max_k=8),
}
SLOTS, TOP_KS, VOCAB = 7, (4, 8), 32000    # the measured LiLiCorr chains draft from top-4 lattices
OPTIONS = {"default": {}, "warps4": dict(num_warps=4)}
FLUSH_BYTES = 256 << 20                     # over 4x an H100 / H200 L2 (50 MB)


def graph_ms(fn, inner: int = 20, repeats: int = 30, flush: torch.Tensor | None = None) -> dict:
    """Median ms of one `fn()` in a graph of `inner` calls; with `flush`, each call follows
    a write of that buffer (evicting L2), and a graph of the writes alone is subtracted."""
    def samples(body) -> list[float]:
        graph = capture(body)
        out = []
        for _ in range(repeats):
            with Stopwatch(torch.device("cuda")) as sw:
                graph.replay()
            out.append(sw.ms / inner)
        return sorted(out)
    if flush is None:
        got = samples(lambda: [fn() for _ in range(inner)])
    else:
        both = samples(lambda: [(flush.zero_(), fn()) for _ in range(inner)])
        alone = samples(lambda: [flush.zero_() for _ in range(inner)])
        got = [b - alone[len(alone) // 2] for b in both]
    return {"median": got[len(got) // 2], "min": got[0], "max": got[-1], "runs": repeats}


def lattice_inputs(fields: dict, top_k: int, seed: int = 0):
    """(candidates, log-probs, slot hiddens, anchor), slot logits and a target embedding."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, SLOTS, VOCAB, generator=gen) * 4
    logp, cand = torch.log_softmax(logits, -1).topk(top_k, -1)
    hidden = torch.randn(1, SLOTS, fields["drafter_width"], generator=gen)
    anchor = torch.randn(1, fields["drafter_width"], generator=gen)
    embed = torch.randn(VOCAB, fields["target_hidden"], generator=gen) * 0.02
    dev, bf16 = "cuda", torch.bfloat16
    return ((cand.to(dev), logp.to(dev), hidden.to(dev, bf16), anchor.to(dev, bf16)), logits.to(dev),
            embed.to(dev, bf16))


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


def bench_shape(fields: dict, top_k: int, options: dict, baseline) -> dict:
    head = random_head(fields)
    (cand, logp, hidden, anchor), logits, embed = lattice_inputs(fields, top_k)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    out: dict = {"config": fields, "slots": SLOTS, "top_k": top_k, "vocab": VOCAB}

    def torch_head():
        start, pair = head(embed[cand], logp, hidden, anchor)
        return greedy_walk(start, pair)

    def draft_times(fused) -> dict:
        return {"draft_ms": graph_ms(lambda: fused.draft(logits, hidden, anchor)),
                "draft_cold_ms": graph_ms(lambda: fused.draft(logits, hidden, anchor), flush=flush)}

    with torch.no_grad():
        guarded(out, "torch_ms", lambda: graph_ms(torch_head))
        guarded(out, "torch_cold_ms", lambda: graph_ms(torch_head, flush=flush))
        for name, option in options.items():
            def variant(option=option):
                fused = FusedLiLiCorrHead(head, SLOTS, top_k, embed, **option)
                ranks = fused(cand, logp, hidden, anchor)[2]
                proj = fused.inputs(hidden, anchor)[2:]
                return {**draft_times(fused),
                        "call_ms": graph_ms(lambda: fused(cand, logp, hidden, anchor)),
                        "inputs_ms": graph_ms(lambda: fused.inputs(hidden, anchor)),
                        "body_ms": graph_ms(lambda: fused.body(cand, logp, *proj)),
                        "registers": fused.registers(),
                        "walk_equal_to_torch": bool(torch.equal(ranks, torch_head()))}
            guarded(out, "fused_" + name, variant)

        def one_layer():
            small = random_head({**fields, "layers": 1})
            fused = FusedLiLiCorrHead(small, SLOTS, top_k, embed)
            proj = fused.inputs(hidden, anchor)[2:]
            return {"body_ms": graph_ms(lambda: fused.body(cand, logp, *proj))}
        guarded(out, "layers1", one_layer)
        if baseline is not None:
            guarded(out, "baseline", lambda: draft_times(baseline.FusedLiLiCorrHead(head, SLOTS, top_k, embed)))
    return out


def markdown(results: dict) -> str:
    cols = ("draft_ms", "draft_cold_ms", "call_ms", "inputs_ms", "body_ms")
    lines = ["| shape | variant | draft ms | draft ms, L2 flushed | call ms | prologue ms | head ms | "
             "registers (spills) |", "|---|---|---|---|---|---|---|---|"]
    for shape, r in results["shapes"].items():
        for key, v in r.items():
            if not isinstance(v, dict) or "error" in v or key == "config":
                continue
            if key in ("torch_ms", "torch_cold_ms"):
                lines.append(f"| {shape} | torch module + walk{', L2 flushed' if 'cold' in key else ''} | | | "
                             f"{v['median']:.4f} | | | |")
                continue
            med = lambda name: f"{v[name]['median']:.4f}" if name in v else ""   # noqa: E731
            regs = "; ".join(f"{n} {x['registers']} ({x['spills']})" for n, x in v.get("registers", {}).items())
            lines.append(f"| {shape} | {key} | " + " | ".join(med(c) for c in cols) + f" | {regs} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--baseline", type=Path, help="an earlier triton_lilicorr.py to time beside this one")
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--top-k", nargs="+", type=int, default=list(TOP_KS))
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
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
    options = {name: OPTIONS[name] for name in args.options}
    for top_k in args.top_k:
        for name in args.shape:
            print(f"== {name}, top-{top_k}", flush=True)
            results["shapes"][f"{name}, top-{top_k}"] = bench_shape(SHAPES[name], top_k, options, baseline)
            (args.out / "lilicorr_head_kernels.json").write_text(json.dumps(results, indent=1, default=str))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
