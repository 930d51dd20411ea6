"""Print what mamba-align-checkpoint-order's kept checkpoints cost admissions: knob off vs on.

    .venv/bin/python bench/scripts/mamba_checkpoint_admission.py [--num-blocks N] [--requests N] [--every N]

vLLM's real KVCacheManager (3 mamba "align" groups + 1 attention group, as the tiny and the real
model), driven by rig.capacity.mamba_pool_sim's scheduler loop: independent requests arrive faster than
the pool drains them, so the head of the waiting queue is refused blocks again and again. A kept
checkpoint holds a block that a waiting request could otherwise take. Seconds, no server.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rig.capacity import mamba_pool_sim as sim  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = sim.AdmissionWorkload()
    ap.add_argument("--num-blocks", type=int, default=d.num_blocks)
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--every", type=int, default=d.every)
    ap.add_argument("--max-seqs", type=int, default=d.max_seqs)
    args = ap.parse_args(argv)
    w = replace(d, num_blocks=args.num_blocks, requests=args.requests, every=args.every, max_seqs=args.max_seqs)
    off, on = sim.run_admissions(w, False), sim.run_admissions(w, True)
    print(sim.admission_report(w, off, on))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
