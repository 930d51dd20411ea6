"""A prompt chunk over a long KVarN-packed context on this GPU: kvarn_triton.chunk_attention (what the vLLM
backend's chunk path runs since 2026-12-07: pages dequantized a block at a time, a running softmax, scores under
CHUNK_SCORE_BYTES) beside the form it replaced (the whole context dequantized, a chunk x context boolean mask,
torch SDPA in float32 with enable_gqa).

The served model's shape per attention layer: 24 query / 4 KV heads, head_dim 256; a chunk of C queries after P
packed tokens (pages from quantize_groups of random K/V, scattered); for each form the CUDA-event median time and
the peak memory it allocated on top of the inputs (torch.cuda.max_memory_allocated), and the relative L2
difference between the two outputs where both ran. A form that does not fit says "OOM" in its columns.

    python bench/scripts/kvarn_chunk_bench.py [--contexts 8192,32768,131072,262144] [--chunk 2048] [--json OUT]

Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rig.atomic import write_json  # noqa: E402
from rig.kernels import prefill_bench as pb  # noqa: E402

HQ, HKV, D = 24, 4, 256


def _dense(kt, q, pool, pages, fresh_k, fresh_v, ctx, lay):
    """The chunk path before 2026-12-07 (vllm_backend._attend_sdpa over the whole dequantized context)."""
    import torch

    k_ctx, v_ctx = kt.dequantize_pages(pool, pages, torch.float32, lay, rotated=True)
    k, v = torch.cat([k_ctx, fresh_k]), torch.cat([v_ctx, fresh_v])
    n, total = q.shape[0], k.shape[0]
    pos = torch.arange(total, device=q.device)
    mask = pos[None, :] <= (ctx + torch.arange(n, device=q.device))[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1), k.transpose(0, 1),
                                                         v.transpose(0, 1), attn_mask=mask, enable_gqa=True)
    return o.transpose(0, 1)


def _measure(fn) -> tuple[object, float | None, float | None]:
    """(output, median ms, peak extra GiB) of fn, or (None, None, None) when it runs out of memory."""
    import torch

    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        ms = pb.time_ms(fn, reps=5, warmup=0, budget_s=20.0)
        return out, ms, peak
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None, None


def _row(kt, lay, g, ctx: int, chunk: int) -> dict:
    """One context length: a scattered pool of ctx // 128 pages from random K/V, a chunk of random queries, both
    forms measured."""
    import torch

    groups, held = divmod(ctx, lay.group)
    pool = torch.empty(groups + 1, lay.page_bytes, dtype=torch.uint8, device="cuda")
    pages = torch.randperm(groups + 1, generator=g, device="cuda")[:groups].to(torch.int32)
    for g0 in range(0, groups, 256):                           # quantize in slices: bounded scratch
        m = min(256, groups - g0)
        k, v = (torch.randn(m, lay.group, HKV, D, generator=g, device="cuda", dtype=torch.float16) for _ in "kv")
        kt.quantize_groups(pool, pages[g0:g0 + m], k, v, lay, True, True)
    q = torch.randn(chunk, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
    fresh_k, fresh_v = (torch.randn(held + chunk, HKV, D, generator=g, device="cuda") for _ in "kv")
    blocked, b_ms, b_gib = _measure(lambda: kt.chunk_attention(q, pool, pages, fresh_k, fresh_v, ctx, lay))
    dense, d_ms, d_gib = _measure(lambda: _dense(kt, q, pool, pages, fresh_k, fresh_v, ctx, lay))
    rel = float((blocked - dense).norm() / dense.norm()) if blocked is not None and dense is not None else None
    return {"context": ctx, "chunk": chunk, "blocked_ms": b_ms, "blocked_peak_gib": b_gib, "dense_ms": d_ms,
            "dense_peak_gib": d_gib, "rel_diff": rel}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=pb.positive_ints("--contexts"), default=[8192, 32768, 131072, 262144])
    ap.add_argument("--chunk", type=int, default=2048, help="queries in the chunk (the profile's step: 2048)")
    ap.add_argument("--json", type=Path, help="also write the rows here (atomically)")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("kvarn_chunk_bench: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "bench" / "scripts"))
    import kvarn_bench

    kt = kvarn_bench.load_kernels(smoke=False)
    lay = kt.page_layout(HKV, D)
    g = torch.Generator(device="cuda").manual_seed(0)
    info = pb.versions()
    print(f"{info['device']} ({info['capability']}), torch {info['torch']}, triton {info['triton']}; chunk "
          f"{a.chunk}, {HQ}/{HKV} heads x {D}, CHUNK_SCORE_BYTES {kt.CHUNK_SCORE_BYTES >> 20} MiB")
    print(f"{'context':>8} | {'blocked ms':>10} {'GiB':>6} | {'dense ms':>9} {'GiB':>6} | rel diff")
    rows = []
    for ctx in a.contexts:
        row = _row(kt, lay, g, ctx, a.chunk)
        rows.append(row)

        def cell(ms, gib):
            return f"{'OOM':>9} {'OOM':>6}" if ms is None else f"{ms:9.2f} {gib:6.2f}"

        rel = row["rel_diff"]
        print(f"{ctx:8d} | {cell(row['blocked_ms'], row['blocked_peak_gib']):>17} | "
              f"{cell(row['dense_ms'], row['dense_peak_gib'])} | {'-' if rel is None else f'{rel:.1e}'}", flush=True)
        torch.cuda.empty_cache()
    if a.json:
        write_json(a.json, {"versions": info, "score_bytes": kt.CHUNK_SCORE_BYTES, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
