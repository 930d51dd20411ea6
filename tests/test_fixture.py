"""Random-weight W4A16 fixtures of a real shape (rig.models.fixture): names, format, determinism, vLLM serving one."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from rig.models import fixture

REAL = fixture.FixtureSpec("qwen3.5-27b-class")
# The real shape with the sizes that make it cheap: same heads, head dims, GDN dims, group 128.
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "vocab_size": 4096,
         "max_position_embeddings": 4096}


def _cfg(spec: fixture.FixtureSpec) -> dict:
    return fixture.hf_config(spec, {"<|endoftext|>": 0, "<|im_end|>": 2})


def test_the_real_shape_has_the_published_layout_and_the_checkpoint_format():
    cfg = _cfg(REAL)
    assert cfg["layer_types"].count("linear_attention") == 48 and cfg["layer_types"].count("full_attention") == 16
    assert cfg["layer_types"][3] == "full_attention" and cfg["layer_types"][63] == "full_attention"
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["packing_format"], q["bits"], q["group_size"], q["sym"]) == \
        ("auto-round", "auto_round:auto_gptq", 4, 128, True)
    assert cfg["rig_fixture"]["warning"].startswith("benchmark fixture: random weights")
    names = dict(fixture.checkpoint_tensors(cfg))
    assert names["model.layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 48 * 128, 5120)
    assert names["model.layers.3.self_attn.q_proj.weight"] == (2 * 24 * 256, 5120)  # gated: query + gate
    assert names["lm_head.weight"] == (248320, 5120) and "mtp.fc.weight" in names
    quant = [n for n, s in names.items() if fixture.quantized(n, s, cfg)]
    # 48 GDN blocks x (qkv, z, out, gate, up, down) + 16 attention blocks x (q, k, v, o, gate, up, down)
    assert len(quant) == 48 * 6 + 16 * 7
    assert not any(n.startswith("mtp.") or "in_proj_a" in n or "in_proj_b" in n for n in quant)
    # 18.6 GB: int4 blocks + fp16 scales, bf16 embeddings, lm_head and MTP layer (16.8 GiB loaded without MTP)
    assert fixture.weights_bytes(REAL) == 18_637_686_784


def test_constant_initial_values_follow_transformers_own_init():
    """Where HF initialises a tensor to a constant (the tiny model is HF-initialised), the fixture has it."""
    import torch
    from safetensors.torch import load_file

    from rig.models.tiny import default_hybrid

    hf = load_file(str(default_hybrid() / "model.safetensors"))
    checked = 0
    for name, t in hf.items():
        if t.ndim == 1 and t.float().std() == 0:
            got = fixture._dense(0, name, tuple(t.shape))
            assert torch.equal(got, torch.full_like(got, t.float()[0].item())), name
            checked += 1
    assert checked >= 10
    a_log = fixture._dense(0, "model.layers.0.linear_attn.A_log", (48,)).float().exp()
    assert 1.0 <= a_log.min() and a_log.max() <= 16.1


def test_unknown_shape_and_override_are_named():
    with pytest.raises(fixture.FixtureError, match="model shape 'qwen9': no models/qwen9.toml; known: "):
        fixture.load_shape("qwen9")
    with pytest.raises(fixture.FixtureError, match=r"overrides \['hidden'\]: not keys of"):
        _cfg(fixture.FixtureSpec("qwen3.5-27b-class", overrides={"hidden": 1}))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return fixture.build(fixture.FixtureSpec("qwen3.5-27b-class", overrides=SMALL),
                         tmp_path_factory.mktemp("fx") / "small")


def test_same_spec_gives_byte_identical_files_and_tampering_is_caught(small, tmp_path):
    again = fixture.build(fixture.FixtureSpec("qwen3.5-27b-class", overrides=SMALL), tmp_path / "again")
    a = json.loads((small / fixture.MANIFEST).read_text())
    assert a == json.loads((again / fixture.MANIFEST).read_text()) and fixture.verify(again)
    assert a["fixture"]["warning"] == fixture.WARNING
    shard = next(again.glob("model-*.safetensors"))
    with shard.open("r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    assert not fixture.verify(again)
    index = json.loads((small / "model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.gate_proj.qweight" in index["weight_map"]
    assert "model.layers.0.linear_attn.in_proj_a.weight" in index["weight_map"]  # kept at 16 bit
    tok = json.loads((small / "tokenizer.json").read_text())
    ids = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok["added_tokens"]}
    assert ids == set(range(SMALL["vocab_size"]))  # every id the random lm_head can pick decodes


def test_vllm_loads_it_through_the_inc_path_and_generates(small, tmp_path):
    """vLLM 0.28 (CPU build) serves the W4A16 fixture: quantization=inc, --ignore-eos tokens come back. On a host
    whose vLLM CPU build has no W4A16 kernel (AVX2 only) it serves through the dense fallback (patch
    cpu-wna16-dense-fallback, which the plan asks for)."""
    from conftest import cpu_plan, start_server

    plan = cpu_plan("batch", tmp_path, MODEL=str(small), MAX_LEN="2048", KV_MEM="256M")
    assert "cpu-wna16-dense-fallback" in plan.patches
    server = start_server(plan, tmp_path)
    try:
        body = {"model": plan.served_name, "prompt": "Oslo", "max_tokens": 12, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        log = server.log_path.read_text()
        assert "quantization=inc" in log
    finally:
        server.stop()
