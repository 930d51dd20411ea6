"""Random-weight checkpoints of a real model's shape, in its own W4A16 format: benchmark fixtures.

Throughput, memory accounting and kernel speed do not depend on weight values: a checkpoint of
the real architecture and size (``models/<shape>.toml``: the published config and the AutoRound
format) runs exactly the kernels, the Marlin int4 path, the GDN state and the KV pool users run,
without a download. It is **never a model**: its text is noise, so benchmarks of it use
``--ignore-eos``; its folder name, manifest and served name say "fixture" / "random weights".

The format is what vLLM 0.28 loads through its INC (``auto-round``) path onto GPTQ-Marlin:
``quantization_config`` with ``packing_format = auto_round:auto_gptq``, and per quantized linear
``qweight`` (int32, 8 nibbles packed along the input dim, [K/8, N]), ``qzeros`` (int32, the GPTQ
v1 stored zero ``8 - 1`` in every nibble, [K/G, N/8]), ``scales`` (fp16, [K/G, N]) and ``g_idx``
(int32, [K]). Tensor names and shapes come from transformers' own class for the config (built on
the meta device: no memory), so they are the names vLLM's loader expects.

Values: every tensor is drawn from its own PCG64 stream, seeded by (seed, name), through numpy:
the same shape and seed give byte-identical files on any host. Initial values follow the HF
initialisation where it is a constant (RMSNorm weights 0 in this family's ``1 + w`` form, the
gated norm and ``dt_bias`` 1, ``A_log`` = log U(1, 16)); weights are uniform with std 0.02; int4
scales make the dequantised weights std 0.02 too, so activations stay finite through 64 layers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tomllib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from rig import paths

SHAPES = paths.ROOT / "models"
MANIFEST = "rig-model.json"
WARNING = "benchmark fixture: random weights of a real model's shape; its text is noise; never a model"
SHARD_BYTES = 4 * 2**30
STD = 0.02
# RMSNorms of this family are stored as w with output x * (1 + w): HF initialises them to 0.
ZEROS = re.compile(r"(layernorm|self_attn\.[qk]_norm|pre_fc_norm_hidden|pre_fc_norm_embedding)\.weight$"
                   r"|^(model|mtp)\.norm\.weight$")


class FixtureError(ValueError):
    """A shape name or override that cannot be built; the message names it."""


@dataclass(frozen=True)
class FixtureSpec:
    """Everything that determines a fixture's bytes."""

    shape: str
    seed: int = 0
    overrides: dict = field(default_factory=dict)  # config keys replaced (tests build small ones)

    @property
    def name(self) -> str:
        body = json.dumps({"shape": load_shape(self.shape), "seed": self.seed, "overrides": self.overrides},
                          sort_keys=True)
        return f"fixture-{self.shape}-w4a16-s{self.seed}-{hashlib.sha256(body.encode()).hexdigest()[:10]}"


def shapes() -> list[str]:
    return sorted(p.stem for p in SHAPES.glob("*.toml"))


def load_shape(name: str) -> dict:
    """The parsed ``models/<name>.toml``: [source], [config], [checkpoint]."""
    path = SHAPES / f"{name}.toml"
    if not path.is_file():
        raise FixtureError(f"model shape {name!r}: no {path.relative_to(paths.ROOT)}; known: {', '.join(shapes())}")
    return tomllib.loads(path.read_text())


def hf_config(spec: FixtureSpec, vocab_ids: dict[str, int]) -> dict:
    """config.json of the fixture: the shape's config, its layer pattern, and the AutoRound quantization_config."""
    shape = load_shape(spec.shape)
    cfg = {**shape["config"], **spec.overrides}
    unknown = set(spec.overrides) - set(shape["config"])
    if unknown:
        raise FixtureError(f"fixture overrides {sorted(unknown)}: not keys of models/{spec.shape}.toml [config]")
    every = cfg.pop("full_attention_interval")
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                              "partial_rotary_factor": cfg["partial_rotary_factor"]}
    ck = shape["checkpoint"]
    keep = {f"model.layers.{i}.{m}": {"bits": 16} for i, t in enumerate(cfg["layer_types"])
            if t == "linear_attention" for m in ck["keep_16bit"]}
    cfg["quantization_config"] = {
        "quant_method": ck["quant_method"], "packing_format": ck["packing_format"], "bits": ck["bits"],
        "group_size": ck["group_size"], "sym": ck["sym"], "data_type": "int",
        "block_name_to_quantize": ",".join(ck["block_name_to_quantize"]), "extra_config": keep,
    }
    cfg.update(bos_token_id=vocab_ids["<|endoftext|>"], eos_token_id=vocab_ids["<|im_end|>"],
               pad_token_id=vocab_ids["<|endoftext|>"], torch_dtype="bfloat16", dtype="bfloat16")
    cfg["rig_fixture"] = {"shape": spec.shape, "seed": spec.seed, "overrides": spec.overrides, "warning": WARNING}
    return cfg


def checkpoint_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every bf16 tensor of the unquantized checkpoint, from transformers' class (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    base = {k: v for k, v in cfg.items() if k not in ("quantization_config", "rig_fixture", "mtp_num_hidden_layers")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**base))
        out = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
        n = cfg.get("mtp_num_hidden_layers", 0)
        if n:
            h = cfg["hidden_size"]
            mtp_cfg = AutoConfig.for_model(**{**base, "layer_types": ["full_attention"] * n, "num_hidden_layers": n})
            out.append(("mtp.fc.weight", (h, 2 * h)))
            out += [(f"mtp.{k}.weight", (h,)) for k in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm")]
            for i in range(n):
                layer = Qwen3_5DecoderLayer(mtp_cfg, i).state_dict()
                out += [(f"mtp.layers.{i}.{k}", tuple(v.shape)) for k, v in layer.items()]
    return sorted(out)


def quantized(name: str, shape: tuple[int, ...], cfg: dict) -> bool:
    """Whether the checkpoint stores this weight as int4: a 2-D linear of a quantized block, not kept at 16 bit."""
    q = cfg["quantization_config"]
    module = name.removesuffix(".weight")
    return (name.endswith(".weight") and len(shape) == 2 and name != "lm_head.weight"
            and "embed_tokens" not in name
            and any(module.startswith(b) for b in q["block_name_to_quantize"].split(","))
            and module not in q["extra_config"])


def _rng(seed: int, name: str):
    import numpy as np

    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(key))


def _uniform_bf16(rng, shape: tuple[int, ...], std: float):
    """bf16 uniform on [-a, a] with the given std (a = std * sqrt 3), from 16 random bits per value."""
    import numpy as np
    import torch

    a = std * math.sqrt(3.0)
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat = out.view(-1)
    step = 1 << 24  # drawn in slices: an embedding's float32 temporaries would take 15 GB at once
    for lo in range(0, flat.numel(), step):
        n = min(step, flat.numel() - lo)
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16).astype(np.float32)
        bits *= 2 * a / 65535.0
        bits -= a
        flat[lo:lo + n] = torch.from_numpy(bits)
    return out


def _dense(seed: int, name: str, shape: tuple[int, ...]):
    """A 16-bit tensor as HF initialises it where that is a constant, else uniform with std 0.02."""
    import torch

    if ZEROS.search(name):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("A_log"):
        u = _rng(seed, name).uniform(1.0, 16.0, size=shape)
        return torch.from_numpy(u).log().to(torch.bfloat16)
    return _uniform_bf16(_rng(seed, name), shape, STD)


def _int4(seed: int, name: str, shape: tuple[int, int], group: int) -> dict:
    """GPTQ (auto_gptq v1) tensors of a symmetric int4 linear of weight shape [N, K]."""
    import numpy as np
    import torch

    n, k = shape
    if k % group or k % 8 or n % 8:
        raise FixtureError(f"{name}: [{n}, {k}] cannot be packed at group {group} (K % group, K % 8, N % 8)")
    module = name.removesuffix(".weight")
    rng = _rng(seed, module)
    qweight = rng.integers(0, 1 << 32, size=(k // 8, n), dtype=np.uint32).view(np.int32)
    # Nibbles uniform on 0..15 -> (q - 8) has std sqrt(85/4) ~ 4.61; scales put the weight's std at STD.
    scale = STD / math.sqrt(85 / 4)
    scales = (rng.uniform(0.75, 1.25, size=(k // group, n)) * scale).astype(np.float16)
    return {
        f"{module}.qweight": torch.from_numpy(qweight),
        f"{module}.qzeros": torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32),
        f"{module}.scales": torch.from_numpy(scales),
        f"{module}.g_idx": torch.arange(k, dtype=torch.int32) // group,
    }


def _one(spec: FixtureSpec, cfg: dict, name: str, shape: tuple[int, ...]) -> dict:
    """One source tensor's checkpoint tensors (an int4 linear expands to its four)."""
    if quantized(name, shape, cfg):
        return _int4(spec.seed, name, shape, cfg["quantization_config"]["group_size"])
    return {name: _dense(spec.seed, name, shape)}


def tensors(spec: FixtureSpec, cfg: dict, workers: int | None = None) -> Iterator[dict]:
    """Every checkpoint tensor, one source tensor at a time, in checkpoint order.

    Drawn on a few threads (numpy's generators and casts release the GIL; 27B values take minutes
    on one core): each tensor has its own stream, so the bytes do not depend on the thread count.
    At most ``2 * workers`` tensors are in flight, which bounds memory to a few of the largest.
    """
    workers = workers or min(8, os.cpu_count() or 1)
    todo = iter(checkpoint_tensors(cfg))
    with ThreadPoolExecutor(workers) as pool:
        window = deque(pool.submit(_one, spec, cfg, n, s) for n, s in islice(todo, 2 * workers))
        while window:
            group = window.popleft().result()
            for n, s in islice(todo, 1):
                window.append(pool.submit(_one, spec, cfg, n, s))
            yield group


def _tokenizer(work: Path, spec: FixtureSpec, vocab_size: int) -> dict[str, int]:
    """rig's tiny tokenizer, its vocabulary padded with filler tokens to the shape's vocab (as the real one is padded).

    Encoding is the tiny BPE's; every id the random lm_head can pick decodes (fillers read ` fxN`).
    """
    from rig.models import tiny

    tiny._tokenizer(work, spec.seed, 2048)
    path = work / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tok["added_tokens"]}
    if vocab_size < len(used):
        raise FixtureError(f"vocab_size {vocab_size}: below the tokenizer's own {len(used)} tokens")
    for i in range(vocab_size):
        if i not in used:
            vocab[f"\u0120fx{i}"] = i
    path.write_text(json.dumps(tok, ensure_ascii=False, sort_keys=True))
    return {t["content"]: t["id"] for t in tok["added_tokens"]}


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _sha256_all(files: list[Path]) -> dict[str, str]:
    """{name: sha256} of files, hashed on threads (hashlib releases the GIL): shards of 4 GiB each."""
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return dict(zip((p.name for p in files), pool.map(_sha256, files), strict=True))


def build(spec: FixtureSpec, dest: Path | None = None, progress=None) -> Path:
    """Build (or reuse, when it verifies) the fixture of ``spec``; atomic: built beside, renamed.

    ``progress(done_bytes, name)`` is called after each tensor (rich bars in the CLI).
    """
    from safetensors.torch import save_file

    dest = dest or paths.models_dir() / spec.name
    if dest.exists() and verify(dest):
        return dest
    work = dest.with_name(dest.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shape_vocab = {**load_shape(spec.shape)["config"], **spec.overrides}["vocab_size"]
    ids = _tokenizer(work, spec, shape_vocab)
    cfg = hf_config(spec, ids)
    shard: dict = {}
    size = done = 0
    weight_map: dict[str, str] = {}
    shards: list[str] = []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            fname = f"model-{len(shards) + 1:05d}.safetensors"
            shards.append(fname)
            save_file(dict(sorted(shard.items())), str(work / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            shard, size = {}, 0

    for group in tensors(spec, cfg):
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        if size and size + nbytes > SHARD_BYTES:
            flush()
        shard.update(group)
        size += nbytes
        done += nbytes
        if progress:
            progress(done, next(iter(group)))
    flush()
    (work / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": done}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (work / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (work / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]},
        indent=2, sort_keys=True) + "\n")
    files = _sha256_all([p for p in sorted(work.iterdir()) if p.is_file()])
    (work / MANIFEST).write_text(json.dumps(
        {"fixture": {"shape": spec.shape, "seed": spec.seed, "overrides": spec.overrides, "warning": WARNING},
         "weights_bytes": done, "files": files}, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    work.rename(dest)
    return dest


def verify(folder: Path) -> bool:
    """True when every file the manifest lists is there with its sha256."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    paths_ = [folder / n for n in manifest["files"]]
    if not all(p.is_file() for p in paths_):
        return False
    return _sha256_all(paths_) == manifest["files"]


def weights_bytes(spec: FixtureSpec) -> int:
    """Bytes the checkpoint's tensors take, without building it (the manifest records the same figure)."""
    cfg = hf_config(spec, {"<|endoftext|>": 0, "<|im_end|>": 2})
    group = cfg["quantization_config"]["group_size"]
    total = 0
    for name, shape in checkpoint_tensors(cfg):
        if quantized(name, shape, cfg):
            n, k = shape
            total += k // 8 * n * 4 + k // group * n // 8 * 4 + k // group * n * 2 + k * 4
        else:
            total += math.prod(shape) * 2
    return total
