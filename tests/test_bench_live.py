"""Every bench protocol end to end on a real CPU vLLM server (tiny hybrid model, CPU scale).

The batch server of the session (PREFIX_CACHE=0) runs everything; shared-prefix's PREFIX_CACHE=1
variant gets one more server, started by the bench's own ServerPool.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest

from rig.bench import protocols
from rig.bench.protocols import CPU_SCALE, Scale
from rig.bench.results import RunResult
from rig.bench.runner import Run, Target, fixed
from rig.plan import resolve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(batch_server, session_tmp) -> Target:
    """The session's batch server with the plan it was started from (conftest.cpu_plan, same port)."""
    plan = resolve("batch", platform="cpu", environ={},
                   sets={"PORT": str(batch_server.port), "API_KEY_FILE": str(session_tmp / "api_key")})
    return Target.of(batch_server, plan)


def run(name: str, acquire, out: Path, seed: int, protocol=None, repeat: int = 1) -> RunResult:
    r = Run(name, protocol or protocols.load(name), acquire, "batch", Scale(factor=CPU_SCALE), repeat=repeat,
            seed=seed, out=out, progress=False)
    return r.execute()


def check_files(out: Path, r: RunResult, plots: set[str]) -> None:
    assert RunResult.model_validate_json((out / "result.json").read_text()) == r
    for name in ("requests.jsonl", "tables.md", *(f"{p}.png" for p in plots)):
        assert (out / name).stat().st_size > 0, name
    for p in plots:
        assert (out / f"{p}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(set(r.seeds)) == len(r.seeds), "a seed was reused"
    assert r.fingerprint["plan"]["knobs"] == r.knobs and r.fingerprint["packages"]["vllm"]
    assert r.finished_utc is not None


def itl_bounds(out: Path, cell, p) -> tuple[float, float]:
    """The window's token count must lie within what the clients' own inter-token gaps allow.

    Over a window of W seconds in which the same c requests decode (no prefill, no request starts or
    ends), each of them gets a token at least every max-ITL seconds, so the window holds at least
    c * (W / max_itl - 1) tokens, and at most every token the pass generated. The gaps come from
    `vllm bench serve`'s stream, the window from the server's counters: an independent check that holds
    on a loaded host too (a stall lengthens max-ITL; it cannot make the window's count wrong). The
    client sees a server gap shortened by however much its own lag shrank over it, hence 2 x max-ITL.
    """
    rows = [json.loads(ln) for ln in (out / "requests.jsonl").read_text().splitlines()]
    gaps = [g for r in rows if r["cell"] == cell.label and r["seed"] == p.seed for g in (r["itl_ms"] or [])]
    assert gaps, f"no inter-token gaps for {cell.label} seed {p.seed}"
    c, w = p.steady_state["target_running"], p.steady_state["window_s"]
    return c * (w / (2 * max(gaps) / 1000) - 1), p.counters["gen"]


def assert_window_consistent(out: Path, cell, p) -> None:
    low, high = itl_bounds(out, cell, p)
    tokens = p.steady_state["decode_tok_per_s"] * p.steady_state["window_s"]
    assert low <= tokens <= high, (low, tokens, high, p.steady_state)


def kept(cell):
    return [p for p in cell.passes if not p.warmup]


def test_throughput(target, tmp_path):
    r = run("throughput", fixed(target), tmp_path, seed=100_000)
    assert r.valid, r.problems
    check_files(tmp_path, r, {"throughput_vs_concurrency", "ttft_tpot_distributions"})
    assert [c.params["concurrency"] for c in r.cells] == [1, 16, 16]  # 64 capped by MAX_SEQS 16
    assert r.cells[0].passes[0].warmup and len(kept(r.cells[0])) == 1
    for c in r.cells:
        p = kept(c)[0]
        assert p.command.startswith("vllm bench serve --backend vllm") and "--ignore-eos" in p.command
        assert p.figures["output_tok_per_s"] > 0 and p.figures["median_tpot_ms"] > 0
        assert p.figures["total_output_tokens"] == c.params["num_prompts"] * c.params["output_len"]
    for c in r.cells:  # every pass is sampled; at this scale a cell is ~1-2 s, too short to promise a window
        p = kept(c)[0]
        ss = p.steady_state
        # the sampler saw the whole pass: the engine's own token count equals what the bench asked for
        assert p.counters["gen"] == p.figures["total_output_tokens"], (p.counters, p.figures)
        assert ss["target_running"] == c.params["concurrency"], ss
        if ss["decode_tok_per_s"] is None:  # no figure only for want of a window, and it says how much it found
            assert ss["window_s"] < 0.5 and ss["reason"].startswith("no steady window of >= 0.5 s"), ss
        else:  # a figure rests on >= 0.5 s of steady intervals, and its token count fits the streams' gaps
            assert ss["window_s"] >= 0.5 and ss["intervals"] >= 1 and ss["reason"] is None, ss
            assert_window_consistent(tmp_path, c, p)
    assert [any("queue time" in f for f in c.flags) for c in r.cells] == [False, True, True]
    table = (tmp_path / "tables.md").read_text()
    assert "| workload | steady-state decode | output tok/s (e2e) | median TPOT | median TTFT |" in table
    assert "128/512, 64 concurrent [scaled: 16/64 c16 n32]" in table


def test_steady_state_decode(target, tmp_path):
    """Long decodes (4 x 1024 tokens, ~6 s) of 4 requests that join and leave together: a /metrics window is found.

    A sampler stall (docs/development.md, "Host stalls") only lengthens an interval, and the counters
    at both ends of one inside the decode still show 4 running and no prefill, so the window survives
    it; a stall over the whole decode leaves none, hence two passes and "at least one".
    """
    proto = protocols.ThroughputProtocol(schema_version=1, kind="throughput", description="steady state",
                                         cells=[protocols.RandomCell(input_len=128, output_len=8192,
                                                                     concurrency=4, num_prompts=4)])
    r = run("steady", fixed(target), tmp_path, seed=150_000, protocol=proto, repeat=2)
    assert r.valid, r.problems
    assert r.cells[0].params["output_len"] == 1024 and r.cells[0].params["concurrency"] == 4
    passes = kept(r.cells[0])
    for p in passes:
        print(f"steady decode {p.figures['steady_decode_tok_per_s']} tok/s, e2e {p.figures['output_tok_per_s']:.1f} "
              f"tok/s, {p.steady_state}")
    found = [p for p in passes if p.steady_state["window_s"] >= 1.0]
    assert len(passes) == 2 and found, [p.steady_state for p in passes]
    for p in found:  # the window's count fits the streams' inter-token gaps (not a speed ratio: load varies)
        assert_window_consistent(tmp_path, r.cells[0], p)


def test_prefill(target, tmp_path):
    r = run("prefill", fixed(target), tmp_path, seed=200_000)
    assert r.valid, r.problems
    check_files(tmp_path, r, {"prefill_vs_length", "ttft_tpot_distributions"})
    assert {c.params["output_len"] for c in r.cells} == {1}
    assert all(c.median("prompt_tok_per_s") > 0 for c in r.cells)
    table = (tmp_path / "tables.md").read_text()
    for row in ("| 1k [scaled: 128] |", "| 16k [scaled: 2048] |", "| 100k [scaled: 12800] |"):
        assert row in table


def test_raw(target, tmp_path):
    r = run("raw", fixed(target), tmp_path, seed=300_000)
    assert r.valid, r.problems
    check_files(tmp_path, r, {"throughput_vs_concurrency"})
    assert [c.label for c in r.cells] == ["C1", "C4", "C8"]
    for c in r.cells:
        p = kept(c)[0]
        conc, n, out_len = c.params["concurrency"], c.params["num_prompts"], c.params["output_len"]
        # counted tokens: the engine generated exactly what the TG run asked for, and drafted nothing
        assert p.counters["gen"] == n * out_len and p.counters.get("drafts", 0) == 0, p.counters
        # tokens per round as the engine counted them (one ITL observation per stream per step after its
        # first token), independent of the client's ITL / TPOT: one token per stream per step
        steps = p.counters["itl_n"]
        assert p.counters["ttft_n"] == n and steps == n * (out_len - 1), p.counters
        assert p.figures["srv_tokens_per_round"] == 1.0
        assert p.figures["tokens_per_round"] == pytest.approx(p.figures["srv_tokens_per_round"], abs=0.1)
        # TG against the engine's own TPOT histogram (not the runner's formula over the client's TPOT)
        srv_tpot_ms = 1000 * p.counters["tpot_sum"] / p.counters["tpot_n"]
        assert p.counters["tpot_n"] == n and p.figures["srv_tpot_ms"] == pytest.approx(srv_tpot_ms)
        assert p.figures["tg_agg_tok_per_s"] == pytest.approx(conc * 1000 / srv_tpot_ms, rel=0.15), p.figures
        assert c.median("pp_tok_per_s") > 0


def test_cohort(target, tmp_path):
    r = run("cohort", fixed(target), tmp_path, seed=400_000)
    assert r.valid, r.problems
    check_files(tmp_path, r, {"throughput_vs_concurrency", "ttft_tpot_distributions"})
    assert [c.label for c in r.cells] == ["C1", "C2", "C4", "C8"]
    for c in r.cells:
        p = kept(c)[0]
        # ignore_eos: every answer is exactly max_tokens, counted from usage (reasoning deltas included)
        assert p.figures["output_tokens"] == c.params["cohort"] * c.params["max_tokens"] == c.params["cohort"] * 128
        assert p.figures["e2e_tok_per_s"] > 0 and p.figures["decode_tok_per_s"] > 0 and p.figures["mean_ttft_ms"] > 0
    rows = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(rows) == 1 + 1 + 2 + 4 + 8  # the warm-up cohort is recorded too


def test_long(target, tmp_path):
    r = run("long", fixed(target), tmp_path, seed=500_000)
    assert r.valid, r.problems
    check_files(tmp_path, r, {"ttft_tpot_distributions"})
    c1, c4 = r.cells
    assert (c1.params["input_len"], c1.params["num_prompts"]) == (12500, 1)
    assert (c4.params["input_len"], c4.params["concurrency"], c4.params["num_prompts"]) == (7500, 4, 4)
    assert kept(c4)[0].figures["total_input_tokens"] >= 4 * 7500


def test_failed_requests_make_the_run_invalid_keep_the_data_and_exit_1(target, tmp_path, monkeypatch):
    from invoke import Context, Exit

    from rig.bench import servers
    from rig.cli import bench

    wrong = Target(target.url, target.headers, "no-such-model", target.plan, target.alive)

    @contextmanager
    def acquire(self, knobs):
        yield wrong

    monkeypatch.setenv("RIG_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(servers.ServerPool, "acquire", acquire)
    with pytest.raises(Exit) as e:
        bench.run(Context(), protocol=["cohort"], platform="cpu", progress=False, seed=700_000)
    assert e.value.code == 1
    (folder,) = (tmp_path / "results").iterdir()
    r = RunResult.model_validate_json((folder / "result.json").read_text())
    assert not r.valid and "failed" in r.problems[0] and "404" in r.problems[0]
    assert len(r.cells) == 4 and all(not p.ok for c in r.cells for p in c.passes)
    assert (folder / "tables.md").read_text().count("—") >= 12  # no figure is made up: every cell shows a dash
    assert "valid: **NO**" in (folder / "tables.md").read_text()


def test_shared_prefix_shows_the_prefix_cache_effect(target, tmp_path, session_tmp):
    from rig.bench.servers import ServerPool

    # Runs beside the session's server: a small KV cache in bytes (the same on every host, never a share of
    # its RAM) lets both fit; 16 requests of ~800 tokens need ~50 MB of KV, 512 MiB hold one MAX_LEN sequence.
    pool = ServerPool("batch", platform="cpu", environ={},
                      sets={"API_KEY_FILE": str(session_tmp / "api_key"), "KV_MEM": "512M"}, log_dir=session_tmp)

    @contextmanager
    def acquire(knobs):
        if knobs.get("PREFIX_CACHE"):
            with pool.acquire(knobs) as t:
                yield t
        else:
            with fixed(target)(knobs) as t:
                yield t

    try:
        # 5 passes a variant, compared by their medians: on a 2-core host the client and the API server can
        # stall for a second or more while the engine works (docs/development.md), enough to swamp one
        # ~1 s pass; the median of 5 passes takes two such stalls
        r = run("shared-prefix", acquire, tmp_path, seed=600_000, repeat=5)
    finally:
        pool.close()
    assert pool.started == 1
    assert r.valid, r.problems
    check_files(tmp_path, r, {"ttft_tpot_distributions"})
    default, cached = r.cells
    assert (default.label, cached.label) == ("default", "prefix_cache")
    assert r.variant_plans["prefix_cache"]["knobs"]["PREFIX_CACHE"] == 1
    assert any("prefix_cache: prefix cache reset: done" in n for n in r.notes), r.notes
    assert "prefix_cache_hit_pct" not in default.summary  # PREFIX_CACHE=0: no queries at all
    assert cached.median("prefix_cache_hit_pct") > 50  # the shared system prompt came from the cache
    ratio = r.derived["wall_ratio_default_over_prefix_cache"]
    walls = {c.label: [round(p.figures["wall_s"], 2) for p in kept(c)] for c in r.cells}
    print(f"\nshared-prefix on CPU: wall {default.median('wall_s'):.2f} s without prefix caching, "
          f"{cached.median('wall_s'):.2f} s with it: {ratio:.2f}x (medians of 5 passes: {walls})")
    assert all(len(w) == 5 for w in walls.values())
    assert ratio > 1.3
    assert "wall_ratio_default_over_prefix_cache" in (tmp_path / "tables.md").read_text()
