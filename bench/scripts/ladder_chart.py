"""The configuration ladder of a GPU run against the reference's: a markdown table on stdout, a PNG.

    python bench/scripts/ladder_chart.py RUN [--out PNG]

RUN is bench/scripts/gpu_session.sh's OUT of a `ladder` step (one folder a rung, each with its
result.json; e.g. docs/gpu-runs/2026-12-05-h200-ladder). The reference's rungs and figures are
bench/reference/ladder.toml; rig.bench.ladder does the work. Exit 2 naming the folder when it
holds no rung.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rig.bench import ladder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a ladder run folder (one subfolder a rung)")
    ap.add_argument("--out", type=Path, help="the PNG (default RUN/ladder.png)")
    a = ap.parse_args()
    try:
        text, png = ladder.write(a.run, a.out)
    except ValueError as e:
        print(f"ladder_chart: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    print(f"\n{png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
