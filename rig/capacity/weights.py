"""Weight bytes from a model's shape: what vLLM holds on the device, and what the checkpoint holds.

Counted linear by linear, because W4A16 is not uniform: the 64 decoder blocks' linears are int4
with an fp16 scale per group of 128 inputs (Marlin drops the symmetric checkpoint's zero points
after loading), while the embeddings, lm_head, the MTP layer and the GDN ``in_proj_a``/``in_proj_b``
stay 16-bit. The MTP layer is loaded only when SPEC=mtp (vLLM skips its weights otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from rig.capacity.shape import Quant, Shape

SCALE_BYTES = 2  # fp16 group scales


@dataclass(frozen=True)
class Weights:
    """Device bytes by part; ``mtp`` counts only when the plan loads the MTP head."""

    quantized: int
    scales: int
    dense: int
    embeddings: int
    lm_head: int
    mtp: int

    def loaded(self, with_mtp: bool) -> int:
        parts = self.quantized + self.scales + self.dense + self.embeddings + self.lm_head
        return parts + (self.mtp if with_mtp else 0)

    @property
    def checkpoint(self) -> int:
        return self.loaded(with_mtp=True)


def attention_linears(s: Shape) -> dict[str, tuple[int, int]]:
    """(in, out) of one gated full-attention layer: q carries the output gate (2x), as Qwen3-Next's."""
    q = s.num_attention_heads * s.head_dim
    kv = s.num_key_value_heads * s.head_dim
    return {"self_attn.q_proj": (s.hidden_size, 2 * q), "self_attn.k_proj": (s.hidden_size, kv),
            "self_attn.v_proj": (s.hidden_size, kv), "self_attn.o_proj": (q, s.hidden_size)}


def gdn_linears(s: Shape) -> dict[str, tuple[int, int]]:
    """(in, out) of one Gated DeltaNet layer's linears."""
    key = s.linear_num_key_heads * s.linear_key_head_dim
    value = s.linear_num_value_heads * s.linear_value_head_dim
    return {"linear_attn.in_proj_qkvz": (s.hidden_size, 2 * key + 2 * value),
            "linear_attn.in_proj_a": (s.hidden_size, s.linear_num_value_heads),
            "linear_attn.in_proj_b": (s.hidden_size, s.linear_num_value_heads),
            "linear_attn.out_proj": (value, s.hidden_size)}


def mlp_linears(s: Shape) -> dict[str, tuple[int, int]]:
    return {"mlp.gate_proj": (s.hidden_size, s.intermediate_size), "mlp.up_proj": (s.hidden_size, s.intermediate_size),
            "mlp.down_proj": (s.intermediate_size, s.hidden_size)}


def gdn_small(s: Shape) -> int:
    """Parameters of a GDN layer that are not linears: the causal conv, A_log, dt_bias, the gated norm."""
    conv_dim = 2 * s.linear_num_key_heads * s.linear_key_head_dim + s.linear_num_value_heads * s.linear_value_head_dim
    return conv_dim * s.linear_conv_kernel_dim + 2 * s.linear_num_value_heads + s.linear_value_head_dim


def layer_linears(s: Shape, kind: str) -> dict[str, tuple[int, int]]:
    mixer = attention_linears(s) if kind == "full_attention" else gdn_linears(s)
    return {**mixer, **mlp_linears(s)}


def _quantized(q: Quant | None, name: str) -> bool:
    return q is not None and not any(k in name for k in q.keep_16bit)


def count(s: Shape) -> Weights:
    """Bytes of every part of the model (see the module doc for what is quantized)."""
    q, b = s.quant, s.dtype_bytes
    quantized = scales = dense = 0
    for kind in s.layer_types:
        for name, (n_in, n_out) in layer_linears(s, kind).items():
            if _quantized(q, name):
                quantized += n_in * n_out * q.bits // 8
                scales += (n_in // q.group_size) * n_out * SCALE_BYTES
            else:
                dense += n_in * n_out * b
        dense += (2 * s.hidden_size + (gdn_small(s) if kind == "linear_attention" else 0)) * b
    dense += s.hidden_size * b  # final norm
    embeddings = s.vocab_size * s.hidden_size * b
    lm_head = 0 if s.config.get("tie_word_embeddings") else embeddings
    mtp_layer = sum(i * o for i, o in layer_linears(s, "full_attention").values()) + 4 * s.hidden_size
    mtp = s.config.get("mtp_num_hidden_layers", 0) * (mtp_layer + 2 * s.hidden_size * s.hidden_size) * b
    return Weights(quantized=quantized, scales=scales, dense=dense, embeddings=embeddings, lm_head=lm_head, mtp=mtp)
