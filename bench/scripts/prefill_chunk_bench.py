"""A prompt's later chunk over its cached prefix on this GPU: rig's int8 route beside vLLM's FlashAttention.

What the engine does per attention layer when a chunk of C queries follows P cached tokens (the served
model's shape: 24 query / 4 KV heads, head_dim 256, bf16; one sequence; vLLM 0.28's FlashAttention cache
layout, logical [blocks, kv heads, --block, 2 × head_dim], blocks scattered):

- fa2 / fa3: ``flash_attn_varlen_func`` from the installed vLLM on the paged cache, as its FlashAttention
  backend calls it (fa_version 2 is what an RTX 3090 runs; 3 is the H100/H200's);
- ours: what ``vllm_route`` does for a routed chunk — the keys of prefix and chunk gathered from the paged
  cache (``_cached_keys``, the step's gather index built once beforehand as the engine builds it once per
  step), then ``int8_prefill_attention_prefix`` (torch pre-pass over all P + C keys, then the kernel);
  "gather" and "kernel" split that time.

Each output's relative L2 error against fa2 is printed beside it. Times are CUDA-event medians
(rig.kernels.prefill_bench.time_ms). This decides whether routing chunks pays and from how many queries
(vllm_route.CHUNK_MIN_QUERIES, 512 until measured).

    python bench/scripts/prefill_chunk_bench.py [--cases 512:15872,2048:2048,2048:6144,2048:14336]
        [--block 800] [--json OUT]

Exits 2 without CUDA; a FlashAttention version that cannot be imported or run gets its reason in its column.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rig.atomic import write_json  # noqa: E402
from rig.kernels import prefill_bench as pb  # noqa: E402
from rig.kernels.prefill_bench import HEAD_DIM, HKV, HQ  # noqa: E402

ROUTE = ROOT / "kernels" / "int8-prefill-attn" / "vllm_route.py"


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'2048:14336,512:1536' → [(2048, 14336), (512, 1536)]: (chunk queries, cached prefix tokens)."""
    out = []
    for part in text.split(","):
        c, _, p = part.partition(":")
        if not (c.strip().isdigit() and p.strip().isdigit()) or int(c) < 1:
            raise argparse.ArgumentTypeError(f"--cases: {part!r} is not CHUNK:PREFIX (positive CHUNK, PREFIX >= 0)")
        out.append((int(c), int(p)))
    return out


def load_route():
    spec = importlib.util.spec_from_file_location("rig_int8_prefill_route", ROUTE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def setup(chunk: int, prefix: int, block: int):
    """q of the chunk, the whole sequence's K/V in a paged cache, its block table and offsets."""
    import torch

    keys = chunk + prefix
    gen = torch.Generator(device="cuda").manual_seed(keys)
    q = torch.randn(chunk, HQ, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    kv = torch.randn(keys, HKV, 2 * HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    nblocks = (keys + block - 1) // block
    ids = torch.randperm(2 * nblocks + 1, device="cuda", generator=gen)[:nblocks].to(torch.int32)
    memory = torch.zeros(2 * nblocks + 1, block, HKV, 2 * HEAD_DIM, device="cuda", dtype=torch.bfloat16)  # NHD
    pos = torch.arange(keys, device="cuda")
    memory[ids[pos // block].long(), pos % block] = kv
    cache = memory.permute(0, 2, 1, 3)  # logical (blocks, H, N, 2D), as vLLM 0.28 hands it to the backend
    return {"q": q, "cache": cache, "table": ids.view(1, -1), "cu_q": pb.cu_seqlens(chunk),
            "cu_k": pb.cu_seqlens(keys), "seqused_k": torch.tensor([keys], dtype=torch.int32, device="cuda"),
            "keys": keys}


def fa_call(version: int, d: dict, scale: float):
    """vLLM's FlashAttention on the paged cache, or the reason it cannot run here."""
    try:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - any import failure is reported, not raised
        return f"import: {type(e).__name__}: {e}"[:80]
    import torch

    key_cache, value_cache = d["cache"].transpose(1, 2).split(HEAD_DIM, dim=-1)
    out = torch.empty_like(d["q"])

    def run():
        flash_attn_varlen_func(q=d["q"], k=key_cache, v=value_cache, out=out, cu_seqlens_q=d["cu_q"],
                               max_seqlen_q=d["q"].shape[0], seqused_k=d["seqused_k"], max_seqlen_k=d["keys"],
                               softmax_scale=scale, causal=True, block_table=d["table"], fa_version=version)
        return out
    try:
        run()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return f"fa{version}: {type(e).__name__}: {e}"[:80]
    return run


def ours(route, d: dict, scale: float):
    """(gather, kernel, both) callables: the route's own gather and the prefix kernel."""
    import numpy as np

    chunk = d["q"].shape[0]
    plan = route.StepPlan(first=0, last=1, token_start=0, token_end=chunk, max_seqlen=chunk, rest_max_query_len=0,
                          rest_max_seq_len=0, query_start_loc=d["cu_q"], key_lens=np.array([d["keys"]]),
                          block_table=d["table"], with_prefix=1)
    impl = SimpleNamespace(head_size=HEAD_DIM, kv_cache_dtype="auto", scale=scale)
    layer = SimpleNamespace(kv_cache=d["cache"])
    attn = route.attn_module()
    plan.gather_index(d["cache"].shape[2], d["cache"].device)  # once per step in the engine
    got = route._cached_keys(plan, impl, layer, d["q"].dtype)
    if isinstance(got, str):
        raise SystemExit(f"prefill_chunk_bench: the route refused the cache: {got}")

    def gather():
        return route._cached_keys(plan, impl, layer, d["q"].dtype)

    def kernel(kv=got):
        return attn.int8_prefill_attention_prefix(d["q"], kv[0], kv[1], d["cu_q"], kv[2], chunk, scale)

    def both():
        return kernel(gather())
    return gather, kernel, both


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=parse_cases, default=parse_cases("512:15872,2048:2048,2048:6144,2048:14336"))
    ap.add_argument("--block", type=int, default=800, help="tokens a cache block (the real plan's 800)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("prefill_chunk_bench: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if a.block % 16:
        print(f"prefill_chunk_bench: --block {a.block}: FlashAttention needs a multiple of 16", file=sys.stderr)
        return 2
    route = load_route()
    scale = HEAD_DIM ** -0.5
    meta = pb.versions()
    print(f"{meta['device']} ({meta['capability']}), torch {meta['torch']}, triton {meta['triton']}; "
          f"{HQ}/{HKV} heads × {HEAD_DIM}, bf16, block {a.block}; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print("| chunk | prefix | fa2 ms | fa3 ms | ours ms (gather + kernel) | ours vs fa2 | err vs fa2 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for chunk, prefix in a.cases:
        d = setup(chunk, prefix, a.block)
        fa = {v: fa_call(v, d, scale) for v in (2, 3)}
        ms = {v: pb.time_ms(f, a.reps, a.warmup, 10.0) if callable(f) else f for v, f in fa.items()}
        gather, kernel, both = ours(route, d, scale)
        t_g, t_k, t_b = (pb.time_ms(f, a.reps, a.warmup, 10.0) for f in (gather, kernel, both))
        err = rel(both(), fa[2]()) if callable(fa[2]) else None
        speed = f"{ms[2] / t_b:.2f}×" if isinstance(ms[2], float) else "—"
        cells = [f"{m:.3f}" if isinstance(m, float) else m for m in (ms[2], ms[3])]
        print(f"| {chunk:,} | {prefix:,} | {cells[0]} | {cells[1]} | {t_b:.3f} ({t_g:.3f} + {t_k:.3f}) | {speed} "
              f"| {'—' if err is None else f'{err:.2e}'} |")
        rows.append({"chunk": chunk, "prefix": prefix, "fa2_ms": ms[2], "fa3_ms": ms[3], "ours_ms": t_b,
                     "gather_ms": t_g, "kernel_ms": t_k, "rel_err_vs_fa2": err})
        del d
        torch.cuda.empty_cache()
    if a.json:
        write_json(a.json, {"facts": {**meta, "block": a.block}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
