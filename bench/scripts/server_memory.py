"""How much host memory one CPU `vllm serve` of the tiny hybrid takes, beside its KV cache.

Why: on CPU, `serve`'s preflight refuses a plan whose server would not fit the host's available
memory (rig/capacity/host.py). What a server needs is its model files, its KV cache (KV_MEM
bytes, fixed by the cpu overlay) and an overhead — three Python processes (API server, engine
core, worker) with torch, vLLM and the compiled graphs — that this script measures: it starts
the batch profile on CPU, waits until `serve` calls it ready (readiness burst done), decodes
MAX_SEQS streams of 256 tokens, and prints the process tree's peak resident and proportional
(PSS: shared pages split between the processes) memory, and what of it is not KV cache.

    .venv/bin/python bench/scripts/server_memory.py [--rounds 3]

The overhead rig uses (``SERVER_OVERHEAD_BYTES``) must be at least the printed
"overhead (RSS - KV_MEM)"; tests/test_server_live.py checks a live server against it too.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rig import paths  # noqa: E402
from rig.capacity import host  # noqa: E402
from rig.plan import resolve  # noqa: E402
from rig.serve import start  # noqa: E402
from rig.server import free_port  # noqa: E402

GIB = 2**30


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def sample(pid: int) -> tuple[int, int]:
    """(RSS, PSS) summed over the server's process tree."""
    rss = pss = 0
    for p in tree(pid):
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        rss, pss = rss + info.rss, pss + info.pss
    return rss, pss


async def decode(url: str, headers: dict, model: str, streams: int, tokens: int) -> None:
    body = {"model": model, "prompt": "The city of", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600, headers=headers) as c:
        await asyncio.gather(*(c.post(f"{url}/v1/completions", json=body) for _ in range(streams)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds after ready")
    ap.add_argument("--kv-mem", default="", help="KV_MEM to measure with (default: the cpu overlay's)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rig-mem-"))
    plan = resolve("batch", platform="cpu", environ={},
                   sets={"PORT": str(free_port()), "API_KEY_FILE": str(tmp / "api_key"),
                         **({"KV_MEM": args.kv_mem} if args.kv_mem else {})})
    t0 = time.monotonic()
    server = start(plan, log_path=tmp / "vllm.log")
    try:
        peak_rss = peak_pss = 0
        for _ in range(args.rounds):
            asyncio.run(decode(server.url, server.headers(), plan.served_name, plan.knobs["MAX_SEQS"], 256))
            rss, pss = sample(server.proc.pid)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        log = (tmp / "vllm.log").read_text(errors="replace")
    finally:
        server.stop()
    pool = re.search(r"KV cache size: ([\d,]+) tokens", log)
    model_bytes = host.model_bytes(Path(plan.model) if Path(plan.model).is_absolute()
                                   else paths.ROOT / plan.model)
    # vLLM's CPU worker allocates the whole cache resident (zeroed, NUMA-bound): RSS grows 1:1 with
    # KV_MEM (run with --kv-mem 1G and 3G to see it), so the overhead is what is left beside it.
    kv = plan.knobs["KV_MEM"]
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; ready + decode in "
          f"{time.monotonic() - t0:.0f} s")
    print(f"plan: batch on cpu, KV_MEM={plan.knobs['KV_MEM']} ({plan.knobs['KV_MEM'] / GIB:.2f} GiB), "
          f"pool: {pool.group(1) if pool else '?'} tokens")
    print(f"model files: {model_bytes / 2**20:.1f} MiB")
    print(f"peak RSS of the server's process tree: {peak_rss / GIB:.2f} GiB; peak PSS: {peak_pss / GIB:.2f} GiB")
    print(f"overhead (RSS - KV_MEM): {(peak_rss - kv) / GIB:.2f} GiB; "
          f"rig assumes SERVER_OVERHEAD_BYTES = {host.SERVER_OVERHEAD_BYTES / GIB:.2f} GiB")


if __name__ == "__main__":
    main()
