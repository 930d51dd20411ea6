"""Upper bounds on speed from bytes and FLOPs: what the card cannot beat, not what it will reach.

A decode step moves bytes and does FLOPs: it reads every weight once, reads and writes each seat's
GDN state, and reads each seat's KV (tokens/s <= seats x bandwidth / bytes per step), and it runs
every seat's token through the linears and attention (tokens/s <= tensor-core rate / FLOPs per
token, the rate prefill has too). The bound is the lower of the two, and which one it is matters:
at 64 seats the RTX 3090's fp16 tensor cores (71 TFLOP/s with fp32 accumulation) bind before its
936 GB/s do, so int8 activations (4x the rate) raise its decode bound, while an H200's 989 TFLOP/s
leave decode memory-bound and int8 cannot (docs/gpu.md, the ladder on an H200). Prefill is
compute-bound: 2 FLOPs per weight per token, plus attention's QK^T and PV over the context, with
the int8 (W4A8 Marlin) layers at the int8 rate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rig.capacity import weights
from rig.capacity.shape import Shape
from rig.knobs import INT8_LAYER_ALIASES


@dataclass(frozen=True)
class Roofline:
    seats: int
    context: int
    step_bytes: int
    decode_tok_s: float          # the lower of the two below
    decode_tok_s_one: float
    decode_memory_tok_s: float   # seats x bandwidth / step bytes
    decode_compute_tok_s: float  # tensor-core rate / FLOPs per token (the prefill bound at this context)
    decode_limit: str            # "memory" or "compute": which one binds
    prefill_flops_per_token: float
    prefill_tok_s: float
    prefill_tok_s_fp16: float


def decode_weight_bytes(loaded_bytes: int, w: weights.Weights, s: Shape, seats: int, tp_pp: int = 1) -> int:
    """Weight bytes one decode step reads: every loaded weight but the input embedding table, of which
    a step reads only its seats' rows (a tied table is read whole, as the lm_head)."""
    if s.config.get("tie_word_embeddings"):
        return loaded_bytes
    row = s.hidden_size * s.dtype_bytes
    return loaded_bytes - w.embeddings // tp_pp + seats * row


def step_bytes(weight_bytes: int, state_per_seat: int, kv_token_bytes: int, seats: int, context: int) -> int:
    """Bytes one decode step moves: weights once, each seat's state read + written, each seat's KV read."""
    return weight_bytes + seats * (2 * state_per_seat + context * kv_token_bytes)


def linear_flops(s: Shape, int8_regex: str | None) -> tuple[float, float]:
    """(fp16, int8) FLOPs per token of the decoder's linears (lm_head once per sequence: left out)."""
    fp16 = int8 = 0.0
    for i, kind in enumerate(s.layer_types):
        for name, (n_in, n_out) in weights.layer_linears(s, kind).items():
            f = 2.0 * n_in * n_out
            if int8_regex is not None and re.search(int8_regex, f"model.layers.{i}.{name}"):
                int8 += f
            else:
                fp16 += f
    return fp16, int8


def attention_flops(s: Shape, context: int) -> float:
    """QK^T and PV per token at the average position of a ``context``-token prompt, over the attention
    layers, plus the GDN state update (a head_k x head_v outer product and read per value head)."""
    attn = 4.0 * s.num_attention_heads * s.head_dim * (context / 2) * s.attention_layers
    gdn = 4.0 * s.linear_num_value_heads * s.linear_key_head_dim * s.linear_value_head_dim * s.gdn_layers \
        if s.gdn_layers else 0.0
    return attn + gdn


def bounds(s: Shape, weight_bytes: int, state_per_seat: int, kv_token_bytes: int, seats: int, context: int,
           bandwidth_gbs: float, fp16_tflops: float, int8_tops: float | None, int8_act: str,
           int8_layers: str) -> Roofline:
    """Decode at ``seats`` requests of ``context`` tokens and at one, each the lower of its memory and compute
    bounds; prefill of a ``context``-token prompt."""
    bw = bandwidth_gbs * 1e9
    sb = step_bytes(weight_bytes, state_per_seat, kv_token_bytes, seats, context)
    one = step_bytes(weight_bytes, state_per_seat, kv_token_bytes, 1, context)
    regex = INT8_LAYER_ALIASES.get(int8_layers, int8_layers) if int8_act == "int8" and int8_tops else None
    f16, i8 = linear_flops(s, regex)
    att = attention_flops(s, context)
    t = (f16 + att) / (fp16_tflops * 1e12) + (i8 / (int8_tops * 1e12) if i8 else 0.0)
    t16 = (f16 + i8 + att) / (fp16_tflops * 1e12)
    memory, compute = seats * bw / sb, 1 / t
    return Roofline(seats=seats, context=context, step_bytes=sb, decode_tok_s=min(memory, compute),
                    decode_tok_s_one=min(bw / one, compute), decode_memory_tok_s=memory,
                    decode_compute_tok_s=compute, decode_limit="memory" if memory <= compute else "compute",
                    prefill_flops_per_token=f16 + i8 + att, prefill_tok_s=1 / t, prefill_tok_s_fp16=1 / t16)
