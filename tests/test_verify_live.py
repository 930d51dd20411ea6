"""`inv verify`'s live rows against one real CPU server that verify itself starts, with the trained tiny hybrid
(rig.models.train, the embedded default), the model whose greedy answer is known: every row passes on it; each
check is then seen failing on something wrong (another key, another served name, a wrong expected answer, an
engine log whose pool is not the planner's); `--url` runs every row after one failed and skips the engine log
with the reason."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from rig import enginelog, verify
from rig.models import train
from rig.plan import Plan, resolve
from rig.server import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    """The batch profile on CPU with the trained control; a 512 MiB pool (the host is shared)."""
    key_dir = tmp_path_factory.mktemp("verify")
    return resolve("batch", (), "cpu", environ={}, sets={
        "MODEL": str(train.committed()), "SERVED_NAME": "rig-trained", "PORT": str(free_port()),
        "API_KEY_FILE": str(key_dir / "api_key"), "KV_MEM": "512M"})


@pytest.fixture(scope="module")
def started(plan) -> Iterator[tuple[verify.Row, verify.Target]]:
    """verify's own server row (what `inv verify` does without --running / --url); stopped at the end."""
    with verify.server(verify.Mode("start"), plan) as (row, target):
        assert row.status == "pass" and target is not None, row.detail
        yield row, target


def test_every_live_row_passes_on_a_working_server(started):
    row, target = started
    assert row.detail.startswith("started batch (cpu) at http://127.0.0.1:") and "log " in row.detail
    rows = {name: verify.timed(name, lambda check=check: check(target)) for name, check in verify.LIVE}
    assert {n: r.status for n, r in rows.items() if r.status != "pass"} == {}, {n: r.detail for n, r in rows.items()}
    assert rows["answer"].detail == "greedy 'What is the weather in Lima?' -> a get_weather call with city='Lima'"
    assert rows["tokenize"].detail.endswith("/detokenize: the same text")
    assert "401 without the key" in rows["auth"].detail and "404 for model" in rows["unknown model"].detail
    log = rows["engine log"].detail
    print(f"\nengine log row: {log}")
    assert log.startswith("pool ") and " = planned " in log and "attention backend CPU_ATTN" in log
    assert re.search(r"concurrency at MAX_LEN [\d.]+x = planned [\d.]+x", log), log


def test_each_live_check_fails_on_what_is_wrong(started, plan, tmp_path, tiny_model):
    _, target = started
    wrong_key = verify.Target(target.url, "not-the-key-of-this-server", plan, None)
    with pytest.raises(RuntimeError, match="/v1/models answered HTTP 401"):
        verify.check_models(wrong_key)
    other_name = verify.Target(target.url, target.key, plan.model_copy(update={"served_name": "rig-other"}), None)
    with pytest.raises(RuntimeError, match=r"lists \['rig-trained'\], not the plan's 'rig-other'"):
        verify.check_models(other_name)
    wrong = verify.KnownAnswer("What is the weather in Lima?", "Oslo", train.WEATHER_TOOL, "city")
    with pytest.raises(RuntimeError, match=r"expected a get_weather call with city='Oslo', got 'Lima'"):
        verify.ask(target, wrong, "trained")
    unknown = verify.Target(target.url, target.key, plan.model_copy(update={"model": str(tiny_model)}), None)
    with pytest.raises(verify.Skip, match=f"no known answer for this model \\({tiny_model.name}\\)"):
        verify.check_answer(unknown)
    text = Path(target.log_path).read_text(errors="replace")
    tokens = enginelog.read(Path(target.log_path)).pool_tokens
    altered = tmp_path / "vllm.log"
    altered.write_text(text.replace(f"KV cache size: {tokens:,} tokens", f"KV cache size: {tokens + 64:,} tokens"))
    with pytest.raises(RuntimeError, match=f"pool {tokens + 64:,} tokens, the planner predicted {tokens:,}"):
        verify.check_engine_log(verify.Target(target.url, target.key, plan, altered))
    with pytest.raises(verify.Skip, match=r"a server rig did not start \(--url\)"):
        verify.check_engine_log(verify.Target(target.url, target.key, plan, None))


def test_url_runs_every_row_after_a_failure_and_reports_them(started, plan, inv, tmp_path, monkeypatch):
    """--url: the engine log is skipped with why; a wrong served name fails its rows, every later row still runs."""
    _, target = started
    monkeypatch.setenv("COLUMNS", "300")
    common = ["--url", target.url, "--key-file", plan.api_key_file, "--set", f"MODEL={plan.model}"]
    assert inv("verify", *common, "--set", "SERVED_NAME=rig-trained", "--report-dir", str(tmp_path / "a")) == 0
    [report] = (tmp_path / "a").glob("verify-*.json")
    rows = {r["name"]: r for r in json.loads(report.read_text())["rows"]}
    assert rows["server"]["detail"].startswith(f"server at {target.url} (not started by rig: vLLM 0.28.")
    assert rows["engine log"]["status"] == "skip" and "(--url)" in rows["engine log"]["detail"]
    assert {n for n, r in rows.items() if r["status"] != "pass"} == {"engine log"}

    assert inv("verify", *common, "--set", "SERVED_NAME=rig-elsewhere", "--report-dir", str(tmp_path / "b")) == 1
    [report] = (tmp_path / "b").glob("verify-*.json")
    doc = json.loads(report.read_text())
    status = {r["name"]: r["status"] for r in doc["rows"]}
    assert doc["passed"] is False and doc["mode"] == "url"
    assert list(status) == ["install", "pins", "patches", "model", "kernels", "capacity", "server",
                            *(n for n, _ in verify.LIVE)]
    assert status["models"] == status["answer"] == status["tokenize"] == "fail"
    assert status["auth"] == status["unknown model"] == status["metrics"] == "pass"
