"""The bench's parts that need no server: protocol files, scaling, SSE parsing, steady state, compare, CLI input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from invoke import Context, Exit

from rig.bench import compare, metrics, protocols, report
from rig.bench.client import SSEParser, _delta_has_token
from rig.bench.protocols import BenchError, RandomCell, Scale
from rig.bench.results import CellResult, PassResult, RunDir, RunResult, spread
from rig.bench.runner import raw_sanity


def test_every_bench_file_loads_and_every_protocol_is_there():
    avail = protocols.available()
    assert set(avail) == {"throughput", "cohort", "prefill", "raw", "shared-prefix", "long"}
    for name, kind in avail.items():
        assert protocols.load(name).kind == kind


def test_every_single_cell_file_is_a_cell_of_its_protocol():
    """bench/cells/ holds one-cell cuts of the protocols for short GPU windows: each loads, and its cell is
    one of the full protocol's (same lengths and concurrency; fewer prompts allowed)."""
    from rig import paths

    files = sorted((paths.ROOT / "bench" / "cells").glob("*.toml"))
    assert {f.stem for f in files} >= {"ladder", "ladder-64", "prefill-16k"}
    for f in files:
        cut = protocols.load_path(f)
        full = {(c.input_len, c.output_len, c.concurrency) for c in protocols.load(cut.kind).cells}
        assert [(c.input_len, c.output_len, c.concurrency) in full for c in cut.cells] == [True], f.name


def test_protocols_carry_the_reference_sizes():
    tp = protocols.load("throughput")
    assert [(c.input_len, c.output_len, c.concurrency, c.num_prompts) for c in tp.cells] == [
        (256, 256, 1, 256), (128, 512, 64, 256), (256, 256, 64, 256)]
    raw = protocols.load("raw")
    assert (raw.input_len, raw.output_len, raw.concurrencies) == (7681, 511, [1, 4, 8])
    assert raw.requires == {"SPEC": "off", "PREFIX_CACHE": 0}
    sp = protocols.load("shared-prefix")
    assert (sp.system_prompt_tokens, sp.num_requests, sp.concurrency) == (5820, 64, 32)
    assert {v["PREFIX_CACHE"] for v in sp.variants.values()} == {0, 1}
    pf = protocols.load("prefill")
    assert {c.input_len for c in pf.cells} == {1024, 4096, 16384, 65536, 102400}
    assert {(c.input_len, c.output_len) for c in protocols.load("long").cells} == {(100000, 256), (60000, 1024)}
    assert protocols.load("cohort").cohorts == [1, 2, 4, 8]


def test_the_chat_prompt_set_is_varied():
    ps = protocols.load_prompts("chat-prompts")
    assert len(ps.prompts) >= 32 and len(set(ps.prompts)) == len(ps.prompts)
    assert min(len(p.split()) for p in ps.prompts) >= 8
    assert len(ps.system_prompt.split()) > 100


def _write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / f"{name}.toml"
    p.write_text(text)
    return p


def test_unknown_key_is_an_error_naming_file_and_key(tmp_path):
    _write(tmp_path, "t", 'schema_version = 1\nkind = "cohort"\ndescription = "x"\nprompts = "p"\n'
                          'cohorts = [1]\nmax_tokens = 8\ncohort_size = 3\n')
    with pytest.raises(BenchError, match=r"t\.toml: cohort_size: Extra inputs are not permitted"):
        protocols.load("t", tmp_path)


def test_unknown_kind_lists_the_valid_ones(tmp_path):
    _write(tmp_path, "t", 'schema_version = 1\nkind = "speed"\ndescription = "x"\n')
    with pytest.raises(BenchError, match="kind = 'speed'; expected one of throughput, prefill, raw"):
        protocols.load("t", tmp_path)


def test_prefill_cells_must_have_one_output_token(tmp_path):
    _write(tmp_path, "p", 'schema_version = 1\nkind = "prefill"\ndescription = "x"\n'
                          'cells = [{ input_len = 8, output_len = 2, concurrency = 1, num_prompts = 1 }]\n')
    with pytest.raises(BenchError, match="output_len = 1"):
        protocols.load("p", tmp_path)


def test_unknown_protocol_names_the_available_ones():
    with pytest.raises(BenchError, match="unknown protocol 'nope': available are cohort, long, prefill"):
        protocols.load("nope")


def test_one_factor_scales_lengths_and_counts_with_floors():
    s = Scale(factor=1 / 8)
    c = RandomCell(input_len=128, output_len=512, concurrency=64, num_prompts=256).scaled(s, max_concurrency=16)
    assert (c.input_len, c.output_len, c.concurrency, c.num_prompts) == (16, 64, 16, 32)
    # at least one full round at the (capped) concurrency; never below the token floor
    c = RandomCell(input_len=16, output_len=1, concurrency=8, num_prompts=8).scaled(s, max_concurrency=16)
    assert (c.input_len, c.concurrency, c.num_prompts) == (4, 8, 8)
    assert s.tokens(1) == 1 and s.tokens(3) == 3 and s.tokens(9) == 4  # a 1-token prefill output stays 1
    full = RandomCell(input_len=7681, output_len=511, concurrency=4, num_prompts=8)
    assert full.scaled(Scale(), 64) == full


def test_sse_parser_skips_keepalive_comments_and_split_lines():
    p = SSEParser()
    stream = (b': keep-alive\n\ndata: {"choices":[{"text":"a"}]}\n\n: ping\n\n'
              b'data: {"choices":[{"delta":{"reasoning_content":"b"}}]}\r\n\r\ndata: {"choices":[],"usage":'
              b'{"completion_tokens":2}}\n\ndata: [DONE]\n\n')
    events = []
    for i in range(0, len(stream), 7):  # arbitrary network splits, even inside a line
        events += p.feed(stream[i:i + 7])
    assert len(events) == 3 and p.done
    assert [_delta_has_token(e) for e in events] == [True, True, False]
    assert _delta_has_token({"choices": [{"delta": {"content": ""}}]})  # an empty delta is still a step
    assert events[2]["usage"]["completion_tokens"] == 2


def _samples(rows):
    return [metrics.Sample(t, {"gen": g, "prompt": p, "success": s, "running": r, "waiting": w})
            for t, g, p, s, r, w in rows]


def test_steady_state_counts_only_full_quiet_decoding_intervals():
    rows = [  # t, gen, prompt, success, running, waiting
        (0.0, 0, 0, 0, 2, 2),       # ramp: requests waiting
        (1.0, 10, 100, 0, 4, 0),    # prefill finished in between
        (2.0, 110, 100, 0, 4, 0),   # steady: 100 tokens / 1 s
        (3.0, 210, 100, 0, 4, 0),   # steady: 100 tokens / 1 s
        (4.0, 250, 120, 1, 4, 0),   # a request left and one joined
        (5.0, 250, 120, 1, 4, 0),   # flat counter under a stale gauge: idle, not decode
        (6.0, 260, 120, 4, 0, 0),   # tail
    ]
    ss = metrics.steady_state(_samples(rows), target=4)
    assert ss.decode_tok_per_s == pytest.approx(100.0)
    assert ss.intervals == 2 and ss.window_s == pytest.approx(2.0)
    none = metrics.steady_state(_samples(rows), target=8)
    assert none.decode_tok_per_s is None and "no steady window" in none.reason


def test_a_seat_capped_server_gets_its_own_figure_never_the_targets():
    """The H100 run of 2026-12-05: 64 sent, 57 seats, 7 waiting the whole wave. Decode at 57 is
    reported as such; the figure at 64 stays empty, and a run that reaches 64 is not called capped."""
    rows = [  # t, gen, prompt, success, running, waiting
        (0.0, 0, 0, 0, 0, 64),
        (1.0, 57, 7296, 0, 57, 7),     # prefill of the first 57
        (2.0, 627, 7296, 0, 57, 7),    # capped decode: 570 tokens / 1 s
        (3.0, 1197, 7296, 0, 57, 7),
        (4.0, 1767, 7296, 0, 57, 7),
        (5.0, 1800, 8192, 57, 7, 0),   # the tail wave's prefill
        (6.0, 1870, 8192, 57, 7, 0),   # 7 decoding, none waiting: not the target either
    ]
    ss = metrics.steady_state(_samples(rows), target=64)
    assert ss.decode_tok_per_s == pytest.approx(570.0) and ss.running == 57 and not ss.at_target
    assert "at most 57 of 64" in ss.reason
    full = metrics.steady_state(_samples([(0.0, 0, 0, 0, 57, 0), (1.0, 570, 0, 0, 57, 0)]), target=57)
    assert full.at_target and full.reason is None
    none = metrics.steady_state(_samples(rows), target=64, min_window_s=5.0)  # the capped window is 3 s
    assert none.decode_tok_per_s is None and "no steady window" in none.reason

    cell = CellResult(label="128/512, 64 concurrent", params={"input_len": 128})
    cell.passes = [PassResult(seed=1, warmup=False, ok=True, figures={
        "steady_decode_tok_per_s": None, "steady_decode_capped_tok_per_s": ss.decode_tok_per_s,
        "steady_running": 57, "output_tok_per_s": 231.0})]
    cell.summarize()
    run = RunResult(protocol="ladder-64", protocol_kind="throughput", protocol_def={}, profile="batch", plan={},
                    knobs={}, fingerprint={}, scale={}, repeat=1, started_utc="2026-12-05T16:18:06+00:00",
                    cells=[cell])
    text = report.table(run)
    assert "— (~570 at 57 running†)" in text and "†Seat-capped" in text


def test_metrics_parser_sums_labelled_series():
    text = ('# HELP x\nvllm:generation_tokens_total{model_name="m"} 12.0\n'
            'vllm:request_success_total{finished_reason="length",model_name="m"} 3.0\n'
            'vllm:request_success_total{finished_reason="stop",model_name="m"} 2.0\n'
            'vllm:num_requests_running{model_name="m"} 4.0\nvllm:other 9\n')
    assert metrics.parse(text) == {"gen": 12.0, "success": 5.0, "running": 4.0}


def test_spec_counters_give_tokens_per_step():
    c = metrics.Counters({"drafts": 100, "draft_tokens": 100, "accepted": 95})
    assert c.spec_tokens_per_step() == pytest.approx(1.95)
    assert c.spec_acceptance() == pytest.approx(0.95)
    assert metrics.Counters({}).spec_tokens_per_step() is None


def test_raw_sanity_rule():
    assert raw_sanity(1.02, 0.25, 0, 1.0) == []
    assert "sanity rule broken: TG per stream" in raw_sanity(4.8, 0.25, 0, 1.0)[0]
    assert "unmeasured" in raw_sanity(None, 0.25, 0, 1.0)[0]
    assert "speculative decoding was active" in raw_sanity(1.0, 0.25, 12, 1.0)[0]
    # the client's figure alone cannot pass the rule: the engine's own count must agree
    assert "the server's tokens per engine step = 2.00" in raw_sanity(1.0, 0.25, 0, 2.0)[0]
    assert "the server's tokens per engine step = unmeasured" in raw_sanity(1.0, 0.25, 0)[0]


def test_server_view_from_histogram_counters():
    from rig.bench.metrics import Counters, parse

    text = "\n".join([
        'vllm:generation_tokens_total{model_name="m"} 640.0',
        'vllm:time_to_first_token_seconds_count{model_name="m"} 10.0',
        'vllm:inter_token_latency_seconds_count{model_name="m"} 210.0',
        'vllm:request_time_per_output_token_seconds_sum{model_name="m"} 0.5',
        'vllm:request_time_per_output_token_seconds_count{model_name="m"} 10.0',
        'vllm:request_time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 10.0'])
    c = Counters(parse(text))
    assert c.deltas["itl_n"] == 210 and "tpot_bucket" not in c.deltas
    assert c.server_tokens_per_round() == pytest.approx((640 - 10) / 210)  # 3 tokens a step: speculation
    assert c.server_tpot_ms() == pytest.approx(50.0)
    assert Counters({}).server_tokens_per_round() is None and Counters({}).server_tpot_ms() is None


def test_summary_is_median_and_spread_of_kept_passes_only():
    cell = CellResult(label="x", params={})
    cell.passes = [PassResult(seed=1, warmup=True, ok=True, figures={"output_tok_per_s": 10.0}),
                   PassResult(seed=2, warmup=False, ok=True, figures={"output_tok_per_s": 100.0}),
                   PassResult(seed=3, warmup=False, ok=True, figures={"output_tok_per_s": 110.0}),
                   PassResult(seed=4, warmup=False, ok=True, figures={"output_tok_per_s": 90.0})]
    cell.summarize()
    s = cell.summary["output_tok_per_s"]
    assert (s.median, s.min, s.max, s.n) == (100.0, 90.0, 110.0, 3)
    assert s.spread_pct == pytest.approx(20.0)
    assert spread([]) is None


def _result(knobs: dict, sha: str = "abc", tok: float = 100.0) -> RunResult:
    fp = {"rig": {"sha": sha}, "packages": {"vllm": "0.28.0"}, "locks": {}, "gpus": [], "patches": {"files": {}},
          "plan": {"knobs": knobs}}
    cell = CellResult(label="C1", params={}, passes=[PassResult(seed=1, warmup=False, ok=True,
                                                                figures={"e2e_tok_per_s": tok})])
    cell.summarize()
    return RunResult(protocol="cohort", protocol_kind="cohort", protocol_def={}, profile="batch", plan={},
                     knobs=knobs, fingerprint=fp, scale={"factor": 1.0}, repeat=1, started_utc="t", cells=[cell])


def test_compare_accepts_one_knob_under_test_and_prints_the_change():
    a = _result({"PREFIX_CACHE": 0, "PORT": 1})
    b = _result({"PREFIX_CACHE": 1, "PORT": 2}, tok=125.0)
    text = compare.render(a, b)
    assert "knob under test: PREFIX_CACHE = 0 (A) vs 1 (B)" in text
    assert "e2e_tok_per_s" in text and "+25.0%" in text


def test_compare_refuses_other_differences_unless_forced():
    a = _result({"PREFIX_CACHE": 0, "KV": "fp8"})
    with pytest.raises(compare.CompareError, match="more than one knob differs"):
        compare.render(a, _result({"PREFIX_CACHE": 1, "KV": "auto"}))
    with pytest.raises(compare.CompareError, match="rig.sha: 'abc' vs 'def'"):
        compare.render(a, _result({"PREFIX_CACHE": 0, "KV": "fp8"}, sha="def"))
    forced = compare.render(a, _result({"PREFIX_CACHE": 0, "KV": "fp8"}, sha="def"), force=True)
    assert "FORCED despite: rig.sha" in forced


def test_result_files_are_written_whole(tmp_path):
    d = RunDir(tmp_path / "run")
    r = _result({})
    d.save(r)
    d.add_requests([{"index": 0, "ttft_ms": 1.0}])
    assert RunResult.model_validate_json((tmp_path / "run" / "result.json").read_text()) == r
    assert json.loads((tmp_path / "run" / "requests.jsonl").read_text())["ttft_ms"] == 1.0
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.parametrize("kwargs, message", [
    ({"protocol": ["nope"]}, "unknown protocol 'nope'"),
    ({"protocol": ["raw"], "set": ["PREFIX_CACHE=1"]}, "needs PREFIX_CACHE=0, but --set PREFIX_CACHE=1"),
    ({"protocol": ["cohort"], "set": ["MAX_SEQS"]}, "expected KNOB=value"),
    ({"protocol": ["cohort"], "set": ["NOPE=1"]}, "--set NOPE: unknown knob"),
    ({"protocol": ["cohort"], "profile": "fast"}, "unknown profile 'fast'"),
    ({"protocol": ["cohort"], "repeat": 0}, "--repeat 0: expected an integer >= 1"),
    ({"protocol": ["cohort"], "scale": "abc"}, "--scale abc: expected a factor in (0, 1]"),
    ({"protocol": ["cohort"], "scale": "2"}, "--scale 2: expected a factor in (0, 1]"),
])
def test_cli_refuses_bad_input_before_starting_anything(kwargs, message, monkeypatch):
    from rig.bench import servers
    from rig.cli import bench

    def no_start(*a, **k):
        raise AssertionError("a server was started despite bad input")

    monkeypatch.setattr(servers.ServerPool, "_start", no_start)
    with pytest.raises(Exit) as e:
        bench.run(Context(), platform="cpu", **kwargs)
    assert e.value.code == 2
    assert message in str(e.value.message)
