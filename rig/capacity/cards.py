"""GPU cards: the table in hardware/gpus.toml (data) and the device NVML reports (name, total, free)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from typing import Any

from rig import paths

GPUS = paths.ROOT / "hardware" / "gpus.toml"


@dataclass(frozen=True)
class Card:
    """One GPU: memory (NVML's total), free memory when a live device was asked, and its peak rates."""

    key: str
    name: str
    memory_bytes: int
    bandwidth_gbs: float | None = None
    fp16_tflops: float | None = None
    int8_tops: float | None = None
    free_bytes: int | None = None
    source: str = ""


@cache
def data() -> dict[str, Any]:
    """hardware/gpus.toml, parsed once."""
    return tomllib.loads(GPUS.read_text())


def overheads() -> dict[str, Any]:
    return data()["overheads"]


def known() -> list[str]:
    return sorted(data()["cards"])


def card(key: str) -> Card:
    """A card of the table by its key (rtx3090, h200, ...); ValueError naming the known keys."""
    cards = data()["cards"]
    if key not in cards:
        raise ValueError(f"--gpu {key!r}: not in hardware/gpus.toml; known cards: {', '.join(known())} "
                         "(add a [cards.NAME] table with memory_bytes, bandwidth_gbs, fp16_tflops, int8_tops, source)")
    c = cards[key]
    return Card(key=key, name=c["name"], memory_bytes=int(c["memory_bytes"]), bandwidth_gbs=c.get("bandwidth_gbs"),
                fp16_tflops=c.get("fp16_tflops"), int8_tops=c.get("int8_tops"), source=c.get("source", ""))


def match(nvml_name: str) -> Card | None:
    """The table's card whose name NVML reports (for its rates), or None."""
    for key, c in data()["cards"].items():
        if c["name"].lower() in nvml_name.lower() or nvml_name.lower() in c["name"].lower():
            return card(key)
    return None


def from_device(name: str, total: int, free: int) -> Card:
    """A live device: NVML's memory figures, the table's rates when the card is known."""
    known_card = match(name)
    base = {"bandwidth_gbs": known_card.bandwidth_gbs, "fp16_tflops": known_card.fp16_tflops,
            "int8_tops": known_card.int8_tops, "source": known_card.source} if known_card else {}
    return Card(key=known_card.key if known_card else "nvml", name=name, memory_bytes=total, free_bytes=free,
                **base)


def nvml() -> Card | None:
    """GPU 0 as NVML reports it, or None without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            return from_device(str(pynvml.nvmlDeviceGetName(h)), int(mem.total), int(mem.free))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no device
        return None
