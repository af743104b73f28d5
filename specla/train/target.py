"""Train the Gated DeltaNet target on the code corpus, then export it and write its card.

    python -m specla.train target --data data/corpus --out runs/target --minutes 7
    python -m specla.train card --summary runs/target/summary.json --out assets/README.md

Backends: `fla` (the default on CUDA) trains fla's `GatedDeltaNetForCausalLM` with its
Triton kernels under bf16 autocast; `torch` trains our plain-torch `GDNForCausalLM` (a
fresh state and a chain topology per window; slow, for CPU smoke tests with a tiny
config). Both have the same parameter names, so one export path serves both.

The budget is wall-clock: AdamW, linear warmup, then cosine decay to 10% of the peak over
`--minutes` of training time (or `--max-steps`, whichever comes first); held-out loss on
fixed windows every `--eval-every` steps; early stop after `--patience` evals without a
new best. Outputs in --out:
    log.jsonl       one line per eval: step, tokens, train/held-out loss, lr, elapsed
    ckpt/           resumable state (safetensors + JSON, no pickle); `--resume` continues
    export/         the best-held-out weights in the `specla.checkpoint` layout (bf16)
    summary.json    the figures of the model card

`--init FOLDER` starts from an exported checkpoint (fresh optimizer, new warmup and cosine):
a second stage that continues a finished run, for instance a cool-down at a lower peak lr
until the held-out loss stops improving. `--init-summary` names the first stage's
summary.json so that the card counts both stages.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specla.config import GDNConfig

MODEL_CONFIGS = {
    # ~13M parameters (bf16 weights ~26 MB): small enough to run speculative decoding on a CPU.
    "embedded": GDNConfig(vocab_size=4096, hidden_size=384, num_hidden_layers=6, num_heads=6,
                          head_dim=64, expand_v=1.0, intermediate_size=1024, conv_size=4,
                          tie_word_embeddings=True, norm_eps=1e-6, bos_token_id=0, eos_token_id=0),
    # For tests and smoke runs.
    "tiny": GDNConfig(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_heads=2,
                      head_dim=32, expand_v=1.0, intermediate_size=128, conv_size=4,
                      tie_word_embeddings=True, norm_eps=1e-6, bos_token_id=0, eos_token_id=0),
}


@dataclasses.dataclass
class TrainConfig:
    minutes: float = 7.0          # training wall-clock budget (cumulative over resumes)
    max_steps: int | None = None
    batch_size: int = 64          # 64 x 512 = 32k tokens a step
    seq_len: int = 512
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_windows: int = 256       # 256 x 512 = 131k held-out tokens, fixed
    patience: int = 5
    ckpt_minutes: float = 3.0
    precision: str = "autocast"   # bf16 autocast on CUDA; "fp32" to switch it off
    seed: int = 0


# ---------------------------------------------------------------------------- model

def fla_config(config: GDNConfig):
    from fla.models import GatedDeltaNetConfig

    accepted = inspect.signature(GatedDeltaNetConfig.__init__).parameters
    return GatedDeltaNetConfig(**{k: v for k, v in config.to_dict().items() if k in accepted})


def build_model(config: GDNConfig, backend: str, device: torch.device) -> torch.nn.Module:
    if backend == "fla":
        from fla.models import GatedDeltaNetForCausalLM

        return GatedDeltaNetForCausalLM(fla_config(config)).to(device)
    from specla.model import GDNForCausalLM

    model = GDNForCausalLM(config)
    init_like_fla(model)
    return model.to(device)


@torch.no_grad()
def init_like_fla(model: torch.nn.Module, std: float = 0.02) -> None:
    """fla's initialisation: N(0, 0.02) weights, A in U(0, 16), dt in logU(1e-3, 1e-1)."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(0, 16).clamp_min(1e-4).log())
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.rand_like(p) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
            dt = dt.clamp(min=1e-4)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))   # inverse softplus
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, std)


def forward_logits(model: torch.nn.Module, x: torch.Tensor, backend: str) -> torch.Tensor:
    if backend == "fla":
        return model(input_ids=x, use_cache=False).logits
    from specla.model import Topology
    from specla.verify import reference_only

    topo = Topology.chain(x.shape[1], model.config.conv_size, x.device)
    with reference_only():   # the differentiable plain-torch recurrence, also on CUDA
        return model(x, model.new_state(x.shape[0]), topo, mode="tree").logits


def lm_loss(model, batch: torch.Tensor, backend: str) -> torch.Tensor:
    """Next-token cross-entropy of a [B, T+1] batch of windows."""
    logits = forward_logits(model, batch[:, :-1], backend)
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only: not norms, biases, or the decay parameters (fla marks those).
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.dim() >= 2 and not getattr(p, "_no_weight_decay", False) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=decay[0].is_cuda)


def learning_rate(cfg: TrainConfig, step: int, elapsed: float) -> float:
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    progress = elapsed / (cfg.minutes * 60)
    if cfg.max_steps:
        progress = max(progress, step / cfg.max_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# ---------------------------------------------------------------------------- data

class Windows:
    """Random training windows and fixed held-out windows, token ids kept on the device."""

    def __init__(self, data_dir: str | Path, cfg: TrainConfig, device: torch.device):
        from specla.data import load_tokens

        self.cfg, self.device = cfg, device
        self.train = torch.from_numpy(np.asarray(load_tokens(data_dir, "train"), dtype=np.int64)).to(device)
        held = torch.from_numpy(np.asarray(load_tokens(data_dir, "heldout"), dtype=np.int64))
        span = cfg.seq_len + 1
        if self.train.numel() <= span or held.numel() < span:
            raise ValueError(f"{data_dir}: too few tokens for windows of {cfg.seq_len}")
        n = min(cfg.eval_windows, held.numel() // span)
        starts = torch.linspace(0, held.numel() - span, n).long()   # evenly spread, fixed
        self.heldout = torch.stack([held[s:s + span] for s in starts]).to(device)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.offsets = torch.arange(span, device=device)

    def batch(self) -> torch.Tensor:
        starts = torch.randint(0, self.train.numel() - self.cfg.seq_len - 1,
                               (self.cfg.batch_size,), generator=self.generator)
        return self.train[starts.to(self.device)[:, None] + self.offsets]


@torch.no_grad()
def evaluate(model, windows: Windows, backend: str, autocast) -> float:
    model.eval()
    total = 0.0
    for chunk in windows.heldout.split(windows.cfg.batch_size):
        with autocast():
            total += lm_loss(model, chunk, backend).item() * chunk.shape[0]
    model.train()
    return total / windows.heldout.shape[0]


# ---------------------------------------------------------------------------- checkpoints

def save_ckpt(path: Path, model, optimizer, windows: Windows, best_state, progress: dict) -> None:
    """model / optimizer / best weights / RNG as safetensors, the rest as JSON; atomic."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(tmp / "model.safetensors"))
    if best_state is not None:
        save_file(best_state, str(tmp / "best.safetensors"))
    opt = optimizer.state_dict()
    tensors = {f"{i}.{k}": v for i, s in opt["state"].items() for k, v in s.items()}
    tensors["rng.batches"] = windows.generator.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    groups = [{k: v for k, v in g.items()} for g in opt["param_groups"]]
    (tmp / "state.json").write_text(json.dumps({**progress, "param_groups": groups}, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def load_ckpt(path: Path, model, optimizer, windows: Windows) -> tuple[dict, dict | None]:
    state = json.loads((path / "state.json").read_text())
    weights = load_file(str(path / "model.safetensors"), device=str(windows.device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any(m != "lm_head.weight" for m in missing):  # a tied head is stored once
        raise ValueError(f"{path}: checkpoint does not match the model ({missing}, {unexpected})")
    tensors = load_file(str(path / "optimizer.safetensors"))
    windows.generator.set_state(tensors.pop("rng.batches"))
    torch.set_rng_state(tensors.pop("rng.torch"))
    opt_state: dict = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        opt_state.setdefault(int(idx), {})[name] = value
    groups = state.pop("param_groups")
    for g in groups:
        g["betas"] = tuple(g["betas"])
    optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    best = path / "best.safetensors"
    return state, (load_file(str(best)) if best.exists() else None)


# ---------------------------------------------------------------------------- train

def train(data: str | Path, out: str | Path, config: GDNConfig, cfg: TrainConfig,
          backend: str, device: torch.device, tokenizer_dir: str | Path | None = "assets",
          resume: bool = False, ckpt_dir: str | Path | None = None,
          init: str | Path | None = None, init_summary: dict | None = None) -> dict:
    from specla.checkpoint import save_model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = Path(ckpt_dir) if ckpt_dir else out / "ckpt"
    tokens_info = json.loads((Path(data) / "tokens.json").read_text())
    config = dataclasses.replace(config, vocab_size=tokens_info["vocab_size"])
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")   # TF32 for whatever autocast leaves in fp32
    model = build_model(config, backend, device)
    if init is not None and not resume:
        load_init_weights(model, init)
    model.train()
    optimizer = make_optimizer(model, cfg)
    windows = Windows(data, cfg, device)
    use_autocast = device.type == "cuda" and cfg.precision == "autocast"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_autocast)

    progress = {"step": 0, "tokens": 0, "elapsed": 0.0, "best_heldout": None, "best_step": None,
                "bad_evals": 0, "train_loss": None}
    best_state = None
    if resume:
        if not (ckpt_path / "state.json").exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        progress, best_state = load_ckpt(ckpt_path, model, optimizer, windows)
        print(f"resumed at step {progress['step']} ({progress['elapsed'] / 60:.1f} min trained)")
    elif (out / "log.jsonl").exists():
        (out / "log.jsonl").unlink()   # a fresh run starts a fresh log
    if init is not None and not resume:
        # Where the second stage starts from, so the log shows what it gained. The starting
        # weights compete for "best": a stage that only overfits exports them unchanged.
        progress["init_heldout"] = evaluate(model, windows, backend, autocast)
        progress.update(best_heldout=progress["init_heldout"], best_step=0)
        best_state = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        with open(out / "log.jsonl", "a") as log0:
            log0.write(json.dumps({"step": 0, "tokens": 0, "train_loss": None,
                                   "heldout_loss": round(progress["init_heldout"], 4),
                                   "lr": 0.0, "elapsed_s": 0.0, "init": str(init)}) + "\n")

    params = sum(p.numel() for p in model.parameters())
    print(f"{backend} backend on {device}: {params / 1e6:.2f}M parameters, "
          f"{windows.train.numel():,} training tokens, {windows.heldout.shape[0]} held-out windows")
    bar = _progress_bar(cfg, initial=progress["step"])
    log = open(out / "log.jsonl", "a")
    t_start, elapsed_before = time.time(), progress["elapsed"]
    last_ckpt = time.time()
    loss_sum = torch.zeros((), device=device)
    loss_count, stopped = 0, "time budget"
    tokens_per_step = cfg.batch_size * cfg.seq_len
    while True:
        elapsed = elapsed_before + time.time() - t_start
        step = progress["step"]
        if elapsed >= cfg.minutes * 60:
            break
        if cfg.max_steps and step >= cfg.max_steps:
            stopped = "max steps"
            break
        lr = learning_rate(cfg, step, elapsed)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = windows.batch()
        with autocast():
            loss = lm_loss(model, batch, backend)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        loss_sum += loss.detach()   # no host sync per step: read it back at eval time
        loss_count += 1
        progress["step"] = step = step + 1
        progress["tokens"] += tokens_per_step
        bar.update(1)

        if step % cfg.eval_every == 0 or (cfg.max_steps and step == cfg.max_steps):
            progress["train_loss"] = (loss_sum / loss_count).item()
            loss_sum.zero_()
            loss_count = 0
            heldout = evaluate(model, windows, backend, autocast)
            progress["elapsed"] = elapsed_before + time.time() - t_start
            improved = progress["best_heldout"] is None or heldout < progress["best_heldout"]
            if improved:
                progress.update(best_heldout=heldout, best_step=step, bad_evals=0)
                best_state = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
            else:
                progress["bad_evals"] += 1
            row = {"step": step, "tokens": progress["tokens"], "train_loss": round(progress["train_loss"], 4),
                   "heldout_loss": round(heldout, 4), "lr": lr, "elapsed_s": round(progress["elapsed"], 1)}
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.set_postfix(train=f"{progress['train_loss']:.3f}", heldout=f"{heldout:.3f}")
            if progress["bad_evals"] >= cfg.patience:
                stopped = f"early stop: no better held-out loss in {cfg.patience} evals"
                break
        if time.time() - last_ckpt > cfg.ckpt_minutes * 60:
            progress["elapsed"] = elapsed_before + time.time() - t_start
            save_ckpt(ckpt_path, model, optimizer, windows, best_state, progress)
            last_ckpt = time.time()
    bar.close()
    progress["elapsed"] = elapsed_before + time.time() - t_start

    if progress["best_heldout"] is None or progress["step"] % cfg.eval_every:  # a final eval
        heldout = evaluate(model, windows, backend, autocast)
        if loss_count:
            progress["train_loss"] = (loss_sum / loss_count).item()
        if progress["best_heldout"] is None or heldout < progress["best_heldout"]:
            progress.update(best_heldout=heldout, best_step=progress["step"])
            best_state = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        log.write(json.dumps({"step": progress["step"], "tokens": progress["tokens"],
                              "train_loss": progress["train_loss"], "heldout_loss": round(heldout, 4),
                              "elapsed_s": round(progress["elapsed"], 1), "final": True}) + "\n")
    log.close()
    save_ckpt(ckpt_path, model, optimizer, windows, best_state, progress)

    export = out / "export"
    files = save_model(best_state, config, export, tokenizer_dir=tokenizer_dir or None)
    summary = make_summary(data, config, cfg, backend, device, params, progress, stopped, files, tokens_info)
    if init is not None:
        summary = add_stage(summary, init, init_summary, progress.get("init_heldout"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{stopped} after {progress['step']} steps, {progress['elapsed'] / 60:.1f} min: best held-out "
          f"loss {progress['best_heldout']:.4f} (ppl {math.exp(progress['best_heldout']):.2f}) -> {export}")
    return summary


def load_init_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy an exported checkpoint's weights (any dtype) into the freshly built model."""
    from specla.checkpoint import read_tensors, resolve, weight_files

    state = read_tensors(weight_files(resolve(folder)))
    own = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [n for n in own if n not in state and not (tied and n == "lm_head.weight")]
    wrong = [n for n in own if n in state and tuple(state[n].shape) != tuple(own[n].shape)]
    if missing or wrong:
        raise ValueError(f"--init {folder}: does not match the model config "
                         f"(missing {missing[:3]}, wrong shape {wrong[:3]})")
    with torch.no_grad():
        for name, p in own.items():
            if name in state:
                p.copy_(state[name].to(p.dtype))


def add_stage(summary: dict, init: str | Path, prior: dict | None, init_heldout: float | None) -> dict:
    """Fold a first stage's figures into a continued run's summary: the card shows totals,
    `stages` keeps each stage's own."""
    this = {k: summary[k] for k in ("tokens_seen", "steps", "minutes", "best_heldout_loss",
                                    "stopped", "train_config")}
    this.update(init=str(init), init_heldout_loss=init_heldout)
    stages = list((prior or {}).get("stages") or ([_stage_of(prior)] if prior else [])) + [this]
    out = dict(summary, stages=stages)
    if prior:
        out["tokens_seen"] = prior["tokens_seen"] + summary["tokens_seen"]
        out["steps"] = prior["steps"] + summary["steps"]
        out["minutes"] = round(prior["minutes"] + summary["minutes"], 2)
        out["tokens_per_second"] = round(out["tokens_seen"] / max(out["minutes"] * 60, 1e-9))
    return out


def _stage_of(summary: dict) -> dict:
    return {k: summary.get(k) for k in ("tokens_seen", "steps", "minutes", "best_heldout_loss",
                                        "stopped", "train_config")}


def _progress_bar(cfg: TrainConfig, initial: int = 0):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the GPU machine may lack it: run without a bar
        class _Quiet:
            def update(self, n): pass
            def set_postfix(self, **kw): print(" ".join(f"{k}={v}" for k, v in kw.items()), flush=True)
            def close(self): pass
        return _Quiet()
    # Without a terminal (the GPU runner), update rarely so that the log stays readable.
    return tqdm(total=cfg.max_steps, initial=initial, unit="step",
                mininterval=1 if sys.stderr.isatty() else 30)


def make_summary(data, config, cfg, backend, device, params, progress, stopped, files, tokens_info) -> dict:
    from specla.data import load_manifest, manifest_summary

    try:
        manifest = manifest_summary(load_manifest(data))
    except FileNotFoundError:
        manifest = None
    from importlib import metadata

    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("flash-linear-attention", "fla-core", "triton", "transformers"):
        try:  # package metadata, not an import: importing fla costs ~10 s on a CPU
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    best = progress["best_heldout"]
    return {
        "parameters": params,
        "tokens_seen": progress["tokens"],
        "steps": progress["step"],
        "final_train_loss": progress["train_loss"],
        "best_heldout_loss": best,
        "best_heldout_ppl": math.exp(best),
        "best_step": progress["best_step"],
        "minutes": round(progress["elapsed"] / 60, 2),
        "tokens_per_second": round(progress["tokens"] / max(progress["elapsed"], 1e-9)),
        "stopped": stopped,
        "backend": backend,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": versions,
        "git_commit": _git_commit(),
        "model_config": config.to_dict(),
        "train_config": dataclasses.asdict(cfg),
        "data": {"path": str(data), "tokens": tokens_info, "manifest": manifest},
        "export": [str(f) for f in files],
    }


def _git_commit() -> str | None:
    import os
    if os.environ.get("SPECLA_COMMIT"):   # the GPU machine gets a copy of the tree without .git
        return os.environ["SPECLA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip() or None
    except Exception:
        return None


def main(argv: list[str] | None = None) -> None:
    """Train the target model; see the module docstring."""
    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m specla.train target", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/corpus", help="folder with train.bin, heldout.bin, tokens.json")
    ap.add_argument("--out", default="runs/target")
    ap.add_argument("--config", default="embedded", choices=sorted(MODEL_CONFIGS))
    ap.add_argument("--backend", choices=("fla", "torch"), default=None,
                    help="default: fla when CUDA is present, else torch")
    ap.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    ap.add_argument("--tokenizer", default="assets", help="tokenizer files copied into the export ('' = none)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ckpt-dir", default=None, help="default: OUT/ckpt")
    ap.add_argument("--init", default=None, help="start from this exported checkpoint (a second stage)")
    ap.add_argument("--init-summary", default=None, help="the first stage's summary.json, for the card")
    ap.add_argument("--minutes", type=float, default=d.minutes)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--eval-windows", type=int, default=d.eval_windows)
    ap.add_argument("--patience", type=int, default=d.patience)
    ap.add_argument("--ckpt-minutes", type=float, default=d.ckpt_minutes)
    ap.add_argument("--precision", choices=("autocast", "fp32"), default=d.precision)
    ap.add_argument("--seed", type=int, default=d.seed)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = args.backend or ("fla" if device.type == "cuda" else "torch")
    cfg = TrainConfig(minutes=args.minutes, max_steps=args.max_steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps,
                      eval_every=args.eval_every, eval_windows=args.eval_windows,
                      patience=args.patience, ckpt_minutes=args.ckpt_minutes,
                      precision=args.precision, seed=args.seed)
    train(args.data, args.out, MODEL_CONFIGS[args.config], cfg, backend, device,
          tokenizer_dir=args.tokenizer, resume=args.resume, ckpt_dir=args.ckpt_dir, init=args.init,
          init_summary=json.loads(Path(args.init_summary).read_text()) if args.init_summary else None)


# ---------------------------------------------------------------------------- model card

CARD = """\
---
license: other
library_name: fla
pipeline_tag: text-generation
tags: [gated-deltanet, linear-attention, code, python, speculative-decoding, specla]
---

# {name}: the SpecLA Explorer target model

A small Gated DeltaNet language model of Python code, trained from scratch for the SpecLA
Explorer: it is the *target* that the project's speculative decoders draft for and verify
against. It is small on purpose, so that the whole speculative loop (draft, tree
verification, factor commit) runs and can be inspected on a CPU. It is a research
artefact, not a code assistant.

## Model

| | |
|---|---|
| architecture | Gated DeltaNet (fla `GatedDeltaNetForCausalLM`, `model_type: gated_deltanet`) |
| parameters | {params} (embeddings tied to the LM head) |
| layers x hidden | {layers} x {hidden}, {heads} heads x {head_dim} (expand_v {expand_v}), conv {conv} |
| MLP | SwiGLU, intermediate {mlp} |
| vocabulary | {vocab} (byte-level BPE, `<|endoftext|>` = 0 is bos/eos/pad, `<|mask|>` = 1 reserved) |
| recurrent state | {state_kib} KiB fp32 per sequence (all layers) |
| weights | bf16 safetensors, shards under 15 MiB |

## Training

| | |
|---|---|
| tokens seen | {tokens} ({epochs} passes over the training split) |
| steps | {steps} x {batch} windows of {seq} tokens |
| optimiser | AdamW (betas {betas}, weight decay {wd}), peak lr {lr}, {warmup} warmup steps, cosine to {min_lr}x |
| time | {minutes} minutes on {device} ({tps} tokens/s), stopped by: {stopped} |{stage_rows}
| software | {software} |
| final train loss | {train_loss} |
| best held-out loss | {heldout_loss} (perplexity {ppl}, {bpb} bits per byte) at step {best_step} |

## Data

Python source files of the standard library (Python {python}) and of the packages in the
project's `requirements.txt`, without tests, files over 200 KB, non-UTF-8 files, exact
duplicates and generated files; big packages are sampled down so that the text stays
near 60 MB. A file is held out when the first 8 hex digits of sha1(its relative path),
mod 1000, fall below 20 (~2% of files); held-out files are never trained on, and the
tokenizer was trained on the training split only.

| split | files | bytes | tokens | sha256 of the text |
|---|---|---|---|---|
{split_rows}

Per source: {groups}.
Package versions: {packages}.

The corpus is the source code of those packages, under their own licences (PSF, BSD,
MIT, Apache-2.0, ...); this model card makes no licence claim beyond theirs.

## Use

The weights and tokenizer are in `assets/target/` (config.json, bf16 safetensors shards,
tokenizer files); this card is `assets/README.md`.

```python
from specla.checkpoint import load_model
model, tokenizer, report = load_model("assets/target")   # fp32 on CPU; bf16 on CUDA

# or with fla (GPU, Triton):
import fla  # registers gated_deltanet with transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("assets/target").cuda()
tokenizer = AutoTokenizer.from_pretrained("assets/target")
```

Prompts: `examples/prompts.jsonl` (a dozen held-out function openings) and
`data/corpus/heldout_prompts.jsonl` (64 prompts of 64 tokens from held-out files).

## Reproduce

```bash
pip install -r requirements.txt
python -m specla.train corpus --out data/corpus          # ~10 s; check sha256 against the table
python -m specla.train tokenizer --corpus data/corpus --out assets/   # ~1 min on 2 CPU cores
python -m specla.train target --data data/corpus --out runs/target --minutes {budget:g}   # one H200
python -m specla.train card --summary runs/target/summary.json --out assets/README.md
rm -rf assets/target && cp -r runs/target/export assets/target
```
The corpus text is byte-identical on a machine with the same Python and package
versions; training itself is not bit-reproducible (wall-clock budget, GPU kernels).
{commit}
## Limitations

Trained for minutes on ~{train_mtok}M tokens of code: it completes common Python idioms
and library boilerplate, and it is wrong often. It has seen no natural-language text
beyond comments and docstrings, knows nothing after its packages' release dates, and has
no safety tuning. Use it to study speculative decoding, not to write code.

## Drafters

Drafters trained for this target are described in the sections below.

<!-- drafters -->
"""


def render_card(summary: dict | None, manifest: dict | None = None) -> str:
    """The model card; figures not known yet (no summary) read 'pending'."""
    s = summary or {}
    pending = "pending"
    cfg = GDNConfig.from_dict(s["model_config"]) if "model_config" in s else MODEL_CONFIGS["embedded"]
    tc = s.get("train_config") or dataclasses.asdict(TrainConfig())
    data = s.get("data") or {}
    manifest = data.get("manifest") or manifest or {}
    tokens = data.get("tokens") or {}
    splits = manifest.get("splits", {})

    def fmt(value, spec=",", none=pending):
        return none if value is None else format(value, spec)

    heldout_bpt = (splits.get("heldout", {}).get("bytes", 0) / tokens["heldout_tokens"]
                   if tokens.get("heldout_tokens") else None)
    loss = s.get("best_heldout_loss")
    bpb = loss / math.log(2) / heldout_bpt if loss is not None and heldout_bpt else None
    params = s.get("parameters")
    if params is None:
        from specla.model import GDNForCausalLM
        with torch.device("meta"):
            params = sum(p.numel() for p in GDNForCausalLM(cfg).parameters())
    rows = "\n".join(
        f"| {name} | {sp['files']:,} | {sp['bytes']:,} | {fmt(tokens.get(name + '_tokens'), ',', '-')} "
        f"| `{sp['sha256']}` |" for name, sp in splits.items())
    groups = ", ".join(f"{g} {v['files']} files / {v['bytes'] / 1e6:.1f} MB"
                       for g, v in sorted(manifest.get("groups", {}).items(), key=lambda kv: -kv[1]["bytes"]))
    packages = ", ".join(f"{k} {v}" for k, v in manifest.get("packages", {}).items() if v)
    versions = s.get("versions", {})
    software = ", ".join(f"{k} {v}" for k, v in versions.items() if v) or pending
    train_tokens = tokens.get("train_tokens")
    return CARD.format(
        name=f"specla-gdn-code-{round(params / 1e6)}m", params=f"{params:,}",
        layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
        head_dim=cfg.head_dim, expand_v=cfg.expand_v, conv=cfg.conv_size, mlp=cfg.mlp_size,
        vocab=cfg.vocab_size, state_kib=cfg.state_bytes() // 1024,
        tokens=fmt(s.get("tokens_seen")),
        epochs=fmt(s["tokens_seen"] / train_tokens if s.get("tokens_seen") and train_tokens else None, ".1f", "?"),
        steps=fmt(s.get("steps")), batch=tc["batch_size"], seq=tc["seq_len"],
        betas=tuple(tc["betas"]), wd=tc["weight_decay"], lr=tc["lr"], warmup=tc["warmup_steps"],
        min_lr=tc["min_lr_ratio"], minutes=fmt(s.get("minutes"), ".1f"),
        device=s.get("device", pending), tps=fmt(s.get("tokens_per_second")),
        stopped=s.get("stopped", pending), software=software,
        train_loss=fmt(s.get("final_train_loss"), ".3f"), heldout_loss=fmt(loss, ".3f"),
        ppl=fmt(s.get("best_heldout_ppl"), ".2f"), bpb=fmt(bpb, ".3f", "?"),
        best_step=fmt(s.get("best_step"), ",", "?"), split_rows=rows or "| pending | | | | |",
        groups=groups or pending, packages=packages or pending,
        python=manifest.get("python", "?"), budget=tc["minutes"],
        stage_rows=_stage_rows(s.get("stages") or []),
        commit=f"\nTrained from commit `{s['git_commit']}`.\n" if s.get("git_commit") else "",
        train_mtok=fmt(train_tokens / 1e6 if train_tokens else None, ".1f", "?"))


def _stage_rows(stages: list[dict]) -> str:
    """One card row per training stage when a run continued an earlier one."""
    if len(stages) < 2:
        return ""
    rows = []
    for i, st in enumerate(stages, 1):
        tc = st.get("train_config") or {}
        start = "from scratch" if not st.get("init") else f"from stage {i - 1}'s best weights"
        rows.append(f"\n| stage {i} | {start}: {st['steps']:,} steps, {st['tokens_seen']:,} tokens, "
                    f"{st['minutes']:.1f} min, peak lr {tc.get('lr')}, best held-out loss "
                    f"{st['best_heldout_loss']:.4f}; stopped by: {st['stopped']} |")
    return "".join(rows)


def card_main(argv: list[str] | None = None) -> None:
    """Write the model card from a training summary (figures 'pending' if there is none)."""
    ap = argparse.ArgumentParser(prog="python -m specla.train card", description=card_main.__doc__)
    ap.add_argument("--summary", default="runs/target/summary.json")
    ap.add_argument("--data", default="data/corpus", help="manifest used when the summary lacks one")
    ap.add_argument("--out", default="assets/README.md")
    args = ap.parse_args(argv)
    summary = json.loads(Path(args.summary).read_text()) if Path(args.summary).exists() else None
    manifest = None
    if Path(args.data, "manifest.json").exists():
        from specla.data import load_manifest, manifest_summary
        manifest = manifest_summary(load_manifest(args.data))
        tokens = Path(args.data, "tokens.json")
        if summary is None and tokens.exists():
            summary = {"data": {"manifest": manifest, "tokens": json.loads(tokens.read_text())}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(render_card(summary, manifest))
    print(f"model card -> {args.out}" + ("" if summary and "steps" in summary else " (figures pending)"))
