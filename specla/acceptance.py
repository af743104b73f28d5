"""Acceptance and exactness measurements over a prompt file (used by the CLI and the bench).

Both decode every prompt speculatively through the real engine, so a tau reported here
comes from outputs that were checked (or can be checked) against AR decoding.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from specla.decode import DecodeSettings
from specla.drafters.base import DraftSettings
from specla.drafters.oracle import OracleDrafter
from specla.engine import Engine


def as_engine(target_or_engine) -> Engine:
    """An engine (a bare target decodes on the eager backend)."""
    return target_or_engine if isinstance(target_or_engine, Engine) else Engine(target_or_engine, "eager")


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """JSON Lines, one object with a "prompt" field per line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ValueError(f"cannot read prompts file {path}: {err.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{path}:{number}: expected an object with a string 'prompt' field")
        prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts[:limit] if limit else prompts


def accept_stats(records: list) -> dict:
    """tau (tokens per target forward, bonus included), histogram, per-position acceptance."""
    lengths = [len(r.acceptance.tokens) for r in records]
    depths = [r.tree.depth for r in records]
    produced = sum(len(r.new_tokens) for r in records)
    per_position = []
    for d in range(1, max(depths, default=0) + 1):
        reached = [n for n, depth in zip(lengths, depths) if depth >= d]
        per_position.append(sum(n >= d for n in reached) / max(1, len(reached)))
    return {"tokens": produced, "forwards": len(records), "lengths": lengths,
            "per_position": per_position}


def merge_stats(parts: list[dict]) -> dict:
    tokens = sum(p["tokens"] for p in parts)
    forwards = sum(p["forwards"] for p in parts)
    lengths = [n for p in parts for n in p["lengths"]]
    hist = Counter(lengths)
    depth = max((len(p["per_position"]) for p in parts), default=0)
    per_position = []
    for d in range(depth):
        num = sum(sum(n >= d + 1 for n in p["lengths"]) for p in parts if len(p["per_position"]) > d)
        den = sum(p["forwards"] for p in parts if len(p["per_position"]) > d)
        per_position.append(round(num / max(1, den), 4))
    return {"tau": round(tokens / max(1, forwards), 4), "tokens": tokens, "target_forwards": forwards,
            "accept_hist": {str(k): hist[k] for k in sorted(hist)},
            "per_position_acceptance": per_position}


def top2_gaps(target, prompt: list[int], tokens: list[int]) -> list[float]:
    """AR's top-1 minus top-2 logit at every generated position (to tell near-ties apart)."""
    from specla.decode import prefill
    from specla.model import Topology, commit
    state, _, _ = prefill(target, prompt)
    topo = Topology.chain(1, target.config.conv_size, target.device)
    gaps, root = [], prompt[-1]
    with torch.inference_mode():
        for token in tokens:
            out = target(torch.tensor([[root]], device=target.device), state, topo, mode="chain")
            commit(state, out.factors, [0])
            top = out.logits[0, 0].topk(2).values
            gaps.append(float(top[0] - top[1]))
            root = token
    return gaps


def exactness(target, tokenize, prompts: list[str], modes: list[str], deferred: list[bool],
              temperature: float, max_new_tokens: int, drafter_factory=None,
              near_tie: float = 0.0) -> dict:
    """Decode each prompt with AR and with speculation in every (mode, deferred) pair.

    `drafter_factory(prompt_tokens, ar_tokens, mode)` gives a drafter; by default the oracle
    drafter (alpha 0.8): a chain for mode 'chain', a tree otherwise. A mismatch at a position
    where AR's top-2 logit gap is below `near_tie` is counted as a near-tie, not a mismatch.
    """
    engine = as_engine(target)
    target = engine.target
    results, total, total_ties = [], 0, 0
    for mode in modes:
        for lazy in deferred:
            mismatches = ties = 0
            for i, prompt in enumerate(tqdm(prompts, desc=f"{mode}/{'deferred' if lazy else 'immediate'}",
                                            leave=False)):
                tokens = tokenize(prompt)
                settings = DecodeSettings(max_new_tokens=max_new_tokens, temperature=temperature,
                                          mode=mode, deferred=lazy, seed=i)
                ar = engine.ar(tokens, settings)
                if drafter_factory is None:
                    drafter = OracleDrafter(ar.tokens + [0] * 64, target.config.vocab_size, alpha=0.8,
                                            shape="chain" if mode == "chain" else "tree", seed=i)
                else:
                    drafter = drafter_factory(tokens, ar.tokens, mode)
                spec = [t for r in engine.speculate(tokens, drafter, settings, DraftSettings(budget=8, top_k=3))
                        for t in r.new_tokens]
                if temperature > 0 or spec == ar.tokens:
                    continue
                first = next(j for j, (a, b) in enumerate(zip(spec, ar.tokens)) if a != b)
                gap = engine.divergence(tokens, spec, first, ar.tokens[first])["top2_gap"]
                if gap < near_tie:
                    ties += 1
                else:
                    mismatches += 1
            results.append({"mode": mode, "deferred": lazy, "prompts": len(prompts),
                            "mismatching_prompts": mismatches, "near_ties": ties})
            total += mismatches
            total_ties += ties
    return {"results": results, "mismatches": total, "near_ties": total_ties,
            "temperature": temperature, "max_new_tokens": max_new_tokens}


def measure_acceptance(target, tokenize, prompts: list[str], drafter, draft_settings: DraftSettings,
                       max_new_tokens: int, check_exact: bool = True,
                       ar_cache: dict | None = None) -> dict:
    """tau and acceptance statistics of `drafter` at temperature 0 (checked against AR).

    `target` is an Engine (or a bare target, decoded eagerly). `ar_cache`, if given, keeps
    each prompt's AR tokens between calls (several drafters are checked against the same AR
    output, decoded once).
    """
    engine = as_engine(target)
    parts, mismatches = [], 0
    ar_cache = {} if ar_cache is None else ar_cache
    for prompt in tqdm(prompts, desc=f"acceptance {drafter.name}", leave=False):
        tokens = tokenize(prompt)
        settings = DecodeSettings(max_new_tokens=max_new_tokens, mode="auto", deferred=True)
        records = list(engine.speculate(tokens, drafter, settings, draft_settings))
        parts.append(accept_stats(records))
        if check_exact:
            key = (tuple(tokens), max_new_tokens)
            if key not in ar_cache:
                ar_cache[key] = engine.ar(tokens, settings).tokens
            spec = [t for r in records for t in r.new_tokens]
            mismatches += spec != ar_cache[key]
    out = merge_stats(parts)
    out["prompts"] = len(prompts)
    out["mismatching_prompts"] = mismatches if check_exact else None
    return out
