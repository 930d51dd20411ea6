"""Print the mamba-align-checkpoint-order figures: knob off vs on, on a real CPU `vllm serve`.

    .venv/bin/python bench/scripts/mamba_checkpoint_order.py [--turns N] [--num-blocks N] [--turn-output N]
        [--unrelated-per-turn N] [--sides off,on|off,off|on,on]

Starts two servers one after the other (tiny hybrid model, --enforce-eager, small KV pool), runs
the conversation of rig.bench.mamba_checkpoint on each and prints the table that
docs/patches.md quotes. Needs the patch series applied (`inv patch.apply`); ~2-3 minutes on CPU.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rig import patches  # noqa: E402
from rig.bench import mamba_checkpoint as mb  # noqa: E402
from rig.models.tiny import default_hybrid  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=mb.Scenario.turns)
    ap.add_argument("--num-blocks", type=int, default=mb.Scenario.num_blocks)
    ap.add_argument("--turn-output", type=int, default=mb.Scenario.turn_output)
    ap.add_argument("--unrelated-per-turn", type=int, default=mb.Scenario.unrelated_per_turn)
    ap.add_argument("--sides", default="off,on", choices=["off,on", "off,off", "on,on"],
                    help="the knob on the first and the second server (off,off: two runs of one configuration)")
    args = ap.parse_args(argv)
    st = patches.state()
    if not st.all_applied:
        print("the patch series is not applied to this vLLM: run `inv patch.apply` first", file=sys.stderr)
        return 2
    sc = replace(mb.Scenario(), turns=args.turns, num_blocks=args.num_blocks, turn_output=args.turn_output,
                 unrelated_per_turn=args.unrelated_per_turn)
    first, second = (s == "on" for s in args.sides.split(","))
    off, on = mb.compare(default_hybrid(), sc, knobs=(first, second))
    print(mb.report(sc, off, on))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
