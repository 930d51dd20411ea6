"""The tiny models rig builds: deterministic bytes, the real architecture's shape, CPU limits, template."""

from __future__ import annotations

import json

import pytest

from rig.models.tiny import MANIFEST, TinySpec, build, verify


@pytest.mark.parametrize("arch", ["hybrid", "dense"])
def test_same_seed_gives_byte_identical_files(tmp_path, arch):
    a = build(TinySpec(arch=arch), tmp_path / "a")
    b = build(TinySpec(arch=arch), tmp_path / "b")
    ma, mb = (json.loads((d / MANIFEST).read_text()) for d in (a, b))
    assert ma["files"] == mb["files"] and len(ma["files"]) >= 6
    c = build(TinySpec(arch=arch, seed=1), tmp_path / "c")
    assert json.loads((c / MANIFEST).read_text())["files"]["model.safetensors"] != ma["files"]["model.safetensors"]


def test_hybrid_has_the_real_layer_pattern_and_respects_cpu_limits(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["linear_key_head_dim"] >= 64 and cfg["linear_value_head_dim"] >= 64  # CPU GDN kernel
    assert 2 * cfg["linear_num_value_heads"] >= 16  # in_proj_ba output: every Linear >= 16 on CPU
    assert cfg["head_dim"] == 256 and cfg["num_attention_heads"] > cfg["num_key_value_heads"]
    assert cfg["mtp_num_hidden_layers"] == 1
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "mtp.fc.weight" in keys and any(k.startswith("mtp.layers.0.self_attn.") for k in keys)
    assert any(".linear_attn.in_proj_qkv." in k for k in keys)


def test_a_tampered_file_fails_verification(tmp_path):
    folder = build(TinySpec(), tmp_path / "m")
    assert verify(folder)
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    assert not verify(folder)


def test_chat_template_renders_qwen_xml_tool_calls(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert '"name": "get_weather"' in text
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    assert call in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for marker in ("<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>"):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
