"""`vllm bench serve` (the pinned 0.28 in this venv) for the random-dataset protocols.

Each cell is one `vllm bench serve` invocation: its own argv, parsed by vLLM's own bench-serve
parser (``vllm.benchmarks.serve.add_cli_args``) and run by its ``main`` — exactly what
``vllm bench serve ARGV`` does (vllm/entrypoints/cli/benchmark/serve.py is those two calls).
The calls of one protocol share one worker process, because importing vLLM costs 15–25 s on a
2-core host and a protocol has up to 13 cells; the result records each cell's command line,
which reruns as is with ``.venv/bin/vllm bench serve``. The API key travels in the worker's
environment (``OPENAI_API_KEY``, which vllm bench reads), never in an argv or a result.

Run as ``python -m rig.bench.vllm_bench``: the worker loop (one JSON request per stdin line).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BenchServeError(RuntimeError):
    """A `vllm bench serve` call failed or its worker died."""


@dataclass(frozen=True)
class ServeArgs:
    """One random-dataset call."""

    base_url: str
    model: str
    tokenizer: str
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    seed: int
    result_dir: str
    result_filename: str
    ignore_eos: bool = True

    def argv(self) -> list[str]:
        """Arguments after ``vllm bench serve``."""
        out = ["--backend", "vllm", "--base-url", self.base_url, "--model", self.model,
               "--tokenizer", self.tokenizer, "--dataset-name", "random",
               "--random-input-len", str(self.input_len), "--random-output-len", str(self.output_len),
               "--num-prompts", str(self.num_prompts), "--max-concurrency", str(self.concurrency),
               "--seed", str(self.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed",
               "--result-dir", self.result_dir, "--result-filename", self.result_filename,
               "--disable-tqdm"]
        if self.ignore_eos:
            out.append("--ignore-eos")
        return out

    def command(self) -> str:
        return " ".join(["vllm", "bench", "serve", *self.argv()])


class Worker:
    """A long-lived `vllm bench serve` runner process (``with Worker(env) as w: w.run(args, log)``)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Worker:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rig.bench.vllm_bench"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env={**os.environ, **self.env},
            cwd=str(Path(__file__).resolve().parents[2]))
        return self

    def run(self, args: ServeArgs, log: Path) -> dict[str, Any]:
        """Run one call; its JSON result (BenchServeError when it failed or the worker died)."""
        assert self.proc and self.proc.stdin and self.proc.stdout
        try:
            self.proc.stdin.write(json.dumps({"argv": args.argv(), "log": str(log)}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchServeError(f"the vllm bench worker died (exit {self.proc.poll()}); see {log}") from None
        line = self.proc.stdout.readline()
        if not line:
            raise BenchServeError(f"the vllm bench worker died (exit {self.proc.wait()}); see {log}")
        reply = json.loads(line)
        if reply.get("error"):
            raise BenchServeError(f"vllm bench serve failed: {reply['error']} (log: {log})")
        path = Path(args.result_dir) / args.result_filename
        if not path.is_file():
            raise BenchServeError(f"vllm bench serve wrote no result at {path} (log: {log})")
        return json.loads(path.read_text())

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _serve_one(argv: list[str], log: str) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    with open(log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        print(f"$ vllm bench serve {' '.join(argv)}", flush=True)
        try:
            main(parser.parse_args(argv))
        except SystemExit as e:
            return {"error": f"argument error (exit {e.code}); see the log"}
        except Exception as e:  # reported to the parent, which marks the run invalid
            import traceback

            traceback.print_exc()
            return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def _loop() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM prints; only replies go to the parent's pipe
    for line in sys.stdin:
        req = json.loads(line)
        out.write(json.dumps(_serve_one(req["argv"], req["log"])) + "\n")
        out.flush()


if __name__ == "__main__":
    _loop()
