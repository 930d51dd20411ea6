"""vLLM's own KV-cache manager for the 3:1 hybrid model, driven step by step like its scheduler.

No server, no model: vLLM's real ``KVCacheManager`` / ``HybridKVCacheCoordinator`` / ``BlockPool``
for three mamba groups in "align" mode plus one full-attention group (the tiny and the real
model's 3 : 1 layout), and a small loop that does what ``v1/core/sched/scheduler.py`` does with
them: running requests first (one token each; when the pool falls short the newest running
request is preempted, freed and queued again at the front), then waiting requests in FIFO order
while seats are free, stopping at the first one the pool refuses. The block-level effects of
``mamba-align-checkpoint-order`` (which blocks are kept, freed, evicted, refused) are then exact,
since they are vLLM's; only the model's compute is absent.

``tests/test_patch_mamba.py`` asserts on it; ``bench/scripts/mamba_checkpoint_admission.py``
prints the admission figures of docs/patches.md from it.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rig import patches

patches.ensure_applied()

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

__all__ = ["B", "KNOB", "Request", "Sim", "AdmissionWorkload", "run_admissions", "admission_report", "knob"]

B = 16  # tokens per block (attention and mamba aligned, as align mode makes them)
KNOB = "VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS"
MAMBA_GROUPS = 3
ATTN_GROUP = 3  # the group id of the attention group (after the three mamba groups)


@contextmanager
def knob(on: bool) -> Iterator[None]:
    """VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS for managers built inside the block (read at construction)."""
    old = os.environ.get(KNOB)
    os.environ[KNOB] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(KNOB, None)
        else:
            os.environ[KNOB] = old


@dataclass
class Entry:
    """A request the loop drives: its outputs (token ids it will 'sample') and how far it got."""

    request: Request
    outputs: list[int]
    pos: int = 0  # outputs appended so far
    arrived: int = 0  # step it was queued
    admitted: int | None = None  # step it was first admitted


@dataclass
class Sim:
    """The scheduler loop over vLLM's KVCacheManager: allocate, compute, append, free."""

    manager: KVCacheManager
    active: list[list] = field(default_factory=list)  # [request, outputs, next output index]
    running_alloc_failures: int = 0
    max_kept_seen: int = 0  # kept checkpoints, all groups and requests together
    max_kept_per_request_group: int = 0

    @classmethod
    def make(cls, num_blocks: int, hash_block_size: int = B) -> Sim:
        """A pool of ``num_blocks`` blocks shared by the four groups (``hash_block_size`` < B: a
        prefix-match unit finer than the block, so a hit can end inside one: copy-on-write)."""
        init_none_hash(sha256)
        attn = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=32, dtype=torch.float32)
        mamba = MambaSpec(block_size=B, shapes=((attn.page_size_bytes // 4,),), dtypes=(torch.float32,),
                          mamba_cache_mode="align")
        groups = [KVCacheGroupSpec([f"linear_attn.{i}"], mamba) for i in range(MAMBA_GROUPS)]
        groups.append(KVCacheGroupSpec(["self_attn.0"], attn))
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        return cls(KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=B, hash_block_size=hash_block_size))

    @staticmethod
    def request(rid: str, prompt: list[int], outputs: int, hash_block_size: int = B) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=outputs), None,
                       block_hasher=get_request_block_hasher(hash_block_size, sha256))

    @property
    def pool(self):
        return self.manager.block_pool

    def mamba_managers(self) -> list:
        return [m for m in self.manager.coordinator.single_type_managers if hasattr(m, "_kept")]

    def kept(self) -> int:
        """Checkpoints kept alive right now (all mamba groups, all requests)."""
        return sum(len(v) for m in self.mamba_managers() for v in m._kept.values())

    def admit(self, r: Request, outputs: list[int]) -> int | None:
        """Prefix lookup + prefill in one chunk; the hit in tokens, None when the pool refuses."""
        blocks, hit, _ = self.manager.get_computed_blocks(r)
        # as Scheduler.schedule() admits: the whole prompt must fit (scheduler_reserve_full_isl,
        # on by default in 0.28)
        if self.manager.allocate_slots(r, r.num_tokens - hit, hit, blocks, full_sequence_must_fit=True,
                                       has_scheduled_reqs=bool(self.active)) is None:
            return None
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = r.num_tokens
        self.retire_copies()
        if r.num_output_tokens == 0:
            r.append_output_token_ids(outputs[0])
        self.active.append([r, outputs, r.num_output_tokens])
        return hit

    def start(self, r: Request, outputs: list[int]) -> int | None:
        """Admit a request at the start of a step."""
        self.manager.new_step_starts()
        return self.admit(r, outputs)

    def retire_copies(self) -> None:
        """The worker ran this step's copy-on-write copies: release the endpoints the scheduler
        retained for them (``Scheduler._free_cow_retained_blocks``)."""
        _, retained = self.manager.take_kv_cache_block_copies()
        if retained:
            self.pool.free_blocks(retained)

    def preempt(self, entry: list) -> None:
        """What the scheduler does to a running request the pool cannot extend: free it all, and
        recompute it later from its tokens so far."""
        r = entry[0]
        self.manager.free(r)
        r.status = RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        self.active.remove(entry)

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
        self.retire_copies()
        self.observe()

    def observe(self) -> None:
        mamba = self.mamba_managers()
        self.max_kept_seen = max(self.max_kept_seen, self.kept())
        self.max_kept_per_request_group = max([self.max_kept_per_request_group,
                                               *(len(v) for m in mamba for v in m._kept.values())])

    def attention_hit_tokens(self, r: Request) -> int:
        """How much of r's prefix the attention group alone still has cached."""
        n = 0
        for h in r.block_hashes:
            if not self.pool.get_cached_block(h, [ATTN_GROUP]):
                break
            n += B
        return n

    def leaks(self) -> list[str]:
        """What is wrong with the pool once every request has been freed: blocks still held, a
        ref count below 0 (a double free keeps the free count, so the count alone cannot tell),
        a block in the free queue twice, checkpoints still kept."""
        problems = []
        pool = self.pool
        for b in pool.blocks:
            if b.is_null:
                continue
            if b.ref_cnt != 0:
                problems.append(f"block {b.block_id}: ref_cnt {b.ref_cnt}")
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        if len(free_ids) != len(set(free_ids)):
            problems.append("a block is in the free queue twice")
        if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
            problems.append(f"{pool.get_num_free_blocks()} free of {pool.num_gpu_blocks - 1} non-null blocks")
        if self.kept():
            problems.append(f"{self.kept()} checkpoints still kept")
        return problems


def block_ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# --------------------------------------------------------------------------------------------
# Admissions under pressure: what the kept checkpoints cost waiting requests


@dataclass(frozen=True)
class AdmissionWorkload:
    """Independent requests (no shared prefix) arriving faster than the pool drains them."""

    num_blocks: int = 64  # the pool (1/16 = 4 blocks per mamba group may be kept: 12 in all)
    max_seqs: int = 8
    requests: int = 64
    every: int = 4  # a request arrives every `every` steps
    prompt: int = 100  # tokens: 7 attention blocks
    output: int = 24  # tokens decoded: 1-2 checkpoints past the prompt's
    # (--every 4, max_seqs 8: the pool, not the seats, limits admissions; vLLM preempts too)


@dataclass
class AdmissionResult:
    knob: bool
    steps: int = 0  # until every request finished
    refused: int = 0  # admission attempts the pool refused (the head of the queue waited a step)
    delay_steps: list[int] = field(default_factory=list)  # per request: admitted - arrived
    preemptions: int = 0
    max_kept: int = 0
    max_waiting: int = 0
    leaks: list[str] = field(default_factory=list)


def run_admissions(w: AdmissionWorkload, knob_on: bool) -> AdmissionResult:
    """The workload on a fresh manager with the knob off or on (the scheduler's order of work)."""
    with knob(knob_on):
        sim = Sim.make(w.num_blocks)
    res = AdmissionResult(knob_on)
    todo = deque(Entry(Sim.request(f"r{i}", [10_000 + 1000 * i + k for k in range(w.prompt)], w.output),
                       [500 + k for k in range(w.output)], arrived=i * w.every) for i in range(w.requests))
    waiting: deque[Entry] = deque()
    by_request: dict[str, Entry] = {}
    step = 0
    while todo or waiting or sim.active:
        if step > 100_000:
            raise RuntimeError("the admission workload made no progress")
        while todo and todo[0].arrived <= step:
            e = todo.popleft()
            waiting.append(e)
            by_request[e.request.request_id] = e
        sim.manager.new_step_starts()
        # running first, as the scheduler does; a request the pool cannot extend preempts the newest
        for entry in list(sim.active):
            if entry not in sim.active:
                continue
            r, outputs, pos = entry
            if pos == len(outputs):
                sim.manager.free(r)
                sim.active.remove(entry)
                continue
            while sim.manager.allocate_slots(r, 1) is None:
                victim = sim.active[-1]
                sim.preempt(victim)
                res.preemptions += 1
                waiting.appendleft(by_request[victim[0].request_id])
                if victim is entry:
                    break
            else:
                r.num_computed_tokens += 1
                r.append_output_token_ids(outputs[pos])
                entry[2] += 1
        while waiting and len(sim.active) < w.max_seqs:
            e = waiting[0]
            if sim.admit(e.request, e.outputs) is None:
                res.refused += 1
                break
            waiting.popleft()
            if e.admitted is None:
                e.admitted = step
                res.delay_steps.append(step - e.arrived)
        sim.retire_copies()
        sim.observe()
        res.max_waiting = max(res.max_waiting, len(waiting))
        step += 1
    res.steps = step
    res.max_kept = sim.max_kept_seen
    res.leaks = sim.leaks()
    return res


def admission_report(w: AdmissionWorkload, off: AdmissionResult, on: AdmissionResult) -> str:
    """The table bench/scripts/mamba_checkpoint_admission.py prints (docs/patches.md quotes it)."""
    def mean(xs: list[int]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    def p90(xs: list[int]) -> int:
        return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else 0

    rows = [
        f"workload: {w.requests} requests of {w.prompt}+{w.output} tok, one every {w.every} steps, no shared "
        f"prefix; pool {w.num_blocks} blocks of {B} tok (3 mamba groups + 1 attention), max_seqs {w.max_seqs}",
        f"{'':36}{'knob off':>10}{'knob on':>10}",
        f"{'admissions refused (attempts)':36}{off.refused:>10}{on.refused:>10}",
        f"{'mean admission delay (steps)':36}{mean(off.delay_steps):>10.1f}{mean(on.delay_steps):>10.1f}",
        f"{'p90 admission delay (steps)':36}{p90(off.delay_steps):>10}{p90(on.delay_steps):>10}",
        f"{'max waiting requests':36}{off.max_waiting:>10}{on.max_waiting:>10}",
        f"{'steps until all finished':36}{off.steps:>10}{on.steps:>10}",
        f"{'preemptions':36}{off.preemptions:>10}{on.preemptions:>10}",
        f"{'max checkpoints kept (blocks)':36}{off.max_kept:>10}{on.max_kept:>10}",
        f"{'blocks leaked / bad ref counts':36}{len(off.leaks):>10}{len(on.leaks):>10}",
    ]
    return "\n".join(rows)
