"""KVarN kernels on a GPU: decode-attention error per context length, bytes per token, decode time vs fp16 SDPA.

One run, one table (also written as JSON with --json PATH). For one attention layer of this model
(24 query / 4 KV heads, head_dim 256):

* error rows (lengths --lengths, default 1k, 4k, 16k, 32k, 128k): K and V from
  ``reference.synthetic`` (Gaussian, hot channels, one outlier-scale token in 128), 4 decode
  queries; the reference is fp32 attention over the original K/V. Formats: ``kvarn`` (our
  quantize-on-write + our decode kernel on the packed paged cache), ``plain RTN`` (the same
  kernels and layout with rotation and normalization off: the reference's rotate=normalize=False
  option), ``fp8 e4m3`` (cast, scale 1, fp32 attention), ``fp16`` (cast, fp32 attention), and
  vLLM's ``turboquant_3bit_nc`` / ``turboquant_4bit_nc`` through vLLM's own Triton store and
  decode kernels when the installed vLLM has them (else a line says why not). Bytes per token per
  layer come from the allocated tensors.
* time rows (--time-lengths, default 8k, 32k, 128k; --batch 8 sequences): decode attention of one
  fp16 query token per sequence, ours (all launches: query rotation, split kernel, combine,
  un-rotation) vs torch SDPA over an fp16 cache [batch, 4, L, 256] (enable_gqa); torch.cuda.Event
  per iteration, --warmup then the median of --iters (>= 20). Effective bandwidth of ours = packed
  cache bytes read / time, against a measured device copy bandwidth (read + write of a 2 GiB
  tensor, same timing).

``--smoke``: tiny sizes on CPU through Triton's interpreter, to check the script end to end; its
time columns are printed as "smoke" (interpreter timings are not speeds).

    python bench/scripts/kvarn_bench.py [--json PATH] [--smoke] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rig.kernels import load_file  # noqa: E402

KV_HEADS, HEAD_DIM, Q_HEADS, GROUP = 4, 256, 24, 128


def load_kernels(smoke: bool):
    """kernels/kvarn/kvarn_triton.py; --smoke sets TRITON_INTERPRET=1 first (triton reads it when it loads)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    return load_file(ROOT / "kernels" / "kvarn" / "kvarn_triton.py", "rig_kernel_kvarn_triton", fresh=True)


# ----------------------------------------------------------------------------- helpers

def attention_gqa(q, k, v):
    """fp32 softmax(q k^T / sqrt(d)) v for q [n, 24, d] over k, v [L, 4, d], without expanding K/V per query head."""
    import torch

    n, hq, d = q.shape
    hkv = k.shape[1]
    qq = q.float().view(n, hkv, hq // hkv, d)
    logits = torch.einsum("nhgd,lhd->nhgl", qq, k.float()) / math.sqrt(d)
    return torch.einsum("nhgl,lhd->nhgd", logits.softmax(-1), v.float()).reshape(n, hq, d)


def timed(fn, device, warmup: int, iters: int) -> float:
    """Median seconds of fn() over iters runs after warmup: CUDA events per iteration on a GPU, perf_counter on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kvarn_cache(kt, k, v, seqs: int, rotated: bool):
    """One packed cache of k, v [L, 4, 256] (L % 128 == 0) shared by ``seqs`` sequences (same block table)."""
    import torch

    groups = k.shape[0] // GROUP
    pool = torch.empty(groups, kt.MODEL_LAYOUT.page_bytes, dtype=torch.uint8, device=k.device)
    pages = torch.arange(groups, dtype=torch.int32, device=k.device)
    shape = (groups, GROUP, KV_HEADS, HEAD_DIM)
    kt.quantize_groups(pool, pages, k.reshape(shape), v.reshape(shape), rotate_=rotated, normalize=rotated)
    return pool, pages.expand(seqs, groups).contiguous()


def decode_args(kt, pool, block_table, groups: int, dtype):
    """The decode_attention arguments after q for full groups and empty tails."""
    import torch

    s, dev = block_table.shape[0], pool.device
    n_groups = torch.full((s,), groups, dtype=torch.int32, device=dev)
    tail = torch.zeros(s, GROUP, KV_HEADS, HEAD_DIM, dtype=dtype, device=dev)
    return (pool, block_table, n_groups, groups, tail, tail, torch.zeros(s, dtype=torch.int32, device=dev))


# ----------------------------------------------------------------------------- vLLM TurboQuant

def turboquant(name: str):
    """vLLM's TurboQuant store + decode for preset ``name``: callable(q, k, v) -> (out, bytes/token), or why not."""
    try:
        from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
        from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention
        from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
    except Exception as e:  # noqa: BLE001 - any import failure is reported, not raised
        return f"{type(e).__name__}: {e}"

    def run(q, k, v):
        import torch

        dev, length, block = k.device, k.shape[0], 16
        cfg = TurboQuantConfig.from_cache_dtype(name, HEAD_DIM)
        h = _hadamard(HEAD_DIM, dev)
        cent = get_centroids(HEAD_DIM, cfg.centroid_bits).to(device=dev, dtype=torch.float32)
        srt = cent.sort().values
        blocks = math.ceil(length / block)
        cache = torch.zeros(blocks, block, KV_HEADS, cfg.slot_size_aligned, dtype=torch.uint8, device=dev)
        slots = torch.arange(length, dtype=torch.int32, device=dev)
        triton_turboquant_store(k.float(), v.float(), cache, slots, h, (srt[:-1] + srt[1:]) / 2,
                                mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                                value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
        n = q.shape[0]
        table = torch.arange(blocks, dtype=torch.int32, device=dev).expand(n, blocks).contiguous()
        lens = torch.full((n,), length, dtype=torch.int32, device=dev)
        out = triton_turboquant_decode_attention(
            q.half(), cache, table, lens, h, cent, 1 / math.sqrt(HEAD_DIM), cfg.mse_bits, cfg.key_packed_size,
            cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8, norm_correction=cfg.norm_correction, PiT=h)
        return out.float(), cache.nbytes / (blocks * block)

    return run


def _hadamard(d: int, device):
    """The normalized Sylvester Hadamard matrix (vLLM's TurboQuant uses the same rotation)."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device)


# ----------------------------------------------------------------------------- the measurements

def error_rows(kt, length: int, seed: int, device, tq: dict) -> list[dict]:
    """Attention-output error per format at one length (4 decode queries, fp32 reference over the original K/V)."""
    import torch

    r = kt.reference
    q, k, v = (t.to(device) for t in r.synthetic(length, seed, queries=4))
    exact = attention_gqa(q, k, v)
    rows = []

    def add(fmt, got, nbytes):
        rel, cos = r.errors(exact, got)
        rows.append({"tokens": length, "format": fmt, "rel_error": rel, "cosine": cos, "bytes_per_token": nbytes})

    groups = length // GROUP
    for fmt, rotated in (("kvarn", True), ("plain RTN", False)):
        pool, table = kvarn_cache(kt, k, v, q.shape[0], rotated)
        out = kt.decode_attention(q, *decode_args(kt, pool, table, groups, torch.float16), rotated=rotated)
        add(fmt, out, pool.nbytes / length)
        del pool
    for fmt, dtype in (("fp8 e4m3", torch.float8_e4m3fn), ("fp16", torch.float16)):
        kk, vv = k.to(dtype), v.to(dtype)
        add(fmt, attention_gqa(q, kk.float(), vv.float()), (kk.nbytes + vv.nbytes) / length)
    for name, run in tq.items():
        if isinstance(run, str):
            continue
        try:
            out, nbytes = run(q, k, v)
            add(name, out, nbytes)
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            tq[name] = f"failed at {length} tokens: {type(e).__name__}: {str(e)[:200]}"
    return rows


def copy_bandwidth(device, nbytes: int, warmup: int, iters: int) -> float:
    """Bytes/s of a device-to-device tensor copy (read + write counted)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, warmup, iters)


def decode_setup(kt, length: int, batch: int, device) -> dict:
    """The time rows' inputs: ``batch`` sequences of ``length`` random tokens (seeded by length) quantized into a
    packed pool (pages in order) and kept as an fp16 cache [batch, 4, L, 256]; an fp16 query [batch, 24, 256].

    Returns q, out (an fp16 buffer like q), args (decode_attention's arguments after q), pool, kf, vf and
    sdpa (a callable: torch SDPA of q over kf, vf with enable_gqa, the fp16 baseline).
    """
    import torch

    g = torch.Generator(device=device).manual_seed(length)
    groups = length // GROUP
    pool = torch.empty(batch * groups, kt.MODEL_LAYOUT.page_bytes, dtype=torch.uint8, device=device)
    kf = torch.empty(batch, KV_HEADS, length, HEAD_DIM, dtype=torch.float16, device=device)
    vf = torch.empty_like(kf)
    for s in range(batch):  # one sequence at a time bounds the fp32 scratch
        k = torch.randn(length, KV_HEADS, HEAD_DIM, generator=g, device=device)
        v = torch.randn(length, KV_HEADS, HEAD_DIM, generator=g, device=device)
        pages = torch.arange(s * groups, (s + 1) * groups, dtype=torch.int32, device=device)
        shape = (groups, GROUP, KV_HEADS, HEAD_DIM)
        kt.quantize_groups(pool, pages, k.reshape(shape), v.reshape(shape))
        kf[s], vf[s] = k.transpose(0, 1), v.transpose(0, 1)
        del k, v
    table = torch.arange(batch * groups, dtype=torch.int32, device=device).view(batch, groups)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=g, device=device).half()
    qs = q.view(batch, Q_HEADS, 1, HEAD_DIM)
    return {"q": q, "out": torch.empty_like(q), "args": decode_args(kt, pool, table, groups, torch.float16),
            "pool": pool, "kf": kf, "vf": vf,
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qs, kf, vf, enable_gqa=True)}


def time_rows(kt, length: int, batch: int, device, warmup: int, iters: int, copy_bps: float,
              tiles: dict) -> list[dict]:
    """Decode time of ours on the packed cache vs torch SDPA over an fp16 cache, ``batch`` sequences of ``length``."""
    x = decode_setup(kt, length, batch, device)
    q, out, args, pool, kf, vf = x["q"], x["out"], x["args"], x["pool"], x["kf"], x["vf"]
    ours = timed(lambda: kt.decode_attention(q, *args, out=out, **tiles), device, warmup, iters)
    sdpa = timed(x["sdpa"], device, warmup, iters)
    packed, plain = pool.nbytes, kf.nbytes + vf.nbytes
    return [
        {"tokens": length, "format": f"kvarn decode x{batch}", "seconds": ours, "speedup_vs_sdpa": sdpa / ours,
         "bytes_read": packed, "GBps": packed / ours / 1e9, "pct_of_copy": 100 * packed / ours / copy_bps,
         "bytes_per_token": packed / (batch * length)},
        {"tokens": length, "format": f"fp16 SDPA x{batch}", "seconds": sdpa, "speedup_vs_sdpa": 1.0,
         "bytes_read": plain, "GBps": plain / sdpa / 1e9, "pct_of_copy": 100 * plain / sdpa / copy_bps,
         "bytes_per_token": plain / (batch * length)},
    ]


def table(rows: list[dict], smoke: bool) -> str:
    """The one markdown table: error columns for error rows, time columns for time rows ('-' where not measured)."""
    def f(row, key, fmt):
        if key not in row:
            return "-"
        if smoke and key in ("seconds", "speedup_vs_sdpa", "GBps", "pct_of_copy"):
            return "smoke"
        return fmt.format(row[key] * (1e6 if key == "seconds" else 1))

    lines = ["| tokens | format | rel. error | cosine | bytes/token/layer | decode µs | vs fp16 SDPA | GB/s "
             "| % of copy |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in sorted(rows, key=lambda x: (x["tokens"], "seconds" in x)):
        lines.append(f"| {row['tokens']:,} | {row['format']} | {f(row, 'rel_error', '{:.4f}')} | "
                     f"{f(row, 'cosine', '{:.4f}')} | {f(row, 'bytes_per_token', '{:,.0f}')} | "
                     f"{f(row, 'seconds', '{:,.1f}')} | {f(row, 'speedup_vs_sdpa', '{:.2f}x')} | "
                     f"{f(row, 'GBps', '{:,.0f}')} | {f(row, 'pct_of_copy', '{:.0f}%')} |")
    return "\n".join(lines)


def goals(rows: list[dict], batch: int) -> str:
    """The issue's two speed goals, checked against this run's rows (>= 3x fp16 SDPA at 32k; >= 60% of copy)."""
    ours = {r["tokens"]: r for r in rows if r["format"] == f"kvarn decode x{batch}"}
    lines = []
    if 32768 in ours:
        x = ours[32768]["speedup_vs_sdpa"]
        lines.append(f"goal >= 3x fp16 SDPA at 32k: {'met' if x >= 3 else 'NOT met'} ({x:.2f}x)")
    for n, r in sorted(ours.items()):
        p = r["pct_of_copy"]
        lines.append(f"goal >= 60% of copy bandwidth at {n:,}: {'met' if p >= 60 else 'NOT met'} ({p:.0f}%)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768,131072", help="error rows: cache lengths")
    ap.add_argument("--time-lengths", default="8192,32768,131072", help="time rows: context lengths")
    ap.add_argument("--batch", type=int, default=8, help="sequences in the time rows")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations (median; >= 20 on a GPU)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-t", type=int, default=0,
                    help="decode kernel: tokens per inner tile (16 ... 128); 0 = the variant's default")
    ap.add_argument("--num-warps", type=int, default=0, help="decode kernel: warps per program; 0 = the variant's")
    ap.add_argument("--variant", default="v2", help="decode split kernel: v2 (default) or v1 (kvarn_decode_sweep.py)")
    ap.add_argument("--json", default="", help="also write the rows and the run's facts here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in Triton's interpreter (no speeds)")
    a = ap.parse_args()
    if a.smoke:
        a.lengths, a.time_lengths, a.batch, a.iters, a.warmup = "256,384", "256", 2, 2, 1
    lengths = [int(x) for x in a.lengths.split(",") if x]
    time_lengths = [int(x) for x in a.time_lengths.split(",") if x]
    bad = [n for n in lengths + time_lengths if n <= 0 or n % GROUP]
    if bad:
        print(f"lengths {bad} are not positive multiples of {GROUP}", file=sys.stderr)
        return 2
    kt = load_kernels(a.smoke)
    if a.variant not in kt.DECODE_DEFAULTS:
        ap.error(f"--variant {a.variant!r}: one of {sorted(kt.DECODE_DEFAULTS)}")
    a.block_t = a.block_t or kt.DECODE_DEFAULTS[a.variant][0]  # the record names the tiles that ran
    a.num_warps = a.num_warps or kt.DECODE_DEFAULTS[a.variant][1]
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter check", file=sys.stderr)
        return 2
    if not a.smoke and a.iters < 20:
        print("--iters: at least 20 on a GPU (the median of fewer is noise)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references stay fp32
    device = torch.device("cpu" if a.smoke else "cuda")
    name = "CPU, Triton interpreter (smoke)" if a.smoke else torch.cuda.get_device_name(device)
    tq = {n: turboquant(n) for n in ("turboquant_3bit_nc", "turboquant_4bit_nc")}
    rows = []
    for length in lengths:
        rows += error_rows(kt, length, a.seed, device, tq)
    copy_bps = copy_bandwidth(device, (16 << 20) if a.smoke else (2 << 30), a.warmup, a.iters)
    for length in time_lengths:
        rows += time_rows(kt, length, a.batch, device, a.warmup, a.iters, copy_bps,
                          {"block_t": a.block_t, "num_warps": a.num_warps, "variant": a.variant})
    import triton

    print(f"KVarN kernels, {name}, torch {torch.__version__}, triton {triton.__version__}, seed {a.seed}; "
          f"error rows: 4 queries x {Q_HEADS} heads, KV {KV_HEADS} x {HEAD_DIM}, fp32 reference; "
          f"time rows: {a.batch} sequences, median of {a.iters} after {a.warmup} warmup, decode {a.variant} "
          f"block_t {a.block_t}, {a.num_warps} warps")
    for n, why in tq.items():
        if isinstance(why, str):
            print(f"{n}: not importable: {why}" if not why.startswith("failed") else f"{n}: {why}")
    print("device copy bandwidth: " + ("smoke" if a.smoke else f"{copy_bps / 1e9:,.0f} GB/s (read + write)"))
    print()
    print(table(rows, a.smoke))
    if not a.smoke:
        print()
        print(goals(rows, a.batch))
    if a.json:
        facts = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "seed": a.seed,
                 "smoke": a.smoke, "batch": a.batch, "variant": a.variant, "block_t": a.block_t,
                 "num_warps": a.num_warps, "iters": a.iters, "warmup": a.warmup,
                 "copy_Bps": copy_bps, "turboquant": {n: (w if isinstance(w, str) else "ran") for n, w in tq.items()}}
        Path(a.json).write_text(json.dumps({"facts": facts, "rows": rows}, indent=1) + "\n")
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
