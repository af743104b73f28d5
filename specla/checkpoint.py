"""Save and load Gated DeltaNet checkpoints in the fla / Hugging Face folder layout.

    folder/
      config.json                     model_type "gated_deltanet" (GDNConfig.to_dict())
      model.safetensors               one file when the weights fit in one shard, else
      model-0000i-of-0000n.safetensors + model.safetensors.index.json (name -> shard)
      tokenizer.json, tokenizer_config.json, special_tokens_map.json

Shards stay under 15 MiB so that every file fits through the 16 MiB limit of the GPU
machine's file transfer. The same folder loads in fla (`GatedDeltaNetForCausalLM.
from_pretrained`) and here; a folder written by fla's `save_pretrained` loads here too.
Only safetensors and JSON are read: never pickle, never remote code.

    model, tokenizer, report = load_model("assets/")        # fp32 on CPU, bf16 on CUDA
    report.unused_tensors                                     # in the file, not in our model
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specla.config import GDNConfig, ModelFormatError
from specla.tokenizer import TOKENIZER_FILES

MAX_SHARD_BYTES = 15 * 2**20
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclasses.dataclass
class LoadReport:
    source: str                      # what the caller asked for (folder or hub id)
    folder: str                      # the local folder that was read
    shards: list[str]
    stored_dtypes: dict[str, int]    # e.g. {"torch.bfloat16": 38}
    dtype: str
    device: str
    num_parameters: int
    unused_tensors: list[str]        # present in the checkpoint, not used by the model: ignored
    notes: list[str] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------- save

def export_state_dict(state: dict[str, torch.Tensor], config: GDNConfig,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors in `dtype`; a tied LM head is stored once (as fla does)."""
    out = {}
    for name, tensor in state.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        out[name] = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else None).contiguous()
    return out


def shard(state: dict[str, torch.Tensor], max_bytes: int = MAX_SHARD_BYTES) -> list[dict]:
    """Greedy shards in name order (a tensor larger than max_bytes gets a shard to itself)."""
    shards, current, size = [], {}, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def save_model(model_or_state: torch.nn.Module | dict, config: GDNConfig, out: str | Path,
               tokenizer_dir: str | Path | None = None, dtype: torch.dtype = torch.bfloat16,
               max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write config.json, the weights (sharded) and the tokenizer files. Returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX_NAME]:
        stale.unlink(missing_ok=True)  # an older save with another shard count must not linger
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    state = export_state_dict(state, config, dtype)
    written = [out / "config.json"]
    raw = config.to_dict()
    raw["dtype"] = str(dtype).removeprefix("torch.")
    written[0].write_text(json.dumps(raw, indent=2) + "\n")
    parts = shard(state, max_shard_bytes)
    names = [WEIGHTS_NAME] if len(parts) == 1 else \
        [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for name, part in zip(names, parts):
        save_file(part, str(out / name), metadata={"format": "pt"})
        written.append(out / name)
    if len(parts) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {t: name for name, part in zip(names, parts) for t in part}}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / INDEX_NAME)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).exists():
                shutil.copyfile(Path(tokenizer_dir) / name, out / name)
                written.append(out / name)
    return written


# ---------------------------------------------------------------------------- load

def resolve(path_or_id: str | Path) -> Path:
    """A local folder as it is; a hub id ("owner/name") downloaded when online."""
    path = Path(path_or_id)
    if path.exists():
        if not path.is_dir():
            raise ModelFormatError(f"{path} is a file; pass the checkpoint folder (with config.json)")
        return path
    text = str(path_or_id)
    local_hint = (f"download it on a machine that is online (`hf download {text} --local-dir "
                  f"DIR`) and pass the local folder instead: load_model('DIR')")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        raise ModelFormatError(f"{text}: no such checkpoint folder")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ModelFormatError(f"{text}: no such local folder, and the hub is offline "
                               f"(HF_HUB_OFFLINE=1) so it cannot be downloaded; {local_hint}")
    try:
        from huggingface_hub import snapshot_download
        # safetensors, JSON and tokenizer files only: pickled weights are never fetched.
        return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                            "*.model"]))
    except Exception as err:  # network, auth, missing repo: all end the same way for the caller
        raise ModelFormatError(f"{text}: no such local folder, and downloading it from the hub "
                               f"failed ({type(err).__name__}: {err}); {local_hint}") from None


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ModelFormatError(f"{index}: not a valid safetensors index ({err})") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise ModelFormatError(f"{index} names shard {f.name}, which is not in {folder}")
        return files
    if (folder / WEIGHTS_NAME).exists():
        return [folder / WEIGHTS_NAME]
    pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
    if pickled:
        raise ModelFormatError(f"{folder}: only pickle weights ({', '.join(sorted(pickled))}); "
                               "SpecLA loads safetensors only (pickle can run code on load). "
                               "Convert them with safetensors on a trusted machine.")
    raise ModelFormatError(f"{folder}: no weights ({WEIGHTS_NAME} or {INDEX_NAME})")


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    state = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    state[name] = fh.get_tensor(name)
        except Exception as err:  # safetensors raises its own error type, or OSError
            raise ModelFormatError(f"{f}: not a readable safetensors file ({err})") from None
    return state


def load_model(path_or_id: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None):
    """(GDNForCausalLM in eval mode, tokenizer or None, LoadReport) from a checkpoint folder."""
    from specla.model import GDNForCausalLM

    folder = resolve(path_or_id)
    config = GDNConfig.from_file(folder / "config.json")
    files = weight_files(folder)
    state = read_tensors(files)
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)

    with torch.device("meta"):  # no time spent on a random init that is overwritten anyway
        model = GDNForCausalLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    notes = []
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        if "lm_head.weight" in state:
            state.pop("lm_head.weight")
            notes.append("lm_head.weight stored although tied to the embeddings: ignored")
    missing = [name for name in expected if name not in state]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelFormatError(f"{folder}: missing tensors {', '.join(missing[:5])}{more}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ModelFormatError(f"{folder}: tensor {name} has shape {list(state[name].shape)}, "
                                   f"config.json implies {list(shape)}")
    unused = sorted(name for name in state if name not in expected)
    stored = {}
    for name in expected:
        stored[str(state[name].dtype)] = stored.get(str(state[name].dtype), 0) + 1
    weights = {name: state[name].to(device=device, dtype=dtype) for name in expected}
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embeddings.weight"]
    model.load_state_dict(weights, strict=True, assign=True)
    if config.tie_word_embeddings:  # assign=True made two Parameters: make them one again
        model.lm_head.weight = model.model.embeddings.weight
    model.eval()

    tokenizer = None
    if (folder / "tokenizer.json").exists():
        from specla.tokenizer import load_tokenizer
        try:
            tokenizer = load_tokenizer(folder)
        except Exception as err:
            raise ModelFormatError(f"{folder}/tokenizer.json: cannot be loaded ({err})") from None
    else:
        notes.append("no tokenizer.json in the folder: tokenizer is None")
    report = LoadReport(source=str(path_or_id), folder=str(folder), shards=[f.name for f in files],
                        stored_dtypes=stored, dtype=str(dtype), device=str(device),
                        num_parameters=sum(p.numel() for p in model.parameters()),
                        unused_tensors=unused, notes=notes)
    return model, tokenizer, report
