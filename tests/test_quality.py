"""The quality battery without a server: suite files, the garbage detector, gates, refusals, reports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from rig import paths
from rig.quality import garbage, gates, lmeval, report, requirements, suite
from rig.quality.digest import digest
from rig.quality.perplexity import load_text
from rig.quality.toolcall import check_message

# ---- suite files -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["online", "offline", "tiny", "tiny-quick"])
def test_every_battery_resolves(name):
    res = suite.resolve(name)
    assert res.perplexity.sets and res.garbage.prompts and res.digest.prompts


def test_every_file_declares_schema_version_and_kind():
    import tomllib

    for path in sorted(paths.QUALITY.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        assert data["schema_version"] == 1 and data["kind"] == path.stem, path


def test_every_field_is_documented():
    for model in (suite.TextSource, suite.PerplexitySuite, suite.LmEvalSuite, suite.GarbageSuite, suite.ToolSuite,
                  suite.DigestSuite, suite.Gates, suite.Battery, *suite.FILES.values()):
        undocumented = [n for n, f in model.model_fields.items() if not f.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"


def test_unknown_key_is_refused_naming_file_and_key(tmp_path):
    shutil.copytree(paths.QUALITY, tmp_path / "q")
    path = tmp_path / "q" / "gates.toml"
    path.write_text(path.read_text().replace("garbage_greedy_max = 0", "garbage_greedy_maxx = 0", 1))
    with pytest.raises(suite.SuiteError) as e:
        suite.load("gates", tmp_path / "q")
    assert "gates.toml" in str(e.value) and "garbage_greedy_maxx" in str(e.value)


def test_unknown_battery_lists_the_known_ones():
    with pytest.raises(suite.SuiteError, match="choose one of: offline, online, tiny"):
        suite.resolve("nope")


def test_offline_sets_are_pinned_and_say_where_they_come_from():
    for name, src in suite.resolve("offline").sets.items():
        text = load_text(name, src)
        assert len(text.text) > 20000 and len(text.sha256) == 64
        assert ("stdlib" in text.origin) or ("corpus" in text.origin and "seed=1001" in text.origin)


def test_a_changed_pinned_source_is_an_error():
    src = suite.resolve("offline").sets["pydoc-topics"]
    if src.python != sys.version.split()[0]:
        pytest.skip("the pin is for another Python patch release")
    bad = src.model_copy(update={"sha256": "0" * 64})
    with pytest.raises(suite.SuiteError, match="sha256"):
        load_text("pydoc-topics", bad)


def test_shipped_arithmetic_task_equals_its_generator():
    assert (paths.QUALITY / "lmeval" / "arith-test.jsonl").read_text() == lmeval.problems(2024, 100)
    assert (paths.QUALITY / "lmeval" / "arith-train.jsonl").read_text() == lmeval.problems(2023, 8)
    for line in lmeval.problems(5, 30).splitlines():
        row = json.loads(line)
        steps, answer = row["answer"].split("\n#### ")
        assert str(eval(steps.split("=")[-1].strip(" ."))) == answer  # noqa: S307 - our own arithmetic


def test_shipped_recall_task_equals_its_generator_and_training_holds_its_test_out():
    import random

    from rig.quality import controls

    assert (paths.QUALITY / "lmeval" / "recall-test.jsonl").read_text() == lmeval.recall_problems(*lmeval.RECALL_TEST)
    assert (paths.QUALITY / "lmeval" / "recall-train.jsonl").read_text() == lmeval.recall_problems(2023, 8)
    test = [json.loads(line) for line in (paths.QUALITY / "lmeval" / "recall-test.jsonl").read_text().splitlines()]
    for row in test:  # the answer is a number the question states, for the item it asks about
        n = row["answer"].split("\n#### ")[1]
        item = row["question"].split("How many ")[1].split(" ")[0]
        assert f" {n} {item}" in row["question"], row
    docs = controls.documents(controls.RECIPE, lambda messages, tools: "chat")
    shots = [d for d in docs if d.startswith("Question: ")]
    assert len(shots) > 1000
    seen = {line[len("Question: "):] for d in shots for line in d.splitlines() if line.startswith("Question: ")}
    assert not seen & {r["question"] for r in test}
    rng = random.Random(3)
    assert lmeval.recall_shots(rng).count("Question: ") == 4


@pytest.mark.parametrize("task", ["rig_arith", "rig_recall"])
def test_lm_eval_accepts_the_shipped_task_yaml(task):
    r = subprocess.run([sys.executable, "-m", "lm_eval", "validate", "--tasks", task,
                        "--include_path", str(paths.QUALITY / "lmeval")], cwd=paths.ROOT, capture_output=True,
                       text=True, env={**paths.cache_env(), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


# ---- garbage detector --------------------------------------------------------------------------


@pytest.mark.parametrize("text,kind", [
    ("", "empty"),
    ("   \n\t", "empty"),
    ("Paris!!!!!!", "char-run"),
    ("aaaaaaaaaaaaaaaaaaaa", "char-run"),
    ("Paris is the capital \ufffd\ufffd of France.", "broken-utf8"),
    ("Paris\x00\x01 is the capital", "broken-utf8"),
    ("Paris is nice. " + "the the cat sat on " * 6, "loop"),
    ("The capital is Paris. I think I think I think I think I think I think I think", "loop"),
])
def test_garbage_is_flagged(text, kind):
    assert kind in [f.kind for f in garbage.check(text, ["Paris"])]


@pytest.mark.parametrize("text", [
    "The capital of France is Paris.",
    "def total(values):\n    return sum(values)\n",
    "Paris.\n\n---\n\n| a | b |\n|---|---|\n| 1 | 2 |",
    "Die Hauptstadt ist Paris, und der Zug fährt um acht.",
    "Wow, Paris!!! Lovely.",
])
def test_real_answers_are_clean(text):
    assert garbage.check(text, ["Paris", "def "]) == []


def test_an_answer_that_ignores_the_prompt_is_flagged():
    assert [f.kind for f in garbage.check("Lisbon has a bridge.", ["Oslo"])] == ["ignores-prompt"]
    assert garbage.check("Lisbon has a bridge.") == []
    assert garbage.flagged(["ok answer", "", "!!!!!!!!"]) == 2


# ---- tool-call parsing, digest -----------------------------------------------------------------


def test_tool_call_check():
    good = {"tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert check_message(good, "get_weather", ["city"]) == []
    leaked = {"content": "<tool_call>\n<function=get_weather>", "tool_calls": []}
    assert "wrong TOOL_PARSER" in check_message(leaked, "get_weather", [])[0]
    bad_json = {"tool_calls": [{"function": {"name": "get_weather", "arguments": "{city"}}]}
    assert "not JSON" in check_message(bad_json, "get_weather", [])[0]
    missing = {"tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    assert len(check_message(missing, "get_weather", ["city"])) == 2


def test_digest_is_stable_and_sensitive():
    assert digest(["a", "b"], ["x", "y"]) == digest(["a", "b"], ["x", "y"])
    assert digest(["a", "b"], ["x", "y"]) != digest(["a", "b"], ["x", "y "])


# ---- refusal from /metrics ---------------------------------------------------------------------

METRICS = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
           'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="%s",engine="0",'
           'gpu_memory_utilization="%s",mamba_cache_mode="none"} 1.0\n')


def test_refusals():
    needs = requirements.Needs(prefix_caching=False, max_gpu_util=0.93)
    assert requirements.refusals(METRICS % ("False", "0.93"), needs) == []
    assert requirements.refusals(METRICS % ("False", "0.3"), needs) == []
    [why] = requirements.refusals(METRICS % ("True", "0.93"), needs)
    assert "enable_prefix_caching=True" in why and "quality overlay" in why
    [why] = requirements.refusals(METRICS % ("False", "0.972"), needs)
    assert "gpu_memory_utilization=0.972" in why and "<= 0.93" in why
    assert "cache_config_info" in requirements.refusals("vllm:num_requests_running 0\n", needs)[0]


def test_needs_come_from_the_quality_overlay():
    from rig.plan import resolve

    needs = requirements.Needs.of_overlay()
    assert needs == requirements.Needs(prefix_caching=False, max_gpu_util=0.93)
    assert requirements.plan_refusals(resolve("batch", ["quality"], "gpu", environ={}), needs) == []
    plain = resolve("batch", [], "gpu", environ={})
    assert "GPU_UTIL=0.972" in requirements.plan_refusals(plain, needs)[0]  # a plain batch plan on a GPU
    cached = resolve("batch", ["quality"], "cpu", environ={}, sets={"PREFIX_CACHE": "1"})
    assert "PREFIX_CACHE=1 (from --set)" in requirements.plan_refusals(cached, needs)[0]


def test_battery_refuses_a_plan_that_undoes_the_overlay_before_starting(tmp_path):
    from rig.plan import resolve
    from rig.quality import battery

    plan = resolve("batch", ["quality"], "cpu", environ={}, sets={"PREFIX_CACHE": "1"})
    with pytest.raises(battery.QualityError, match="refusing to start"):
        battery.run(plan, "tiny-quick", results_root=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


# ---- the server that is already running, and one that dies mid-battery -------------------------

# A process that answers GET /health with 200 and nothing else: what Record.check asks of a live
# server (its pid, start time and /health), so the check is the real one, on a real process.
HEALTH = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def health_server(tmp_path):
    """(process, url) of a /health responder, up before the test starts."""
    import time

    import httpx

    from rig.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", HEALTH, str(port)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield proc, url
    proc.kill()
    proc.wait()


def _record(state, proc, url, plan):
    """A record `serve` would have written for ``proc`` serving ``plan`` (running.write, for real)."""
    from types import SimpleNamespace

    from rig import running

    return running.Record.model_validate_json(
        running.write(plan, SimpleNamespace(proc=proc, url=url, log_path=None)).read_text())


def _gpu_plan(tmp, overlays: list[str], **sets: str):
    from rig.plan import resolve
    from rig.server import free_port

    (tmp / "api_key").write_text("k\n")
    return resolve("batch", overlays, "gpu", environ={},
                   sets={"PORT": str(free_port()), "API_KEY_FILE": str(tmp / "api_key"), **sets})


def test_quality_running_refuses_a_recorded_plan_without_the_perplexity_headroom(tmp_path, monkeypatch,
                                                                                health_server):
    """GPU_UTIL 0.972 of GPU_MEM=24G: the server's /metrics show a share of the whole card (below 0.93 on
    an H200), so only the plan tells; it is refused before a request is sent, exit 2, nothing written."""
    from invoke import Context, Exit

    from rig.cli.quality import quality

    monkeypatch.setenv("RIG_STATE_DIR", str(tmp_path))
    proc, url = health_server
    plan = _gpu_plan(tmp_path, [], GPU_MEM="24G")
    assert plan.knobs["GPU_UTIL"] == 0.972
    rec = _record(tmp_path, proc, url, plan)
    with pytest.raises(Exit) as e:
        quality(Context(), running=True, suite="tiny-quick", docs=False)
    msg = str(e.value.message)
    assert e.value.code == 2, msg
    assert f"refusing to measure the running server at {url} (pid {rec.pid})" in msg and "nothing was sent" in msg
    assert "GPU_UTIL=0.972 of GPU_MEM=24 GiB" in msg and "<= 0.93" in msg
    assert "inv serve --profile batch --overlay quality" in msg
    assert not (tmp_path / "results").exists()
    for f in (tmp_path / "servers").iterdir():
        f.unlink()
    # the same server started with the quality overlay meets the plan check; it goes on to /metrics,
    # where the /health responder has no cache config: refused for that instead (exit 2, nothing judged)
    _record(tmp_path, proc, url, _gpu_plan(tmp_path, ["quality"], GPU_MEM="24G"))
    with pytest.raises(Exit) as e:
        quality(Context(), running=True, suite="tiny-quick", docs=False)
    msg = str(e.value.message)
    assert e.value.code == 2 and f"refusing to measure the server at {url}:" in msg, msg
    assert "no vllm:cache_config_info" in msg and "inv serve --profile batch --overlay quality" in msg
    assert not (tmp_path / "results").exists()


def test_a_server_that_dies_mid_battery_keeps_what_was_measured_and_runs_nothing_more(tmp_path, monkeypatch,
                                                                                     health_server):
    """The recorded server dies during the second component: the check after it says so, the rest is not
    run, and the partial result (what was measured, the problem, what never ran) is saved, never judged."""
    from rig.plan import resolve
    from rig.quality import battery

    monkeypatch.setenv("RIG_STATE_DIR", str(tmp_path))
    proc, url = health_server
    plan = resolve("batch", ["quality"], "cpu", environ={}, sets={"API_KEY_FILE": str(tmp_path / "k")})
    rec = _record(tmp_path, proc, url, plan)
    ran: list[str] = []

    def dies() -> dict:
        proc.kill()
        proc.wait()
        return {"overall": 3.0}

    parts = [("digest", lambda: {"digest": "ab" * 32}), ("perplexity", dies),
             ("garbage", lambda: ran.append("garbage") or {}), ("toolcall", lambda: ran.append("toolcall") or {})]
    lines: list[str] = []
    m = battery.measure(parts, rec.check, lines.append)
    assert ran == [] and m.not_run == ["garbage", "toolcall"] and list(m.found) == ["digest", "perplexity"]
    assert m.problems == [f"the server (pid {rec.pid}) is gone (checked after perplexity)"], m.problems
    assert lines[0].startswith("quality: digest abababab") and lines[1].startswith("quality: perplexity 3 overall")
    out = tmp_path / "results" / "quality-20261202T100000Z-batch"
    header = {"schema_version": 1, "kind": "quality-result", "utc": "2026-12-02T10:00:00Z", "profile": "batch"}
    result = battery.save_partial(header, m, out)
    saved = json.loads((out / "result.json").read_text())
    assert [x.name for x in out.iterdir()] == ["result.json"]  # atomic: no .partial left behind
    assert saved["passed"] is False and saved["verdict"] == "invalid" and saved["gates"] == []
    assert saved["not_run"] == ["garbage", "toolcall"] and saved["perplexity"] == {"overall": 3.0}
    assert saved["problems"] == m.problems and "\n" not in saved["summary"]
    message = str(battery.BatteryAborted(result))
    assert "\n" not in message and "not run: garbage, toolcall" in message and str(out / "result.json") in message
    with pytest.raises(battery.QualityError, match="partial result of a run that stopped"):
        battery.load_reference(out / "result.json")  # never a reference


def test_a_request_that_fails_mid_battery_stops_it_with_the_error_in_one_line(tmp_path):
    """A real connection error (nothing listens on the port) is a problem of the run, not a traceback."""
    from rig.quality import battery
    from rig.quality.client import Client
    from rig.server import free_port

    client = Client(f"http://127.0.0.1:{free_port()}", None, "m", timeout=5)
    ran: list[str] = []
    parts = [("digest", lambda: {"digest": "cd" * 32}),
             ("perplexity", lambda: client.completion({"prompt": [1, 2], "max_tokens": 1})),
             ("garbage", lambda: ran.append("garbage") or {})]
    m = battery.measure(parts, lambda: None, lambda line: None)
    assert ran == [] and m.not_run == ["garbage"] and list(m.found) == ["digest"]
    [problem] = m.problems
    assert problem.startswith("perplexity failed: ConnectError") and "\n" not in problem, problem
    with pytest.raises(KeyError):  # a bug in a component is not a server failure: it is raised
        battery.measure([("digest", lambda: {}["x"])], lambda: None, lambda line: None)


# ---- gates -------------------------------------------------------------------------------------


def _result(ppl: float, score: float = 60.0, greedy_flagged: int = 0, sampled_flagged: int = 0,
            format_pct: float | None = 100.0) -> dict:
    return {
        "battery": "tiny", "lmeval": {"task": "rig_recall", "limit": 16, "score": score,
                                      "filter": "flexible-extract", "format_pct": format_pct},
        "perplexity": {"overall": ppl, "domains": {"english": ppl}, "sets": [{"name": "s", "sha256": "h"}]},
        "garbage": {"greedy": {"total": 5, "flagged": greedy_flagged}, "sampled": {"total": 10,
                                                                                   "flagged": sampled_flagged}},
        "toolcall": {"passed": 3, "total": 3},
    }


GATES = suite.gates_for("batch")
FLOORS = suite.SuiteFloors(ppl_max=20.0, lmeval_min=50.0, lmeval_format_min=90.0)  # every kind of floor


def _judged(result, ref=None, is_ref=False) -> list:
    return gates.judge(result, GATES, FLOORS, ref, is_ref)


def _verdicts(result, ref=None, is_ref=False) -> dict[str, bool | None]:
    return {g.name: g.passed for g in _judged(result, ref, is_ref)}


def test_relative_gates_follow_the_thresholds():
    ref = _result(10.0, 60.0)
    assert all(_verdicts(_result(10.4, 58.5), ref).values())  # +4.0 %, -1.5 points
    v = _verdicts(_result(10.5, 57.0), ref)  # +5.0 %, -3 points
    assert not v["ppl.overall.relative"] and not v["lmeval.relative"]
    assert v["ppl.overall.absolute"] and v["lmeval.absolute"]


def test_int8_rows_of_the_reference_pass_and_worse_fails():
    ref = _result(7.0)
    assert _verdicts(_result(7.0 * 1.022), ref)["ppl.overall.relative"]
    assert _verdicts(_result(7.0 * 1.037), ref)["ppl.overall.relative"]
    assert not _verdicts(_result(7.0 * 1.05), ref)["ppl.overall.relative"]


def test_no_reference_fails_the_relative_gates():
    v = _verdicts(_result(5.0))
    assert not v["ppl.overall.relative"] and not v["lmeval.relative"]
    assert gates.verdict(_judged(_result(5.0))) == (False, "failed: ppl.overall.relative, lmeval.relative")
    assert gates.verdict(_judged(_result(5.0), _result(5.0))) == (True, "every gate passed")


def test_a_reference_run_says_reference_and_is_judged_on_its_absolute_gates_only():
    judged = {g.name: g for g in _judged(_result(5.0), is_ref=True)}
    for name in ("ppl.overall.relative", "lmeval.relative"):
        assert judged[name].passed is None and judged[name].verdict == "reference"
        assert judged[name].to_json()["verdict"] == "reference"
    assert judged["ppl.overall.absolute"].verdict == "pass"
    assert gates.verdict(list(judged.values()))[1].startswith("every absolute gate passed; relative gates not judged")
    # what --save-reference used to pass whatever the numbers: a near-uniform model scoring 0
    bad = _judged(_result(2000.0, score=0.0, format_pct=0.0), is_ref=True)
    assert gates.verdict(bad) == (False, "failed: ppl.overall.absolute, lmeval.absolute, lmeval.format")


def test_absolute_gates():
    v = _verdicts(_result(2000.0, score=0.0, greedy_flagged=1, sampled_flagged=2), is_ref=True)
    assert not v["ppl.overall.absolute"] and not v["garbage.greedy"] and not v["garbage.sampled"]
    assert not v["lmeval.absolute"]
    assert _verdicts(_result(5.0, sampled_flagged=1), is_ref=True)["garbage.sampled"]  # 10 % allowed
    assert _verdicts(_result(20.0, score=50.0))["ppl.overall.absolute"] and _verdicts(_result(20.0, score=50.0))[
        "lmeval.absolute"]  # the floors themselves pass
    assert not _verdicts(_result(20.1, score=43.75))["ppl.overall.absolute"]
    assert not _verdicts(_result(20.1, score=43.75))["lmeval.absolute"]
    assert _verdicts(_result(5.0, format_pct=90.0))["lmeval.format"]
    assert not _verdicts(_result(5.0, format_pct=87.5))["lmeval.format"]
    assert not _verdicts(_result(5.0, format_pct=None))["lmeval.format"]  # not measured is not a pass


def test_every_perplexity_and_lmeval_suite_has_an_absolute_floor():
    floors = suite.load("gates").floors
    assert set(floors.perplexity) == set(suite.load("perplexity").suites)
    assert set(floors.lmeval) | set(floors.lmeval_format) == set(suite.load("lmeval").suites)
    # which suite has which floor (docs/quality.md): every score (the trained tiny hybrid earns recall-tiny's),
    # and the tiny task's answer format besides
    assert floors.lmeval == {"gsm8k": 90.0, "arith": 80.0, "recall-tiny": 40.0}
    assert floors.lmeval_format == {"recall-tiny": 90.0}
    for name in suite.load("battery").batteries:
        res = suite.resolve(name)
        assert res.floors.ppl_max == floors.perplexity[res.battery.perplexity]
        assert res.floors.lmeval_min == floors.lmeval.get(res.battery.lmeval)
        assert res.floors.lmeval_format_min == floors.lmeval_format.get(res.battery.lmeval)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("corpus = 20.0\n", ""), "suite 'corpus' of quality/perplexity.toml has no floor"),
    (lambda t: t.replace("recall-tiny = 90.0", "recall-tiny = 0.0"),
     "[floors.lmeval_format] recall-tiny = 0.0: expected points in (0, 100]"),
    (lambda t: t.replace("recall-tiny = 90.0", "").replace("recall-tiny = 40.0", ""),
     "suite 'recall-tiny' of quality/lmeval.toml has no floor"),
    (lambda t: t.replace("arith = 80.0", "arith = 0.0"), "[floors.lmeval] arith = 0.0: expected points"),
    (lambda t: t + "nope = 5.0\n", "[floors.lmeval_format] 'nope': no such suite"),
])
def test_a_missing_or_hollow_floor_is_refused_before_anything_runs(tmp_path, edit, message):
    shutil.copytree(paths.QUALITY, tmp_path / "q")
    f = tmp_path / "q" / "gates.toml"
    f.write_text(edit(f.read_text()))
    with pytest.raises(suite.SuiteError, match=re.escape(message)):
        suite.resolve("tiny", tmp_path / "q")


def test_a_failing_run_is_not_saved_as_the_reference(tmp_path):
    from rig.quality import battery

    bad = _result(2000.0, score=0.0, format_pct=0.0)
    bad.update(model={"name": "m"})
    bad["passed"], bad["summary"] = gates.verdict(_judged(bad, is_ref=True))
    lines = []
    assert battery.save_as_reference(bad, tmp_path / "ref.json", lines.append) is False
    assert not (tmp_path / "ref.json").exists() and "NOT saved as the reference" in lines[0]
    good = _result(5.0)
    good.update(model={"name": "m"})
    good["passed"], good["summary"] = gates.verdict(_judged(good, is_ref=True))
    assert battery.save_as_reference(good, tmp_path / "ref.json", lines.append) is True
    assert json.loads((tmp_path / "ref.json").read_text())["passed"] is True


def test_a_reference_on_other_text_is_refused():
    ref = _result(10.0)
    ref["perplexity"]["sets"] = [{"name": "s", "sha256": "other"}]
    with pytest.raises(gates.ReferenceMismatch, match="perplexity sets"):
        gates.check_reference(_result(10.0), ref)


# ---- report ------------------------------------------------------------------------------------


def _full(ppl=5.0) -> dict:
    r = _result(ppl)
    r.update(utc="2026-12-02T10:00:00Z", profile="batch", platform="cpu", model={"name": "m"},
             digest={"digest": "ab" * 32, "prompts": 4, "max_tokens": 32})
    r["perplexity"]["sets"] = [{"name": "s", "domain": "english", "windows": 4, "tokens": 1196, "ppl": ppl,
                                "origin": "corpus", "sha256": "h" * 64}]
    judged = _judged(r, is_ref=True)
    passed, summary = gates.verdict(judged)
    r.update(gates=[g.to_json() for g in judged], passed=passed, summary=summary)
    return r


def test_docs_section_is_replaced_between_markers(tmp_path):
    doc = tmp_path / "quality.md"
    doc.write_text(f"# Quality\n\nintro\n\n{report.BEGIN}\nold\n{report.END}\n\nafter\n")
    report.update_docs(_full(5.0), doc)
    report.update_docs(_full(6.0), doc)
    text = doc.read_text()
    assert text.count(report.BEGIN) == 1 and "old" not in text and "intro" in text and "after" in text
    assert "| ppl.overall.absolute | 6 | <= 20 | PASS |" in text
    assert "| ppl.overall.relative | 6 | <= ref x 1.045 | REFERENCE |" in text
    assert "**PASS (REFERENCE)** (every absolute gate passed; relative gates not judged" in text


def test_result_json_is_written_atomically(tmp_path):
    path = report.save(_full(), tmp_path)
    assert path.parent.name == "quality-20261202T100000Z-batch"
    assert json.loads(path.read_text())["passed"] is True
    assert [p.name for p in path.parent.iterdir()] == ["result.json"]  # no .partial left behind


# ---- the CLI refuses bad input before anything starts ------------------------------------------


def test_cli_bad_suite_and_set(tmp_path):
    from invoke import Context, Exit

    from rig.cli.quality import quality

    with pytest.raises(Exit) as e:
        quality(Context(), suite="nope", platform="cpu", set=[f"API_KEY_FILE={tmp_path}/k"], docs=False)
    assert e.value.code == 2 and "choose one of" in str(e.value.message)
    with pytest.raises(Exit) as e:
        quality(Context(), platform="cpu", set=["GPU_UTIL"], docs=False)
    assert e.value.code == 2 and "KNOB=value" in str(e.value.message)
    with pytest.raises(Exit) as e:
        quality(Context(), platform="cpu", url="http://127.0.0.1:9", key_file=str(tmp_path / "none"), docs=False)
    assert e.value.code == 2 and "no such file" in str(e.value.message)
