"""KVarN reference (CPU, torch): attention-output error of a KVarN cache beside plain RTN, fp8 and bf16.

For each length (default 1k, 4k, 16k tokens), one layer of this model's attention (24 query /
4 KV heads, head_dim 256) on ``reference.synthetic`` data: Gaussian K and V with a few hot
channels and one outlier-scale token in 128 (the case KVarN exists for), 4 decode queries. The
fp32 attention output softmax(qKᵀ/√d)·V is the reference; each row replaces K and V by their
round trip through one cache format and reports the output's relative L2 error and cosine
similarity, and the format's bytes per token per layer:

- kvarn: kernels/kvarn/reference.py — Hadamard rotation, dual-scaling normalization, RTN,
  K 4-bit / V 2-bit, 128-token groups (bytes from the layout);
- plain RTN: the same layout and bytes, rotation and normalization off (per-token asymmetric RTN);
- fp8: torch float8_e4m3fn round trip, scale 1 (vLLM's default fp8 cache without calibrated scales);
- bf16: torch bfloat16 round trip;
- kvarn, K only / V only: one tensor through kvarn, the other kept fp32 (where the error comes from).

A second table repeats it on plain Gaussian data (``--no-outliers`` only), where the method has
nothing to fix. CPU only: this measures the format's math, not any kernel's speed.

    python bench/scripts/kvarn_reference.py [--lengths 1024,4096,16384] [--seed 0] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rig.kernels import load_file, module_name  # noqa: E402


def load_reference():
    """kernels/kvarn/reference.py as a module (it imports only torch)."""
    return load_file(ROOT / "kernels" / "kvarn" / "reference.py", module_name("kvarn", "reference"))


def rows(r, length: int, seed: int, outliers: bool) -> list[tuple[str, float, float, float]]:
    """(format, rel err, cosine, bytes/token/layer) for one length."""
    q, k, v = r.synthetic(length, seed, outliers=outliers)
    ref = r.attention(q, k, v)
    elems = 2 * r.KV_HEADS * r.HEAD_DIM
    out = []
    for name, rot in (("kvarn", True), ("plain RTN", False)):
        kk = r.roundtrip_cache(k, r.K_BITS, rot, rot)
        vv = r.roundtrip_cache(v, r.V_BITS, rot, rot)
        out.append((name, *r.errors(ref, r.attention(q, kk, vv)), r.token_bytes()))
        if rot:  # where kvarn's error comes from: each tensor quantized alone, the other kept fp32
            out.append(("kvarn, K only (V fp32)", *r.errors(ref, r.attention(q, kk, v)), float("nan")))
            out.append(("kvarn, V only (K fp32)", *r.errors(ref, r.attention(q, k, vv)), float("nan")))
    for name, dtype in (("fp8 e4m3", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
        kk, vv = k.to(dtype).to(torch.float32), v.to(dtype).to(torch.float32)
        out.append((name, *r.errors(ref, r.attention(q, kk, vv)), elems * torch.finfo(dtype).bits / 8))
    return out


def table(r, lengths: list[int], seed: int, outliers: bool) -> str:
    """The markdown table for all lengths."""
    lines = ["| tokens | format | rel. error | cosine | bytes/token/layer |", "|---:|---|---:|---:|---:|"]
    for length in lengths:
        for name, rel, cos, nbytes in rows(r, length, seed, outliers):
            shown = "-" if nbytes != nbytes else f"{nbytes:,.0f}"
            lines.append(f"| {length:,} | {name} | {rel:.4f} | {cos:.4f} | {shown} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384", help="comma-separated cache lengths (multiples of 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--no-outliers", action="store_true", help="also print the plain-Gaussian control table")
    a = ap.parse_args()
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        print(f"--lengths {a.lengths!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    r = load_reference()
    bad = [n for n in lengths if n <= 0 or n % r.GROUP_TOKENS]
    if bad:
        print(f"--lengths: {bad} are not positive multiples of the {r.GROUP_TOKENS}-token group", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    print(f"KVarN reference, torch {torch.__version__}, CPU, seed {a.seed}, 4 queries x 24 heads, "
          f"KV 4 heads x {r.HEAD_DIM}, K {r.K_BITS}-bit / V {r.V_BITS}-bit, group {r.GROUP_TOKENS}, "
          f"{r.NORM_ITERS} normalization rounds")
    print("\nK, V with hot channels and outlier-scale tokens:\n")
    print(table(r, lengths, a.seed, True))
    if a.no_outliers:
        print("\nControl, plain Gaussian K, V (nothing for the method to fix):\n")
        print(table(r, lengths, a.seed, False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
