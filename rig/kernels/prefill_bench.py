"""What the int8 prefill attention's bench scripts share: the served model's attention shape and one
sequence's inputs of it, CUDA-event timing, the versions a figure belongs to, their JSON and arguments.

Used by ``bench/scripts/prefill_attn_bench.py`` (the kernel beside SDPA and vLLM's kernels) and
``bench/scripts/prefill_prepass_profile.py`` (one call split into its stages): the same inputs at a
length and the same event timing, so their figures can be read side by side. Standard library only at
import (torch and triton inside the functions): prefill_attn_bench also runs on a bare GPU host with
torch and triton alone, and prefill_prepass_profile says itself when torch is missing.
"""

from __future__ import annotations

import argparse
import platform
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KERNEL = "int8-prefill-attn"
HQ, HKV, HEAD_DIM = 24, 4, 256
"""The served model's attention shape: 24 query heads, 4 KV heads, head_dim 256 (bf16)."""


def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [tokens, HQ, HEAD_DIM] and k, v [tokens, HKV, HEAD_DIM] of one sequence: bf16 on the GPU, standard
    normal, drawn in that order from a generator seeded with ``tokens`` (every script measures the same bytes)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
               for h in (HQ, HKV, HKV))
    return q, k, v


def cu_seqlens(tokens: int) -> torch.Tensor:
    """The varlen boundaries of one sequence of ``tokens`` tokens: int32 [0, tokens] on the GPU."""
    import torch

    return torch.tensor([0, tokens], dtype=torch.int32, device="cuda")


def event_ms(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None) -> list[float]:
    """CUDA-event ms of each of ``reps`` calls of ``fn``, the device synchronized before each and after it.

    ``before`` (when given) is queued after that synchronization and ahead of the start event:
    prefill_prepass_profile queues a spin kernel there, so every launch of ``fn`` is queued before the
    start event fires and no host time falls inside the interval.
    """
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_ms(fn: Callable[[], object], reps: int, warmup: int, budget_s: float) -> float:
    """Median CUDA-event time of ``fn`` in ms: ``warmup`` untimed calls, then up to ``reps`` timed
    ones, fewer when one call is long (at least 3), so a 64k row stays within ``budget_s``."""
    for _ in range(warmup):
        fn()
    first = event_ms(fn, 1)[0]
    n = max(3, min(reps, int(budget_s * 1000 / max(first, 1e-3))))
    return statistics.median(event_ms(fn, n))


def versions() -> dict[str, str]:
    """Device and library versions the figures belong to."""
    import torch
    import triton

    return {"device": torch.cuda.get_device_name(), "capability": "sm{}{}".format(*torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton.__version__,
            "python": platform.python_version()}


def positive_ints(flag: str) -> Callable[[str], list[int]]:
    """An argparse ``type`` for ``flag``: '1024,4096' → [1024, 4096]; an entry that is not a positive integer
    is an error naming the flag and the entry."""

    def parse(text: str) -> list[int]:
        out = []
        for part in text.split(","):
            if not part.strip().isdigit() or int(part) < 1:
                raise argparse.ArgumentTypeError(f"{flag}: {part!r} is not a positive integer")
            out.append(int(part))
        return out

    return parse
