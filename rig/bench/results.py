"""The result of one bench run: a typed, self-describing JSON document plus its sidecar files.

One folder per run under ``rig.paths.results_dir()``::

    <utc>-<protocol>-<profile>/
      result.json      RunResult below (documented field by field; docs/bench.md)
      requests.jsonl   one line per request: cell, pass, seed, ttft_ms, tpot_ms, e2e_ms, itl_ms, ...
      tables.md        the reference's tables, filled from result.json
      *.png            plots (matplotlib, Agg)
      vllm-bench/      each `vllm bench serve` call's own JSON and log

Every file is written atomically (temp file + rename), and result.json is rewritten after every
pass, so a run that dies still leaves everything it measured.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rig.atomic import write_atomic


class Spread(BaseModel):
    """Median and spread of one figure over the kept passes."""

    median: float = Field(description="median over the kept (non-warm-up) passes")
    min: float = Field(description="smallest pass")
    max: float = Field(description="largest pass")
    spread_pct: float = Field(description="(max - min) / median x 100")
    n: int = Field(description="passes it rests on")


def spread(values: list[float]) -> Spread | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    med = statistics.median(vals)
    return Spread(median=med, min=min(vals), max=max(vals),
                  spread_pct=(max(vals) - min(vals)) / med * 100 if med else 0.0, n=len(vals))


class PassResult(BaseModel):
    """One pass of one cell (a `vllm bench serve` call, or one batch of our client)."""

    model_config = ConfigDict(extra="forbid")
    seed: int = Field(description="the seed of this call (distinct per call)")
    warmup: bool = Field(description="true: a discarded warm-up pass, not in any summary")
    ok: bool = Field(description="every request succeeded and every check held")
    problems: list[str] = Field(default_factory=list, description="why ok is false")
    figures: dict[str, float | None] = Field(default_factory=dict, description="measured figures, units in the names")
    steady_state: dict[str, Any] | None = Field(None, description="the /metrics steady-state window, when sampled")
    counters: dict[str, float] = Field(default_factory=dict, description="Δ of vLLM's counters over the pass")
    command: str | None = Field(None, description="the `vllm bench serve` command line, when it was one")
    raw: str | None = Field(None, description="the raw result file of the pass, relative to the run folder")


class CellResult(BaseModel):
    """One workload of a protocol: its parameters, every pass, and the summary of the kept ones."""

    model_config = ConfigDict(extra="forbid")
    label: str = Field(description="the row label, e.g. '128/512, 64 concurrent'")
    variant: str | None = Field(None, description="server variant (shared-prefix: default / prefix_cache)")
    params: dict[str, Any] = Field(description="the cell's parameters after scaling")
    passes: list[PassResult] = Field(default_factory=list, description="warm-up first, then every kept pass")
    summary: dict[str, Spread] = Field(default_factory=dict, description="figure -> median and spread")
    flags: list[str] = Field(default_factory=list, description="notes on how to read the figures")

    def summarize(self) -> None:
        kept = [p for p in self.passes if not p.warmup and p.ok]
        names = sorted({k for p in kept for k in p.figures})
        self.summary = {k: s for k in names if (s := spread([p.figures.get(k) for p in kept])) is not None}

    def median(self, figure: str) -> float | None:
        s = self.summary.get(figure)
        return s.median if s else None


class RunResult(BaseModel):
    """result.json: everything needed to read, trust and reproduce a bench run."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = Field(1, description="format version of this file")
    kind: Literal["bench-result"] = Field("bench-result", description="what this file is")
    protocol: str = Field(description="protocol name (bench/<name>.toml)")
    protocol_kind: str = Field(description="throughput, prefill, raw, cohort, shared-prefix or long")
    protocol_def: dict[str, Any] = Field(description="the protocol file's content, as loaded")
    profile: str = Field(description="profile of the server(s)")
    plan: dict[str, Any] = Field(description="the resolved plan of the (first) server")
    variant_plans: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                                     description="variant -> resolved plan, when variants ran")
    knobs: dict[str, Any] = Field(description="the (first) server's resolved knobs")
    server: dict[str, Any] = Field(default_factory=dict, description=(
        "which server was measured: started_by (rig bench / rig serve (recorded) / external), url, plan_digest, "
        "and for a recorded server its pid and start time; for an external one what /v1/models, /version and "
        "/metrics said"))
    fingerprint: dict[str, Any] = Field(description="rig.fingerprint.collect(plan)")
    scale: dict[str, Any] = Field(description="the size scale applied (factor 1 = the reference's sizes)")
    repeat: int = Field(description="kept passes per cell")
    seeds: list[int] = Field(default_factory=list, description="every seed used, in call order")
    started_utc: str = Field(description="UTC start, ISO 8601")
    finished_utc: str | None = Field(None, description="UTC end; null while running or when it died")
    valid: bool = Field(True, description="false: a request failed, a server died or a sanity rule broke")
    problems: list[str] = Field(default_factory=list, description="why valid is false")
    notes: list[str] = Field(default_factory=list, description="method notes (prefix-cache resets, scaling)")
    cells: list[CellResult] = Field(default_factory=list, description="every workload, in table order")
    not_run: list[str] = Field(default_factory=list, description=(
        "cells never sent: the server died or restarted before them (the run is invalid)"))
    derived: dict[str, float | None] = Field(default_factory=dict,
                                             description="figures across cells (e.g. the prefix-cache speedup)")
    files: dict[str, str] = Field(default_factory=dict, description="name -> file of this run folder")

    def invalidate(self, why: str) -> None:
        self.valid = False
        self.problems.append(why)


class RunDir:
    """A run's folder: atomic writes of result.json, requests.jsonl and the rest."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._requests: list[str] = []

    def add_requests(self, rows: list[dict[str, Any]]) -> None:
        self._requests.extend(json.dumps(r, sort_keys=True) for r in rows)
        write_atomic(self.root / "requests.jsonl", "\n".join(self._requests) + "\n")

    def requests(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self._requests]

    def save(self, result: RunResult) -> Path:
        path = self.root / "result.json"
        write_atomic(path, json.dumps(result.model_dump(), indent=2, sort_keys=True) + "\n")
        return path


def load(path: Path) -> RunResult:
    """A result.json, or the run folder holding it."""
    p = path / "result.json" if path.is_dir() else path
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no result.json there; give a run folder under .rig/results/ or its file")
    return RunResult.model_validate_json(p.read_text())
