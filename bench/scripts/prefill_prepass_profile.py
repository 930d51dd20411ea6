"""Where the int8 prefill attention's time goes, stage by stage: checks, pre-pass (mean, quantize), attention.

The CUDA pre-pass (K smoothing + per-block int8 quantization, ``smooth_quant.cu`` through
``rig.kernels.cubin``) measured 1.3–1.6 ms at 1k–16k tokens on the H200 in prefill_attn_bench,
nearly independent of length. This script splits one ``int8_prefill_attention`` call into its
stages and times each three ways, so a host-side cost and a device-side cost cannot be confused:

- host µs: ``time.perf_counter`` around the call, the queue empty before it (what Python, ctypes
  and the driver spend on the CPU; no sync inside the call, so this is not GPU time);
- GPU µs: CUDA events around the call with the stream held busy first (``torch.cuda._sleep``), so
  every launch is queued before the start event fires: the device's own time, no host in it;
- event µs: CUDA events around the call on an idle GPU, a sync after each — how
  prefill_attn_bench timed it (≈ host time before the first launch + GPU time).

Stages (one sequence, 24 q / 4 kv heads, head_dim 256, bf16): checks (``check_varlen``, the
attention's and the pre-pass's own, all host); prepare (outputs and workspace allocated, the
fatbin's entry points bound, the stream); mean (block sums + K's channel mean: 2 launches);
quantize (Q, then K − mean: 2 launches); attention (the Triton kernel); and, whole: the pre-pass
(``cubin.smooth_quant``) and ``int8_prefill_attention``. Medians of --reps after --warmup.

Diagnostics beside the table: the cost of one bare ctypes driver call; the pre-pass's host time
with the driver bound through ``ctypes.CDLL`` (releases the GIL on every call, as cubin.py does)
and through ``ctypes.PyDLL`` (keeps it), and on a side stream instead of the legacy default one,
before and after ``import vllm`` (prefill_attn_bench imports it; threads it starts would compete
for the GIL); the Python threads alive. Then a
torch.profiler trace of the staged call at --trace-tokens: key_averages sorted by self CUDA time
and by self CPU time, top 15 each (--trace writes the Chrome trace too).

    python bench/scripts/prefill_prepass_profile.py [--tokens 1024,4096,16384] [--json OUT] [--trace OUT.json]

Needs a CUDA device (exit 2 without one) and a fresh CUDA pre-pass build for it (``inv kernels.build
--arch sm90`` on the H200; exit 3 naming what is wrong otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rig.atomic import write_json  # noqa: E402
from rig.kernels import prefill_bench as pb  # noqa: E402
from rig.kernels.prefill_bench import HEAD_DIM, HKV, HQ, KERNEL  # noqa: E402

DRIVER_CALLS = ("cuGetErrorName", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent", "cuCtxSetCurrent",
                "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel")
"""The driver functions rig.kernels.cubin binds (the PyDLL variant copies their prototypes)."""
STAGES = ("checks", "prepare", "mean", "quantize", "attention", "pre-pass (smooth_quant)",
          "total (int8_prefill_attention)")


def no_cuda(reason: str) -> int:
    print(f"prefill_prepass_profile: {reason}; nothing measured (run it on a GPU host)", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------- timing


def host_us(fn: Callable[[], object], reps: int) -> float:
    """Median perf_counter µs of ``fn`` with the queue drained before each call."""
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def event_us(fn: Callable[[], object], reps: int) -> float:
    """Median CUDA-event µs of ``fn`` on an idle GPU, synced after each (prefill_attn_bench's way)."""
    return statistics.median(ms * 1e3 for ms in pb.event_ms(fn, reps))


def sleep_cycles_per_us() -> float:
    """``torch.cuda._sleep``'s clock cycles per µs on this GPU (measured, the clock varies)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles // 10)  # warm
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def gpu_us(fn: Callable[[], object], reps: int, cycles_per_us: float, host: float) -> float:
    """Median device µs of ``fn``: the stream is held by a spin kernel longer than the host needs to
    queue the start event, ``fn``'s launches and the end event, so no host time falls between them."""
    import torch

    cycles = int(cycles_per_us * (3 * host + 500))
    return statistics.median(ms * 1e3 for ms in pb.event_ms(fn, reps, before=lambda: torch.cuda._sleep(cycles)))


# ----------------------------------------------------------------------------- the staged call


class Staged:
    """One ``int8_prefill_attention`` call split at its stages (the same calls it makes, in order)."""

    def __init__(self, attn, cubin, tokens: int) -> None:
        import torch

        self.attn, self.cubin, self.ref = attn, cubin, attn.reference
        self.q, self.k, self.v = pb.inputs(tokens)
        self.cu = pb.cu_seqlens(tokens)
        self.tokens = tokens
        self.block = self.ref.QUANT_BLOCK
        self.scale = self.ref.default_sm_scale(HEAD_DIM)
        self.out = torch.empty_like(self.q)
        self.call = self.prepare()
        self.call.launch_mean()  # real quantized inputs for the attention stage
        self.call.launch_quant()

    def checks(self) -> None:
        self.ref.check_varlen(self.q, self.k, self.v, self.cu, self.tokens)
        self.attn._check_attention(self.v, self.cu, self.q.shape, self.out)
        self.cubin.check_inputs(self.q, self.k, self.cu, self.tokens, self.block, varlen=False)

    def prepare(self):
        import torch

        with torch.cuda.device(self.q.device):
            return self.cubin.prepare(self.q, self.k, self.cu, self.tokens, self.block)

    def mean(self) -> None:
        self.call.launch_mean()

    def quantize(self) -> None:
        self.call.launch_quant()

    def attention(self):
        return self.attn._launch(*self.call.outputs, self.v, self.cu, self.tokens, self.scale, self.out)

    def prepass(self):
        return self.cubin.smooth_quant(self.q, self.k, self.cu, self.tokens)

    def total(self):
        return self.attn.int8_prefill_attention(self.q, self.k, self.v, self.cu, self.tokens, self.scale,
                                                out=self.out)

    def functions(self) -> dict[str, Callable[[], object]]:
        return dict(zip(STAGES, (self.checks, self.prepare, self.mean, self.quantize, self.attention, self.prepass,
                                 self.total), strict=True))


def measure(staged: Staged, reps: int, warmup: int, cycles_per_us: float) -> list[dict]:
    """Every stage of one length, three ways."""
    rows = []
    for name, fn in staged.functions().items():
        for _ in range(warmup):
            fn()
        h = host_us(fn, reps)
        device = gpu_us(fn, reps, cycles_per_us, h) if name != "checks" else 0.0
        rows.append({"tokens": staged.tokens, "stage": name, "host_us": h, "gpu_us": device,
                     "event_us": event_us(fn, reps)})
    return rows


# ----------------------------------------------------------------------------- diagnostics


def pydll_driver(cubin) -> ctypes.PyDLL:
    """libcuda.so.1 through ctypes.PyDLL (the GIL kept during each call), cubin's prototypes."""
    cdll = cubin._driver()
    lib = ctypes.PyDLL("libcuda.so.1")
    for name in DRIVER_CALLS:
        src, dst = getattr(cdll, name), getattr(lib, name)
        dst.argtypes, dst.restype = src.argtypes, src.restype
    return lib


def driver_call_ns(lib, reps: int = 20_000) -> float:
    """Median ns of one bare cuCtxGetCurrent through ``lib`` (the cheapest driver call), over batches."""
    cur = ctypes.c_void_p()
    ref = ctypes.byref(cur)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(reps // 20):
            lib.cuCtxGetCurrent(ref)
        times.append((time.perf_counter() - t0) / (reps // 20) * 1e9)
    return statistics.median(times)


def gil_ab(staged: Staged, cubin, reps: int, warmup: int) -> dict:
    """The pre-pass's host and event µs with the driver bound via CDLL (as shipped) and via PyDLL."""
    from unittest import mock

    out = {"threads": sorted(t.name for t in threading.enumerate())}
    py = pydll_driver(cubin)
    for label, ctx in (("cdll", contextlib.nullcontext()), ("pydll", mock.patch.object(cubin, "_driver", lambda: py))):
        with ctx:
            for _ in range(warmup):
                staged.prepass()
            out[f"{label}_host_us"] = host_us(staged.prepass, reps)
            out[f"{label}_event_us"] = event_us(staged.prepass, reps)
            out[f"{label}_driver_call_ns"] = driver_call_ns(cubin._driver())
    import torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # torch's current stream is then not the legacy default one
        for _ in range(warmup):
            staged.prepass()
        out["side_stream_host_us"] = host_us(staged.prepass, reps)
        out["side_stream_event_us"] = event_us(staged.prepass, reps)
    return out


def profile(staged: Staged, calls: int, trace: Path | None) -> dict:
    """torch.profiler over ``calls`` staged calls and as many plain ones: two top-15 tables."""
    import torch
    from torch.profiler import ProfilerActivity, record_function

    for _ in range(3):
        staged.total()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("staged call"):
                for name, fn in staged.functions().items():
                    if name.startswith(("pre-pass", "total")):
                        continue
                    with record_function(f"stage: {name}"):
                        fn()
            torch.cuda.synchronize()
        for _ in range(calls):
            with record_function("int8_prefill_attention (as served)"):
                staged.total()
            torch.cuda.synchronize()
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    result = {"calls": calls, "tables": {}, "rows": {}}
    for key in ("self_cuda_time_total", "self_cpu_time_total"):
        result["tables"][key] = averages.table(sort_by=key, row_limit=15)
        ordered = sorted(averages, key=lambda e: getattr(e, key.replace("cuda", "device")), reverse=True)[:15]
        result["rows"][key] = [{"name": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total,
                                "cpu_total_us": e.cpu_time_total, "self_cuda_us": e.self_device_time_total,
                                "cuda_total_us": e.device_time_total} for e in ordered]
    return result


# ----------------------------------------------------------------------------- output


def print_table(rows: list[dict]) -> None:
    head = f"{'tokens':>7} {'stage':<32} {'host us':>9} {'GPU us':>9} {'event us':>9}  bound"
    print(head)
    print("-" * len(head))
    for r in rows:
        bound = "host" if r["host_us"] > r["gpu_us"] else "GPU"
        print(f"{r['tokens']:>7} {r['stage']:<32} {r['host_us']:>9.1f} {r['gpu_us']:>9.1f} {r['event_us']:>9.1f}  "
              f"{bound}")
    for r in rows:
        if r["stage"] == "pre-pass (smooth_quant)":
            gap = r["event_us"] - max(r["host_us"], r["gpu_us"])
            print(f"pre-pass at {r['tokens']} tokens: event {r['event_us']:.1f} us = max(host {r['host_us']:.1f}, "
                  f"GPU {r['gpu_us']:.1f}) + {gap:.1f} us unexplained by either")


def print_gil(phases: dict[str, dict]) -> None:
    for phase, d in phases.items():
        print(f"{phase}: pre-pass host us CDLL {d['cdll_host_us']:.1f} / PyDLL {d['pydll_host_us']:.1f}; "
              f"event us CDLL {d['cdll_event_us']:.1f} / PyDLL {d['pydll_event_us']:.1f}; one driver call "
              f"{d['cdll_driver_call_ns']:.0f} / {d['pydll_driver_call_ns']:.0f} ns; on a side stream host "
              f"{d['side_stream_host_us']:.1f} / event {d['side_stream_event_us']:.1f} us; "
              f"{len(d['threads'])} Python threads: {', '.join(d['threads'])}")


parse_tokens = pb.positive_ints("--tokens")


def load_kernel(kernel: str):
    """(attn module, rig.kernels.cubin) for the checkout this script is in."""
    from rig.kernels import cubin, load

    return load(kernel, "attn"), cubin


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=parse_tokens, default=parse_tokens("1024,4096,16384"),
                   help="comma-separated sequence lengths (one sequence each)")
    p.add_argument("--reps", type=int, default=50, help="timed runs per stage and way (median)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs per stage first")
    p.add_argument("--trace-tokens", type=int, default=4096, help="length of the profiled call")
    p.add_argument("--trace-calls", type=int, default=5, help="profiled calls (staged, then as served)")
    p.add_argument("--trace", type=Path, default=None, help="also write the Chrome trace here")
    p.add_argument("--no-vllm", action="store_true", help="skip the GIL comparison after `import vllm`")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        return no_cuda(f"torch is not importable ({e})")
    if not torch.cuda.is_available():
        return no_cuda("no CUDA device (torch.cuda.is_available() is False)")
    attn, cubin = load_kernel(KERNEL)
    if attn.prepass() is not cubin.smooth_quant:
        from rig.kernels import manifest

        arch = cubin.build_arch(torch.cuda.get_device_capability())
        why = "; ".join(manifest.problems(KERNEL, arch)) if arch else "no build arch runs on this GPU"
        print(f"prefill_prepass_profile: the CUDA pre-pass is not in use ({why}); `inv kernels.build --arch {arch}` "
              "builds it", file=sys.stderr)
        return 3
    info = pb.versions()
    attn.warmup(HQ, HKV, HEAD_DIM, torch.bfloat16, "cuda")
    cycles = sleep_cycles_per_us()
    print(f"device {info['device']} ({info['capability']}), torch {info['torch']} (CUDA {info['cuda']}), "
          f"triton {info['triton']}, python {info['python']}; GIL switch interval "
          f"{sys.getswitchinterval() * 1e3:.1f} ms; spin kernel {cycles:.0f} cycles/us")
    print(f"shape: one sequence, {HQ} q / {HKV} kv heads, head_dim {HEAD_DIM}, bf16; medians of {args.reps}")
    rows = []
    for tokens in args.tokens:
        rows += measure(Staged(attn, cubin, tokens), args.reps, args.warmup, cycles)
    print_table(rows)
    gil_at = Staged(attn, cubin, args.trace_tokens)
    phases = {"before import vllm": gil_ab(gil_at, cubin, args.reps, args.warmup)}
    if not args.no_vllm:
        try:
            import vllm

            info["vllm"] = vllm.__version__
            phases["after import vllm"] = gil_ab(gil_at, cubin, args.reps, args.warmup)
        except Exception as exc:  # the comparison is optional: say why it is missing
            info["vllm"] = f"not importable ({type(exc).__name__}: {str(exc)[:100]})"
    print_gil(phases)
    prof = profile(gil_at, args.trace_calls, args.trace)
    for key, table in prof["tables"].items():
        print(f"\ntorch.profiler, {args.trace_tokens} tokens, {args.trace_calls} staged + {args.trace_calls} "
              f"as-served calls, sorted by {key} (top 15):")
        print(table)
    if args.trace:
        print(f"wrote {args.trace}")
    if args.json:
        stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        write_json(args.json, {"measured_utc": stamp, "versions": info, "spin_cycles_per_us": cycles,
                               "switch_interval_s": sys.getswitchinterval(),
                               "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM, "dtype": "bf16"},
                               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               "stages": rows, "gil": phases,
                               "profile": {"tokens": args.trace_tokens, "calls": prof["calls"],
                                           "top": prof["rows"]}})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
