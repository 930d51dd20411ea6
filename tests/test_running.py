"""The running-server record and the refusals of `--running` / `--url`, without a vLLM server.

Records are written for real processes (a `sleep` child) and judged by their real pid and start
time; the refusals are checked on resolved plans. tests/test_running_live.py does the same against
a real `serve`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from invoke import Context, Exit

from rig import running
from rig.bench import attach, failures, protocols
from rig.bench.runner import Target
from rig.plan import resolve
from rig.server import free_port


@dataclass
class Proc:
    """What running.write reads of a server: its process, URL and log."""

    proc: subprocess.Popen
    url: str
    log_path: Path | None = None


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RIG_STATE_DIR", str(tmp_path))
    return tmp_path


def _plan(tmp: Path, **sets: str):
    return resolve("batch", platform="cpu", environ={},
                   sets={"PORT": str(free_port()), "API_KEY_FILE": str(tmp / "api_key"), **sets})


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


def test_record_is_written_atomically_and_names_the_server(state, sleeper):
    plan = _plan(state)
    secret = "s3cret-key-that-must-not-leak"
    (state / "api_key").write_text(secret + "\n")
    path = running.write(plan, Proc(sleeper, f"http://127.0.0.1:{plan.knobs['PORT']}"))
    assert path.parent == state / "servers" and not [p for p in path.parent.iterdir() if p.name.startswith(".")]
    rec = running.Record.model_validate_json(path.read_text())
    assert (rec.plan_digest, rec.pid, rec.served_name) == (plan.digest, sleeper.pid, plan.served_name)
    assert rec.plan_obj().digest == plan.digest and rec.fingerprint["plan"]["sha256"] == plan.digest
    assert secret not in path.read_text() and rec.key() == secret and rec.api_key_file == str(state / "api_key")
    assert running.find().pid == sleeper.pid
    running.remove(path, pid=sleeper.pid + 1)  # another server's record on that port: left alone
    assert path.exists()
    running.remove(path, pid=sleeper.pid)
    assert not path.exists()


def test_a_record_of_a_killed_process_is_stale_named_removed_and_ignored(state, sleeper):
    plan = _plan(state)
    path = running.write(plan, Proc(sleeper, "http://127.0.0.1:9"))
    os.kill(sleeper.pid, signal.SIGKILL)
    sleeper.wait()
    said: list[str] = []
    with pytest.raises(running.RunningError, match="no running server is recorded.*inv serve.*--url"):
        running.find(warn=said.append)
    assert len(said) == 1 and "stale server record" in said[0] and str(sleeper.pid) in said[0], said
    assert not path.exists()


def test_a_reused_pid_is_not_the_recorded_server(state, sleeper):
    plan = _plan(state)
    path = running.write(plan, Proc(sleeper, "http://127.0.0.1:9"))
    data = json.loads(path.read_text())
    data["start_time"] -= 3600  # the pid now belongs to a process started an hour later than recorded
    path.write_text(json.dumps(data))
    rec = running.Record.model_validate(data)
    assert not rec.same_process() and "restarted" in rec.check()
    assert running.live(warn=lambda m: None) == []


def test_a_live_process_that_does_not_answer_is_gone(state, sleeper):
    rec = running.Record.model_validate_json(
        running.write(_plan(state), Proc(sleeper, f"http://127.0.0.1:{free_port()}")).read_text())
    assert rec.same_process() and "stopped answering /health" in rec.check(timeout=2)


def test_bench_running_without_a_record_exits_2(state, capsys):
    from rig.cli import bench

    with pytest.raises(Exit) as e:
        bench.run(Context(), protocol=["throughput"], platform="cpu", running=True, progress=False)
    assert e.value.code == 2 and "no running server is recorded" in str(e.value.message)
    assert not (state / "results").exists()


def test_quality_and_verify_running_without_a_record_exit_2(state):
    from rig.cli import dev, quality

    for call in (lambda: quality.quality(Context(), platform="cpu", running=True, docs=False),
                 lambda: dev.verify(Context(), running=True)):
        with pytest.raises(Exit) as e:
            call()
        assert e.value.code == 2 and "no running server is recorded" in str(e.value.message)


def _target(plan, foreign: bool = False) -> Target:
    return Target("http://127.0.0.1:9", {}, plan.served_name, plan, lambda: True, foreign=foreign,
                  server={"plan_digest": plan.digest})


def test_refusals_say_why_and_what_to_do(tmp_path):
    protos = [(n, protocols.load(n)) for n in ("throughput", "raw", "shared-prefix")]
    cached = _target(_plan(tmp_path, PREFIX_CACHE="1"))
    why = attach.refusals(protos, cached, {})
    assert len(why) == 2, why
    assert "'raw'" in why[0] and "PREFIX_CACHE=1 (needs 0)" in why[0]
    assert "inv serve --set SPEC=off --set PREFIX_CACHE=0" in why[0]
    assert "'shared-prefix' compares two servers" in why[1] and "without --running" in why[1]
    plain = _target(_plan(tmp_path))
    assert attach.refusals(protos[:2], plain, {}) == []  # the batch plan meets raw's requires
    assert "already up with its own knobs" in attach.refusals(protos[:1], plain, {"MAX_SEQS": "4"})[0]
    (foreign,) = attach.refusals(protos[1:2], _target(_plan(tmp_path), foreign=True), {})
    assert "cannot verify" in foreign and "--running" in foreign


def _traceback_of(url: str) -> str:
    try:
        httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return traceback.format_exc()
    raise AssertionError(f"{url} answered")


def test_failures_are_summarised_by_kind_one_line_each():
    refused = _traceback_of(f"http://127.0.0.1:{free_port()}/v1/completions")
    assert refused.count("\n") > 10  # a real, long traceback
    errors = [refused] * 64 + ["HTTP 404: model not found"] * 2 + [None, ""]
    lines = failures.summarize(errors)
    assert len(lines) == 2 and lines[0].startswith("64 x ConnectError: ") and lines[1].startswith("2 x HTTP 404")
    assert all("\n" not in ln and len(ln) < 300 for ln in lines)
    msg = failures.line(66, 70, errors, 4)
    assert msg.startswith("66 of 70 requests failed (4 completed): 64 x ConnectError") and len(msg) < 600
