"""The Gated DeltaNet configuration, read from an fla / Hugging Face `config.json`."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


class ModelFormatError(ValueError):
    """A checkpoint that cannot be loaded: the message says what is wrong and where."""


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    vocab_size: int = 32000
    hidden_size: int = 2048
    num_hidden_layers: int = 21
    num_heads: int = 6
    head_dim: int = 256
    expand_v: float = 2.0
    conv_size: int = 4
    conv_bias: bool = False
    use_gate: bool = True
    allow_neg_eigval: bool = False
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    output_gate_activation: str = "swish"
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    max_position_embeddings: int = 2048

    @property
    def head_v_dim(self) -> int:
        return int(self.head_dim * self.expand_v)

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.num_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        """q, k and v pre-conv inputs, concatenated: what the short-conv window holds."""
        return 2 * self.key_dim + self.value_dim

    @property
    def mlp_size(self) -> int:
        # fla's GatedMLP rule: 2/3 * hidden * ratio, rounded up to a multiple of 256.
        if self.intermediate_size is not None:
            return self.intermediate_size
        size = int(self.hidden_size * (self.hidden_ratio or 4) * 2 / 3)
        return 256 * ((size + 255) // 256)

    def state_bytes(self, batch: int = 1) -> int:
        """fp32 recurrent state of every layer."""
        return 4 * batch * self.num_hidden_layers * self.num_heads * self.head_dim * self.head_v_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "GDNConfig":
        model_type = raw.get("model_type")
        if model_type != "gated_deltanet":
            raise ModelFormatError(
                f"{source}: model_type is {model_type!r}; SpecLA runs Gated DeltaNet "
                "checkpoints (model_type 'gated_deltanet').")
        if raw.get("use_short_conv", True) is False:
            raise ModelFormatError(f"{source}: use_short_conv=False is not supported.")
        num_v_heads = raw.get("num_v_heads")
        if num_v_heads not in (None, raw.get("num_heads", cls.num_heads)):
            raise ModelFormatError(f"{source}: grouped value heads (num_v_heads={num_v_heads}) "
                                   "are not supported.")
        if raw.get("attn") or raw.get("attnres_block_size"):
            raise ModelFormatError(f"{source}: hybrid attention layers / attnres are not supported.")
        if raw.get("hidden_act", "swish") != "swish":
            raise ModelFormatError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported.")
        names = {f.name for f in dataclasses.fields(cls)}
        config = cls(**{key: value for key, value in raw.items() if key in names})
        config.validate(source)
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "GDNConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelFormatError(f"{path}: no config.json there") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ModelFormatError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(raw, dict):
            raise ModelFormatError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=str(path))

    def validate(self, source: str = "config") -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim",
                     "conv_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelFormatError(f"{source}: {name} must be a positive integer, got {value!r}")
        if not math.isclose(self.head_dim * self.expand_v, self.head_v_dim, rel_tol=1e-6):
            raise ModelFormatError(f"{source}: head_dim * expand_v must be an integer")
        if self.output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ModelFormatError(f"{source}: unknown output_gate_activation "
                                   f"{self.output_gate_activation!r}")

    def to_dict(self) -> dict[str, Any]:
        """fla-compatible config.json content."""
        out = dataclasses.asdict(self)
        out.update(model_type="gated_deltanet", architectures=["GatedDeltaNetForCausalLM"],
                   use_short_conv=True, hidden_act="swish", attn_mode="chunk",
                   fuse_norm=True, fuse_swiglu=True, fuse_cross_entropy=True)
        return out


# The public GDN-1.3B shape (m-a-p's 1.3B-100B GatedDeltaNet-pure) and fla's default shape.
PUBLIC_1P3B = GDNConfig(hidden_size=2048, num_hidden_layers=24, num_heads=8, head_dim=256,
                        expand_v=1.0, intermediate_size=5632, vocab_size=32000)
FLA_DEFAULT = GDNConfig()
