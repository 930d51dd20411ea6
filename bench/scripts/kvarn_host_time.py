"""Host time of one eager KVarN decode_attention call on a GPU, optionally beside an older kernels file.

Eager calls pay Python and Triton's launch path on the host; when that is longer than the GPU's work the GPU
waits (docs/kvarn.md, "Eager calls pay the host"). This times ``--calls`` eager calls at 8 x ``--tokens`` (short,
so the GPU keeps up and the loop measures the host), per variant, for this tree's kernels/kvarn/kvarn_triton.py
and, with ``--old PATH`` (e.g. ``git show REV:kernels/kvarn/kvarn_triton.py > /tmp/old/kvarn_triton.py``, its
siblings beside it), that file's, alternating for ``--rounds`` rounds (a VM's host time drifts between rounds:
compare within one). Then the two outputs' largest difference and a cProfile of this tree's calls.

    python bench/scripts/kvarn_host_time.py [--old /tmp/old/kvarn_triton.py] [--variants v5,v3] [--rounds 2]

Exits 2 without CUDA (the host cost of a launch is a CUDA launch's).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kvarn_bench as kb  # noqa: E402

from rig.kernels import load_file  # noqa: E402


def host_us(kt, x: dict, variant: str, calls: int) -> float:
    """Mean host microseconds of one eager call of ``kt``'s decode_attention (kvarn_bench.host_time)."""
    return kb.host_time(lambda: kt.decode_attention(x["q"], *x["args"], variant=variant), calls) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, help="an older kvarn_triton.py (its siblings beside it) to time beside")
    ap.add_argument("--variants", default="v5,v3", help="comma-separated decode variants")
    ap.add_argument("--tokens", type=int, default=1024, help="context a sequence (a multiple of 128)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    if a.old is not None and not a.old.is_file():
        print(f"--old {a.old}: no such file (write one with git show REV:kernels/kvarn/kvarn_triton.py)",
              file=sys.stderr)
        return 2
    if a.tokens <= 0 or a.tokens % kb.GROUP or a.calls <= 0 or a.rounds <= 0 or not variants:
        print(f"--tokens: a positive multiple of {kb.GROUP}; --calls, --rounds: positive; --variants: at least one",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: the host time of a launch is measured on a GPU host", file=sys.stderr)
        return 2
    new = kb.load_kernels(False)
    bad = [v for v in variants if v not in new.DECODE_DEFAULTS]
    if bad:
        print(f"--variants {bad}: one of {sorted(new.DECODE_DEFAULTS)}", file=sys.stderr)
        return 2
    old = load_file(a.old.resolve(), "rig_kernel_kvarn_triton_old", fresh=True) if a.old else None
    x = kb.decode_setup(new, a.tokens, 8, torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host µs a call, {a.calls} eager calls at 8 x "
          f"{a.tokens} tokens")
    for rnd in range(a.rounds):
        for v in variants:
            before = f"old {host_us(old, x, v, a.calls):8.1f}   " if old else ""
            print(f"round {rnd} {v}: {before}this tree {host_us(new, x, v, a.calls):8.1f}", flush=True)
    if old:
        diff = (old.decode_attention(x["q"], *x["args"]).float() - new.decode_attention(x["q"], *x["args"]).float())
        print(f"old vs this tree, default variant: max abs diff {diff.abs().max().item():.3g}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        new.decode_attention(x["q"], *x["args"])
    prof.disable()
    torch.cuda.synchronize()
    print("cProfile, 200 calls of this tree's default variant:")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
