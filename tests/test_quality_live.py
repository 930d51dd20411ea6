"""The battery against real CPU vLLM servers: it fails a random model, passes a trained one, catches a
degraded copy, and refuses a server whose cache settings would corrupt perplexity.

Servers: the session's ``batch_server`` (random tiny hybrid; on CPU its settings equal the quality
overlay's, so it is measured, not refused), the trained model and its degraded copy (each started by
the battery itself with the quality overlay), and one eager server with prefix caching on (refused).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def _gates(result: dict) -> dict[str, bool]:
    return {g["name"]: g["passed"] for g in result["gates"]}


@pytest.fixture(scope="module")
def trained_model() -> Path:
    return controls.trained()


@pytest.fixture(scope="module")
def random_result(batch_server, session_tmp) -> dict:
    plan = _plan(session_tmp, SERVED_NAME=batch_server.served_name)
    return battery.run(plan, "tiny-quick", url=batch_server.url, key=batch_server.api_key,
                       results_root=session_tmp / "results")


@pytest.fixture(scope="module")
def reference_file(session_tmp) -> Path:
    return session_tmp / "reference-trained.json"


@pytest.fixture(scope="module")
def trained_result(trained_model, session_tmp, reference_file) -> dict:
    plan = _plan(session_tmp, MODEL=str(trained_model), SERVED_NAME="rig-trained")
    return battery.run(plan, "tiny", save_reference=True, reference=reference_file,
                       results_root=session_tmp / "results")


def test_random_model_fails_garbage_and_perplexity(random_result):
    g = _gates(random_result)
    assert random_result["server"]["started_by"] == "external"
    assert not g["garbage.greedy"] and not g["garbage.sampled"]
    assert not g["ppl.overall.absolute"]
    assert not g["ppl.overall.relative"]  # no reference for it either
    assert random_result["passed"] is False
    assert Path(random_result["path"]).is_file()


def test_same_server_same_digest(batch_server, random_result):
    again = digest.run(Client(batch_server.url, batch_server.api_key, batch_server.served_name),
                       suite.resolve("tiny-quick").digest)
    assert again["digest"] == random_result["digest"]["digest"]


def test_trained_model_passes(trained_result, random_result):
    g = _gates(trained_result)
    assert trained_result["server"]["started_by"] == "rig"
    assert g["garbage.greedy"] and g["garbage.sampled"] and g["ppl.overall.absolute"], trained_result["gates"]
    assert g["toolcall.parsed"], trained_result["toolcall"]
    assert trained_result["passed"], trained_result["summary"]
    for case in trained_result["toolcall"]["cases"]:
        assert case["tool_calls"][0]["name"] == "get_weather"
        assert "city" in json.loads(case["tool_calls"][0]["arguments"])
    mine, theirs = trained_result["perplexity"]["domains"], random_result["perplexity"]["domains"]
    for domain in mine:
        assert mine[domain] * 20 < theirs[domain], (domain, mine[domain], theirs[domain])


def test_lm_eval_ran_against_the_server(trained_result):
    lm = trained_result["lmeval"]
    assert lm["task"] == "rig_arith" and lm["limit"] == 8
    assert set(lm["scores"]) == {"strict-match", "flexible-extract"}
    samples = list(Path(lm["samples_dir"]).glob("samples_rig_arith_*.jsonl"))
    rows = [json.loads(line) for line in samples[0].read_text().splitlines()]
    assert {r["doc_id"] for r in rows} == set(range(8))  # one row per question and filter
    assert all(r["resps"][0][0] for r in rows)  # the server answered every question


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
