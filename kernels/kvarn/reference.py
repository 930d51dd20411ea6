"""KVarN cache format and math in plain torch: the reference the Triton kernels must match.

KVarN (arXiv 2606.03458) quantizes K and V without calibration: a normalized Hadamard rotation over
the channel axis spreads channel outliers over all channels, an iterative dual-scaling variance
normalization (per-token, then per-channel scales, a few rounds) evens out the magnitudes inside a
group of tokens, then round-to-nearest stores each value in a few bits. Written here from the
paper's description; no code was copied.

The format is fixed for this model's attention layers (4 KV heads x head_dim 256): K at 4 bits and
V at 2 bits, groups of 128 tokens. Per group and per tensor (K or V) it stores, in this order:

* ``codes``: uint8, [token, head, dim * bits / 8], token-major (one token's bytes are contiguous,
  so a token is written in one place). 4-bit: channel 2i in the low nibble of byte i, 2i+1 in the
  high nibble. 2-bit: channel 4i+j in bits 2j..2j+1 of byte i (channel 4i in the lowest crumb).
* ``token_scale``: float16, [token, head]: the RTN step, the token's normalization folded in.
* ``token_offset``: float16, [token, head]: the value code 0 stands for (asymmetric RTN).
* ``channel_scale``: float16, [head, dim]: the product of the per-channel normalization scales.

Decoding one value: ``x_rot[t, h, c] = (code * token_scale[t, h] + token_offset[t, h]) *
channel_scale[h, c]``, then ``x = x_rot @ H`` (H is symmetric and orthonormal: its own inverse).
fp16 numbers are little-endian. This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_TOKENS = 128
"""Tokens that share channel scales: the method's group (the paper's 128)."""
KV_HEADS = 4
HEAD_DIM = 256
K_BITS = 4
V_BITS = 2
NORM_ITERS = 3
"""Rounds of (per-token, per-channel) normalization; scales change little after the second."""
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2
CODE_DTYPE = torch.uint8
TINY = 1e-8
"""Floor of a normalization scale, so an all-zero token or channel is not divided by zero."""
CHANNEL_RANGE = (2.0 ** -14, 2.0 ** 15)
"""Channel scales are clamped to float16's normal range: a dead channel (RMS 0) is stored as 2^-14, not 0."""

FORMAT_BUDGET = 840
"""Bytes per token per layer the issue allows (fp8 is 2,048)."""


@dataclass(frozen=True)
class Field:
    """One stored array of a group of one tensor (K or V): what it is per, its dtype and bytes per group."""

    name: str
    per: str
    dtype: str
    group_bytes: int


def layout(bits: int, heads: int = KV_HEADS, dim: int = HEAD_DIM, group: int = GROUP_TOKENS) -> tuple[Field, ...]:
    """The arrays one group of one tensor stores, in stored order (the byte count follows from this alone)."""
    _check_bits(bits)
    return (
        Field("codes", "token x head x channel", f"u{bits} packed in uint8", group * heads * dim * bits // 8),
        Field("token_scale", "token x head", "float16", group * heads * SCALE_BYTES),
        Field("token_offset", "token x head", "float16", group * heads * SCALE_BYTES),
        Field("channel_scale", "head x channel (per group)", "float16", heads * dim * SCALE_BYTES),
    )


def group_bytes(bits: int, heads: int = KV_HEADS, dim: int = HEAD_DIM, group: int = GROUP_TOKENS) -> int:
    """Bytes one group of one tensor takes."""
    return sum(f.group_bytes for f in layout(bits, heads, dim, group))


def token_bytes(heads: int = KV_HEADS, dim: int = HEAD_DIM, group: int = GROUP_TOKENS) -> float:
    """Bytes per token per attention layer, K and V together (the figure the capacity planner uses)."""
    return (group_bytes(K_BITS, heads, dim, group) + group_bytes(V_BITS, heads, dim, group)) / group


def tail_bytes(heads: int = KV_HEADS, dim: int = HEAD_DIM, value_bytes: int = 2, group: int = GROUP_TOKENS) -> int:
    """Bytes of one sequence's unquantized tail in one attention layer, K and V, ``value_bytes`` a value.

    A group's channel scales need all of its tokens, so the newest < ``group`` tokens of a sequence
    cannot be packed yet: the kernels keep a whole group of them per sequence in the model's dtype
    (fp16 or bf16: 2 bytes), however long the sequence is. The kernels' buffers and the capacity
    planner's per-seat figure both come from here.
    """
    return 2 * group * heads * dim * value_bytes


def _check_bits(bits: int) -> None:
    if bits not in (2, 4):
        raise ValueError(f"bits={bits}: the KVarN format packs 2- or 4-bit codes only")


def hadamard(n: int) -> torch.Tensor:
    """The normalized n x n Hadamard matrix (Sylvester): symmetric and orthonormal, so H @ H = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"head_dim={n}: the Hadamard rotation needs a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(torch.float32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [..., dim] -> uint8 [..., dim * bits / 8]; lower channel in the lower bits."""
    _check_bits(bits)
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"last axis {codes.shape[-1]} is not a multiple of {per} ({bits}-bit codes per byte)")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"codes outside 0..{(1 << bits) - 1} cannot be packed at {bits} bits")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(CODE_DTYPE)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., n] -> integer codes [..., n * 8 / bits] (int64), the inverse of pack_codes."""
    _check_bits(bits)
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    c = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], -1)


@dataclass(frozen=True)
class Packed:
    """One quantized group of one tensor: the four stored arrays plus what the reader must know."""

    bits: int
    rotated: bool
    codes: torch.Tensor
    token_scale: torch.Tensor
    token_offset: torch.Tensor
    channel_scale: torch.Tensor

    def to_tensor(self) -> torch.Tensor:
        """The group's bytes in the stored order (codes, token_scale, token_offset, channel_scale), uint8 [n]."""
        parts = [self.codes, self.token_scale, self.token_offset, self.channel_scale]
        return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])

    def to_bytes(self) -> bytes:
        """The group's bytes in the stored order, as ``bytes``."""
        return self.to_tensor().cpu().numpy().tobytes()


def from_tensor(buf: torch.Tensor, bits: int, rotated: bool = True, heads: int = KV_HEADS, dim: int = HEAD_DIM,
                group: int = GROUP_TOKENS) -> Packed:
    """A group read back from its stored bytes (uint8 [group_bytes]): the inverse of ``Packed.to_tensor``.

    How a reader that holds only the cache's bytes (vLLM's pages) gets the arrays back; the views
    share ``buf``'s memory.
    """
    sizes = [f.group_bytes for f in layout(bits, heads, dim, group)]
    if buf.dtype != CODE_DTYPE or buf.numel() != sum(sizes):
        raise ValueError(f"a {bits}-bit group of {group} tokens x {heads} heads x {dim} is {sum(sizes)} uint8 "
                         f"bytes; got {buf.numel()} of {buf.dtype}")
    codes, ts, to, cs = buf.reshape(-1).split(sizes)
    return Packed(bits, rotated, codes.view(group, heads, dim * bits // 8), ts.view(SCALE_DTYPE).view(group, heads),
                  to.view(SCALE_DTYPE).view(group, heads), cs.view(SCALE_DTYPE).view(heads, dim))


def page_bytes(heads: int = KV_HEADS, dim: int = HEAD_DIM, group: int = GROUP_TOKENS) -> int:
    """Bytes of one cache page: one group's K (4-bit) then its V (2-bit), for ``heads`` KV heads."""
    return group_bytes(K_BITS, heads, dim, group) + group_bytes(V_BITS, heads, dim, group)


def head_token_bytes(dim: int = HEAD_DIM, group: int = GROUP_TOKENS) -> int:
    """Packed bytes of one token of one KV head, K and V with their scales: a one-head page over its tokens.

    The per-group channel scales are spread over the group's tokens; vLLM's page arithmetic (the
    backend's spec, the capacity planner) needs a whole number of bytes per head and token, so a
    ``dim`` whose share is fractional is refused.
    """
    total = page_bytes(1, dim, group)
    if total % group:
        raise ValueError(f"head_dim={dim}: a KVarN group of one head takes {total} B, not a whole number of bytes "
                         f"for each of its {group} tokens (a head_dim that is a multiple of 32 is)")
    return total // group


def write_page(page: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotate: bool = True,
               normalize: bool = True) -> None:
    """Quantize one whole group k, v [group, heads, dim] into ``page`` (uint8 [page_bytes]), K then V."""
    kq, vq = quantize(k, K_BITS, rotate, normalize), quantize(v, V_BITS, rotate, normalize)
    page.copy_(torch.cat([kq.to_tensor(), vq.to_tensor()]).to(page.device))


def read_page(page: torch.Tensor, heads: int = KV_HEADS, dim: int = HEAD_DIM, group: int = GROUP_TOKENS,
              rotated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one page (uint8 [page_bytes]) dequantized, float32 [group, heads, dim] each."""
    nk = group_bytes(K_BITS, heads, dim, group)
    buf = page.reshape(-1).cpu()
    return (dequantize(from_tensor(buf[:nk], K_BITS, rotated, heads, dim, group)),
            dequantize(from_tensor(buf[nk:], V_BITS, rotated, heads, dim, group)))


def dual_normalize(x: torch.Tensor, iters: int = NORM_ITERS) -> torch.Tensor:
    """Channel scales [head, dim] from alternating per-token and per-channel RMS normalization of x [T, H, D].

    Second moments (RMS), not centered variances: the RTN offset takes a token's mean, and a
    channel with a large mean and little spread would be blown up by dividing by its std. The
    per-token factors are not returned: the per-token RTN step is scale-equivariant and absorbs them.
    """
    y = x.to(torch.float32)
    channel = torch.ones(x.shape[1], x.shape[2], dtype=torch.float32)
    for _ in range(iters):
        y = y / y.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(TINY)
        c = y.pow(2).mean(0).sqrt().clamp_min(TINY)
        y = y / c
        channel = channel * c
    return channel


def quantize(x: torch.Tensor, bits: int, rotate: bool = True, normalize: bool = True) -> Packed:
    """Quantize one group x [tokens, heads, dim] to ``bits``; rotate=normalize=False is plain per-token RTN.

    Stored scales are rounded to float16 before the codes are computed, so the codes are exact
    against what is stored and a kernel that does the same arithmetic gets the same codes.
    """
    _check_bits(bits)
    if x.dim() != 3:
        raise ValueError(f"a group is [tokens, heads, dim]; got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("the group has inf or nan values: it cannot be quantized")
    y = x.to(torch.float32)
    if rotate:
        y = y @ hadamard(y.shape[-1])
    channel = dual_normalize(y) if normalize else torch.ones(y.shape[1], y.shape[2])
    channel = channel.clamp(*CHANNEL_RANGE).to(SCALE_DTYPE)
    y = y / channel.to(torch.float32)
    lo, hi = y.amin(-1), y.amax(-1)
    step = ((hi - lo) / ((1 << bits) - 1)).to(SCALE_DTYPE)
    step = torch.where(step > 0, step, torch.ones_like(step))
    offset = lo.to(SCALE_DTYPE)
    q = torch.round((y - offset.to(torch.float32)[..., None]) / step.to(torch.float32)[..., None])
    q = q.clamp(0, (1 << bits) - 1)
    return Packed(bits, rotate, pack_codes(q, bits), step, offset, channel)


def dequantize(p: Packed) -> torch.Tensor:
    """The group back as float32 [tokens, heads, dim]."""
    q = unpack_codes(p.codes, p.bits).to(torch.float32)
    y = q * p.token_scale.to(torch.float32)[..., None] + p.token_offset.to(torch.float32)[..., None]
    y = y * p.channel_scale.to(torch.float32)
    return y @ hadamard(y.shape[-1]) if p.rotated else y


def roundtrip_cache(x: torch.Tensor, bits: int, rotate: bool = True, normalize: bool = True) -> torch.Tensor:
    """A whole cache [length, heads, dim] through quantize/dequantize, group by group (length % 128 == 0)."""
    if x.shape[0] % GROUP_TOKENS:
        raise ValueError(f"length {x.shape[0]} is not a multiple of the {GROUP_TOKENS}-token group")
    groups = x.split(GROUP_TOKENS, 0)
    return torch.cat([dequantize(quantize(g, bits, rotate, normalize)) for g in groups], 0)


def cached_context(x: torch.Tensor, bits: int, rotate: bool = True, normalize: bool = True) -> torch.Tensor:
    """What a paged KVarN cache holds for ``x`` [length, heads, dim], in float32: its whole groups through
    quantize/dequantize, the newest ``length % GROUP_TOKENS`` tokens (the unquantized tail) as they are.

    The context the kernels' prefill and decode attend over, so the tests build their expected outputs from it.
    """
    n = x.shape[0] // GROUP_TOKENS * GROUP_TOKENS
    x = x.to(torch.float32)
    return torch.cat([roundtrip_cache(x[:n], bits, rotate, normalize), x[n:]]) if n else x


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for queries q [n, q_heads, d] over a cache k, v [L, kv_heads, d] (GQA)."""
    rep = q.shape[1] // k.shape[1]
    kk = k.to(torch.float32).repeat_interleave(rep, 1)
    vv = v.to(torch.float32).repeat_interleave(rep, 1)
    logits = torch.einsum("nhd,lhd->hnl", q.to(torch.float32), kk) / q.shape[-1] ** 0.5
    return torch.einsum("hnl,lhd->nhd", logits.softmax(-1), vv)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """A step's n new queries q [n, q_heads, d] (positions ctx..ctx+n-1) over k, v [>= ctx + n, kv_heads, d]:
    query i sees keys 0..ctx+i (what an engine step computes for a chunk or a decode token)."""
    return torch.cat([attention(q[i:i + 1], k[:ctx + i + 1], v[:ctx + i + 1]) for i in range(q.shape[0])])


def synthetic(length: int, seed: int, queries: int = 4, q_heads: int = 24,
              outliers: bool = True) -> tuple[torch.Tensor, ...]:
    """Real-shaped q, K, V with what KVarN exists for: a few hot channels and a few outlier-scale tokens.

    K: Gaussian, 4 channels per head scaled by 8-16 (persistent channel outliers) and a per-channel
    offset; V: Gaussian with milder hot channels; 1 token in 128 scaled by 6-10 in K and V.
    ``outliers=False``: plain Gaussian q, K, V (where the method has nothing to fix).
    """
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(length, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(length, KV_HEADS, HEAD_DIM, generator=g)
    if not outliers:
        return torch.randn(queries, q_heads, HEAD_DIM, generator=g), k, v
    k = k + 0.5 * torch.randn(1, KV_HEADS, HEAD_DIM, generator=g)
    for h in range(KV_HEADS):
        hot = torch.randperm(HEAD_DIM, generator=g)[:4]
        k[:, h, hot] *= 8 + 8 * torch.rand(4, generator=g)
        v[:, h, hot[:2]] *= 3
    tokens = torch.randperm(length, generator=g)[: max(1, length // 128)]
    k[tokens] *= (6 + 4 * torch.rand(len(tokens), 1, 1, generator=g))
    v[tokens] *= (6 + 4 * torch.rand(len(tokens), 1, 1, generator=g))
    q = torch.randn(queries, q_heads, HEAD_DIM, generator=g)
    return q, k, v


def errors(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Relative L2 error and cosine similarity of got against ref (flattened)."""
    a, b = ref.flatten().to(torch.float64), got.flatten().to(torch.float64)
    return float((b - a).norm() / a.norm()), float(torch.nn.functional.cosine_similarity(a, b, 0))
