"""Our own streaming client: where `vllm bench serve` cannot go (chat cohorts, a shared system prompt).

It measures what `vllm bench serve` measures, the same way (vllm/benchmarks/serve.py,
``calculate_metrics``): TTFT = first token's arrival − send; e2e = last byte − send;
TPOT = (e2e − TTFT) / (output tokens − 1); ITL = gaps between streamed chunks after the first.
Output tokens come from the server's ``usage`` (``stream_options.include_usage``), not from
counting chunks, so a chunk carrying several tokens (speculative decoding) is counted right.
docs/bench.md shows the two agree within 3 % on the same workload.

The SSE parser works on raw bytes: comment lines (``: keep-alive``), blank lines and ``[DONE]``
are skipped; every event with ``choices`` is an engine output — content, reasoning deltas (the
qwen3 parser moves text before ``</think>`` into ``reasoning``/``reasoning_content``) or an empty
delta — as `vllm bench serve` counts them. A request that fails —
HTTP error, broken stream, no usage — is recorded with its error, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    """One request's measurements (times in ms, from a monotonic clock)."""

    index: int
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    start_s: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    cached_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _delta_has_token(event: dict[str, Any]) -> bool:
    """True when an SSE event is an engine output: it has choices (text, a delta, even an empty one).

    The rule of `vllm bench serve` (endpoint_request_func.py: any chunk with ``choices``): vLLM
    sends a chunk per engine step, and a step's text can be empty — a token that ends inside a
    UTF-8 sequence, a skipped special token — while the token still counts in ``usage``. The
    chat stream's first chunk (the role) leaves with the first token, after prefill.
    """
    return bool(event.get("choices"))


class SSEParser:
    """Incremental ``text/event-stream`` parser: feed bytes, get the JSON of each ``data:`` event."""

    def __init__(self) -> None:
        self._buf = b""
        self.done = False

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        self._buf += chunk
        events = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return events
            line = self._buf[:nl].rstrip(b"\r")
            self._buf = self._buf[nl + 1:]
            if not line.startswith(b"data:"):
                continue  # blank separators, ": keep-alive" comments, event:/id: fields
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            events.append(json.loads(payload))


def _finish(res: RequestResult, t0: float, first: float | None, last: float | None, usage: dict | None,
            itl: list[float], saw_done: bool) -> None:
    if first is None or last is None:
        raise RuntimeError("the stream ended without a single generated token")
    if not usage:
        raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
    if not saw_done:
        raise RuntimeError("the stream ended without [DONE]")
    res.ttft_ms = (first - t0) * 1000
    res.e2e_ms = (last - t0) * 1000
    res.itl_ms = [x * 1000 for x in itl]
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    res.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    res.cached_tokens = details.get("cached_tokens")
    if res.output_tokens > 1:
        res.tpot_ms = (res.e2e_ms - res.ttft_ms) / (res.output_tokens - 1)
    res.ok = True


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], index: int,
                     on_token: Callable[[], None] | None = None) -> RequestResult:
    """Send one streaming request and measure it; errors are caught and recorded on the result."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(index=index)
    parser = SSEParser()
    first = last = None
    itl: list[float] = []
    usage = None
    t0 = time.perf_counter()
    res.start_s = t0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {r.status_code}: {text}")
            async for chunk in r.aiter_raw():
                now = time.perf_counter()
                for event in parser.feed(chunk):
                    if event.get("usage"):
                        usage = event["usage"]
                    if "error" in event:
                        raise RuntimeError(f"server error in stream: {event['error']}")
                    if _delta_has_token(event):
                        res.chunks += 1
                        if first is None:
                            first = now
                        else:
                            itl.append(now - last)
                        last = now
                        if on_token is not None:
                            on_token()
        _finish(res, t0, first, last, usage, itl, parser.done)
    except Exception as e:  # recorded, not raised: a run reports every failure it saw
        res.ok = False
        res.error = f"{type(e).__name__}: {e}"
    return res


@dataclass
class BatchResult:
    """Every request of one pass, and the pass's wall time."""

    requests: list[RequestResult]
    wall_s: float

    @property
    def failed(self) -> list[RequestResult]:
        return [r for r in self.requests if not r.ok]


async def run_batch(base_url: str, endpoint: str, bodies: Sequence[dict[str, Any]], concurrency: int,
                    headers: dict[str, str] | None = None, on_token: Callable[[], None] | None = None,
                    on_done: Callable[[RequestResult], None] | None = None,
                    timeout_s: float = 3600.0) -> BatchResult:
    """Send ``bodies`` with at most ``concurrency`` in flight (like --max-concurrency), all at once."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    url = base_url.rstrip("/") + endpoint

    async def one(i: int, body: dict[str, Any], client: httpx.AsyncClient) -> RequestResult:
        async with sem:
            res = await stream_one(client, url, body, i, on_token)
        if on_done is not None:
            on_done(res)
        return res

    async with httpx.AsyncClient(headers=headers or {}, limits=limits,
                                 timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, b, client) for i, b in enumerate(bodies)))
        wall = time.perf_counter() - t0
    for r in results:
        r.start_s -= t0
    return BatchResult(list(results), wall)
