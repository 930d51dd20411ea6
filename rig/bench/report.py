"""What a run shows: rich progress while it runs; markdown tables and PNG plots when it is done.

The tables take the reference's shapes (../reference batch-mode "Benchmarks", "Prefill",
"Raw-engine cells", cohort and "Shared prompts" tables) so a run reads side by side with it.
With ``--repeat`` > 1 a cell shows the median and, in brackets, the spread of its passes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rig.atomic import write_atomic
from rig.bench.results import CellResult, RunResult


class Progress:
    """A rich progress bar (passes done, streamed tokens); a no-op when disabled."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._p = None
        self._task = None
        self._tokens = 0
        self._shown = 0.0

    def start(self, desc: str, total: int, tokens: bool = False) -> None:
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        if self._p is None:
            self._p = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                   TextColumn("{task.fields[tokens]}"), TimeElapsedColumn())
            self._p.start()
        self._tokens = 0
        self._task = self._p.add_task(desc, total=total, tokens="")

    def describe(self, desc: str) -> None:
        if self._p is not None and self._task is not None:
            self._p.update(self._task, description=desc)

    def advance(self) -> None:
        if self._p is not None and self._task is not None:
            self._p.advance(self._task)

    def token(self) -> None:
        """Called per streamed chunk: counts, and redraws at most 5 times a second."""
        if self._p is None:
            return
        self._tokens += 1
        now = time.monotonic()
        if now - self._shown > 0.2:
            self._shown = now
            self._p.update(self._task, tokens=f"{self._tokens} tokens streamed")

    def stop(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


# -- formatting ---------------------------------------------------------------------------------
def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}" if abs(v) >= 10 else f"{v:,.2f}"


def fmt(cell: CellResult, figure: str, unit: str = "", scale: float = 1.0, prefix: str = "") -> str:
    """Median of a figure with its unit, and its spread when there were several passes; '—' if absent."""
    s = cell.summary.get(figure)
    if s is None:
        return "—"
    text = f"{prefix}{_num(s.median * scale)}{unit}"
    return f"{text} (±{s.spread_pct / 2:.1f}%)" if s.n > 1 else text


def fmt_ms(cell: CellResult, figure: str, star: bool = False) -> str:
    s = cell.summary.get(figure)
    if s is None:
        return "—"
    text = fmt(cell, figure, " s", 1 / 1000) if s.median >= 1000 else fmt(cell, figure, " ms")
    return text + ("*" if star else "")


def _queue(cell: CellResult) -> bool:
    return any("queue time" in f for f in cell.flags)


def _ref(cell: CellResult) -> dict[str, Any]:
    return cell.params.get("ref") or cell.params


def _capped(cell: CellResult) -> bool:
    return cell.summary.get("steady_decode_tok_per_s") is None and cell.summary.get(
        "steady_decode_capped_tok_per_s") is not None


def _steady(cell: CellResult) -> str:
    """The steady-state decode column: the figure at the cell's concurrency, else the seat-capped one, marked."""
    if not _capped(cell):
        return fmt(cell, "steady_decode_tok_per_s", prefix="~")
    running = cell.summary.get("steady_running")
    at = f" at {running.median:.0f} running" if running is not None else ""
    return f"— (~{fmt(cell, 'steady_decode_capped_tok_per_s')}{at}†)"


def table(r: RunResult) -> str:
    """The markdown table(s) of one run, shaped like the reference's."""
    kind = r.protocol_kind
    lines: list[str]
    if kind == "throughput":
        lines = ["| workload | steady-state decode | output tok/s (e2e) | median TPOT | median TTFT |",
                 "|---|---|---|---|---|"]
        lines += [f"| {c.label} | {_steady(c)} | {fmt(c, 'output_tok_per_s')} "
                  f"| {fmt_ms(c, 'median_tpot_ms')} | {fmt_ms(c, 'median_ttft_ms', _queue(c))} |" for c in r.cells]
        if any(_queue(c) for c in r.cells):
            lines += ["", "*TTFT at saturation is queue time — the bench fires all requests at once."]
        if any(_capped(c) for c in r.cells):
            lines += ["", "†Seat-capped: the server held fewer requests at once than the cell's concurrency (its KV "
                          "pool's seats); the figure is its decode at that count, not at the cell's."]
    elif kind == "prefill":
        lines = _prefill_table(r)
    elif kind == "raw":
        lines = ["| cell | PP / TG-agg | TG per stream | tokens per round |", "|---|---|---|---|"]
        lines += [f"| {c.label} | {fmt(c, 'pp_tok_per_s')} / {fmt(c, 'tg_agg_tok_per_s', ' tok/s')} "
                  f"| {fmt(c, 'tg_per_stream_tok_per_s', ' tok/s')} | {fmt(c, 'tokens_per_round')} |" for c in r.cells]
    elif kind == "cohort":
        lines = ["| Cohort | e2e throughput | decode throughput | mean TTFT |", "|---|---|---|---|"]
        lines += [f"| {c.label} | {fmt(c, 'e2e_tok_per_s', ' tok/s')} | {fmt(c, 'decode_tok_per_s', ' tok/s')} "
                  f"| {fmt_ms(c, 'mean_ttft_ms')} |" for c in r.cells]
    elif kind == "shared-prefix":
        c0 = r.cells[0].params if r.cells else {}
        lines = [f"| {c0.get('num_requests')} requests sharing a {c0.get('system_prompt_tokens')}-token system "
                 f"prompt, concurrency {c0.get('concurrency')} | wall | output | median latency | p90 |",
                 "|---|---|---|---|---|"]
        lines += [f"| {c.label} ({', '.join(f'{k}={v}' for k, v in c.params.get('knobs', {}).items())}) "
                  f"| {fmt(c, 'wall_s', ' s')} | {fmt(c, 'output_tok_per_s', ' tok/s')} "
                  f"| {fmt(c, 'median_latency_s', ' s')} | {fmt(c, 'p90_latency_s', ' s')} |" for c in r.cells]
        lines += [""] + [f"{k}: **{v:.2f}x**" for k, v in r.derived.items() if v is not None]
    else:  # long
        lines = ["| workload | prompt tok/s | output tok/s | median TTFT | median TPOT | wall |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {c.label} | {fmt(c, 'prompt_tok_per_s')} | {fmt(c, 'output_tok_per_s')} "
                  f"| {fmt_ms(c, 'median_ttft_ms')} | {fmt_ms(c, 'median_tpot_ms')} | {fmt(c, 'duration_s', ' s')} |"
                  for c in r.cells]
    return "\n".join(lines) + "\n"


def _prefill_table(r: RunResult) -> list[str]:
    rows: dict[int, dict[str, CellResult]] = defaultdict(dict)
    for c in r.cells:
        ref = _ref(c)
        col = "1" if ref["concurrency"] == 1 else "4" if ref["concurrency"] <= 4 else "8-16"
        rows[ref["input_len"]][col] = c
    lines = ["| input length | conc 1 | conc 4 | conc 8-16 | single-request TTFT |", "|---|---|---|---|---|"]
    for n in sorted(rows):
        cols = rows[n]
        name = f"{n // 1024}k" if n >= 1024 else str(n)
        scaled = cols[next(iter(cols))].params["input_len"]
        if scaled != n:
            name += f" [scaled: {scaled}]"
        cells = [fmt(cols[k], "prompt_tok_per_s", " tok/s") if k in cols else "—" for k in ("1", "4", "8-16")]
        ttft = fmt_ms(cols["1"], "median_ttft_ms") if "1" in cols else "—"
        lines.append(f"| {name} | {' | '.join(cells)} | {ttft} |")
    return lines


def render_markdown(r: RunResult) -> str:
    fp = r.fingerprint
    head = [f"# bench {r.protocol} — profile {r.profile}", "",
            f"{r.protocol_def.get('description', '')}", "",
            f"- valid: **{'yes' if r.valid else 'NO'}**" + ("" if r.valid else f" — {'; '.join(r.problems)}"),
            f"- started {r.started_utc}, finished {r.finished_utc}; repeat {r.repeat}; "
            f"scale {r.scale.get('factor')}; seeds {r.seeds[0] if r.seeds else '-'}..{r.seeds[-1] if r.seeds else '-'}",
            f"- rig {fp.get('rig', {}).get('sha')}"
            + (" **with uncommitted changes**" if fp.get("rig", {}).get("dirty") else "")
            + f", plan {fp.get('plan', {}).get('sha256', '')[:12]}"]
    if r.server:
        who = r.server.get("started_by", "?")
        head.append(f"- server: {who} at {r.server.get('url')}"
                    + (f", pid {r.server['pid']}" if r.server.get("pid") else "")
                    + (f", plan {r.server['plan_digest'][:12]}" if r.server.get("plan_digest") else
                       f", vLLM {r.server.get('version')}, models {[m.get('id') for m in r.server.get('models', [])]}"))
    head += [f"- {n}" for n in r.notes]
    flags = sorted({f"{c.label}: {f}" for c in r.cells for f in c.flags if "queue time" not in f})
    head += [f"- flag: {f}" for f in flags]
    return "\n".join(head) + "\n\n" + table(r)


# -- plots ----------------------------------------------------------------------------------------
def _series_vs_concurrency(r: RunResult) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for c in r.cells:
        p = c.params
        if r.protocol_kind == "throughput":
            shape = f"{_ref(c)['input_len']}/{_ref(c)['output_len']}"
            for fig, name in (("output_tok_per_s", "e2e"), ("steady_decode_tok_per_s", "steady decode")):
                if (v := c.median(fig)) is not None:
                    out[f"{shape} {name}"].append((p["concurrency"], v))
        elif r.protocol_kind == "cohort":
            for fig in ("e2e_tok_per_s", "decode_tok_per_s"):
                if (v := c.median(fig)) is not None:
                    out[fig.replace("_tok_per_s", "")].append((p["cohort"], v))
        elif r.protocol_kind == "raw":
            for fig in ("tg_agg_tok_per_s", "pp_tok_per_s"):
                if (v := c.median(fig)) is not None:
                    out[fig.replace("_tok_per_s", "")].append((p["concurrency"], v))
    return out


def plot_all(r: RunResult, rows: list[dict[str, Any]], folder: Path) -> dict[str, str]:
    """PNG plots for this run; returns name -> file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: dict[str, str] = {}

    def save(fig: Any, name: str) -> None:
        import io

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        write_atomic(folder / f"{name}.png", buf.getvalue())
        files[name] = f"{name}.png"

    series = _series_vs_concurrency(r)
    if series:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, pts in series.items():
            pts = sorted(pts)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
        ax.set(xlabel="concurrency", ylabel="tokens/s", title=f"{r.protocol}: throughput vs concurrency")
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
        save(fig, "throughput_vs_concurrency")
    if r.protocol_kind == "prefill":
        by_c: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for c in r.cells:
            if (v := c.median("prompt_tok_per_s")) is not None:
                by_c[c.params["concurrency"]].append((c.params["input_len"], v))
        fig, ax = plt.subplots(figsize=(6, 4))
        for conc, pts in sorted(by_c.items()):
            pts = sorted(pts)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"concurrency {conc}")
        ax.set(xlabel="input length (tokens)", ylabel="prompt tokens/s", title=f"{r.protocol}: prefill vs length")
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
        save(fig, "prefill_vs_length")
    kept = [x for x in rows if x.get("ok") and not x.get("warmup")]
    if kept:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for cell in sorted({x["cell"] for x in kept}):
            sub = [x for x in kept if x["cell"] == cell]
            ttft = [x["ttft_ms"] for x in sub if x.get("ttft_ms") is not None]
            tpot = [x["tpot_ms"] for x in sub if x.get("tpot_ms") is not None]
            if ttft:
                a1.hist(ttft, bins=30, alpha=0.5, label=cell)
            if tpot:
                a2.hist(tpot, bins=30, alpha=0.5, label=cell)
        a1.set(xlabel="TTFT (ms)", ylabel="requests", title="TTFT distribution")
        a2.set(xlabel="TPOT (ms)", ylabel="requests", title="TPOT distribution")
        a1.legend(fontsize=6)
        save(fig, "ttft_tpot_distributions")
    return files


def write_all(r: RunResult, rows: list[dict[str, Any]], folder: Path) -> dict[str, str]:
    """tables.md and the plots; returns name -> file name for result.files."""
    write_atomic(folder / "tables.md", render_markdown(r))
    return {"tables": "tables.md", **plot_all(r, rows, folder)}
