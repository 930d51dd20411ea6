"""bench/scripts/kvarn_bench.py end to end on CPU (``--smoke``: Triton's interpreter, tiny sizes), and its long decode.

The smoke run is one subprocess (the script sets TRITON_INTERPRET=1 before triton loads, which this
process cannot do once triton is imported), on one torch thread; its JSON is read back. What is held
of the long synthetic decode (issue 14's error accumulation):

* every checkpoint (2, 4, 8 steps at the smoke size) has a row for every format in both modes
  (feedback, no feedback), and the table prints them; every figure is finite;
* controls that can fail: the fp32 rerun equals the fp32 reference (the harness compares like with
  like); without feedback the states are the same in every format (nothing flows from o to x); with
  feedback the KVarN state does differ by the last checkpoint (the feedback path carries cache error
  into the state); fp16's error stays at rounding level;
* KVarN's attention-output error is below plain RTN's at the same 832 B, at every checkpoint in both
  modes (held at the smoke size for seeds 0-5 when this was written; the error rows show the same
  ordering), and bounded (relative error < 1, cosine > 0.5).

The batched exact attention the long decode uses is held to the error rows' attention_gqa per slot.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rig.kernels import load_file
from tests.conftest import gpu_script_refuses

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "scripts" / "kvarn_bench.py"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: the KVarN kernels are Triton")
SMOKE_CHECKPOINTS = (2, 4, 8)
FORMATS = ("fp32 (rerun)", "fp16", "fp8 e4m3", "kvarn", "plain RTN")
MODES = ("feedback", "no feedback")
METRICS = ("out_rel_error", "out_cosine", "state_rel_error", "state_cosine")


def _bench():
    """kvarn_bench.py as a module (importing it loads no kernel and runs nothing)."""
    return load_file(SCRIPT, "rig_bench_kvarn_bench")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[str, dict]:
    """(stdout, JSON) of ``kvarn_bench.py --smoke --json``."""
    out = tmp_path_factory.mktemp("kvarn_bench") / "smoke.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"kvarn_bench.py --smoke failed (exit {proc.returncode}):\n" \
                                 f"{(proc.stdout + proc.stderr)[-6000:]}"
    return proc.stdout, json.loads(out.read_text())


def _rows(data: dict) -> dict:
    rows = data["long_decode"]
    by = {(r["decode_steps"], r["format"], r["mode"]): r for r in rows}
    assert len(by) == len(rows), "a (steps, format, mode) row appears twice"
    return by


def test_attention_batched_is_attention_gqa_per_slot(one_torch_thread):
    kb = _bench()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 24, 256, generator=g)
    k, v = torch.randn(2, 3, 4, 50, 256, generator=g)
    got = kb.attention_batched(q, k, v)
    for s in range(3):
        want = kb.attention_gqa(q[s:s + 1], k[s].transpose(0, 1), v[s].transpose(0, 1))[0]
        torch.testing.assert_close(got[s], want, rtol=1e-5, atol=1e-6)
    swapped = kb.attention_batched(q, k.flip(1), v.flip(1))  # KV heads served to the wrong query heads
    assert not torch.allclose(swapped, got, rtol=1e-3, atol=1e-4)


def test_smoke_long_decode_rows_and_table(smoke):
    stdout, data = smoke
    by = _rows(data)
    want = {(c, f, m) for c in SMOKE_CHECKPOINTS for f in FORMATS for m in MODES}
    assert set(by) == want, f"missing {sorted(want - set(by))}, unexpected {sorted(set(by) - want)}"
    for key, row in by.items():
        assert all(math.isfinite(row[m]) for m in METRICS), f"{key}: {row}"
        assert row["tokens"] == data["facts"]["long_decode"]["prefill"] + key[0]
    assert "| decode steps | tokens | format |" in stdout
    for c in SMOKE_CHECKPOINTS:
        for f in FORMATS:
            assert f"| {c:,} | {by[(c, f, 'feedback')]['tokens']:,} | {f} |" in stdout, f"no table row {c} {f}"


def test_smoke_long_decode_controls(smoke):
    _, data = smoke
    by = _rows(data)
    for c in SMOKE_CHECKPOINTS:
        for m in MODES:
            rerun = by[(c, "fp32 (rerun)", m)]
            assert rerun["out_rel_error"] <= 1e-6 and rerun["state_rel_error"] <= 1e-6, rerun
            assert by[(c, "fp16", m)]["out_rel_error"] < 0.01, by[(c, "fp16", m)]
        for f in FORMATS:
            assert by[(c, f, "no feedback")]["state_rel_error"] <= 1e-6, f"{f} at {c}: the control's state moved"
    last = by[(SMOKE_CHECKPOINTS[-1], "kvarn", "feedback")]
    assert last["state_rel_error"] > 0.01, f"the feedback path carries no cache error into the state: {last}"


def test_smoke_long_decode_kvarn_beats_plain_rtn(smoke):
    _, data = smoke
    by = _rows(data)
    for c in SMOKE_CHECKPOINTS:
        for m in MODES:
            kv, rtn = by[(c, "kvarn", m)], by[(c, "plain RTN", m)]
            assert kv["out_rel_error"] < rtn["out_rel_error"], f"{c} steps, {m}: kvarn {kv} vs plain RTN {rtn}"
            assert kv["out_rel_error"] < 1.0 and kv["out_cosine"] > 0.5, kv


def test_the_chunk_bench_refuses_bad_contexts_and_a_host_without_cuda():
    """bench/scripts/kvarn_chunk_bench.py (kvarn_triton.chunk_attention beside the dense form it replaced, on a
    GPU): a malformed --contexts entry is refused naming it; without CUDA it says so and exits 2."""
    gpu_script_refuses(ROOT / "bench" / "scripts" / "kvarn_chunk_bench.py", ["--contexts", "8192,x"],
                       "--contexts: 'x' is not a positive integer")


def test_the_host_time_script_refuses_bad_arguments_and_a_host_without_cuda(tmp_path):
    """bench/scripts/kvarn_host_time.py (eager decode calls' host time, GPU): a missing --old file is refused naming
    it, before any device work; without CUDA it says so and exits 2."""
    gpu_script_refuses(ROOT / "bench" / "scripts" / "kvarn_host_time.py", ["--old", str(tmp_path / "none.py")],
                       "none.py: no such file")


def test_the_decode_sweep_profile_mode_launches_only_the_picked_configs():
    """kvarn_decode_sweep.py --profile (what gpu_session.sh's ncu step runs under Nsight Compute, which profiles the
    first 'decode_split' launch it sees) launches each picked config once a length and nothing else: no v1 reference
    before it, no timing; here on CPU (--smoke: Triton's interpreter, its three configs at two tiny lengths)."""
    script = ROOT / "bench" / "scripts" / "kvarn_decode_sweep.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--profile"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    launched = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("launched ")]
    assert launched == ["v1", "v2", "v3"] * 2, proc.stdout
    assert "SDPA" not in proc.stdout and "µs" not in proc.stdout, proc.stdout
