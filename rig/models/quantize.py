"""W4A16 with auto-round from a recipe file: the real checkpoint's format, made by rig.

A recipe (``models/recipes/<name>.toml``) fixes everything that shapes the output: bits, group,
symmetry, auto-round's iterations (0 = round to nearest), the calibration samples (cut from rig's
generated corpus, ``rig.models.corpus``), the export format and the layers kept at 16 bits. The
export is ``auto_round:auto_gptq`` — what vLLM 0.28 loads through its INC path (onto GPTQ-Marlin
on a GPU, onto its CPU W4A16 kernel on a CPU) — symmetric int4 only, because W4A8 Marlin
(INT8_ACT) reads the weights as ``uint4b8`` and asserts on zero points.

The hybrid's tuned mode (``iters > 0``, and auto-round's optimized RTN) failed on Qwen3.5 with
"Expected attn_mask dtype to be bool or float ... got long int". Cause: auto-round records the
keyword arguments of the *first* decoder block once and replays them into every block. Qwen3.5's
first block is a Gated DeltaNet layer, whose ``attention_mask`` is the 2-D padding mask (int64)
that ``create_recurrent_attention_mask`` returns, and auto-round always hands the model such a mask
for a list of calibration samples (it zeroes each sample's last position, so the mask is never all
ones). Replayed into the first full-attention block, that 2-D int64 mask reaches SDPA. rig feeds
auto-round samples of exactly ``seqlen`` tokens, unpadded, each with ``attention_mask=None``:
auto-round then passes no mask of its own, both of Qwen3.5's mask builders return None, the GDN
layers run unmasked (nothing is padding) and SDPA runs causal — correct for every block type,
without patching auto-round.

Atomic: the export is written into a hidden ``.<out>.partial`` folder beside ``--out`` and renamed
only after the output was checked (config, keep-16-bit layers) and its record written; an
interrupted run leaves only the partial folder, which has no record and is removed by the next run.
The record (``rig-model.json``) holds the recipe, the auto-round / torch / transformers versions,
the input model's hash, the timing and the sha256 of every output file (``serve``'s preflight and
``inv verify`` check them).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from rig import paths, tomlfile
from rig.atomic import write_json
from rig.models import corpus, tiny

RECIPES = paths.ROOT / "models" / "recipes"
RECORD = tiny.MANIFEST
FORMAT = "auto_round:auto_gptq"
SYM_REASON = ("sym = false: refused — W4A8 Marlin (INT8_ACT) needs symmetric int4 weights (uint4b8); "
              "asymmetric zero points hit its assert")


class QuantizeError(ValueError):
    """A recipe, a model or an output that cannot be used; the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Calibration(_Strict):
    """Where the calibration samples come from."""

    source: Literal["corpus"] = Field(description=(
        "`corpus`: rig's generated text (rig.models.corpus: English, German, Python, chat, tool calls), "
        "tokenized by the model's own tokenizer and cut into nsamples windows of seqlen tokens"))
    seed: int = Field(description=(
        "corpus seed; must differ from every corpus seed of quality/perplexity.toml (those sets are held out)"))


class Recipe(_Strict):
    """One quantization recipe: everything that shapes the output's bytes."""

    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["quantize"] = Field(description="file kind")
    description: str = Field(min_length=1, description="one line: what the recipe is for")
    bits: Literal[4] = Field(description="weight bits; rig serves W4A16 (and W4A8 from it), so 4")
    group_size: Literal[32, 64, 128] = Field(
        description="weights per scale along the input dimension (the group sizes Marlin runs)")
    sym: bool = Field(description="symmetric int4; must be true (W4A8 Marlin needs it)")
    iters: int = Field(ge=0, description="auto-round's tuning steps per block; 0 = round to nearest (RTN)")
    opt_rtn: bool = Field(description=(
        "iters = 0 only: auto-round's optimized RTN (an importance matrix from the calibration samples) "
        "instead of plain round to nearest; must be false when iters > 0"))
    nsamples: int = Field(ge=1, description="calibration samples")
    seqlen: int = Field(ge=16, description="tokens per calibration sample")
    batch_size: int = Field(ge=1, description="calibration samples per tuning step")
    calibration: Calibration = Field(description="where the samples come from")
    format: Literal["auto_round:auto_gptq"] = Field(description=(
        "export format: auto-round's `auto_round` export with GPTQ packing, loaded by vLLM 0.28's INC path"))
    keep_16bit: list[str] = Field(description=(
        "module-name fragments kept at 16 bits (auto-round's ignore_layers; checked in the output): the "
        "embeddings, lm_head, the MTP layer and GDN's in_proj_a/in_proj_b, as the real checkpoint keeps them"))
    seed: int = Field(description="auto-round's seed (sample order and rounding initialisation)")

    @field_validator("sym")
    @classmethod
    def _symmetric(cls, v: bool) -> bool:
        if not v:
            raise ValueError(SYM_REASON)
        return v

    @field_validator("opt_rtn")
    @classmethod
    def _opt_rtn_only_for_rtn(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("iters", 0) > 0:
            raise ValueError("opt_rtn = true applies only with iters = 0 (tuned mode has no RTN step)")
        return v


def recipe_names() -> list[str]:
    """The quantization recipes shipped in models/recipes/ (file stems, sorted); the folder also holds train
    recipes (``kind = "train"``, rig.models.train), which are not listed."""
    import tomllib

    def kind(path: Path) -> str | None:
        try:
            return tomllib.loads(path.read_text()).get("kind")
        except (OSError, tomllib.TOMLDecodeError):
            return "quantize"  # listed, so that loading it names what is wrong with it
    return sorted(p.stem for p in RECIPES.glob("*.toml") if kind(p) == "quantize")


def recipe_file(ref: str) -> Path:
    """A recipe path, or the name of a file in models/recipes/; QuantizeError naming it when there is none."""
    path = Path(ref)
    if not path.suffix and not path.exists():
        path = RECIPES / f"{ref}.toml"
    if not path.is_file():
        raise QuantizeError(f"recipe {ref!r}: no such file; shipped recipes: {', '.join(recipe_names())}")
    return path


def _held_out_seeds() -> set[int]:
    """Corpus seeds of the perplexity sets: calibrating on them would tune the model to its own test text."""
    from rig.quality import suite

    return {s.seed for s in suite.load("perplexity").sets.values() if s.source == "corpus" and s.seed is not None}


def load_recipe(path: Path) -> Recipe:
    """Parse and validate a recipe file; QuantizeError naming the file and each bad key."""
    data = tomlfile.read(path, QuantizeError, str(path))
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(file)"
            lines.append(f"{path}: key {key!r}: {err['msg'].removeprefix('Value error, ')}")
        raise QuantizeError("\n".join(lines)) from None
    if recipe.calibration.seed in _held_out_seeds():
        raise QuantizeError(f"{path}: key 'calibration.seed': {recipe.calibration.seed} is the seed of a held-out "
                            "perplexity set in quality/perplexity.toml; pick another")
    return recipe


def calibration_ids(recipe: Recipe, tokenizer) -> list[list[int]]:
    """``nsamples`` windows of exactly ``seqlen`` token ids, consecutive from the start of the corpus.

    The corpus is generated with more lines per domain (doubling from 500) until it holds enough
    tokens; ``corpus.generate`` is deterministic, so the windows depend only on the recipe and the
    tokenizer. Unpadded, equal-length windows are what lets rig pass no attention mask (module doc).
    """
    need = recipe.nsamples * recipe.seqlen
    lines = 500
    while True:
        ids = tokenizer(corpus.generate(recipe.calibration.seed, lines_per_domain=lines),
                        add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) >= need:
            return [ids[i * recipe.seqlen:(i + 1) * recipe.seqlen] for i in range(recipe.nsamples)]
        lines *= 2


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def folder_files(folder: Path) -> dict[str, str]:
    """sha256 of every file of a model folder (sorted relative paths), the record's own file left out."""
    return {p.relative_to(folder).as_posix(): _sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != RECORD}


def model_digest(files: dict[str, str]) -> str:
    """One sha256 over a folder's (path, sha256) pairs: the input model's identity in the record."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def device() -> str:
    """Where auto-round tunes: the CUDA device when torch sees one, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def autoround_kwargs(recipe: Recipe, dev: str) -> dict:
    """AutoRound's keyword arguments for a recipe (the dataset is added by ``quantize``)."""
    return {
        "bits": recipe.bits, "group_size": recipe.group_size, "sym": recipe.sym, "iters": recipe.iters,
        "disable_opt_rtn": not recipe.opt_rtn, "nsamples": recipe.nsamples, "seqlen": recipe.seqlen,
        "batch_size": recipe.batch_size, "seed": recipe.seed, "ignore_layers": ",".join(recipe.keep_16bit),
        "device_map": dev, "enable_deterministic_algorithms": True,
    }


def check_output(folder: Path, recipe: Recipe) -> dict:
    """The exported quantization_config, after checking what vLLM's INC path and W4A8 Marlin rely on.

    QuantizeError naming the key when the config differs from the recipe, when no linear was
    quantized, or when a module the recipe keeps at 16 bits was stored as int4.
    """
    cfg = json.loads((folder / "config.json").read_text())
    q = cfg.get("quantization_config")
    if not q:
        raise QuantizeError(f"{folder}/config.json: no quantization_config")
    want = {"quant_method": "auto-round", "packing_format": recipe.format, "bits": recipe.bits,
            "group_size": recipe.group_size, "sym": recipe.sym}
    for key, value in want.items():
        if q.get(key) != value:
            raise QuantizeError(f"{folder}/config.json: quantization_config.{key} = {q.get(key)!r}, expected {value!r}")
    names = _tensor_names(folder)
    packed = {n.removesuffix(".qweight") for n in names if n.endswith(".qweight")}
    if not packed:
        raise QuantizeError(f"{folder}: no int4 tensor (*.qweight) in the export")
    kept_int4 = sorted(m for m in packed for frag in recipe.keep_16bit if frag in m)
    if kept_int4:
        raise QuantizeError(f"{folder}: kept-16-bit modules stored as int4: {', '.join(kept_int4[:5])}")
    return q


def _tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names.update(f.keys())
    return names


def _load(src: Path):
    """The bf16 model and tokenizer from a checkpoint folder, on the CPU (auto-round moves blocks to its device)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.eval()
    return model, tok


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("auto-round", "torch", "transformers", "safetensors")}


def source_folder(model: str) -> Path:
    """``--model``: a checkpoint folder, or ``tiny:hybrid`` / ``tiny:dense`` (built when missing)."""
    if model.startswith("tiny:"):
        arch = model.split(":", 1)[1]
        if arch not in ("hybrid", "dense"):
            raise QuantizeError(f"--model {model!r}: unknown tiny model; allowed: tiny:hybrid, tiny:dense")
        return tiny.build(tiny.TinySpec(arch=arch))
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise QuantizeError(f"--model {model!r}: no checkpoint there (config.json missing)")
    if (folder / RECORD).is_file() and not tiny.verify(folder):
        raise QuantizeError(f"--model {model!r}: files differ from its {RECORD}; rebuild or re-fetch it")
    cfg = json.loads((folder / "config.json").read_text())
    if "quantization_config" in cfg:
        raise QuantizeError(f"--model {model!r}: already quantized ({cfg['quantization_config'].get('quant_method')}); "
                            "quantize the 16-bit checkpoint")
    return folder


def _partial(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial")


def quantize(recipe_path: Path, model: str, out: Path, log: Callable[[str], None] = print) -> Path:
    """Quantize ``model`` with the recipe into ``out`` (atomic); returns ``out``.

    QuantizeError when the recipe or model is unusable or ``out`` already exists (nothing is overwritten).
    """
    recipe = load_recipe(recipe_path)
    out = out.resolve()
    if out.exists():
        raise QuantizeError(f"--out {out}: already exists; remove it or choose another folder")
    src = source_folder(model)
    work = _partial(out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        record = _run(recipe, recipe_path, src, work, log)
        write_json(work / RECORD, record, sort_keys=True)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def _run(recipe: Recipe, recipe_path: Path, src: Path, work: Path, log: Callable[[str], None]) -> dict:
    """Load, calibrate, tune, export and check into ``work``; returns the record (without it written)."""
    import torch
    from auto_round import AutoRound

    t0 = time.monotonic()
    src_files = folder_files(src)
    model, tok = _load(src)
    t_load = time.monotonic() - t0
    samples = calibration_ids(recipe, tok)
    dataset = [{"input_ids": torch.tensor([ids]), "attention_mask": None} for ids in samples]
    dev = device()
    mode = "RTN" if recipe.iters == 0 else f"{recipe.iters} iterations"
    log(f"quantizing {src} with {recipe_path.name} on {dev}: {mode}, "
        f"{recipe.nsamples} x {recipe.seqlen} calibration tokens")
    t1 = time.monotonic()
    export = work / "export"
    ar = AutoRound(model, tok, dataset=dataset, **autoround_kwargs(recipe, dev))
    ar.quantize_and_save(str(export), format="auto_round")
    t_quant = time.monotonic() - t1
    _flatten(exported_folder(export), work)
    shutil.rmtree(export)
    q = check_output(work, recipe)
    timing = {"load_s": round(t_load, 2), "quantize_and_export_s": round(t_quant, 2),
              "total_s": round(time.monotonic() - t0, 2)}
    log(f"done in {timing['total_s']:.1f} s (load {timing['load_s']:.1f} s, auto-round quantize + export "
        f"{timing['quantize_and_export_s']:.1f} s)")
    return {
        "quantized": {
            "recipe": {"file": _display(recipe_path), "sha256": _sha256(recipe_path), "values": recipe.model_dump()},
            "source": {"path": str(src), "sha256": model_digest(src_files), "files": src_files},
            "versions": _versions(), "device": dev, "timing": timing,
            "quantization_config": q,
        },
        "files": folder_files(work),
    }


def exported_folder(export: Path) -> Path:
    """The one folder under ``export`` that auto-round wrote a config.json into.

    auto-round appends a name of its own (``<model>-w4g128``) to the folder it is given; rig finds it by
    looking, never from auto-round's return value, and refuses anything outside ``export``.
    """
    root = export.resolve()
    found = sorted({p.parent.resolve() for p in root.rglob("config.json")})
    if len(found) != 1 or not found[0].is_relative_to(root):
        raise QuantizeError(f"{export}: expected one exported checkpoint (config.json) inside it, found {found}")
    return found[0]


def _flatten(made: Path, work: Path) -> None:
    """Move the export's files up into ``work`` (both must be inside ``work``: nothing else is ever moved)."""
    root = work.resolve()
    if not (made.resolve().is_relative_to(root) and made.resolve() != root):
        raise QuantizeError(f"{made}: not inside {work}; refusing to move its files")
    for p in sorted(made.iterdir()):
        p.rename(root / p.name)


def _display(path: Path) -> str:
    try:
        return path.resolve().relative_to(paths.ROOT).as_posix()
    except ValueError:
        return str(path)


def record(folder: Path) -> dict:
    """The record of a quantized folder ({} when it has none)."""
    try:
        return json.loads((folder / RECORD).read_text()).get("quantized", {})
    except (OSError, ValueError):
        return {}

