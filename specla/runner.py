"""The service layer of the explorer: load a runtime, run a prompt, replay a trace.

No gradio here: the app calls `run` (a generator of traces, the last one complete) and
builds every view from the trace dicts it yields. A run measures the AR baseline on the
same prompt, device and settings first, then decodes speculatively, so the speedup in the
trace compares two measurements of this run.

    runtime = load_runtime()                       # assets/ model + drafters, or a demo
    for trace in run(runtime, "def fib(n):", {"drafter": "block", "max_new_tokens": 64}):
        ...                                        # partial traces, then the complete one
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from specla import trace as tr
from specla.decode import MAX_NEW_TOKENS, DecodeSettings, check_prompt
from specla.drafters.base import Draft, DraftContext, DraftSettings
from specla.drafters.oracle import OracleDrafter
from specla.engine import Engine
from specla.tree import MAX_TREE_NODES, DraftTree, TreeError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DRAFTER_KINDS = ("block", "lilicorr", "eagle")
ORACLE = "oracle"
MAX_PROMPT_CHARS = 20_000
MAX_PROMPT_TOKENS = 2048

DEFAULTS: dict[str, Any] = {
    "drafter": None, "tree": "chain", "top_k": 4, "budget": 8, "block_size": 8, "depth": 6,
    "prune_tau": None, "mode": "auto", "deferred": True, "temperature": 0.0, "top_p": 1.0,
    "max_new_tokens": 64, "seed": 0, "paths": None, "oracle_alpha": 0.8,
}
TREE_SHAPES = ("chain", "beam", "best-first")
MODES = ("auto", "chain", "tree", "hybrid")


class ByteTokenizer:
    """A stand-in tokenizer (one token per UTF-8 byte) for the random demo model and tests."""
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@dataclasses.dataclass
class Runtime:
    """The target model, its tokenizer and the drafters, loaded once per process.

    `drafters` maps a name to a drafter object (reset per run by the engine) or to a
    factory `make(prompt_tokens, ar_tokens, settings) -> drafter` for drafters built per
    run, such as the oracle that needs the target's own continuation.
    """
    target: Any
    tokenizer: Any
    drafters: dict[str, Any]
    model_name: str = "unnamed"
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""
    eos_token_id: int | None = None
    fingerprint: str = ""
    engine: Engine | None = None      # default: Engine(target), graphed on CUDA

    def __post_init__(self) -> None:
        if not self.drafters:
            raise ValueError("a runtime needs at least one drafter")
        if not self.fingerprint:
            self.fingerprint = model_fingerprint(self.target)
        for name in self.drafters:
            self.labels.setdefault(name, "oracle (measurement)" if name == ORACLE else name)
        if self.engine is None:
            self.engine = Engine(self.target)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    def encode(self, text: str) -> list[int]:
        if hasattr(self.tokenizer, "get_vocab") and hasattr(self.tokenizer, "convert_ids_to_tokens"):
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        out = self.tokenizer.encode(text)
        return list(getattr(out, "ids", out))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def model_info(self) -> dict:
        graphed = self.engine.backend == "graphed"
        return {"name": self.model_name, "device": self.device.type, "hardware": hardware_name(self.device),
                "launch": "CUDA graphs" if graphed else "eager PyTorch", "backend": self.engine.backend,
                "dtype": str(self.target.dtype).replace("torch.", ""), "fingerprint": self.fingerprint,
                "config": dataclasses.asdict(self.target.config)}


def model_fingerprint(model) -> str:
    """A short hash of the config, the parameter names and shapes, and a sample of each tensor."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            h.update(f"{name}{tuple(p.shape)}".encode())
            h.update(p.flatten()[:32].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"CPU {cpu}, {threads} thread{'s' if threads != 1 else ''}"


def oracle_factory(vocab_size: int) -> Callable:
    """The oracle drafter, built per run from the AR continuation (labelled as measurement)."""
    def make(prompt_tokens: list[int], ar_tokens: list[int], settings: dict) -> OracleDrafter:
        shape = "chain" if settings["tree"] == "chain" and not settings["paths"] else "tree"
        return OracleDrafter(ar_tokens, vocab_size, alpha=settings["oracle_alpha"],
                             seed=settings["seed"], shape=shape)
    return make


def tiny_random_runtime(seed: int = 0, device: str = "cpu", note: str = "",
                        random_drafters: tuple[str, ...] = ()) -> Runtime:
    """A 2-layer random-weight GDN over bytes with the oracle drafter: tests and demo only.

    `random_drafters` adds untrained drafters of those kinds (labelled so): their drafts are
    almost never accepted, but every view, the LiLiCorr lattice included, gets real data.
    """
    from specla.config import GDNConfig
    from specla.model import GDNForCausalLM

    config = GDNConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16,
                       expand_v=2.0, hidden_ratio=2, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    target = GDNForCausalLM(config).to(device).eval()
    drafters: dict[str, Any] = {ORACLE: oracle_factory(config.vocab_size)}
    if random_drafters:
        from specla.drafters import new_drafter
        drafters.update({kind: new_drafter(kind, target) for kind in random_drafters})
    return Runtime(target, ByteTokenizer(), drafters, model_name="tiny random GDN (demo, random weights)",
                   note=note, labels={kind: f"{kind} (random weights)" for kind in random_drafters})


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


RANDOM_1P3B = "gdn-1.3b-random"
RANDOM_1P3B_GIB = 6.0          # weights (2.9 GB bf16), state, graphs and workspace, with room
# what the 1.3B runtime says about itself, known before it is built (the page offers it unbuilt)
RANDOM_1P3B_NAME = "GDN-1.3B public shape, random bf16 weights (1.47B parameters)"
RANDOM_1P3B_LABELS = {ORACLE: "oracle (simulated acceptance α)"}
RANDOM_1P3B_NOTE = ("Random weights: the text is noise. The oracle drafter knows the target's own answer and "
                    "is right with probability α: this shows the engine's speed at a simulated acceptance "
                    "rate in the bandwidth-bound regime of a 1.3B model, not a trained drafter.")


def gpu_shortfall(gib: float) -> str | None:
    """Why a model that needs `gib` GiB of GPU memory cannot be built here now; None if it can."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        free = torch.cuda.mem_get_info()[0] / 2**30
    except RuntimeError as err:      # a GPU that torch sees but cannot query
        return f"needs a CUDA GPU whose free memory can be read ({err})"
    if free < gib:
        return f"needs about {gib:.0f} GiB of free GPU memory; {free:.1f} GiB are free"
    return None


class WideVocabTokenizer:
    """A tokenizer for a target whose vocabulary is wider than the tokenizer's: ids it does
    not know are shown as <id> (a random-weight model's output is noise either way)."""

    def __init__(self, inner, vocab_size: int):
        self.inner, self.vocab_size = inner, vocab_size
        self.known = len(inner.get_vocab()) if hasattr(inner, "get_vocab") else 256

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        out, run = [], []
        for i in ids:
            if 0 <= i < self.known:
                run.append(i)
                continue
            if run:
                out.append(self.inner.decode(run))
                run = []
            out.append(f"<{i}>")
        if run:
            out.append(self.inner.decode(run))
        return "".join(out)


def random_1p3b_runtime(device: str = "cuda") -> Runtime:
    """The GDN-1.3B public shape (24 layers x 2048, 1.47B parameters) with random bf16 weights
    and the oracle drafter: the bandwidth-bound regime, at a simulated acceptance rate."""
    from specla.config import PUBLIC_1P3B
    from specla.model import random_gdn

    if device != "cuda":
        raise ValueError("the GDN-1.3B shape needs a CUDA GPU (on a CPU one token takes seconds)")
    shortfall = gpu_shortfall(RANDOM_1P3B_GIB)
    if shortfall:
        raise ValueError(f"the GDN-1.3B shape {shortfall}")
    target = random_gdn(PUBLIC_1P3B, device, torch.bfloat16, seed=0)
    from specla.tokenizer import load_tokenizer
    tokenizer = WideVocabTokenizer(load_tokenizer(ASSETS), PUBLIC_1P3B.vocab_size)
    return Runtime(target, tokenizer, {ORACLE: oracle_factory(PUBLIC_1P3B.vocab_size)},
                   model_name=RANDOM_1P3B_NAME, labels=dict(RANDOM_1P3B_LABELS), note=RANDOM_1P3B_NOTE)


def load_runtime(model: str | None = None, drafters: str | None = None,
                 device: str | None = None, dtype: str = "auto", backend: str = "auto") -> Runtime:
    """The target (default: assets/target), its drafters (default: assets/drafters/<kind>/).

    Without a model in assets/ (and none given), a tiny random demo runtime is returned
    with a note saying so. Trained drafters that do not fit the target (trained for another
    one, or unreadable) are skipped, and the note says which and why. The model-free n-gram
    drafter and the oracle (labelled as measurement) are always offered.
    dtype: bf16 | fp32 | auto (fp32 on the CPU, bf16 on a GPU, where fp32 is not free even
    for a launch-bound model: benchmarks/results/h200/session7/). backend: the engine's
    (auto: CUDA graphs on a GPU).
    """
    from specla.drafters import DrafterFormatError, load_drafter, model_free_drafter

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype not in ("auto", *DTYPES):
        raise ValueError(f"dtype must be auto, bf16 or fp32, got {dtype!r}")
    if model in (None, "") and not (ASSETS / "target").exists():
        model = "random-tiny"
    if model == RANDOM_1P3B:
        return random_1p3b_runtime(device)
    if model == "random-tiny":
        runtime = tiny_random_runtime(device=device, random_drafters=DRAFTER_KINDS, note=(
            "No trained model loaded: this is a tiny random-weight model, for trying the explorer only. "
            "Its text is noise; use the oracle drafter to see drafts accepted."))
        ngram = runtime.drafters["ngram"] = model_free_drafter("ngram", runtime.target)
        runtime.labels["ngram"] = ngram.label
        return runtime
    from specla.checkpoint import load_model

    path = model or str(ASSETS / "target")
    auto = torch.bfloat16 if device == "cuda" else torch.float32
    target, tokenizer, report = load_model(path, device, DTYPES.get(dtype, auto))
    target.eval()
    if tokenizer is None:
        if not (ASSETS / "tokenizer.json").exists():
            raise ValueError(f"{path} has no tokenizer.json and assets/ has none either")
        from specla.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(ASSETS)
    found: dict[str, Any] = {}
    skipped: dict[str, list[str]] = {}     # reason -> drafter kinds
    root = Path(drafters) if drafters else ASSETS / "drafters"
    for kind in DRAFTER_KINDS:
        if (root / kind).is_dir():
            try:
                found[kind] = load_drafter(str(root / kind), target)
            except DrafterFormatError as err:
                reason = "trained for another target" if "trained for another target" in str(err) else str(err)
                skipped.setdefault(reason, []).append(kind)
    found["ngram"] = model_free_drafter("ngram", target)
    found[ORACLE] = oracle_factory(target.config.vocab_size)
    note = " ".join(f"Skipped the {', '.join(kinds)} drafter{'s' if len(kinds) > 1 else ''} in {root} "
                    f"({reason})." for reason, kinds in skipped.items())
    if note:
        note += (" The n-gram drafter needs no training; `python -m specla train drafter --target "
                 f"{path}` trains the others for this model.")
    name = "assets/target" if model in (None, "") else str(path)
    params = getattr(report, "num_parameters", None)
    if isinstance(params, int):
        c = target.config
        name += f" ({params / 1e6:.1f}M parameters, {c.num_hidden_layers} layers × {c.hidden_size})"
    return Runtime(target, tokenizer, found, model_name=name, eos_token_id=target.config.eos_token_id,
                   note=note, labels={"ngram": found["ngram"].label}, engine=Engine(target, backend))


# The drafter a page, or a run that names none, starts with: the pair measured fastest with
# the page's starting shape on the engine's backend. CUDA graphs: the block drafter at its
# measured preset, 1.28x (benchmarks/results/h100/session41/), against LiLiCorr's chain at
# 1.00x (benchmarks/results/h100/session39/). The CPU: LiLiCorr's chain, 1.77x, against the
# block chain's 1.64x (benchmarks/results/cpu/session40/speedup_cpu_default_drafter.md); on
# session 41's noisier VM one LiLiCorr chain ran at 1.68x and 1.94x, the block chain at 1.80x.
PREFERRED_DRAFTERS = {"graphed": ("block", "lilicorr"), "eager": ("lilicorr", "block")}


def default_drafter(runtime: Runtime) -> str:
    """Of the loaded drafters, the first of `PREFERRED_DRAFTERS` for the engine's backend;
    else the first loaded."""
    preferred = PREFERRED_DRAFTERS.get(runtime.engine.backend, ())
    return next((name for name in preferred if name in runtime.drafters), next(iter(runtime.drafters)))


DRAFTER_LIMITS = {"block_size": 32, "top_k": 16}    # the page's limits for a drafter without training limits


def drafter_limits(runtime: Runtime, name: str) -> dict:
    """Largest block size and top-k a loaded drafter supports (what it was trained with)."""
    limits = {"block_size": DRAFTER_LIMITS["block_size"], "top_k": min(DRAFTER_LIMITS["top_k"], runtime.vocab_size)}
    net = getattr(runtime.drafters.get(name), "net", None)
    block = getattr(getattr(net, "config", None), "block_size", None)
    if isinstance(block, int):
        limits["block_size"] = block
    max_k = getattr(getattr(getattr(net, "head", None), "config", None), "max_k", None)
    if isinstance(max_k, int):
        limits["top_k"] = min(limits["top_k"], max_k)
    return limits


# ---------------------------------------------------------------------------------------
# settings


MEASURED = "measured"       # the preset a drafter's folder holds (`python -m specla.train tree-preset`)


def parse_paths(text: Any) -> list[list[int]] | str | None:
    """A Medusa-style tree preset: JSON list of index paths, parents first. '' means none;
    "measured" the drafter's own measured preset (resolved by `validate`)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if isinstance(text, str) and text.strip().lower() == MEASURED:
        return MEASURED
    if isinstance(text, str):
        try:
            paths = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"tree preset is not a JSON list of index paths ({err.msg}); "
                             "example: [[0], [0, 0], [1]]") from None
    else:
        paths = text
    if not (isinstance(paths, list) and paths and all(
            isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 64
                                              for i in p) for p in paths)):
        raise ValueError("tree preset must be a non-empty list of index paths of small non-negative "
                         "integers, e.g. [[0], [0, 0], [1]]")
    if len(paths) > MAX_TREE_NODES - 1:
        raise ValueError(f"tree preset has {len(paths)} nodes; the limit is {MAX_TREE_NODES - 1}")
    try:
        DraftTree.from_index_paths(paths, [0] * (len(paths) + 1))
    except TreeError as err:
        raise ValueError(f"tree preset: {err}") from None
    return paths


def preset_paths(text: Any, drafter, name: str) -> list[list[int]] | None:
    """`parse_paths`, with "measured" resolved to the drafter's own measured preset."""
    paths = parse_paths(text)
    return measured_preset(drafter, name) if paths == MEASURED else paths


def default_preset(runtime: Runtime, drafter: str) -> str:
    """The tree preset a page starts `drafter` with: "measured" where the engine runs CUDA graphs
    and the drafter has a measured preset, the fastest path measured there (the block drafter's,
    1.15x against its chain's 0.99x: benchmarks/results/h200/session19/); else "" (the shape)."""
    entry = runtime.drafters.get(drafter) if isinstance(drafter, str) else None     # bad input: no preset
    return MEASURED if tree_preset_of(entry) and runtime.engine.backend == "graphed" else ""


def tree_preset_of(drafter) -> dict | None:
    """A drafter's measured tree preset as its drafter.json records it, or None."""
    return (getattr(drafter, "meta", None) or {}).get("tree_preset")


def measured_preset(drafter, name: str) -> list[list[int]]:
    """The index paths of a drafter's measured tree preset (its drafter.json), or a ValueError."""
    preset = tree_preset_of(drafter)
    if not preset:
        raise ValueError(f"the {name} drafter has no measured tree preset "
                         "(a block drafter's: python -m specla.train tree-preset)")
    return parse_paths(preset["paths"])


def _number(settings: dict, key: str, kind: type, lo: float, hi: float, optional: bool = False):
    """One numeric setting, checked: a finite number of the right kind within [lo, hi].

    Whole numbers may come as floats or text ("3", 3.0) from a slider or an API client;
    a fraction where a whole number is needed (3.7 tokens) is refused, never cut, and so
    are booleans, lists and other non-numbers. Every refusal is a ValueError naming the
    setting and the value.
    """
    name = key.replace("_", " ")
    value = settings.get(key, DEFAULTS[key])
    if optional and (value is None or (isinstance(value, str) and not value.strip())):
        return None
    raw = value
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {raw!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {raw!r}")
    if kind is int:
        if value != int(value):
            raise ValueError(f"{name} must be a whole number, got {raw!r}")
        value = int(value)
    else:
        value = float(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be between {lo} and {hi}, got {value}")
    return value


def _choice(settings: dict, key: str, choices, label: str):
    """A text setting that must be one of `choices`; anything else is a ValueError."""
    value = settings[key]
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{label} must be one of {', '.join(choices)}, got {value!r}")
    return value


def normalize_settings(runtime: Runtime, settings: dict | None) -> dict:
    """Fill defaults, check every value, return the dict a trace records.

    Consistency rules: a tree preset overrides the shape; chain verification needs a chain
    (a ValueError otherwise); pruning tau 0 or empty means no pruning.
    """
    s = dict(DEFAULTS, **{k: v for k, v in (settings or {}).items() if k in DEFAULTS})
    if s["drafter"] in (None, ""):
        s["drafter"] = default_drafter(runtime)
    if not isinstance(s["drafter"], str) or s["drafter"] not in runtime.drafters:
        raise ValueError(f"unknown drafter {s['drafter']!r}; this model has: {', '.join(runtime.drafters)}")
    _choice(s, "tree", TREE_SHAPES, "tree shape")
    _choice(s, "mode", MODES, "verification mode")
    s["top_k"] = _number(s, "top_k", int, 1, min(64, runtime.vocab_size))
    s["budget"] = _number(s, "budget", int, 1, MAX_TREE_NODES - 1)
    s["block_size"] = _number(s, "block_size", int, 2, 64)
    s["depth"] = _number(s, "depth", int, 1, 64)
    s["prune_tau"] = _number(s, "prune_tau", float, 0.0, 100.0, optional=True) or None
    s["temperature"] = _number(s, "temperature", float, 0.0, 10.0)
    s["top_p"] = _number(s, "top_p", float, 1e-6, 1.0)
    s["max_new_tokens"] = _number(s, "max_new_tokens", int, 1, MAX_NEW_TOKENS)
    s["seed"] = _number(s, "seed", int, 0, 2**31 - 1)
    s["oracle_alpha"] = _number(s, "oracle_alpha", float, 0.0, 1.0)
    if not isinstance(s["deferred"], bool):
        raise ValueError(f"deferred commit must be true or false, got {s['deferred']!r}")
    s["paths"] = preset_paths(s["paths"], runtime.drafters[s["drafter"]], s["drafter"])
    is_chain = s["tree"] == "chain" if s["paths"] is None else all(p == [0] * len(p) for p in s["paths"])
    if s["mode"] == "chain" and not is_chain:
        raise ValueError("chain verification needs a chain draft: pick tree shape 'chain' "
                         "or verification auto / tree / hybrid")
    if s["drafter"] != ORACLE:
        s.pop("oracle_alpha")
    return s


def settings_record(s: dict) -> dict:
    """Normalised settings as a trace records them (no empty preset)."""
    return {k: v for k, v in s.items() if k != "paths" or v}


def clean_prompt(prompt: Any) -> str:
    """The prompt as the trace records it: text, within the length limit, valid UTF-8."""
    if not isinstance(prompt, str):
        raise ValueError("the prompt must be text")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt is {len(prompt):,} characters long; the limit is {MAX_PROMPT_CHARS:,}")
    # lone surrogates (possible in JSON from a browser) cannot be encoded: replace them
    return prompt.encode("utf-8", errors="replace").decode("utf-8")


def encode_prompt(runtime: Runtime, prompt: str) -> list[int]:
    if not prompt.strip():
        raise ValueError("the prompt is empty: type at least one character")
    tokens = runtime.encode(prompt)
    check_prompt(tokens, runtime.vocab_size, MAX_PROMPT_TOKENS)
    return tokens


# ---------------------------------------------------------------------------------------
# a tree preset applied to any drafter


class PresetShape:
    """Keep only the drafter's nodes at the preset's index paths (sibling ranks).

    The inner drafter is asked for a tree wide and deep enough; its candidates are ranked
    by the order it lists siblings in (best first for top-k drafters). Acceptance stays
    exact: any candidate subset is verified losslessly.
    """

    def __init__(self, inner, paths: list[list[int]]):
        self.inner, self.paths = inner, [tuple(p) for p in paths]
        self.name = getattr(inner, "name", "drafter")
        self.feature_layers = inner.feature_layers

    def settings(self, settings: DraftSettings) -> DraftSettings:
        """The inner drafter's settings: wide, deep and large enough for every preset path."""
        return settings.for_preset(self.paths)

    def reset(self, *args) -> None:
        self.inner.reset(*args)

    def observe(self, accepted) -> None:
        self.inner.observe(accepted)

    def propose(self, ctx: DraftContext) -> Draft:
        if getattr(self.inner, "static_rows", False):     # every preset node, as the device drafts it
            return self.inner.propose_preset(DraftContext(ctx.root_token, self.settings(ctx.settings), ctx.generator),
                                             self.paths)
        s = self.settings(ctx.settings)
        if s.tree == "chain":
            s.tree = "beam"
        draft = self.inner.propose(DraftContext(ctx.root_token, s, ctx.generator))
        tree = draft.tree
        wanted = set(self.paths)
        keep = [0] + [i + 1 for i, p in enumerate(tree.to_index_paths()) if tuple(p) in wanted]
        new_index = {old: new for new, old in enumerate(keep)}

        def remap(node: dict) -> dict | None:  # pruned nodes hang off a kept parent, or go
            if "parent" not in node:
                return node
            return dict(node, parent=new_index[node["parent"]]) if node["parent"] in new_index else None

        dropped = [{"token": tree.tokens[i], "parent": tree.parents[i], "reason": "preset"}
                   for i in range(1, len(tree)) if i not in new_index]
        kept = DraftTree([tree.tokens[i] for i in keep], [-1] + [new_index[tree.parents[i]] for i in keep[1:]],
                         None if tree.logprobs is None else [tree.logprobs[i] for i in keep],
                         pruned=[q for q in map(remap, tree.pruned + dropped) if q is not None])
        proposal = None if draft.proposal is None else draft.proposal[keep]
        return Draft(kept, proposal, draft.details)


# ---------------------------------------------------------------------------------------
# runs


def _draft_settings(s: dict) -> DraftSettings:
    return DraftSettings(top_k=s["top_k"], budget=s["budget"], block_size=s["block_size"], depth=s["depth"],
                         tree=s["tree"], prune_tau=s["prune_tau"], temperature=s["temperature"])


def _decode_settings(s: dict, runtime: Runtime, max_new_tokens: int | None = None) -> DecodeSettings:
    return DecodeSettings(max_new_tokens=max_new_tokens or s["max_new_tokens"], temperature=s["temperature"],
                          top_p=s["top_p"], mode=s["mode"], deferred=s["deferred"], seed=s["seed"],
                          stop_at_eos=runtime.eos_token_id is not None)


def _drafter_for_run(runtime: Runtime, s: dict, prompt_tokens: list[int], ar_tokens: list[int]):
    entry = runtime.drafters[s["drafter"]]
    if hasattr(entry, "propose"):
        # a shallow copy per run: weights shared, per-sequence state (rebound by reset) not
        drafter = copy.copy(entry)
    else:
        drafter = entry(prompt_tokens, ar_tokens, s)
    return PresetShape(drafter, s["paths"]) if s["paths"] else drafter


def run(runtime: Runtime, prompt: str, settings: dict | None = None) -> Iterator[dict | str | None]:
    """Measure AR, then decode speculatively through the engine; yield what the page shows.

    Yields a status line (str) while measuring or capturing, `None` after each decoded step
    with nothing new to draw (so a consumer can stop between any two steps; on the graphed
    backend, whose steps are decoded in batches, at most every HEARTBEAT_SECONDS), and traces: a
    partial one now and then, the complete one last. Every trace is a snapshot: nothing in
    it changes after it is yielded.

    The speedup compares two measurements of this run on this machine: AR and speculation
    through the same engine backend, warmed up. Graphed (CUDA): AR is the median of 3 runs
    of the graphed AR step, speculation the sum of the steps' CUDA-event times. Eager (CPU):
    AR and speculation alternate three times and the fastest of each counts (a shared CPU
    moves single runs by 20%); the trace keeps every pair's speedup as the spread.
    """
    clock = _StageClock()
    s = normalize_settings(runtime, settings)
    prompt = clean_prompt(prompt)
    tokens = encode_prompt(runtime, prompt)
    engine, eos = runtime.engine, runtime.eos_token_id
    graphed = engine.backend == "graphed"
    decode = _decode_settings(s, runtime)
    yield (f"Measuring the AR baseline ({'CUDA graphs, median of 3 runs' if graphed else 'eager PyTorch'}) "
           f"on {hardware_name(runtime.device)}…")
    engine.ar(tokens, _decode_settings(s, runtime, min(4, s["max_new_tokens"])), eos)   # warm
    ar = engine.ar(tokens, decode, eos, repeats=3 if graphed else 1)
    clock.stage("ar_baseline")
    drafter = _drafter_for_run(runtime, s, tokens, ar.tokens)
    if graphed:
        yield "Capturing the CUDA graphs for these settings (once per settings; not timed)…"
    capture_ms = _warm_speculation(engine, drafter, tokens, s, runtime, eos)
    clock.stage("drafter_and_capture")
    plan = engine.plan(drafter, decode, _draft_settings(s))      # after the build: a failed capture shows
    model, record = runtime.model_info(), settings_record(s)
    engine_info = {"backend": plan.backend, "drafting": plan.drafting, "acceptance": plan.acceptance,
                   "note": plan.note, "ops": engine.ops_note, "verification": engine.verification_note(),
                   "drafting_kernel": engine.drafting_note(),
                   "dtype": model["dtype"],
                   "graphs": engine.graphs, "capture_ms": round(capture_ms, 1)}

    def make(steps: list[dict], seconds: float, baseline: dict, **extra) -> dict:
        trace = tr.build_trace(model=model, settings=record, prompt=prompt, prompt_tokens=tokens, steps=steps,
                               decode=runtime.decode, seconds=seconds, baseline=baseline)
        trace["engine"] = dict(engine_info, graphs=engine.graphs)
        trace["latency_ms"] = dict(clock.stages)
        trace.update(extra)
        spread = (extra.get("timing") or {}).get("speedup_spread")
        if spread:
            trace["summary"]["speedup_spread"] = spread
        return trace

    baseline = _baseline(ar.ms_per_token, len(ar.tokens), ar.runs_ms_per_token)
    steps: list[dict] = []
    seconds, last_yield = 0.0, time.perf_counter()
    last_beat = last_yield
    if not graphed:
        # the page shows the baseline while the first step decodes; on CUDA graphs that step
        # comes milliseconds later, and drawing an empty trace first would delay it (~50-90 ms)
        yield make([], 0.0, baseline)
    for rec in engine.speculate(tokens, drafter, decode, _draft_settings(s), eos):
        steps.append(tr.step_to_dict(rec))
        seconds += rec.elapsed_ms / 1e3
        now = time.perf_counter()
        if len(steps) == 1:
            clock.stage("first_step")
        if len(steps) == 1 or now - last_yield >= UPDATE_SECONDS:    # the first step is drawn at once
            last_yield = last_beat = now
            yield make(list(steps), seconds, baseline)
        elif not graphed or now - last_beat >= HEARTBEAT_SECONDS:
            # graphed: a batch of steps was decoded before its records arrive, so a heartbeat
            # per record would only cost a page update each (~10 ms) with nothing left to stop
            last_beat = now
            yield None
    extra: dict[str, Any] = {}
    if not graphed:
        seconds, baseline, extra["timing"] = yield from _alternate(engine, drafter, tokens, s, runtime, eos,
                                                                   ar, seconds, steps)
    clock.stage("decode")
    spec_tokens = tr.output_tokens(steps)[0]
    extra["exactness"] = _exactness(engine, tokens, ar.tokens, spec_tokens, s)
    clock.stage("exactness")
    yield make(steps, seconds, baseline, **extra)


UPDATE_SECONDS = 0.25         # at most this often a partial trace is drawn while decoding
HEARTBEAT_SECONDS = 0.05      # graphed backend: at most this often an empty update (a place to Stop)


class _StageClock:
    """Wall milliseconds of a run's stages (host clock, each stage ending where the next
    begins), kept in the trace so a slow first step can be traced to its stage."""

    def __init__(self):
        self.stages: dict[str, float] = {}
        self.last = time.perf_counter()

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = round(1e3 * (now - self.last), 2)
        self.last = now


def _baseline(ms_per_token: float, tokens: int, runs: list[float]) -> dict:
    return {"kind": "ar", "tokens_per_s": round(1e3 / ms_per_token, 3) if ms_per_token > 0 else 0.0,
            "seconds": round(ms_per_token * tokens / 1e3, 4), "tokens": tokens,
            "ms_per_token_runs": [round(x, 5) for x in runs]}


def _warm_speculation(engine, drafter, tokens, s, runtime, eos) -> float:
    """Build (graphed: capture and compile) and warm the speculative decode for these settings,
    on a short decode. Returns the milliseconds that took (never part of a speedup)."""
    start = time.perf_counter()
    short = _decode_settings(s, runtime, min(4, s["max_new_tokens"]))
    for _ in engine.speculate(tokens, drafter, short, _draft_settings(s), eos):
        pass
    return 1e3 * (time.perf_counter() - start)


def _alternate(engine, drafter, tokens, s, runtime, eos, ar, seconds, steps):
    """Two more AR / speculation pairs after the streamed one (eager backend): the fastest run
    of each counts, and every pair's speedup is kept as the spread."""
    decode = _decode_settings(s, runtime)
    produced = sum(len(st["new_tokens"]) for st in steps) or 1
    ar_ms, spec_ms = [ar.ms_per_token], [1e3 * seconds / produced]
    for _ in range(2):
        yield "Repeating AR and speculation (fastest of 3 alternating runs counts)…"
        ar_ms.append(engine.ar(tokens, decode, eos).ms_per_token)
        took = 0.0
        for rec in engine.speculate(tokens, drafter, decode, _draft_settings(s), eos):
            took += rec.elapsed_ms
            yield None
        spec_ms.append(took / produced)
    pairs = [a / b for a, b in zip(ar_ms, spec_ms) if b > 0]
    timing = {"method": "3 alternating AR / speculation runs, fastest of each",
              "ar_ms_per_token": [round(x, 4) for x in ar_ms], "spec_ms_per_token": [round(x, 4) for x in spec_ms],
              "speedup_spread": [round(min(pairs), 4), round(max(pairs), 4)] if pairs else None}
    return min(spec_ms) * produced / 1e3, _baseline(min(ar_ms), len(ar.tokens), ar_ms), timing


def _exactness(engine, prompt: list[int], ar_tokens: list[int], spec_tokens: list[int], s: dict) -> dict:
    """Whether the output equals AR's (greedy), and where and by what logit gap it leaves it."""
    if s["temperature"] > 0:
        return {"checked": False, "why": "sampling: the output follows the target's distribution, not AR's draw"}
    n = min(len(ar_tokens), len(spec_tokens))
    first = next((i for i in range(n) if ar_tokens[i] != spec_tokens[i]), None)
    out = {"checked": True, "equal": first is None, "compared_tokens": n, "dtype": str(engine.dtype).replace("torch.", "")}
    if first is not None:
        out["first_divergence"] = engine.divergence(prompt, spec_tokens, first, ar_tokens[first])
    return out


def reveal(trace: dict, n_steps: int) -> dict:
    """The trace as it stood after its first `n_steps` steps (for the Step button).

    Output and summary are rebuilt from those steps; the time is the complete run's time
    scaled by the share of measured step time, the baseline is kept.
    """
    steps = trace["steps"][:max(0, n_steps)]
    if len(steps) == len(trace["steps"]):
        return trace
    def total(ss):
        return sum(sum(st["times_ms"].values()) for st in ss)
    full = total(trace["steps"])
    seconds = trace["summary"].get("seconds", 0.0) * (total(steps) / full if full > 0 else 0.0)
    tokens, sources, step_of = tr.output_tokens(steps)
    text = trace.get("token_text", {})
    out = dict(trace, steps=steps)
    out["output"] = {"tokens": tokens, "sources": sources, "step_of": step_of,
                     "text": "".join(text.get(str(t), "") for t in tokens)}
    out["summary"] = tr.summarize(steps, seconds, trace.get("baseline"))
    return out


def replay(data: Any, runtime: Runtime | None = None) -> tuple[dict, str]:
    """Validate a loaded trace for display; the note says if its model is not the loaded one."""
    trace = tr.validate_trace(data)
    model = trace.get("model", {})
    name = tr.visible(str(model.get("name", "unknown model")), 80)
    if runtime is None:
        return trace, f"Replaying a saved trace of {name} (no model needed)."
    if model.get("fingerprint") and model.get("fingerprint") == runtime.fingerprint:
        return trace, f"Replaying a saved trace of the loaded model ({name})."
    return trace, (f"Replaying a saved trace of {name}, which is not the loaded model "
                   f"({runtime.model_name}): the views show the trace as recorded; Run uses the loaded model.")


EXPORT_KEEP = 20              # exported trace files kept on disk: the newest ...
EXPORT_MAX_AGE_S = 30 * 60    # ... and none older than this (a download link lives this long)


def export_folder(folder: str | Path | None = None) -> Path:
    """Where exports go: `folder`, else $GRADIO_TEMP_DIR/traces, else ./.gradio/traces."""
    return Path(folder or os.environ.get("GRADIO_TEMP_DIR") or Path.cwd() / ".gradio") / "traces"


def export_trace(trace: dict, folder: str | Path | None = None) -> Path:
    """Check `trace`, write it as `trace-<uuid>.json` and prune older exports.

    The name is random because files in the app's cache are public by URL. A trace that
    breaks the trace invariant raises TraceError and nothing is written.
    """
    import uuid

    tr.validate_trace(trace)
    folder = export_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"trace-{uuid.uuid4().hex}.json"
    try:
        data = tr.dumps(trace).encode("utf-8")
    except UnicodeEncodeError:     # lone surrogates from an uploaded trace: keep them as \u escapes
        data = json.dumps(trace, separators=(",", ":")).encode("ascii")
    path.write_bytes(data)
    prune_exports(folder, keep_path=path)
    return path


def prune_exports(folder: str | Path, keep: int = EXPORT_KEEP, max_age_s: float = EXPORT_MAX_AGE_S,
                  keep_path: Path | None = None) -> int:
    """Delete exported traces beyond the newest `keep` and any older than `max_age_s`.

    `keep_path` (the export just written) always stays. Returns the number deleted.
    """
    files = []
    for path in Path(folder).glob("trace-*.json"):
        try:
            files.append((path.stat().st_mtime, path))
        except OSError:        # deleted by another session meanwhile
            continue
    files.sort(reverse=True)
    now, deleted = time.time(), 0
    for rank, (mtime, path) in enumerate(files):
        if path == keep_path or (rank < keep and now - mtime <= max_age_s):
            continue
        try:
            path.unlink()
            deleted += 1
        except OSError:
            pass
    return deleted
