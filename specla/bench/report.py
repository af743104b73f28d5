"""report.md / report.html from the suites' JSON files."""
from __future__ import annotations

import json
from pathlib import Path

from specla.bench.common import fmt, num


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
               [r for r in p.get("rows") or [] if r.get("kind") != "oracle"])]
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
