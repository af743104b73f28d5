"""Drafters: registry, construction, and the checkpoint format.

    block     DFlash-style block drafter, trees from its slot marginals      (block.py)
    lilicorr  the block drafter + LiLiCorr head over its candidate lattice   (lilicorr.py)
    eagle     one-layer EAGLE-style drafter, autoregressive over a tree      (eagle.py)
    ngram     model-free: continuations of the context found in the prompt and the output
              so far (ngram.py); no weights, so no checkpoint: `model_free_drafter` builds it

A checkpoint is a folder:
    drafter.json         kind, hyperparameters, feature_layers, block_size, the top-k it was
                         trained with, and the target fingerprint (config hash + a hash of the
                         embedding weights); training metrics
    drafter.safetensors  the drafter's own weights in bf16 (never the target's embedding,
                         norm or LM head: those are read from the target at load time)

`load_drafter(path, target)` raises `DrafterFormatError` (a ValueError) for a missing or
corrupt file, an unknown kind, or a drafter trained for another target.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from specla.config import GDNConfig
from specla.drafters.base import Drafter

DRAFTERS = ("block", "lilicorr", "eagle")          # trained: a checkpoint folder each
MODEL_FREE = ("ngram",)                            # no weights: built for any target
FORMAT = "specla-drafter"
VERSION = 1
CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "drafter.safetensors"
MAX_WEIGHTS_BYTES = 15 * 2**20

# The fields that decide what the target computes (ids and context limits do not).
_ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim",
                "expand_v", "conv_size", "conv_bias", "use_gate", "allow_neg_eigval",
                "norm_eps", "tie_word_embeddings", "output_gate_activation")


class DrafterFormatError(ValueError):
    """A drafter checkpoint that cannot be used with this target."""


def target_fingerprint(config: GDNConfig, embed_weight: torch.Tensor) -> dict:
    """Config hash + embedding hash: what a drafter checkpoint is tied to.

    The embedding is hashed in bf16 on the CPU, so fp32 and bf16 copies of the same
    checkpoint (CPU runtime, GPU trainer) agree.
    """
    arch = {name: getattr(config, name) for name in _ARCH_FIELDS}
    arch["mlp_size"] = config.mlp_size
    config_hash = hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]
    emb = embed_weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
    embedding_hash = hashlib.sha256(emb.numpy().tobytes()).hexdigest()[:16]
    return {"config_hash": config_hash, "embedding_hash": embedding_hash,
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers}


def fingerprint_of(target: nn.Module) -> dict:
    """Fingerprint of a runtime target (`specla.model.GDNForCausalLM`)."""
    config = target.config
    if not isinstance(config, GDNConfig):
        config = GDNConfig.from_dict(config.to_dict())
    return target_fingerprint(config, target.model.embeddings.weight)


def build_net(kind: str, config: dict, head: dict | None = None) -> nn.Module:
    """The drafter's weights (random init) from its hyperparameters."""
    if kind in ("block", "lilicorr"):
        from specla.drafters.block import BlockConfig, BlockNet
        head_module = None
        if kind == "lilicorr":
            from specla.drafters.lilicorr import HeadConfig, LiLiCorrHead
            if head is None:
                raise DrafterFormatError("a LiLiCorr drafter needs a head configuration")
            head_module = LiLiCorrHead(HeadConfig(**head))
        return BlockNet(BlockConfig(**config), head_module)
    if kind == "eagle":
        from specla.drafters.eagle import EagleConfig, EagleNet
        return EagleNet(EagleConfig(**config))
    raise DrafterFormatError(f"unknown drafter kind {kind!r}; known kinds: {', '.join(DRAFTERS)}")


def wrap(kind: str, net: nn.Module, target: nn.Module, train_top_k: int | None = None,
         fingerprint: dict | None = None) -> Drafter:
    """A Drafter around `net` that borrows the target's embedding, norm and LM head."""
    from specla.drafters.block import BlockDrafter, TargetParts
    parts = TargetParts(target)
    if kind == "block":
        drafter = BlockDrafter(net, parts, train_top_k)
    elif kind == "lilicorr":
        from specla.drafters.lilicorr import LiLiCorrDrafter
        drafter = LiLiCorrDrafter(net, parts, train_top_k)
    elif kind == "eagle":
        from specla.drafters.eagle import EagleDrafter
        drafter = EagleDrafter(net, parts, train_top_k)
    else:
        raise DrafterFormatError(f"unknown drafter kind {kind!r}; known kinds: {', '.join(DRAFTERS)}")
    drafter.fingerprint = fingerprint if fingerprint is not None else fingerprint_of(target)
    return drafter


def model_free_drafter(kind: str, target: nn.Module, **options) -> Drafter:
    """A drafter that needs no weights, for any target (options go to its constructor)."""
    if kind != "ngram":
        raise ValueError(f"unknown model-free drafter {kind!r}; known: {', '.join(MODEL_FREE)}")
    from specla.drafters.ngram import NgramDrafter
    return NgramDrafter(target.config.vocab_size, device=target.lm_head.weight.device, **options)


def new_drafter(kind: str, target: nn.Module, feature_layers: tuple[int, ...] | None = None,
                block_size: int = 8, top_k: int = 8, **overrides) -> Drafter:
    """A randomly initialised drafter of `kind` sized for `target` (tests, training)."""
    net = new_net(kind, target.config, feature_layers, block_size, top_k, **overrides)
    net = net.to(device=target.lm_head.weight.device, dtype=target.lm_head.weight.dtype)
    return wrap(kind, net, target, top_k)


def new_net(kind: str, config: GDNConfig, feature_layers: tuple[int, ...] | None = None,
            block_size: int = 8, top_k: int = 8, **overrides) -> nn.Module:
    from specla.drafters.block import default_feature_layers
    D, V = config.hidden_size, config.vocab_size
    if kind == "eagle":
        heads = overrides.pop("heads", max(1, D // 64))
        return build_net(kind, {"target_hidden": D, "vocab_size": V, "heads": heads, **overrides})
    if kind not in ("block", "lilicorr"):
        raise DrafterFormatError(f"unknown drafter kind {kind!r}; known kinds: {', '.join(DRAFTERS)}")
    layers = tuple(feature_layers) if feature_layers else default_feature_layers(config.num_hidden_layers)
    head_over = overrides.pop("head", {})
    cfg = {"target_hidden": D, "vocab_size": V, "feature_layers": layers,
           "block_size": block_size, **overrides}
    head = None
    if kind == "lilicorr":
        head = {"drafter_width": cfg.get("width", 256), "target_hidden": D,
                "max_slots": max(block_size - 1, 1), "max_k": top_k, **head_over}
    return build_net(kind, cfg, head)


def save_drafter(drafter: Drafter, path: str | Path, extra: dict | None = None) -> Path:
    """Write drafter.json + drafter.safetensors (bf16) into the folder `path`."""
    from safetensors.torch import save_file
    from specla.drafters.block import param_count

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
               for k, v in drafter.net.state_dict().items()}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > MAX_WEIGHTS_BYTES:
        raise ValueError(f"drafter weights are {size / 2**20:.1f} MiB; the limit is "
                         f"{MAX_WEIGHTS_BYTES / 2**20:.0f} MiB")
    meta = {"format": FORMAT, "version": VERSION, "kind": drafter.kind,
            **drafter.checkpoint_meta(), "target": drafter.fingerprint,
            "params": param_count(drafter.net), **(extra or {})}
    _atomic_write(path / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT}))
    _atomic_write(path / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    return path


def _atomic_write(dest: Path, write) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    write(tmp)
    os.replace(tmp, dest)


def read_meta(path: str | Path) -> dict:
    """The drafter.json of a checkpoint folder, checked for format and kind."""
    path = Path(path)
    if path.is_file() and path.name == CONFIG_FILE:
        path = path.parent
    file = path / CONFIG_FILE
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise DrafterFormatError(f"{path}: no {CONFIG_FILE} there (not a drafter checkpoint)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DrafterFormatError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DrafterFormatError(f"{file}: not a SpecLA drafter checkpoint (format {FORMAT!r} expected)")
    if meta.get("version") != VERSION:
        raise DrafterFormatError(f"{file}: checkpoint version {meta.get('version')!r}; "
                                 f"this code reads version {VERSION}")
    if meta.get("kind") not in DRAFTERS:
        raise DrafterFormatError(f"{file}: unknown drafter kind {meta.get('kind')!r}; "
                                 f"known kinds: {', '.join(DRAFTERS)}")
    return meta


def load_drafter(path: str | Path, target: nn.Module) -> Drafter:
    """Load a drafter checkpoint folder for `target` (a runtime GDNForCausalLM)."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_file() and path.name == CONFIG_FILE:
        path = path.parent
    meta = read_meta(path)
    kind = meta["kind"]
    mine = fingerprint_of(target)
    theirs = meta.get("target") or {}
    for key in ("config_hash", "embedding_hash"):
        if theirs.get(key) != mine[key]:
            raise DrafterFormatError(
                f"{path}: this {kind} drafter was trained for another target ({key} "
                f"{theirs.get(key)!r}, this target has {mine[key]!r}; the drafter expects vocab "
                f"{theirs.get('vocab_size')}, hidden {theirs.get('hidden_size')}, "
                f"{theirs.get('num_hidden_layers')} layers)")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise DrafterFormatError(f"{path}: {WEIGHTS_FILE} is missing")
    try:
        tensors = load_file(str(weights))
    except Exception as err:  # safetensors' own error type moved between versions
        raise DrafterFormatError(f"{weights}: corrupt or unreadable safetensors file ({err})") from None
    try:
        net = build_net(kind, meta["config"], meta.get("head"))
    except (TypeError, KeyError, ValueError) as err:
        raise DrafterFormatError(f"{path / CONFIG_FILE}: bad hyperparameters ({err})") from None
    try:
        net.load_state_dict(tensors, strict=True)
    except RuntimeError as err:
        first = str(err).splitlines()[0] if str(err) else "mismatch"
        raise DrafterFormatError(f"{weights}: weights do not fit the {kind} drafter described "
                                 f"in {CONFIG_FILE} ({first})") from None
    weight = target.lm_head.weight
    net = net.to(device=weight.device, dtype=weight.dtype)
    drafter = wrap(kind, net, target, meta.get("top_k"), fingerprint=mine)
    drafter.meta = meta
    return drafter


__all__ = ["DRAFTERS", "MODEL_FREE", "model_free_drafter", "DrafterFormatError", "load_drafter", "save_drafter", "new_drafter",
           "new_net", "build_net", "wrap", "target_fingerprint", "fingerprint_of", "read_meta"]
