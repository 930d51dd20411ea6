"""Steady-state decode from vLLM's /metrics counters, sampled while a workload runs.

The engine's "Avg generation throughput" log line mixes ramp, prefill and tail; the number the
reference calls steady-state decode is Δ ``vllm:generation_tokens_total`` / Δt over the part of
the run where every slot decodes and nothing else happens. A sampler polls /metrics (not the
log) and an interval between two consecutive samples counts as steady when, at both ends,
``vllm:num_requests_running`` equals the target concurrency and no request is waiting, and in
between neither ``vllm:prompt_tokens_total`` nor ``vllm:request_success_total`` moved (no
prefill finished, no request left or joined) while ``vllm:generation_tokens_total`` did (the
gauges are only refreshed by an engine step, so an idle engine can leave a stale "running").
A server whose KV pool holds fewer seats than the target never gets there: it runs R < target and
queues the rest. Its decode at R (the same quiet intervals, requests waiting) is reported as such,
never as the figure at the target: a reference's "64 concurrent" is not a measurement at 57.

Speculative decoding: tokens per step = (drafts + accepted) / drafts from the
``vllm:spec_decode_*`` counters over the whole run. The server's own view of a pass — its TPOT and
the tokens a stream got per engine step — comes from the ``_sum`` / ``_count`` series of its latency
histograms, independent of what the client measured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

COUNTERS = {
    "gen": "vllm:generation_tokens_total",
    "prompt": "vllm:prompt_tokens_total",
    "success": "vllm:request_success_total",
    "preempt": "vllm:num_preemptions_total",
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "cache_queries": "vllm:prefix_cache_queries_total",
    "cache_hits": "vllm:prefix_cache_hits_total",
    # the server's own latency histograms (their _sum and _count series are counters too)
    "ttft_n": "vllm:time_to_first_token_seconds_count",
    "itl_n": "vllm:inter_token_latency_seconds_count",
    "tpot_sum": "vllm:request_time_per_output_token_seconds_sum",
    "tpot_n": "vllm:request_time_per_output_token_seconds_count",
}
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}


def totals(text: str, names: Collection[str] | None = None) -> dict[str, float]:
    """Each sample name of a /metrics text (``names`` only, when given) with its series summed:
    labels differ by model name, finish reason, engine, and a figure wants all of them."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if names is None or name in names:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
    return out


def parse(text: str) -> dict[str, float]:
    """The metrics we use, by our short names (COUNTERS, GAUGES), every series summed."""
    short = {**{v: k for k, v in COUNTERS.items()}, **{v: k for k, v in GAUGES.items()}}
    return {short[name]: v for name, v in totals(text, short).items()}


@dataclass
class Sample:
    t: float
    values: dict[str, float]


@dataclass
class SteadyState:
    """The steady-state decode figure and how much of the run it rests on."""

    decode_tok_per_s: float | None
    window_s: float
    intervals: int
    target_running: int
    reason: str | None = None
    # the requests decoding in the window: target_running, or fewer when the server's seats capped it
    running: int | None = None

    @property
    def at_target(self) -> bool:
        return self.decode_tok_per_s is not None and self.running == self.target_running

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _window(samples: list[Sample], running: int, waiting: bool) -> tuple[float, float, int]:
    """Generated tokens, seconds and intervals where ``running`` requests decode and nothing else
    happens; ``waiting``: requests queue at both ends (a seat-capped server) rather than none."""
    gen = dt = 0.0
    n = 0
    for a, b in zip(samples, samples[1:], strict=False):
        va, vb = a.values, b.values
        flat = all(v.get("running") == running and bool(v.get("waiting")) == waiting for v in (va, vb))
        quiet = all(vb.get(k, 0) == va.get(k, 0) for k in ("prompt", "success"))
        moving = vb.get("gen", 0) > va.get("gen", 0)  # a flat counter under running > 0: a stale gauge, idle engine
        if flat and quiet and moving and b.t > a.t:
            gen += vb.get("gen", 0) - va.get("gen", 0)
            dt += b.t - a.t
            n += 1
    return gen, dt, n


def steady_state(samples: list[Sample], target: int, min_window_s: float = 0.5) -> SteadyState:
    """Δ generated tokens / Δt over the intervals where ``target`` requests decode and nothing else;
    failing that, where the server decoded fewer with the rest queued (``running`` says how many)."""
    gen, dt, n = _window(samples, target, waiting=False)
    if dt >= min_window_s and gen > 0:
        return SteadyState(gen / dt, dt, n, target, running=target)
    found = (f"found {dt:.2f} s over {n} intervals")
    capped = sorted({int(s.values.get("running") or 0) for s in samples if s.values.get("waiting")} - {0})
    best = max(((r, *_window(samples, r, waiting=True)) for r in capped if r < target),
               key=lambda w: w[2], default=None)
    if best is not None and best[2] >= min_window_s and best[1] > 0:
        r, g, d, k = best
        return SteadyState(g / d, d, k, target, running=r,
                           reason=f"the server ran at most {r} of {target} at once (the rest waited for a seat in its "
                                  f"KV pool; {found} at {target}): this is decode at {r}, not at {target}")
    return SteadyState(None, dt, n, target,
                       reason=f"no steady window of >= {min_window_s} s with {target} requests decoding "
                              f"and no prefill ({found})")


@dataclass
class Counters:
    """Counter deltas over a whole pass."""

    deltas: dict[str, float] = field(default_factory=dict)

    def spec_tokens_per_step(self) -> float | None:
        drafts = self.deltas.get("drafts", 0)
        return (drafts + self.deltas.get("accepted", 0)) / drafts if drafts > 0 else None

    def server_tokens_per_round(self) -> float | None:
        """Tokens a stream got per engine step, as the engine counted them: vLLM observes one
        inter-token latency per request per step that gave it tokens (after its first), so
        (generated - first tokens) / ITL observations; 1 without speculation, more with it."""
        steps = self.deltas.get("itl_n", 0)
        later = self.deltas.get("gen", 0) - self.deltas.get("ttft_n", 0)
        return later / steps if steps > 0 else None

    def server_tpot_ms(self) -> float | None:
        """Mean time per output token of the requests that finished, as the engine timed them."""
        n = self.deltas.get("tpot_n", 0)
        return 1000 * self.deltas.get("tpot_sum", 0) / n if n > 0 else None

    def spec_acceptance(self) -> float | None:
        proposed = self.deltas.get("draft_tokens", 0)
        return self.deltas.get("accepted", 0) / proposed if proposed > 0 else None


class Sampler:
    """Polls /metrics from a thread every ``interval_s`` while a pass runs (``with Sampler(...)``)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, interval_s: float = 0.25) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.headers = headers or {}
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self, client: httpx.Client) -> Sample | None:
        try:
            r = client.get(self.url, headers=self.headers)
            r.raise_for_status()
        except httpx.HTTPError as e:
            self.errors.append(f"{type(e).__name__}: {e}")
            return None
        s = Sample(time.perf_counter(), parse(r.text))
        self.samples.append(s)
        return s

    def _run(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while not self._stop.is_set():
                self.poll(client)
                self._stop.wait(self.interval_s)
            self.poll(client)

    def __enter__(self) -> Sampler:
        with httpx.Client(timeout=10.0) as client:
            self.poll(client)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def counters(self) -> Counters:
        if len(self.samples) < 2:
            return Counters()
        a, b = self.samples[0].values, self.samples[-1].values
        return Counters({k: b.get(k, 0.0) - a.get(k, 0.0) for k in COUNTERS})
