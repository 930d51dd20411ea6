"""The reference stack's published RTX 3090 figures, predicted by rig's capacity planner.

Published (the reference stack, RTX 3090 24 GB, batch profile: fp8 KV, GPU_UTIL 0.972, MAX_SEQS 64,
MAX_LEN 150000): a KV pool of 223,821 tokens, 193,298 with PREFIX_CACHE=1; with an fp32 recurrent
state only 37 of 64 requests run; with fp16 ~70 short requests fit. The planner works from the
real-shaped config (models/qwen3.5-27b-class.toml) and vLLM 0.28's own page and pool code; the
two overheads a config cannot tell are hardware/gpus.toml [overheads], calibrated here:

    .venv/bin/python bench/scripts/plan_reference.py              # predicted vs published
    .venv/bin/python bench/scripts/plan_reference.py --calibrate  # how the two constants were fitted
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rig.capacity import cards, pages, report, shape, weights  # noqa: E402
from rig.plan import resolve  # noqa: E402

PUBLISHED = [  # (figure, knobs, what is compared, published value)
    ("KV pool, default (tokens)", {}, "pool", 223_821),
    ("KV pool, PREFIX_CACHE=1 (tokens)", {"PREFIX_CACHE": "1"}, "pool", 193_298),
    ("requests running, fp32 state (of 64)", {"MAMBA_SSM_DTYPE": "float32"}, "seats", 37),
    ("short requests that fit, fp16 state", {}, "seats", 70),
]


def predict(sets: dict[str, str]) -> report.Report:
    plan = resolve("batch", platform="gpu", environ={}, sets=sets)
    return report.for_plan(plan, cards.card("rtx3090"))


def blocks_for(tokens: int, sets: dict[str, str]) -> tuple[int, int]:
    """(blocks, block bytes) of the smallest pool whose vLLM-reported size is ``tokens``."""
    plan = resolve("batch", platform="gpu", environ={}, sets=sets)
    k, s = plan.knobs, shape.real_shape()
    probe = pages.pool(s, k["KV"], k["MAMBA_SSM_DTYPE"], 10**9, k["MAX_LEN"], k["BLOCK_SIZE"], bool(k["PREFIX_CACHE"]))
    n = 1
    while pages.pool(s, k["KV"], k["MAMBA_SSM_DTYPE"], n * probe.block_bytes, k["MAX_LEN"], k["BLOCK_SIZE"],
                     bool(k["PREFIX_CACHE"])).reported_tokens < tokens:
        n += 1
    return n, probe.block_bytes


def calibrate() -> None:
    base = predict({}).budget
    n, bb = blocks_for(223_821, {})
    n_pc, _ = blocks_for(193_298, {"PREFIX_CACHE": "1"})
    mid = int((n + 0.5) * bb)
    runtime = base.requested_bytes - base.weights_bytes - mid
    seat = (n - n_pc) * bb // 64
    print(f"GPU_UTIL 0.972 x {cards.card('rtx3090').memory_bytes:,} B = {base.requested_bytes:,} B")
    print(f"weights as vLLM loads them (no MTP: SPEC=off): {base.weights_bytes:,} B")
    print(f"223,821 tokens = vLLM 0.28's report of {n} blocks of {bb:,} B (800 tokens x 16 layers): "
          f"KV bytes in [{n * bb:,}, {(n + 1) * bb:,}), middle {mid:,}")
    print(f"runtime_bytes = {base.requested_bytes:,} - {base.weights_bytes:,} - {mid:,} = {runtime:,}")
    print(f"193,298 tokens with PREFIX_CACHE=1 = {n_pc} blocks: {n - n_pc} blocks fewer = {(n - n_pc) * bb:,} B, "
          f"prefix_cache_seat_bytes = that / 64 seats = {seat:,}")
    # The figures docs/plan.md discusses beside the fit: the MTP layer, align mode alone, keep_16bit.
    s = shape.real_shape()
    w = weights.count(s)
    print(f"weights with the MTP layer (SPEC=mtp loads it): {w.checkpoint:,} B (MTP {w.mtp:,} B)")
    none, align = (pages.pool(s, "fp8", "float16", mid, 150_000, 0, pc).reported_tokens for pc in (False, True))
    print(f"align mode alone (PREFIX_CACHE=1's second state block, same {mid:,} KV bytes): {none:,} -> "
          f"{align:,} tokens, {none - align:,} fewer")
    int4 = weights.count(dataclasses.replace(s, quant=dataclasses.replace(s.quant, keep_16bit=())))
    print(f"in_proj_a/b as int4 (a config.json without the shape file's keep_16bit): "
          f"{w.checkpoint - int4.checkpoint:,} B less")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="print how hardware/gpus.toml [overheads] were fitted")
    if ap.parse_args().calibrate:
        calibrate()
        return 0
    ov = cards.overheads()
    print(f"rtx3090, batch profile, shape {shape.REAL_SHAPE.name}; runtime_bytes {ov['runtime_bytes']:,}, "
          f"prefix_cache_seat_bytes {ov['prefix_cache_seat_bytes']:,} (hardware/gpus.toml)")
    print(f"{'figure':40} {'published':>10} {'predicted':>10} {'diff':>7}")
    worst = 0.0
    for name, sets, what, published in PUBLISHED:
        b = predict(sets).budget
        got = b.pool.reported_tokens if what == "pool" else b.short_seats
        diff = (got - published) / published
        worst = max(worst, abs(diff))
        print(f"{name:40} {published:>10,} {got:>10,} {diff:>+7.1%}")
    print(f"worst difference {worst:.1%} (limit 3%)")
    return 0 if worst <= 0.03 else 1


if __name__ == "__main__":
    sys.exit(main())
