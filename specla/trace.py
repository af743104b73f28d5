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
            "times_ms": {"draft", "verify", "accept", "commit", "idle"}, "lattice": {...} | null}
    (graphed: "idle" is the time the GPU waited for the host before the step's batch began)
"""
from __future__ import annotations

import datetime
import json
import math
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

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
             for k in ("draft", "verify", "accept", "commit", "idle")}
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
    """A complete trace of `steps`; `decode` gives the text of every token id it mentions."""
    tokens, sources, step_of = output_tokens(steps)
    trace = {
        "schema": SCHEMA, "version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model, "settings": settings, "prompt": prompt, "prompt_tokens": prompt_tokens,
        "token_text": {},
        "steps": steps,
        "output": {"tokens": tokens, "sources": sources, "step_of": step_of, "text": decode(tokens)},
        "summary": summarize(steps, seconds, baseline),
        "baseline": baseline,
    }
    ids = sorted({token for token, _ in token_ids(trace) if _is_token(token)})
    trace["token_text"] = {str(i): decode([i]) for i in ids}
    return trace


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_ids(trace: dict) -> Iterator[tuple[Any, str]]:
    """Every token id a trace mentions, with where it sits (for messages).

    The views show the text of each of these, so `token_text` must hold all of them.
    """
    for token in trace.get("prompt_tokens") or []:
        yield token, "the prompt"
    output_ids = (trace.get("output") or {}).get("tokens")
    for token in output_ids if isinstance(output_ids, list) else []:
        yield token, "the output"
    for i, step in enumerate(trace.get("steps") or []):
        where = f"step {i}"
        tree = step.get("tree") or {}
        for key, values in (("tree", tree.get("tokens")), ("target choices", step.get("target_choice")),
                            ("accepted tokens", step.get("accepted_tokens")),
                            ("new tokens", step.get("new_tokens"))):
            for token in values if isinstance(values, list) else []:
                yield token, f"{where}'s {key}"
        if "bonus" in step:
            yield step["bonus"], f"{where}'s bonus token"
        for node in tree.get("pruned") or []:
            if isinstance(node, dict):
                for key in ("token", "parent_token"):
                    if key in node:
                        yield node[key], f"{where}'s pruned nodes"
        lattice = step.get("lattice")
        if isinstance(lattice, dict):
            # a malformed lattice only shows less in its view; the token ids it does hold need text
            for row in lattice.get("candidates") or []:
                for token in row if isinstance(row, list) else []:
                    yield token, f"{where}'s lattice"
            truth = lattice.get("truth")
            for token in truth if isinstance(truth, list) else []:
                yield token, f"{where}'s lattice"


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise TraceError(message)


def validate_trace(data: Any) -> dict:
    """Check a trace deeply enough that every view can draw it, and its invariant.

    Used on load (`load_trace`, replay) and before an export; returns `data` unchanged.
    """
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
    check_consistency(data)
    return data


def check_consistency(trace: dict) -> None:
    """The invariant every trace keeps, whether complete, partial or cut short by Stop.

    The output is the steps' new tokens in order; the summary counts exactly those tokens
    and one target forward per step; every token id mentioned has its text. A TraceError
    names the first broken rule.
    """
    steps, output, summary = trace["steps"], trace["output"], trace["summary"]
    for i, step in enumerate(steps):
        _require(step.get("index") == i, f"step {i} is numbered {step.get('index')!r}: steps must be 0, 1, 2, ...")
        made = step["accepted_tokens"] + [step.get("bonus")]
        new = step["new_tokens"]
        _require(0 < len(new) <= len(made) and new == made[:len(new)],
                 f"step {i}: its new tokens are not its accepted tokens plus the bonus (cut at the end)")
        _require(len(new) == len(made) or i == len(steps) - 1,
                 f"step {i} kept fewer tokens than it verified, but only a run's last step is cut")
    tokens, sources, step_of = output_tokens(steps)
    _require(output.get("tokens") == tokens, "the output tokens are not the steps' new tokens in order")
    _require(output.get("sources") == sources and output.get("step_of") == step_of,
             "the output's sources or step numbers do not match its tokens")
    _require(summary.get("new_tokens") == len(tokens),
             f"the summary counts {summary.get('new_tokens')!r} new tokens but the steps made {len(tokens)}")
    _require(summary.get("target_forwards") == len(steps),
             f"the summary counts {summary.get('target_forwards')!r} target forwards but there are "
             f"{len(steps)} steps")
    spread = summary.get("speedup_spread")
    if spread is not None:
        _require(isinstance(spread, list) and len(spread) == 2
                 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in spread)
                 and spread[0] <= spread[1], "the summary's speedup_spread is not [min, max]")
    text = trace["token_text"]
    for token, where in token_ids(trace):
        _require(_is_token(token), f"{where} holds {token!r}, which is not a token id")
        _require(str(token) in text, f"token id {token} in {where} has no text in token_text")


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


def visible(text: str, limit: int | None = None, spaces: bool = False) -> str:
    """Token text with whitespace and control characters made visible (plain text).

    `spaces` shows spaces as "·" too (short labels, where a space token would vanish).
    """
    if text == "":
        return "∅"
    out = []
    for ch in text:
        if ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("→")
        elif ch == " " and spaces:
            out.append("·")
        elif ord(ch) < 0x20:
            out.append(chr(0x2400 + ord(ch)))
        elif ch == "\x7f":
            out.append("␡")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    s = "".join(out)
    if limit is not None and len(s) > limit:
        s = s[:limit - 1] + "…"
    return s
