"""The configuration ladder read against the reference's: ratios to the fp16 rung, a table and a PNG.

Absolute tok/s of a lent H200 say nothing about a 3090; the ladder's *ratios* (what int8 activations
or fp16 state buy over plain W4A16) are what a run can be held against. The reference's figures are
data (bench/reference/ladder.toml, published, typed from its README); the measured ones are each
rung's own result.json in a run folder (bench/scripts/gpu_session.sh writes ``<run>/<rung>/``).
A rung that did not run (no result.json, or a cell that failed) is shown as such, never filled in.
"""

from __future__ import annotations

import io
import json
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from rig import paths
from rig.atomic import write_atomic

LADDER_FILE = paths.ROOT / "bench" / "reference" / "ladder.toml"


class Rung(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    label: str
    knobs: str
    e2e_128_512: float
    e2e_256_256: float
    steady: float


class Ladder(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1]
    kind: Literal["ladder"]
    source: str
    baseline: str
    cell: str
    rungs: list[Rung]

    def rung(self, name: str) -> Rung:
        return next(r for r in self.rungs if r.name == name)


def load(path: Path = LADDER_FILE) -> Ladder:
    """The reference ladder; a ValueError naming the file when it does not validate."""
    try:
        ladder = Ladder.model_validate(tomllib.loads(path.read_text()))
    except (OSError, tomllib.TOMLDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid ladder file ({e})") from None
    if ladder.baseline not in {r.name for r in ladder.rungs}:
        raise ValueError(f"{path}: baseline {ladder.baseline!r} is not one of its rungs")
    return ladder


@dataclass(frozen=True)
class Measured:
    """One rung's kept-pass medians for the ladder's cell, or why there are none."""

    e2e: float | None
    steady: float | None
    why_not: str = ""


def measured(run: Path, rung: str, cell: str) -> Measured:
    """Read ``run/rung/result.json``: the median output tok/s and steady decode of the cell named ``cell``."""
    f = run / rung / "result.json"
    if not f.is_file():
        return Measured(None, None, "not run")
    data = json.loads(f.read_text())
    for c in data.get("cells", []):
        if c.get("label") == cell:
            s = c.get("summary") or {}
            e2e, steady = (s.get(k, {}).get("median") for k in ("output_tok_per_s", "steady_decode_tok_per_s"))
            if e2e is None:
                return Measured(None, None, "no passes")
            return Measured(float(e2e), None if steady is None else float(steady))
    return Measured(None, None, f"no cell {cell!r}")


@dataclass(frozen=True)
class Row:
    rung: Rung
    got: Measured
    ref_e2e_ratio: float
    ref_steady_ratio: float
    e2e_ratio: float | None
    steady_ratio: float | None


def rows(ladder: Ladder, run: Path) -> list[Row]:
    """Every reference rung with its measurement in ``run`` and both as ratios to the baseline rung."""
    base_ref = ladder.rung(ladder.baseline)
    base = measured(run, ladder.baseline, ladder.cell)
    out = []
    for r in ladder.rungs:
        got = measured(run, r.name, ladder.cell)
        e2e = got.e2e / base.e2e if got.e2e and base.e2e else None
        steady = got.steady / base.steady if got.steady and base.steady else None
        out.append(Row(r, got, r.e2e_128_512 / base_ref.e2e_128_512, r.steady / base_ref.steady, e2e, steady))
    return out


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _n(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def table(ladder: Ladder, run: Path) -> str:
    """A markdown table: each rung's measured tok/s and its ratios beside the reference's."""
    head = (f"| rung | e2e | steady | e2e vs {ladder.baseline} (here / reference) "
            f"| steady vs {ladder.baseline} (here / reference) |\n|---|---:|---:|---:|---:|\n")
    body = "".join(
        f"| {r.rung.name} ({r.rung.label}) | {_n(r.got.e2e) if r.got.e2e else r.got.why_not} | {_n(r.got.steady)} "
        f"| {_x(r.e2e_ratio)} / {_x(r.ref_e2e_ratio)} | {_x(r.steady_ratio)} / {_x(r.ref_steady_ratio)} |\n"
        for r in rows(ladder, run))
    return head + body


def chart(ladder: Ladder, run: Path, title: str) -> bytes:
    """Grouped bars, one group a rung: the reference's e2e and steady ratios, then the run's (PNG bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = rows(ladder, run)
    series = [("reference e2e", "ref_e2e_ratio", "#9ecae1"), ("reference steady", "ref_steady_ratio", "#3182bd"),
              ("here e2e", "e2e_ratio", "#fdae6b"), ("here steady", "steady_ratio", "#e6550d")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.2
    for i, (label, attr, color) in enumerate(series):
        xs = [j + (i - 1.5) * width for j in range(len(rs))]
        ys = [getattr(r, attr) or 0.0 for r in rs]
        bars = ax.bar(xs, ys, width, label=label, color=color)
        for b, r in zip(bars, rs, strict=True):
            if getattr(r, attr) is None:
                ax.annotate(r.got.why_not or "—", (b.get_x() + width / 2, 0.02), rotation=90, fontsize=7,
                            ha="center", va="bottom")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(rs)), [f"{r.rung.name}\n" + textwrap.fill(r.rung.label, 18) for r in rs], fontsize=7)
    ax.set_ylabel(f"tok/s relative to {ladder.baseline}")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncols=2)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def write(run: Path, out: Path | None = None, ladder: Ladder | None = None) -> tuple[str, Path]:
    """The table (returned) and the PNG (written atomically to ``out``, default ``run/ladder.png``)."""
    ladder = ladder or load()
    if not run.is_dir():
        raise ValueError(f"{run}: no such run folder (expected bench/scripts/gpu_session.sh's OUT, one folder a rung)")
    if all(r.got.why_not == "not run" for r in rows(ladder, run)):
        names = ", ".join(r.name for r in ladder.rungs)
        raise ValueError(f"{run}: none of the ladder's rungs ({names}) has a result.json there")
    out = out or run / "ladder.png"
    write_atomic(out, chart(ladder, run, f"{run.name}: {ladder.cell}, ratios to {ladder.baseline} "
                                          f"(reference: {ladder.source})"))
    return table(ladder, run), out
