"""Deterministic tiny models of the real architecture, built offline: the embedded default on CPU.

``hybrid``: ``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``) with the real model's layer
pattern — three Gated DeltaNet layers to one gated full-attention layer, GQA, head_dim 256,
partial rotary — plus one MTP layer so speculative decoding (``SPEC=mtp``) can be tried.
``dense``: ``Qwen3ForCausalLM``. Both share a byte-level BPE tokenizer trained on
``rig.models.corpus`` and a Qwen-style chat template with the XML tool-call format.

Limits of vLLM 0.28 on CPU respected here (see docs/development.md): GDN head dim >= 64
(smaller raises "Unexpected head dim size"); every Linear output >= 16 (``in_proj_b``/``a`` are
merged into one ``in_proj_ba`` of 2 x value heads, hence 8 value heads). The mamba state is
kept small (4 key / 8 value heads of 64) and the attention page wide (4 KV heads x 256), so the
hybrid block that prefix caching hashes stays a few dozen tokens long and tests can hit it.

Same spec and seed -> byte-identical files (tests check the sha256 of every file).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rig import paths
from rig.models import corpus

TEMPLATE = Path(__file__).with_name("chat_template.jinja")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (not special) so they survive detokenization: the tool and reasoning parsers read them.
MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MANIFEST = "rig-model.json"


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny model's bytes."""

    arch: str = "hybrid"
    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    mtp_layers: int = 1
    max_position_embeddings: int = 32768
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]
        return f"tiny-{self.arch}-s{self.seed}-{digest}"


def _tokenizer(out: Path, seed: int, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL) - len(MARKUP),
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus.generate(seed).splitlines()
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=32768,
    )
    fast.add_tokens(MARKUP)
    fast.chat_template = TEMPLATE.read_text()
    fast.save_pretrained(out)


def _hybrid_config(spec: TinySpec, tok_ids: dict[str, int]) -> dict:
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(spec.num_hidden_layers)
        ],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "partial_rotary_factor": 0.25,
        "mtp_num_hidden_layers": spec.mtp_layers,
        "bos_token_id": tok_ids["<|endoftext|>"],
        "eos_token_id": tok_ids["<|im_end|>"],
        "pad_token_id": tok_ids["<|endoftext|>"],
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def _dense_config(spec: TinySpec, tok_ids: dict[str, int]) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_theta": 1000000.0,
        "bos_token_id": tok_ids["<|endoftext|>"],
        "eos_token_id": tok_ids["<|im_end|>"],
        "pad_token_id": tok_ids["<|endoftext|>"],
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def _weights(spec: TinySpec, config: dict) -> dict:
    """Random weights from the HF reference implementation, seeded; MTP layer appended."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    base = {k: v for k, v in config.items() if k != "mtp_num_hidden_layers"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**base), dtype=torch.float32)
    state = dict(model.state_dict())
    if spec.arch == "hybrid" and spec.mtp_layers:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

        n = spec.mtp_layers
        mtp_cfg = AutoConfig.for_model(**{**base, "layer_types": ["full_attention"] * n, "num_hidden_layers": n})
        h = spec.hidden_size
        state["mtp.fc.weight"] = torch.randn(h, 2 * h) * 0.02
        for norm in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
            state[f"mtp.{norm}.weight"] = torch.zeros(h)
        for i in range(n):
            for k, v in Qwen3_5DecoderLayer(mtp_cfg, i).state_dict().items():
                state[f"mtp.layers.{i}.{k}"] = v
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
    return state


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(spec: TinySpec, dest: Path | None = None) -> Path:
    """Build (or reuse) the model of ``spec``; returns its folder. Atomic: built aside, renamed."""
    dest = dest or paths.models_dir() / spec.name
    if dest.exists() and verify(dest):
        return dest
    import torch
    from safetensors.torch import save_file

    torch.use_deterministic_algorithms(True)
    work = dest.with_name(dest.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _tokenizer(work, spec.seed, spec.vocab_size)
    vocab = json.loads((work / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    config = (_hybrid_config if spec.arch == "hybrid" else _dense_config)(spec, ids)
    state = _weights(spec, config)
    save_file(dict(sorted(state.items())), str(work / "model.safetensors"), metadata={"format": "pt"})
    (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (work / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
         "pad_token_id": config["pad_token_id"], "do_sample": True, "temperature": 0.7, "top_p": 0.8,
         "top_k": 20}, indent=2, sort_keys=True) + "\n")
    files = {p.name: _sha256(p) for p in sorted(work.iterdir()) if p.is_file()}
    (work / MANIFEST).write_text(json.dumps({"spec": asdict(spec), "files": files}, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    work.rename(dest)
    return dest


def verify(folder: Path) -> bool:
    """True when every file listed in the manifest is present with its recorded sha256."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return all((folder / n).is_file() and _sha256(folder / n) == h for n, h in manifest["files"].items())


def default_hybrid() -> Path:
    """The embedded default model: what `serve` runs on a host without a CUDA GPU."""
    return build(TinySpec())
