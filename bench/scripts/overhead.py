"""How many streamed tokens per second our bench client handles on one core, 64 streams at once.

Starts the stand-in server (bench/scripts/standin.py: streams as fast as it can) pinned to one
CPU, pins this process to another, and runs rig.bench.client's ``run_batch`` — the code the cohort
and shared-prefix protocols use, SSE parsing and per-token timing included — with 64 concurrent
streaming requests. Twice: with one SSE event per network write (the client's worst case: one
read per token) and with 16 events per write. The verdict is tokens per second of the client's
CPU time — what one core sustains — because the wall rate is capped by the stand-in (one core
of Python) and by anything else running on the host; both are printed.

    .venv/bin/python bench/scripts/overhead.py [--streams 64] [--tokens 2000] [--requests 256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rig.bench import client  # noqa: E402
from rig.server import free_port  # noqa: E402


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure(a: argparse.Namespace, burst: int, mine: int, theirs: int) -> tuple[float, float, float]:
    """(tokens/s wall, tokens per client CPU-second, client CPU share) against a stand-in with this burst."""
    port = free_port()
    here = Path(__file__).with_name("standin.py")
    srv = subprocess.Popen([sys.executable, str(here), "--port", str(port), "--burst", str(burst)],
                           stdout=subprocess.PIPE, text=True)
    try:
        os.sched_setaffinity(srv.pid, {theirs})
        srv.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        bodies = [{"model": "standin", "prompt": "x", "max_tokens": a.tokens} for _ in range(a.requests)]
        asyncio.run(client.run_batch(url, "/v1/completions", bodies[:a.streams], a.streams))  # warm-up
        c0, t0 = cpu_s(), time.perf_counter()
        b = asyncio.run(client.run_batch(url, "/v1/completions", bodies, a.streams))
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    finally:
        srv.terminate()
        srv.wait()
    if b.failed:
        raise SystemExit(f"FAILED: {len(b.failed)} requests: {b.failed[0].error}")
    tokens = sum(r.output_tokens for r in b.requests)
    chunks = sum(r.chunks for r in b.requests)
    assert tokens == chunks == a.requests * a.tokens, (tokens, chunks)
    print(f"stand-in writes {burst:>2} event(s) per write: {tokens} tokens in {wall:6.2f} s wall, "
          f"{cpu:6.2f} s client CPU -> {tokens / wall:9,.0f} tokens/s wall, {tokens / cpu:9,.0f} tokens per "
          f"client CPU-second (client CPU busy {cpu / wall * 100:3.0f}%)")
    return tokens / wall, tokens / cpu, cpu / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2000, help="tokens streamed per request")
    ap.add_argument("--need", type=float, default=20000, help="tokens/s the client must handle")
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    mine, theirs = cpus[0], cpus[-1]
    os.sched_setaffinity(0, {mine})
    print(f"client pinned to cpu {mine}, stand-in to cpu {theirs}; {a.requests} requests x {a.tokens} tokens, "
          f"{a.streams} concurrent streams; every SSE event parsed and timed")
    _, per_cpu_1, _ = measure(a, 1, mine, theirs)
    rate_16, per_cpu_16, busy_16 = measure(a, 16, mine, theirs)
    # The capacity of one core is tokens per CPU-second: wall rates also depend on the stand-in and on
    # whatever else runs on the host; they are printed, the verdict uses the worst case (one event per write).
    ok = per_cpu_1 >= a.need
    print(f"{'PASS' if ok else 'FAIL'}: need >= {a.need:,.0f} tokens/s on one core; one event per write: "
          f"{per_cpu_1:,.0f} tokens per CPU-second ({per_cpu_16:,.0f} with 16 per write; wall rate {rate_16:,.0f}/s "
          f"with the client's core {busy_16 * 100:.0f}% busy)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
