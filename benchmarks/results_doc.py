"""Build docs/RESULTS.md from the measured JSON files under benchmarks/results/.

    python benchmarks/results_doc.py                       # writes docs/RESULTS.md
    python benchmarks/results_doc.py --results DIR --out FILE

Every table is read from a result file and names that file, its command, commit, date and
device. The files come from several tools, so each is recognised by its shape: rows of
decoding runs (e2e, head and acceptance suites), exactness checks, AR runtimes, training
summaries. A file of another shape is listed by name; a file that cannot be read is listed
with the reason. Nothing here measures anything.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "RESULTS.md"
HEADER = """# Results

Built by `python benchmarks/results_doc.py` from the JSON files under
[`benchmarks/results/`](../benchmarks/results/); do not edit by hand. Each section is one
file: its command, commit and device, then its numbers (medians where a run was repeated).
The narrative of each GPU session, with every device command, is in
[`benchmarks/results/h200/README.md`](../benchmarks/results/h200/README.md).
"""


def median(value: Any) -> float | None:
    """A number, or the median of a {"median": ...} measurement."""
    if isinstance(value, dict):
        value = value.get("median")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def fmt(value: Any, digits: int = 3, suffix: str = "") -> str:
    number = median(value)
    return "" if number is None else f"{number:.{digits}f}{suffix}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def provenance(data: dict) -> str:
    """command, commit, date and device of a result file, as far as it records them."""
    env = data.get("environment") if isinstance(data.get("environment"), dict) else {}
    git = env.get("git") if isinstance(env.get("git"), dict) else {}
    command = env.get("command") or data.get("command")
    commit = git.get("commit") or data.get("commit") or data.get("git_commit")
    date = env.get("date") or data.get("date")
    device = env.get("gpu") or data.get("device") or env.get("device")
    if env.get("device") == "cpu" and env.get("cpu_count"):
        device = f"CPU, {env['cpu_count']} cores, {env.get('torch_threads', '?')} torch threads"
    parts = [f"`{command}`" if command else None, f"commit {str(commit)[:7]}" if commit else None,
             str(date)[:10] if date else None, str(device) if device else None]
    return " · ".join(p for p in parts if p) or "no command or commit recorded"


def exact_cell(exact: Any) -> str:
    """Whether a row's output equalled AR: mismatching prompts, or unexcused divergences."""
    if not isinstance(exact, dict) or not exact:
        return ""
    for key in ("mismatching_prompts", "unexcused"):
        if isinstance(exact.get(key), (int, list)):
            n = exact[key] if isinstance(exact[key], int) else len(exact[key])
            if n:
                return f"no ({n})"
            return "near-ties only" if exact.get("divergences") else "yes"
    if "equal_to_ar" in exact:
        return "yes" if exact["equal_to_ar"] else "near-ties only" if exact.get("unexcused") == [] else "no"
    return ""


def run_rows(rows: list[dict]) -> list[str]:
    """Decoding rows (e2e, head, acceptance suites): whatever columns they have."""
    columns: list[tuple[str, Callable[[dict], str]]] = [
        ("row", lambda r: r.get("name") or " / ".join(str(r[k]) for k in ("drafter", "settings", "tree") if k in r)),
        ("alpha", lambda r: fmt(r.get("alpha"), 1)),
        ("top-k, budget", lambda r: f"{r['top_k']}, {r['budget']}" if "top_k" in r and "budget" in r else ""),
        ("tau", lambda r: fmt(r.get("tau"), 2)),
        ("ms/token", lambda r: fmt(r.get("ms_per_token"))),
        ("AR ms/token", lambda r: fmt(r.get("ar_ms_per_token"))),
        ("speedup", lambda r: fmt(r.get("speedup"), 2, "x")),
        ("exact", lambda r: exact_cell(r.get("exact")) or (
            ("yes" if r["mismatching_prompts"] == 0 else f"no ({r['mismatching_prompts']})")
            if isinstance(r.get("mismatching_prompts"), int) else "")),
        ("note", lambda r: f"skipped ({r['skipped']})" if r.get("skipped") else ""),
    ]
    cells = [[fn(r) if isinstance(r, dict) else "" for _, fn in columns] for r in rows]
    keep = [i for i, (name, _) in enumerate(columns) if any(row[i] for row in cells)]
    return table([columns[i][0] for i in keep], [[row[i] for i in keep] for row in cells])


def render_runs(data: dict) -> list[str] | None:
    out = []
    sections = [("", data)] + [(key, data[key]) for key in ("pair", "oracle") if isinstance(data.get(key), dict)]
    for key, section in sections:
        rows = section.get("rows")
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            if key:
                what = {"pair": "the embedded target and its drafters",
                                    "oracle": "an oracle drafter right with probability alpha"}[key]
                size = ", ".join(f"{k.replace('_', ' ')} {section[k]}" for k in ("prompts", "new_tokens")
                                 if isinstance(section.get(k), int))
                out += [f"*{key}: {what}{' (' + size + ')' if size else ''}*", ""]
            out += run_rows(rows) + [""]
    return out or None


def render_exactness(data: dict) -> list[str] | None:
    results = data.get("results")
    if not (isinstance(results, list) and results and all(isinstance(r, dict) and "mode" in r for r in results)):
        return None
    rows = [[str(r.get("mode")), "deferred" if r.get("deferred") else "immediate", str(r.get("prompts", "")),
             str(r.get("mismatching_prompts", "")), str(r.get("near_ties", ""))] for r in results]
    return table(["verification", "commit", "prompts", "mismatching prompts", "near-ties"], rows) + [""]


def render_runtime(data: dict) -> list[str] | None:
    models = data.get("models")
    if not isinstance(models, dict):
        return None
    rows = []
    for model, entry in models.items():
        result = entry.get("result", entry) if isinstance(entry, dict) else {}
        for variant, v in (result.get("variants") or {}).items():
            if isinstance(v, dict):
                rows.append([model, variant, fmt(v.get("ms_per_token")), fmt(v.get("fraction_of_floor"), 2)])
    return table(["model", "AR variant", "ms/token", "share of memory floor"], rows) + [""] if rows else None


def render_training(data: dict) -> list[str] | None:
    keys = ("parameters", "tokens_seen", "minutes", "minutes_used", "best_heldout_loss", "best_heldout_ppl",
            "tokens_per_second", "stopped")
    found = [(k, data[k]) for k in keys if k in data and not isinstance(data[k], (dict, list))]
    if len(found) < 2:
        return None
    return table(["field", "value"], [[k.replace("_", " "), f"{v:.4g}" if isinstance(v, float) else str(v)]
                                      for k, v in found]) + [""]


def render_sets(data: dict) -> list[str] | None:
    """Rows measured on several prompt sets (run_acceptance.py): tau (and the speedup) per set."""
    rows, sets = data.get("rows"), data.get("sets")
    if not (isinstance(rows, list) and rows and isinstance(sets, dict)
            and all(isinstance(r, dict) and isinstance(r.get("sets"), dict) for r in rows)):
        return None
    names = list(sets)
    speed = any("speedup" in (r["sets"].get(n) or {}) for r in rows for n in names)
    header = ["row", "top-k, budget"] + [f"{n} tau" for n in names]
    header += [f"{n} speedup" for n in names] if speed else []
    header += ["exact"]
    body = []
    for r in rows:
        opts = r.get("options") or []
        label = " / ".join(str(r[k]) for k in ("drafter", "tree") if k in r)
        label += f" ({', '.join(f'{k}={v}' for k, v in (opts.items() if isinstance(opts, dict) else []))})" \
            if isinstance(opts, dict) and opts else ""
        cells = [label, f"{r.get('top_k')}, {r.get('budget')}"]
        cells += [fmt((r["sets"].get(n) or {}).get("tau"), 3) for n in names]
        if speed:
            cells += [fmt((r["sets"].get(n) or {}).get("speedup"), 2, "x") for n in names]
        bad = sum((r["sets"].get(n) or {}).get("mismatching_prompts") or 0 for n in names)
        cells.append("yes" if bad == 0 else f"no ({bad})")
        body.append(cells)
    return table(header, body) + ["", "Prompt sets: " + ", ".join(f"{n} ({k} prompts)" for n, k in sets.items())
                                  + ".", ""]


def render_app_vs_bench(data: dict) -> list[str] | None:
    """The app driven over HTTP against the bench's rows for the same settings."""
    cases = data.get("cases")
    if not (isinstance(cases, dict) and cases and all(isinstance(c, dict) for c in cases.values())):
        return None
    def mid(values: Any) -> float | None:
        values = [v for v in values or [] if isinstance(v, (int, float))]
        return statistics.median(values) if values else None

    body = []
    for name, c in cases.items():
        body.append([name, fmt(mid(c.get("app_speedups")), 2, "x"), fmt(c.get("bench_speedup"), 2, "x"),
                     fmt(c.get("app_over_bench_speedup"), 3), fmt(mid(c.get("app_ar_tokens_per_s")), 0),
                     fmt(c.get("bench_ar_tokens_per_s"), 0), fmt(mid(c.get("app_tau")), 2),
                     fmt(mid(c.get("seconds_to_first_step")), 2)])
    header = ["case", "app speedup", "bench speedup", "app / bench", "app AR tokens/s", "bench AR tokens/s",
              "tau", "s to first step (median)"]
    lines = [f"{data.get('prompts')} prompts of `{Path(str(data.get('prompt_file'))).name}` x "
             f"{data.get('new_tokens')} tokens.", ""]
    return lines + table(header, body) + [""]


RENDERERS = (render_app_vs_bench, render_sets, render_runs, render_exactness, render_runtime, render_training)


def render_file(path: Path, root: Path) -> tuple[list[str], bool]:
    """A section for one file, and whether any renderer recognised it."""
    name = path.relative_to(root).as_posix()
    head = [f"### [`{name}`](../benchmarks/results/{name})", ""]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return head + [f"Could not be read: {err}", ""], True
    if not isinstance(data, dict):
        return [], False
    for render in RENDERERS:
        try:
            body = render(data)
        except (TypeError, KeyError, ValueError, AttributeError):   # an unexpected shape: try the next
            body = None
        if body:
            return head + [provenance(data), ""] + body, True
    return [], False


def build(results: Path = RESULTS) -> str:
    """The whole document for the JSON files under `results` (an empty list when there are none)."""
    lines = [HEADER]
    # a folder's own files first, then its subfolders, so each folder gets one heading
    files = sorted(results.rglob("*.json"), key=lambda p: (p.parent.relative_to(results).parts, p.name)) \
        if results.is_dir() else []
    if not files:
        return "\n".join(lines + [f"No result files under `{results.name}/` yet.", ""])
    unrecognised, folder = [], None
    for path in files:
        section, known = render_file(path, results)
        if not known:
            unrecognised.append(path.relative_to(results).as_posix())
            continue
        parent = path.parent.relative_to(results).as_posix()
        if parent != folder:
            folder = parent
            lines += [f"## {'benchmarks/results/' + parent if parent != '.' else 'benchmarks/results'}", ""]
        lines += section
    if unrecognised:
        lines += ["## Other result files", "", "Kept with their raw numbers, not tabulated here: "
                  + ", ".join(f"`{name}`" for name in unrecognised) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result JSON files")
    ap.add_argument("--out", type=Path, default=OUT, help="the Markdown file to write")
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(build(args.results), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
