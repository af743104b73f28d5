"""Shared pieces of the bench suites: result files, timing statistics, the environment."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "results"
SUITES = ("runtime", "e2e", "head", "kernels", "acceptance")
PROMPT_FILES = (ROOT / "data" / "corpus" / "heldout_prompts.jsonl", ROOT / "examples" / "prompts.jsonl")

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety
    def tqdm(it, **kw):
        return it


def stat(values) -> dict:
    """Run count, median, min, max (and the values) of a list of numbers."""
    values = [float(v) for v in values]
    if not values:
        return {"runs": 0, "median": None, "min": None, "max": None, "values": []}
    return {"runs": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values), "values": [round(v, 6) for v in values]}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


class Deadline:
    """Wall-clock budget: suites stop starting new variants once it is spent."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def ok(self, need: float = 0.0) -> bool:
        return self.left() > need


class Results:
    """One suite's JSON, rewritten after every change so a crash loses at most one variant."""

    def __init__(self, out: Path, name: str, env: dict):
        self.path = out / f"{name}.json"
        self.data = {"suite": name, "environment": env}

    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, value):
        self.data[key] = value
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        tmp.replace(self.path)


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return repr(x)


def guarded(record: dict, key: str, fn, *args, **kwargs):
    """Run one variant; on failure keep the traceback in the results and go on."""
    try:
        value = fn(*args, **kwargs)
        record[key] = value
        return value
    except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others
        record[key] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        print(f"  ! {key} failed: {type(err).__name__}: {err}", flush=True)
        if torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a sticky CUDA error: nothing more to save
                pass
        return None


def git_commit() -> dict:
    """Commit and dirtiness from git, or from .git itself when the git binary is missing, or
    from SPECLA_COMMIT where the tree was copied without .git (the GPU machine)."""
    if os.environ.get("SPECLA_COMMIT"):
        return {"commit": os.environ["SPECLA_COMMIT"], "dirty": None, "source": "SPECLA_COMMIT"}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                                   text=True, timeout=10).stdout.strip() != ""
            return {"commit": head.stdout.strip(), "dirty": dirty, "source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    git = ROOT / ".git"
    try:
        ref = (git / "HEAD").read_text().strip()
        if not ref.startswith("ref:"):
            return {"commit": ref, "dirty": None, "source": ".git/HEAD"}
        name = ref.split(None, 1)[1]
        if (git / name).exists():
            return {"commit": (git / name).read_text().strip(), "ref": name, "dirty": None, "source": ".git"}
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + name):
                return {"commit": line.split()[0], "ref": name, "dirty": None, "source": "packed-refs"}
    except OSError:
        pass
    return {"commit": None, "dirty": None, "source": "unknown"}


def environment(device: torch.device, argv: list[str]) -> dict:
    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: say so
            return None

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python -m specla bench"] + list(argv)),
           "device": str(device), "python": platform.python_version(),
           "torch": torch.__version__, "triton": version("triton"), "fla": version("fla"),
           "transformers": version("transformers"), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "git": git_commit()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), sm_count=props.multi_processor_count, cuda=torch.version.cuda,
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return env


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def timing(runs_ms: list[float], tokens: int, bytes_per_step: int | None = None,
           floor_ms: float | None = None) -> dict:
    """ms/token and tokens/s stats of runs that each produced `tokens` tokens."""
    per_token = [ms / tokens for ms in runs_ms]
    out = {"tokens_per_run": tokens, "ms_per_token": stat(per_token),
           "tokens_per_s": stat([1e3 / x for x in per_token])}
    med = out["ms_per_token"]["median"]
    if bytes_per_step and med:
        out["achieved_GBps"] = bytes_per_step / (med * 1e6)   # bytes per ms -> GB/s
    if floor_ms and med:
        out["fraction_of_floor"] = floor_ms / med
    return out


def fmt(s: dict | None, digits: int = 3) -> str:
    """'median (min-max, n=R)' of a stat dict."""
    if not isinstance(s, dict) or s.get("median") is None:
        return "-"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])}, n={s['runs']})"


def num(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def free_cuda() -> None:
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- runtime suite

def small_config():
    from specla.config import GDNConfig
    return GDNConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_heads=4,
                     head_dim=128, expand_v=2.0)


def _hist(values) -> dict:
    out = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def drafter_settings(kind: str, drafter):
    """The draft shapes measured for each kind of trained drafter."""
    from specla.drafters.base import DraftSettings

    if kind in ("block", "lilicorr"):
        block = getattr(getattr(getattr(drafter, "net", None), "config", None), "block_size", 8) or 8
        return [("chain", DraftSettings(tree="chain", block_size=block, top_k=4, budget=block - 1)),
                ("best-first-10", DraftSettings(tree="best-first", block_size=block, top_k=4, budget=10)),
                ("best-first-16", DraftSettings(tree="best-first", block_size=block, top_k=4, budget=16))]
    return [("best-first-10", DraftSettings(tree="best-first", top_k=4, budget=10, depth=6)),
            ("best-first-16", DraftSettings(tree="best-first", top_k=4, budget=16, depth=6)),
            ("chain-6", DraftSettings(tree="chain", top_k=1, budget=6, depth=6))]


def load_pair(device, quick: bool, limit: int | None, drafters_dir: Path | None = None):
    """(target, tokenizer, {kind: drafter}, prompts as token lists, notes) or a skip reason."""
    from specla.checkpoint import load_model
    from specla.drafters import load_drafter

    target_dir = ROOT / "assets" / "target"
    if not (target_dir / "config.json").exists():
        return None, f"no embedded target at {target_dir}"
    target, tokenizer, _ = load_model(target_dir, device=device)
    if tokenizer is None:
        return None, f"{target_dir} has no tokenizer"
    drafters, notes = {}, []
    for folder in sorted(Path(drafters_dir or ROOT / "assets" / "drafters").glob("*")):
        if folder.is_dir():
            try:
                drafters[folder.name] = load_drafter(folder, target)
            except Exception as err:  # noqa: BLE001 - report the drafter, go on with the rest
                notes.append(f"{folder.name}: {type(err).__name__}: {err}")
    prompt_file = next((p for p in PROMPT_FILES if p.exists()), None)
    if prompt_file is None:
        return None, "no prompt file (data/corpus/heldout_prompts.jsonl or examples/prompts.jsonl)"
    from specla.acceptance import read_prompts

    texts = read_prompts(prompt_file, limit or (3 if quick else 8))
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    prompts = [p for p in prompts if len(p) >= 2]
    return (target, tokenizer, drafters, prompts, {"prompt_file": str(prompt_file.relative_to(ROOT)),
                                                   "drafter_notes": notes}), None
