"""The Gradio page: prompt, decoding controls, Run / Step / Stop / Reset, and the views.

`Explorer` holds the event functions (plain Python, testable without a browser);
`build_demo` lays them out. Sessions keep their trace in `gr.State` (JSON-able dicts), the
models live in the process; all model work shares one queue (`concurrency_id="model"`).
Every handler turns an exception into a warning and a status line: bad input never breaks
the page, and user errors (ValueError and its subclasses) leave no traceback in the log.

The run and step handlers take their settings as named parameters, so the HTTP API names
them too (`/run` takes `prompt, drafter, oracle_alpha, tree, ..., seed, model`). Their
listeners skip Gradio's preprocessing: the values arrive as sent and
`runner.normalize_settings` checks them, so a wrong type gets the same clear message in
the page and over the API.

The last setting, `model`, is a key of `model_choice.ModelChoices`: the loaded model, or
the GDN-1.3B shape, built on the first run that selects it. Each session picks its own;
the handlers resolve it to a runtime on every call.
"""
from __future__ import annotations

import contextlib
import functools
import html
import json
import logging
import math
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr

from specla import figures as F
from specla import runner
from specla.figures import plural
from specla.model_choice import LOADED, ModelChoices, is_out_of_memory, release_gpu_memory
from specla.trace import MAX_TRACE_BYTES, load_trace
from specla.tree import MAX_TREE_NODES

log = logging.getLogger("specla.explorer")
EXAMPLES_FILE = Path(__file__).resolve().parent.parent / "examples" / "prompts.jsonl"
FALLBACK_EXAMPLES = [["def fibonacci(n):\n"], ["import os\n\n\ndef main():\n"],
                     ["class Stack:\n    def __init__(self):\n"]]
# the settings controls, in the order the event functions receive them
CONTROLS = ("drafter", "oracle_alpha", "tree", "paths", "top_k", "block_size", "depth", "budget",
            "prune_tau", "mode", "deferred", "temperature", "top_p", "max_new_tokens", "seed", "model")
CONTROL_DEFAULTS = {"drafter": None, "oracle_alpha": 0.8, "tree": "chain", "paths": "", "top_k": 4,
                    "block_size": 8, "depth": 6, "budget": 8, "prune_tau": 0.0, "mode": "auto", "deferred": True,
                    "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 64, "seed": 0, "model": LOADED}
CONTROL_LABELS = {"oracle_alpha": "oracle α", "top_k": "top-k", "block_size": "block size", "depth": "depth",
                  "budget": "node budget", "prune_tau": "pruning τ", "temperature": "temperature",
                  "top_p": "top-p", "max_new_tokens": "max new tokens", "seed": "seed"}
# the numeric controls' ranges on the page; None: set by the runtime or the drafter
CONTROL_RANGES: dict[str, tuple[float, float | None]] = {
    "oracle_alpha": (0, 1), "top_k": (1, None), "block_size": (2, None), "depth": (1, 32),
    "budget": (1, MAX_TREE_NODES - 1), "prune_tau": (0, 10), "temperature": (0, 2), "top_p": (0.05, 1),
    "max_new_tokens": (1, None), "seed": (0, 2**31 - 1)}
N_VIEWS = 11   # status, text, step, slider, tree, lattice, commit, speedup, summary, trace, cursor
N_REPLAY = N_VIEWS + 1 + len(CONTROLS) + 1   # the views, the prompt, every control, the preset note
SKIP_VIEWS = (gr.skip(),) * N_VIEWS
KEPT_TRACE = 9   # the index of the kept trace (gr.State) among the views
CSS = """
#status {min-height: 1.6em}
.specla-note {color: #92400e; background: #fffbeb; border-radius: 6px; padding: 4px 8px}
#step-info {max-height: 430px; overflow-y: auto}
"""
# Gradio's client refuses a file over max_file_size before sending it, with a toast that
# vanishes; this puts the refusal in the status line too, where the page reports results.
UPLOAD_GUARD_JS = """
<script>
document.addEventListener("change", (event) => {
  const input = event.target;
  if (!(input instanceof HTMLInputElement) || input.type !== "file") return;
  if (!input.parentElement || !input.parentElement.querySelector("#upload")) return;
  const limit = %d;
  const big = Array.from(input.files || []).find((f) => f.size > limit);
  if (!big) return;
  const status = document.querySelector("#status span.md");
  if (status) {
    status.innerHTML = "<p><strong>Error:</strong> the file " + big.name.replace(/[<>&]/g, "") + " is " +
      (big.size / 1048576).toFixed(1) + " MiB; the limit is %d MiB. Nothing was uploaded.</p>";
  }
}, true);
</script>
""" % (MAX_TRACE_BYTES, MAX_TRACE_BYTES // 2**20)
INTRO = """# SpecLA Explorer
Exact speculative decoding for Gated DeltaNet, one step at a time. A **drafter** proposes a
chain or tree of tokens; the **target** verifies the whole tree in one forward pass from its
recurrent state; the longest path that matches the target is kept, **plus one bonus token**
the target adds itself; the state is then rebuilt from small per-token **factors**, never from
a rejected token. At temperature 0 the text is plain autoregressive (AR) decoding's: in fp32
token for token; in bf16 on a GPU the two paths round differently, so a near-tie can flip, and
the summary says where and by what logit gap. The speed is measured against AR in the same run."""


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
    drafter = overrides.get("drafter", runner.default_drafter(runtime))
    values = {**CONTROL_DEFAULTS, "drafter": drafter, "paths": runner.default_preset(runtime, drafter), **overrides}
    return [values[name] for name in CONTROLS]


def is_user_error(err: Exception) -> bool:
    """Bad input (a ValueError: settings, prompts, trees, traces, checkpoints), not a bug."""
    return isinstance(err, ValueError)


def friendly(err: Exception) -> str:
    """The message for the page; only errors that are not the user's are logged with a traceback."""
    if is_user_error(err):
        return str(err)
    log.error("event failed:\n%s", traceback.format_exc())
    return f"internal error ({type(err).__name__}: {err}); the page still works: try other settings or Reset"


def guarded(n_outputs: int = N_VIEWS) -> Callable:
    """Catch every exception of an event generator: a warning and a status line instead.

    The status is the first of the generator's `n_outputs` outputs; the others are left as
    they are. The wrapper keeps the wrapped function's signature (Gradio reads the API
    parameter names from it).
    """
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - the page must survive any input
                msg = friendly(err)
                gr.Warning(html.escape(msg))
                yield (f"**Error:** {msg}",) + (gr.skip(),) * (n_outputs - 1)
        return wrapper
    return decorate


def quiet(n_outputs: int = 1) -> Callable:
    """For the small helper events: a failure leaves their `n_outputs` outputs unchanged, with a warning."""
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - a helper must never break the page
                gr.Warning(html.escape(friendly(err)))
                return gr.skip() if n_outputs == 1 else (gr.skip(),) * n_outputs
        return wrapper
    return decorate


class DrawPace:
    """When a streamed run may draw its next partial trace.

    Each draw costs the server four plotly figures and the browser a longer render of them.
    A page sent draws faster than it renders them falls behind the stream and answers no
    click, Stop's included, until it catches up. So a draw is due only when DRAW_SPACING
    times the last draw's server cost (the measurable stand-in for the browser's) has passed
    since it began, and never sooner than MIN_SECONDS.
    """

    DRAW_SPACING = 6.0
    MIN_SECONDS = 0.25

    def __init__(self):
        self.last_start, self.last_cost = -float("inf"), 0.0

    def due(self) -> bool:
        wait = max(self.MIN_SECONDS, self.DRAW_SPACING * self.last_cost)
        return time.perf_counter() - self.last_start >= wait

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        self.last_start = time.perf_counter()
        yield
        self.last_cost = time.perf_counter() - self.last_start


def snapshot(trace: dict) -> dict:
    """A copy of a streamed trace whose step list no later step can grow.

    The kept trace must stay consistent with its own summary whatever the producer does
    with its list after yielding it (the view of a run at Stop is this snapshot).
    """
    return dict(trace, steps=list(trace["steps"]))


def discard_upload(path: str | os.PathLike) -> None:
    """Delete an uploaded file once read, when it is Gradio's copy of an upload.

    Gradio copies each upload into <its upload folder>/<hash>/<name>; that copy is ours to
    drop, with its folder when empty. Anything else (a file elsewhere, an exported trace)
    stays.
    """
    from gradio.utils import get_upload_folder

    try:
        file = Path(path).resolve()
        root = Path(get_upload_folder()).resolve()
        if file.parent.parent != root or file.parent == runner.export_folder(root).resolve():
            return
        file.unlink(missing_ok=True)
        if not any(file.parent.iterdir()):
            file.parent.rmdir()
    except OSError as err:   # already gone, or not ours to delete: nothing to clean
        log.info("upload %s not removed: %s", path, err)


class Page(gr.Blocks):
    """gr.Blocks that answers a malformed request with a message instead of a traceback.

    Gradio checks some inputs itself before any handler runs: a call with too few values,
    or a value that is not a file where a file is expected. Those are the caller's errors
    (ValueErrors, pydantic's included); they go back as a gr.Error naming the problem and
    leave the server log clean.
    """

    async def preprocess_data(self, block_fn, inputs, state, explicit_call=False):
        try:
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except gr.Error:
            raise
        except ValueError as err:
            if "FileData" in str(err):
                message = "this parameter takes a file, uploaded with it (gradio_client: handle_file(path))"
            else:
                lines = [line.strip() for line in str(err).splitlines() if line.strip()]
                message = lines[0] if lines else type(err).__name__
            raise gr.Error(f"Bad request: {message[:300]}", print_exception=False) from None


class Explorer:
    """The event functions. `run_fn(model, prompt, settings)` yields what runner.run yields
    for the runtime of the model choice `model` (runner.run by default; app.py passes a
    GPU-decorated wrapper, which gets the key, a string, so that ZeroGPU can pickle it).
    `models` resolves those keys; by default the loaded `runtime` and the GDN-1.3B shape."""

    def __init__(self, runtime: runner.Runtime,
                 run_fn: Callable[[str, str, dict], Iterator[dict | str | None]] | None = None,
                 models: ModelChoices | None = None):
        self.runtime = runtime      # the model loaded at start
        self.models = models or ModelChoices(runtime)
        if self.models.loaded is not runtime:
            raise ValueError("the model choices must start from the runtime the page was built with")
        self.run_fn = run_fn or (lambda model, prompt, settings:
                                 runner.run(self.models.runtime(model), prompt, settings))
        self.first_drafter = runner.default_drafter(runtime)

    # -- helpers ---------------------------------------------------------------------
    def control_range(self, name: str, drafter: str | None = None, model: str = LOADED) -> tuple[float, float]:
        """The page's range of a numeric control (top-k and block size depend on the drafter)."""
        lo, hi = CONTROL_RANGES[name]
        if hi is None:
            choice = self.models.get(model)
            if name == "max_new_tokens":
                hi = 1024 if choice.device == "cuda" else 512
            else:
                hi = self.models.limits(model, drafter or next(iter(choice.drafters)))[name]
        return lo, hi

    def model_md(self, model: str = LOADED) -> str:
        """The page's model line for a model choice, with its note (random weights, skipped drafters)."""
        choice = self.models.get(model)
        line = (f"**Model:** {html.escape(choice.name)} · {html.escape(self.models.hardware(model))} · drafters: "
                + html.escape(", ".join(choice.drafters.values())))
        return line + (f'\n\n<div class="specla-note">{html.escape(choice.note)}</div>' if choice.note else "")

    def _runtime(self, model: Any) -> Iterator[tuple]:
        """The chosen model's runtime; a model built on demand says so while it is built (once)."""
        choice = self.models.get(model)
        if choice.runtime is None:
            reason = self.models.unavailable(model)
            if not reason:
                yield (f"Building {choice.short} on {self.models.hardware(model)}: once, for every session…",) \
                    + SKIP_VIEWS[1:]
        return self.models.runtime(model)      # says why, when it cannot run here

    def _updates(self, model: str, prompt: str, settings: dict) -> Iterator[dict | str | None]:
        """run_fn's updates; running out of GPU memory becomes a message, with the memory freed."""
        try:
            yield from self.run_fn(model, prompt, settings)
            return
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
            failure = self.models.out_of_memory(model, err)
        release_gpu_memory()      # after the handler: its traceback held the run's tensors
        raise failure

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
                return F.empty_figure(title, F.escape(F.visible(message, 200)))

        return (status, draw(F.token_html, None), draw(F.step_html, None), slider,
                draw(F.tree_figure, "Draft tree"), draw(F.lattice_figure, "LiLiCorr lattice"),
                draw(F.commit_figure, "State commits"), draw(F.speedup_figure, "Speedup"),
                draw(lambda t, _: self.summary_md(t), None), full if full is not None else trace, cursor)

    @staticmethod
    def run_model_md(trace: dict) -> str:
        """The run's model, and for the oracle drafter that its acceptance rate is simulated."""
        m, s = trace.get("model") or {}, trace.get("settings") or {}
        line = f"  \n*Model: {F.escape(F.visible(str(m.get('name', 'unknown')), 120))}"
        alpha = s.get("oracle_alpha")
        if s.get("drafter") == runner.ORACLE and isinstance(alpha, (int, float)) and not isinstance(alpha, bool):
            line += f"; drafter: the oracle, right with probability α = {alpha:.2f} (a simulated acceptance rate)"
        return line + ".*"

    def summary_md(self, trace: dict | None) -> str:
        """The run in one line: tokens, forwards, τ, the measured speedup (and its spread), phase times."""
        if not trace or not trace.get("steps"):
            return ""
        s, b, m = trace.get("summary") or {}, trace.get("baseline") or {}, trace.get("model") or {}
        hw = html.escape(str(m.get("hardware") or m.get("device", "?")))
        produced, forwards = plural(s.get("new_tokens", 0), "token"), plural(s.get("target_forwards", 0), "target forward")
        line = f"**{produced} in {forwards}: τ = {s.get('tau', 0):.2f}** tokens per forward (AR: 1.00)"
        if b.get("tokens_per_s"):
            line += (f" · speculative {s.get('tokens_per_s', 0):.1f} tokens/s vs AR {b['tokens_per_s']:.1f} tokens/s"
                     f" → **{s.get('speedup') or 0:.2f}×**")
            spread = F.speedup_spread(s)
            if spread:
                line += f" (alternating runs: {spread[0]:.2f}× to {spread[1]:.2f}×)"
            line += f", measured in this run on {hw}"
        times = s.get("time_ms") or {}
        steps = max(1, s.get("target_forwards", 1))
        line += " · time per step: " + ", ".join(f"{k} {v / steps:.3f} ms" for k, v in times.items() if v)
        return line + self.run_model_md(trace) + self.engine_md(trace) + self.exactness_md(trace)

    @staticmethod
    def engine_md(trace: dict) -> str:
        """Which backend ran the run, where drafting and acceptance ran, and why not on the device."""
        e, m = trace.get("engine") or {}, trace.get("model") or {}
        if not e:
            return ""
        if e.get("backend") == "graphed":
            ops = str(e.get("ops", "")) + (f"; {e['verification']}" if e.get("verification") else "")
            drafts = f" ({e['drafting_kernel']})" if e.get("drafting") == "device" and e.get("drafting_kernel") else ""
            how = (f"  \n*Engine: CUDA graphs ({html.escape(ops)}, {e.get('dtype')}), drafting "
                   f"on the {'device' if e.get('drafting') == 'device' else 'host'}{html.escape(drafts)}, acceptance on the "
                   f"{e.get('acceptance')}; {e.get('graphs', 0)} graphs, set-up {e.get('capture_ms', 0) / 1e3:.1f} s "
                   "(capture and compile, not timed). Step times are CUDA events.*")
        else:
            how = ("  \n*Engine: eager PyTorch" + (" on the CPU: plain-torch reference recurrences, no fused kernels "
                   "or CUDA graphs; speedups here show the mechanics" if m.get("device") == "cpu" else "") + ".*")
        if e.get("note"):
            how += f"  \n*Not all on the device: {html.escape(str(e['note']))}.*"
        return how

    @staticmethod
    def exactness_md(trace: dict) -> str:
        """Whether the output equals AR's, and where and by what logit gap it leaves it."""
        x = trace.get("exactness") or {}
        if not x.get("checked"):
            return ""
        if x.get("equal"):
            return f"  \nOutput equals AR's, token for token ({x.get('compared_tokens')} tokens compared, {x.get('dtype')})."
        d = x.get("first_divergence") or {}
        verdict = ("a near-tie: within twice the measured rounding noise between the two paths"
                   if d.get("near_tie") else "**beyond the measured rounding noise: please report it**")
        return (f"  \nOutput leaves AR's at token {d.get('position')} ({x.get('dtype')}): AR's logit gap between "
                f"its token and this one is {d.get('logit_gap', 0):.4f} (noise {d.get('noise', 0):.4f}), {verdict}.")

    @staticmethod
    def _status(runtime: runner.Runtime, trace: dict, settings: dict, done: bool) -> str:
        s = trace.get("summary") or {}
        n = s.get("new_tokens", 0)
        if done:
            label = runtime.labels.get(settings.get("drafter"), settings.get("drafter"))
            return (f"**Done**: {plural(n, 'token')} in {plural(len(trace['steps']), 'step')} with the {label} "
                    f"drafter (τ = {s.get('tau', 0):.2f}).")
        return f"**Running**: step {len(trace['steps'])}, {n}/{settings.get('max_new_tokens')} tokens…"

    @staticmethod
    def _settings(runtime: runner.Runtime, **controls) -> dict:
        """The settings dict runner.run takes, checked (a ValueError names a bad value)."""
        return runner.normalize_settings(runtime, controls)

    # -- events ----------------------------------------------------------------------
    @guarded()
    def on_run(self, prompt: str, drafter: str | None = None, oracle_alpha: float = 0.8, tree: str = "chain",
               paths: str | None = None, top_k: int = 4, block_size: int = 8, depth: int = 6, budget: int = 8,
               prune_tau: float = 0.0, mode: str = "auto", deferred: bool = True, temperature: float = 0.0,
               top_p: float = 1.0, max_new_tokens: int = 64, seed: int = 0, model: str = LOADED) -> Iterator[tuple]:
        """Decode `prompt` with these settings; stream the views; the last output is complete."""
        started = time.perf_counter()
        controls = {name: value for name, value in locals().items() if name in CONTROLS and name != "model"}
        runtime = yield from self._runtime(model)
        settings = self._settings(runtime, **controls)
        runner.encode_prompt(runtime, runner.clean_prompt(prompt))   # fail fast, before the model work
        # the kept trace is cleared here, so a Stop before the first step keeps nothing stale
        yield ((f"Measuring the AR baseline on {runner.hardware_name(runtime.device)}, then decoding…",)
               + (gr.skip(),) * (N_VIEWS - 3) + (None, None))
        trace, pace = None, DrawPace()
        for update in self._updates(model, prompt, settings):
            if update is None:     # a step with nothing new to show: yielding lets Stop cancel here
                yield SKIP_VIEWS
                continue
            if isinstance(update, str):     # a status line: measuring, capturing graphs
                yield (update,) + SKIP_VIEWS[1:]
                continue
            first = trace is None or not trace["steps"]
            trace = snapshot(update)
            if not first and not pace.due():   # keep it (Stop shows it), draw a later one
                yield SKIP_VIEWS[:KEPT_TRACE] + (trace,) + SKIP_VIEWS[KEPT_TRACE + 1:]
                continue
            if first and trace["steps"]:      # the server's side of the Run-to-first-step latency
                log.info("first step drawn %.0f ms after Run (stages: %s)", 1e3 * (time.perf_counter() - started),
                         trace.get("latency_ms"))
            with pace.drawing():
                views = self.views(trace, len(trace["steps"]) - 1, None,
                                   self._status(runtime, trace, settings, False))
            yield views
        if trace is not None:   # complete again, so an API client's last output has every view
            yield self.views(trace, len(trace["steps"]) - 1, None, self._status(runtime, trace, settings, True))

    @guarded()
    def on_step(self, prompt: str, trace: dict | None = None, cursor: int | None = None,
                drafter: str | None = None, oracle_alpha: float = 0.8, tree: str = "chain",
                paths: str | None = None, top_k: int = 4, block_size: int = 8, depth: int = 6, budget: int = 8,
                prune_tau: float = 0.0, mode: str = "auto", deferred: bool = True, temperature: float = 0.0,
                top_p: float = 1.0, max_new_tokens: int = 64, seed: int = 0, model: str = LOADED) -> Iterator[tuple]:
        """Reveal one more step of the session's run; the first click decodes the run in the background."""
        controls = {name: value for name, value in locals().items() if name in CONTROLS and name != "model"}
        runtime = yield from self._runtime(model)
        settings = self._settings(runtime, **controls)
        record = runner.settings_record(settings)
        same = (isinstance(trace, dict) and trace.get("prompt") == runner.clean_prompt(prompt)
                and trace.get("settings") == record
                and (trace.get("model") or {}).get("fingerprint") == runtime.fingerprint)
        cursor = cursor if isinstance(cursor, int) else 0
        if same and cursor < len(trace["steps"]):
            cursor += 1
            shown = runner.reveal(trace, cursor)
            yield self.views(shown, cursor - 1, cursor, f"Step {cursor - 1} revealed ({cursor} of "
                             f"{len(trace['steps'])}); press Step for the next one.", full=trace)
            return
        if same:
            yield self.views(trace, len(trace["steps"]) - 1, None,
                             f"All {plural(len(trace['steps']), 'step')} revealed. Press Run or change the prompt.")
            return
        runner.encode_prompt(runtime, runner.clean_prompt(prompt))
        # a new run: the kept trace is cleared, so a Stop now keeps nothing of the previous one
        yield (("Step mode: decoding the whole run once in the background; each click then reveals one step…",)
               + (gr.skip(),) * (N_VIEWS - 3) + (None, None))
        full = None
        for update in self._updates(model, prompt, settings):
            if not isinstance(update, dict):
                yield SKIP_VIEWS
                continue
            full = snapshot(update)
            n = (full.get("summary") or {}).get("new_tokens", 0)
            yield (f"Step mode: decoding in the background ({n}/{settings['max_new_tokens']} tokens)…",) \
                + (gr.skip(),) * (N_VIEWS - 1)
        if full is None or not full["steps"]:
            yield ("**Error:** The run produced no steps.",) + (gr.skip(),) * (N_VIEWS - 1)
            return
        yield self.views(runner.reveal(full, 1), 0, 1, f"Step 0 revealed (1 of {len(full['steps'])}); "
                         "press Step for the next one.", full=full)

    @guarded()
    def on_scrub(self, step: float, trace: dict | None = None, cursor: int | None = None) -> Iterator[tuple]:
        """Move every step view to `step` (clamped to the trace)."""
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
            raise ValueError(f"step must be a number, got {step!r}")
        shown = runner.reveal(trace, cursor) if trace and isinstance(cursor, int) else trace
        out = self.views(shown, int(step), cursor, gr.skip(), full=trace)
        # the speedup figure does not depend on the step: leave it alone
        yield out[:3] + (gr.skip(),) + out[4:7] + (gr.skip(), gr.skip(), gr.skip(), gr.skip())

    @guarded(N_REPLAY)
    def on_upload(self, file: Any) -> Iterator[tuple]:
        """Replay a saved trace: every view, the prompt and every setting come from the file."""
        path = getattr(file, "name", file)
        if not path:
            raise ValueError("no file received")
        try:
            data = load_trace(path)
        finally:
            discard_upload(path)
        model, why = self.replay_model(data.get("model"))
        trace, note = runner.replay(data, self.models.get(model).runtime)
        controls, changed = self.restore_controls(trace.get("settings"), model)
        changed = ([why] if why else []) + changed
        restored = ("The prompt and every setting are restored from the trace"
                    + (f", except: {'; '.join(changed)}" if changed else "")
                    + f": Run decodes it again with {self.models.get(model).short}.")
        paths = trace.get("settings", {}).get("paths")
        preset_note = f"Preset: {plural(len(paths), 'node')}." if isinstance(paths, list) and paths else ""
        prompt = trace.get("prompt") if isinstance(trace.get("prompt"), str) else gr.skip()
        yield (self.views(trace, 0 if trace["steps"] else None, None,
                          F.escape(note) + " " + F.escape(restored))
               + (prompt, *controls, preset_note))

    def replay_model(self, record: Any) -> tuple[str, str | None]:
        """The model choice a trace's model record names, and why not, when it cannot run here."""
        model = self.models.key_for(record)
        if model is None:          # another model: the replay note says so
            return LOADED, None
        reason = self.models.unavailable(model)
        if reason:
            return LOADED, f"its model, {self.models.get(model).short}, {reason} here, so the model is the loaded one"
        return model, None

    def restore_controls(self, settings: Any, model: str = LOADED) -> tuple[list, list[str]]:
        """Updates that set every settings control to a trace's values on `model`, in CONTROLS
        order, and the values that had to change to fit this page (unknown drafter, out of range)."""
        s = settings if isinstance(settings, dict) else {}
        choice = self.models.get(model)
        changed: list[str] = []
        drafter = s.get("drafter")
        if not (isinstance(drafter, str) and drafter in choice.drafters):
            first = next(iter(choice.drafters))
            changed.append(f"its drafter {F.visible(str(drafter), 24)!r} is not loaded here, so the drafter is "
                           f"{choice.drafters[first]}")
            drafter = first
        values: dict[str, Any] = {"drafter": drafter}
        for name, (default, label) in {k: (CONTROL_DEFAULTS[k], v) for k, v in CONTROL_LABELS.items()}.items():
            value = s.get(name, default)
            if name == "prune_tau" and value is None:
                value = 0.0
            lo, hi = self.control_range(name, drafter, model)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                changed.append(f"{label} {F.visible(str(value), 24)!r} is not a number, so it is {default}")
                value = default
            elif not lo <= value <= hi:
                clamped = min(max(value, lo), hi)
                changed.append(f"{label} {value} is outside this page's range ({lo} to {hi}), so it is {clamped}")
                value = clamped
            values[name] = value
        for name, choices in (("tree", runner.TREE_SHAPES), ("mode", runner.MODES)):
            value = s.get(name, CONTROL_DEFAULTS[name])
            if value not in choices:
                changed.append(f"{name} {F.visible(str(value), 24)!r} is unknown, so it is {CONTROL_DEFAULTS[name]}")
                value = CONTROL_DEFAULTS[name]
            values[name] = value
        deferred = s.get("deferred", True)
        values["deferred"] = deferred if isinstance(deferred, bool) else True
        paths = s.get("paths")
        values["paths"] = json.dumps(paths) if isinstance(paths, list) and paths else ""
        is_chain = values["tree"] == "chain" if not values["paths"] else all(
            isinstance(p, list) and all(i == 0 for i in p) for p in paths)
        modes = list(runner.MODES) if is_chain else [m for m in runner.MODES if m != "chain"]
        if values["mode"] not in modes:
            values["mode"] = "auto"
        lim = self.models.limits(model, drafter)
        updates = {
            **values, "model": model,
            "drafter": gr.Dropdown(choices=[(label, name) for name, label in choice.drafters.items()], value=drafter),
            "max_new_tokens": gr.Slider(maximum=self.control_range("max_new_tokens", drafter, model)[1],
                                        value=values["max_new_tokens"]),
            "oracle_alpha": gr.Slider(value=values["oracle_alpha"], visible=drafter == runner.ORACLE),
            "top_k": gr.Slider(maximum=lim["top_k"], value=values["top_k"]),
            "block_size": gr.Slider(maximum=lim["block_size"], value=values["block_size"]),
            "mode": gr.Radio(choices=modes, value=values["mode"]),
        }
        return [updates[name] for name in CONTROLS], changed

    def on_stop(self, trace: dict | None, cursor: int | None) -> tuple:
        """After a cancel: redraw every view from the kept trace (streamed updates may lag)."""
        shown = runner.reveal(trace, cursor) if trace and isinstance(cursor, int) else trace
        steps = (shown or {}).get("steps") or []
        if not steps:
            return self.views(None, None, None, "**Stopped** before the first step: nothing was decoded.",
                              full=trace)
        n_tokens = len((shown.get("output") or {}).get("tokens") or [])
        return self.views(shown, len(steps) - 1, cursor,
                          f"**Stopped** after {plural(len(steps), 'step')} ({plural(n_tokens, 'token')}); the "
                          "partial trace stays in the views and can be exported.", full=trace)

    def on_reset(self) -> tuple:
        return self.views(None, None, None, "Ready.") + (gr.DownloadButton(visible=False),)

    def on_export(self, trace: dict | None = None) -> tuple[str | None, str]:
        """Write the session's trace to a file: (its path, a status line); (None, the reason) if not."""
        try:
            if not trace:
                raise ValueError("nothing to export yet: run a prompt or upload a trace first")
            path = runner.export_trace(trace)
            return str(path), (f"Trace ready: {path.name} ({path.stat().st_size / 1024:.0f} KiB). "
                               "Click the download button.")
        except Exception as err:  # noqa: BLE001
            msg = friendly(err)
            gr.Warning(html.escape(msg))
            return None, f"**Error:** {msg}"

    @staticmethod
    def show_download(path: Any) -> Any:
        """The download button, visible when an export produced a file."""
        return gr.DownloadButton(visible=bool(path))

    def preset_for(self, drafter: str, model: str = LOADED) -> str:
        """The tree preset `drafter` starts with on `model` (runner.default_preset; "" until built)."""
        runtime = self.models.get(model).runtime
        return runner.default_preset(runtime, drafter) if runtime is not None else ""

    def preset_controls(self, drafter: str, model: str, tree: str, paths: str, mode: str) -> tuple:
        """(preset box, mode, note) after a drafter or model change: a preset left at a default
        ("" or "measured") follows the new drafter's default; one the user wrote is kept."""
        if str(paths or "").strip().lower() in ("", runner.MEASURED):
            paths = self.preset_for(drafter, model)
        radio, note = self.shape_controls(tree, paths, mode)
        return gr.Textbox(value=paths), radio, note

    @quiet(2)
    def on_shape(self, tree: str, paths: str, mode: str):
        """Keep the verification mode consistent with the tree shape; validate the preset."""
        return self.shape_controls(tree, paths, mode)

    @staticmethod
    def shape_controls(tree: str, paths: str, mode: str) -> tuple:
        """on_shape's (mode radio, preset note)."""
        try:
            parsed = runner.parse_paths(paths)
            if parsed == runner.MEASURED:
                note = "Preset: the drafter's measured tree."
            else:
                note = "" if parsed is None else (f"Preset: {plural(len(parsed), 'node')}, "
                                                  f"depth {max(len(p) for p in parsed)}.")
        except ValueError as err:
            parsed, note = None, f"**Error:** {html.escape(str(err))}"
        if parsed is None:
            is_chain = tree == "chain"
        else:       # a measured preset is a tree
            is_chain = parsed != runner.MEASURED and all(p == [0] * len(p) for p in parsed)
        choices = list(runner.MODES) if is_chain else [m for m in runner.MODES if m != "chain"]
        if mode not in choices:
            mode = "auto"
            note += " Chain verification needs a chain: switched to auto."
        return gr.Radio(choices=choices, value=mode), note.strip()

    @quiet()
    def on_depth(self, depth: float, budget: float):
        return gr.Slider(value=max(int(budget), int(depth)))

    @quiet()
    def on_budget(self, budget: float, depth: float):
        return gr.Slider(value=min(int(depth), int(budget)))

    @quiet(6)
    def on_drafter(self, drafter: str, block_size: float, top_k: float, model: str = LOADED, tree: str = "chain",
                   paths: str = "", mode: str = "auto"):
        """Show α for the oracle; cap block size and top-k at what the drafter was trained for;
        the preset, mode and note as `preset_controls` leaves them."""
        lim = self.models.limits(model, drafter)
        return (gr.Slider(visible=drafter == runner.ORACLE),
                gr.Slider(maximum=lim["block_size"], value=min(int(block_size), lim["block_size"])),
                gr.Slider(maximum=lim["top_k"], value=min(int(top_k), lim["top_k"])),
                *self.preset_controls(drafter, model, tree, paths, mode))

    @quiet(11)
    def on_model(self, model: str, drafter: str, block_size: float, top_k: float, max_new_tokens: float,
                 tree: str = "chain", paths: str = "", mode: str = "auto"):
        """Offer the chosen model's drafters and ranges. A model that cannot run here says why
        in the status and the choice goes back to the loaded model; nothing is built.

        Returns updates of: model, drafter, oracle α, block size, top-k, max new tokens, the
        model line, the status, and the preset box, mode and preset note (`preset_controls`).
        """
        status = gr.skip()
        reason = self.models.unavailable(model)
        if reason:
            status = (f"**{html.escape(self.models.get(model).label)}** cannot run here: it {html.escape(reason)}. "
                      "The loaded model stays selected.")
            model = LOADED
        drafters = self.models.get(model).drafters
        drafter = drafter if drafter in drafters else next(iter(drafters))
        lim, most = self.models.limits(model, drafter), self.control_range("max_new_tokens", drafter, model)[1]
        return (gr.Dropdown(choices=self.models.options(), value=model),
                gr.Dropdown(choices=[(label, name) for name, label in drafters.items()], value=drafter),
                gr.Slider(visible=drafter == runner.ORACLE),
                gr.Slider(maximum=lim["block_size"], value=min(int(block_size), lim["block_size"])),
                gr.Slider(maximum=lim["top_k"], value=min(int(top_k), lim["top_k"])),
                gr.Slider(maximum=most, value=min(int(max_new_tokens), most)),
                self.model_md(model), status, *self.preset_controls(drafter, model, tree, paths, mode))


def model_info(models: ModelChoices) -> str:
    """The Model selector's hint: what the other model is, or what it lacks here."""
    if runner.RANDOM_1P3B not in models.choices:
        return "the only model of this page (chosen at start)"
    reason = models.unavailable(runner.RANDOM_1P3B)
    if reason:
        return f"the GDN-1.3B shape {reason} here"
    return (f"the GDN-1.3B shape is built on its first run (about {runner.RANDOM_1P3B_GIB:.0f} GiB of GPU "
            "memory) and kept for every session")


def build_demo(runtime: runner.Runtime, run_fn: Callable | None = None, model_limit: int = 1,
               models: ModelChoices | None = None) -> gr.Blocks:
    """The page on `runtime`; `run_fn` and `models` as Explorer takes them."""
    ex = Explorer(runtime, run_fn, models)
    examples, example_labels = load_examples()
    first = ex.first_drafter
    D = CONTROL_DEFAULTS

    def rng(name):
        return ex.control_range(name, first)

    # uploads and cached outputs older than an hour are deleted every 10 minutes
    with Page(title="SpecLA Explorer", delete_cache=(600, 3600)) as demo:
        gr.Markdown(INTRO)
        model_line = gr.Markdown(ex.model_md(LOADED), elem_id="model-line")
        trace_state, cursor_state = gr.State(None), gr.State(None)
        with gr.Row():
            with gr.Column(scale=2, min_width=340):
                model = gr.Dropdown(ex.models.options(), value=LOADED, label="Model", elem_id="model",
                                    info=model_info(ex.models), interactive=len(ex.models.choices) > 1)
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
                            "*Stop* cancels a run after the step in progress and keeps what it has so far.")
            with gr.Column(scale=3, min_width=420):
                status = gr.Markdown("Ready.", label="run status", elem_id="status")
                text = gr.HTML(F.token_html(None), label="output text", elem_id="text")
                summary = gr.Markdown("", label="run summary", elem_id="summary")
                with gr.Row():
                    export_btn = gr.Button("Export trace (JSON)", elem_id="export")
                    download = gr.DownloadButton("Download trace", visible=False, elem_id="download")
                    upload = gr.UploadButton(f"Upload a trace to replay (≤ {MAX_TRACE_BYTES // 2**20} MiB)",
                                             file_types=[".json"], elem_id="upload")
        with gr.Accordion("Decoding settings", open=True):
            with gr.Row():
                drafter = gr.Dropdown([(runtime.labels[n], n) for n in runtime.drafters], value=first,
                                      elem_id="drafter",
                                      label="Drafter", info="oracle: knows the target's answer, right with "
                                      "probability α; measures the engine, not a real drafter")
                oracle_alpha = gr.Slider(*rng("oracle_alpha"), value=D["oracle_alpha"], step=0.05,
                                         label="Oracle acceptance α", visible=first == runner.ORACLE)
                tree = gr.Radio(list(runner.TREE_SHAPES), value=D["tree"], label="Tree shape")
                mode = gr.Radio(list(runner.MODES), value=D["mode"], label="Verification",
                                info="auto picks per step from the tree's shape")
                with gr.Column(min_width=220):
                    first_preset = ex.preset_for(first)
                    paths = gr.Textbox(value=first_preset, label="Tree preset (optional, overrides the shape)",
                                       lines=1, elem_id="paths",
                                       placeholder="index paths, e.g. [[0], [0, 0], [1], [0, 1]], or measured")
                    preset_note = gr.Markdown(ex.shape_controls(D["tree"], first_preset, D["mode"])[1])
            with gr.Row():
                top_k = gr.Slider(*rng("top_k"), value=min(D["top_k"], rng("top_k")[1]), step=1,
                                  label="Top-k (children per node)")
                budget = gr.Slider(*rng("budget"), value=D["budget"], step=1, label="Node budget")
                block_size = gr.Slider(*rng("block_size"), value=min(D["block_size"], rng("block_size")[1]),
                                       step=1, label="Block size", info="block / LiLiCorr drafters")
                depth = gr.Slider(*rng("depth"), value=D["depth"], step=1, label="Depth",
                                  info="EAGLE drafter; kept ≤ budget")
                prune_tau = gr.Slider(*rng("prune_tau"), value=D["prune_tau"], step=0.5, label="Pruning τ (0 = off)",
                                      info="keep nodes within τ nats of the best path")
            with gr.Row():
                temperature = gr.Slider(*rng("temperature"), value=D["temperature"], step=0.05,
                                        label="Temperature (0 = greedy)")
                top_p = gr.Slider(*rng("top_p"), value=D["top_p"], step=0.05, label="Top-p")
                max_new = gr.Slider(*rng("max_new_tokens"), value=D["max_new_tokens"], step=1,
                                    label="Max new tokens", elem_id="max-new")
                seed = gr.Number(value=D["seed"], precision=0, minimum=rng("seed")[0], maximum=rng("seed")[1],
                                 label="Seed")
                deferred = gr.Checkbox(value=D["deferred"], label="Deferred commit",
                                       info="fold accepted factors into the next verification")
        # one screen on a 1280x720 projector: the scrubber and the step in words beside the tree
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=320):
                slider = gr.Slider(0, 1, value=0, step=1, label="Step", interactive=False, elem_id="scrubber")
                step_info = gr.HTML(F.step_html(None, None), label="step in words", elem_id="step-info")
            with gr.Column(scale=3, min_width=420):
                gr.Markdown("**Draft tree**: left to right = depth; ■ root (the last bonus), ● drafted node "
                            "coloured by draft probability, blue line = accepted path, ★ = +1 bonus token, "
                            "grey × = pruned before verification. Hover a node for the target's view.")
                tree_plot = gr.Plot(F.tree_figure(None, None), label="draft tree", show_label=False,
                                    elem_id="tree-plot")
        gr.Markdown("**LiLiCorr lattice**: slots × top-k candidates of the block drafter, shaded by "
                    "log-probability; orange frames = the path LiLiCorr chose, red frames = the target's "
                    "token, dashed line over rank 0 = the top-1 path; numbers above = pair scores along the "
                    "chosen path.")
        lattice_plot = gr.Plot(F.lattice_figure(None, None), label="LiLiCorr lattice", show_label=False,
                               elem_id="lattice-plot")
        gr.Markdown("**State commits**: how many tokens each step folded into the recurrent state (and kept "
                    "pending when deferred), bytes of factors against dense per-node state snapshots, commit "
                    "time and verification mode. Rejected tokens write nothing into the state.")
        commit_plot = gr.Plot(F.commit_figure(None), label="state commits", show_label=False, elem_id="commit-plot")
        gr.Markdown("**Speedup**: tokens/s against the AR baseline measured on the same prompt and hardware in "
                    "this run (dashed), τ per step with the predicted E[τ] for the measured per-token "
                    "acceptance α, accepted lengths, and where each step's time went.")
        speedup_plot = gr.Plot(F.speedup_figure(None), label="speedup", show_label=False, elem_id="speedup-plot")

        controls = [drafter, oracle_alpha, tree, paths, top_k, block_size, depth, budget, prune_tau, mode,
                    deferred, temperature, top_p, max_new, seed, model]
        views = [status, text, step_info, slider, tree_plot, lattice_plot, commit_plot, speedup_plot, summary,
                 trace_state, cursor_state]
        model_queue = dict(concurrency_limit=model_limit, concurrency_id="model", show_progress_on=[status])
        helper = dict(api_visibility="undocumented")
        raw = dict(preprocess=False)   # values as sent: runner.normalize_settings checks them with clear messages

        def waiting():
            return "Waiting for the model (queued behind other runs)…", gr.DownloadButton(visible=False)

        run_ev = run_btn.click(waiting, None, [status, download], queue=False, **helper).then(
            ex.on_run, [prompt, *controls], views, api_name="run", **model_queue, **raw)
        step_ev = step_btn.click(ex.on_step, [prompt, trace_state, cursor_state, *controls], views,
                                 api_name="step", **model_queue, **raw)
        stop_btn.click(None, None, None, cancels=[run_ev, step_ev], queue=False, **helper).then(
            ex.on_stop, [trace_state, cursor_state], views, **helper)
        reset_btn.click(ex.on_reset, None, views + [download], cancels=[run_ev, step_ev], **helper)
        slider.input(ex.on_scrub, [slider, trace_state, cursor_state], views, trigger_mode="always_last",
                     show_progress="hidden", api_name="scrub", **raw)
        export_btn.click(ex.on_export, [trace_state], [download, status], api_name="export").then(
            ex.show_download, [download], [download], **helper)
        upload.upload(ex.on_upload, [upload], views + [prompt, *controls, preset_note], api_name="replay").then(
            quiet()(ex.model_md), [model], [model_line], **helper)
        for event in (tree.input, paths.blur, paths.submit):
            event(ex.on_shape, [tree, paths, mode], [mode, preset_note], show_progress="hidden", **helper)
        depth.release(ex.on_depth, [depth, budget], [budget], show_progress="hidden", **helper)
        budget.release(ex.on_budget, [budget, depth], [depth], show_progress="hidden", **helper)
        preset_controls = [paths, mode, preset_note]
        drafter.input(ex.on_drafter, [drafter, block_size, top_k, model, tree, paths, mode],
                      [oracle_alpha, block_size, top_k, *preset_controls], show_progress="hidden", **helper)
        model.input(ex.on_model, [model, drafter, block_size, top_k, max_new, tree, paths, mode],
                    [model, drafter, oracle_alpha, block_size, top_k, max_new, model_line, status, *preset_controls],
                    show_progress="hidden", **helper)
    demo.explorer = ex   # for tests
    return demo


# one upload limit: Gradio refuses a bigger file before sending it, and load_trace refuses it too
LAUNCH_KWARGS = dict(css=CSS, theme=gr.themes.Soft(), max_file_size=MAX_TRACE_BYTES, head=UPLOAD_GUARD_JS)
