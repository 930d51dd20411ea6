"""The model as the planner sees it: a config.json-like dict (no weights) and its quantization.

Where it comes from, in order: the plan's checkpoint folder (``config.json`` and its
``quantization_config``), the tiny model rig builds (its config, built or not), or — for the real
checkpoint not downloaded yet — the published shape in ``models/qwen3.5-27b-class.toml``. The
planner then needs nothing but these numbers.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rig import paths

REAL_SHAPE = paths.ROOT / "models" / "qwen3.5-27b-class.toml"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Quant:
    """Weight quantization of the linears (None = 16-bit checkpoint)."""

    bits: int
    group_size: int
    block_prefixes: tuple[str, ...] = ("model.layers",)
    keep_16bit: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shape:
    """A hybrid decoder's shape: what weights, state and KV bytes follow from."""

    config: dict[str, Any]
    quant: Quant | None
    source: str
    layer_types: tuple[str, ...] = field(default=())

    def __getattr__(self, name: str) -> Any:  # config keys read as attributes: shape.hidden_size
        if name.startswith("_") or name == "config":
            raise AttributeError(name)
        try:
            return self.config[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def attention_layers(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def gdn_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16"]


def layer_types(config: dict[str, Any]) -> tuple[str, ...]:
    """The per-layer kinds: config's ``layer_types``, else every ``full_attention_interval``-th layer;
    a config with neither is a dense transformer (the quality battery's dense control): all attention."""
    if config.get("layer_types"):
        return tuple(config["layer_types"])
    n = int(config["num_hidden_layers"])
    if "full_attention_interval" not in config:
        return ("full_attention",) * n
    every = int(config["full_attention_interval"])
    return tuple("full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n))


def quant_of(qc: dict[str, Any] | None) -> Quant | None:
    """A checkpoint's quantization_config (AutoRound / GPTQ keys) or the shape file's [checkpoint]."""
    if not qc or not qc.get("bits"):
        return None
    prefixes = qc.get("block_name_to_quantize") or ["model.layers"]
    prefixes = [prefixes] if isinstance(prefixes, str) else prefixes
    return Quant(bits=int(qc["bits"]), group_size=int(qc.get("group_size", 128)),
                 block_prefixes=tuple(prefixes), keep_16bit=tuple(qc.get("keep_16bit", ())))


# What the planner reads of every model, and of a model with GDN layers too (HF config names).
REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size")
REQUIRED_GDN = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")


class ShapeError(ValueError):
    """A model config the planner cannot read: names the file and the keys it lacks."""


def from_config(config: dict[str, Any], source: str) -> Shape:
    cfg = dict(config.get("text_config", config))
    missing = [k for k in REQUIRED if k not in cfg]
    if not missing and "linear_attention" in layer_types(cfg):
        missing = [k for k in REQUIRED_GDN if k not in cfg]
    if missing:
        raise ShapeError(f"{source}: the capacity planner needs {', '.join(missing)} in the model's config "
                         f"(a Hugging Face config.json of a Qwen3 / Qwen3.5-family decoder); point MODEL at a "
                         f"complete checkpoint folder")
    return Shape(config=cfg, quant=quant_of(config.get("quantization_config")), source=source,
                 layer_types=layer_types(cfg))


def real_shape() -> Shape:
    """The published Qwen3.5-27B-class shape (models/qwen3.5-27b-class.toml), W4A16 AutoRound."""
    data = tomllib.loads(REAL_SHAPE.read_text())
    cfg = dict(data["config"])
    cfg["quantization_config"] = dict(data["checkpoint"])
    return from_config(cfg, str(REAL_SHAPE.relative_to(paths.ROOT)))


def tiny_shape(arch: str) -> Shape:
    """The tiny model rig builds, from the same function that writes its config.json."""
    from rig.models.tiny import TinySpec, _hybrid_config

    if arch != "hybrid":
        raise ValueError(f"MODEL='tiny:{arch}': the capacity planner covers hybrid models; allowed: tiny:hybrid")
    cfg = _hybrid_config(TinySpec(arch=arch), {"<|endoftext|>": 0, "<|im_end|>": 1})
    return from_config(cfg, "rig/models/tiny.py (TinySpec)")


def for_model(model_knob: str, folder: Path) -> Shape:
    """The shape of a plan's MODEL: its config.json when present, else what rig knows of it."""
    if model_knob.startswith("tiny:"):
        return tiny_shape(model_knob.split(":", 1)[1])
    cfg_path = folder / "config.json"
    if cfg_path.is_file():
        return from_config(json.loads(cfg_path.read_text()), str(cfg_path))
    return real_shape()
