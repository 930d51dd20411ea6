"""KVarN decode sweep on a GPU: each (variant, block_t, warps, stages, splits, precise, unpack) config vs fp16 SDPA.

For --lengths (default 8k, 32k, 128k) and --batch 8 sequences (kvarn_bench.decode_setup's inputs:
random K/V quantized into a packed pool, the same tokens as an fp16 cache, one fp16 query token per
sequence), times torch SDPA over the fp16 cache and ``decode_attention`` under each config of a
small grid (CONFIGS), with kvarn_bench.timed (CUDA events, median of --iters after --warmup). Each
config's output is compared with the v1 kernel's defaults (max |diff| over all lengths; the output is fp16,
so ~2e-4 is one fp16 ulp near 0.3). Prints one
markdown table sorted by the time at 32k (or the middle length), then the best config's speedup vs
SDPA and its share of the measured copy bandwidth (packed bytes read / time). A config that fails to
compile or run gets its error in the table, and the sweep goes on.

Needs only torch, triton and numpy (no pydantic: kvarn_bench imports rig.kernels, which imports rig.paths
only). Exits 2 without CUDA. ``--smoke``: a tiny size and a few configs on CPU in Triton's interpreter,
to check the script end to end (no speeds).

    python bench/scripts/kvarn_decode_sweep.py [--lengths 8192,32768,131072] [--batch 8] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvarn_bench as kb  # noqa: E402

BASELINE = {"variant": "v1"}
"""The old kernel at its defaults (block_t 32, 8 warps, auto splits): the sweep's reference output."""
CONFIGS = [BASELINE] + [
    {"variant": "v2", "block_t": 128, "num_warps": 8, "precise": pk} for pk in ("kv", "k")
] + [
    {"variant": "v3", **kw} for kw in (
        {}, {"num_warps": 4}, {"num_warps": 16}, {"stages": 3}, {"stages": 2}, {"stages": 4},
        {"unpack": "cvt"}, {"precise": "k"}, {"precise": ""}, {"splits": 8}, {"splits": 32}, {"splits": 64},
        {"precise": "k", "num_warps": 4}, {"precise": "k", "unpack": "cvt", "num_warps": 4},
        {"block_t": 64}, {"block_t": 64, "num_warps": 4}, {"block_t": 32, "num_warps": 4},
        {"unpack": "ptx"}, {"unpack": "ptx", "stages": 2}, {"unpack": "ptx", "precise": "k"},
        {"unpack": "ptx", "precise": ""}, {"maxnreg": 128}, {"maxnreg": 128, "unpack": "ptx"},
        {"maxnreg": 128, "stages": 2}, {"maxnreg": 128, "precise": "k"},
        {"block_t": 64, "num_warps": 4, "maxnreg": 128})
] + [
    {"variant": "v4", **kw} for kw in (
        {}, {"unpack": "ptx"}, {"splits": 64}, {"splits": 128}, {"splits": 512}, {"unpack": "ptx", "splits": 128})
] + [
    {"variant": "v5", **kw} for kw in (
        {}, {"stages": 2}, {"stages": 3}, {"stages": 6}, {"splits": 64}, {"splits": 128}, {"splits": 512},
        {"splits": 33}, {"splits": 48}, {"splits": 96}, {"stages": 2, "splits": 64}, {"stages": 3, "splits": 64},
        {"maxnreg": 168}, {"maxnreg": 168, "splits": 96}, {"maxnreg": 128}, {"maxnreg": 128, "splits": 128},
        {"precise": "k"}, {"precise": ""}, {"unpack": "subnormal"}, {"unpack": "subnormal", "precise": "k"},
        {"unpack": "subnormal", "precise": ""}, {"unpack": "subnormal", "lazy": True},
        {"unpack": "subnormal", "precise": "k", "lazy": True}, {"prefetch": True}, {"prefetch": True, "precise": "k"},
        {"prefetch": True, "unpack": "subnormal", "precise": "k", "lazy": True},
        {"prefetch": True, "unpack": "subnormal", "precise": "", "lazy": True},
        {"prefetch": True, "unpack": "subnormal", "precise": "", "lazy": True, "maxnreg": 168},
        {"unpack": "subnormal", "maxnreg": 200}, {"unpack": "subnormal", "precise": "", "maxnreg": 168},
        {"skew": True}, {"skew": True, "prefetch": True, "unpack": "subnormal", "precise": "k", "lazy": True},
        {"skew": True, "prefetch": True, "unpack": "subnormal", "precise": "", "lazy": True},
        {"skew": True, "stages": 4, "prefetch": True, "unpack": "subnormal", "precise": "k", "lazy": True},
        {"qsmem": True}, {"qsmem": True, "precise": "k", "maxnreg": 168},
        {"qsmem": True, "precise": "k", "maxnreg": 128},
        {"qsmem": True, "unpack": "subnormal", "precise": "k", "lazy": True, "maxnreg": 168},
        {"qsmem": True, "precise": "k"}, {"qsmem": True, "precise": ""},
        {"qsmem": True, "unpack": "subnormal", "precise": "k", "lazy": True}, {"qsmem": True, "stages": 3},
        {"qsmem": True, "stages": 4}, {"qsmem": True, "unpack": "subnormal"}, {"qsmem": False},
        {"qsmem": True, "maxnreg": 200}, {"qsmem": True, "precise": "k", "maxnreg": 200},
        {"qsmem": True, "unpack": "subnormal", "precise": "k", "lazy": True, "maxnreg": 200},
        {"qsmem": True, "unpack": "subnormal", "precise": "k", "lazy": True, "prefetch": True},
        {"qsmem": True, "maxnreg": 200, "splits": 33}, {"qsmem": True, "maxnreg": 200, "splits": 66},
        {"qsmem": True, "maxnreg": 168, "splits": 33}, {"inplace": True}, {"inplace": True, "precise": "k"},
        {"inplace": True, "unpack": "subnormal", "precise": "k", "lazy": True, "prefetch": True},
        {"inplace": True, "unpack": "subnormal", "precise": "", "lazy": True})
] + [
    {"variant": "v6", **kw} for kw in (
        {}, {"precise": "k"}, {"stages": 3}, {"maxnreg": 255}, {"maxnreg": 128}, {"splits": 33})
] + [
    {"variant": "v5", "csmem": True, **kw} for kw in (
        {}, {"precise": "k"}, {"unpack": "subnormal", "precise": "k", "lazy": True}, {"inplace": True},
        {"inplace": True, "unpack": "subnormal", "precise": "k", "lazy": True}, {"stages": 3})
] + [
    {"variant": "v5", "csmem": False, **kw} for kw in (
        {}, {"inplace": True, "unpack": "subnormal", "precise": "k", "lazy": True})
] + [
    {"variant": "v5", "csmem": True, "qsmem": False, **kw} for kw in (
        {"maxnreg": 168}, {"maxnreg": 168, "precise": "k"},
        {"maxnreg": 168, "precise": "k", "unpack": "subnormal", "lazy": True, "inplace": True}, {})
]
"""109 configs: v1 (the reference), v2 at the 2026-12-05 sweep's best ("kv" and "k"; its other tiles and warps
were slower there), and v3 (codes read as stored, K's as the large dot operand) at its defaults (block_t 128,
8 warps, 1 stage, "magic" unpack, precise "kv") and one or two knobs changed at a time: stages 3 is Triton's
default pipelining; unpack "ptx" the magic number four codes at a time in inline PTX; maxnreg 128 two 8-warp
programs an SM, with spills (the last two added 2026-12-06, docs/kvarn.md); v4 (Gluon, one warp a program, one
tiling) at its default splits and others, both unpacks; v5 (v4 fed by a ring of tiles in shared memory) at its
default ring depth (2; 4 until 2026-12-07) and splits, and others (2026-12-07: split counts around one wave of
resident one-warp programs, and register caps of 168 and 128: 12 and 16 programs an SM, with spills, against 8 at
255); from index 51 (2026-12-07, evening) v5's hi-only operands (precise "k", ""), the subnormal unpack (codes as
fp16 subnormals, no subtraction), the lazy rescale (one V unit a group), the prefetch of the next group's channel
scales, register caps (200: no spill in the token loop; the split count follows the cap, kvarn_triton._resident,
which counted 10 programs an SM there until rows 84-86 showed 8: those rows of 2026-12-07 ran a part-filled second
wave) and the skewed loop (a tile's dots before the previous tile's softmax and P.V); from index
69 (2026-12-07, night) the query's operands in shared memory (qsmem: 64 registers a thread fewer to hold), alone,
under caps of 168 and 128, with hi-only operands, the subnormal unpack and deeper rings, caps of 200; (79) v5
without it, qsmem's default on an sm90 GPU since 2026-12-07 (night); (84-86)
caps of 200 / 168 at one wave of 8 programs an SM (33 splits) and two (66), against the split count the cap implies;
(87-90) the in-place unpack (codes masked where they lie: 72 fewer shifts a tile), with qsmem; (91-96) v6 (v5 on two
warps a program, half the channels each) at its defaults (cap 168: 6 programs an SM), precise "k", a ring of 3,
no cap (255: 4 programs), a cap of 128 (8, with spills) and 33 splits; (97-102, 2026-12-07, late) v5 with its group
start from shared memory (csmem: the channel scales copied a group ahead, the query parked once a program), alone, with
precise "k", with the subnormal unpack + "k" + lazy, with inplace, with all of those, and a ring of 3; (103-104) v5
without it (csmem's default on an sm90 GPU since 2026-12-07, late), alone and with all of those; (105-108) csmem
without qsmem under a cap of 168 — 12 programs an sm90 SM, as 18,432 B of shared memory a program allow (with the
query parked for the tiles too, 26,624 B: 8), ptxas spilling 156 B, 23 local loads a tile — with precise "k", with
"k" + subnormal + lazy + inplace (lazy's 2 KiB: 11 programs), and uncapped (8 programs: what qsmem adds to csmem).
precise "kv" is v1's precision; "k" passes the tests' 1e-3 bound; "" does not (a speed ceiling)."""
SMOKE_CONFIGS = [BASELINE, {"variant": "v2"}, {"variant": "v3", "precise": "k", "unpack": "cvt", "splits": 2}]


def label(cfg: dict, kt_defaults: dict) -> tuple[str, str, str, str, str, str]:
    """Table cells: variant (v3: and its unpack), block_t, warps, stages, splits, precise (kernel defaults shown as
    such)."""
    d = kt_defaults[cfg["variant"]]
    variant = cfg["variant"] + (f" {cfg.get('unpack', 'magic')}" if cfg["variant"] in ("v3", "v4") else "") + \
        (" sub" if cfg.get("unpack") == "subnormal" else "") + (" lazy" if cfg.get("lazy") else "") + \
        (" pf" if cfg.get("prefetch") else "") + (" skew" if cfg.get("skew") else "") + \
        (" qs" if cfg.get("qsmem") else " no-qs" if cfg.get("qsmem") is False else "") + \
        (" ip" if cfg.get("inplace") else "") + \
        (" cs" if cfg.get("csmem") else " no-cs" if cfg.get("csmem") is False else "") + \
        (f" r{cfg['maxnreg']}" if "maxnreg" in cfg else "")
    return (variant, str(cfg.get("block_t", d[0])), str(cfg.get("num_warps", d[1])),
            str(cfg.get("stages", d[2] or "-")), str(cfg.get("splits", "auto")),
            repr(cfg.get("precise", "kv")) if cfg["variant"] != "v1" else "kv (hi+lo)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768,131072", help="context lengths (multiples of 128)")
    ap.add_argument("--batch", type=int, default=8, help="sequences")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny size, 3 configs, CPU in Triton's interpreter")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (the GPU's work alone, as a decode "
                                                         "step under CUDA graphs pays it) instead of eager calls")
    ap.add_argument("--kernels", action="store_true", help="also list the best config's CUDA kernels and their time "
                                                           "at the key length (torch profiler)")
    ap.add_argument("--only", default="", help="comma-separated: variants (v1 ... v6: all their configs) and numbers "
                                               "N (CONFIGS[N], e.g. one kernel under a profiler); default all")
    ap.add_argument("--profile", action="store_true", help="launch each picked config once at each length and nothing "
                                                            "else (no SDPA, no v1 reference, no timing): what a "
                                                            "profiler filtering on 'decode_split' should catch")
    a = ap.parse_args()
    picks = [x for x in a.only.split(",") if x]
    configs = [c for i, c in enumerate(CONFIGS) if not picks or c["variant"] in picks or str(i) in picks]
    known = {c["variant"] for c in CONFIGS} | {str(i) for i in range(len(CONFIGS))}
    if not configs or any(x not in known for x in picks):
        print(f"--only {a.only}: no such config; variants (v1 ... v6) or an index below {len(CONFIGS)}",
              file=sys.stderr)
        return 2
    if a.smoke:
        a.lengths, a.batch, a.iters, a.warmup, configs = "256,384", 2, 1, 0, SMOKE_CONFIGS
        a.graph = a.kernels = False  # CUDA only
    lengths = [int(x) for x in a.lengths.split(",") if x]
    if not lengths or any(n <= 0 or n % kb.GROUP for n in lengths):
        print(f"--lengths {a.lengths}: positive multiples of {kb.GROUP}", file=sys.stderr)
        return 2
    kt = kb.load_kernels(a.smoke)
    import torch
    import triton

    if not a.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter check", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.smoke else "cuda")
    if a.profile:
        return profile_launches(kt, configs, lengths, a.batch, device)
    key = 32768 if 32768 in lengths else lengths[len(lengths) // 2]

    def timed(fn):
        return kb.timed_graph(fn, a.warmup, a.iters) if a.graph else kb.timed(fn, device, a.warmup, a.iters)

    copy_bps = kb.copy_bandwidth(device, (16 << 20) if a.smoke else (2 << 30), a.warmup, max(a.iters, 1))
    sdpa, packed, plain = {}, {}, {}
    times = [{} for _ in configs]
    diffs = [0.0 for _ in configs]
    errors = ["" for _ in configs]
    for n in lengths:
        x = kb.decode_setup(kt, n, a.batch, device)
        q, args = x["q"], x["args"]
        packed[n], plain[n] = x["pool"].nbytes, x["kf"].nbytes + x["vf"].nbytes
        sdpa[n] = timed(x["sdpa"])
        ref = kt.decode_attention(q, *args, **BASELINE).float()
        for i, cfg in enumerate(configs):
            if errors[i]:
                continue
            try:
                out = torch.full_like(q, float("nan"))
                got = kt.decode_attention(q, *args, out=out, **cfg).float()
                diffs[i] = max(diffs[i], (got - ref).abs().max().item())  # NaN (rows left unwritten) stays NaN
                if got.isnan().any():
                    diffs[i] = float("nan")
                times[i][n] = timed(lambda q=q, args=args, out=out, cfg=cfg: kt.decode_attention(
                    q, *args, out=out, **cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, the sweep goes on
                errors[i] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        x = q = args = ref = None  # frees this length's caches before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def us(sec):
        return "smoke" if a.smoke else f"{sec * 1e6:,.1f}"

    name = "CPU, Triton interpreter (smoke)" if a.smoke else torch.cuda.get_device_name(device)
    print(f"KVarN decode sweep, {name}, torch {torch.__version__}, triton {triton.__version__}; {a.batch} sequences, "
          f"24 query / 4 KV heads x 256; median of {a.iters} after {a.warmup} warmup"
          f"{' (CUDA-graph replays: GPU time)' if a.graph else ' (eager calls)'}; packed cache "
          f"{packed[lengths[0]] / (a.batch * lengths[0]):,.0f} B/token; copy bandwidth "
          + ("smoke" if a.smoke else f"{copy_bps / 1e9:,.0f} GB/s"))
    print()
    def short(n):
        return f"{n // 1024}k" if n % 1024 == 0 else str(n)

    cols = " | ".join(f"µs {short(n)}" for n in lengths)
    print(f"| variant | block_t | warps | stages | splits | precise | {cols} | vs SDPA {short(key)} "
          f"| % copy {short(key)} | max abs diff vs v1 |")
    print("|---|---:|---:|---:|---:|---|" + "---:|" * len(lengths) + "---:|---:|---:|")
    spct = "smoke" if a.smoke else f"{100 * plain[key] / sdpa[key] / copy_bps:.0f}%"
    print(f"| fp16 SDPA | - | - | - | - | - | {' | '.join(us(sdpa[n]) for n in lengths)} | 1.00x | {spct} | - |")
    order = sorted(range(len(configs)), key=lambda i: (bool(errors[i]), times[i].get(key, float("inf"))))
    for i in order:
        cells = " | ".join(label(configs[i], kt.DECODE_DEFAULTS))
        if errors[i]:
            print(f"| {cells} | failed: {errors[i]} |" + " |" * (len(lengths) + 2))
            continue
        t = times[i]
        speed = "smoke" if a.smoke else f"{sdpa[key] / t[key]:.2f}x"
        pct = "smoke" if a.smoke else f"{100 * packed[key] / t[key] / copy_bps:.0f}%"
        print(f"| {cells} | {' | '.join(us(t[n]) for n in lengths)} | {speed} | {pct} | {diffs[i]:.2e} |")
    ok = [i for i in order if not errors[i]]
    if not ok:
        print("\nno config ran")
        return 1
    best = ok[0]
    print()
    print(f"best at {key:,}: {' '.join(f'{k}={v}' for k, v in configs[best].items())}")
    for n in lengths:
        t = times[best][n]
        if a.smoke:
            print(f"  {n:,} tokens: smoke (interpreter timings are not speeds); max abs diff vs v1 {diffs[best]:.2e}")
        else:
            print(f"  {n:,} tokens: {t * 1e6:,.1f} µs, {sdpa[n] / t:.2f}x fp16 SDPA ({sdpa[n] * 1e6:,.1f} µs), "
                  f"{packed[n] / t / 1e9:,.0f} GB/s = {100 * packed[n] / t / copy_bps:.0f}% of copy bandwidth")
    if a.kernels:
        kernel_times(kt, configs[best], key, a.batch, device)
    return 0


def profile_launches(kt, configs: list[dict], lengths: list[int], batch: int, device) -> int:
    """One decode_attention call per config and length, nothing else launched around them: a sweep run for the timing
    table first launches the v1 reference, whose split kernel a profiler's first 'decode_split' match would be."""
    import torch

    for n in lengths:
        x = kb.decode_setup(kt, n, batch, device)
        for cfg in configs:
            kt.decode_attention(x["q"], *x["args"], **cfg)
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"launched {' '.join(label(cfg, kt.DECODE_DEFAULTS))} at {batch} x {n:,}")
        x = None
    return 0


def kernel_times(kt, cfg: dict, n: int, batch: int, device) -> None:
    """What one decode_attention call costs where: each CUDA kernel it launches with its mean GPU time, the host's
    time a call (a loop of launches the GPU keeps up with: the eager cost of Python and the launches) and the
    host operations that take most of it (torch profiler, 10 calls)."""
    import torch

    x = kb.decode_setup(kt, n, batch, device)

    def call():
        return kt.decode_attention(x["q"], *x["args"], **cfg)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    rows = prof.key_averages()
    gpu = [e for e in rows if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"\nkernels of one call at {n:,} tokens ({' '.join(f'{k}={v}' for k, v in cfg.items())}), mean of 10:")
    for e in sorted(gpu, key=lambda e: -e.device_time_total):
        print(f"  {e.device_time_total / e.count:9.1f} µs  x{e.count // 10:<3} {e.key[:90]}")
    host = [e for e in rows if e.device_type == torch.autograd.DeviceType.CPU]
    print("host operations, self CPU time a call (top 8):")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"  {e.self_cpu_time_total / 10:9.1f} µs  x{e.count // 10:<3} {e.key[:90]}")
    small = kb.decode_setup(kt, 1024, batch, device)  # a short context: the GPU outruns the host
    host_s = kb.host_time(lambda: kt.decode_attention(small["q"], *small["args"], **cfg), 200, warmup=3)
    print(f"host time a call (200 calls at 1,024 tokens, launches only): {host_s * 1e6:,.1f} µs")
    return None


if __name__ == "__main__":
    sys.exit(main())
