"""cpu-wna16-dense-fallback on the real (patched) vLLM: a W4A16 layer on a CPU build without `cpu_gemm_wna16`.

vLLM's AVX2 CPU ops build has no W4A16 linear kernel; with the patch, vLLM's own `CPUWNA16LinearKernel`
keeps such a layer's weight dequantized and multiplies densely. These tests run that kernel class on GPTQ-packed
random codes with the op hidden (so every host takes the fallback) and compare with the codes' values computed
here, independently; where the host's build has the op, its answer is the cross-check. `tests/test_model_quantize.py`
serves W4A16 models through it on an AVX2 host (the relative perplexity gate, with a broken export failing it).
"""

from __future__ import annotations

import pytest

from rig import patches
from rig.capacity import cpuisa

patches.ensure_applied()

import torch  # noqa: E402
from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel  # noqa: E402
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    pack_quantized_values_into_int32,
)
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.scalar_type import scalar_types  # noqa: E402

IN, OUT = 256, 64


class _Without:
    """torch.ops._C as a build without one op: what vLLM's AVX2 CPU build is, on any host."""

    def __init__(self, ops, missing: str):
        self._ops, self._missing = ops, missing

    def __getattr__(self, name):
        if name == self._missing:
            raise AttributeError(f"'_C' object has no attribute '{name}'")
        return getattr(self._ops, name)


def _param(t: torch.Tensor, **dims) -> torch.nn.Parameter:
    p = torch.nn.Parameter(t, requires_grad=False)
    for k, v in dims.items():
        setattr(p, k, v)
    return p


def _layer(seed: int, group_size: int, g_idx: bool, zero_points: bool = False):
    """A GPTQ-packed W4A16 layer of random codes and scales: (kernel, layer, the weight's values [IN, OUT], the
    values read without the type's bias: a wrong dequantization)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (IN, OUT), generator=g, dtype=torch.int32)
    groups = 1 if group_size == -1 else IN // group_size
    scales = (torch.rand(groups, OUT, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    group = (torch.randint(0, groups, (IN,), generator=g) if g_idx else
             torch.arange(IN) // (IN if group_size == -1 else group_size))
    layer = torch.nn.Module()
    layer.weight_packed = _param(pack_quantized_values_into_int32(codes, scalar_types.uint4b8, 0), input_dim=0,
                                 output_dim=1, packed_dim=0)
    layer.weight_scale = _param(scales, input_dim=0, output_dim=1)
    layer.weight_g_idx = _param(group.to(torch.int32), input_dim=0) if g_idx else None
    layer.weight_zp = _param(torch.zeros(groups, OUT // 8, dtype=torch.int32), input_dim=0, output_dim=1,
                             packed_dim=1) if zero_points else None
    layer.bias = None
    cfg = MPLinearLayerConfig((IN, OUT), (IN, OUT), scalar_types.uint4b8, torch.bfloat16, group_size, zero_points,
                              g_idx)
    kernel = CPUWNA16LinearKernel(cfg, "weight_packed", "weight_scale", "weight_zp" if zero_points else None,
                                  "weight_g_idx" if g_idx else None)
    values = (codes - 8).float() * scales.float()[group]
    return kernel, layer, values, codes.float() * scales.float()[group]


@pytest.fixture
def without_op(monkeypatch):
    CpuPlatform.import_kernels()  # what vLLM does first: load the host's ops build
    monkeypatch.setattr(torch.ops, "_C", _Without(torch.ops._C, "cpu_gemm_wna16"))
    monkeypatch.setenv("VLLM_RIG_CPU_WNA16_DENSE", "1")


@pytest.mark.parametrize("group_size, g_idx", [(128, False), (-1, False), (64, True)])
def test_without_the_op_a_w4a16_layer_multiplies_by_its_codes_values(without_op, group_size, g_idx):
    kernel, layer, values, unbiased = _layer(7, group_size, g_idx)
    kernel.process_weights_after_loading(layer)
    assert layer.rig_dense_weight is not None and layer.rig_dense_weight.shape == (OUT, IN)
    assert layer.rig_dense_weight.dtype == torch.bfloat16
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = kernel.apply_weights(layer, x).float()
    want = x.float() @ values
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-2, f"group_size {group_size}, g_idx {g_idx}: relative error {rel}"
    # the negative control: the same bound fails for the codes read without the type's bias (8)
    wrong = x.float() @ unbiased
    assert ((got - wrong).norm() / wrong.norm()).item() > 1e-2


def test_with_the_knob_at_0_nothing_changes_even_without_the_op(without_op, monkeypatch):
    """Upstream's behaviour is kept unless the plan asks: the layer keeps its packed form for cpu_gemm_wna16 (the
    engine would stop at its first step, as upstream's does)."""
    monkeypatch.setenv("VLLM_RIG_CPU_WNA16_DENSE", "0")
    kernel, layer, _, _ = _layer(7, 128, False)
    kernel.process_weights_after_loading(layer)
    assert layer.rig_dense_weight is None
    with pytest.raises(AttributeError, match="cpu_gemm_wna16"):
        kernel.apply_weights(layer, torch.zeros(1, IN, dtype=torch.bfloat16))


def test_without_the_op_an_asymmetric_layer_is_refused_at_load_naming_the_way_out(without_op):
    kernel, layer, _, _ = _layer(3, 128, False, zero_points=True)
    with pytest.raises(NotImplementedError, match="symmetric W4A16 only .* AVX-512"):
        kernel.process_weights_after_loading(layer)


def test_with_the_op_nothing_changes_and_the_kernel_agrees_with_the_codes_values():
    if not cpuisa.has_w4a16_kernel():
        pytest.skip("this host's vLLM CPU build has no cpu_gemm_wna16 (AVX2 ops): the fallback tests above are "
                    "what runs here")
    kernel, layer, values, _ = _layer(7, 128, False)
    kernel.process_weights_after_loading(layer)
    assert layer.rig_dense_weight is None
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = kernel.apply_weights(layer, x).float()
    want = x.float() @ values
    assert ((got - want).norm() / want.norm()).item() < 1e-2
