"""Host memory on the CPU platform: does one more server fit, before it is started?

On CPU, vLLM's KV cache lives in host RAM. With KV_MEM (the cpu overlay fixes it) the cache is
exactly that many bytes on every host, so what a server needs is known ahead: its model files,
the KV cache at its worst (every page written) and an overhead — the API server, engine core and
worker processes with torch, vLLM and the compiled graphs. The overhead is measured by
bench/scripts/server_memory.py (its output is quoted in docs/development.md) and a live test
holds a running server under this estimate. Comparing the sum with the host's available memory
(MemAvailable: what can be had without swapping) turns an out-of-memory death minutes into a
start into a refusal with the numbers, before anything is started.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

GIB = 2**30
# Peak RSS of a batch-profile CPU server's process tree less its KV cache (which vLLM's CPU worker
# keeps wholly resident) was 2.34 GiB with KV_MEM=1G and with 3G (bench/scripts/server_memory.py,
# 2026-12-03, docs/development.md): 3 GiB leaves room for other hosts' allocators and libraries.
SERVER_OVERHEAD_BYTES = 3 * GIB


@dataclass(frozen=True)
class Need:
    """What one server takes of host memory, in bytes."""

    model: int
    kv: int
    overhead: int = SERVER_OVERHEAD_BYTES

    @property
    def total(self) -> int:
        return self.model + self.kv + self.overhead

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB (model {self.model / GIB:.2f} + KV_MEM {self.kv / GIB:.2f} + "
                f"server processes {self.overhead / GIB:.1f})")


def model_bytes(folder: Path) -> int:
    """Bytes of the weight files a server loads (safetensors / bin), 0 for a folder not built yet."""
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))


def need(knobs: dict, model_folder: Path) -> Need:
    """KV_MEM bytes, or (KV_MEM=0) what vLLM's CPU rule would reserve: GPU_UTIL x the host's RAM."""
    kv = int(knobs["KV_MEM"]) or int(knobs["GPU_UTIL"] * psutil.virtual_memory().total)
    return Need(model=model_bytes(model_folder), kv=kv)


def available() -> int:
    """Memory the host can give without swapping (the kernel's MemAvailable)."""
    return psutil.virtual_memory().available


def refusal(knobs: dict, model_folder: Path, have: int | None = None) -> str | None:
    """Why a CPU server of these knobs would not fit this host now, or None when it fits."""
    n = need(knobs, model_folder)
    have = available() if have is None else have
    if n.total <= have:
        return None
    return (f"this host has {have / GIB:.1f} GiB of memory available, the server needs {n.describe()}: "
            "stop other servers or lower KV_MEM (with MAX_LEN x MAX_SEQS to match)")
