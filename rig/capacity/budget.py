"""Memory before launch: weights, runtime overhead, the KV pool at GPU_UTIL (or KV_MEM), seats, verdict.

vLLM 0.28 sizes the KV cache as GPU_UTIL x the device's total memory less what the profile run
measured (weights, activation peak, CUDA graphs, non-torch memory). The planner has the weights
(rig.capacity.weights) and takes the rest from hardware/gpus.toml [overheads] (calibrated, said
so there). With KV_MEM set the cache is exactly that many bytes, which is what keeps CPU plans
the same on every host: on the cpu platform nothing here reads the host.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rig.capacity import cards, pages, weights
from rig.capacity.shape import Shape

GIB = 2**30


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class Budget:
    """A plan's memory, its pool and what it means for seats; ``errors`` mean it cannot start."""

    platform: str
    card: str
    total_bytes: int | None
    requested_bytes: int | None
    weights_bytes: int
    runtime_bytes: int
    prefix_cache_bytes: int
    kv_bytes: int | None
    kv_source: str
    pool: pages.Pool | None
    max_len_fit: int | None = None
    short_seats: int | None = None
    seats_at_max_len: int | None = None
    kv_mem_exact: int | None = None
    kv_mem_margin: int | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.pool:
            d["pool"] = {**asdict(self.pool), "block_bytes": self.pool.block_bytes, "padding": self.pool.padding}
        return d


def drafter_bytes(knobs: dict[str, Any], root: Path) -> int:
    """DFlash2 drafter files when the plan uses one and they are present (0 otherwise: not counted)."""
    if knobs["SPEC"] != "dflash2":
        return 0
    folder = Path(knobs["DRAFT_MODEL"])
    folder = folder if folder.is_absolute() else root / folder
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0


def num_spec(knobs: dict[str, Any]) -> int:
    """Draft tokens per step: each adds a conv-state row and a state block per GDN group per seat."""
    return knobs["SPEC_K"] if knobs["SPEC"] != "off" else 0


def plan_budget(knobs: dict[str, Any], platform: str, s: Shape, card: cards.Card | None, root: Path,
                step_tokens: int = 0) -> Budget:
    """The whole memory picture of a plan; ``card`` is None on the cpu platform.

    ``step_tokens`` is the plan's max_num_batched_tokens (0: vLLM's default), which sizes the
    activation peak vLLM's profile run measures; the runtime overhead was fitted at one step size.
    """
    w = weights.count(s)
    tp_pp = knobs["TP"] * knobs["PP"]
    weight_bytes = (w.loaded(with_mtp=knobs["SPEC"] == "mtp") + drafter_bytes(knobs, root)) // tp_pp
    ov = cards.overheads()
    kv_dtype = knobs["KV"]
    if platform == "cpu" or card is None:
        b = Budget(platform, "cpu", None, None, weight_bytes, 0, 0, knobs["KV_MEM"] or None,
                   "KV_MEM" if knobs["KV_MEM"] else "host RAM (vLLM's CPU rule: not predicted)", None)
    else:
        runtime = int(ov["runtime_bytes"])
        pc = int(ov["prefix_cache_seat_bytes"]) * knobs["MAX_SEQS"] if knobs["PREFIX_CACHE"] else 0
        requested = int(knobs["GPU_UTIL"] * card.memory_bytes)
        kv = knobs["KV_MEM"] or requested - weight_bytes - runtime - pc
        b = Budget(platform, card.name, card.memory_bytes, requested, weight_bytes, runtime, pc, kv,
                   "KV_MEM" if knobs["KV_MEM"] else "GPU_UTIL", None)
        if not knobs["KV_MEM"] and card.key != ov["calibrated_on"]:
            b.warnings.append(f"the runtime overhead ({_gib(runtime)}) was fitted on the {ov['calibrated_on']}'s "
                              f"published pool, not measured on the {card.name}: its pool is an estimate; "
                              "KV_MEM (bytes) makes it exact")
        step_fit = int(ov["calibrated_step_tokens"])
        if not knobs["KV_MEM"] and step_tokens > step_fit:
            b.warnings.append(f"this plan steps {step_tokens:,} tokens (max_num_batched_tokens) and the runtime "
                              f"overhead was fitted at {step_fit:,}: vLLM's profile run measures a larger "
                              "activation peak for longer steps and leaves a smaller pool than planned (not "
                              "modelled); KV_MEM (bytes) makes the pool exact")
        if weight_bytes + runtime >= requested:
            b.errors.append(f"the weights alone ({_gib(weight_bytes)}) and the runtime overhead ({_gib(runtime)}) "
                            f"exceed GPU_UTIL={knobs['GPU_UTIL']} of the {card.name}'s {_gib(card.memory_bytes)} "
                            f"({_gib(requested)}): use a bigger card or TP=2")
            return b
        if card.free_bytes is not None and card.free_bytes < requested:
            b.errors.append(f"the {card.name} has {_gib(card.free_bytes)} free, GPU_UTIL={knobs['GPU_UTIL']} asks "
                            f"for {_gib(requested)} (vLLM refuses to start): stop what else uses it (nvidia-smi) "
                            f"or set GPU_UTIL={card.free_bytes / card.memory_bytes * 0.99:.3f}")
            return b
    if knobs["SPEC"] == "dflash2" and not drafter_bytes(knobs, root):
        b.warnings.append(f"DRAFT_MODEL={knobs['DRAFT_MODEL']!r} is not there: the drafter's weights are not "
                          "counted (the pool is smaller by their size)")
    if not b.kv_bytes or b.kv_bytes <= 0:
        return b
    if kv_dtype.startswith("turboquant_") and not s.gdn_layers:
        # TurboQuantConfig.get_boundary_skip_layers (vllm/model_executor/layers/quantization/turboquant/config.py)
        # keeps a dense model's first and last 2 layers in the model's dtype, and
        # Platform._align_heterogeneous_kv_block_size then sizes one pool for two pages: not restated here.
        b.warnings.append(f"KV={kv_dtype!r} on a dense model: vLLM keeps its first and last 2 layers unquantized "
                          "and pads one pool for both pages, which the planner does not restate: the pool is not "
                          "predicted (a hybrid model has no such layers)")
        return b
    # BLOCK_SIZE=0 is vLLM's choice: 128 on its CPU platform (vllm/platforms/cpu.py), the backend's 16 on CUDA.
    requested_block = knobs["BLOCK_SIZE"] or (128 if platform == "cpu" else 0)
    p = pages.pool(s, kv_dtype, knobs["MAMBA_SSM_DTYPE"], b.kv_bytes, knobs["MAX_LEN"], requested_block,
                   bool(knobs["PREFIX_CACHE"]), num_spec(knobs), knobs["TP"], max_seqs=knobs["MAX_SEQS"])
    b.pool = p
    if kv_dtype == "kvarn":
        per = pages.tails_per_companion(s, kv_dtype, knobs["MAMBA_SSM_DTYPE"], knobs["TP"], num_spec(knobs))
        b.warnings.append(
            f"KV='kvarn' ({cards.data()['planned_kv']['kvarn']['status']}) packs {p.attn_token_bytes:,} B a token "
            f"and layer into whole {pages.kernel_block('kvarn')}-token groups and keeps each running sequence's newest "
            f"< {pages.kernel_block('kvarn')} tokens unpacked in companion state layers, {per} attention layers' "
            f"tails of {p.tail_layer_bytes:,} B each to a {p.page_bytes:,} B page: {p.tail_seat_bytes:,} B of the "
            f"pool a seat ({s.attention_layers} attention layers; docs/kvarn.md)")
    verdict(b, p, knobs, float(ov["warn_margin"]), float(ov["kv_mem_margin"]))
    return b


def more_kv(b: Budget, p: pages.Pool, knobs: dict[str, Any]) -> str:
    """How to give one MAX_LEN request its room: the KV_MEM that holds it, or what frees memory on a GPU."""
    blocks = 1 + p.state_blocks(knobs["MAX_LEN"]) + p.attention_groups * -(-knobs["MAX_LEN"] // p.block_size)
    if knobs["KV_MEM"]:
        return f"KV_MEM={p.kv_bytes_for(blocks)} (the {blocks} blocks it needs)"
    return f"free {_gib(p.kv_bytes_for(blocks) - b.kv_bytes)} more for the KV cache (GPU_UTIL, a bigger card)"


def verdict(b: Budget, p: pages.Pool, knobs: dict[str, Any], warn_margin: float, kv_margin: float) -> None:
    """Refusals (cannot start or cannot hold its own seats) and near-cliff warnings, each with the fix."""
    usable = p.blocks - 1  # block 0 is vLLM's null block
    b.max_len_fit = p.max_len_fit()
    b.short_seats = p.seats(1)
    b.seats_at_max_len = p.seats(knobs["MAX_LEN"])
    b.kv_mem_exact = p.kv_bytes_for(p.blocks)
    b.kv_mem_margin = p.kv_bytes_for(int(b.kv_mem_exact * (1 - kv_margin)) // p.block_bytes)
    seats, max_len = knobs["MAX_SEQS"], knobs["MAX_LEN"]
    if b.max_len_fit < max_len:
        b.errors.append(f"MAX_LEN={max_len}: the pool ({p.blocks} blocks of {p.block_size} tokens, "
                        f"{_gib(b.kv_bytes)}) holds at most {b.max_len_fit} tokens for one request beside its state; "
                        f"set MAX_LEN={b.max_len_fit} or less, or " + more_kv(b, p, knobs))
    state = p.state_blocks(1)  # what every running request holds before any attention block
    if seats * state > usable:
        b.errors.append(f"MAX_SEQS={seats}: the recurrent state of {seats} seats takes {seats * state} blocks, "
                        f"the pool has {usable} ({knobs['MAMBA_SSM_DTYPE']} state, {p.mamba_page_bytes:,} bytes "
                        f"a page): only {b.short_seats} requests can run; set MAX_SEQS={b.short_seats}"
                        + (" or MAMBA_SSM_DTYPE=float16" if knobs["MAMBA_SSM_DTYPE"] == "float32" else ""))
    elif b.short_seats < seats:
        tails = (f", {p.state_groups} of them state: the kvarn tail's {p.tail_seat_bytes:,} B among them"
                 if p.tail_seat_bytes else "")
        b.warnings.append(f"MAX_SEQS={seats}: only {b.short_seats} short requests fit the pool at once (each "
                          f"takes {state + p.attention_groups} blocks{tails}); the rest wait. "
                          f"MAX_SEQS={b.short_seats} fits")
    elif b.short_seats < seats * (1 + warn_margin):
        b.warnings.append(f"MAX_SEQS={seats} is within {warn_margin:.0%} of the {b.short_seats} short requests "
                          "the pool holds: a little less memory and requests wait")
    if not b.errors and b.max_len_fit < max_len * (1 + warn_margin):
        b.warnings.append(f"MAX_LEN={max_len} is within {warn_margin:.0%} of the {b.max_len_fit} tokens the pool "
                          f"holds for one request; MAX_LEN={int(b.max_len_fit / (1 + warn_margin))} leaves room")
