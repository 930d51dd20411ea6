"""The battery against real CPU vLLM servers: it fails a random model, passes a trained one, catches a
degraded copy, and refuses a server whose cache settings would corrupt perplexity.

Servers: the session's ``batch_server`` (the trained tiny hybrid, the positive control: what `serve` runs on
a CPU host; on CPU its settings equal the quality overlay's, so it is measured, not refused), the random tiny
hybrid (the negative control) and the trained model's degraded copy (each started by the battery itself with
the quality overlay), one eager server with prefix caching on (refused), and one the battery starts and that
is killed after its first component (a partial result, exit 1).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from rig.models import train
from rig.plan import Plan, resolve
from rig.quality import battery, controls, digest, suite
from rig.quality.client import Client
from rig.server import free_port

pytestmark = pytest.mark.slow


def _plan(tmp: Path, **sets: str) -> Plan:
    """The batch profile with the quality overlay on CPU, on a free port, with a small KV cache in bytes (the
    same on every host; the battery's prompts are short, and the host is shared with other servers)."""
    base = {"PORT": str(free_port()), "API_KEY_FILE": str(tmp / "api_key"), "KV_MEM": "512M"}
    return resolve("batch", ["quality"], platform="cpu", environ={}, sets={**base, **sets})


def _gates(result: dict) -> dict[str, bool | None]:
    """Gate -> passed (None: a relative gate of the reference run, not judged)."""
    return {g["name"]: g["passed"] for g in result["gates"]}


FLOORS = suite.resolve("tiny").floors


@pytest.fixture(scope="module")
def trained_model() -> Path:
    """The models folder's verified copy of the committed trained hybrid (the degraded copy is written beside
    it, never into the checkout)."""
    return train.served_copy()


@pytest.fixture(scope="module")
def random_result(session_tmp) -> dict:
    plan = _plan(session_tmp, MODEL="tiny:hybrid", SERVED_NAME="rig-random")
    return battery.run(plan, "tiny", results_root=session_tmp / "results")


@pytest.fixture(scope="module")
def reference_file(session_tmp) -> Path:
    return session_tmp / "reference-trained.json"


@pytest.fixture(scope="module")
def trained_result(batch_server, session_tmp, reference_file) -> dict:
    plan = _plan(session_tmp, SERVED_NAME=batch_server.served_name)  # the cpu overlay's MODEL, as it serves
    return battery.run(plan, "tiny", url=batch_server.url, key=batch_server.api_key, save_reference=True,
                       reference=reference_file, results_root=session_tmp / "results")


def test_random_model_fails_every_absolute_floor(random_result):
    g = _gates(random_result)
    assert random_result["server"]["started_by"] == "rig"
    assert not g["garbage.greedy"] and not g["garbage.sampled"]
    assert not g["ppl.overall.absolute"] and random_result["perplexity"]["overall"] > FLOORS.ppl_max
    assert not g["lmeval.absolute"] and random_result["lmeval"]["score"] < FLOORS.lmeval_min
    assert not g["lmeval.format"] and random_result["lmeval"]["format_pct"] < FLOORS.lmeval_format_min
    assert not g["ppl.overall.relative"] and not g["lmeval.relative"]  # no reference for it either
    assert random_result["passed"] is False
    assert Path(random_result["path"]).is_file()


def test_same_server_same_digest(batch_server, trained_result):
    again = digest.run(Client(batch_server.url, batch_server.api_key, batch_server.served_name),
                       suite.resolve("tiny").digest)
    assert again["digest"] == trained_result["digest"]["digest"]


def test_trained_model_passes_every_absolute_gate_on_its_merits(trained_result, random_result):
    g = _gates(trained_result)
    assert trained_result["server"]["started_by"] == "external"
    assert g["garbage.greedy"] and g["garbage.sampled"] and g["ppl.overall.absolute"], trained_result["gates"]
    assert g["lmeval.format"] and trained_result["lmeval"]["format_pct"] >= FLOORS.lmeval_format_min, \
        trained_result["lmeval"]
    assert g["lmeval.absolute"] and trained_result["lmeval"]["score"] >= FLOORS.lmeval_min, trained_result["lmeval"]
    assert g["toolcall.parsed"], trained_result["toolcall"]
    # the reference run judges nothing relative: its relative gates say "reference", not "pass"
    verdicts = {x["name"]: x["verdict"] for x in trained_result["gates"]}
    assert verdicts["ppl.overall.relative"] == verdicts["lmeval.relative"] == "reference"
    assert g["ppl.overall.relative"] is None and g["lmeval.relative"] is None
    assert trained_result["passed"], trained_result["summary"]
    assert trained_result["summary"].startswith("every absolute gate passed; relative gates not judged")
    assert trained_result["reference"]["saved"] is True
    for case in trained_result["toolcall"]["cases"]:
        assert case["tool_calls"][0]["name"] == "get_weather"
        assert "city" in json.loads(case["tool_calls"][0]["arguments"])
    mine, theirs = trained_result["perplexity"]["domains"], random_result["perplexity"]["domains"]
    for domain in mine:
        assert mine[domain] * 20 < theirs[domain], (domain, mine[domain], theirs[domain])


def test_lm_eval_ran_against_the_server_and_its_score_is_the_samples(trained_result):
    lm = trained_result["lmeval"]
    assert lm["task"] == "rig_recall" and lm["limit"] == 16 and lm["filter"] == "flexible-extract"
    assert set(lm["scores"]) == {"strict-match", "flexible-extract"}
    samples = list(Path(lm["samples_dir"]).glob("samples_rig_recall_*.jsonl"))
    rows = [json.loads(line) for line in samples[0].read_text().splitlines()]
    assert {r["doc_id"] for r in rows} == set(range(16))  # one row per question and filter
    assert all(r["resps"][0][0] for r in rows)  # the server answered every question
    flexible = [r for r in rows if r["filter"] == "flexible-extract"]
    strict = [r for r in rows if r["filter"] == "strict-match"]
    right = sum(r["exact_match"] for r in flexible)
    formatted = sum("#### " in r["resps"][0][0] for r in strict)
    print(f"\nrig_recall: {right:g} of {len(flexible)} right (flexible-extract), {formatted} of {len(strict)} "
          f"with a '#### N' line; e.g. {flexible[0]['resps'][0][0]!r}")
    # the gated numbers are the samples' own: the score, and the format share from the raw answers
    assert lm["score"] == pytest.approx(100 * right / len(flexible))
    assert lm["format_pct"] == pytest.approx(100 * formatted / len(strict))


def test_degraded_copy_fails_the_relative_gate(trained_model, trained_result, reference_file, session_tmp):
    degraded = controls.degrade(trained_model)
    plan = _plan(session_tmp, MODEL=str(degraded), SERVED_NAME="rig-degraded")
    result = battery.run(plan, "tiny-quick", reference=reference_file, results_root=session_tmp / "results")
    g = _gates(result)
    assert not g["ppl.overall.relative"], result["gates"]
    assert result["perplexity"]["overall"] > trained_result["perplexity"]["overall"] * 1.045
    assert result["passed"] is False


def test_a_prefix_cached_server_is_refused(tiny_model, session_tmp):
    from conftest import start_server

    plan = _plan(session_tmp, PREFIX_CACHE="1", ENFORCE_EAGER="1")
    server = start_server(plan, session_tmp)
    try:
        metrics = Client(server.url, server.api_key, server.served_name).metrics()
        assert 'enable_prefix_caching="True"' in metrics  # what vLLM 0.28 really exports
        with pytest.raises(battery.QualityError, match="enable_prefix_caching=True"):
            battery.run(plan, "tiny-quick", url=server.url, key=server.api_key, results_root=session_tmp / "r")
    finally:
        server.stop()


def test_a_server_killed_mid_battery_leaves_a_partial_result(tiny_model, session_tmp, capsys):
    """The battery's own server is killed (its whole process group, SIGKILL) as the digest is logged: perplexity
    fails on the dead server, the check after it names the exit, garbage never runs; the digest is kept in a
    partial result that judges nothing."""
    plan = _plan(session_tmp, ENFORCE_EAGER="1")
    killed: list[int] = []

    def log(line: str) -> None:
        print(line)
        if line.startswith("quality: digest") and not killed:
            # the battery's server by its port: the session's other servers are children of pytest too
            port = f"--port {plan.knobs['PORT']}"
            [leader] = [p for p in psutil.Process().children(recursive=True)
                        if "vllm" in " ".join(p.cmdline()) and port in " ".join(p.cmdline())
                        and os.getpgid(p.pid) == p.pid]
            os.killpg(leader.pid, signal.SIGKILL)
            killed.append(leader.pid)

    with pytest.raises(battery.BatteryAborted) as e:
        battery.run(plan, "tiny-quick", results_root=session_tmp / "killed", log=log)
    r = e.value.result
    assert killed and r["passed"] is False and r["verdict"] == "invalid" and r["gates"] == [], r["summary"]
    assert r["not_run"] == ["garbage"] and "digest" in r["digest"] and "perplexity" not in r, r
    assert r["problems"][0].startswith("perplexity failed: "), r["problems"]
    assert r["problems"][-1] == (f"the server rig started (pid {killed[0]}) exited with code -9; "
                                 f"log {Path(r['path']).parent / 'vllm.log'} (checked after perplexity)"), r["problems"]
    assert json.loads(Path(r["path"]).read_text())["not_run"] == ["garbage"]
    assert "\n" not in str(e.value) and "Traceback" not in capsys.readouterr().out
