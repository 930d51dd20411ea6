"""Run one protocol against live servers and record everything: the method of the reference, as code.

The method, each point a known trap:
- every call gets its own seed (a reused seed lets the prefix cache serve repeated prompts);
- the first pass on a server is a warm-up, kept in the record but out of every summary;
- ``repeat`` passes per cell are all kept; the summary is their median and spread;
- the prefix cache is reset before a protocol when the server offers it, otherwise a note says so;
- steady-state decode comes from /metrics counters sampled during the pass (rig.bench.metrics);
- a failed request, a dead server or a broken sanity rule marks the run invalid — the run still
  writes everything it measured, and the caller exits non-zero.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from rig import fingerprint, paths
from rig.bench import client, failures, metrics, protocols, report
from rig.bench.protocols import (
    BenchError,
    CohortProtocol,
    LongProtocol,
    PrefillProtocol,
    RandomCell,
    RawProtocol,
    Scale,
    SharedPrefixProtocol,
    ThroughputProtocol,
)
from rig.bench.results import CellResult, PassResult, RunDir, RunResult
from rig.bench.vllm_bench import BenchServeError, ServeArgs, Worker

# Spec-decode acceptance above these is implausible for the drafter on real text: collapsed,
# repetitive generations are what inflate it. Flagged, not failed.
SPEC_PLAUSIBLE_ACCEPTANCE = {"mtp": 0.9, "dflash2": 0.8}


@dataclass
class Target:
    """A live server a protocol runs against, with the plan it was started from."""

    url: str
    headers: dict[str, str]
    served_name: str
    plan: Any
    alive: Callable[[], bool]
    log_path: Path | None = None
    # why the server is no longer the one measured (gone, restarted, silent), None while it is: a running
    # server's record checks pid, start time and /health (rig.running.Record.check)
    gone: Callable[[], str | None] | None = None
    # which server this is, for the result: who started it and how to know it again
    server: dict[str, Any] = field(default_factory=dict)
    # a server of someone else's process: the bench must not assume its knobs (reset, requires)
    foreign: bool = False

    @classmethod
    def of(cls, server: Any, plan: Any) -> Target:
        return cls(server.url, server.headers(), server.served_name or plan.served_name, plan, server.alive,
                   getattr(server, "log_path", None),
                   server={"started_by": "rig bench", "url": server.url, "plan_digest": plan.digest})

    @classmethod
    def of_record(cls, rec: Any) -> Target:
        """The server `serve` recorded (rig.running.Record): its plan, and a liveness check of pid + start time."""
        plan = rec.plan_obj()
        return cls(rec.url, rec.headers(), rec.served_name, plan, lambda: rec.same_process(),
                   Path(rec.log_path) if rec.log_path else None, gone=rec.check,
                   server={"started_by": "rig serve (recorded)", "url": rec.url, "plan_digest": rec.plan_digest,
                           "pid": rec.pid, "start_time": rec.start_time, "recorded_utc": rec.recorded_utc,
                           "fingerprint_at_start": rec.fingerprint})

    def why_gone(self, probe: bool) -> str | None:
        """Why the server can no longer be measured; with probe, a silent server counts too (/health)."""
        if not self.alive():
            return "the server process exited"
        if self.gone is not None:
            return self.gone()
        if probe:
            try:
                r = httpx.get(f"{self.url}/health", timeout=10)
                return None if r.status_code == 200 else f"the server answers /health with HTTP {r.status_code}"
            except httpx.HTTPError as e:
                return f"the server stopped answering /health ({type(e).__name__})"
        return None

    @property
    def tokenizer(self) -> str:
        p = Path(self.plan.model)
        return str(p if p.is_absolute() else paths.ROOT / p)


Acquire = Callable[[dict[str, Any]], AbstractContextManager[Target]]


class ServerDied(RuntimeError):
    """The server under test stopped answering: the run ends here, invalid."""


def check_requires(required: dict[str, Any], plan: Any, what: str) -> None:
    """BenchError when the server's knobs are not what the protocol needs (before anything runs)."""
    bad = [f"{k}={plan.knobs.get(k)!r} (needs {v!r})" for k, v in required.items() if plan.knobs.get(k) != v]
    if bad:
        raise BenchError(f"{what}: the server's knobs do not fit: {', '.join(bad)}; "
                         f"run it with --set {' --set '.join(f'{k}={v}' for k, v in required.items())}")


def reset_prefix_cache(t: Target) -> str:
    """POST /reset_prefix_cache (needs VLLM_SERVER_DEV_MODE=1 in 0.28); a note on what happened."""
    return try_reset(t)[1]


def try_reset(t: Target) -> tuple[bool | None, str]:
    """(reset done: True, not possible: False, not needed: None; the note saying so)."""
    if not t.plan.knobs.get("PREFIX_CACHE"):
        return None, "prefix cache reset: not needed (the server runs with PREFIX_CACHE=0)"
    try:
        r = httpx.post(f"{t.url}/reset_prefix_cache", headers=t.headers, timeout=30)
    except httpx.HTTPError as e:
        return False, f"prefix cache reset: failed ({e}); distinct seeds per call still keep prompts apart"
    if r.status_code == 200 and r.json().get("success"):
        return True, "prefix cache reset: done before the protocol (POST /reset_prefix_cache)"
    if r.status_code == 404:
        return False, ("prefix cache reset: unavailable (vLLM 0.28 serves /reset_prefix_cache only with "
                       "VLLM_SERVER_DEV_MODE=1); distinct seeds per call keep prompts from repeating")
    return False, f"prefix cache reset: refused (HTTP {r.status_code} {r.text[:100]})"


NOT_RESET_WARNING = ("warning: the prefix cache was NOT reset between passes ({why}): every pass used its own "
                     "seeds, so no prompt repeats, but what earlier passes left in the cache may still be hit")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


@dataclass
class Run:
    """One protocol run: call :meth:`execute`; the RunResult says whether it is valid."""

    name: str
    protocol: Any
    acquire: Acquire
    profile: str
    scale: Scale = field(default_factory=Scale)
    repeat: int = 1
    seed: int | None = None
    out: Path | None = None
    progress: bool = True
    sample_interval_s: float = 0.25
    result: RunResult | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.repeat < 1:
            raise BenchError(f"--repeat {self.repeat}: expected an integer >= 1 (passes kept per cell)")
        self._seed = self.seed if self.seed is not None else int(time.time()) % 1_000_000 * 1000
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        self.dir = RunDir(self.out or paths.results_dir() / f"{stamp}-{self.name}-{self.profile}")
        self._bar = report.Progress(enabled=self.progress)
        self._resets: dict[str, dict[str, Any]] = {}
        self.server_died: str | None = None  # why, when the server died or restarted: nothing more is sent

    # -- bookkeeping ---------------------------------------------------------------------------
    def reset_between_passes(self, t: Target) -> None:
        """Reset the prefix cache before a pass where the server allows it; else warn once in the result."""
        state = self._resets.setdefault(t.url, {"ok": None, "n": 0})
        if state["ok"] is False or not t.plan.knobs.get("PREFIX_CACHE"):
            return
        ok, note = try_reset(t)
        if ok:
            state.update(ok=True, n=state["n"] + 1)
            return
        state["ok"] = False
        assert self.result is not None
        self.result.notes.append(NOT_RESET_WARNING.format(why=note.split(": ", 1)[-1].split(";")[0]))

    def next_seed(self) -> int:
        self._seed += 1
        assert self.result is not None
        self.result.seeds.append(self._seed)
        return self._seed

    def _start(self, t: Target) -> RunResult:
        return RunResult(
            protocol=self.name, protocol_kind=self.protocol.kind, protocol_def=self.protocol.model_dump(),
            profile=self.profile, plan={} if t.foreign else t.plan.model_dump(),
            knobs={} if t.foreign else dict(t.plan.knobs),
            fingerprint=fingerprint.collect(None if t.foreign else t.plan), scale=self.scale.model_dump(),
            repeat=self.repeat,
            server=t.server,
            started_utc=datetime.now(UTC).isoformat(timespec="seconds"),
            notes=[] if self.scale.factor == 1 else [
                f"sizes scaled by {self.scale.factor:g} (token lengths and request counts; concurrency capped by "
                f"the server's MAX_SEQS and the request count): not comparable with full-size runs"],
        )

    def _begin(self, t: Target) -> RunResult:
        r = self._start(t)
        if t.foreign:
            r.notes.append(t.server.get("note", "a server rig did not start"))
        return r

    def _save(self) -> None:
        assert self.result is not None
        self.dir.save(self.result)

    def _record(self, cell: CellResult, p: PassResult, rows: list[dict[str, Any]], t: Target) -> None:
        for r in rows:
            r.update(cell=cell.label, variant=cell.variant, seed=p.seed, warmup=p.warmup)
        self.dir.add_requests(rows)
        cell.passes.append(p)
        if not p.ok and not p.warmup:
            self.result.invalidate(f"{cell.label}: {'; '.join(p.problems)}")
        elif not p.ok:
            self.result.invalidate(f"{cell.label} (warm-up): {'; '.join(p.problems)}")
        cell.summarize()
        self._save()
        why = t.why_gone(probe=not p.ok)
        if why:
            raise ServerDied(f"{why} during {cell.label}: the run stops here"
                             + (f" (log: {t.log_path})" if t.log_path else ""))

    def _plan_cells(self, labels: list[str]) -> None:
        """The cells this run means to measure, so the ones a dead server stops are named "not run"."""
        self._planned = list(labels)

    def _mark_not_run(self, why: str) -> None:
        assert self.result is not None
        started = len(self.result.cells)  # cells are appended as they start, in plan order
        self.result.not_run = getattr(self, "_planned", [])[started:]
        if self.result.not_run:
            self.result.notes.append(f"not run ({why.split(':')[0]}): {', '.join(self.result.not_run)}")

    # -- entry point ---------------------------------------------------------------------------
    def execute(self) -> RunResult:
        """Run every cell; write result.json after each pass, tables and plots at the end."""
        try:
            self._dispatch()
        except ServerDied as e:
            self.server_died = str(e)
            self.result.invalidate(str(e))
            self._mark_not_run(str(e))
        except KeyboardInterrupt:
            if self.result is not None:
                self.result.invalidate("interrupted (Ctrl-C): the figures cover only what ran")
            raise
        finally:
            self._bar.stop()
            if self.result is not None:
                self._finish()
        return self.result

    def _finish(self) -> None:
        r = self.result
        r.finished_utc = datetime.now(UTC).isoformat(timespec="seconds")
        done = sum(s["n"] for s in self._resets.values() if s["ok"])
        if done:
            r.notes.append(f"prefix cache reset before each pass ({done} resets, POST /reset_prefix_cache)")
        if not r.cells:
            r.invalidate("no cell ran")
        r.files = {"result": "result.json", "requests": "requests.jsonl"}
        self._save()
        try:
            r.files.update(report.write_all(r, self.dir.requests(), self.dir.root))
        except Exception as e:  # a broken plot must not lose the figures
            r.notes.append(f"report files failed: {type(e).__name__}: {e}")
        self._save()

    def _dispatch(self) -> None:
        p = self.protocol
        if isinstance(p, SharedPrefixProtocol):
            return self._shared_prefix(p)
        with self.acquire(dict(p.requires)) as t:
            check_requires(p.requires, t.plan, f"protocol {self.name!r}")
            self.result = self._begin(t)
            self.result.notes.append(reset_prefix_cache(t))
            self._save()
            if isinstance(p, CohortProtocol):
                self._cohort(p, t)
            elif isinstance(p, RawProtocol):
                self._raw(p, t)
            elif isinstance(p, ThroughputProtocol | PrefillProtocol | LongProtocol):
                self._random_cells(p, t)
            else:  # pragma: no cover - the loader admits no other kind
                raise BenchError(f"no runner for protocol kind {p.kind!r}")

    # -- vllm bench serve cells ----------------------------------------------------------------
    def _serve_args(self, t: Target, c: RandomCell, tag: str) -> ServeArgs:
        seed = self.next_seed()
        return ServeArgs(base_url=t.url, model=t.served_name, tokenizer=t.tokenizer, input_len=c.input_len,
                         output_len=c.output_len, num_prompts=c.num_prompts, concurrency=c.concurrency,
                         seed=seed, result_dir=str(self.dir.root / "vllm-bench"),
                         result_filename=f"{tag}-seed{seed}.json")

    def _bench_call(self, w: Worker, t: Target, c: RandomCell, tag: str,
                    sample: bool) -> tuple[ServeArgs, dict[str, Any] | None, list[str], metrics.Sampler]:
        args = self._serve_args(t, c, tag)
        log = self.dir.root / "vllm-bench" / f"{tag}-seed{args.seed}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        sampler = metrics.Sampler(t.url, t.headers, self.sample_interval_s if sample else 3600.0)
        problems: list[str] = []
        data = None
        with sampler:
            try:
                data = w.run(args, log)
            except BenchServeError as e:
                problems.append(str(e))
        if data is not None:
            failed, done = int(data.get("failed") or 0), int(data.get("completed") or 0)
            if failed or done != c.num_prompts:
                problems.append(failures.line(failed, c.num_prompts, list(data.get("errors") or []), done))
        return args, data, problems, sampler

    def _random_pass(self, w: Worker, t: Target, c: RandomCell, cell: CellResult, warmup: bool,
                     steady: bool) -> None:
        self.reset_between_passes(t)
        args, data, problems, sampler = self._bench_call(w, t, c, cell.params["tag"], steady)
        p = PassResult(seed=args.seed, warmup=warmup, ok=not problems, problems=problems, command=args.command(),
                       raw=f"vllm-bench/{args.result_filename}")
        rows: list[dict[str, Any]] = []
        if data is not None:
            p.figures = figures_from_vllm(data)
            rows = rows_from_vllm(data)
            self._counters(p, sampler, t, cell)
            if steady:
                target = min(c.concurrency, int(t.plan.knobs.get("MAX_SEQS", c.concurrency)), c.num_prompts)
                ss = metrics.steady_state(sampler.samples, target)
                p.steady_state = ss.to_json()
                p.figures["steady_decode_tok_per_s"] = ss.decode_tok_per_s if ss.at_target else None
                if ss.decode_tok_per_s is not None and not ss.at_target:  # seat-capped: a figure of its own
                    p.figures["steady_decode_capped_tok_per_s"] = ss.decode_tok_per_s
                    p.figures["steady_running"] = ss.running
                    note = (f"steady-state decode is not at {target}: the server held at most {ss.running} requests "
                            f"at once (the rest waited for KV seats); its decode at {ss.running} is the "
                            "steady_decode_capped figure")
                    if note not in cell.flags:
                        cell.flags.append(note)
        self._record(cell, p, rows, t)

    def _counters(self, p: PassResult, sampler: metrics.Sampler, t: Target, cell: CellResult) -> None:
        ctr = sampler.counters()
        p.counters = ctr.deltas
        if ctr.deltas.get("cache_queries", 0) > 0:  # prefix caching on: how much of the prompts it served
            p.figures["prefix_cache_hit_pct"] = 100 * ctr.deltas.get("cache_hits", 0) / ctr.deltas["cache_queries"]
        tps = ctr.spec_tokens_per_step()
        if tps is None:
            return
        p.figures["spec_tokens_per_step"] = tps
        acc = ctr.spec_acceptance()
        p.figures["spec_acceptance"] = acc
        bound = SPEC_PLAUSIBLE_ACCEPTANCE.get(t.plan.knobs.get("SPEC"), 0.9)
        if acc is not None and acc > bound:
            note = (f"spec-decode acceptance {acc:.2f} is above the drafter's plausible bound {bound}: collapsed "
                    f"(repetitive) generations inflate acceptance; read the outputs before trusting the figure")
            if note not in cell.flags:
                cell.flags.append(note)

    def _cell(self, label: str, c: RandomCell, tag: str, ref: RandomCell | None = None) -> CellResult:
        cell = CellResult(label=label, params={**c.model_dump(), "tag": tag,
                                               "ref": (ref or c).model_dump()})
        self.result.cells.append(cell)
        return cell

    def _random_cells(self, p: ThroughputProtocol | PrefillProtocol | LongProtocol, t: Target) -> None:
        slots = int(t.plan.knobs.get("MAX_SEQS", 1 << 30))
        cells = [c.scaled(self.scale, slots) for c in p.cells]
        steady = isinstance(p, ThroughputProtocol) and p.steady_state
        total = (len(cells) * self.repeat + 1)
        self._plan_cells([cell_label(p.kind, p.cells[i], c) for i, c in enumerate(cells)])
        with Worker(self._worker_env(t)) as w:
            self._bar.start(f"{self.name}", total)
            for i, c in enumerate(cells):
                label = cell_label(p.kind, p.cells[i], c)
                cell = self._cell(label, c, f"{p.kind}-{i}", p.cells[i])
                if i == 0:
                    self._bar.describe(f"{self.name}: warm-up")
                    self._random_pass(w, t, c, cell, True, steady)
                    self._bar.advance()
                for k in range(self.repeat):
                    self._bar.describe(f"{self.name}: {label} pass {k + 1}/{self.repeat}")
                    self._random_pass(w, t, c, cell, False, steady)
                    self._bar.advance()
                self._flag_saturation(cell, c, slots)

    @staticmethod
    def _flag_saturation(cell: CellResult, c: RandomCell, slots: int) -> None:
        if c.concurrency > 1 and c.concurrency * 2 >= slots:
            cell.flags.append("TTFT at saturation is queue time: the bench fires all requests at once")

    def _worker_env(self, t: Target) -> dict[str, str]:
        env = dict(paths.cache_env())
        auth = t.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            env["OPENAI_API_KEY"] = auth[len("Bearer "):]
        return env

    # -- raw engine cells ----------------------------------------------------------------------
    def _raw(self, p: RawProtocol, t: Target) -> None:
        slots = int(t.plan.knobs.get("MAX_SEQS", 1 << 30))
        inp, outp = self.scale.tokens(p.input_len), self.scale.tokens(p.output_len)
        self._plan_cells([f"C{c}" if min(c, slots) == c else f"C{c} (capped at {min(c, slots)})"
                          for c in p.concurrencies])
        with Worker(self._worker_env(t)) as w:
            self._bar.start(self.name, len(p.concurrencies) * self.repeat + 1)
            for i, conc in enumerate(p.concurrencies):
                cc = min(conc, slots)
                n = cc * p.rounds
                pp_cell = RandomCell(input_len=inp, output_len=1, concurrency=cc, num_prompts=n)
                tg_cell = RandomCell(input_len=inp, output_len=outp, concurrency=cc, num_prompts=n)
                ref = RandomCell(input_len=p.input_len, output_len=p.output_len, concurrency=conc,
                                 num_prompts=conc * p.rounds)
                cell = self._cell(f"C{conc}" if cc == conc else f"C{conc} (capped at {cc})", tg_cell, f"raw-c{cc}", ref)
                for k in range(self.repeat + (1 if i == 0 else 0)):
                    warm = i == 0 and k == 0
                    self._bar.describe(f"{self.name}: {cell.label} {'warm-up' if warm else f'pass {k}'}")
                    self._raw_pass(w, t, cell, pp_cell, tg_cell, p.tokens_per_round_tolerance, warm)
                    self._bar.advance()

    def _raw_pass(self, w: Worker, t: Target, cell: CellResult, pp: RandomCell, tg: RandomCell, tol: float,
                  warmup: bool) -> None:
        self.reset_between_passes(t)
        a1, d1, prob1, _ = self._bench_call(w, t, pp, f"raw-pp-c{pp.concurrency}", False)
        a2, d2, prob2, s2 = self._bench_call(w, t, tg, f"raw-tg-c{tg.concurrency}", False)
        problems = prob1 + prob2
        p = PassResult(seed=a2.seed, warmup=warmup, ok=True, problems=problems,
                       command=f"{a1.command()} && {a2.command()}",
                       raw=f"vllm-bench/{a2.result_filename}")
        rows: list[dict[str, Any]] = []
        if d1 is not None and d2 is not None:
            f2 = figures_from_vllm(d2)
            tpot, itl = f2.get("mean_tpot_ms"), f2.get("mean_itl_ms")
            p.figures = {
                "pp_tok_per_s": d1["total_input_tokens"] / d1["duration"],
                "tg_agg_tok_per_s": tg.concurrency * 1000 / tpot if tpot else None,
                "tg_per_stream_tok_per_s": 1000 / tpot if tpot else None,
                "mean_tpot_ms": tpot, "mean_itl_ms": itl, "median_ttft_ms": f2.get("median_ttft_ms"),
                "tokens_per_round": itl / tpot if tpot and itl else None,
            }
            rows = rows_from_vllm(d2)
            self._counters(p, s2, t, cell)
            ctr = s2.counters()
            p.figures["srv_tokens_per_round"] = ctr.server_tokens_per_round()
            p.figures["srv_tpot_ms"] = ctr.server_tpot_ms()
            problems += raw_sanity(p.figures["tokens_per_round"], tol, p.counters.get("drafts", 0),
                                   p.figures["srv_tokens_per_round"])
        p.ok = not problems
        self._record(cell, p, rows, t)

    # -- our client: cohorts, shared prefix -----------------------------------------------------
    def _client_pass(self, t: Target, bodies: list[dict[str, Any]], concurrency: int,
                     cell: CellResult, warmup: bool, seed: int, figures: Callable[[client.BatchResult], dict]) -> None:
        self.reset_between_passes(t)
        sampler = metrics.Sampler(t.url, t.headers, 3600.0)
        with sampler:
            batch = asyncio.run(client.run_batch(t.url, "/v1/chat/completions", bodies, concurrency, t.headers,
                                                 on_token=self._bar.token))
        problems = [failures.line(len(batch.failed), len(bodies), [r.error for r in batch.failed])
                    ] if batch.failed else []
        p = PassResult(seed=seed, warmup=warmup, ok=not problems, problems=problems,
                       figures=figures(batch) if not batch.failed else {})
        self._counters(p, sampler, t, cell)
        self._record(cell, p, [r.to_json() for r in batch.requests], t)

    def _cohort(self, p: CohortProtocol, t: Target) -> None:
        prompts = protocols.load_prompts(p.prompts).prompts
        max_tokens = self.scale.tokens(p.max_tokens)
        self._bar.start(self.name, len(p.cohorts) * self.repeat + 1, tokens=True)
        self._plan_cells([f"C{c}" for c in p.cohorts])
        for i, c in enumerate(p.cohorts):
            cell = CellResult(label=f"C{c}", params={"cohort": c, "max_tokens": max_tokens,
                                                     "ignore_eos": p.ignore_eos, "prompts": p.prompts})
            self.result.cells.append(cell)
            for k in range(self.repeat + (1 if i == 0 else 0)):
                warm = i == 0 and k == 0
                self._bar.describe(f"{self.name}: C{c} {'warm-up' if warm else 'pass'}")
                seed = self.next_seed()
                rng = random.Random(seed)
                bodies = [self._chat_body(t, rng.choice(prompts), max_tokens, p.ignore_eos, p.enable_thinking,
                                          f"You are a helpful assistant. (session {seed}-{j})")
                          for j in range(c)]
                self._client_pass(t, bodies, c, cell, warm, seed, cohort_figures)
                self._bar.advance()

    @staticmethod
    def _chat_body(t: Target, user: str, max_tokens: int, ignore_eos: bool, thinking: bool,
                   system: str) -> dict[str, Any]:
        """A chat request with model-default sampling: no temperature, top_p or seed is sent.

        The call's seed picks prompts and heads the system message instead. A per-request ``seed``
        is also unsafe here: vLLM 0.28's CPU backend rewinds the request's generator after a
        partial (chunked) prefill, and its CPU generator has no offset ("CPU Generator does not use
        offset"), which kills the engine.
        """
        return {"model": t.served_name, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "chat_template_kwargs": {"enable_thinking": thinking}}

    def _shared_prefix(self, p: SharedPrefixProtocol) -> None:
        ps = protocols.load_prompts(p.prompts)
        n_req = self.scale.count(p.num_requests)
        sys_tokens, max_tokens = self.scale.tokens(p.system_prompt_tokens), self.scale.tokens(p.max_tokens)
        walls: dict[str, float | None] = {}
        self._plan_cells(list(p.variants))
        for variant, knobs in p.variants.items():
            with self.acquire({**p.requires, **knobs}) as t:
                check_requires({**p.requires, **knobs}, t.plan, f"protocol {self.name!r}, variant {variant!r}")
                if self.result is None:
                    self.result = self._begin(t)
                self.result.variant_plans[variant] = t.plan.model_dump()
                self.result.notes.append(f"{variant}: {reset_prefix_cache(t)}")
                conc = min(p.concurrency, int(t.plan.knobs.get("MAX_SEQS", p.concurrency)))
                n = max(n_req, conc)
                cell = CellResult(label=variant, variant=variant,
                                  params={"num_requests": n, "concurrency": conc, "system_prompt_tokens": sys_tokens,
                                          "max_tokens": max_tokens, "knobs": knobs})
                self.result.cells.append(cell)
                tok = _tokenizer(t.tokenizer)
                self._bar.start(f"{self.name}: {variant}", self.repeat + 1, tokens=True)
                for k in range(self.repeat + 1):
                    seed = self.next_seed()
                    system = build_system_prompt(tok, ps.system_prompt, sys_tokens, seed)
                    count = conc if k == 0 else n
                    bodies = [self._chat_body(t, ps.prompts[(seed + j) % len(ps.prompts)], max_tokens, p.ignore_eos,
                                              False, system) for j in range(count)]
                    self._bar.describe(f"{self.name}: {variant} {'warm-up' if k == 0 else f'pass {k}'}")
                    self._client_pass(t, bodies, conc, cell, k == 0, seed, shared_prefix_figures)
                    self._bar.advance()
                walls[variant] = cell.median("wall_s")
        names = list(p.variants)
        if len(names) == 2 and all(walls.get(v) for v in names):
            # the first variant over the second: how many times faster the second runs the same work
            self.result.derived[f"wall_ratio_{names[0]}_over_{names[1]}"] = walls[names[0]] / walls[names[1]]


def raw_sanity(tokens_per_round: float | None, tol: float, drafts: float,
               server_tokens_per_round: float | None = None) -> list[str]:
    """The raw cell's rule: one token per stream per round — from the client (TG per stream x round
    latency) and from the engine's own count (``Counters.server_tokens_per_round``) — and no drafts."""
    problems = []
    for who, value in (("TG per stream x round latency", tokens_per_round),
                       ("the server's tokens per engine step", server_tokens_per_round)):
        if value is None or abs(value - 1) > tol:
            shown = "unmeasured" if value is None else f"{value:.2f}"
            problems.append(f"sanity rule broken: {who} = {shown} tokens per round, expected "
                            f"1 +- {tol} (a speculative path still active, or a broken measurement)")
    if drafts > 0:
        problems.append(f"speculative decoding was active ({drafts:.0f} drafts): not a raw cell")
    return problems


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_system_prompt(tok: Any, text: str, n_tokens: int, seed: int) -> str:
    """A system prompt of about ``n_tokens`` tokens: a per-seed header, then ``text`` repeated and cut."""
    head = tok.encode(f"Session {seed}. Follow the policy below.\n", add_special_tokens=False)
    body = tok.encode(text.strip() + "\n\n", add_special_tokens=False) or [0]
    ids = list(head)
    while len(ids) < n_tokens:
        ids.extend(body)
    return tok.decode(ids[:max(n_tokens, len(head))])


def cell_label(kind: str, ref: RandomCell, c: RandomCell) -> str:
    """The reference's row label (its sizes), with the scaled sizes when they differ."""
    base = {"throughput": f"{ref.input_len}/{ref.output_len}, {ref.concurrency} concurrent",
            "prefill": f"{ref.input_len // 1024}k, conc {ref.concurrency}" if ref.input_len >= 1024
            else f"{ref.input_len}, conc {ref.concurrency}",
            "long": f"{ref.num_prompts} x {ref.input_len // 1000}k in / {ref.output_len} out"}.get(kind, ref.label)
    return base if c == ref else f"{base} [scaled: {c.label}]"


def figures_from_vllm(d: dict[str, Any]) -> dict[str, float | None]:
    """The figures of one `vllm bench serve` JSON, renamed with units."""
    dur = d.get("duration") or 0
    f: dict[str, float | None] = {
        "duration_s": dur, "completed": d.get("completed"), "failed": d.get("failed"),
        "output_tok_per_s": d.get("output_throughput"),
        "prompt_tok_per_s": d["total_input_tokens"] / dur if dur else None,
        "total_input_tokens": d.get("total_input_tokens"), "total_output_tokens": d.get("total_output_tokens"),
    }
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            f[f"{stat}_{m}_ms"] = d.get(f"{stat}_{m}_ms")
    return f


def rows_from_vllm(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-request rows from `vllm bench serve --save-detailed` (same fields as our client's)."""
    rows = []
    for i, ttft in enumerate(d.get("ttfts") or []):
        itl = list((d.get("itls") or [[]])[i] or [])
        out = (d.get("output_lens") or [0])[i]
        err = (d.get("errors") or [""])[i]
        e2e = (ttft + sum(itl)) * 1000 if ttft is not None else None
        rows.append({"index": i, "ok": not err, "error": err or None,
                     "prompt_tokens": (d.get("input_lens") or [0])[i], "output_tokens": out,
                     "start_s": (d.get("start_times") or [0])[i], "ttft_ms": ttft * 1000 if ttft else None,
                     "e2e_ms": e2e, "tpot_ms": sum(itl) * 1000 / (out - 1) if out and out > 1 and itl else None,
                     "itl_ms": [x * 1000 for x in itl], "source": "vllm bench serve"})
    return rows


def cohort_figures(b: client.BatchResult) -> dict[str, float | None]:
    """e2e = all output tokens / wall; decode = Σ per-stream decode rates; mean TTFT."""
    rs = b.requests
    out = sum(r.output_tokens for r in rs)
    decode = sum((r.output_tokens - 1) / ((r.e2e_ms - r.ttft_ms) / 1000) for r in rs
                 if r.output_tokens > 1 and r.e2e_ms > r.ttft_ms)
    return {"wall_s": b.wall_s, "output_tokens": out, "e2e_tok_per_s": out / b.wall_s,
            "decode_tok_per_s": decode, "mean_ttft_ms": _mean([r.ttft_ms for r in rs]),
            "median_tpot_ms": _pct([r.tpot_ms for r in rs if r.tpot_ms], 0.5),
            "mean_tpot_ms": _mean([r.tpot_ms for r in rs if r.tpot_ms]),
            "mean_itl_ms": _mean([x for r in rs for x in r.itl_ms])}


def shared_prefix_figures(b: client.BatchResult) -> dict[str, float | None]:
    """wall, output tok/s, median and p90 latency (the reference's columns), plus TTFT and prompt size."""
    rs = b.requests
    out = sum(r.output_tokens for r in rs)
    lat = [r.e2e_ms / 1000 for r in rs]
    return {"wall_s": b.wall_s, "output_tokens": out, "output_tok_per_s": out / b.wall_s,
            "median_latency_s": _pct(lat, 0.5), "p90_latency_s": _pct(lat, 0.9),
            "mean_ttft_ms": _mean([r.ttft_ms for r in rs]),
            "mean_prompt_tokens": _mean([r.prompt_tokens for r in rs])}


def fixed(target: Target) -> Acquire:
    """An Acquire for one already-running server: every protocol and variant runs on it."""

    @contextmanager
    def acquire(_knobs: dict[str, Any]) -> Iterator[Target]:
        yield target

    return acquire
