"""`python -m specla`: generate, exactness, acceptance, bench, train.

Every subcommand prints a human-readable result; with --json the last line of its output is
one JSON object. Bad input ends with a one-line `error: ...` on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "assets" / "target"
DEFAULT_DRAFTERS = ROOT / "assets" / "drafters"
MAX_PROMPT_TOKENS = 8192

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _device(name: str | None):
    import torch
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA GPU is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {name!r}")
    return torch.device(name)


def _load(args):
    from specla.checkpoint import load_model
    model, tokenizer, report = load_model(args.model, device=_device(args.device))
    if tokenizer is None:
        raise ValueError(f"{args.model}: the checkpoint has no tokenizer.json")
    for name in report.unused_tensors:
        print(f"note: ignoring legacy tensor {name}", file=sys.stderr)
    return model, tokenizer


def _checked_tokens(model, tokenizer, text: str) -> list[int]:
    from specla.decode import check_prompt
    ids = tokenizer.encode(text, add_special_tokens=False)
    check_prompt(ids, model.config.vocab_size, MAX_PROMPT_TOKENS)
    return ids


def _load_drafter(kind: str, model, args):
    from specla.drafters import MODEL_FREE, load_drafter, model_free_drafter
    if kind in MODEL_FREE:
        return model_free_drafter(kind, model)
    path = Path(args.drafter_path) if getattr(args, "drafter_path", None) else DEFAULT_DRAFTERS / kind
    return load_drafter(path, model)


def _with_preset(drafter, args):
    """The drafter cut to --preset's tree (JSON index paths, or "measured": the drafter's own)."""
    from specla.runner import PresetShape, preset_paths
    paths = preset_paths(args.preset, drafter, args.drafter) if args.preset else None
    return PresetShape(drafter, paths) if paths else drafter


def _engine(model, args):
    from specla.engine import Engine
    return Engine(model, args.backend)


def cmd_generate(args) -> dict:
    from specla.decode import DecodeSettings
    from specla.drafters.base import DraftSettings

    model, tokenizer = _load(args)
    engine = _engine(model, args)
    prompt = _checked_tokens(model, tokenizer, args.prompt)
    settings = DecodeSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, stop_at_eos=True)
    eos = getattr(tokenizer, "eos_token_id", None)
    start = time.perf_counter()
    plan = None
    if args.drafter:
        drafter = _with_preset(_load_drafter(args.drafter, model, args), args)
        draft = DraftSettings(tree=args.tree, top_k=args.top_k, budget=args.budget)
        plan = engine.plan(drafter, settings, draft)
        records = list(engine.speculate(prompt, drafter, settings, draft, eos_token_id=eos))
        tokens = [t for r in records for t in r.new_tokens]
        forwards = len(records)
        decode_ms = sum(r.elapsed_ms for r in records)
    else:
        ar = engine.ar(prompt, settings, eos_token_id=eos)
        tokens, forwards = ar.tokens, len(ar.tokens)
        decode_ms = ar.ms_per_token * len(tokens)
    seconds = time.perf_counter() - start
    text = tokenizer.decode(tokens)
    print(args.prompt + text)
    rate = 1e3 * len(tokens) / decode_ms if decode_ms > 0 else 0.0
    how = f"{engine.backend} backend" + (f", {plan.drafting} drafting" if plan else "")
    print(f"-- {len(tokens)} tokens at {rate:.1f} tokens/s decoding ({seconds:.2f} s with set-up) on "
          f"{model.device}, {how} ({forwards} target forwards)" + (f"; {plan.note}" if plan and plan.note else ""),
          file=sys.stderr)
    return {"text": text, "token_ids": tokens, "tokens_per_s": round(rate, 3),
            "device": str(model.device), "backend": engine.backend, "target_forwards": forwards,
            "drafter": args.drafter or None, "drafting": plan.drafting if plan else None}


def cmd_exactness(args) -> dict:
    from specla.acceptance import exactness, read_prompts

    model, tokenizer = _load(args)
    engine = _engine(model, args)
    prompts = read_prompts(args.prompts, args.limit)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    deferred = [{"on": True, "off": False}[d.strip()] for d in args.deferred.split(",")]
    factory = None
    if args.drafter == "oracle" and args.preset:
        raise ValueError("--preset cuts a drafter's candidate tree; the oracle drafts one chain")
    if args.drafter != "oracle":
        drafter = _with_preset(_load_drafter(args.drafter, model, args), args)
        factory = lambda prompt, ar_tokens, mode: drafter  # noqa: E731 (reset() starts each run)
    out = exactness(engine, lambda t: _checked_tokens(model, tokenizer, t), prompts, modes, deferred,
                    args.temperature, args.max_new_tokens, factory, near_tie=args.near_tie)
    out["backend"] = engine.backend
    for r in out["results"]:
        print(f"{r['mode']:>6} {'deferred' if r['deferred'] else 'immediate':>9}: "
              f"{r['mismatching_prompts']} mismatching / {r['prompts']} prompts, {r['near_ties']} near-ties")
    return out


def cmd_acceptance(args) -> dict:
    from specla.acceptance import measure_acceptance, read_prompts
    from specla.drafters.base import DraftSettings

    model, tokenizer = _load(args)
    engine = _engine(model, args)
    prompts = read_prompts(args.prompts, args.limit)
    drafter = _with_preset(_load_drafter(args.drafter, model, args), args)
    ds = DraftSettings(tree=args.tree, top_k=args.top_k, budget=args.budget,
                       block_size=args.block_size, depth=args.depth, prune_tau=args.prune_tau)
    ds.validate(model.config.vocab_size)
    out = measure_acceptance(engine, lambda t: _checked_tokens(model, tokenizer, t), prompts,
                             drafter, ds, args.max_new_tokens)
    out.update(drafter=args.drafter, tree=args.tree, preset=args.preset, top_k=args.top_k, budget=args.budget,
               block_size=args.block_size, backend=engine.backend)
    print(f"tau = {out['tau']} over {out['prompts']} prompts ({out['target_forwards']} forwards); "
          f"histogram {out['accept_hist']}; per position {out['per_position_acceptance']}")
    return out


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="checkpoint folder (fla/HF layout) or a hub id (online only); "
                        "default: the embedded model in assets/target")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--backend", choices=("auto", "eager", "graphed"), default="auto",
                   help="decoding backend: graphed (CUDA graphs), eager (plain PyTorch, the reference) or "
                        "auto (default: graphed on CUDA)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")


def _draft_args(p: argparse.ArgumentParser, default_drafter: str | None) -> None:
    p.add_argument("--drafter", default=default_drafter,
                   help="block | lilicorr | eagle (from assets/drafters), ngram (model-free, any "
                        "model) or oracle (exactness only)")
    p.add_argument("--drafter-path", help="drafter folder (default assets/drafters/<kind>)")
    p.add_argument("--tree", default="chain", help="chain | beam | best-first")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--budget", type=int, default=16, help="draft nodes per step, root excluded")
    p.add_argument("--preset", help="a tree preset, overriding --tree: JSON index paths such as "
                                    "'[[0], [0, 0], [1]]', or measured (the drafter's own, e.g. the block drafter's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specla",
        description="SpecLA: exact speculative decoding for Gated DeltaNet models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("generate", help="generate text (AR, or speculative with --drafter)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    _model_args(p)
    _draft_args(p, None)
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("exactness", help="compare speculative decoding with AR, token for token")
    p.add_argument("--prompts", required=True, help="JSON Lines file with a 'prompt' field per line")
    p.add_argument("--modes", default="chain,tree,hybrid,auto")
    p.add_argument("--deferred", default="on,off")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--near-tie", type=float, default=0.0,
                   help="top-2 logit gap under which a divergence counts as a near-tie (bf16 noise)")
    _model_args(p)
    _draft_args(p, "oracle")
    p.set_defaults(run=cmd_exactness)

    p = sub.add_parser("acceptance", help="tau, accept-length histogram, per-position acceptance")
    p.add_argument("--prompts", required=True)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--prune-tau", type=float)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int)
    _model_args(p)
    _draft_args(p, "lilicorr")
    p.set_defaults(run=cmd_acceptance)

    sub.add_parser("bench", help="benchmarks (see python -m specla bench --help)", add_help=False)
    sub.add_parser("train", help="training (see python -m specla train --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from specla.bench import main as bench_main
        return bench_main(argv[1:]) or 0
    if argv and argv[0] == "train":
        from specla.train.__main__ import main as train_main
        return train_main(argv[1:]) or 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    try:
        if hasattr(args, "max_new_tokens"):
            from specla.decode import MAX_NEW_TOKENS
            if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
                raise ValueError(f"--max-new-tokens must be between 1 and {MAX_NEW_TOKENS}")
        result = args.run(args)
    except (ValueError, OSError) as err:   # ModelFormatError, TreeError, TraceError are ValueErrors
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0
