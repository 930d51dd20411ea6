"""A plan's capacity report: shape, weights, state, KV bytes per dtype, pool, seats, roofline, verdict.

The one entry point `inv plan` and `serve`'s preflight share (``for_plan``); rendering is separate
(``render`` for people, ``to_json`` for tools). Data flows one way: a resolved Plan in, numbers out.
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rig import paths
from rig.capacity import budget, cards, pages, roofline, shape, weights
from rig.plan import Plan

GIB = 2**30


@dataclass
class Report:
    profile: str
    platform: str
    model_source: str
    card: cards.Card | None
    knobs: dict[str, Any]
    weights: weights.Weights
    state: dict[str, int]
    state_per_seat: int
    state_per_draft_token: int
    kv_token_bytes: dict[str, int]
    budget: budget.Budget
    roofline: roofline.Roofline | None

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "platform": self.platform, "model_source": self.model_source,
                "card": asdict(self.card) if self.card else None,
                "knobs": {k: self.knobs[k] for k in ("KV", "MAMBA_SSM_DTYPE", "MAX_SEQS", "MAX_LEN", "GPU_UTIL",
                                                     "KV_MEM", "BLOCK_SIZE", "PREFIX_CACHE", "SPEC", "SPEC_K",
                                                     "TP", "PP")},
                "weights": {**asdict(self.weights), "loaded": self.budget.weights_bytes,
                            "checkpoint": self.weights.checkpoint},
                "state_per_layer": self.state, "state_per_seat": self.state_per_seat,
                "state_per_draft_token": self.state_per_draft_token,
                "kv_bytes_per_token_per_layer": self.kv_token_bytes, "budget": self.budget.to_dict(),
                "roofline": asdict(self.roofline) if self.roofline else None}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def model_folder(plan: Plan) -> Path:
    folder = Path(plan.model)
    return folder if folder.is_absolute() else paths.ROOT / folder


def kv_table(s: shape.Shape, tp: int) -> dict[str, int]:
    """Bytes per token per attention layer for every cache dtype vLLM 0.28 has and rig plans (kvarn planned:
    its packed pages, from kernels/kvarn's layout; its per-seat tail is the pool's, not a per-token figure)."""
    table = {d: pages.attention_token_bytes(s, d, tp) for d in pages.KV_DTYPES}
    table["kvarn"] = pages.attention_token_bytes(s, "kvarn", tp)
    return table


def step_tokens(argv: list[str]) -> int:
    """The plan's --max-num-batched-tokens (0 when vLLM's default applies), read from its command line."""
    flag = "--max-num-batched-tokens"
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith(flag + "="):
            return int(a.split("=", 1)[1])
    return 0


def for_plan(plan: Plan, card: cards.Card | None, context: int | None = None) -> Report:
    """Everything the planner predicts for a resolved plan on ``card`` (None: the cpu platform)."""
    k = plan.knobs
    s = shape.for_model(k["MODEL"], model_folder(plan))
    if plan.platform == "cpu":
        card = None
    elif card is not None and k.get("GPU_MEM"):  # plan for GPU_MEM bytes of it (the gpu24 overlay), as serve does
        card = dataclasses.replace(card, name=f"{card.name} as {k['GPU_MEM'] / 2**30:g} GiB (GPU_MEM)",
                                   memory_bytes=min(k["GPU_MEM"], card.memory_bytes),
                                   free_bytes=None if card.free_bytes is None else min(card.free_bytes, k["GPU_MEM"]))
    spec = budget.num_spec(k)
    st = pages.state_bytes(s, k["MAMBA_SSM_DTYPE"], k["TP"], spec)
    per_seat = sum(st.values()) * s.gdn_layers
    base = pages.state_bytes(s, k["MAMBA_SSM_DTYPE"], k["TP"], 0)
    one_more = pages.state_bytes(s, k["MAMBA_SSM_DTYPE"], k["TP"], 1)
    per_draft = (one_more["conv"] - base["conv"]) * s.gdn_layers + pages.mamba_page_bytes(
        s, k["MAMBA_SSM_DTYPE"], k["TP"], 1) * s.gdn_layers  # a conv row + a state block per group's layers
    b = budget.plan_budget(k, plan.platform, s, card, paths.ROOT, step_tokens(plan.argv))
    w = weights.count(s)
    kvt = kv_table(s, k["TP"])
    roof = None
    if card is not None and card.bandwidth_gbs and card.fp16_tflops and b.pool is not None and k["KV"] != "kvarn":
        ctx = context or min(k["MAX_LEN"], 4096)
        seats = max(1, min(k["MAX_SEQS"], b.pool.seats(ctx)))
        kv_tok = b.pool.attn_token_bytes * s.attention_layers
        read = roofline.decode_weight_bytes(b.weights_bytes, w, s, seats, k["TP"] * k["PP"])
        roof = roofline.bounds(s, read, per_seat, kv_tok, seats, ctx, card.bandwidth_gbs,
                               card.fp16_tflops, card.int8_tops, k["INT8_ACT"], k["INT8_LAYERS"])
    return Report(plan.profile, plan.platform, s.source, card, k, w, st, per_seat, per_draft, kvt,
                  b, roof)


def _n(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def _g(x: int | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f} GiB"


def render(r: Report, width: int = 110) -> str:
    """The table for people (deterministic: fixed width, no colour)."""
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None, force_terminal=False)
    b, k = r.budget, r.knobs
    where = r.card.name if r.card else "vLLM's CPU backend"
    con.print(f"plan {r.profile} on {where} ({r.platform}); shape: {r.model_source}")
    t = Table("", "value", "", box=None, pad_edge=False)
    t.add_row("weights loaded", _g(b.weights_bytes), f"checkpoint {_g(r.weights.checkpoint)} (MTP "
              f"{_g(r.weights.mtp)}, embeddings + lm_head {_g(r.weights.embeddings + r.weights.lm_head)})")
    t.add_row("GDN state / seat", f"{r.state_per_seat:,} B",
              f"{k['MAMBA_SSM_DTYPE']} recurrent {r.state['recurrent']:,} + conv {r.state['conv']:,} B a layer; "
              f"+ {r.state_per_draft_token:,} B a draft token")
    kv_now = b.pool.attn_token_bytes if b.pool else r.kv_token_bytes.get(k["KV"], 0)
    t.add_row("KV / token / layer", f"{kv_now:,} B",
              ", ".join(f"{d} {v:,}" for d, v in r.kv_token_bytes.items()))
    if b.total_bytes:
        t.add_row("memory", _g(b.requested_bytes), f"GPU_UTIL {k['GPU_UTIL']} x {_g(b.total_bytes)}; runtime "
                  f"{_g(b.runtime_bytes)} (calibrated); prefix cache {_g(b.prefix_cache_bytes)}")
    t.add_row("KV cache", _g(b.kv_bytes), f"from {b.kv_source}")
    p = b.pool
    if p:
        match = f"; prefix-cache hits in multiples of {p.match_unit} tokens" if p.match_unit else ""
        t.add_row("block / page", f"{p.block_size} tokens", f"page {p.page_bytes:,} B (mamba {p.mamba_page_bytes:,} B, "
                  f"padded {p.padding:.2%}); {p.groups} groups of {p.layers_per_group} layers{match}")
        t.add_row("pool", f"{p.reported_tokens:,} tokens", f"{p.blocks} blocks; max concurrency at MAX_LEN "
                  f"{k['MAX_LEN']:,}: {p.max_concurrency:.2f}x")
        if p.tail_seat_bytes:
            t.add_row("kvarn tail", f"{p.tail_seat_bytes:,} B / seat", f"newest < {pages.kernel_block('kvarn')} "
                      f"tokens unpacked, {p.tail_layer_bytes:,} B a layer, in companion state layers' padded "
                      f"pages; {k['MAX_SEQS']} seats: {_g(p.tail_seat_bytes * k['MAX_SEQS'])} of the pool")
        t.add_row("seats", f"{b.short_seats} short", f"{b.seats_at_max_len} at MAX_LEN; MAX_SEQS {k['MAX_SEQS']}; "
                  f"longest request {_n(b.max_len_fit)} tokens")
        t.add_row("KV_MEM", _n(b.kv_mem_exact), f"reproduces this pool; {_n(b.kv_mem_margin)} keeps a "
                  f"{cards.overheads()['kv_mem_margin']:.0%} margin")
    if r.roofline:
        f = r.roofline
        other = (f"compute {f.decode_compute_tok_s:,.0f}" if f.decode_limit == "memory"
                 else f"memory {f.decode_memory_tok_s:,.0f}")
        t.add_row("decode bound", f"{f.decode_tok_s:,.0f} tok/s", f"{f.seats} seats at {f.context:,} tokens, "
                  f"{f.decode_limit}-bound ({f.step_bytes / GIB:.2f} GiB a step; {other} tok/s); one seat "
                  f"{f.decode_tok_s_one:,.0f} tok/s")
        t.add_row("prefill bound", f"{f.prefill_tok_s:,.0f} tok/s", f"{f.prefill_flops_per_token / 1e9:.1f} GFLOP a "
                  f"token; all-fp16 path {f.prefill_tok_s_fp16:,.0f} tok/s")
    con.print(t)
    for e in b.errors:
        con.print(f"refused: {e}", soft_wrap=True)
    for w in b.warnings:
        con.print(f"warning: {w}", soft_wrap=True)
    return buf.getvalue()
