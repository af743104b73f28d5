"""The Gradio page: prompt, decoding controls, Run / Step / Stop / Reset, and the views.

`Explorer` holds the event functions (plain Python, testable without a browser);
`build_demo` lays them out. Sessions keep their trace in `gr.State` (JSON-able dicts), the
model lives in the process; all model work shares one queue (`concurrency_id="model"`).
Every handler turns an exception into a warning and a status line: bad input never breaks
the page.
"""
from __future__ import annotations

import functools
import html
import json
import logging
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr

from specla import figures as F
from specla import runner
from specla.trace import TraceError, load_trace
from specla.tree import MAX_TREE_NODES

log = logging.getLogger("specla.explorer")
EXAMPLES_FILE = Path(__file__).resolve().parent.parent / "examples" / "prompts.jsonl"
FALLBACK_EXAMPLES = [["def fibonacci(n):\n"], ["import os\n\n\ndef main():\n"],
                     ["class Stack:\n    def __init__(self):\n"]]
# the settings controls, in the order the event functions receive them
CONTROLS = ("drafter", "oracle_alpha", "tree", "paths", "top_k", "block_size", "depth", "budget",
            "prune_tau", "mode", "deferred", "temperature", "top_p", "max_new_tokens", "seed")
CONTROL_DEFAULTS = {"drafter": None, "oracle_alpha": 0.8, "tree": "chain", "paths": "", "top_k": 4,
                    "block_size": 8, "depth": 6, "budget": 8, "prune_tau": 0.0, "mode": "auto", "deferred": True,
                    "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 64, "seed": 0}
N_VIEWS = 11   # status, text, step, slider, tree, lattice, commit, speedup, summary, trace, cursor
CSS = """
#status {min-height: 1.6em}
.specla-note {color: #92400e; background: #fffbeb; border-radius: 6px; padding: 4px 8px}
"""
INTRO = """# SpecLA Explorer
Exact speculative decoding for Gated DeltaNet, one step at a time. A **drafter** proposes a
chain or tree of tokens; the **target** verifies the whole tree in one forward pass from its
recurrent state; the longest path that matches the target is kept, **plus one bonus token**
the target adds itself; the state is then rebuilt from small per-token **factors**, never from
a rejected token. At temperature 0 the text equals plain autoregressive (AR) decoding token
for token; only the speed differs, and it is measured against AR in the same run."""


def load_examples(path: Path = EXAMPLES_FILE) -> tuple[list[list[str]], list[str] | None]:
    """Prompts from examples/prompts.jsonl ({"prompt": ..., "label": ...} a line); fallbacks if absent."""
    rows, labels = [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, str):
            prompt = item
        else:
            prompt = (item.get("prompt") or item.get("text")) if isinstance(item, dict) else None
        if isinstance(prompt, str) and prompt.strip():
            rows.append([prompt])
            label = item.get("label") or item.get("title") or item.get("name") if isinstance(item, dict) else None
            first_line = next(row for row in prompt.splitlines() if row.strip()).strip()
            labels.append(str(label) if label else first_line[:48] + ("…" if len(first_line) > 48 else ""))
    if not rows:
        return FALLBACK_EXAMPLES, None
    return rows[:24], labels[:24]


def control_values(runtime: runner.Runtime, **overrides) -> list:
    """Values of the settings controls in CONTROLS order (for tests and API clients)."""
    values = {**CONTROL_DEFAULTS, "drafter": next(iter(runtime.drafters)), **overrides}
    return [values[name] for name in CONTROLS]


def friendly(err: Exception) -> str:
    if isinstance(err, (ValueError, TraceError)):
        return str(err)
    log.error("event failed:\n%s", traceback.format_exc())
    return f"internal error ({type(err).__name__}: {err}); the page still works: try other settings or Reset"


def guarded(fn: Callable) -> Callable:
    """Catch every exception of an event generator: a warning and a status line instead."""
    @functools.wraps(fn)
    def wrapper(*args):
        try:
            yield from fn(*args)
        except Exception as err:  # noqa: BLE001 - the page must survive any input
            msg = friendly(err)
            gr.Warning(html.escape(msg))
            yield (f"**Error:** {msg}",) + (gr.skip(),) * (N_VIEWS - 1)
    return wrapper


class Explorer:
    """The event functions. `run_fn(prompt, settings)` yields traces (runner.run by default;
    app.py passes a GPU-decorated wrapper)."""

    def __init__(self, runtime: runner.Runtime, run_fn: Callable[[str, dict], Iterator[dict]] | None = None):
        self.runtime = runtime
        self.run_fn = run_fn or (lambda prompt, settings: runner.run(runtime, prompt, settings))
        self.hardware = runner.hardware_name(runtime.device)

    # -- helpers ---------------------------------------------------------------------
    def settings(self, *values) -> dict:
        s = dict(zip(CONTROLS, values))
        if s.get("prune_tau") in (0, 0.0):
            s["prune_tau"] = None
        return s

    def views(self, trace: dict | None, step: int | None, cursor: int | None, status: str,
              full: dict | None = None) -> tuple:
        """Every view of `trace` at `step`; `full` is the state to keep (default: trace)."""
        n = len((trace or {}).get("steps") or [])
        if step is not None:
            step = max(0, min(int(step), n - 1)) if n else None
        slider = gr.Slider(minimum=0, maximum=max(1, n - 1), value=step or 0, step=1, interactive=n > 1,
                           label=f"Step (0 to {max(0, n - 1)}): moves every step view" if n else "Step")
        def draw(build, title):
            """One view; a trace this view cannot read leaves the others intact."""
            try:
                return build(trace, step)
            except Exception as err:  # noqa: BLE001 - an odd uploaded trace must not break the page
                log.warning("view %s failed: %s", title, err)
                message = f"This view cannot be drawn from this trace ({type(err).__name__}: {err})."
                if title is None:
                    return f'<div style="color:#b91c1c">{html.escape(message)}</div>'
                return F.empty_figure(title, html.escape(F.visible(message, 200)))

        return (status, draw(F.token_html, None), draw(F.step_html, None), slider,
                draw(F.tree_figure, "Draft tree"), draw(F.lattice_figure, "LiLiCorr lattice"),
                draw(F.commit_figure, "State commits"), draw(F.speedup_figure, "Speedup"),
                draw(lambda t, _: self.summary_md(t), None), full if full is not None else trace, cursor)

    def summary_md(self, trace: dict | None) -> str:
        if not trace or not trace.get("steps"):
            return ""
        s, b, m = trace.get("summary") or {}, trace.get("baseline") or {}, trace.get("model") or {}
        hw = html.escape(str(m.get("hardware") or m.get("device", "?")))
        line = (f"**{s.get('new_tokens', 0)} tokens in {s.get('target_forwards', 0)} target forwards: "
                f"τ = {s.get('tau', 0):.2f}** tokens per forward (AR: 1.00)")
        if b.get("tokens_per_s"):
            line += (f" · speculative {s.get('tokens_per_s', 0):.1f} tokens/s vs AR {b['tokens_per_s']:.1f} tokens/s"
                     f" → **{s.get('speedup') or 0:.2f}×**, measured in this run on {hw}")
        times = s.get("time_ms") or {}
        line += " · time: " + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items())
        if m.get("device") == "cpu":
            line += ("  \n*On CPU the target runs plain-torch reference recurrences (no fused kernels, no "
                     "CUDA graphs): speedups here show the mechanics; the GPU path is built for speed.*")
        return line

    def _status(self, trace: dict, settings: dict, done: bool) -> str:
        s = trace.get("summary") or {}
        n = s.get("new_tokens", 0)
        label = self.runtime.labels.get(settings.get("drafter"), settings.get("drafter"))
        if done:
            return (f"**Done**: {n} tokens in {len(trace['steps'])} steps with the {label} drafter "
                    f"(τ = {s.get('tau', 0):.2f}).")
        return f"**Running**: step {len(trace['steps'])}, {n}/{settings.get('max_new_tokens')} tokens…"

    # -- events ----------------------------------------------------------------------
    @guarded
    def on_run(self, prompt: str, *controls) -> Iterator[tuple]:
        settings = self.settings(*controls)
        runner.normalize_settings(self.runtime, settings)          # fail fast, before the queue work
        yield (f"Measuring the AR baseline on {self.hardware}, then decoding…",) + (gr.skip(),) * (N_VIEWS - 1)
        trace = None
        for update in self.run_fn(prompt, settings):
            if update is None:          # a step with nothing new to draw: Stop may cancel here
                yield (gr.skip(),) * N_VIEWS
            elif isinstance(update, str):
                yield (update,) + (gr.skip(),) * (N_VIEWS - 1)
            else:
                trace = update
                yield self.views(trace, len(trace["steps"]) - 1, None, self._status(trace, settings, False))
        if trace is not None:   # complete again, so an API client's last output has every view
            yield self.views(trace, len(trace["steps"]) - 1, None, self._status(trace, settings, True))

    @guarded
    def on_step(self, prompt: str, trace: dict | None, cursor: int | None, *controls) -> Iterator[tuple]:
        settings = self.settings(*controls)
        record = runner.settings_record(runner.normalize_settings(self.runtime, settings))
        same = bool(trace) and trace.get("prompt") == runner.clean_prompt(prompt) and trace.get("settings") == record
        cursor = cursor if isinstance(cursor, int) else 0
        if same and cursor < len(trace["steps"]):
            cursor += 1
            shown = runner.reveal(trace, cursor)
            yield self.views(shown, cursor - 1, cursor, f"Step {cursor - 1} revealed ({cursor} of "
                             f"{len(trace['steps'])}); press Step for the next one.", full=trace)
            return
        if same:
            yield self.views(trace, len(trace["steps"]) - 1, None,
                             f"All {len(trace['steps'])} steps revealed. Press Run or change the prompt.")
            return
        yield ("Step mode: decoding the whole run once in the background; each click then reveals one step…",) \
            + (gr.skip(),) * (N_VIEWS - 1)
        full = None
        for update in self.run_fn(prompt, settings):
            if not isinstance(update, dict):
                yield (gr.skip(),) * N_VIEWS
                continue
            full = update
            n = (full.get("summary") or {}).get("new_tokens", 0)
            yield (f"Step mode: decoding in the background ({n}/{settings['max_new_tokens']} tokens)…",) \
                + (gr.skip(),) * (N_VIEWS - 1)
        if full is None or not full["steps"]:
            yield ("**Error:** The run produced no steps.",) + (gr.skip(),) * (N_VIEWS - 1)
            return
        yield self.views(runner.reveal(full, 1), 0, 1, f"Step 0 revealed (1 of {len(full['steps'])}); "
                         "press Step for the next one.", full=full)

    @guarded
    def on_scrub(self, step: float, trace: dict | None, cursor: int | None) -> Iterator[tuple]:
        shown = runner.reveal(trace, cursor) if trace and isinstance(cursor, int) else trace
        out = self.views(shown, int(step or 0), cursor, gr.skip(), full=trace)
        # the speedup figure does not depend on the step: leave it alone
        yield out[:3] + (gr.skip(),) + out[4:7] + (gr.skip(), gr.skip(), gr.skip(), gr.skip())

    @guarded
    def on_upload(self, file: Any) -> Iterator[tuple]:
        path = getattr(file, "name", file)
        if not path:
            raise ValueError("no file received")
        trace, note = runner.replay(load_trace(path), self.runtime)
        yield self.views(trace, 0 if trace["steps"] else None, None, html.escape(note))

    def on_stop(self, trace: dict | None, cursor: int | None) -> tuple:
        """After a cancel: redraw every view from the kept trace (streamed updates may lag)."""
        n = len((trace or {}).get("steps") or [])
        shown = runner.reveal(trace, cursor) if trace and isinstance(cursor, int) else trace
        step = len(shown["steps"]) - 1 if shown and shown.get("steps") else None
        return self.views(shown, step, cursor, f"**Stopped** after {n} steps; the partial trace stays in the "
                          "views and can be downloaded.", full=trace)

    def on_reset(self) -> tuple:
        return self.views(None, None, None, "Ready.") + (gr.DownloadButton(visible=False),)

    def on_export(self, trace: dict | None):
        try:
            if not trace:
                raise ValueError("nothing to export yet: run a prompt or upload a trace first")
            path = runner.export_trace(trace)
            return gr.DownloadButton(value=str(path), visible=True, label=f"Download {path.name}"), \
                f"Trace ready: {path.name} ({path.stat().st_size / 1024:.0f} KiB). Click the download button."
        except Exception as err:  # noqa: BLE001
            msg = friendly(err)
            gr.Warning(html.escape(msg))
            return gr.DownloadButton(visible=False), f"**Error:** {msg}"

    def on_shape(self, tree: str, paths: str, mode: str):
        """Keep the verification mode consistent with the tree shape; validate the preset."""
        try:
            parsed = runner.parse_paths(paths)
            note = "" if parsed is None else f"Preset: {len(parsed)} nodes, depth {max(len(p) for p in parsed)}."
        except ValueError as err:
            parsed, note = None, f"**Error:** {err}"
        is_chain = (tree == "chain") if parsed is None else all(p == [0] * len(p) for p in parsed)
        choices = list(runner.MODES) if is_chain else [m for m in runner.MODES if m != "chain"]
        if mode not in choices:
            mode = "auto"
            note += " Chain verification needs a chain: switched to auto."
        return gr.Radio(choices=choices, value=mode), note.strip()

    def on_depth(self, depth: float, budget: float):
        return gr.Slider(value=max(int(budget), int(depth)))

    def on_budget(self, budget: float, depth: float):
        return gr.Slider(value=min(int(depth), int(budget)))

    def on_drafter(self, drafter: str, block_size: float, top_k: float):
        """Show α for the oracle; cap block size and top-k at what the drafter was trained for."""
        lim = runner.drafter_limits(self.runtime, drafter)
        return (gr.Slider(visible=drafter == runner.ORACLE),
                gr.Slider(maximum=lim["block_size"], value=min(int(block_size), lim["block_size"])),
                gr.Slider(maximum=lim["top_k"], value=min(int(top_k), lim["top_k"])))


def build_demo(runtime: runner.Runtime, run_fn: Callable | None = None, model_limit: int = 1) -> gr.Blocks:
    ex = Explorer(runtime, run_fn)
    examples, example_labels = load_examples()
    first = next(iter(runtime.drafters))
    lim = runner.drafter_limits(runtime, first)
    D = CONTROL_DEFAULTS
    model_line = (f"**Model:** {html.escape(runtime.model_name)} · {ex.hardware} · drafters: "
                  + ", ".join(runtime.labels[n] for n in runtime.drafters))
    with gr.Blocks(title="SpecLA Explorer") as demo:
        gr.Markdown(INTRO)
        gr.Markdown(model_line)
        if runtime.note:
            gr.Markdown(f'<div class="specla-note">{html.escape(runtime.note)}</div>')
        trace_state, cursor_state = gr.State(None), gr.State(None)
        with gr.Row():
            with gr.Column(scale=2, min_width=340):
                prompt = gr.Textbox(label="Prompt", lines=4, max_lines=12, max_length=runner.MAX_PROMPT_CHARS,
                                    value=examples[0][0], elem_id="prompt")
                gr.Examples(examples=examples, inputs=[prompt], example_labels=example_labels,
                            cache_examples=False, examples_per_page=6, label="Examples (click one, then Run)",
                            elem_id="examples")
                with gr.Row():
                    run_btn = gr.Button("Run", variant="primary", elem_id="run")
                    step_btn = gr.Button("Step", elem_id="step")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                    reset_btn = gr.Button("Reset", elem_id="reset")
                gr.Markdown("*Run* streams the whole decode. *Step* decodes the whole run once in the "
                            "background on its first click, then reveals one more step per click. "
                            "*Stop* cancels a run and keeps what it has so far.")
            with gr.Column(scale=3, min_width=420):
                status = gr.Markdown("Ready.", elem_id="status")
                text = gr.HTML(F.token_html(None), elem_id="text")
                summary = gr.Markdown("", elem_id="summary")
                with gr.Row():
                    export_btn = gr.Button("Export trace (JSON)", elem_id="export")
                    download = gr.DownloadButton("Download trace", visible=False, elem_id="download")
                    upload = gr.UploadButton("Upload a trace to replay", file_types=[".json"], elem_id="upload")
        with gr.Accordion("Decoding settings", open=True):
            with gr.Row():
                drafter = gr.Dropdown([(runtime.labels[n], n) for n in runtime.drafters], value=first,
                                      label="Drafter", info="oracle: knows the target's answer, right with "
                                      "probability α; measures the engine, not a real drafter")
                oracle_alpha = gr.Slider(0, 1, value=D["oracle_alpha"], step=0.05, label="Oracle acceptance α",
                                         visible=first == runner.ORACLE)
                tree = gr.Radio(list(runner.TREE_SHAPES), value=D["tree"], label="Tree shape")
                mode = gr.Radio(list(runner.MODES), value=D["mode"], label="Verification",
                                info="auto picks per step from the tree's shape")
                with gr.Column(min_width=220):
                    paths = gr.Textbox(label="Tree preset (optional, overrides the shape)", lines=1,
                                       placeholder="index paths, e.g. [[0], [0, 0], [1], [0, 1]]")
                    preset_note = gr.Markdown("")
            with gr.Row():
                top_k = gr.Slider(1, lim["top_k"], value=min(D["top_k"], lim["top_k"]), step=1,
                                  label="Top-k (children per node)")
                budget = gr.Slider(1, MAX_TREE_NODES - 1, value=D["budget"], step=1, label="Node budget")
                block_size = gr.Slider(2, lim["block_size"], value=min(D["block_size"], lim["block_size"]), step=1,
                                       label="Block size", info="block / LiLiCorr drafters")
                depth = gr.Slider(1, 32, value=D["depth"], step=1, label="Depth", info="EAGLE drafter; kept ≤ budget")
                prune_tau = gr.Slider(0, 10, value=D["prune_tau"], step=0.5, label="Pruning τ (0 = off)",
                                      info="keep nodes within τ nats of the best path")
            with gr.Row():
                temperature = gr.Slider(0, 2, value=D["temperature"], step=0.05, label="Temperature (0 = greedy)")
                top_p = gr.Slider(0.05, 1, value=D["top_p"], step=0.05, label="Top-p")
                max_new = gr.Slider(1, 1024 if runtime.device.type == "cuda" else 512, value=D["max_new_tokens"],
                                    step=1,
                                    label="Max new tokens", elem_id="max-new")
                seed = gr.Number(value=D["seed"], precision=0, minimum=0, maximum=2**31 - 1, label="Seed")
                deferred = gr.Checkbox(value=D["deferred"], label="Deferred commit",
                                       info="fold accepted factors into the next verification")
        slider = gr.Slider(0, 1, value=0, step=1, label="Step", interactive=False, elem_id="scrubber")
        step_info = gr.HTML(F.step_html(None, None), elem_id="step-info")
        with gr.Row():
            with gr.Column():
                gr.Markdown("**Draft tree**: left to right = depth; ■ root (the last bonus), ● drafted node "
                            "coloured by draft probability (fixed 0 to 1 scale), blue line = accepted path, "
                            "★ = +1 bonus token, grey × = pruned before verification. Hover for the target's view.")
                tree_plot = gr.Plot(F.tree_figure(None, None), show_label=False, elem_id="tree-plot")
            with gr.Column():
                gr.Markdown("**LiLiCorr lattice**: slots × top-k candidates of the block drafter, shaded by "
                            "log-probability; orange = the path LiLiCorr chose, dashed = top-1 path, red ring = "
                            "the target's token; numbers = pair scores along the chosen path.")
                lattice_plot = gr.Plot(F.lattice_figure(None, None), show_label=False, elem_id="lattice-plot")
        gr.Markdown("**State commits**: how many tokens each step folded into the recurrent state (and kept "
                    "pending when deferred), bytes of factors against dense per-node state snapshots, commit "
                    "time and verification mode. Rejected tokens write nothing into the state.")
        commit_plot = gr.Plot(F.commit_figure(None), show_label=False, elem_id="commit-plot")
        gr.Markdown("**Speedup**: tokens/s against the AR baseline measured on the same prompt and hardware in "
                    "this run (dashed), τ per step with the predicted E[τ] for the measured per-token "
                    "acceptance α, accepted lengths, and where each step's time went.")
        speedup_plot = gr.Plot(F.speedup_figure(None), show_label=False, elem_id="speedup-plot")

        controls = [drafter, oracle_alpha, tree, paths, top_k, block_size, depth, budget, prune_tau, mode,
                    deferred, temperature, top_p, max_new, seed]
        views = [status, text, step_info, slider, tree_plot, lattice_plot, commit_plot, speedup_plot, summary,
                 trace_state, cursor_state]
        model_queue = dict(concurrency_limit=model_limit, concurrency_id="model", show_progress_on=[status])
        helper = dict(api_visibility="undocumented")

        def waiting():
            return "Waiting for the model (queued behind other runs)…", gr.DownloadButton(visible=False)

        run_ev = run_btn.click(waiting, None, [status, download], queue=False, **helper).then(
            ex.on_run, [prompt, *controls], views, api_name="run", **model_queue)
        step_ev = step_btn.click(ex.on_step, [prompt, trace_state, cursor_state, *controls], views,
                                 api_name="step", **model_queue)
        stop_btn.click(None, None, None, cancels=[run_ev, step_ev], queue=False, **helper).then(
            ex.on_stop, [trace_state, cursor_state], views, **helper)
        reset_btn.click(ex.on_reset, None, views + [download], cancels=[run_ev, step_ev], **helper)
        slider.input(ex.on_scrub, [slider, trace_state, cursor_state], views, trigger_mode="always_last",
                     show_progress="hidden", api_name="scrub")
        export_btn.click(ex.on_export, [trace_state], [download, status], api_name="export")
        upload.upload(ex.on_upload, [upload], views, api_name="replay")
        for event in (tree.input, paths.blur, paths.submit):
            event(ex.on_shape, [tree, paths, mode], [mode, preset_note], show_progress="hidden", **helper)
        depth.release(ex.on_depth, [depth, budget], [budget], show_progress="hidden", **helper)
        budget.release(ex.on_budget, [budget, depth], [depth], show_progress="hidden", **helper)
        drafter.input(ex.on_drafter, [drafter, block_size, top_k], [oracle_alpha, block_size, top_k],
                      show_progress="hidden", **helper)
    demo.explorer = ex   # for tests
    return demo


LAUNCH_KWARGS = dict(css=CSS, theme=gr.themes.Soft(), max_file_size="64mb")
