"""Where a kernel's warps wait, by loop region: an Nsight Compute source page (SASS) split at the kernel's loops.

    ncu --set full --import-source yes -k regex:NAME -c 1 -o REPORT python3 ...
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SASS.csv
    python bench/scripts/ncu_regions.py SASS.csv [--top 12] [--json OUT]

The page has one row an instruction with its warp-state samples (all, and by stall reason) and how often it ran.
This script finds the loops (a branch back to an earlier address), takes the innermost one (the shortest of at
least --least instructions) and the outermost, and sums the samples of: the prologue, the outer loop before the
inner one (for a decode split kernel: a group's start), the inner loop (its tiles), the outer loop after it (a
group's end) and the epilogue; each with its main stall reasons, then the --top instructions by samples. What it
answers: which part of the kernel its time goes to, and whether warps there wait on memory (long_sb, lg), on a
dependent instruction (wait, short_sb) or issue (selected). Reads the CSV only; no GPU needed.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rig.atomic import write_atomic  # noqa: E402

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(text: str) -> float:
    """A CSV cell as a number (ncu writes thousands separators; an empty cell is 0)."""
    text = text.replace(",", "").strip()
    return float(text) if text else 0.0


def read(path: Path) -> tuple[list[str], list[list[str]]]:
    """(header, instruction rows) of ncu's source-page CSV: its first line names the kernel, its second the columns."""
    rows = list(csv.reader(path.open()))
    at = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if at is None or SAMPLES not in rows[at]:
        raise SystemExit(f"{path}: not an ncu source page with warp-state samples (want a row starting 'Address' and "
                         f"a column {SAMPLES!r}: ncu -i REPORT --page source --csv --print-source sass)")
    return rows[at], [r for r in rows[at + 1:] if r and r[0].startswith("0x")]


def regions(header: list[str], rows: list[list[str]], least: int = 64) -> list[dict]:
    """The kernel split at its innermost and outermost loops: per region its instructions, samples, executed count
    and samples by stall reason (the reasons' 'stall_' columns, not the 'Not Issued' ones)."""
    col = {h: i for i, h in enumerate(header)}
    addr = [int(r[0], 16) for r in rows]
    loops = [(int(m.group(1), 16), a) for a, r in zip(addr, rows, strict=True)
             if (m := re.search(r"\bBRA (0x[0-9a-f]+)", r[1])) and int(m.group(1), 16) < a]
    loops = [(a, b) for a, b in loops if sum(a <= x <= b for x in addr) >= least]
    if not loops:
        raise SystemExit("no loop of at least --least instructions in the page: nothing to split at")
    inner, outer = min(loops, key=lambda s: s[1] - s[0]), max(loops, key=lambda s: s[1] - s[0])
    bounds = [("prologue", addr[0], outer[0] - 1), ("outer loop, before the inner", outer[0], inner[0] - 1),
              ("inner loop", inner[0], inner[1]), ("outer loop, after the inner", inner[1] + 1, outer[1]),
              ("epilogue", outer[1] + 1, addr[-1])]
    if inner == outer:
        bounds = [("prologue", addr[0], inner[0] - 1), ("inner loop", *inner), ("epilogue", inner[1] + 1, addr[-1])]
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for name, lo, hi in bounds:
        sel = [r for a, r in zip(addr, rows, strict=True) if lo <= a <= hi]
        out.append({"region": name, "instructions": len(sel), "samples": sum(_num(r[col[SAMPLES]]) for r in sel),
                    "executed": sum(_num(r[col[EXECUTED]]) for r in sel),
                    "stalls": {h.removeprefix("stall_"): sum(_num(r[col[h]]) for r in sel) for h in stalls}})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path, help="ncu -i REPORT --page source --csv --print-source sass > this file")
    ap.add_argument("--least", type=int, default=64, help="a loop's fewest instructions (shorter: spin loops)")
    ap.add_argument("--top", type=int, default=12, help="instructions listed by samples")
    ap.add_argument("--json", type=Path, help="also write the regions as JSON (atomically)")
    a = ap.parse_args()
    if not a.csv.is_file():
        print(f"{a.csv}: no such file (ncu -i REPORT --page source --csv --print-source sass > FILE)", file=sys.stderr)
        return 2
    header, rows = read(a.csv)
    parts = regions(header, rows, a.least)
    total = sum(p["samples"] for p in parts) or 1.0
    print(f"{a.csv.name}: {len(rows)} instructions, {total:,.0f} warp-state samples\n")
    print("| region | instructions | samples | share | executed | main stall reasons (share of the region) |")
    print("|---|---:|---:|---:|---:|---|")
    for p in parts:
        top = sorted(p["stalls"].items(), key=lambda kv: -kv[1])[:4]
        why = ", ".join(f"{k} {100 * v / (p['samples'] or 1):.0f} %" for k, v in top if v)
        print(f"| {p['region']} | {p['instructions']} | {p['samples']:,.0f} | {100 * p['samples'] / total:.1f} % | "
              f"{p['executed']:,.0f} | {why} |")
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    print(f"\ntop {a.top} instructions by samples:")
    for r in sorted(rows, key=lambda r: -_num(r[col[SAMPLES]]))[:a.top]:
        why = max(stalls, key=lambda h: _num(r[col[h]]))
        print(f"  {r[0]}  {_num(r[col[SAMPLES]]):7,.0f}  {why.removeprefix('stall_'):14s} {r[1].strip()[:70]}")
    if a.json:
        write_atomic(a.json, json.dumps({"csv": a.csv.name, "regions": parts}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
