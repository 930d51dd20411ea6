"""What a `vllm serve` log says the engine built: KV pool, concurrency, block size, page padding, attention backend.

The capacity planner predicts the pool and block size from vLLM's own page code without a server; these
lines are what the server actually chose, so ``verify`` (and the live tests) can put the two side by side.
vLLM 0.28 writes them at INFO level (``rig.plan.check_with_vllm`` keeps that level for servers rig starts).
A line vLLM did not write is None: the block-size line only appears when a hybrid model's attention page is
raised to hold a mamba page, the backend line's wording differs between the CPU and the CUDA platforms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

POOL = re.compile(r"KV cache size: ([\d,]+) tokens")
BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")
PADDING = re.compile(r"Padding mamba page size by ([\d.]+)%")
CONCURRENCY = re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")
# CUDA: "Using FLASH_ATTN backend" / "Using FLASHINFER attention backend"; CPU: "... layout for CPU_ATTN backend."
BACKEND = re.compile(r"Using (\w+) (?:attention )?backend|KV cache layout for (\w+) backend")


@dataclass(frozen=True)
class EngineLog:
    """The figures one engine start logged (the last start when a log holds several)."""

    pool_tokens: int | None
    block_size: int | None
    padding_pct: float | None
    attention_backend: str | None
    max_concurrency: float | None = None  # requests of max_model_len the pool holds at once, as vLLM logs it


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    found = list(pattern.finditer(text))
    return found[-1] if found else None


def parse(text: str) -> EngineLog:
    pool, block, padding, backend, conc = (_last(p, text) for p in (POOL, BLOCK, PADDING, BACKEND, CONCURRENCY))
    return EngineLog(
        pool_tokens=int(pool.group(1).replace(",", "")) if pool else None,
        block_size=int(block.group(1)) if block else None,
        padding_pct=float(padding.group(1)) if padding else None,
        attention_backend=(backend.group(1) or backend.group(2)) if backend else None,
        max_concurrency=float(conc.group(1)) if conc else None,
    )


def read(path: Path) -> EngineLog:
    return parse(path.read_text(errors="replace"))
