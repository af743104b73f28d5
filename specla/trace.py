"""Versioned JSON traces of a run: what every explorer view and every export is built from.

A trace is plain JSON (see docs/TRACE.md for the schema, version 1):

    {"schema": "specla-trace", "version": 1, "created": ISO time,
     "model": {"name", "device", "dtype", "fingerprint", "config": {...}},
     "settings": {"drafter", "tree", "top_k", "budget", "block_size", "depth", "prune_tau",
                  "mode", "deferred", "temperature", "top_p", "max_new_tokens", "seed"},
     "prompt": str, "prompt_tokens": [int],
     "token_text": {"<id>": str},                  # every token id in the trace
     "steps": [step, ...],
     "output": {"tokens": [int], "sources": ["draft"|"bonus"], "step_of": [int], "text": str},
     "summary": {...},                             # see `summarize`
     "baseline": {"kind": "ar", "tokens_per_s": float, "seconds": float, "tokens": int} | null}

    step = {"index", "root", "tree": {"tokens", "parents", "logprobs", "pruned"},
            "draft_probs", "target_probs", "target_choice", "accepted_nodes" (root first),
            "accepted_tokens", "bonus", "new_tokens", "mode", "commit": {...},
            "times_ms": {"draft", "verify", "accept", "commit"}, "lattice": {...} | null}
"""
from __future__ import annotations

import datetime
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Callable

SCHEMA = "specla-trace"
VERSION = 1
MAX_TRACE_BYTES = 20 * 1024 * 1024


class TraceError(ValueError):
    """A file that is not a usable SpecLA trace; the message says why."""


def step_to_dict(record) -> dict:
    """A decode.StepRecord as JSON-able data."""
    acc = record.acceptance
    tree = record.tree
    return {
        "index": record.index,
        "root": tree.tokens[0],
        "tree": tree.to_dict(),
        "draft_probs": [round(p, 6) for p in record.draft_probs],
        "target_probs": [round(p, 6) for p in record.target_probs],
        "target_choice": acc.target_choice,
        "accepted_nodes": acc.path,
        "accepted_tokens": acc.tokens,
        "bonus": acc.bonus,
        "new_tokens": record.new_tokens,
        "mode": record.mode,
        "commit": record.commit,
        "times_ms": {k: round(v, 4) for k, v in record.times_ms.items()},
        "lattice": lattice_with_prefixes(record.details.get("lattice"), acc, tree),
    }


def lattice_with_prefixes(lattice: dict | None, acc, tree) -> dict | None:
    """Add what verification revealed: selected, top-1 and oracle prefix lengths.

    The target's own continuation along the accepted path (accepted tokens + bonus) is the
    truth; a slot counts while the truth matches the selected / top-1 candidate, and the
    oracle prefix counts while the truth is anywhere among the slot's candidates.
    """
    if not lattice:
        return None
    truth = acc.tokens + [acc.bonus]
    cands = lattice.get("candidates", [])

    def prefix(hit: Callable[[int, int], bool]) -> int:
        n = 0
        while n < min(len(truth), len(cands)) and hit(n, truth[n]):
            n += 1
        return n

    chosen = lattice.get("chosen", [])
    out = dict(lattice)
    out["selected_prefix"] = prefix(lambda s, t: s < len(chosen) and cands[s][chosen[s]] == t)
    out["top1_prefix"] = prefix(lambda s, t: cands[s][0] == t)
    out["oracle_prefix"] = prefix(lambda s, t: t in cands[s])
    out["truth"] = truth[:len(cands)]
    return out


def summarize(steps: list[dict], seconds: float, baseline: dict | None) -> dict:
    """Run-level numbers; every ratio is computed from the numbers next to it."""
    produced = sum(len(s["new_tokens"]) for s in steps)
    forwards = len(steps)
    accept_lengths = [len(s["accepted_tokens"]) for s in steps]
    hist = Counter(accept_lengths)
    max_depth = max((max_depth_of(s) for s in steps), default=0)
    per_position = []
    for depth in range(1, max_depth + 1):
        reached = [s for s in steps if max_depth_of(s) >= depth]
        per_position.append(round(sum(len(s["accepted_tokens"]) >= depth for s in reached)
                                  / max(1, len(reached)), 4))
    times = {k: round(sum(s["times_ms"].get(k, 0.0) for s in steps), 3)
             for k in ("draft", "verify", "accept", "commit")}
    tokens_per_s = produced / seconds if seconds > 0 else 0.0
    out = {
        "new_tokens": produced,
        "target_forwards": forwards,
        "tau": round(produced / forwards, 4) if forwards else 0.0,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens_per_s, 3),
        "accept_hist": {str(k): hist[k] for k in sorted(hist)},
        "per_position_acceptance": per_position,
        "time_ms": times,
        "modes": dict(Counter(s["mode"] for s in steps)),
        "speedup": None,
    }
    if baseline and baseline.get("tokens_per_s"):
        out["speedup"] = round(tokens_per_s / baseline["tokens_per_s"], 4)
    return out


def max_depth_of(step: dict) -> int:
    parents = step["tree"]["parents"]
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
    return max(depth)


def predicted_tau(alpha: float, depth: int) -> float:
    """E[tau] for a chain of `depth` drafts with i.i.d. per-token acceptance alpha (+ bonus)."""
    if alpha >= 1.0:
        return depth + 1.0
    return (1 - alpha ** (depth + 1)) / (1 - alpha)


def output_tokens(steps: list[dict]) -> tuple[list[int], list[str], list[int]]:
    """The generated tokens, where each came from ("draft" or "bonus"), and its step."""
    tokens, sources, step_of = [], [], []
    for s in steps:
        n_draft = len(s["accepted_tokens"])
        for j, t in enumerate(s["new_tokens"]):
            tokens.append(t)
            sources.append("draft" if j < n_draft else "bonus")
            step_of.append(s["index"])
    return tokens, sources, step_of


def build_trace(*, model: dict, settings: dict, prompt: str, prompt_tokens: list[int],
                steps: list[dict], decode: Callable[[list[int]], str], seconds: float,
                baseline: dict | None) -> dict:
    tokens, sources, step_of = output_tokens(steps)
    ids = set(prompt_tokens) | set(tokens)
    for s in steps:
        ids.update(s["tree"]["tokens"])
        ids.update(s["target_choice"])
        for row in (s.get("lattice") or {}).get("candidates", []):
            ids.update(row)
    return {
        "schema": SCHEMA, "version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model, "settings": settings, "prompt": prompt, "prompt_tokens": prompt_tokens,
        "token_text": {str(i): decode([i]) for i in sorted(ids)},
        "steps": steps,
        "output": {"tokens": tokens, "sources": sources, "step_of": step_of, "text": decode(tokens)},
        "summary": summarize(steps, seconds, baseline),
        "baseline": baseline,
    }


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise TraceError(message)


def validate_trace(data: Any) -> dict:
    """Check a loaded trace deeply enough that every view can draw it."""
    _require(isinstance(data, dict), "not a SpecLA trace: the file holds no JSON object")
    _require(data.get("schema") == SCHEMA, "not a SpecLA trace: 'schema' is not 'specla-trace'")
    version = data.get("version")
    _require(isinstance(version, int), "trace has no integer 'version'")
    _require(version <= VERSION, f"trace version {version} is newer than this app reads ({VERSION})")
    for key, kind in (("steps", list), ("output", dict), ("summary", dict), ("token_text", dict),
                      ("settings", dict), ("model", dict), ("prompt_tokens", list)):
        _require(isinstance(data.get(key), kind), f"trace field '{key}' is missing or not a {kind.__name__}")
    for i, step in enumerate(data["steps"]):
        _require(isinstance(step, dict), f"step {i} is not an object")
        tree = step.get("tree")
        _require(isinstance(tree, dict), f"step {i} has no tree")
        tokens, parents = tree.get("tokens"), tree.get("parents")
        _require(isinstance(tokens, list) and isinstance(parents, list) and tokens
                 and len(tokens) == len(parents), f"step {i}: tree tokens/parents malformed")
        _require(all(isinstance(p, int) and -1 <= p < j for j, p in enumerate(parents)),
                 f"step {i}: tree parents are not in topological order")
        for key in ("accepted_nodes", "accepted_tokens", "new_tokens", "target_probs", "draft_probs"):
            _require(isinstance(step.get(key), list), f"step {i}: '{key}' missing")
        _require(all(isinstance(n, int) and 0 <= n < len(tokens) for n in step["accepted_nodes"]),
                 f"step {i}: accepted node out of range")
        _require(isinstance(step.get("times_ms"), dict) and isinstance(step.get("commit"), dict),
                 f"step {i}: times or commit missing")
        for v in step["times_ms"].values():
            _require(isinstance(v, (int, float)) and math.isfinite(v), f"step {i}: bad time value")
    return data


def dumps(trace: dict) -> str:
    return json.dumps(trace, ensure_ascii=False, separators=(",", ":"))


def load_trace(path: str | Path) -> dict:
    """Read and validate a trace file with clear errors for every way it can be wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as err:
        raise TraceError(f"cannot read the trace file: {err.strerror}") from None
    _require(size <= MAX_TRACE_BYTES, f"trace file is {size / 2**20:.1f} MiB; the limit is "
             f"{MAX_TRACE_BYTES // 2**20} MiB")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise TraceError("trace file is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise TraceError(f"trace file is not valid JSON (truncated?): {err.msg} at line {err.lineno}") from None
    return validate_trace(data)
