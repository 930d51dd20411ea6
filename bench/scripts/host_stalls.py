"""How long other processes stall on this host while vLLM's CPU backend generates.

Why: client-timed figures (TTFT, a /metrics sampler's clock, a wall time) are only as good as the
client's scheduling. On a small host the engine's worker keeps a core busy and the engine core
process spins while it waits for it; this script measures what that leaves to everything else.

It starts the batch profile on CPU (tiny hybrid model) twice: the way rig does — a process group
of its own in the caller's session — and in a session of its own (setsid), as rig did before.
On each it runs a watchdog process, a loop that sleeps 50 ms and records every wake-up that came
more than 0.25 s late: with the server idle; while 4 streams decode 1024 tokens each, one round
after another, with the watchdog in this script's session; and the same with the watchdog in a
session of its own. With the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled)
every session is a CPU group of its own. During each loaded phase a thread of this process polls
/metrics every 0.25 s, as the bench's sampler does. Printed: the watchdog's late wake-ups (count,
worst, total), the host's steal time (/proc/stat: time the hypervisor gave the vCPUs to someone
else), the sampler's worst gap and the engine's generated tokens over the phase.

    .venv/bin/python bench/scripts/host_stalls.py [--seconds 40]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rig import paths  # noqa: E402
from rig.bench import metrics  # noqa: E402
from rig.plan import resolve  # noqa: E402
from rig.serve import preflight, server_for  # noqa: E402
from rig.server import VllmServer, free_port  # noqa: E402

WATCHDOG = r"""
import json, sys, time
late, t_end = [], time.monotonic() + float(sys.argv[1])
prev = time.monotonic()
while prev < t_end:
    time.sleep(0.05)
    now = time.monotonic()
    if now - prev > 0.3:
        late.append(now - prev - 0.05)
    prev = now
print(json.dumps(late))
"""


def steal_ticks() -> int:
    """The 'steal' column of /proc/stat's cpu line (ticks of USER_HZ, normally 1/100 s)."""
    return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8])


def watchdog(seconds: float, own_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WATCHDOG, str(seconds)], stdout=subprocess.PIPE, text=True,
                            start_new_session=own_session)


def summary(name: str, late: list[float], steal: int) -> str:
    worst = max(late, default=0.0)
    return (f"{name}\n{'':8}watchdog late wake-ups > 0.25 s: {len(late):3d}, worst {worst:5.2f} s, total "
            f"{sum(late):6.2f} s; steal time {steal / 100:.2f} s")


def load(server: VllmServer, until: float, done: list[int]) -> None:
    """Rounds of 4 concurrent 1024-token greedy completions until ``until``."""
    url, headers = server.url, server.headers()
    body = {"model": server.served_name, "prompt": "count", "max_tokens": 1024, "ignore_eos": True,
            "temperature": 0}

    def one() -> None:
        with httpx.Client(timeout=600) as c:
            r = c.post(f"{url}/v1/completions", json=body, headers=headers)
            r.raise_for_status()
            done.append(r.json()["usage"]["completion_tokens"])

    while time.monotonic() < until:
        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def loaded(server: VllmServer, seconds: float, own_session: bool) -> None:
    """One loaded phase: the watchdog, the sampler and the engine's output over it."""
    sampler = metrics.Sampler(server.url, server.headers())
    done: list[int] = []
    s0 = steal_ticks()
    wd = watchdog(seconds, own_session)
    t0 = time.monotonic()
    with sampler:
        load(server, t0 + seconds, done)
    wall = time.monotonic() - t0
    late = json.loads(wd.communicate()[0])
    where = "a session of its own" if own_session else "this script's session"
    print(summary(f"4 streams decoding, {seconds:.0f} s, watchdog in {where}", late, steal_ticks() - s0))
    gaps = [b.t - x.t for x, b in zip(sampler.samples, sampler.samples[1:], strict=False)]
    gen = sampler.samples[-1].values.get("gen", 0) - sampler.samples[0].values.get("gen", 0)
    print(f"{'':8}/metrics sampler (0.25 s, this process): {len(sampler.samples)} samples, worst gap "
          f"{max(gaps):.2f} s; engine generated {gen:.0f} tokens in {wall:.1f} s ({gen / wall:.0f} tok/s)",
          flush=True)


def measure(server: VllmServer, seconds: float) -> None:
    """The idle phase, then the loaded phase with the watchdog in the server's session and in its own."""
    s0 = steal_ticks()
    idle = json.loads(watchdog(10).communicate()[0])
    print(summary("server idle, 10 s", idle, steal_ticks() - s0), flush=True)
    loaded(server, seconds, own_session=False)
    loaded(server, seconds, own_session=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="length of the loaded phase")
    a = ap.parse_args(argv)
    tmp = paths.state_dir() / "host-stalls"
    tmp.mkdir(parents=True, exist_ok=True)
    plan = resolve("batch", platform="cpu", environ={},
                   sets={"PORT": str(free_port()), "API_KEY_FILE": str(tmp / "api_key")})
    for own_session in (False, True):
        how = "a session of its own (as rig did before)" if own_session else "the caller's session (rig's way)"
        print(f"== server in {how}", flush=True)
        _, _, _, key = preflight(plan)
        server = server_for(plan, key, paths.logs_dir() / "host-stalls-vllm.log")
        server.own_session = own_session
        try:
            server.start()
            server.wait_ready(timeout=900)
            measure(server, a.seconds)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
