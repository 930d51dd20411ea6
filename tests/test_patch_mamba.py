"""mamba-align-checkpoint-order on real vLLM code: the KV-cache manager, then a real CPU server.

Unit level: vLLM's own KVCacheManager / HybridKVCacheCoordinator / BlockPool for a hybrid spec
(three mamba groups in "align" mode + one full-attention group, as the 3:1 model), driven step
by step the way the scheduler drives it: a conversation turn decodes while unrelated requests
come and go, then the next turn asks for its prefix.
End to end (slow): two `vllm serve` starts of the tiny hybrid model, knob off and on.
"""

from __future__ import annotations

from statistics import median

import pytest

from rig.capacity import mamba_pool_sim
from rig.capacity.mamba_pool_sim import KNOB, Request, Sim

CONV = list(range(100, 170))  # 70-token first prompt
OUT1 = list(range(1000, 1040))  # 40 tokens decoded: checkpoints at 80 and 96
NEXT = CONV + OUT1[:-1] + list(range(5, 22))  # the next turn: history + new user tokens


def drain(sim: Sim) -> None:
    """Run every active request to its end (and free it)."""
    for _ in range(2000):
        if not sim.active:
            return
        sim.step()
    raise AssertionError("requests made no progress")


def assert_clean(sim: Sim) -> None:
    """Every request has been freed: every block's ref_cnt is 0 (not just the free count, which a
    double free keeps), no block is twice in the free queue, nothing is kept."""
    assert sim.leaks() == []


def test_the_leak_check_sees_a_double_free(monkeypatch):
    """The check the scenarios end with can fail: a block freed twice keeps the free count
    (its ref_cnt goes to -1 and it is not queued again) but not a ref_cnt of 0."""
    monkeypatch.setenv(KNOB, "1")
    sim = Sim.make(48)
    r = Sim.request("r", CONV, 4)
    sim.start(r, [1, 2, 3, 4])
    block = sim.manager.coordinator.single_type_managers[3].req_to_blocks["r"][0]
    sim.manager.free(r)
    sim.active.clear()
    free = sim.pool.get_num_free_blocks()
    sim.pool.free_blocks([block])  # the double free
    assert sim.pool.get_num_free_blocks() == free == sim.pool.num_gpu_blocks - 1
    assert sim.leaks() == [f"block {block.block_id}: ref_cnt -1"]


def conversation(every: int, num_blocks: int = 48, unrelated_prompt: int = 64) -> tuple[int, Sim, Request]:
    """Turn 1 decodes while an unrelated request starts every ``every`` steps; returns turn 2's hit."""
    sim = Sim.make(num_blocks)
    c1 = Sim.request("turn1", CONV, len(OUT1))
    assert sim.start(c1, OUT1) == 0
    n, step = 0, 0
    while any(e[0] is c1 for e in sim.active):
        assert step < 1000, "the conversation made no progress"
        if every and step % every == 0:
            u = Sim.request(f"u{n}", [3000 + 100 * n + k for k in range(unrelated_prompt)], 4)
            n += sim.start(u, [2000, 2001, 2002, 2003]) is not None
        sim.step()
        step += 1
    drain(sim)
    c2 = Sim.request("turn2", NEXT, 10)
    return sim.start(c2, list(range(10))), sim, c2


@pytest.mark.parametrize("every", [3, 2])
def test_interleaved_traffic_keeps_the_hybrid_hit_only_with_the_knob(monkeypatch, every):
    monkeypatch.setenv(KNOB, "0")
    hit_off, sim_off, c2_off = conversation(every)
    monkeypatch.setenv(KNOB, "1")
    hit_on, sim_on, _ = conversation(every)
    assert hit_on == 96  # the newest checkpoint inside the common prefix, with all its attention blocks
    assert hit_off == 0  # upstream: the checkpoints went first ...
    assert sim_off.attention_hit_tokens(c2_off) >= 96  # ... although the attention KV is still cached
    assert sim_on.running_alloc_failures == sim_off.running_alloc_failures == 0
    for sim in (sim_off, sim_on):
        drain(sim)
        assert_clean(sim)


def test_without_pressure_both_hit_the_same(monkeypatch):
    for k in ("0", "1"):
        monkeypatch.setenv(KNOB, k)
        hit, sim, _ = conversation(every=0)
        assert hit == 96
        drain(sim)
        assert_clean(sim)


def test_keeping_is_bounded_never_starves_and_leaks_nothing(monkeypatch):
    """Under pressure every step the kept checkpoints are given back instead of failing
    allocations; per request at most VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX per group are kept;
    when all requests end, every block is free again."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    monkeypatch.setenv(KNOB, "1")
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX", "2")
    released: list[int] = []
    real = KVCacheCoordinator.release_kept_checkpoints

    def counting(self) -> int:  # a spy on the real method, which still runs
        released.append(real(self))
        return released[-1]

    monkeypatch.setattr(KVCacheCoordinator, "release_kept_checkpoints", counting)
    hit, sim, c2 = conversation(every=1)
    assert sum(released) > 0  # the pool ran short and the kept checkpoints were given back ...
    assert sim.running_alloc_failures == 0  # ... so no running request was refused a block
    assert sim.max_kept_per_request_group <= 2  # VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX
    assert 0 < sim.max_kept_seen <= 3 * (48 // 16)  # 3 mamba groups x 1/16 of the 48-block pool
    drain(sim)
    assert_clean(sim)


def test_preemption_frees_kept_checkpoints_and_the_request_resumes_cleanly(monkeypatch):
    """A request preempted mid-decode (freed, recomputed later from its tokens so far) gives its
    kept checkpoints back, hits its own prefix when readmitted, and leaves every ref_cnt at 0."""
    monkeypatch.setenv(KNOB, "1")
    sim = Sim.make(48)
    c1 = Sim.request("turn1", CONV, len(OUT1))
    sim.start(c1, OUT1)
    for _ in range(30):  # past the checkpoints at 80 and 96
        sim.step()
    assert sim.max_kept_per_request_group == 2 and sim.max_kept_seen == 3 * 2
    entry = next(e for e in sim.active if e[0] is c1)
    sim.preempt(entry)
    assert sim.kept() == 0
    pool = sim.pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    sim.manager.new_step_starts()
    hit = sim.admit(c1, OUT1)  # the scheduler's resume: a fresh prefix lookup over prompt + outputs
    assert hit == 96  # the newest kept checkpoint, freed last, still cached
    drain(sim)
    assert c1.num_output_tokens == len(OUT1)
    assert_clean(sim)


def test_abort_before_and_during_decode_leaves_every_ref_count_at_zero(monkeypatch):
    """Aborted requests are freed like finished ones: right after admission, mid-decode with
    checkpoints kept, and one that hit another request's kept checkpoint (a block held twice)."""
    monkeypatch.setenv(KNOB, "1")
    sim = Sim.make(64)
    a = Sim.request("a", CONV, len(OUT1))
    sim.start(a, OUT1)
    sim.manager.free(a)  # abort right after the prefill
    sim.active.clear()
    assert_clean(sim)
    c1 = Sim.request("turn1", CONV, len(OUT1))
    sim.start(c1, OUT1)
    for _ in range(30):
        sim.step()
    assert sim.kept() == 3 * 2
    # a second request over the same prefix + outputs hits a checkpoint turn1 still keeps
    c2 = Sim.request("turn2", CONV + OUT1[:29] + [7] * 5, 8)
    assert sim.start(c2, list(range(8))) == 96
    for _ in range(20):
        sim.step()
    for r in (c1, c2):  # abort both mid-decode
        sim.manager.free(r)
    sim.active.clear()
    assert_clean(sim)


def test_deferred_free_hands_kept_checkpoints_back_last(monkeypatch):
    """The scheduler's deferred free (``pop_blocks_for_free`` now, ``free_blocks(reversed(...))``
    once the in-flight step is done): the kept checkpoints come with the request's blocks, are
    freed after its attention blocks (so evicted after them) and nothing is freed twice."""
    monkeypatch.setenv(KNOB, "1")
    sim = Sim.make(48)
    c1 = Sim.request("turn1", CONV, len(OUT1))
    sim.start(c1, OUT1)
    for _ in range(30):
        sim.step()
    kept = {b.block_id for m in sim.mamba_managers() for v in m._kept.values() for _, b in v}
    assert len(kept) == 3 * 2
    attn = {b.block_id for b in sim.manager.coordinator.single_type_managers[3].req_to_blocks["turn1"]}
    blocks = sim.manager.pop_blocks_for_free(c1)
    sim.active.clear()
    assert sim.kept() == 0 and kept <= {b.block_id for b in blocks}
    assert all(b.ref_cnt > 0 for b in blocks if not b.is_null)  # not freed yet: the step may still write
    sim.pool.free_blocks(reversed(blocks))  # Scheduler._drain_deferred_frees
    assert_clean(sim)
    queue = [b.block_id for b in sim.pool.free_block_queue.get_all_free_blocks()]
    assert min(queue.index(i) for i in kept) > max(queue.index(i) for i in attn)


def test_partial_hit_copy_on_write_with_the_knob(monkeypatch):
    """A prefix-match unit finer than the block (hash 8 < block 16): the prompt's partial tail is
    cached, the producer's next step moves it into a copy-on-write block, a second request hits it
    inside a block and gets its own CoW copy; with the knob on, no ref count ends below or above 0."""
    monkeypatch.setenv(KNOB, "1")
    sim = Sim.make(64, hash_block_size=8)
    prompt = list(range(300, 376))  # 76 tokens: the last hash boundary, 72, is inside block 4
    p = Sim.request("producer", prompt, 40, hash_block_size=8)
    sim.manager.new_step_starts()
    blocks, hit, _ = sim.manager.get_computed_blocks(p)
    assert hit == 0
    assert sim.manager.allocate_slots(p, 72, 0, blocks) is not None  # align: the chunk ends at the boundary
    p.num_computed_tokens = 72
    sim.retire_copies()
    sim.manager.new_step_starts()
    assert sim.manager.allocate_slots(p, 4) is not None
    p.num_computed_tokens = 76
    p.status = p.status.RUNNING
    p.append_output_token_ids(0)
    sim.retire_copies()
    sim.active.append([p, list(range(40)), 1])
    for _ in range(30):
        sim.step()
    c = Sim.request("consumer", prompt[:72] + [9] * 30, 8, hash_block_size=8)
    sim.manager.new_step_starts()
    hit = sim.admit(c, list(range(8)))
    assert hit == 72  # inside block 4: a partial hit, copied on write
    drain(sim)
    assert_clean(sim)


def test_kept_checkpoints_cost_admissions_nothing():
    """Kept checkpoints are given back when an admission falls short too, not only a running
    request: with independent requests arriving faster than the pool drains them, the knob
    refuses no more admissions and delays none longer (before, it held up to 3/16 of the pool
    from waiting requests: bench/scripts/mamba_checkpoint_admission.py, docs/patches.md)."""
    w = mamba_pool_sim.AdmissionWorkload()
    off, on = mamba_pool_sim.run_admissions(w, False), mamba_pool_sim.run_admissions(w, True)
    assert off.refused > 0 and off.max_waiting > 1  # the pool, not the seats, held requests back
    assert on.max_kept > 0  # the knob kept checkpoints during the run
    assert on.refused <= off.refused
    assert sum(on.delay_steps) <= sum(off.delay_steps)
    assert on.steps <= off.steps and on.preemptions <= off.preemptions
    assert off.leaks == on.leaks == []


def test_a_malformed_max_stops_only_a_manager_that_keeps(monkeypatch):
    """VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX is parsed only with the knob on (vLLM's
    enable_envs_cache() reads every variable at start, so a bad value must not stop a server
    that does not keep checkpoints); with the knob on the error names the variable."""
    from vllm import envs

    for bad in ("two", "0", "-1", ""):
        monkeypatch.setenv("VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX", bad)
        monkeypatch.setenv(KNOB, "0")
        envs.enable_envs_cache()  # what the engine core does after start: reads every variable
        envs.disable_envs_cache()
        Sim.make(48)  # builds; the value is unused
        monkeypatch.setenv(KNOB, "1")
        with pytest.raises(ValueError, match=f"VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX={bad!r}: expected an integer"):
            Sim.make(48)
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX", "3")
    assert envs.VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX == "3"


@pytest.mark.slow
def test_e2e_cpu_server_more_hits_lower_ttft_same_outputs(tiny_model, tmp_path):
    """Two real servers (knob off, knob on): the bench scenario, asserted.

    The traffic phase shows the hits and the TTFT. Its outputs are not compared token for token:
    greedy decoding of the random-weight tiny model is not stable under a different batch
    composition on CPU (two runs of the same configuration, knob off both times, already differ:
    docs/patches.md, "Identity"). Identity is asserted where it is defined, on each turn replayed
    alone afterwards: from scratch the two servers give the same tokens; resumed from a
    checkpoint, the same tokens and logprobs within mb.TOLERANCE as from scratch."""
    from rig.bench import mamba_checkpoint as mb

    sc = mb.Scenario()
    off, on = mb.compare(tiny_model, sc, log_dir=tmp_path)
    print(mb.report(sc, off, on))
    assert sum(on.turn_cached) > sum(off.turn_cached)  # per turn, from each response's usage
    assert on.hits > off.hits  # vllm:prefix_cache_hits_total over the run
    assert on.queries == off.queries  # the same prompts were asked
    # the median: the client's clock sees a host's scheduling stalls too, one turn's TTFT can carry one
    assert median(on.turn_ttft_ms) < median(off.turn_ttft_ms)
    assert on.unrelated_sent == off.unrelated_sent == sc.turns * sc.unrelated_per_turn
    assert on.preemptions == 0
    # identity, where it is defined
    assert [c.ids for c in on.scratch] == [c.ids for c in off.scratch]  # same requests alone, no cache
    prompts = mb.replay_prompts(on.prompts)
    assert [c.cached for c in on.resumed] == [len(p) - 1 for p in prompts]  # one token from a checkpoint
    assert sum(c.cached for c in on.first) > 0  # some turns resumed from what the traffic phase kept
    for s in (off, on):
        for runs in (s.first, s.resumed):
            assert [mb.disagreement(a, b) for a, b in zip(s.scratch, runs, strict=True)] == [None] * len(runs)


def _fault_plugin(tmp_path) -> dict[str, str]:
    """The server environment that makes vLLM load tests/faults/rig_fault_mamba_resume.py as a
    general plugin (a dist-info naming its entry point) with the fault switched on."""
    from pathlib import Path

    site = tmp_path / "fault-site"
    info = site / "rig_fault_mamba_resume-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rig-fault-mamba-resume\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nrig_fault_mamba_resume = "
                                           "rig_fault_mamba_resume:register\n")
    faults = Path(__file__).parent / "faults"
    return {"PYTHONPATH": f"{site}:{faults}", "RIG_FAULT_MAMBA_RESUME": "zero"}


@pytest.mark.slow
def test_e2e_identity_check_fails_when_the_state_resume_is_wrong(tiny_model, tmp_path):
    """The negative control: a real server whose worker zeroes a resumed request's mamba state
    (a vLLM plugin, tests/faults/) — the same replay and check as above must see it."""
    from dataclasses import replace

    from rig.bench import mamba_checkpoint as mb

    sc = replace(mb.Scenario(), turns=2, turn_output=64, unrelated_per_turn=0)
    side = mb.run_side(tiny_model, sc, True, tmp_path, extra_env=_fault_plugin(tmp_path))
    log = "\n".join(p.read_text() for p in tmp_path.glob("mamba-checkpoint-on-*.log"))
    assert "rig fault: zeroed the resumed mamba state" in log  # the fault ran in the worker
    print("\n".join(mb.identity_lines(side)))
    assert side.resumed[0].cached == len(mb.replay_prompts(side.prompts)[0]) - 1  # turn 2 resumed ...
    assert mb.disagreement(side.scratch[0], side.resumed[0]) is not None  # ... and the check sees the wrong state
