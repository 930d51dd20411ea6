"""Does our client measure what `vllm bench serve` measures? Same workload, same server, back to back.

Starts a server of a profile (default: batch; the tiny hybrid model on a CPU host), then for each
round runs the pinned `vllm bench serve` CLI on a random-dataset workload and, right after, our
client (rig/bench/client.py) on the same workload shape — prompts sampled by vLLM's own
RandomDataset with the next seed, the request body `vllm bench serve` sends; the two alternate
who goes first from round to round. Round 0 is a warm-up and is not counted.

Two passes never run on an engine of the same speed: on a small shared host one pass decodes
up to 20 % faster than the next. So each pass is also measured by the server itself — its
`vllm:time_to_first_token_seconds` and `vllm:request_time_per_output_token_seconds` histograms
over that pass — and the verdict compares what each tool reports *relative to the server's own
figure of the same pass*, which cancels the engine's speed: TTFT / server TTFT, TPOT / server
TPOT, and output tok/s x server TPOT (a pass on a slower engine has fewer tokens per second and
a longer TPOT in the same proportion). Verdict figure: the median over rounds of (rig's
normalised figure / vllm's) − 1; exit 1 when one exceeds --tolerance (3 %). The raw figures and
their paired differences (rig / vllm − 1 within a round, the engine's drift included) are
printed too.

    .venv/bin/python bench/scripts/agreement.py [--rounds 8] [--num-prompts 64] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from rig import paths  # noqa: E402
from rig.bench import client, metrics  # noqa: E402
from rig.bench.servers import ServerPool  # noqa: E402

FIGURES = ("output_tok_per_s", "mean_ttft_ms", "mean_tpot_ms")
# the server's own view of the same requests (histogram sums / counts over the pass), printed
# beside each tool's figures: when the two tools differ but these do not, the difference is the
# client's, not the workload's
SERVER = {"srv_ttft_ms": "vllm:time_to_first_token_seconds",
          "srv_tpot_ms": "vllm:request_time_per_output_token_seconds"}


def histograms(t) -> dict[str, float]:
    """``_sum`` and ``_count`` of the SERVER histograms, summed over their label sets."""
    text = httpx.get(f"{t.url}/metrics", headers=t.headers, timeout=60).text
    return metrics.totals(text, {m + suffix for m in SERVER.values() for suffix in ("_sum", "_count")})


def measured(fn, t, *args) -> dict[str, float]:
    """A tool's figures plus the server's mean TTFT and TPOT over the same pass, in ms."""
    h0 = histograms(t)
    f = fn(t, *args)
    h1 = histograms(t)
    for key, metric in SERVER.items():
        n = h1.get(metric + "_count", 0) - h0.get(metric + "_count", 0)
        f[key] = 1000 * (h1.get(metric + "_sum", 0) - h0.get(metric + "_sum", 0)) / n if n else float("nan")
    return f


def vllm_bench(t, a: argparse.Namespace, seed: int, out: Path) -> dict[str, float]:
    """One `vllm bench serve` call (the venv's CLI); its JSON figures."""
    vllm = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm), "bench", "serve", "--backend", "vllm", "--base-url", t.url, "--model", t.served_name,
           "--tokenizer", t.tokenizer, "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
           "--max-concurrency", str(a.concurrency), "--seed", str(seed), "--ignore-eos", "--save-result",
           "--result-dir", str(out), "--result-filename", f"vllm-{seed}.json", "--disable-tqdm"]
    env = {**os.environ, **paths.cache_env(), "OPENAI_API_KEY": t.headers["Authorization"].split(" ", 1)[1]}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d = json.loads((out / f"vllm-{seed}.json").read_text())
    return {"output_tok_per_s": d["output_throughput"], "mean_ttft_ms": d["mean_ttft_ms"],
            "mean_tpot_ms": d["mean_tpot_ms"]}


def ours(t, a: argparse.Namespace, seed: int, tok) -> dict[str, float]:
    """Our client on the same workload: vLLM's RandomDataset prompts, the body vllm bench sends."""
    from vllm.benchmarks.datasets import RandomDataset

    reqs = RandomDataset(random_seed=seed).sample(tokenizer=tok, num_requests=a.num_prompts,
                                                   input_len=a.input_len, output_len=a.output_len)
    bodies = [{"model": t.served_name, "prompt": r.prompt, "repetition_penalty": 1.0, "max_tokens": a.output_len,
               "ignore_eos": True} for r in reqs]
    b = asyncio.run(client.run_batch(t.url, "/v1/completions", bodies, a.concurrency, t.headers))
    if b.failed:
        raise SystemExit(f"our client: {len(b.failed)} requests failed: {b.failed[0].error}")
    rs = b.requests
    return {"output_tok_per_s": sum(r.output_tokens for r in rs) / b.wall_s,
            "mean_ttft_ms": statistics.fmean(r.ttft_ms for r in rs),
            "mean_tpot_ms": statistics.fmean(r.tpot_ms for r in rs if r.tpot_ms is not None)}


# each tool's figure relative to the server's own figure of the same pass (see the docstring)
NORMALISED = {
    "mean_ttft_ms / srv_ttft_ms": lambda r: r["mean_ttft_ms"] / r["srv_ttft_ms"],
    "mean_tpot_ms / srv_tpot_ms": lambda r: r["mean_tpot_ms"] / r["srv_tpot_ms"],
    "output_tok_per_s x srv_tpot_ms": lambda r: r["output_tok_per_s"] * r["srv_tpot_ms"],
}


def median(rows: dict[str, list[dict[str, float]]], side: str, x: str) -> float:
    return statistics.median(r[x] for r in rows[side])


def paired(rows: dict[str, list[dict[str, float]]], f) -> float:
    """Median over rounds of f(rig) / f(vllm) - 1, the two passes of a round back to back."""
    return statistics.median(f(o) / f(v) - 1 for o, v in zip(rows["ours"], rows["vllm"], strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="batch")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8, help="counted rounds (after one warm-up round)")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=7000)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    os.environ.update(paths.cache_env())
    with ServerPool(a.profile) as pool, pool.acquire({}) as t, tempfile.TemporaryDirectory() as tmp:
        tok = AutoTokenizer.from_pretrained(t.tokenizer)
        print(f"server: {t.served_name} ({t.plan.platform}), workload: random {a.input_len}/{a.output_len}, "
              f"{a.num_prompts} prompts, concurrency {a.concurrency}, --ignore-eos")
        rows: dict[str, list[dict[str, float]]] = {"vllm": [], "ours": []}
        seed = a.seed
        for k in range(a.rounds + 1):
            if k % 2:  # alternate who goes first, so drift on a shared host does not favour one side
                o = measured(ours, t, a, seed + 1, tok)
                v = measured(vllm_bench, t, a, seed, Path(tmp))
            else:
                v = measured(vllm_bench, t, a, seed, Path(tmp))
                o = measured(ours, t, a, seed + 1, tok)
            seed += 2
            tag = "warm-up" if k == 0 else f"round {k}"
            for name, f in (("vllm bench serve", v), ("rig client", o)):
                print(f"{tag:>8}  {name:<16} " + "  ".join(f"{x} {f[x]:9.2f}" for x in (*FIGURES, *SERVER)))
            if k:
                rows["vllm"].append(v)
                rows["ours"].append(o)
        print("\n                     median over rounds            paired: median of (rig / vllm) - 1")
        print(f"{'raw figure':<20} {'vllm bench serve':>17} {'rig client':>12} {'round by round':>16}")
        for x in (*FIGURES, *SERVER):
            print(f"{x:<20} {median(rows, 'vllm', x):>17.2f} {median(rows, 'ours', x):>12.2f} "
                  f"{paired(rows, lambda r, x=x: r[x]) * 100:>+15.2f}%")
        worst = 0.0
        print(f"\n{'verdict: normalised by the server':<37} {'paired: median of (rig / vllm) - 1':>34}")
        for x, norm in NORMALISED.items():
            d = paired(rows, norm)
            worst = max(worst, abs(d))
            print(f"{x:<37} {d * 100:>+33.2f}%")
    ok = worst <= a.tolerance
    verdict = "AGREE" if ok else "DISAGREE"
    print(f"\n{verdict}: largest difference {worst * 100:.2f}% (tolerance {a.tolerance * 100:.0f}%)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
