"""Prefill attention speed on this GPU: our int8-QK kernel beside torch SDPA and vLLM's Triton kernels.

One sequence of each length (default 1k, 4k, 16k, 64k tokens), the served model's attention
shape (24 query / 4 KV heads, head_dim 256, bf16), causal. Rows, all in one run:

- ours (pre-pass + attn): ``int8_prefill_attention`` — K smoothing and int8 quantization (the
  CUDA pre-pass when built, else the torch one: the row says which) then the int8-QK kernel;
- ours (attn only): ``attn_int8`` on already-quantized inputs; ours (pre-pass only);
- (a) sdpa flash: torch SDPA restricted to its FlashAttention-2 backend (what an RTX 3090 runs);
- (b) sdpa default: SDPA with the math backend excluded (its O(T²) memory cannot hold 64k),
  torch choosing among the rest in its own priority order (the row names the choice);
- (c) vllm unified: vLLM's TRITON_ATTN kernel (``unified_attention``) as that backend calls it
  for a prefill, K/V in its paged cache layout (block size --vllm-block); (c2) vllm prefill:
  ``context_attention_fwd`` from ``triton_prefill_attention.py`` (contiguous K/V).

GQA for SDPA: ``enable_gqa=True`` (no copy of K/V); if a backend refuses it, K/V are repeated to
24 heads once, outside the timed region, and the row says "repeat". Times are CUDA-event medians
of --reps runs after --warmup; a row whose single run is long gets fewer reps (never under 3).
TFLOP/s counts causal attention as 2·2·T²/2·Hq·D operations. Also measured in the same run: the
card's int8 matmul ceiling (``torch._int_mm``) and bf16 matmul ceiling (``torch.matmul``), square
--ceiling-n matrices; "of mixed ceiling" is ours against half the work at each (QKᵀ int8, P·V
bf16). A correctness column gives each output's relative L2 error against (a).

    python bench/scripts/prefill_attn_bench.py [--lengths 1024,4096,16384,65536] [--json OUT]

vLLM's kernels are imported from the installed vllm package (PYTHONPATH=/tmp/site on the H200);
when they cannot be imported the row says why and the rest still runs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rig.atomic import write_json  # noqa: E402
from rig.kernels import load_file, module_name  # noqa: E402
from rig.kernels import prefill_bench as pb  # noqa: E402
from rig.kernels.prefill_bench import HEAD_DIM, HKV, HQ, KERNEL  # noqa: E402

parse_lengths = pb.positive_ints("--lengths")


def load_kernel():
    """The kernel's ``attn`` module: through rig.kernels.load when rig has it, else by path."""
    try:
        from rig.kernels import load

        return load(KERNEL)
    except ImportError:  # rig's dependencies (pydantic) absent: a bare GPU host with torch and triton only
        pass
    # under the name rig.kernels.load gives it, so one process loads it once
    return load_file(ROOT / "kernels" / KERNEL / "attn.py", module_name(KERNEL, "attn"))


def matmul_ceilings(n: int, reps: int) -> dict[str, float]:
    """Measured int8 (torch._int_mm, int32 out) TOPS and bf16 matmul TFLOP/s on n×n×n."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a8 = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda", generator=gen)
    b8 = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda", generator=gen).t().contiguous().t()
    a16 = torch.randn(n, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    b16 = torch.randn(n, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    ops = 2 * n**3
    int8_ms = pb.time_ms(lambda: torch._int_mm(a8, b8), reps, 3, 2.0)
    bf16_ms = pb.time_ms(lambda: a16 @ b16, reps, 3, 2.0)
    return {"int8_tops": ops / int8_ms / 1e9, "bf16_tflops": ops / bf16_ms / 1e9, "n": n}


def causal_flops(tokens: int) -> float:
    """Operations of causal attention for one sequence: 2·2·T²/2·Hq·D (QKᵀ and P·V, half the square)."""
    return 2 * 2 * tokens**2 / 2 * HQ * HEAD_DIM


def sdpa_backend_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> str:
    """Which SDPA backend torch picks for these inputs (its own dispatcher's answer), or 'unknown'."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=gqa)
        return SDPBackend(choice).name.lower()
    except Exception as exc:  # a private API: its absence only costs the label
        return f"unknown ({type(exc).__name__})"


def sdpa_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args) -> list[dict]:
    """Rows (a) flash-only and (b) default-without-math of torch SDPA, outputs in [T, Hq, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    rows = []
    allowed = {"(a) sdpa flash": [SDPBackend.FLASH_ATTENTION],
               "(b) sdpa default": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                    SDPBackend.EFFICIENT_ATTENTION]}
    for label, backends in allowed.items():
        row = {"variant": label}
        for gqa in (True, False):
            kk, vv = (kt, vt) if gqa else (kt.repeat_interleave(HQ // HKV, 1), vt.repeat_interleave(HQ // HKV, 1))

            def run(kk=kk, vv=vv, gqa=gqa, backends=backends):
                with sdpa_kernel(backends):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kk, vv, is_causal=True,
                                                                            enable_gqa=gqa)
            try:
                out = run()
            except RuntimeError as exc:
                row["error"] = str(exc).splitlines()[0][:160]
                continue
            row.pop("error", None)
            with sdpa_kernel(backends):
                name = sdpa_backend_name(qt, kk, vv, gqa)
            row.update(ms=pb.time_ms(run, args.reps, args.warmup, args.budget_s), gqa="enable_gqa" if gqa else "repeat",
                       note=f"{'enable_gqa' if gqa else 'repeat'}; {name}", out=out[0].transpose(0, 1))
            break
        rows.append(row)
    return rows


def vllm_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args) -> list[dict]:
    """Rows (c) vLLM's unified_attention (TRITON_ATTN, paged K/V) and (c2) context_attention_fwd."""
    rows = []
    tokens = q.shape[0]
    scale = 1.0 / math.sqrt(HEAD_DIM)
    cu = pb.cu_seqlens(tokens)
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as exc:
        rows.append({"variant": "(c) vllm unified", "error": f"import: {type(exc).__name__}: {exc}"[:200]})
    else:
        bs = args.vllm_block
        blocks = -(-tokens // bs)
        # the TRITON_ATTN backend's cache: (blocks, kv heads, block size, 2·D), seen as (blocks, block, heads, D)
        cache = torch.zeros(blocks, HKV, bs, 2 * HEAD_DIM, dtype=q.dtype, device="cuda")
        key_cache, value_cache = cache.transpose(1, 2).split(HEAD_DIM, dim=-1)
        padded = blocks * bs - tokens
        key_cache.copy_(torch.nn.functional.pad(k, (0, 0, 0, 0, 0, padded)).view(blocks, bs, HKV, HEAD_DIM))
        value_cache.copy_(torch.nn.functional.pad(v, (0, 0, 0, 0, 0, padded)).view(blocks, bs, HKV, HEAD_DIM))
        block_table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(1, blocks)
        seqused = torch.tensor([tokens], dtype=torch.int32, device="cuda")
        descale = torch.ones(1, 1, dtype=torch.float32, device="cuda").expand(1, HKV)
        out = torch.empty_like(q)

        def run_unified():
            unified_attention(q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu, max_seqlen_q=tokens,
                              seqused_k=seqused, max_seqlen_k=tokens, softmax_scale=scale, causal=True,
                              window_size=(-1, -1), block_table=block_table, softcap=0, q_descale=None,
                              k_descale=descale, v_descale=descale)
            return out
        rows.append(_try_row("(c) vllm unified", run_unified, args, f"TRITON_ATTN kernel, paged, block {bs}"))
    try:
        from vllm.v1.attention.ops.triton_prefill_attention import context_attention_fwd
    except Exception as exc:
        rows.append({"variant": "(c2) vllm prefill", "error": f"import: {type(exc).__name__}: {exc}"[:200]})
    else:
        out2 = torch.empty_like(q)
        start = torch.tensor([0], dtype=torch.int32, device="cuda")
        lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")

        def run_prefill():
            context_attention_fwd(q, k, v, out2, start, lens, tokens, is_causal=True, softmax_scale=scale)
            return out2
        rows.append(_try_row("(c2) vllm prefill", run_prefill, args, "context_attention_fwd, contiguous"))
    return rows


def _try_row(label: str, fn: Callable[[], torch.Tensor], args, note: str) -> dict:
    """Run once for the output, then time; an exception becomes the row's error, not the script's."""
    try:
        out = fn().clone()
        return {"variant": label, "ms": pb.time_ms(fn, args.reps, args.warmup, args.budget_s), "note": note, "out": out}
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return {"variant": label, "error": f"{type(exc).__name__}: {first}"[:200]}


def our_rows(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args) -> list[dict]:
    """Rows for our kernel: pre-pass + attention, attention alone, pre-pass alone."""
    tokens = q.shape[0]
    cu = pb.cu_seqlens(tokens)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    prepass = attn.prepass()
    which = "CUDA pre-pass" if prepass is not attn.reference.smooth_quant else "torch pre-pass"
    out = torch.empty_like(q)
    qi, qs, ki, ks = prepass(q, k, cu, tokens)
    rows = [
        _try_row("ours (pre-pass + attn)", lambda: attn.int8_prefill_attention(q, k, v, cu, tokens, scale, out=out),
                 args, which),
        _try_row("ours (attn only)", lambda: attn.attn_int8(qi, qs, ki, ks, v, cu, tokens, scale, out=out), args,
                 f"tiles {tuple(attn.tiles_for(attn.arch_family(torch.cuda.get_device_capability()), HEAD_DIM))}"),
        _try_row("ours (pre-pass only)", lambda: prepass(q, k, cu, tokens)[0], args, which),
    ]
    rows[2].pop("out", None)
    return rows


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ over the whole tensor, in fp32."""
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def bench_length(attn, tokens: int, args, ceilings: dict[str, float]) -> list[dict]:
    """Every row for one sequence of ``tokens`` tokens, with throughput and error against (a)."""
    q, k, v = pb.inputs(tokens)
    rows = our_rows(attn, q, k, v, args) + sdpa_rows(q, k, v, args) + vllm_rows(q, k, v, args)
    flash = next((r for r in rows if r["variant"] == "(a) sdpa flash" and "ms" in r), None)
    flops = causal_flops(tokens)
    mixed_ms = (flops / 2 / ceilings["int8_tops"] + flops / 2 / ceilings["bf16_tflops"]) / 1e9
    for r in rows:
        r["tokens"] = tokens
        out = r.pop("out", None)
        if "ms" not in r or r["variant"] == "ours (pre-pass only)":  # not attention: no FLOP rate, no speedup
            continue
        r["tflops"] = flops / r["ms"] / 1e9
        if flash is not None:
            r["speedup_vs_flash"] = flash["ms"] / r["ms"]
            if out is not None and flash.get("out") is not None:
                r["rel_err_vs_flash"] = rel_err(out, flash["out"])
        if r["variant"].startswith("ours (attn only)"):
            r["of_mixed_ceiling"] = mixed_ms / r["ms"]
    if flash is not None:
        flash.pop("out", None)
    torch.cuda.empty_cache()
    return rows


SWEEP = [(128, 64, 8, 2), (128, 64, 8, 1), (128, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 128, 8, 1),
         (64, 64, 8, 2), (64, 64, 8, 3), (64, 64, 4, 2), (64, 32, 8, 2), (64, 32, 4, 2)]
"""Tile configurations (BLOCK_M, BLOCK_N, num_warps, num_stages) --sweep-tiles times for this device."""


def sweep_tiles(attn, tokens: int, args) -> None:
    """Time ``attn_int8`` at ``tokens`` with every SWEEP configuration in place of this device's
    TILES entry (restored after); each is checked against the torch emulation first. Prints one
    line each: how TILES' entry for this arch family was chosen."""
    family = attn.arch_family(torch.cuda.get_device_capability())
    key = (family, HEAD_DIM)
    kept = attn.TILES[key]
    q, k, v = pb.inputs(tokens)
    cu = pb.cu_seqlens(tokens)
    parts = attn.reference.smooth_quant(q, k, cu, tokens)
    small = [x[:1000] for x in (q, k, v)]
    cu_small = pb.cu_seqlens(1000)
    small_parts = attn.reference.smooth_quant(small[0], small[1], cu_small, 1000)
    emu = attn.reference.attention_int8_ref(*small_parts, small[2], cu_small, 1 / math.sqrt(HEAD_DIM))
    print(f"tile sweep for {key} at {tokens} tokens (TILES has {tuple(kept)}):")
    try:
        for cfg in SWEEP:
            attn.TILES[key] = attn.Tiles(*cfg)
            try:
                got = attn.attn_int8(*small_parts, small[2], cu_small, 1000, 1 / math.sqrt(HEAD_DIM))
                err = float(attn.reference.rel_err_per_head(got, emu).max())
                ms = pb.time_ms(lambda: attn.attn_int8(*parts, v, cu, tokens, 1 / math.sqrt(HEAD_DIM)), args.reps,
                             args.warmup, args.budget_s)
                tflops = causal_flops(tokens) / ms / 1e9
                print(f"  {cfg}: {ms:8.3f} ms {tflops:6.1f} TFLOP/s, err vs emulation {err:.1e}")
            except Exception as exc:
                print(f"  {cfg}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''}")
    finally:
        attn.TILES[key] = kept


def projection_3090(speedup_bound_source: Path = ROOT / "hardware" / "gpus.toml") -> str:
    """The RTX 3090 gain if both kernels were tensor-core bound: QKᵀ (half the work) at the card's
    int8/16-bit rate ratio, P·V unchanged — from hardware/gpus.toml, a projection, not a measurement."""
    import tomllib

    card = tomllib.loads(speedup_bound_source.read_text())["cards"]["rtx3090"]
    ratio = card["int8_tops"] / card["fp16_tflops"]
    return (f"projection, not a measurement: on an RTX 3090 (hardware/gpus.toml: int8 {card['int8_tops']} TOPS vs "
            f"fp16 with fp32 accumulate {card['fp16_tflops']} TFLOPS, {ratio:.0f}x) a tensor-core-bound kernel "
            f"gains at most 1 / (0.5 / {ratio:.0f} + 0.5) = {1 / (0.5 / ratio + 0.5):.2f}x over FlashAttention-2")


def versions() -> dict[str, str]:
    """Device, driver-side and library versions the figures belong to, vLLM's among them."""
    info = pb.versions()
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception as exc:
        info["vllm"] = f"not importable ({type(exc).__name__})"
    return info


def print_table(info: dict, ceilings: dict, rows: list[dict]) -> None:
    """The one table, plus the header lines that say what it was measured on."""
    print(f"device {info['device']} ({info['capability']}), torch {info['torch']} (CUDA {info['cuda']}), "
          f"triton {info['triton']}, vllm {info['vllm']}, python {info['python']}")
    print(f"ceilings ({ceilings['n']}³ matmul): int8 torch._int_mm {ceilings['int8_tops']:.0f} TOPS, "
          f"bf16 matmul {ceilings['bf16_tflops']:.0f} TFLOP/s")
    print(f"shape: one sequence, {HQ} q / {HKV} kv heads, head_dim {HEAD_DIM}, bf16, causal")
    head = f"{'tokens':>7} {'variant':<24} {'ms':>9} {'TFLOP/s':>8} {'vs (a)':>7} {'err vs (a)':>10}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "ms" not in r:
            print(f"{r['tokens']:>7} {r['variant']:<24} {'—':>9} {'':>8} {'':>7} {'':>10}  {r.get('error', '')}")
            continue
        sp = f"{r['speedup_vs_flash']:.2f}x" if "speedup_vs_flash" in r else ""
        err = f"{r['rel_err_vs_flash']:.2e}" if "rel_err_vs_flash" in r else ""
        rate = f"{r['tflops']:.1f}" if "tflops" in r else ""
        note = r.get("note", "")
        if "of_mixed_ceiling" in r:
            note += f"; {100 * r['of_mixed_ceiling']:.0f}% of mixed ceiling"
        print(f"{r['tokens']:>7} {r['variant']:<24} {r['ms']:>9.3f} {rate:>8} {sp:>7} {err:>10}  {note}")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure, print the table, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=parse_lengths, default=parse_lengths("1024,4096,16384,65536"),
                   help="comma-separated sequence lengths (one sequence each)")
    p.add_argument("--reps", type=int, default=20, help="timed runs per row (at most; fewer for long rows)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per row before timing")
    p.add_argument("--budget-s", type=float, default=1.5, help="timed seconds per row that set how many reps run")
    p.add_argument("--ceiling-n", type=int, default=8192, help="size of the square matmuls that measure the ceilings")
    p.add_argument("--vllm-block", type=int, default=64, help="KV cache block size for vLLM's paged kernel")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.add_argument("--sweep-tiles", type=int, default=0, metavar="TOKENS",
                   help="instead of the table: time every SWEEP tile configuration at TOKENS tokens")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_attn_bench: no CUDA device (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    attn = load_kernel()
    if args.sweep_tiles:
        sweep_tiles(attn, args.sweep_tiles, args)
        return 0
    attn.warmup(HQ, HKV, HEAD_DIM, torch.bfloat16, "cuda")
    info = versions()
    ceilings = matmul_ceilings(args.ceiling_n, args.reps)
    rows = [r for t in args.lengths for r in bench_length(attn, t, args, ceilings)]
    print_table(info, ceilings, rows)
    at16k = [r for r in rows if r["tokens"] == 16384 and r["variant"] == "ours (pre-pass + attn)" and "ms" in r]
    if at16k and "speedup_vs_flash" in at16k[0]:
        print(f"at 16k: ours (pre-pass + attn) is {at16k[0]['speedup_vs_flash']:.2f}x (a) sdpa flash")
    print(projection_3090())
    if args.json:
        stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        write_json(args.json, {"measured_utc": stamp, "versions": info, "ceilings": ceilings,
                               "projection_3090": projection_3090(),
                               "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM, "dtype": "bf16"},
                               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               "rows": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
