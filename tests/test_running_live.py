"""`bench`/`quality`/`verify --running` against servers `inv serve` started, in a subprocess, for real.

Two servers, one after the other (never both up: the first is killed by its last test):
- `cached`: batch with PREFIX_CACHE=1 and a 512 MiB KV cache — a bench pass warns that the cache
  could not be reset (serve's plans do not set VLLM_SERVER_DEV_MODE); raw, shared-prefix and the
  quality battery are refused with exit 2 before a request is sent (the server's own request
  counters do not move; the battery is refused on the recorded plan); then `kill -9` of serve and
  its server leaves a stale record, ignored with a message.
- `batch`: the batch profile as `pixi run serve-batch` runs it on CPU — a throughput cell and the
  quality battery against it carry its plan digest; `verify --running` passes; then its engine is
  killed mid-run: the run is invalid, what was measured is kept, the cell after it is "not run".
Each has a state folder of its own (its record, results) sharing the shell's caches and models.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from invoke import Context, Exit

from rig import paths, running
from rig.bench.results import RunResult
from rig.server import free_port, log_tail

pytestmark = pytest.mark.slow

INV = str(Path(sys.executable).with_name("inv"))


@dataclass
class Served:
    """An `inv serve` subprocess, its state folder and the record it wrote."""

    proc: subprocess.Popen
    state: Path
    args: list[str]
    env: dict[str, str]
    log: Path

    @property
    def record(self) -> running.Record:
        (path,) = (self.state / "servers").glob("*.json")
        return running.Record.model_validate_json(path.read_text())


def _serve(tmp: Path, *sets: str) -> Served:
    state = tmp / "state"
    state.mkdir()
    (state / "cache").symlink_to(paths.cache_dir())  # the shell's compile cache: a warm start
    env = {**os.environ, "RIG_STATE_DIR": str(state), "RIG_MODELS_DIR": str(paths.models_dir())}
    args = ["serve", "--profile", "batch", "--platform", "cpu", "--set", f"PORT={free_port()}",
            "--set", f"API_KEY_FILE={tmp / 'api_key'}", *[x for s in sets for x in ("--set", s)]]
    log = tmp / "serve.log"
    proc = subprocess.Popen([INV, *args], cwd=paths.ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, process_group=0)
    served = Served(proc, state, args, env, log)
    deadline = time.monotonic() + 900  # rig.serve.start's own ready_timeout (docs/development.md)
    while not list((state / "servers").glob("*.json")):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(served)
            pytest.fail(f"inv serve did not record a ready server (exit {proc.poll()}):\n{log_tail(log)}")
        time.sleep(1)
    return served


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _stop(s: Served) -> None:
    """SIGTERM serve (it stops its server and removes the record); kill whatever is left."""
    tree = _tree(s.proc.pid)
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
    try:
        s.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=10)


def _counters(s: Served) -> dict[str, float]:
    """The server's own request and prompt-token counters (a request sent would move them)."""
    rec = s.record
    text = httpx.get(f"{rec.url}/metrics", headers=rec.headers(), timeout=30).text
    out = {}
    for name in ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:num_requests_running"):
        out[name] = sum(float(m) for m in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))
    return out


def _protocol(tmp: Path, name: str, cells: list[tuple[int, int, int, int]]) -> str:
    """A throughput protocol file of the given (input, output, concurrency, prompts) cells."""
    body = [f'schema_version = 1\nkind = "throughput"\ndescription = "{name}"\nsteady_state = false\n']
    body += [f"[[cells]]\ninput_len = {i}\noutput_len = {o}\nconcurrency = {c}\nnum_prompts = {n}\n"
             for i, o, c, n in cells]
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(body))
    return str(path)


def _bench(path: str, **kw) -> RunResult:
    """`inv bench --running` of one protocol file; the result it wrote (Exit 1 is an invalid run: re-raised)."""
    from rig.cli import bench

    try:
        bench.run(Context(), protocol=[path], **{"running": True, **kw}, scale="1", progress=False)
        code = 0
    except Exit as e:
        code = e.code
    (folder,) = [d for d in (paths.results_dir()).iterdir() if d.name.endswith(f"-{Path(path).stem}-batch")]
    r = RunResult.model_validate_json((folder / "result.json").read_text())
    assert code == (0 if r.valid else 1), (code, r.problems)
    return r


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> Iterator[Served]:
    s = _serve(tmp_path_factory.mktemp("cached"), "PREFIX_CACHE=1", "KV_MEM=512M")
    try:
        yield s
    finally:
        _stop(s)


@pytest.fixture
def in_state(monkeypatch):
    def use(s: Served) -> None:
        monkeypatch.setenv("RIG_STATE_DIR", str(s.state))
        monkeypatch.setenv("RIG_MODELS_DIR", str(paths.models_dir()))
    return use


def test_a_pass_on_a_server_without_the_reset_endpoint_warns_the_cache_was_not_reset(cached, in_state, tmp_path):
    in_state(cached)
    r = _bench(_protocol(tmp_path, "small", [(64, 16, 2, 2)]), seed=810_000)
    assert r.valid, r.problems
    assert r.server["started_by"] == "rig serve (recorded)" and r.server["plan_digest"] == cached.record.plan_digest
    warning = [n for n in r.notes if n.startswith("warning: the prefix cache was NOT reset between passes")]
    assert len(warning) == 1 and "VLLM_SERVER_DEV_MODE=1" in warning[0], r.notes
    assert r.seeds and len(set(r.seeds)) == len(r.seeds)  # a seed per pass instead


def test_what_the_running_server_cannot_do_is_refused_before_a_request_is_sent(cached, in_state, capsys):
    from rig.cli import bench, quality

    in_state(cached)
    before = _counters(cached)
    results_before = sorted(paths.results_dir().iterdir())
    with pytest.raises(Exit) as e:
        bench.run(Context(), protocol=["raw", "shared-prefix"], running=True, progress=False)
    msg = str(e.value.message)
    assert e.value.code == 2 and "nothing was sent" in msg
    assert "protocol 'raw'" in msg and "PREFIX_CACHE=1 (needs 0)" in msg and "inv serve --set SPEC=off" in msg
    assert "protocol 'shared-prefix' compares two servers" in msg
    with pytest.raises(Exit) as e:  # refused on the recorded plan, before /metrics is read
        quality.quality(Context(), running=True, suite="tiny-quick", docs=False)
    msg = str(e.value.message)
    assert e.value.code == 2 and "PREFIX_CACHE=1 (from --set)" in msg and "nothing was sent" in msg, msg
    assert "inv serve --profile batch --overlay quality" in msg, msg
    assert sorted(paths.results_dir().iterdir()) == results_before  # nothing half-written either
    assert _counters(cached) == before


def test_a_stale_record_after_kill_9_is_ignored_with_a_message(cached, in_state, capsys):
    from rig.cli import bench

    in_state(cached)
    rec = cached.record
    tree = _tree(cached.proc.pid)
    for p in tree:  # serve and its whole server, with no chance to clean up
        p.kill()
    psutil.wait_procs(tree, timeout=30)
    assert list((cached.state / "servers").glob("*.json")), "kill -9 left no record to be stale"
    capsys.readouterr()
    with pytest.raises(Exit) as e:
        bench.run(Context(), protocol=["throughput"], running=True, progress=False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no running server is recorded" in str(e.value.message)
    assert "ignoring a stale server record" in err and f"pid {rec.pid}" in err, err
    assert not list((cached.state / "servers").glob("*.json"))


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> Iterator[Served]:
    s = _serve(tmp_path_factory.mktemp("batch"))
    try:
        yield s
    finally:
        _stop(s)
        assert not list((s.state / "servers").glob("*.json")), "serve left its record behind"


def test_serve_records_the_plan_it_serves(batch):
    rec = batch.record
    dry = subprocess.run([INV, *batch.args, "--dry-run", "--json"], cwd=paths.ROOT, env=batch.env,
                         capture_output=True, text=True, timeout=300)  # the plan these arguments resolve to
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout) == rec.plan and rec.plan_obj().digest == rec.plan_digest
    assert rec.serve_pid == batch.proc.pid and rec.pid in [p.pid for p in _tree(batch.proc.pid)]
    assert rec.check() is None and rec.fingerprint["plan"]["sha256"] == rec.plan_digest
    assert "inv bench --running" in batch.log.read_text()


def test_bench_quality_and_verify_measure_the_recorded_server(batch, in_state, tmp_path, capsys, monkeypatch):
    from rig.cli import dev, quality

    in_state(batch)
    monkeypatch.setenv("COLUMNS", "400")  # verify's rich table on one line a row
    rec = batch.record
    r = _bench(_protocol(tmp_path, "one-cell", [(128, 64, 4, 8)]), seed=820_000)
    assert r.valid, r.problems
    assert r.server["plan_digest"] == rec.plan_digest == r.fingerprint["plan"]["sha256"]
    assert r.server["pid"] == rec.pid and r.plan == rec.plan
    assert r.cells[0].passes[-1].figures["total_output_tokens"] == 8 * 64
    capsys.readouterr()
    try:
        quality.quality(Context(), running=True, suite="tiny-quick", docs=False)
    except Exit as e:  # the random-weight model fails its floors (docs/quality.md): exit 1, result written
        assert e.code == 1
    out = capsys.readouterr().out
    (path,) = re.findall(r"^rig: result: (\S+)$", out, re.M)
    q = json.loads(Path(path).read_text())
    assert q["plan_digest"] == rec.plan_digest and q["server"]["started_by"] == "rig serve (recorded)"
    assert q["server"]["pid"] == rec.pid and q["perplexity"]["overall"] > 0
    dev.verify(Context(), running=True)  # raises Exit(1) on a failed check
    assert f"pid {rec.pid}" in capsys.readouterr().out


def test_a_server_rig_did_not_start_is_described_by_what_it_answers(batch, in_state, tmp_path, capsys, monkeypatch):
    """--url: no record is used (none is trusted): the result is marked external, with /version and /v1/models."""
    from rig.cli import bench, dev

    in_state(batch)
    rec = batch.record
    key_file = rec.api_key_file
    before = _counters(batch)
    with pytest.raises(Exit) as e:
        bench.run(Context(), protocol=["raw"], url=rec.url, key_file=key_file, progress=False)
    assert e.value.code == 2 and "cannot verify" in str(e.value.message) and _counters(batch) == before
    r = _bench(_protocol(tmp_path, "foreign", [(64, 16, 2, 2)]), seed=840_000, running=False, url=rec.url,
               key_file=key_file)
    assert r.valid, r.problems
    assert r.server["started_by"] == "external" and r.server["version"].startswith("0.28."), r.server
    assert r.server["models"][0]["id"] == rec.served_name
    assert r.server["cache_config"]["enable_prefix_caching"] == "False"
    assert r.plan == {} and "plan" not in r.fingerprint
    assert any("plan and fingerprint are unknown" in n for n in r.notes), r.notes
    monkeypatch.setenv("COLUMNS", "400")
    dev.verify(Context(), url=rec.url, key_file=key_file)
    assert "not started by rig: vLLM 0.28." in capsys.readouterr().out


def test_a_server_killed_mid_run_makes_it_invalid_keeps_the_data_and_sends_nothing_more(batch, in_state, tmp_path,
                                                                                        capsys):
    in_state(batch)
    rec = batch.record
    path = _protocol(tmp_path, "dies", [(32, 16, 1, 1), (128, 1024, 4, 4), (48, 16, 1, 1)])

    def kill_during_the_second_cell() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # only the long cell runs 4 requests at once
            if _counters(batch)["vllm:num_requests_running"] >= 4:
                time.sleep(1)  # decoding now
                os.killpg(rec.pid, signal.SIGKILL)  # the vllm server's whole group: engine core too
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_during_the_second_cell, daemon=True)
    killer.start()
    r = _bench(path, seed=830_000)
    killer.join(5)
    out, err = capsys.readouterr()
    first, second, third = "32/16, 1 concurrent", "128/1024, 4 concurrent", "48/16, 1 concurrent"
    assert not r.valid and any("during " + second in p and "the run stops here" in p for p in r.problems), r.problems
    assert [c.label for c in r.cells] == [first, second] and r.cells[0].passes[-1].ok  # measured before: kept
    assert r.cells[0].summary["output_tok_per_s"].n == 1
    assert r.not_run == [third] and any(n.startswith("not run") for n in r.notes)
    folder = next(paths.results_dir().glob("*-dies-batch"))
    rows = [json.loads(x) for x in (folder / "requests.jsonl").read_text().splitlines()]
    assert {x["cell"] for x in rows} <= {first, second}  # nothing was sent for the third cell
    tables = (folder / "tables.md").read_text()
    assert "valid: **NO**" in tables and "not run" in tables
    assert "Traceback" not in tables + out + err and len(tables) < 8000, len(tables)
    assert batch.proc.wait(timeout=120) == 1  # serve saw its server die, said so and removed the record
    assert not list((batch.state / "servers").glob("*.json"))
