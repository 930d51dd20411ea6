"""marlin-int8-layer-select on the real (patched) vLLM: which layers get int8 activations.

The selection is checked over the real 27B model's linear layer prefixes (64 layers, 3 Gated
DeltaNet : 1 full attention, plus lm_head and the MTP block), with and without the
``language_model.`` prefix of the VL checkpoint, for each INT8_LAYERS value the profiles use.

The INC (AutoRound) W4A16 path is driven through vLLM's own INCConfig / scheme factory for a
GPTQ-packed auto-round config. What cannot be constructed on this CPU and is therefore not
exercised: ``create_weights`` (needs an initialised tensor-parallel group) and the Marlin GPU
kernel itself (CUDA SM >= 80); on CPU the GPTQ method picks CPUWNA16LinearKernel. The test
checks the input dtype the method carries, which is what Marlin's ``MPLinearLayerConfig.act_type``
is built from in ``AutoGPTQLinearMethod.create_weights``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rig import patches
from rig.knobs import INT8_LAYER_ALIASES

patches.ensure_applied()

from vllm.model_executor.layers.quantization.utils import marlin_utils  # noqa: E402

N_LAYERS = 64


def layer_names(lm_prefix: str) -> list[str]:
    """Linear layer prefixes of the real model (as vLLM names them when building the layers)."""
    names = []
    for i in range(N_LAYERS):
        base = f"{lm_prefix}model.layers.{i}"
        if i % 4 == 3:
            names += [f"{base}.self_attn.qkv_proj", f"{base}.self_attn.o_proj"]
        else:
            names += [f"{base}.linear_attn.in_proj_qkvz", f"{base}.linear_attn.out_proj"]
        names += [f"{base}.mlp.gate_up_proj", f"{base}.mlp.down_proj"]
    names += [f"{lm_prefix}lm_head", "mtp.fc", "mtp.layers.0.self_attn.qkv_proj", "mtp.layers.0.self_attn.o_proj",
              "mtp.layers.0.mlp.gate_up_proj", "mtp.layers.0.mlp.down_proj"]
    return names


# INT8_LAYERS value -> (expected count per naming variant, predicate written independently)
CASES = {
    "mlp": (2 * N_LAYERS, lambda n: ".mlp." in n),
    "gate_up": (N_LAYERS, lambda n: n.endswith("mlp.gate_up_proj")),
    ".": (4 * N_LAYERS, lambda n: True),
    "linear_attn": (2 * 48 + 0, lambda n: ".linear_attn." in n),
    "self_attn": (2 * 16, lambda n: ".self_attn." in n),
}


def selected(names: list[str]) -> list[str]:
    return [n for n in names if marlin_utils.get_marlin_input_dtype(n) == torch.int8]


@pytest.fixture
def int8(monkeypatch):
    for k in ("VLLM_MARLIN_INT8_INCLUDE_RE", "VLLM_MARLIN_INT8_EXCLUDE_RE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("VLLM_MARLIN_INPUT_DTYPE", "int8")
    return monkeypatch


@pytest.mark.parametrize("lm_prefix", ["", "language_model."])
@pytest.mark.parametrize("value", list(CASES))
def test_selection_over_the_real_layer_names(int8, value, lm_prefix):
    int8.setenv("VLLM_MARLIN_INT8_INCLUDE_RE", INT8_LAYER_ALIASES.get(value, value))
    names = layer_names(lm_prefix)
    count, pred = CASES[value]
    got = selected(names)
    expected = [n for n in names if pred(n) and "lm_head" not in n and not n.startswith("mtp.")]
    assert got == expected
    assert len(got) == count
    assert not any("lm_head" in n or n.startswith("mtp.") for n in got)  # default exclude lm_head|mtp


def test_without_input_dtype_nothing_changes(monkeypatch):
    monkeypatch.delenv("VLLM_MARLIN_INPUT_DTYPE", raising=False)
    monkeypatch.setenv("VLLM_MARLIN_INT8_INCLUDE_RE", ".")
    assert all(marlin_utils.get_marlin_input_dtype(n) is None for n in layer_names(""))


def test_exclude_can_be_emptied_and_no_prefix_keeps_global_behaviour(int8):
    int8.setenv("VLLM_MARLIN_INT8_EXCLUDE_RE", "")
    assert len(selected(layer_names(""))) == len(layer_names(""))  # lm_head and mtp too
    int8.setenv("VLLM_MARLIN_INT8_INCLUDE_RE", "gate_up")
    assert marlin_utils.get_marlin_input_dtype() == torch.int8  # fp8/fp4 Marlin helpers call without a prefix
    assert marlin_utils.get_marlin_input_dtype("") == torch.int8


# DeepSeek / GLM-style MTP layers: vLLM names them model.layers.<num_hidden_layers>.* (the head
# model.layers.<N>.head, checkpoint ...shared_head.head), like a main layer: the default exclude
# does not see them (documented in the patch header and docs/patches.md); an explicit one does.
DEEPSEEK_MTP = ["model.layers.61.mlp.experts", "model.layers.61.self_attn.o_proj", "model.layers.61.head",
                "model.layers.61.shared_head.head"]


def test_deepseek_style_mtp_names_escape_the_default_exclude_but_not_an_explicit_one(int8):
    assert all(marlin_utils.get_marlin_input_dtype(n) == torch.int8 for n in DEEPSEEK_MTP)
    int8.setenv("VLLM_MARLIN_INT8_EXCLUDE_RE", r"lm_head|mtp|^model\.layers\.61\.")
    assert all(marlin_utils.get_marlin_input_dtype(n) is None for n in DEEPSEEK_MTP)
    assert marlin_utils.get_marlin_input_dtype("model.layers.60.mlp.experts") == torch.int8


def test_a_bad_regex_names_the_knob(int8):
    int8.setenv("VLLM_MARLIN_INT8_INCLUDE_RE", "mlp(")
    with pytest.raises(ValueError, match=r"VLLM_MARLIN_INT8_INCLUDE_RE='mlp\(' is not a valid"):
        marlin_utils.get_marlin_input_dtype("model.layers.0.mlp.gate_up_proj")


def _inc_linear_inner_method(prefix: str):
    """vLLM's INC scheme for a W4A16 AutoRound (GPTQ-packed, symmetric) layer config."""
    from vllm.model_executor.layers.quantization.inc.inc import INCConfig
    from vllm.model_executor.layers.quantization.inc.schemes.factory import resolve_scheme

    cfg = INCConfig.from_config({"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True,
                                 "packing_format": "auto_round:auto_gptq"})
    layer = torch.nn.Module()
    layer_config = cfg.config_parser.resolve(layer, prefix)
    assert layer_config.is_gptq and layer_config.bits == 4 and layer_config.quantized
    method = resolve_scheme(layer_config).get_linear_method(cfg, layer, prefix, layer_config)
    return method.scheme.inner_method


def test_inc_autoround_path_honours_input_dtype_per_layer(int8):
    int8.setenv("VLLM_MARLIN_INT8_INCLUDE_RE", INT8_LAYER_ALIASES["gate_up"])
    inner = _inc_linear_inner_method("model.layers.0.mlp.gate_up_proj")
    assert type(inner).__name__ == "AutoGPTQLinearMethod"
    assert inner.input_dtype == torch.int8  # 0.28.0 leaves it None: INT8_ACT silently ignored
    assert _inc_linear_inner_method("model.layers.0.mlp.down_proj").input_dtype is None  # not selected
    assert _inc_linear_inner_method("lm_head").input_dtype is None  # excluded by default


def test_inc_autoround_path_without_input_dtype_stays_16_bit(monkeypatch):
    monkeypatch.delenv("VLLM_MARLIN_INPUT_DTYPE", raising=False)
    assert _inc_linear_inner_method("model.layers.0.mlp.gate_up_proj").input_dtype is None


# ------------------------------------------------------------------------------------------
# MoE: the method's dtype (which decides the weight repack and int8 scale processing) and the
# Marlin kernel's must agree per layer. 0.28.0's MarlinExpertsBase read the global setting, so
# an experts layer the regexes leave out got 16-bit weights run with int8 activations.

EXPERTS = ["model.layers.0.mlp.experts", "language_model.model.layers.5.mlp.experts", "mtp.layers.0.mlp.experts"]


def _moe_config():
    """vLLM's FusedMoEConfig for a small 4-expert layer, built on CPU (no distributed state)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    pc = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=1, ep_size=1, tp_rank=0, pcp_rank=0, dp_rank=0,
                                ep_rank=0, sp_size=1, use_ep=False, all2all_backend="naive", enable_eplb=False)
    return FusedMoEConfig(num_experts=4, experts_per_token=2, hidden_dim=256, intermediate_size=256,
                          num_local_experts=4, num_logical_experts=4, activation=MoEActivation.SILU, device="cpu",
                          routing_method=RoutingMethodType.Renormalize, moe_parallel_config=pc,
                          in_dtype=torch.bfloat16)


def _backend_oracle_as_on_a_gpu(monkeypatch) -> None:
    """vLLM's WNA16 MoE oracle offers x86 CPUs no backend at all (CPUExpertsInt4 is Arm-only), so
    AutoGPTQMoEMethod's constructor raises on any x86 host; on a CUDA GPU it picks Marlin. Answer
    that one question as a GPU would: the method and kernel code under test are vLLM's own."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
    from vllm.model_executor.layers.quantization import auto_gptq

    monkeypatch.setattr(auto_gptq, "select_wna16_moe_backend",
                        lambda *a, **k: (WNA16MoEBackend.MARLIN, MarlinExperts))


def _marlin_kernel_of(method, moe_config) -> torch.dtype | None:
    """Build the method's kernel as on a CUDA GPU (the oracle picks Marlin there; on CPU it
    picks CPUExpertsInt4): vLLM's own _setup_kernel -> make_wna16_moe_kernel -> MarlinExperts."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    method.experts_cls, method.wna16_moe_backend, method.is_k_full = MarlinExperts, WNA16MoEBackend.MARLIN, True
    layer = torch.nn.Module()
    layer.moe_config = moe_config
    layer.w13_scales, layer.w2_scales = torch.ones(4, 2, 512), torch.ones(4, 2, 256)
    layer._expert_routing_tables = lambda: None
    method._setup_kernel(layer)
    assert type(method.moe_kernel.fused_experts) is MarlinExperts
    return method.moe_kernel.fused_experts.input_dtype


def _inc_moe_method(prefix: str, monkeypatch):
    """vLLM's INC scheme's MoE method for a W4A16 AutoRound (GPTQ-packed) experts layer. INC
    returns an unquantized method on CPU before anything else; its platform check is the one
    thing answered as on a GPU here, with the backend oracle (_backend_oracle_as_on_a_gpu)."""
    import types

    from vllm.model_executor.layers.quantization.inc.inc import INCConfig
    from vllm.model_executor.layers.quantization.inc.schemes import inc_wna16_scheme
    from vllm.model_executor.layers.quantization.inc.schemes.factory import resolve_scheme

    monkeypatch.setattr(inc_wna16_scheme, "current_platform", types.SimpleNamespace(is_cpu=lambda: False))
    _backend_oracle_as_on_a_gpu(monkeypatch)
    cfg = INCConfig.from_config({"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True,
                                 "packing_format": "auto_round:auto_gptq"})
    layer = torch.nn.Module()
    layer.moe_config = _moe_config()
    layer_config = cfg.config_parser.resolve(layer, prefix)
    method = resolve_scheme(layer_config).get_moe_method(cfg, layer, prefix, layer_config)
    assert type(method).__name__ == "AutoGPTQMoEMethod"
    return method, layer.moe_config


@pytest.mark.parametrize("include", ["gate_up", "mlp", "experts"])
def test_inc_moe_method_and_its_marlin_kernel_agree_per_layer(int8, include):
    int8.setenv("VLLM_MARLIN_INT8_INCLUDE_RE", INT8_LAYER_ALIASES.get(include, include))
    for prefix in EXPERTS:
        method, moe_config = _inc_moe_method(prefix, int8)
        expected = marlin_utils.get_marlin_input_dtype(prefix)  # selected: int8; else None
        assert method.input_dtype == expected, prefix  # 0.28.0: always None (INT8_ACT ignored)
        assert _marlin_kernel_of(method, moe_config) == expected, prefix  # 0.28.0: always int8
    selected_any = [p for p in EXPERTS if marlin_utils.get_marlin_input_dtype(p) is not None]
    assert bool(selected_any) == (include != "gate_up")  # gate_up selects no experts layer
    assert "mtp.layers.0.mlp.experts" not in selected_any  # default exclude


def test_gptq_moe_method_and_its_marlin_kernel_agree_per_layer(int8):
    """AutoGPTQConfig.get_quant_method gives the MoE method get_marlin_input_dtype(prefix); its
    kernel must be built with it, not with the global setting."""
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig, AutoGPTQMoEMethod

    int8.setenv("VLLM_MARLIN_INT8_INCLUDE_RE", "layers\\.0\\.")
    _backend_oracle_as_on_a_gpu(int8)
    for prefix, expected in [("model.layers.0.mlp.experts", torch.int8), ("model.layers.1.mlp.experts", None)]:
        moe_config = _moe_config()
        cfg = AutoGPTQConfig(weight_bits=4, group_size=128, desc_act=False, is_sym=True, lm_head_quantized=False,
                             dynamic={}, full_config={})
        method = AutoGPTQMoEMethod(cfg, moe_config)
        method.input_dtype = marlin_utils.get_marlin_input_dtype(prefix)  # what get_quant_method sets
        assert method.input_dtype == expected
        assert _marlin_kernel_of(method, moe_config) == expected, prefix


def test_without_input_dtype_the_moe_kernel_stays_16_bit(monkeypatch):
    monkeypatch.delenv("VLLM_MARLIN_INPUT_DTYPE", raising=False)
    method, moe_config = _inc_moe_method("model.layers.0.mlp.experts", monkeypatch)
    assert method.input_dtype is None and _marlin_kernel_of(method, moe_config) is None


def test_every_wna16_moe_method_builds_its_kernel_with_the_dtype_it_converts_for():
    """In vLLM's source: each function that builds a WNA16 MoE kernel (make_wna16_moe_kernel)
    belongs to a class whose weight conversion (convert_to_wna16_moe_kernel_format) uses an
    input_dtype; the kernel gets that same expression (compressed-tensors, GPTQ, AWQ), or the
    conversion uses None and the kernel gets the default None (MoeWNA16)."""
    import ast

    import vllm

    root = Path(vllm.__file__).parent / "model_executor"
    seen = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        if "make_wna16_moe_kernel(" not in text or "def make_wna16_moe_kernel" in text:
            continue
        for cls in [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)]:
            calls = [c for c in ast.walk(cls) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
            converts = [c for c in calls if c.func.id == "convert_to_wna16_moe_kernel_format"]
            makes = [c for c in calls if c.func.id == "make_wna16_moe_kernel"]
            if not makes:
                continue
            assert len(converts) == 1, (path.name, cls.name)
            converted = ast.unparse(next(k.value for k in converts[0].keywords if k.arg == "input_dtype"))
            for make in makes:
                given = [ast.unparse(k.value) for k in make.keywords if k.arg == "input_dtype"]
                for k in make.keywords:  # **marlin_args: a dict literal assigned in the class
                    if k.arg is None:
                        given += [ast.unparse(v) for d in ast.walk(cls) if isinstance(d, ast.Dict)
                                  for key, v in zip(d.keys, d.values, strict=True)
                                  if isinstance(key, ast.Constant) and key.value == "input_dtype"]
                assert given == [converted] or (converted == "None" and not given), (path.name, cls.name, given)
            seen.append(cls.name)
    assert {"AutoGPTQMoEMethod", "AutoAWQMoEMethod", "MoeWNA16Method"} <= set(seen)
    assert any(n.startswith("CompressedTensorsWNA16") for n in seen), seen
