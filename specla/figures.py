"""The explorer's views, each built from a trace dict (docs/TRACE.md) and a step index.

    token_html      the text, every token coloured by where it came from, with hover details
    step_html       one step in words: what was drafted, accepted, rejected
    tree_figure     the draft tree of a step, the accepted path and the bonus token
    lattice_figure  the LiLiCorr lattice of a step (slots x top-k) with the chosen path
    commit_figure   what each commit wrote: tokens, factor bytes vs dense snapshots, time
    speedup_figure  tokens/s against the AR baseline of the same run, tau, time per phase

One colour means one thing within a view; every figure has a title, axis labels, a legend
and a fixed `uirevision`, so zoom survives streamed updates. Figures stay lean: one trace
per kind of mark, no per-point styling where a colour scale does.
"""
from __future__ import annotations

import html
import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specla.trace import max_depth_of, predicted_tau, visible
from specla.tree import DraftTree

# Okabe-Ito colours (colour-blind safe)
PROMPT, DRAFT, BONUS, REJECTED = "#6b7280", "#0072B2", "#E69F00", "#D55E00"
PHASES = {"draft": "#56B4E9", "verify": "#009E73", "accept": "#F0E442", "commit": "#D55E00",
          "idle": "#999999"}     # idle: the GPU waiting for the host between batches of steps
PRUNED = "#c4c4c4"
LEAN = go.layout.Template(layout=dict(
    font=dict(family="sans-serif", size=12), paper_bgcolor="white", plot_bgcolor="white",
    xaxis=dict(gridcolor="#eeeeee", zeroline=False), yaxis=dict(gridcolor="#eeeeee", zeroline=False),
    margin=dict(l=60, r=20, t=70, b=50), hoverlabel=dict(font=dict(family="monospace"))))
HEIGHT = 420


def _layout(fig: go.Figure, title: str, view: str, height: int = HEIGHT, side_legend: bool = False) -> go.Figure:
    legend = dict(orientation="v", x=1.02, y=1, xanchor="left") if side_legend else \
        dict(orientation="h", y=-0.18, x=0)
    fig.update_layout(template=LEAN, title=dict(text=title, x=0.01, font=dict(size=14)), height=height,
                      uirevision=view, legend=dict(legend, traceorder="normal"))
    return fig


def empty_figure(title: str, message: str, view: str = "empty") -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=13, color="#555555"), align="center")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, view, height=260)


# ---------------------------------------------------------------------------------------
# text


def escape(text: str) -> str:
    """Text for HTML content and for plotly labels, escaped exactly once.

    Only &, < and > are escaped: plotly's SVG text reads those three entities back but
    shows `&quot;` literally, and quotes need no escaping outside attributes.
    """
    return html.escape(text, quote=False)


def plural(n: int, word: str, words: str | None = None) -> str:
    """"1 token", "2 tokens" ("1 step", "0 steps")."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def speedup_spread(summary: dict) -> tuple[float, float] | None:
    """The [min, max] speedup of the alternating measurements, when the summary has it."""
    spread = summary.get("speedup_spread")
    if isinstance(spread, (list, tuple)) and len(spread) == 2 and all(_num(v) is not None for v in spread):
        return float(spread[0]), float(spread[1])
    return None


def _text_html(text: str) -> str:
    """Escaped token text for the running text: markers for \\n and \\t, then the real break."""
    shown = escape(visible(text))
    shown = shown.replace("↵", '<span style="color:#9ca3af">↵</span><br>')
    return shown.replace("→", '<span style="color:#9ca3af">→</span>\t')


def token_of(trace: dict, token: int) -> str:
    return trace.get("token_text", {}).get(str(token), f"<{token}>")


def label(trace: dict, token: int, limit: int = 8) -> str:
    """A token for plotly text (which reads HTML tags): visible, spaces shown, escaped once."""
    return escape(visible(token_of(trace, token), limit, spaces=True))


def quoted(trace: dict, token: int, limit: int = 24) -> str:
    """A token in quotes for hover texts and lists, escaped once."""
    return escape(repr(visible(token_of(trace, token), limit)))


def _fmt(p) -> str:
    return f"{p:.3f}" if isinstance(p, (int, float)) and math.isfinite(p) else "n/a"


def _token_details(trace: dict) -> list[tuple[str, str]]:
    """(source, hover title) for every output token."""
    steps = {s.get("index"): s for s in trace.get("steps", [])}
    out, position = [], {}
    output = trace.get("output", {})
    for token, source, idx in zip(output.get("tokens", []), output.get("sources", []), output.get("step_of", [])):
        pos = position.get(idx, 0)
        position[idx] = pos + 1
        step = steps.get(idx, {})
        nodes = step.get("accepted_nodes", [])
        if source == "draft" and pos + 1 < len(nodes):
            node = nodes[pos + 1]
            reported = (step.get("tree") or {}).get("logprobs") is not None
            draft_p = _fmt(_at(step.get("draft_probs"), node)) if reported else "not reported"
            title = (f"step {idx} · accepted draft · draft p {draft_p}"
                     f" · target p {_fmt(_at(step.get('target_probs'), node))}")
        else:
            title = f"step {idx} · bonus token: the target's own next token after the accepted drafts"
        out.append((source, f"{title} · {visible(token_of(trace, token), 40)!r}"))
    return out


def _at(values, i):
    return values[i] if isinstance(values, list) and 0 <= i < len(values) else None


def token_html(trace: dict | None, step: int | None = None) -> str:
    """The prompt and the output, every output token coloured by its source.

    Tokens of the selected step are underlined. Hover a token for its step and probabilities.
    """
    legend = ('<div style="font-size:13px;margin-bottom:6px">'
              f'<span style="color:{PROMPT}">■ prompt</span> &nbsp; '
              f'<span style="color:{DRAFT}">■ accepted draft token</span> &nbsp; '
              f'<span style="color:{BONUS}">■ bonus token (target\'s own)</span> &nbsp; '
              '<u>underlined</u>: the selected step · hover a token for details</div>')
    if not trace:
        return (f'<div class="specla-text">{legend}<div style="color:#6b7280">No run yet: type a prompt '
                'and press Run, or upload a saved trace.</div></div>')
    parts = [f'<span class="tok-prompt" style="color:{PROMPT}">{_text_html(trace.get("prompt", ""))}</span>']
    colours = {"draft": DRAFT, "bonus": BONUS}
    output = trace.get("output", {})
    for token, (source, title), idx in zip(output.get("tokens", []), _token_details(trace), output.get("step_of", [])):
        style = f"color:{colours.get(source, DRAFT)}"
        if source == "bonus":
            style += ";background:#fff4de"
        if idx == step:
            style += ";text-decoration:underline;text-decoration-thickness:2px"
        parts.append(f'<span class="tok tok-{source}" style="{style}" title="{html.escape(title)}">'
                     f'{_text_html(token_of(trace, token))}</span>')
    body = "".join(parts)
    return (f'<div class="specla-text">{legend}<div style="white-space:pre-wrap;font-family:monospace;'
            'font-size:14px;line-height:1.5;max-height:360px;overflow-y:auto;border:1px solid #e5e7eb;'
            f'border-radius:6px;padding:8px;tab-size:4">{body}</div></div>')


def step_html(trace: dict | None, step: int | None) -> str:
    """One step in words, and the rejected candidates next to the accepted path."""
    steps = (trace or {}).get("steps") or []
    if step is None or not 0 <= step < len(steps):
        return '<div class="specla-step" style="color:#6b7280">No step selected.</div>'
    s = steps[step]
    tree = s.get("tree", {})
    tokens, parents = tree.get("tokens", []), tree.get("parents", [])
    path = s.get("accepted_nodes", [0])
    on_path = set(path)
    has_draft_p = tree.get("logprobs") is not None
    t = s.get("times_ms", {})
    times = " · ".join(f"{k} {v:.2f} ms" for k, v in t.items() if isinstance(v, (int, float)))
    n_new = len(s.get("new_tokens", []))
    lines = [f"<b>Step {s.get('index', step)}</b>: {plural(len(tokens) - 1, 'drafted node')} (depth "
             f"{max_depth_of(s) if parents else 0}), {len(s.get('accepted_tokens', []))} accepted + 1 bonus "
             f"→ {plural(n_new, 'new token')} · verified as <b>{escape(str(s.get('mode')))}</b>"
             f" · {escape(times)}"]
    cut = truncation(trace, step)
    if cut:
        lines.append(f'<span style="color:{REJECTED}">{escape(cut)}</span>')
    rejected = []
    choice = s.get("target_choice") or []
    for node in path:
        for kid in (i for i, p in enumerate(parents) if p == node and i not in on_path):
            want = _at(choice, node)
            draft_p = _fmt(_at(s.get("draft_probs"), kid)) if has_draft_p else "not reported"
            rejected.append(f"<li>after node {node}: drafted <code>{quoted(trace, tokens[kid])}"
                            f"</code> (draft p {draft_p}, target p "
                            f"{_fmt(_at(s.get('target_probs'), kid))})"
                            + (f"; the target wanted <code>{quoted(trace, want)}</code>"
                               if want is not None else "") + "</li>")
    others = len(tokens) - len(on_path) - len(rejected)
    if rejected:
        shown = rejected[:12]
        more = len(rejected) - len(shown) + others
        lines.append(f'<span style="color:{REJECTED}">Rejected candidates next to the accepted path:</span>'
                     f"<ul style='margin:2px 0'>{''.join(shown)}</ul>"
                     + (f"and {plural(more, 'more node')} below them." if more > 0 else ""))
    else:
        lines.append("Every drafted node was accepted." if len(on_path) == len(tokens)
                     else f"{plural(others, 'drafted node')} lay below rejected ones.")
    return f'<div class="specla-step" style="font-size:13px">{"<br>".join(lines)}</div>'


def truncation(trace: dict, step: int) -> str:
    """Why a step kept fewer tokens than it verified (accepted + bonus), or "" if it kept them all.

    Only a run's last step is cut: by the end-of-text token, or by max new tokens.
    """
    s = trace["steps"][step]
    made = len(s.get("accepted_tokens", [])) + 1
    new = s.get("new_tokens", [])
    if len(new) >= made:
        return ""
    dropped = plural(made - len(new), "more token")
    eos = ((trace.get("model") or {}).get("config") or {}).get("eos_token_id")
    if new and eos is not None and new[-1] == eos:
        return (f"Cut to {plural(len(new), 'token')}: the end-of-text token ends the run, so the "
                f"{dropped} verified after it {'is' if made - len(new) == 1 else 'are'} not kept.")
    limit = (trace.get("settings") or {}).get("max_new_tokens")
    reached = f"max new tokens ({limit})" if isinstance(limit, int) else "max new tokens"
    return (f"Cut to {plural(len(new), 'token')}: this step reached {reached}, so the {dropped} "
            f"verified here {'is' if made - len(new) == 1 else 'are'} not kept.")


# ---------------------------------------------------------------------------------------
# draft tree


def tidy_layout(children: dict[int, list[int]], root: int = 0) -> dict[int, tuple[float, float]]:
    """Leaves on consecutive slots, each parent at the midpoint of its children (x = depth)."""
    pos: dict[int, tuple[float, float]] = {}
    next_slot = 0

    def place(node: int, depth: int) -> float:
        nonlocal next_slot
        kids = children.get(node, [])
        if kids:
            slots = [place(k, depth + 1) for k in kids]
            slot = (slots[0] + slots[-1]) / 2
        else:
            slot, next_slot = next_slot, next_slot + 1
        pos[node] = (depth, -slot)
        return slot

    place(root, 0)
    return pos


def tree_figure(trace: dict | None, step: int | None) -> go.Figure:
    steps = (trace or {}).get("steps") or []
    if step is None or not 0 <= step < len(steps):
        return empty_figure("Draft tree", "No step to show yet.", "tree")
    s = steps[step]
    t = s["tree"]
    tree = DraftTree(t["tokens"], t["parents"])
    graph = tree.to_networkx()
    n = len(tree)
    pruned = [p for p in (t.get("pruned") or []) if isinstance(p, dict)
              and isinstance(p.get("parent"), int) and 0 <= p["parent"] < n][:256]
    for j, p in enumerate(pruned):
        graph.add_edge(p["parent"], n + j)
    pos = tidy_layout({v: list(graph.successors(v)) for v in graph.nodes})
    path = s.get("accepted_nodes") or [0]
    on_path = set(path)
    choice = s.get("target_choice") or []
    dp, tp = s.get("draft_probs") or [], s.get("target_probs") or []
    has_draft_p = t.get("logprobs") is not None

    fig = go.Figure()
    ex, ey = [], []
    for parent, child in graph.edges:
        if child < n:
            ex += [pos[parent][0], pos[child][0], None]
            ey += [pos[parent][1], pos[child][1], None]
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#9ca3af", width=1),
                             hoverinfo="skip", name="drafted edge"))
    if pruned:
        px, py, hx, hy, hover = [], [], [], [], []
        for j, p in enumerate(pruned):
            (x0, y0), (x1, y1) = pos[p["parent"]], pos[n + j]
            px += [x0, x1, None]
            py += [y0, y1, None]
            hx.append(x1)
            hy.append(y1)
            lp = p.get("logprob")
            hover.append(f"pruned before verification ({escape(str(p.get('reason', 'confidence')))})<br>"
                         f"token {quoted(trace, p.get('token', -1))}"
                         + (f"<br>draft log p {lp:.3f}" if isinstance(lp, (int, float)) else ""))
        fig.add_trace(go.Scatter(x=px, y=py, mode="lines", line=dict(color=PRUNED, width=1, dash="dot"),
                                 hoverinfo="skip", showlegend=False))
        fig.add_trace(go.Scatter(x=hx, y=hy, mode="markers", marker=dict(color=PRUNED, size=8, symbol="x"),
                                 hovertext=hover, hoverinfo="text", name="pruned (not verified)"))
    order = list(range(1, n)) + [0]     # the root last, so the legend shows a drafted node
    hover, labels = [], []
    for i in order:
        want = _at(choice, i)
        hover.append(
            f"node {i} · depth {tree.depths[i]}{' · root (last step’s bonus)' if i == 0 else ''}<br>"
            f"token {quoted(trace, tree.tokens[i])}<br>"
            f"draft p {_fmt(_at(dp, i)) if has_draft_p else 'not reported'} · target p {_fmt(_at(tp, i))}"
            + (f"<br>target argmax next: {quoted(trace, want)}" if want is not None else "")
            + ("<br>accepted" if i in on_path else ""))
        labels.append(label(trace, tree.tokens[i]) if n <= 48 else "")
    colour = dict(color=[_num(_at(dp, i)) or 0.0 for i in order],
                  cmin=0, cmax=1, colorscale="Viridis", showscale=True,
                  colorbar=dict(title=dict(text="draft p"), thickness=12, len=0.8)) if has_draft_p else \
        dict(color=DRAFT)
    fig.add_trace(go.Scatter(
        x=[pos[i][0] for i in order], y=[pos[i][1] for i in order], mode="markers+text",
        text=labels, textposition="top center", textfont=dict(size=10, family="monospace"),
        marker=dict(size=[14 if i == 0 else 11 for i in order],
                    symbol=["square" if i == 0 else "circle" for i in order],
                    line=dict(color="#111827", width=1), **colour),
        hovertext=hover, hoverinfo="text", customdata=order,
        name="drafted node (colour: draft p)" if has_draft_p else "drafted node (drafter reports no p)"))
    fig.add_trace(go.Scatter(x=[pos[i][0] for i in path], y=[pos[i][1] for i in path], mode="lines+markers",
                             line=dict(color=DRAFT, width=4), marker=dict(size=6, color=DRAFT),
                             hoverinfo="skip", name="accepted path"))
    last = pos[path[-1]]
    star = (last[0] + 1, last[1] - 0.5)   # below the slot of a rejected child, never on it
    bonus = s.get("bonus")
    fig.add_trace(go.Scatter(
        x=[star[0]], y=[star[1]], mode="markers+text", text=[label(trace, bonus)],
        textposition="bottom center",
        marker=dict(symbol="star", size=18, color=BONUS, line=dict(color="#111827", width=1)),
        hovertext=[f"+1 bonus token {quoted(trace, bonus)}: the target's own next token "
                   "after the accepted path (next step's root)"], hoverinfo="text", name="+1 bonus token"))
    fig.add_shape(type="line", x0=last[0], y0=last[1], x1=star[0], y1=star[1],
                  line=dict(color=BONUS, width=2, dash="dash"), layer="below")
    ys = [y for _, y in pos.values()] + [star[1]]
    fig.update_xaxes(title_text="depth (tokens after the root)", dtick=1)
    fig.update_yaxes(title_text="sibling slot", showticklabels=False, range=[min(ys) - 0.8, max(ys) + 0.8])
    return _layout(fig, f"Draft tree of step {s.get('index', step)}: {plural(n - 1, 'drafted node')}, "
                        f"{len(path) - 1} accepted + bonus", "tree")


# ---------------------------------------------------------------------------------------
# LiLiCorr lattice


LATTICE_SCALE = "Blues"
LATTICE_ZMIN, LATTICE_ZMAX = -8.0, 0.0
FRAME = 0.44       # half the side of a cell frame, in cell units (a cell is 1 x 1)


def text_colour_on(z: float | None) -> str:
    """Black or white, whichever reads better on the lattice colour of log-probability z.

    The cell colour is sampled from the heatmap's own colour scale and the text colour picked
    by the WCAG contrast ratio against it.
    """
    from plotly.colors import sample_colorscale, unlabel_rgb

    if z is None:
        return "#111827"
    t = min(1.0, max(0.0, (z - LATTICE_ZMIN) / (LATTICE_ZMAX - LATTICE_ZMIN)))
    rgb = unlabel_rgb(sample_colorscale(LATTICE_SCALE, [t])[0])

    def channel(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    lum = 0.2126 * channel(rgb[0]) + 0.7152 * channel(rgb[1]) + 0.0722 * channel(rgb[2])
    # contrast with white (1.05 / (lum + 0.05)) against contrast with black ((lum + 0.05) / 0.05)
    return "#ffffff" if 1.05 / (lum + 0.05) > (lum + 0.05) / 0.05 else "#111827"


def _frames(cells: list[tuple[int, int]], half: float) -> tuple[list, list]:
    """One polyline of square frames around lattice cells (slot, rank), None-separated."""
    xs, ys = [], []
    for x, y in cells:
        xs += [x - half, x + half, x + half, x - half, x - half, None]
        ys += [y - half, y - half, y + half, y + half, y - half, None]
    return xs, ys


def lattice_figure(trace: dict | None, step: int | None) -> go.Figure:
    """The LiLiCorr lattice of a step: candidate tokens in cells, paths as frames around them.

    Frames and lines never cross a cell's text: the chosen path and the target's tokens are
    frames, the top-1 path a line along rank 0's upper edge, pair scores a row above.
    """
    steps = (trace or {}).get("steps") or []
    if step is None or not 0 <= step < len(steps):
        return empty_figure("LiLiCorr lattice", "No step to show yet.", "lattice")
    lat = steps[step].get("lattice")
    cands = (lat or {}).get("candidates")
    if not lat or not isinstance(cands, list) or not cands or not all(isinstance(r, list) and r for r in cands):
        drafter = escape(visible(str((trace.get("settings") or {}).get("drafter", "this")), 24))
        return empty_figure("LiLiCorr lattice",
                            f"No lattice in this step: the {drafter} drafter does not build one.<br>"
                            "Only the LiLiCorr drafter proposes a slots × top-k lattice of candidates<br>"
                            "and picks a coherent path through it; choose it in the drafter menu.", "lattice")
    S, k = len(cands), max(len(r) for r in cands)
    logp = lat.get("logprobs") or lat.get("log_probs") or []
    z = [[_num(_at(_at(logp, s) or [], j)) for s in range(S)] for j in range(k)]
    text = [[label(trace, cands[s][j]) if j < len(cands[s]) else "" for s in range(S)] for j in range(k)]
    slots = list(range(1, S + 1))
    fig = go.Figure(go.Heatmap(
        x=slots, y=list(range(k)), z=z, text=text, zmin=LATTICE_ZMIN, zmax=LATTICE_ZMAX, colorscale=LATTICE_SCALE,
        colorbar=dict(title=dict(text="drafter log p"), thickness=12),
        hovertemplate="slot %{x} · rank %{y}<br>token %{text}<br>log p %{z:.2f}<extra></extra>",
        name="candidates"))
    cells = [(s, j) for j in range(k) for s in range(S) if text[j][s]]
    fig.add_trace(go.Scatter(
        x=[s + 1 for s, _ in cells], y=[j for _, j in cells], mode="text", text=[text[j][s] for s, j in cells],
        textfont=dict(size=11, family="monospace", color=[text_colour_on(z[j][s]) for s, j in cells]),
        hoverinfo="skip", showlegend=False, name="candidate tokens"))
    fig.add_trace(go.Scatter(x=[0.5, S + 0.5], y=[-0.5, -0.5], mode="lines", hoverinfo="skip",
                             line=dict(color="#6b7280", width=2, dash="dash"),
                             name="top-1 path = rank 0 (block drafter alone)"))
    chosen = [c for c in (lat.get("chosen") or []) if isinstance(c, int)][:S]
    if chosen:
        fx, fy = _frames([(s + 1, c) for s, c in enumerate(chosen)], FRAME)
        fig.add_trace(go.Scatter(x=fx, y=fy, mode="lines", line=dict(color=BONUS, width=3), hoverinfo="skip",
                                 name="chosen path (LiLiCorr)"))
        pair = lat.get("pair_scores") or _path_pairs(lat.get("pair"), chosen)
        scores = [(s + 1.5, _num(_at(pair, s))) for s in range(min(len(chosen) - 1, len(pair)))]
        if scores:
            fig.add_trace(go.Scatter(x=[x for x, _ in scores], y=[-0.85] * len(scores), mode="text",
                                     text=[f"{v:.1f}" if v is not None else "" for _, v in scores],
                                     textfont=dict(color="#7c2d12", size=10), hoverinfo="skip",
                                     name="pair score on the chosen path (above, between slots)"))
    truth = lat.get("truth") or []
    hits = [(s + 1, cands[s].index(token)) for s, token in enumerate(truth[:S]) if token in cands[s]]
    if hits:
        tx, ty = _frames(hits, FRAME - 0.07)
        fig.add_trace(go.Scatter(x=tx, y=ty, mode="lines", line=dict(color=REJECTED, width=2, dash="dot"),
                                 hoverinfo="skip", name="target's token (truth)"))
    fig.update_xaxes(title_text="slot (position after the root)", dtick=1, range=[0.5, S + 0.5])
    fig.update_yaxes(title_text="candidate rank (top-k)", autorange=False, range=[k - 0.5, -1.1],
                     tickvals=list(range(k)))
    pre = " · ".join(f"{name} prefix {lat.get(key)}" for name, key in
                     (("selected", "selected_prefix"), ("top-1", "top1_prefix"), ("oracle", "oracle_prefix"))
                     if lat.get(key) is not None)
    return _layout(fig, f"LiLiCorr lattice of step {steps[step].get('index', step)}: {pre} (of {plural(S, 'slot')})",
                   "lattice")


def _path_pairs(pair, chosen: list[int]) -> list:
    """pair[s][i][j] (slot s rank i -> slot s+1 rank j) read along the chosen ranks."""
    out = []
    for s in range(len(chosen) - 1):
        row = _at(_at(pair, s) or [], chosen[s])
        out.append(_at(row or [], chosen[s + 1]))
    return out


def _num(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


# ---------------------------------------------------------------------------------------
# state-factor commits


def commit_figure(trace: dict | None, step: int | None = None) -> go.Figure:
    steps = (trace or {}).get("steps") or []
    if not steps:
        return empty_figure("State commits", "No steps yet.", "commit")
    x = [s.get("index", i) for i, s in enumerate(steps)]
    c = [s.get("commit") or {} for s in steps]
    committed = [int(ci.get("folded_now", 0)) + int(ci.get("folded_in_verify", 0)) for ci in c]
    pending = [int(ci.get("pending_after", 0)) for ci in c]
    end = x[-1] + 1
    flush = pending[-1]
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.12, row_heights=[0.4, 0.32, 0.28],
                        subplot_titles=("tokens written into the state per step",
                                        "bytes kept per step (log scale)", "commit time and verification mode"))
    fig.add_trace(go.Bar(x=x + ([end] if flush else []), y=committed + ([flush] if flush else []),
                         marker_color=DRAFT, name="committed (folded into the state)",
                         hovertemplate="step %{x}: %{y} tokens folded<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=pending, marker_color="#a5c8e4", name="pending (deferred to the next verify)",
                         hovertemplate="step %{x}: %{y} tokens pending<extra></extra>"), row=1, col=1)
    for key, name, colour, dash in (("factor_bytes", "factors of the accepted path", DRAFT, "solid"),
                                    ("factor_bytes_all_nodes", "factors of all verified nodes", "#56B4E9", "dot"),
                                    ("dense_snapshot_bytes", "dense state snapshot per node (what it avoids)",
                                     REJECTED, "dash")):
        fig.add_trace(go.Scatter(x=x, y=[max(1, ci.get(key, 0) or 0) for ci in c], mode="lines+markers",
                                 line=dict(color=colour, dash=dash), marker=dict(size=4), name=name,
                                 hovertemplate="step %{x}: %{y:.3s}B<extra>" + name + "</extra>"), row=2, col=1)
    modes = [str(s.get("mode", "?")) for s in steps]
    commit_ms = [_num((s.get("times_ms") or {}).get("commit")) or 0.0 for s in steps]
    cap = axis_cap(commit_ms)
    labels = [m if cap is None or v <= cap else "" for m, v in zip(modes, commit_ms)]
    fig.add_trace(go.Bar(x=x, y=commit_ms, marker_color="#6b7280",
                         text=labels if len(steps) <= 40 else None, textposition="outside", textfont=dict(size=9),
                         cliponaxis=cap is None,
                         customdata=modes, name="commit time (label: verification mode)",
                         hovertemplate="step %{x}: commit %{y:.3f} ms · verified as %{customdata}<extra></extra>"),
                  row=3, col=1)
    _mark_clipped(fig, x, commit_ms, cap, row=3, col=1)
    fig.update_yaxes(title_text="tokens", row=1, col=1)
    fig.update_yaxes(title_text="bytes", type="log", row=2, col=1)
    fig.update_yaxes(title_text="ms", row=3, col=1, **({} if cap is None else {"range": [0, 1.25 * cap]}))
    fig.update_xaxes(title_text="step (the bar after the last step: flush at the end)", row=3, col=1)
    fig.update_layout(barmode="stack")
    _highlight(fig, step, steps, rows=3)
    deferred = (trace.get("settings") or {}).get("deferred")
    return _layout(fig, "State-factor commits: " + ("deferred (folded into the next verification)" if deferred
                                                    else "immediate (folded after each verification)"),
                   "commit", height=600, side_legend=True)


def axis_cap(values: list[float], quantile: float = 0.9, factor: float = 2.0) -> float | None:
    """An axis top that keeps bars readable when a few values are far above the rest.

    `factor` x the `quantile` of the values, when the largest value is above that (and
    there are at least 5 values); None when every bar fits as it is.
    """
    vals = sorted(v for v in values if _num(v) is not None and v >= 0)
    if len(vals) < 5:
        return None
    ref = vals[int(quantile * (len(vals) - 1))]
    cap = factor * ref
    return cap if ref > 0 and vals[-1] > cap else None


def _mark_clipped(fig: go.Figure, x: list, totals: list[float], cap: float | None, row: int, col: int) -> None:
    """A ▲ with the true value over every bar that the axis cap cuts off."""
    if cap is None:
        return
    over = [(xi, v) for xi, v in zip(x, totals) if v > cap]
    fig.add_trace(go.Scatter(
        x=[xi for xi, _ in over], y=[1.08 * cap] * len(over), mode="markers+text",
        marker=dict(symbol="triangle-up", size=10, color="#111827"), text=[f"{v:.1f} ms" for _, v in over],
        textposition="middle right", textfont=dict(size=10), cliponaxis=False,
        hovertemplate="step %{x}: %{text} (bar cut at the axis top)<extra></extra>",
        name="▲ bar above the axis (its value)"), row=row, col=col)


def _highlight(fig: go.Figure, step: int | None, steps: list, rows: int = 1, cols: int = 1) -> None:
    if step is None or not 0 <= step < len(steps):
        return
    x = steps[step].get("index", step)
    for r in range(1, rows + 1):
        for col in range(1, cols + 1):
            fig.add_vrect(x0=x - 0.5, x1=x + 0.5, fillcolor="#fde68a", opacity=0.35, line_width=0,
                          layer="below", row=r, col=col)


# ---------------------------------------------------------------------------------------
# speedup


def alpha_estimate(steps: list[dict]) -> float:
    """Per-token acceptance: accepted drafts / drafts the target tested (a rejection counts once)."""
    accepted = sum(len(s.get("accepted_tokens", [])) for s in steps)
    tested = sum(min(len(s.get("accepted_tokens", [])) + 1, max(1, max_depth_of(s))) for s in steps)
    return accepted / tested if tested else 0.0


def speedup_figure(trace: dict | None, step: int | None = None) -> go.Figure:
    steps = (trace or {}).get("steps") or []
    summary, baseline = (trace or {}).get("summary") or {}, (trace or {}).get("baseline") or {}
    if not steps:
        return empty_figure("Speedup", "No steps yet." + (" AR baseline measured: "
                            f"{baseline.get('tokens_per_s', 0):.1f} tokens/s." if baseline else ""), "speedup")
    model = trace.get("model") or {}
    hardware = escape(visible(str(model.get("hardware") or model.get("device") or "unknown hardware"), 80))
    spec, ar = summary.get("tokens_per_s", 0.0), baseline.get("tokens_per_s")
    x = [s.get("index", i) for i, s in enumerate(steps)]
    taus = [len(s.get("new_tokens", [])) for s in steps]
    fig = make_subplots(rows=2, cols=2, vertical_spacing=0.22, horizontal_spacing=0.08,
                        subplot_titles=("tokens/s, measured in this run", "tokens per target forward (τ)",
                                        "accepted drafts per step", "time per step by phase"))
    if ar:
        fig.add_trace(go.Bar(x=["AR"], y=[ar], marker_color="#d1d5db", name="AR tokens/s",
                             text=[f"{ar:.1f}"], textposition="outside", cliponaxis=False,
                             hovertemplate="AR baseline: %{y:.1f} tokens/s<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=["AR", "speculative"], y=[ar, ar], mode="lines",
                                 line=dict(color="#374151", dash="dash", width=2), name="AR baseline (dashed)",
                                 hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Bar(x=["speculative"], y=[spec], marker_color=DRAFT, name="speculative tokens/s",
                         text=[f"{spec:.1f}"], textposition="outside", cliponaxis=False,
                         hovertemplate="speculative: %{y:.1f} tokens/s<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=taus, mode="lines+markers", line=dict(color=DRAFT, width=1),
                             marker=dict(size=5), name="τ of each step (accepted + bonus)",
                             hovertemplate="step %{x}: τ %{y}<extra></extra>"), row=1, col=2)
    mean_tau = summary.get("tau", 0.0)
    alpha = alpha_estimate(steps)
    depths = [max(1, max_depth_of(s)) for s in steps]
    pred = sum(predicted_tau(alpha, d) for d in depths) / len(depths)
    span = [x[0], x[-1]] if len(x) > 1 else [x[0] - 0.5, x[0] + 0.5]
    fig.add_trace(go.Scatter(x=span, y=[mean_tau] * 2, mode="lines", line=dict(color="#111827", width=2),
                             name=f"measured mean τ = {mean_tau:.2f}", hoverinfo="skip"), row=1, col=2)
    fig.add_trace(go.Scatter(x=span, y=[pred] * 2, mode="lines", line=dict(color="#CC79A7", width=2, dash="dot"),
                             name=f"predicted E[τ] = {pred:.2f} (chain formula, α = {alpha:.2f})",
                             hoverinfo="skip"), row=1, col=2)
    hist = summary.get("accept_hist") or {}
    fig.add_trace(go.Bar(x=[int(k) for k in hist], y=list(hist.values()), marker_color="#0b4f7c",
                         name="steps by accepted drafts",
                         hovertemplate="%{y} steps accepted %{x} drafts<extra></extra>"),
                  row=2, col=1)
    totals = [0.0] * len(steps)
    for phase, colour in PHASES.items():
        ms = [_num((s.get("times_ms") or {}).get(phase)) or 0.0 for s in steps]
        totals = [t + v for t, v in zip(totals, ms)]
        fig.add_trace(go.Bar(x=x, y=ms, marker_color=colour,
                             name=f"{phase} ms", hovertemplate=f"step %{{x}}: {phase} %{{y:.3f}} ms<extra></extra>"),
                      row=2, col=2)
    step_cap = axis_cap(totals)
    _mark_clipped(fig, x, totals, step_cap, row=2, col=2)
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="tokens / s", range=[0, 1.2 * max(spec, ar or 0, 1e-9)], row=1, col=1)
    fig.update_yaxes(title_text="tokens", rangemode="tozero", row=1, col=2)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_yaxes(title_text="steps", row=2, col=1)
    fig.update_xaxes(title_text="accepted drafts in a step", dtick=1, row=2, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=2, **({} if step_cap is None else {"range": [0, 1.25 * step_cap]}))
    fig.update_xaxes(title_text="step", row=2, col=2)
    speed = summary.get("speedup")
    head = f"Speedup {speed:.2f}× vs AR" if isinstance(speed, (int, float)) else "Speedup (no AR baseline)"
    spread = speedup_spread(summary)
    if spread and isinstance(speed, (int, float)):
        head += f" ({spread[0]:.2f}× to {spread[1]:.2f}× over alternating runs)"
    launch = model.get("launch")
    if isinstance(launch, str):
        hardware += f" ({escape(launch)}, both sides)"
    fig = _layout(fig, f"{head} · measured in this run on {hardware} · batch 1, "
                       f"{'greedy' if not (trace.get('settings') or {}).get('temperature') else 'sampling'}",
                  "speedup", height=600, side_legend=True)
    return fig
