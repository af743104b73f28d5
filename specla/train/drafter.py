"""Train the drafters on text the target itself generated.

    python -m specla.train drafter --target runs/target --data data/corpus \
        --out runs/drafters --minutes 7.5 [--kinds lilicorr,block,eagle] [--resume]

One command does everything inside the `--minutes` wall-clock budget:
1. load the target: on CUDA fla's GatedDeltaNetForCausalLM (bf16, Triton kernels), on CPU
   our plain-torch runtime; on CUDA first check fla's features against the runtime on CPU;
2. generate continuations (greedy and T=0.8, 128-256 new tokens) from 32-128-token prompts
   cut from train.bin, in large batches, for a share of the budget (`--gen-fraction`);
3. train every requested kind in one loop that shares each batch's live target forward
   (features of `feature_layers`, last hidden, logits): the block drafter (weighted block CE),
   LiLiCorr jointly with its block drafter from step 0 (block CE + 0.25 lattice CE + 0.25
   penalty), the EAGLE-style drafter (distillation to the target's distribution + hidden
   regression, unrolled over a few drafted steps);
4. save the drafters often: `<out>/<kind>/drafter.{json,safetensors}` (inference, 2 files a
   kind) and `<out>/summary.json` at the end (7 files in all: what a GPU run can send back);
   the resumable state (fp32 weights + AdamW moments, sharded safetensors + JSON) and the
   generated corpus go to `--state` (default runs/drafter-state), read by `--resume`.

The "true" tokens are the target's own continuations. Greedy-generated rows are held out to
measure acceptance proxies: prefix lengths a chain would get accepted at temperature 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from specla.checkpoint import shard
from specla.config import GDNConfig
from specla.drafters import new_net, save_drafter, target_fingerprint, wrap
from specla.drafters.block import (TargetParts, default_feature_layers, default_gamma,
                                   param_count, slot_weights)
from specla.drafters.lilicorr import lattice, lattice_losses, prefix_len

from specla.train.generated import (SHARD_BYTES, Chunk, generate_corpus, greedy_agreement,
                                    load_corpus, prompt_tokens, sample_batch, save_corpus)


# ----------------------------------------------------------------------------------------
# Live targets: what training needs from the target model
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class TargetOut:
    features: torch.Tensor | None   # [B, L, n_feature_layers, D] residual stream after each layer
    last_hidden: torch.Tensor       # [B, L, D] after the final norm
    logits: torch.Tensor            # [B, L, V]


class TorchTarget:
    """Our runtime as the live target: the exact model the drafters will serve (CPU or CUDA)."""

    def __init__(self, model: nn.Module, feature_layers: tuple[int, ...]):
        self.model = model.eval().requires_grad_(False)
        self.config: GDNConfig = model.config
        self.feature_layers = tuple(feature_layers)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, segment: int = 128) -> TargetOut:
        """Whole sequences in segments (a draft tree holds at most 256 nodes), the state
        carried between them by commits."""
        from specla.model import Topology, commit
        B, L = tokens.shape
        state = self.model.new_state(B)
        outs = []
        for lo in range(0, L, segment):
            part = tokens[:, lo:lo + segment]
            n = part.shape[1]
            out = self.model(part, state, Topology.chain(n, self.config.conv_size, tokens.device),
                             mode="chain", feature_layers=self.feature_layers)
            if lo + n < L:
                commit(state, out.factors, list(range(n)))
            outs.append(out)
        cat = lambda xs: torch.cat(xs, dim=1) if xs[0] is not None else None  # noqa: E731
        return TargetOut(cat([o.features for o in outs]), cat([o.last_hidden for o in outs]),
                         cat([o.logits for o in outs]))

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int, temperature: float,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        from specla.model import Topology, commit
        B, P = prompts.shape
        state = self.model.new_state(B)
        conv = self.config.conv_size
        out = self.model(prompts, state, Topology.chain(P, conv, prompts.device), mode="chain")
        commit(state, out.factors, list(range(P)))
        picks = [pick(out.logits[:, -1], temperature, generator)]
        one = Topology.chain(1, conv, prompts.device)
        for _ in range(new_tokens - 1):
            out = self.model(picks[-1][:, None], state, one, mode="chain")
            commit(state, out.factors, [0])
            picks.append(pick(out.logits[:, -1], temperature, generator))
        return torch.stack(picks, dim=1)


class FlaTarget:
    """fla's GatedDeltaNetForCausalLM as a live target (CUDA, Triton kernels).

    Features come from forward hooks on the blocks: output[0] of block l is the residual
    stream after block l, which is exactly our runtime's `features` for layer l. (fla's
    `hidden_states` tuple holds the *inputs* of the blocks, then the final-normed output:
    hidden_states[l + 1] = after block l for l < L-1, hidden_states[L] = last_hidden; the
    top block's raw output is not in it. The hooks avoid that off-by-one.)
    """

    def __init__(self, model: nn.Module, config: GDNConfig, feature_layers: tuple[int, ...]):
        self.model = model.eval().requires_grad_(False)
        self.config = config
        self.feature_layers = tuple(feature_layers)
        self._captured: dict[int, torch.Tensor] = {}
        for l in self.feature_layers:
            model.model.layers[l].register_forward_hook(self._hook(l))
        self._capture = False
        self.use_cache = True   # generate() through fla's cache; False: full forward per token

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self._capture:
                self._captured[layer] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @torch.no_grad()
    def run(self, tokens: torch.Tensor) -> TargetOut:
        self._capture, self._captured = True, {}
        try:
            out = self.model(input_ids=tokens, output_hidden_states=True, use_cache=False)
        finally:
            self._capture = False
        feats = (torch.stack([self._captured[l] for l in self.feature_layers], dim=2)
                 if self.feature_layers else None)
        return TargetOut(feats, out.hidden_states[-1], out.logits)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int, temperature: float,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        if self.use_cache:
            try:
                return self._generate_loop(prompts, new_tokens, temperature, generator)
            except Exception as err:  # noqa: BLE001  (one GPU run: fall back rather than die)
                print(f"[drafter-train] fla cache loop failed ({type(err).__name__}: {err}); "
                      "generating without a cache")
                self.use_cache = False
        return self._generate_nocache(prompts, new_tokens, temperature, generator)

    def _generate_nocache(self, prompts: torch.Tensor, new_tokens: int, temperature: float,
                          generator: torch.Generator | None) -> torch.Tensor:
        """Fallback without any cache API: a full forward per new token (quadratic, but a
        ~13M target at these lengths makes it seconds per chunk, and it cannot lose state)."""
        seq = prompts
        for _ in range(new_tokens):
            logits = self.model(input_ids=seq, use_cache=False, logits_to_keep=1).logits[:, -1]
            seq = torch.cat([seq, pick(logits, temperature, generator)[:, None]], dim=1)
        return seq[:, prompts.shape[1]:]

    def _generate_loop(self, prompts, new_tokens, temperature, generator) -> torch.Tensor:
        """A plain batched loop over fla's cache (no HF generate: fewer moving parts)."""
        out = self.model(input_ids=prompts, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        picks = [pick(out.logits[:, -1], temperature, generator)]
        for _ in range(new_tokens - 1):
            out = self.model(input_ids=picks[-1][:, None], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            picks.append(pick(out.logits[:, -1], temperature, generator))
        return torch.stack(picks, dim=1)


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def load_runtime_target(path: str | Path, device: str = "cpu", dtype=torch.float32) -> nn.Module:
    """Our plain-torch runtime from a checkpoint folder (`specla.checkpoint` layout)."""
    from specla.checkpoint import load_model
    return load_model(path, device, dtype)[0]


def load_fla_target(path: str | Path, device: str, dtype=torch.bfloat16) -> tuple[nn.Module, str]:
    """fla's model on `device`: AutoModel first, checked tensor by tensor against the files;
    if that fails in any way, fla's class built by hand from config.json + the same tensors."""
    import inspect

    import fla.models  # noqa: F401  (registers gated_deltanet with transformers' Auto classes)
    from specla.checkpoint import read_tensors, weight_files
    path = Path(path)
    sd = read_tensors(weight_files(path))
    config = GDNConfig.from_file(path / "config.json")
    how = "AutoModelForCausalLM"
    try:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        own = model.state_dict()
        for name, tensor in sd.items():
            if name not in own or not torch.equal(own[name].to(dtype).cpu(), tensor.to(dtype)):
                raise ValueError(f"weight {name} differs from the file after from_pretrained")
    except Exception as err:  # any failure: build the model ourselves from the same files
        print(f"[drafter-train] AutoModelForCausalLM route failed ({err}); building fla's model by hand")
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
        raw = json.loads((path / "config.json").read_text())
        accepted = inspect.signature(GatedDeltaNetConfig.__init__).parameters
        model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**{k: v for k, v in raw.items() if k in accepted}))
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if config.tie_word_embeddings:
            model.tie_weights()
            missing = [m for m in missing if m != "lm_head.weight"]
        if missing:
            raise ValueError(f"{path}: weights missing from the checkpoint: {missing[:5]}") from None
        how = "GatedDeltaNetForCausalLM + load_state_dict"
    return model.to(device=device, dtype=dtype).eval(), how


def check_alignment(live: FlaTarget, path: str | Path, tokens: torch.Tensor) -> dict:
    """Compare fla's features / last hidden / logits with our runtime's (CPU, fp32).

    Also records which fla `hidden_states` index matches each of our feature layers.
    Raises when they disagree beyond bf16 noise: drafters trained on misaligned features
    would be useless with the runtime.
    """
    ref = TorchTarget(load_runtime_target(path), live.feature_layers)
    mine = ref.run(tokens.cpu())
    theirs = live.run(tokens.to(live.device))
    with torch.no_grad():
        hs = live.model(input_ids=tokens.to(live.device), output_hidden_states=True, use_cache=False).hidden_states

    def rel(a, b):
        a, b = a.float().cpu(), b.float().cpu()
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    report = {"last_hidden": rel(theirs.last_hidden, mine.last_hidden),
              "logits": rel(theirs.logits, mine.logits),
              "argmax_agreement": float((theirs.logits.float().cpu().argmax(-1) == mine.logits.argmax(-1)).float().mean()),
              "features": {}, "hidden_states_index": {}}
    for i, l in enumerate(live.feature_layers):
        report["features"][str(l)] = rel(theirs.features[:, :, i], mine.features[:, :, i])
        errs = [rel(h, mine.features[:, :, i]) for h in hs]
        report["hidden_states_index"][str(l)] = int(np.argmin(errs))
    report["hidden_states_last_is_last_hidden"] = rel(hs[-1], mine.last_hidden) < 0.05
    worst = max([report["last_hidden"], *report["features"].values()])
    report["ok"] = worst < 0.1
    if not report["ok"]:
        raise RuntimeError(f"fla's features do not match the runtime's (relative error {worst:.3f}): "
                           f"{json.dumps(report)}")
    return report


# ----------------------------------------------------------------------------------------
# Trainers
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class HParams:
    block_size: int = 8
    top_k: int = 8                 # LiLiCorr lattice width at training (each step draws 2..top_k)
    window: int = 64
    width: int = 256
    heads: int = 4
    layers: int = 2
    mlp_hidden: int = 768
    head_width: int = 128
    head_heads: int = 4
    eagle_mlp_hidden: int = 1024
    seqs: int = 64                 # sequences per step (one live target forward)
    anchors: int = 48              # block anchors per sequence
    unroll: int = 3                # EAGLE training-time-test steps
    lr: float = 1.5e-3
    eagle_lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.03           # share of the training time
    gamma: float | None = None     # block CE slot decay (None: 4 for B=8, 7 for B=16)
    lattice_weight: float = 0.25
    penalty_weight: float = 0.25
    regression_weight: float = 0.1
    save_every: float = 60.0       # seconds


def seed_tensors(folder: Path, fingerprint: dict) -> dict[str, torch.Tensor]:
    """The weights of the drafter in `folder` (`--init-from`), once its drafter.json says it
    was trained for the target of `fingerprint`; else ValueError."""
    from safetensors.torch import load_file
    from specla.drafters import WEIGHTS_FILE, read_meta
    theirs = read_meta(folder).get("target") or {}
    for key in ("config_hash", "embedding_hash"):
        if theirs.get(key) != fingerprint.get(key):
            raise ValueError(f"--init-from {folder}: that drafter was trained for another target ({key})")
    try:
        return load_file(str(Path(folder) / WEIGHTS_FILE))
    except Exception as err:  # safetensors' own error type moved between versions
        raise ValueError(f"--init-from {folder}: {WEIGHTS_FILE} is missing or unreadable ({err})") from None


def lr_scale(progress: float, warmup: float) -> float:
    """Linear warm-up, then cosine down to 10%."""
    if progress < warmup:
        return max(progress / warmup, 0.01)
    p = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))


class Trainer:
    """One drafter kind: its net, optimizer, loss, metrics, checkpoints."""

    def __init__(self, kind: str, live, hp: HParams, fingerprint: dict, out: Path,
                 state: Path | None = None):
        self.kind, self.live, self.hp, self.fingerprint = kind, live, hp, fingerprint
        self.out = out / kind                           # the drafter checkpoint (deliverable)
        self.state = (state or out / "state") / kind    # resumable training state
        self.parts = TargetParts(live.model)
        dev = live.device
        if kind == "eagle":
            self.net = new_net(kind, live.config, mlp_hidden=hp.eagle_mlp_hidden, window=hp.window)
        else:
            over = dict(width=hp.width, heads=hp.heads, layers=hp.layers, mlp_hidden=hp.mlp_hidden,
                        window=hp.window)
            if kind == "lilicorr":
                over["head"] = dict(width=hp.head_width, heads=hp.head_heads)
            self.net = new_net(kind, live.config, live.feature_layers, hp.block_size, hp.top_k, **over)
        self.net = self.net.to(dev).train()
        self.peak_lr = hp.eagle_lr if kind == "eagle" else hp.lr
        decay = [p for n, p in self.net.named_parameters() if p.ndim >= 2 and "emb" not in n]
        other = [p for n, p in self.net.named_parameters() if not (p.ndim >= 2 and "emb" not in n)]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                      {"params": other, "weight_decay": 0.0}],
                                     lr=self.peak_lr, betas=(0.9, 0.95),
                                     **({"fused": True} if dev.type == "cuda" else {}))
        self.step_count = 0
        self.seconds = 0.0
        self.history: list[dict] = []
        self._running: dict[str, torch.Tensor] = {}
        gamma = hp.gamma or default_gamma(hp.block_size)
        self.slot_w = slot_weights(hp.block_size - 1, gamma, dev)
        self.rng = torch.Generator().manual_seed(zlib.crc32(kind.encode()))

    # -- losses ----------------------------------------------------------------------------
    def losses(self, tokens: torch.Tensor, prompt_len: int, tout: TargetOut,
               anchors: torch.Tensor | None = None, k: int | None = None) -> dict[str, torch.Tensor]:
        if self.kind == "eagle":
            return self.eagle_losses(tokens, prompt_len, tout, self.hp.unroll)
        return self.block_losses(tokens, prompt_len, tout, anchors, k)

    def block_anchors(self, tokens: torch.Tensor, prompt_len: int, per_seq: int) -> torch.Tensor:
        b, L = tokens.shape
        B = self.hp.block_size
        lo, hi = max(prompt_len - 1, 1), L - B
        if hi < lo:
            lo = min(1, hi)
        return torch.randint(lo, hi + 1, (b, per_seq), generator=self.rng).to(tokens.device)

    def block_forward(self, tokens: torch.Tensor, tout: TargetOut, anchors: torch.Tensor):
        """The block pass at every anchor a (root x_a, context = fused rows a-W..a-1).

        Returns h [N, S, d], logits [N, S, V], the context rows [N, W, d], the true tokens
        x_{a+1..a+S} [N, S], and the slot positions [b, A, S].
        """
        hp, net = self.hp, self.net
        b = tokens.shape[0]
        S, W = hp.block_size - 1, hp.window
        dev = tokens.device
        bi = torch.arange(b, device=dev)[:, None, None]
        fused = net.fuse(tout.features)                                       # [b, L, d]
        idx = anchors[..., None] - W + torch.arange(W, device=dev)           # [b, A, W]
        valid = (idx >= 0).flatten(0, 1)
        ctx = fused[bi, idx.clamp(min=0)].flatten(0, 1)                       # [N, W, d]
        root = tokens.gather(1, anchors).flatten()
        h, logits = net(self.parts, root, ctx, valid)                        # [N, S, *]
        slots = anchors[..., None] + torch.arange(1, S + 1, device=dev)      # [b, A, S]
        true = tokens[bi, slots].flatten(0, 1)                               # [N, S]
        return h, logits, ctx, true, slots

    def block_losses(self, tokens, prompt_len, tout, anchors=None, k=None):
        hp, net, parts = self.hp, self.net, self.parts
        if anchors is None:
            anchors = self.block_anchors(tokens, prompt_len, hp.anchors)
        bi = torch.arange(tokens.shape[0], device=tokens.device)[:, None, None]
        h, logits, ctx, true, slots = self.block_forward(tokens, tout, anchors)
        ce = F.cross_entropy(logits.float().flatten(0, 1), true.flatten(), reduction="none").view(true.shape)
        out = {"block_ce": (ce * self.slot_w).sum(-1).mean() / self.slot_w.sum()}
        with torch.no_grad():
            top1 = logits.argmax(-1)
            out["slot_acc"] = (top1 == true).float().mean()
            out["top1_prefix"] = prefix_len(top1 == true).float().mean()
            out["slot1_acc"] = (top1[:, 0] == true[:, 0]).float().mean()
        if net.head is None:
            out["loss"] = out["block_ce"]
            return out
        if k is None:
            k = hp.top_k if torch.rand((), generator=self.rng) < 0.5 else \
                int(torch.randint(2, hp.top_k + 1, (), generator=self.rng))
        z = tout.logits[bi, slots - 1].flatten(0, 1)                         # live target logits
        cand, _, start, pair = lattice(parts, net.head, logits, h, ctx[:, -1], k)
        lat = lattice_losses(start, pair, cand, true, z)
        out.update({key: val for key, val in lat.items() if key not in ("slot_acc", "top1_prefix")})
        out["loss"] = out["block_ce"] + hp.lattice_weight * lat["lattice_ce"] + hp.penalty_weight * lat["penalty"]
        return out

    def eagle_losses(self, tokens, prompt_len, tout, steps, eval_prefix: bool = False):
        hp, parts = self.hp, self.parts
        b, L = tokens.shape
        dev = tokens.device
        outs = self.net.unrolled(parts, tokens, tout.last_hidden, steps)
        teacher = tout.logits[:, 1:].float()                                 # query i -> position i+1
        t_prob = torch.softmax(teacher, dim=-1)
        t_top = teacher.argmax(-1)
        target_h = tout.last_hidden[:, 1:].float()
        i = torch.arange(L - 1, device=dev)
        out: dict[str, torch.Tensor] = {}
        loss = torch.zeros((), device=dev)
        norm = 0.0
        hits = []
        for u, o in enumerate(outs, start=1):
            valid = (i - u + 1 >= 0).float()[None].expand(b, -1)
            logits = parts.logits(o).float()
            ce = -(t_prob * torch.log_softmax(logits, -1)).sum(-1)
            reg = F.smooth_l1_loss(parts.norm(o).float(), target_h, reduction="none").mean(-1)
            w = 0.8 ** (u - 1)
            loss = loss + w * ((ce + hp.regression_weight * reg) * valid).sum() / valid.sum().clamp_min(1)
            norm += w
            with torch.no_grad():
                agree = (logits.argmax(-1) == t_top).float()
                out[f"acc{u}"] = (agree * valid).sum() / valid.sum().clamp_min(1)
                if eval_prefix:
                    nxt = torch.cat([tokens[:, 2:], tokens[:, -1:]], 1)     # x_{i+2}
                    hits.append(logits.argmax(-1) == nxt)
        out["loss"] = loss / norm
        out["distill_ce"] = out["loss"]
        if eval_prefix:
            # chain from root position r (its first draft must be a generated token, r >= P-1):
            # depth u is query r+u-2 of step u, and must equal x_{r+u}
            roots = torch.arange(max(prompt_len - 1, 1), L - steps, device=dev)
            hit = torch.stack([hits[u - 1][:, roots + u - 2] for u in range(1, steps + 1)], -1)
            out["chain_prefix"] = prefix_len(hit).float().mean()
        return out

    # -- optimisation ------------------------------------------------------------------------
    def step(self, tokens, prompt_len, tout, lr_factor: float) -> dict[str, float]:
        for group in self.opt.param_groups:
            group["lr"] = self.peak_lr * lr_factor
        dev = tokens.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = self.losses(tokens, prompt_len, tout)
        self.opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
        self.opt.step()
        self.step_count += 1
        vals = {k: v.detach() for k, v in out.items()} | {"grad_norm": gnorm.detach()}
        for key, val in vals.items():   # smoothed, kept on the device (no sync per step)
            self._running[key] = val.float() if key not in self._running else 0.95 * self._running[key] + 0.05 * val.float()
        return vals

    @property
    def running(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._running.items()}

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, int, TargetOut]]) -> dict[str, float]:
        """Acceptance proxies on held-out greedy rows (a chain at temperature 0)."""
        self.net.eval()
        sums: dict[str, float] = {}
        for tokens, prompt_len, tout in batches:
            dev = tokens.device
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                if self.kind == "eagle":
                    out = self.eagle_losses(tokens, prompt_len, tout, max(self.hp.unroll, self.hp.block_size - 1),
                                            eval_prefix=True)
                else:
                    gen = torch.Generator().manual_seed(1234)
                    saved, self.rng = self.rng, gen
                    out = self.block_losses(tokens, prompt_len, tout, k=min(4, self.hp.top_k))
                    self.rng = saved
            for key, val in out.items():
                sums[key] = sums.get(key, 0.0) + float(val) / len(batches)
        self.net.train()
        if "chain_prefix" in sums:
            sums["chain_tau"] = sums["chain_prefix"] + 1
        if "top1_prefix" in sums:
            sums["top1_tau"] = sums["top1_prefix"] + 1
        if "selected_prefix" in sums:
            sums["selected_tau"] = sums["selected_prefix"] + 1
        return sums

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, extra: dict | None = None) -> None:
        from safetensors.torch import save_file
        self.out.mkdir(parents=True, exist_ok=True)
        drafter = wrap(self.kind, self.net, self.live.model, self.hp.top_k, fingerprint=self.fingerprint)
        self.net.train()
        info = {"train": {"steps": self.step_count, "seconds": round(self.seconds, 1),
                          "metrics": {k: round(v, 4) for k, v in self.running.items()}, **(extra or {})}}
        save_drafter(drafter, self.out, info)
        self.state.mkdir(parents=True, exist_ok=True)
        # Resumable state: fp32 weights + AdamW moments, sharded below the transfer limit.
        tensors = {f"param.{n}": p.detach().float().cpu().contiguous() for n, p in self.net.named_parameters()}
        names = {id(p): n for n, p in self.net.named_parameters()}
        for group in self.opt.param_groups:
            for p in group["params"]:
                for key, val in self.opt.state.get(p, {}).items():
                    if torch.is_tensor(val):
                        tensors[f"opt.{names[id(p)]}.{key}"] = val.detach().float().cpu().reshape(val.shape).contiguous()
        shards = shard(tensors, SHARD_BYTES)
        for old in self.state.glob("train_state-*.safetensors"):
            old.unlink()
        files = []
        for i, part in enumerate(shards):
            name = f"train_state-{i:04d}.safetensors"
            save_file(part, str(self.state / name))
            files.append(name)
        state = {"kind": self.kind, "steps": self.step_count, "seconds": self.seconds, "files": files,
                 "hparams": dataclasses.asdict(self.hp), "target": self.fingerprint,
                 "history": self.history[-200:]}
        (self.state / "train_state.json").write_text(json.dumps(state, indent=1))

    def seed_from(self, folder: Path) -> list[str]:
        """Copy a trained drafter's weights into every parameter of the same name and shape;
        the rest (a LiLiCorr head seeded from a block drafter) keep their fresh init."""
        tensors = seed_tensors(folder, self.fingerprint)
        seeded = []
        with torch.no_grad():
            for name, p in self.net.named_parameters():
                src = tensors.get(name)
                if src is not None and src.shape == p.shape:
                    p.copy_(src.to(p.device, p.dtype))
                    seeded.append(name)
        if not seeded:
            raise ValueError(f"--init-from {folder}: no tensor fits a {self.kind} drafter of this shape")
        return seeded

    def resume(self) -> bool:
        from safetensors.torch import load_file
        try:
            state = json.loads((self.state / "train_state.json").read_text())
        except (OSError, ValueError):
            return False
        if state.get("target") != self.fingerprint:
            print(f"[drafter-train] {self.state}: state is for another target; starting fresh")
            return False
        tensors: dict[str, torch.Tensor] = {}
        for name in state["files"]:
            tensors.update(load_file(str(self.state / name)))
        params = dict(self.net.named_parameters())
        try:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(tensors[f"param.{n}"])
        except (KeyError, RuntimeError) as err:
            print(f"[drafter-train] {self.state}: state does not fit ({err}); starting fresh")
            return False
        for n, p in params.items():
            st = {key.rsplit(".", 1)[1]: val for key, val in tensors.items()
                  if key.startswith(f"opt.{n}.") and key.count(".") == n.count(".") + 2}
            if st:
                self.opt.state[p] = {k: v.to(p.device) for k, v in st.items()}
        self.step_count, self.seconds = state["steps"], state["seconds"]
        self.history = state.get("history", [])
        return True


# ----------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------

def train_drafters(live, chunks: list[Chunk], kinds: list[str], out: Path, hp: HParams,
                   fingerprint: dict, *, seconds: float | None = None, max_steps: int | None = None,
                   resume: bool = False, seed: int = 0, state: Path | None = None,
                   init_from: Path | None = None, log=print) -> dict:
    """Train every kind on shared batches until `seconds` or `max_steps`; save; evaluate.
    `init_from` (a drafter folder) seeds the kinds that do not resume."""
    from tqdm import tqdm
    if seconds is None and max_steps is None:
        raise ValueError("give a time budget or a step count")
    trainers = [Trainer(kind, live, hp, fingerprint, out, state) for kind in kinds]
    resumed = {t.kind: (t.resume() if resume else False) for t in trainers}
    seeded = {t.kind: t.seed_from(init_from) for t in trainers if init_from and not resumed[t.kind]}
    for kind, names in seeded.items():
        log(f"[drafter-train] {kind}: {len(names)} tensors seeded from {init_from}")
    lr_cap = 0.3 if any(resumed.values()) else 1.0   # fine-tune gently on a resumed run
    gen = torch.Generator().manual_seed(seed)
    eval_batches = held_out(live, chunks, hp.seqs)
    t0 = last_save = time.time()
    # the wall time of training (the live target's forward and every kind's step, run
    # together); a step's host time alone misses the GPU work it queues
    base_seconds = {t.kind: t.seconds for t in trainers}

    def clock_seconds() -> None:
        now = time.time()
        for t in trainers:
            t.seconds = base_seconds[t.kind] + now - t0

    step = 0
    bar = tqdm(total=max_steps or int(seconds), desc="train " + ",".join(kinds), mininterval=5,
               unit="step" if max_steps else "s")
    while True:
        elapsed = time.time() - t0
        if (max_steps is not None and step >= max_steps) or (seconds is not None and elapsed >= seconds):
            break
        progress = step / max_steps if max_steps else elapsed / seconds
        factor = lr_cap * lr_scale(progress, hp.warmup)
        tokens, prompt_len = sample_batch(chunks, hp.seqs, gen)
        tout = live.run(tokens)
        for t in trainers:
            vals = t.step(tokens, prompt_len, tout, factor)
            if step % 100 == 0:
                t.history.append({"step": t.step_count, "t": round(elapsed, 1), "lr": round(factor * t.peak_lr, 6),
                                  **{k: round(float(v), 4) for k, v in vals.items()}})
        step += 1
        if max_steps:
            bar.update(1)
        else:
            bar.n = min(int(time.time() - t0), int(seconds))
            bar.refresh() if step % 20 == 0 else None
        if step % 50 == 0:
            bar.set_postfix({t.kind: f"{float(t._running['loss']):.3f}" for t in trainers})
        if time.time() - last_save > hp.save_every:
            clock_seconds()
            for t in trainers:
                t.save()
                log(f"[drafter-train] {elapsed:6.0f}s step {step:6d} {t.kind:8s} " + " ".join(
                    f"{k}={v:.3f}" for k, v in t.running.items()
                    if k in ("loss", "slot_acc", "top1_prefix", "selected_prefix", "oracle_prefix", "acc1", "acc3")))
            last_save = time.time()
    bar.close()
    summary = {}
    clock_seconds()
    for t in trainers:
        metrics = t.evaluate(eval_batches) if eval_batches else {}
        t.save({"eval": {k: round(v, 4) for k, v in metrics.items()}})
        summary[t.kind] = {"params": param_count(t.net), "steps": t.step_count, "resumed": resumed[t.kind],
                           "seeded_from": str(init_from) if t.kind in seeded else None,
                           "seeded_tensors": len(seeded.get(t.kind, ())),
                           "train_seconds": round(t.seconds, 1),
                           "final": {k: round(v, 4) for k, v in t.running.items()},
                           "eval": {k: round(v, 4) for k, v in metrics.items()},
                           "checkpoint": str(t.out), "history": t.history[-100:]}
        log(f"[drafter-train] {t.kind}: {t.step_count} steps, eval {json.dumps(summary[t.kind]['eval'])}")
    return summary


def held_out(live, chunks: list[Chunk], seqs: int, max_batches: int = 4) -> list[tuple]:
    """Live-target outputs over the held-out greedy rows, computed once."""
    batches = []
    for c in chunks:
        if c.eval_rows and len(batches) < max_batches:
            rows = c.tokens[-c.eval_rows:][:seqs]
            batches.append((rows, c.prompt_len, live.run(rows)))
    return batches


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specla.train drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target checkpoint folder (config.json + safetensors)")
    p.add_argument("--data", default="data/corpus", help="folder with train.bin (uint16 tokens)")
    p.add_argument("--out", default="runs/drafters",
                   help="drafter checkpoints: <out>/<kind>/drafter.{json,safetensors} + <out>/summary.json")
    p.add_argument("--state", default="runs/drafter-state",
                   help="resumable training state and the generated corpus (kept apart from --out, "
                        "whose 7 files are what a GPU run sends back)")
    p.add_argument("--minutes", type=float, default=7.5, help="wall-clock budget for everything")
    p.add_argument("--kinds", default="lilicorr,block,eagle")
    p.add_argument("--resume", action="store_true", help="continue from out/<kind>/train_state*")
    p.add_argument("--init-from", default=None,
                   help="a trained drafter folder whose weights seed every parameter of the same name and "
                        "shape (e.g. a LiLiCorr drafter from a block drafter: the head starts fresh)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-layers", default=None, help="comma-separated target layers")
    p.add_argument("--gen-fraction", type=float, default=0.2)
    p.add_argument("--live", choices=("torch", "fla"), default="torch",
                   help="the live target: this project's runtime (default; on CUDA its Triton "
                        "chain kernel, batched) or fla's model (eager generation is ~100x slower)")
    p.add_argument("--gen-tokens", type=int, default=8_000_000)
    p.add_argument("--gen-batch", type=int, default=1024)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (tests)")
    for f in dataclasses.fields(HParams):
        p.add_argument("--" + f.name.replace("_", "-"), type=float if f.type in ("float", "float | None") else int,
                       default=None, help=f"(default {f.default})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    args = parse_args(argv)
    budget = args.minutes * 60
    from specla.drafters import DRAFTERS
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in kinds:
        if k not in DRAFTERS:
            raise SystemExit(f"unknown drafter kind {k!r}; choose from {', '.join(DRAFTERS)}")
    hp = HParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(HParams)
                    if getattr(args, f.name) is not None})
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_flush_denormal(True)   # CPU training slows ~20x once values go denormal
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = GDNConfig.from_file(Path(args.target) / "config.json")
    feature_layers = (tuple(int(x) for x in args.feature_layers.split(",")) if args.feature_layers
                      else default_feature_layers(config.num_hidden_layers))
    if not any(k in ("block", "lilicorr") for k in kinds):
        feature_layers = ()
    state_dir = Path(args.state)
    train_bin = prompt_tokens(Path(args.data), Path(args.target), config, state_dir / "tokens")
    summary: dict = {"device": str(device), "torch": torch.__version__, "minutes_budget": args.minutes,
                     "kinds": kinds, "feature_layers": list(feature_layers), "hparams": dataclasses.asdict(hp)}
    if device.type == "cuda" and args.live == "fla":
        model, how = load_fla_target(args.target, str(device))
        live = FlaTarget(model, config, feature_layers)
        summary["target_loader"] = how
        summary["gpu"] = torch.cuda.get_device_name(device)
        probe = torch.from_numpy(np.stack([train_bin[i * 1000:i * 1000 + 48] for i in range(2)]).astype(np.int64))
        summary["alignment"] = check_alignment(live, args.target, probe) if feature_layers else None
        print(f"[drafter-train] fla vs runtime: {json.dumps(summary['alignment'])}")
    else:
        live = TorchTarget(load_runtime_target(args.target, str(device)), feature_layers)
        summary["target_loader"] = f"specla runtime ({device.type}, fp32)"
    fingerprint = target_fingerprint(config, live.model.model.embeddings.weight)
    summary["target"] = fingerprint
    if args.init_from:      # before minutes of generation, not after
        try:
            seed_tensors(Path(args.init_from), fingerprint)
        except ValueError as err:
            raise SystemExit(str(err)) from None

    t_gen = time.time()
    chunks = load_corpus(state_dir / "data", fingerprint, device) if args.resume else None
    if chunks is None:
        chunks = generate_corpus(live, train_bin, seconds=args.gen_fraction * budget, max_tokens=args.gen_tokens,
                                 batch=args.gen_batch, seed=args.seed)
        save_corpus(chunks, state_dir / "data", fingerprint)
    agreement = greedy_agreement(live, chunks)
    summary["data"] = {"tokens": int(sum(c.tokens.numel() for c in chunks)),
                       "generated_tokens": int(sum(c.tokens.shape[0] * (c.tokens.shape[1] - c.prompt_len) for c in chunks)),
                       "sequences": int(sum(c.tokens.shape[0] for c in chunks)),
                       "held_out_sequences": int(sum(c.eval_rows for c in chunks)),
                       "seconds": round(time.time() - t_gen, 1), "greedy_agreement": agreement}
    if agreement is not None and agreement < 0.9:
        print(f"[drafter-train] WARNING: greedy continuations match the target's argmax only "
              f"{agreement:.1%} of the time: generation may be losing its state between steps")
    reserve = min(30.0, 0.07 * budget)   # final evaluation and saves
    seconds = budget - (time.time() - t_start) - reserve
    if args.max_steps is None and seconds < 30:
        print(f"[drafter-train] WARNING: only {seconds:.0f} s of the budget left for training "
              "(slow start-up?); training 30 s anyway")
        seconds = 30.0
    summary["drafters"] = train_drafters(live, chunks, kinds, out, hp, fingerprint,
                                              seconds=None if args.max_steps else seconds,
                                              max_steps=args.max_steps, resume=args.resume, seed=args.seed,
                                              state=state_dir,
                                              init_from=Path(args.init_from) if args.init_from else None)
    summary["minutes_used"] = round((time.time() - t_start) / 60, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[drafter-train] wrote {out / 'summary.json'} after {summary['minutes_used']} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
