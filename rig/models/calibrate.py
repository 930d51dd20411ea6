"""INT8_LAYERS calibration: which linears tolerate int8 activations (W4A8 Marlin), measured, not guessed.

rig runs calibration windows (the ones ``inv model.quantize`` cuts from rig's corpus for a recipe:
``quantize.calibration_ids``) through the 16-bit model with transformers, and a forward hook on every
``nn.Linear`` of the decoder layers records, per linear:

- the input's absmax and per-channel absmax, and its outlier channels — rule: a channel whose absmax
  exceeds ``OUTLIER_FACTOR`` (6) times the median channel absmax of that input;
- the input's int8 error: ‖x − dequant(quant(x))‖ / ‖x‖ over all calibration tokens, with the
  quantizer vLLM 0.28's Marlin INT8_ACT path runs (``marlin_utils.marlin_quant_input`` →
  ``int8_utils.per_token_quant_int8``): symmetric, one scale per token, scale = max(absmax, 1e-10) / 127,
  round half away from zero (``libdevice.round``), no zero point;
- the output's error: ‖x·Wᵀ − dequant(quant(x))·Wᵀ‖ / ‖x·Wᵀ‖ — what the int8 activations cost at the
  layer's output (W is the 16-bit weight: the int4 rounding is the same with and without INT8_ACT).

Linears are grouped the way vLLM names them (``model.layers.N.mlp.gate_up_proj`` is HF's gate_proj and
up_proj: one input, one Marlin call), because INT8_LAYERS regexes are searched in vLLM's layer prefixes.
The recipe's 16-bit layers (``keep_16bit``: GDN's in_proj_a/b, the MTP layer) are left out — Marlin
never runs them. Layers are ranked by output error; each INT8_LAYERS preset (``rig.knobs.INT8_LAYER_ALIASES``)
is evaluated on the layers it selects; the recommendation is the preset selecting the most layers whose
max output error stays within ``--max-error`` (default ``DEFAULT_MAX_ERROR``), else an explicit regex of
the layers within it, else none (INT8_ACT off).

Same model and windows → byte-identical JSON: float32, one CPU thread, deterministic algorithms, floats
rounded to 6 significant digits, sorted keys, no timing in the file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rig import knobs
from rig.atomic import write_json
from rig.models import quantize

OUTLIER_FACTOR = 6.0
DEFAULT_MAX_ERROR = 0.02
DEFAULT_RECIPE = "w4a16-autoround"
TOP_OUTLIERS = 8
# vLLM 0.28's packed_modules_mapping of Qwen3_5ForCausalLM / Qwen3ForCausalLM, HF member -> vLLM layer
# (tests/test_model_calibrate.py checks it against vLLM itself).
PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
          "in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz",
          "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba"}
DECODER = re.compile(r"^model\.layers\.\d+\.")


class CalibrateError(ValueError):
    """Bad input to calibration; the message names the flag or the file."""


def max_error(value: str | float | None) -> float:
    """``--max-error``: a relative output error in (0, 1]; CalibrateError naming the flag otherwise."""
    if value is None or value == "":
        return DEFAULT_MAX_ERROR
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise CalibrateError(f"--max-error {value!r}: not a number; a relative error in (0, 1], "
                             f"default {DEFAULT_MAX_ERROR}") from None
    if not 0 < v <= 1:
        raise CalibrateError(f"--max-error {value!r}: out of range; a relative error in (0, 1], "
                             f"default {DEFAULT_MAX_ERROR}")
    return v


def vllm_name(hf_name: str) -> str:
    """The vLLM layer prefix an HF linear is loaded into (merged projections share one)."""
    head, _, leaf = hf_name.rpartition(".")
    return f"{head}.{PACKED.get(leaf, leaf)}"


def quant_dequant_int8(x):
    """Symmetric per-token int8 round trip, as vLLM's ``per_token_quant_int8`` kernel does it (float32)."""
    import torch

    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 127
    q = x / scale
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)
    return q * scale


@dataclass
class LayerStats:
    """Running sums for one vLLM layer over every calibration token (members share one input)."""

    members: list[str] = field(default_factory=list)
    in_features: int = 0
    channel_absmax: object = None
    in_err2: float = 0.0
    in_ref2: float = 0.0
    out_err2: float = 0.0
    out_ref2: float = 0.0
    tokens: int = 0

    def add_input(self, x) -> None:
        """Input statistics of one forward (counted once per layer, not per member)."""
        import torch

        amax = x.abs().amax(dim=0)
        self.channel_absmax = amax if self.channel_absmax is None else torch.maximum(self.channel_absmax, amax)
        self.in_err2 += float((x - quant_dequant_int8(x)).pow(2).sum())
        self.in_ref2 += float(x.pow(2).sum())
        self.tokens += x.shape[0]

    def add_output(self, x, weight) -> None:
        """One member's output error; summed over members it is the merged layer's (concatenated output)."""
        y = x @ weight.T
        yq = quant_dequant_int8(x) @ weight.T
        self.out_err2 += float((y - yq).pow(2).sum())
        self.out_ref2 += float(y.pow(2).sum())

    def summary(self) -> dict:
        """The layer's row of the report (unrounded)."""
        amax = self.channel_absmax
        median = float(amax.median())
        outliers = (amax > OUTLIER_FACTOR * median).nonzero().flatten().tolist()
        top = sorted(outliers, key=lambda c: (-float(amax[c]), c))[:TOP_OUTLIERS]
        return {
            "members": sorted(self.members), "in_features": self.in_features, "tokens": self.tokens,
            "absmax": float(amax.max()), "median_channel_absmax": median,
            "outlier_channels": len(outliers), "top_outlier_channels": top,
            "top_outlier_ratio": float(amax[top[0]] / median) if top and median > 0 else 0.0,
            "input_error": (self.in_err2 / self.in_ref2) ** 0.5 if self.in_ref2 else 0.0,
            "output_error": (self.out_err2 / self.out_ref2) ** 0.5 if self.out_ref2 else 0.0,
        }


def _targets(model, keep_16bit: list[str]) -> dict[str, object]:
    """The decoder layers' linears Marlin would run (HF name -> module); 16-bit-kept ones left out."""
    import torch

    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and DECODER.match(n) and not any(f in n for f in keep_16bit)}


def _hook(stats: LayerStats, name: str, first: bool):
    """A forward hook adding one linear's input (if it is the group's first member) and output figures."""
    def hook(module, inputs, _output) -> None:
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
        if first:
            stats.add_input(x)
        stats.add_output(x, module.weight.detach().float())
    return hook


def collect(model, windows: list[list[int]], keep_16bit: list[str]) -> dict[str, dict]:
    """Run every window through ``model`` with hooks on; returns vLLM layer name -> summary."""
    import torch

    stats: dict[str, LayerStats] = {}
    handles = []
    for name, mod in _targets(model, keep_16bit).items():
        layer = vllm_name(name)
        first = layer not in stats
        s = stats.setdefault(layer, LayerStats(in_features=mod.in_features))
        s.members.append(name)
        handles.append(mod.register_forward_hook(_hook(s, name, first)))
    dev = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for ids in windows:
                model(input_ids=torch.tensor([ids], device=dev), attention_mask=None, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if not stats:
        raise CalibrateError("no decoder-layer nn.Linear found (model.layers.N.*): not a decoder model rig knows")
    return {name: s.summary() for name, s in stats.items()}


def preset_rows(layers: dict[str, dict]) -> dict[str, dict]:
    """Each INT8_LAYERS preset: its regex, the layers it selects, their mean and max output error."""
    rows = {}
    for preset, regex in knobs.INT8_LAYER_ALIASES.items():
        chosen = sorted(n for n in layers if re.search(regex, n))
        errs = [layers[n]["output_error"] for n in chosen]
        rows[preset] = {"regex": regex, "layers": chosen, "count": len(chosen),
                        "mean_output_error": sum(errs) / len(errs) if errs else 0.0,
                        "max_output_error": max(errs, default=0.0)}
    return rows


def explicit_regex(names: list[str]) -> str:
    """A regex selecting exactly ``names`` when searched in vLLM prefixes (end-anchored: layers.1 != layers.11)."""
    return "(?:" + "|".join(re.escape(n) for n in sorted(names)) + ")$"


def recommend(layers: dict[str, dict], presets: dict[str, dict], limit: float) -> dict:
    """The INT8_LAYERS to use: the widest preset within ``limit``, else an explicit regex, else none."""
    ok = [p for p, row in presets.items() if row["count"] and row["max_output_error"] <= limit]
    if ok:
        best = max(ok, key=lambda p: (presets[p]["count"], p))
        return {"INT8_LAYERS": best, "kind": "preset", "layers": presets[best]["layers"],
                "why": f"the preset selecting the most layers ({presets[best]['count']}) whose max output error "
                       f"{presets[best]['max_output_error']:.4g} <= --max-error {limit:g}"}
    within = sorted(n for n, row in layers.items() if row["output_error"] <= limit)
    if within:
        return {"INT8_LAYERS": explicit_regex(within), "kind": "regex", "layers": within,
                "why": f"no preset stays within --max-error {limit:g}; the {len(within)} of {len(layers)} "
                       "layers that do, by name"}
    return {"INT8_LAYERS": None, "kind": "none", "layers": [],
            "why": f"no layer stays within --max-error {limit:g}: keep INT8_ACT off"}


def _round(v):
    """Floats to 6 significant digits, recursively: what makes the JSON byte-stable."""
    if isinstance(v, float):
        return float(f"{v:.6g}")
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_round(x) for x in v]
    return v


@contextmanager
def _deterministic() -> Iterator[str]:
    """Fixed seed, deterministic algorithms and (on CPU) one thread, restored afterwards; yields the device.

    One thread because a CPU reduction's order depends on the thread count; restoring keeps the caller's
    process (a test session, another task) as it was.
    """
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    rng = torch.random.get_rng_state()
    dev = quantize.device()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    if dev == "cpu":
        torch.set_num_threads(1)
    try:
        yield dev
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
        torch.random.set_rng_state(rng)


def _load(src: Path, dev: str):
    """The model in float32 (statistics in full precision) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(dev)
    model.eval()
    return model, tok


def calibrate(model: str, recipe_ref: str = DEFAULT_RECIPE, limit: float = DEFAULT_MAX_ERROR,
              nsamples: int = 0, seqlen: int = 0) -> dict:
    """The report for ``model`` (a folder or tiny:hybrid / tiny:dense) on the recipe's calibration windows.

    ``nsamples`` / ``seqlen`` > 0 override the recipe's (a shorter run on the same corpus, from its start).
    """
    path = quantize.recipe_file(recipe_ref)
    recipe = quantize.load_recipe(path)
    if nsamples < 0:
        raise CalibrateError(f"--nsamples {nsamples}: 0 (the recipe's) or a count of windows >= 1")
    if seqlen < 0 or 0 < seqlen < 16:
        raise CalibrateError(f"--seqlen {seqlen}: 0 (the recipe's) or tokens per window >= 16")
    recipe = recipe.model_copy(update={"nsamples": nsamples or recipe.nsamples, "seqlen": seqlen or recipe.seqlen})
    src = quantize.source_folder(model)
    with _deterministic() as dev:
        net, tok = _load(src, dev)
        windows = quantize.calibration_ids(recipe, tok)
        layers = collect(net, windows, recipe.keep_16bit)
    presets = preset_rows(layers)
    ranked = sorted(layers, key=lambda n: (-layers[n]["output_error"], n))
    report = {
        "model": {"path": quantize._display(src), "sha256": quantize.model_digest(quantize.folder_files(src))},
        "prompts": {"recipe": quantize._display(path), "corpus_seed": recipe.calibration.seed,
                    "nsamples": recipe.nsamples, "seqlen": recipe.seqlen, "tokens": recipe.nsamples * recipe.seqlen},
        "method": {"device": dev, "dtype": "float32",
                   "activation_quant": "int8, symmetric, per token: scale = max(absmax, 1e-10)/127, round half "
                                       "away from zero (vLLM 0.28 marlin_quant_input -> per_token_quant_int8)",
                   "outlier_rule": f"channel absmax > {OUTLIER_FACTOR:g} x the median channel absmax",
                   "left_out": recipe.keep_16bit, "max_error": limit},
        "layers": {n: {**layers[n], "rank": i + 1} for i, n in enumerate(ranked)},
        "presets": presets,
        "recommended": recommend(layers, presets, limit),
    }
    return _round(report)


def write(report: dict, out: Path) -> Path:
    """The report as JSON with sorted keys (same model and prompts -> same bytes), atomically."""
    return write_json(out, report, sort_keys=True)
