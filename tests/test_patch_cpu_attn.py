"""cpu-attn-amx-off on the real (patched) vLLM: which CPU attention kernel `_get_attn_isa` picks, and when rig asks.

On an AMX host a W4A16 model's first request killed vLLM's CPU worker with SIGILL in the AMX attention
kernel (docs/patches.md). These tests drive vLLM's own `_get_attn_isa` with the host's AMX answer
replaced both ways, so they say the same on every CPU; `tests/test_model_quantize.py` serves W4A16
models live, which on an AMX host is the failure's own check.
"""

from __future__ import annotations

import json

import pytest

from rig import patches
from rig.plan import resolve

patches.ensure_applied()

import torch  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402


@pytest.fixture(params=[True, False], ids=["amx-host", "no-amx-host"])
def amx(request, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: request.param)
    return request.param


@pytest.mark.parametrize("knob", [None, "1", "0"])
def test_the_knob_at_0_chooses_as_a_host_without_amx_does(amx, knob, monkeypatch):
    monkeypatch.delenv("VLLM_RIG_CPU_ATTN_AMX", raising=False)
    if knob is not None:
        monkeypatch.setenv("VLLM_RIG_CPU_ATTN_AMX", knob)
    got = cpu_attn._get_attn_isa(torch.bfloat16, 64, 256)
    assert got == ("amx" if amx and knob != "0" else "vec")
    # what the knob does not touch: fp32, and blocks the AMX kernel never takes
    assert cpu_attn._get_attn_isa(torch.float32, 64, 256) == "vec"
    assert cpu_attn._get_attn_isa(torch.bfloat16, 48, 256) == "vec16"


def _model(tmp_path, quantized: bool):
    d = tmp_path / ("w4a16" if quantized else "bf16")
    d.mkdir()
    cfg = {"architectures": ["Qwen3_5ForCausalLM"]}
    if quantized:
        cfg["quantization_config"] = {"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True,
                                      "packing_format": "auto_round:auto_gptq"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("platform, quantized, asked", [
    ("cpu", True, True), ("cpu", False, False), ("gpu", True, False)])
def test_the_plan_asks_for_it_for_a_quantized_model_on_cpu_only(tmp_path, platform, quantized, asked):
    sets = {"MODEL": str(_model(tmp_path, quantized))}
    if platform == "gpu":
        sets["GPU_ARCH"] = "sm86"
    plan = resolve("batch", platform=platform, environ={}, sets=sets)
    assert ("cpu-attn-amx-off" in plan.patches) is asked
    assert ("cpu-wna16-dense-fallback" in plan.patches) is asked  # and the W4A16 fallback for an AVX2 build
    assert plan.env.get("VLLM_RIG_CPU_WNA16_DENSE") == ("1" if asked else None)
    assert plan.env.get("VLLM_RIG_CPU_ATTN_AMX") == ("0" if asked else None)
