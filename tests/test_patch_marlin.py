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
    assert marlin_utils.get_marlin_input_dtype() == torch.int8  # MoE / helpers call without a prefix
    assert marlin_utils.get_marlin_input_dtype("") == torch.int8


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
