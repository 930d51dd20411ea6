"""v4 (the Gluon decode split kernel) against v1 and timed beside v3 and fp16 SDPA: the first GPU check of a kernel.

For each length, 8 sequences (kvarn_bench.decode_setup): fp16 SDPA and decode_attention's default (v3) timed, then
v4 with each unpack and each split count (0: v4's default, V4_SPLITS), each compared with v1 as relative L2 error
of the whole output (the tests hold v4 to v1 within 1e-5 at their small sizes and to the reference's bound at
8 x 32k) and timed (kvarn_bench.timed: CUDA events, median of --iters after 3 warmup). The sweep
(kvarn_decode_sweep.py --only v4) gives the same timings in its table; this prints the error, the
ratios to SDPA and v3, and goes on past a failing config. Exits 2 without CUDA.

    python bench/scripts/kvarn_v4_check.py [--lengths 8192,32768] [--splits 0,128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvarn_bench as kb  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768", help="context lengths (multiples of 128)")
    ap.add_argument("--splits", default="0,128", help="v4 split counts; 0 = v4's default")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations (median)")
    a = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        print("kvarn_v4_check: needs a CUDA GPU (v4 is a compiled Gluon kernel)", file=sys.stderr)
        return 2
    kt = kb.load_kernels(False)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for n in [int(x) for x in a.lengths.split(",")]:
        x = kb.decode_setup(kt, n, 8, dev)
        q, args = x["q"], x["args"]
        ref = kt.decode_attention(q, *args, variant="v1").float()
        t_sdpa = kb.timed(x["sdpa"], dev, 3, a.iters)
        t_v3 = kb.timed(lambda q=q, args=args: kt.decode_attention(q, *args, variant="v3"), dev, 3, a.iters)
        print(f"{n:>6}: fp16 SDPA {t_sdpa * 1e6:8.1f} us   v3 {t_v3 * 1e6:8.1f} us", flush=True)
        for unpack in ("magic", "ptx"):
            for sp in [int(s) for s in a.splits.split(",")]:
                kw = dict(variant="v4", unpack=unpack, splits=sp or None)
                try:
                    got = kt.decode_attention(q, *args, **kw).float()
                    rel = ((got - ref).norm() / ref.norm()).item()
                    t = kb.timed(lambda q=q, args=args, kw=kw: kt.decode_attention(q, *args, **kw), dev, 3,
                                 a.iters)
                except Exception as e:  # noqa: BLE001 - report the config's failure and go on
                    print(f"        v4 {unpack} splits {sp}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                    continue
                print(f"        v4 {unpack:5} splits {sp or 'dflt':>4}: {t * 1e6:8.1f} us  ({t_sdpa / t:4.2f}x SDPA, "
                      f"{t_v3 / t:4.2f}x v3)  rel vs v1 {rel:.2e}", flush=True)
        x = q = args = ref = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
