"""mamba-align-checkpoint-order on real vLLM code: the KV-cache manager, then a real CPU server.

Unit level: vLLM's own KVCacheManager / HybridKVCacheCoordinator / BlockPool for a hybrid spec
(three mamba groups in "align" mode + one full-attention group, as the 3:1 model), driven step
by step the way the scheduler drives it: a conversation turn decodes while unrelated requests
come and go, then the next turn asks for its prefix.
End to end (slow): two `vllm serve` starts of the tiny hybrid model, knob off and on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

import pytest
import torch

from rig import patches

patches.ensure_applied()

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

B = 16  # tokens per block (attention and mamba aligned, as align mode makes them)
KNOB = "VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS"


@dataclass
class Sim:
    """A minimal scheduler loop over vLLM's KVCacheManager: allocate, compute, append, free."""

    manager: KVCacheManager
    active: list[list] = field(default_factory=list)  # [request, outputs, next output index]
    running_alloc_failures: int = 0
    max_kept_seen: int = 0  # kept checkpoints, all groups and requests together
    max_kept_per_request_group: int = 0

    @classmethod
    def make(cls, num_blocks: int) -> Sim:
        init_none_hash(sha256)
        attn = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=32, dtype=torch.float32)
        mamba = MambaSpec(block_size=B, shapes=((attn.page_size_bytes // 4,),), dtypes=(torch.float32,),
                          mamba_cache_mode="align")
        groups = [KVCacheGroupSpec([f"linear_attn.{i}"], mamba) for i in range(3)]
        groups.append(KVCacheGroupSpec(["self_attn.0"], attn))
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        return cls(KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=B, hash_block_size=B))

    @staticmethod
    def request(rid: str, prompt: list[int], outputs: int) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=outputs), None,
                       block_hasher=get_request_block_hasher(B, sha256))

    def start(self, r: Request, outputs: list[int]) -> int | None:
        """Admit a request: prefix lookup + prefill in one chunk; None when it must wait."""
        self.manager.new_step_starts()
        blocks, hit, _ = self.manager.get_computed_blocks(r)
        if self.manager.allocate_slots(r, r.num_prompt_tokens - hit, hit, blocks) is None:
            return None
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = r.num_prompt_tokens
        r.append_output_token_ids(outputs[0])
        self.active.append([r, outputs, 1])
        return hit

    def step(self) -> None:
        """One decode step for every running request; finished ones are freed."""
        self.manager.new_step_starts()
        for entry in list(self.active):
            r, outputs, pos = entry
            if pos == len(outputs):
                self.manager.free(r)
                self.active.remove(entry)
                continue
            if self.manager.allocate_slots(r, 1) is None:
                self.running_alloc_failures += 1
                continue
            r.num_computed_tokens += 1
            r.append_output_token_ids(outputs[pos])
            entry[2] += 1
        mamba = [m for m in self.manager.coordinator.single_type_managers if hasattr(m, "_kept")]
        self.max_kept_seen = max(self.max_kept_seen, sum(len(v) for m in mamba for v in m._kept.values()))
        self.max_kept_per_request_group = max([self.max_kept_per_request_group,
                                               *(len(v) for m in mamba for v in m._kept.values())])

    def attention_hit_tokens(self, r: Request) -> int:
        """How much of r's prefix the attention group alone still has cached."""
        attn_group = 3
        n = 0
        for h in r.block_hashes:
            if not self.manager.block_pool.get_cached_block(h, [attn_group]):
                break
            n += B
        return n


CONV = list(range(100, 170))  # 70-token first prompt
OUT1 = list(range(1000, 1040))  # 40 tokens decoded: checkpoints at 80 and 96
NEXT = CONV + OUT1[:-1] + list(range(5, 22))  # the next turn: history + new user tokens


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
    for _ in range(1000):
        if not sim.active:
            break
        sim.step()
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


def test_without_pressure_both_hit_the_same(monkeypatch):
    for knob in ("0", "1"):
        monkeypatch.setenv(KNOB, knob)
        assert conversation(every=0)[0] == 96


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
    while sim.active:
        sim.step()
    pool = sim.manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # only the null block is in use
    assert all(not m._kept for m in sim.manager.coordinator.single_type_managers if hasattr(m, "_kept"))


def test_preemption_path_releases_kept_checkpoints(monkeypatch):
    """A request freed mid-decode (preemption / abort) gives its kept checkpoints back too."""
    monkeypatch.setenv(KNOB, "1")
    sim = Sim.make(48)
    c1 = Sim.request("turn1", CONV, len(OUT1))
    sim.start(c1, OUT1)
    for _ in range(30):  # past the checkpoints at 80 and 96
        sim.step()
    assert sim.max_kept_per_request_group == 2 and sim.max_kept_seen == 3 * 2
    sim.manager.free(c1)
    sim.active.clear()
    pool = sim.manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


@pytest.mark.slow
def test_e2e_cpu_server_more_hits_lower_ttft_same_outputs(tiny_model, tmp_path):
    """Two real servers (knob off, knob on): the bench scenario, asserted."""
    from rig import mamba_checkpoint_bench as mb

    sc = mb.Scenario()
    off, on = mb.compare(tiny_model, sc, log_dir=tmp_path)
    print(mb.report(sc, off, on))
    assert sum(on.turn_cached) > sum(off.turn_cached)  # per turn, from each response's usage
    assert on.hits > off.hits  # vllm:prefix_cache_hits_total over the run
    assert on.queries == off.queries  # the same prompts were asked
    # the median: the client's clock sees a host's scheduling stalls too, one turn's TTFT can carry one
    assert median(on.turn_ttft_ms) < median(off.turn_ttft_ms)
    assert on.outputs == off.outputs
    assert on.unrelated_sent == off.unrelated_sent == sc.turns * sc.unrelated_per_turn
    assert on.preemptions == 0
