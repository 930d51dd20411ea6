"""KV=kvarn's quality inside vLLM: perplexity with the packed cache vs vLLM's own cache vs plain RTN.

Serves the kvarn profile three times on the cpu platform (rig's plan, preflight and readiness as `serve`
does), one after another: ``auto`` (KV=auto: vLLM's CPU attention over a bf16 cache), ``kvarn`` (rig's
backend, KVarN's rotation + normalization + RTN) and ``rtn`` (the same backend and bytes,
VLLM_RIG_KVARN_METHOD=rtn: plain per-token RTN). Each server scores the same windows of held-out text
through ``prompt_logprobs`` (rig.quality.perplexity.window_nll). A window longer than a step
(max_num_batched_tokens, 2,048 on the cpu profile) is prefilled in chunks, and every chunk after the first
attends over the cache the earlier chunks wrote: for kvarn and rtn their packed groups. So only tokens past
the first chunk can see the cache's error; the table reports them apart (``cached``).

    python bench/scripts/kvarn_engine_ppl.py [--windows 8] [--window-tokens 4096] [--lines 4000] [--sets ...]
        [--platform gpu]

Prints one table and, per method, one request's decode time per token after a window (DECODE_TOKENS
tokens timed against one, so the prefill and the round trip drop out); ``--json`` writes the rows.
The model is the trained tiny hybrid (what the cpu overlay serves; on ``--platform gpu`` the same, set
by GPU_SETS, with auto = vLLM's FlashAttention over a bf16 cache); its texts are rig's corpus
(quality/perplexity.toml, held-out seed), in its own domain.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rig.atomic import write_atomic  # noqa: E402
from rig.fingerprint import collect  # noqa: E402
from rig.plan import resolve  # noqa: E402
from rig.quality import suite  # noqa: E402
from rig.quality.client import Client  # noqa: E402
from rig.quality.perplexity import load_text  # noqa: E402
from rig.serve import nvml_device  # noqa: E402
from rig.server import free_port  # noqa: E402

METHODS = {"auto": ({"KV": "auto"}, {}), "kvarn": ({}, {}), "rtn": ({}, {"VLLM_RIG_KVARN_METHOD": "rtn"})}
# On a GPU: the cpu overlay's model and context, a 4 GiB pool in a 24 GiB plan. Eager comes from the gpu overlay's
# kvarn knobs (rig's backend declares no CUDA-graph support), and auto's server is the same profile with KV=auto,
# so it is held to the same.
GPU_SETS = {"MODEL": "models/trained/tiny-hybrid", "SERVED_NAME": "rig-tiny-hybrid", "MAX_LEN": "32768",
            "KV_MEM": "4G", "GPU_MEM": "24G"}


def window_nll_split(client: Client, ids: list[int], first: int) -> tuple[float, int, float, int]:
    """(nll, count) of tokens 2..first and of tokens past ``first`` (those that attend over cached chunks)."""
    plp = client.completion({"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})[
        "choices"][0]["prompt_logprobs"]
    if plp is None or len(plp) != len(ids):
        raise SystemExit(f"the server returned {0 if plp is None else len(plp)} prompt logprobs for {len(ids)}")
    lps = [-entry[str(tok)]["logprob"] for tok, entry in zip(ids[1:], plp[1:], strict=True)]
    head, tail = lps[: first - 1], lps[first - 1:]
    return sum(head), len(head), sum(tail), len(tail)


DECODE_TOKENS = 256


def decode_ms(client: Client, ids: list[int], repeats: int = 3) -> float:
    """Milliseconds a decode step takes for one request after ``ids``: (time of DECODE_TOKENS + 1 tokens - time of
    1) / DECODE_TOKENS, best of ``repeats`` (the difference takes the prefill and the HTTP round trip out)."""
    def best(n: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            client.completion({"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True})
            times.append(time.perf_counter() - t0)
        return min(times)

    return 1000 * (best(DECODE_TOKENS + 1) - best(1)) / DECODE_TOKENS


def measure(method: str, sets: list[str], windows: int, window_tokens: int, log_dir: Path, lines: int,
            platform: str = "cpu") -> dict:
    """One server of ``method``: per set, the perplexity of the first step's tokens and of the cached ones."""
    from rig.serve import start

    knobs, env = METHODS[method]
    own = {**GPU_SETS, "GPU_ARCH": nvml_device().arch} if platform == "gpu" else {}
    plan = resolve("kvarn", platform=platform, environ={}, sets={"PORT": str(free_port()),
                                                                  "API_KEY_FILE": str(log_dir / "key"), **own,
                                                                  **knobs})
    if env:
        plan = plan.model_copy(update={"env": {**plan.env, **env}})
    step = int(dict(zip(plan.argv, plan.argv[1:], strict=False))["--max-num-batched-tokens"])
    if window_tokens <= step:
        raise SystemExit(f"--window-tokens {window_tokens} must exceed the step of {step} tokens, or no token "
                         "attends over the cache")
    t0 = time.monotonic()
    server = start(plan, log_path=log_dir / f"vllm-{method}.log")
    try:
        client = Client(server.url, (log_dir / "key").read_text().strip(), server.served_name)
        perplexity_sets = suite.load("perplexity").sets
        rows = {}
        for name in sets:
            src = perplexity_sets[name]
            if src.source == "corpus" and lines:
                src = src.model_copy(update={"lines": lines})
            ids = client.tokenize(load_text(name, src).text)
            n = min(windows, len(ids) // window_tokens)
            if n == 0:
                raise SystemExit(f"set {name} has {len(ids)} tokens, fewer than one window of {window_tokens}")
            acc = [0.0, 0, 0.0, 0]
            for w in range(n):
                part = window_nll_split(client, ids[w * window_tokens:(w + 1) * window_tokens], step)
                acc = [a + b for a, b in zip(acc, part, strict=True)]
            rows[name] = {"windows": n, "first_step_ppl": math.exp(acc[0] / acc[1]), "first_step_tokens": acc[1],
                          "cached_ppl": math.exp(acc[2] / acc[3]), "cached_tokens": acc[3]}
        ms = decode_ms(client, ids[:window_tokens])
        log = server.log_path.read_text()
        return {"method": method, "platform": platform, "step_tokens": step, "sets": rows,
                "decode_ms_per_token": round(ms, 3), "decode_context": window_tokens,
                "seconds": round(time.monotonic() - t0, 1), "fingerprint": collect(plan),
                "kvarn_log": [ln.split("] ", 1)[-1] for ln in log.splitlines() if "rig kvarn" in ln][-1:]}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8, help="windows per set (default 8)")
    ap.add_argument("--window-tokens", type=int, default=4096, help="tokens a window (default 4096)")
    ap.add_argument("--sets", default="corpus-english,corpus-german,corpus-code",
                    help="perplexity sets of quality/perplexity.toml (default: rig's three held-out corpus sets)")
    ap.add_argument("--lines", type=int, default=4000,
                    help="lines of a corpus set (its held-out seed; default 4000, for enough windows; 0: the set's)")
    ap.add_argument("--methods", default="auto,kvarn,rtn", help="of auto, kvarn, rtn (default all three)")
    ap.add_argument("--platform", default="cpu", choices=("cpu", "gpu"),
                    help="cpu (vLLM's CPU backend) or gpu (vLLM's CUDA build, GPU 0; default cpu)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args(argv)
    methods = [m for m in a.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        ap.error(f"--methods {a.methods!r}: each of {', '.join(METHODS)}")
    sets = [s for s in a.sets.split(",") if s]
    known = suite.load("perplexity").sets
    if [s for s in sets if s not in known] or not sets:
        ap.error(f"--sets {a.sets!r}: sets of quality/perplexity.toml ({', '.join(known)})")
    with tempfile.TemporaryDirectory(prefix="kvarn-ppl-") as tmp:
        results = [measure(m, sets, a.windows, a.window_tokens, Path(tmp), a.lines, a.platform) for m in methods]
    base = next((r for r in results if r["method"] == "auto"), None)
    print(f"KV cache perplexity in vLLM ({a.platform} platform, {a.window_tokens}-token windows, steps of "
          f"{results[0]['step_tokens']} tokens: the 'cached' tokens attend over the earlier steps' cache)\n")
    print("| set | method | first step ppl | cached ppl | cached vs auto | windows | cached tokens |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in sets:
        for r in results:
            row = r["sets"][name]
            rel = (f"{row['cached_ppl'] / base['sets'][name]['cached_ppl'] - 1:+.2%}" if base else "-")
            print(f"| {name} | {r['method']} | {row['first_step_ppl']:.4f} | {row['cached_ppl']:.4f} | {rel} | "
                  f"{row['windows']} | {row['cached_tokens']:,} |")
    for r in results:
        print(f"\n{r['method']}: {r['seconds']} s; one request's decode after {r['decode_context']:,} tokens: "
              f"{r['decode_ms_per_token']} ms a token; {' '.join(r['kvarn_log']) or 'no kvarn log line'}")
    if a.json:
        write_atomic(a.json, json.dumps({"window_tokens": a.window_tokens, "results": results}, indent=2,
                                        default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
