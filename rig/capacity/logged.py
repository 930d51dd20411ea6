"""What a running vLLM 0.28 server says of its pool in its log: the figures the planner predicts.

One place for the log lines' shapes, so the planner is held to a live server the same way on CPU
(tests/test_server_live.py), on CUDA (tests/test_gpu.py) and by ``verify``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

POOL = re.compile(r"KV cache size: ([\d,]+) tokens")
BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")
PADDING = re.compile(r"Padding mamba page size by ([\d.]+)%")
BACKEND = re.compile(r"Using (\w+) (?:attention )?backend")


@dataclass(frozen=True)
class Logged:
    """None where the log has no such line (a dense model pads nothing; an older vLLM words it otherwise)."""

    pool_tokens: int | None
    block_size: int | None
    padding_pct: float | None
    attention_backend: str | None


def read(log: str) -> Logged:
    """The last of each line: a restarted engine in the same log reports its pool again."""
    def last(rx: re.Pattern[str]) -> str | None:
        found = rx.findall(log)
        return found[-1] if found else None

    pool, block, pad = last(POOL), last(BLOCK), last(PADDING)
    return Logged(pool_tokens=int(pool.replace(",", "")) if pool else None,
                  block_size=int(block) if block else None,
                  padding_pct=float(pad) if pad else None, attention_backend=last(BACKEND))
