"""The int8-QK prefill attention's specification in plain torch: the pre-pass and two references.

Three things live here, and this module imports nothing but torch (CPU CI runs it without
triton, and the CUDA pre-pass ``smooth_quant.cu`` is checked against it):

- ``smooth_quant``: the pre-pass, defined to the bit. The CUDA kernel must produce identical
  bytes, so every fp32 operation is spelled out in the order it happens (a sum in another order
  rounds differently, and one ulp of a mean can move a value across a rounding midpoint);
- ``attention_ref``: exact causal attention in fp32 from the unquantized inputs (the yardstick
  of the kernel's accuracy tests), chunked so that 65,536 tokens fit in memory;
- ``attention_int8_ref``: what the Triton kernel computes, in torch (int8 scores, P rounded to
  v's dtype, fp32 accumulation): the numerical design can be checked on a CPU.

Tensors are packed variable-length sequences as vLLM's prefill passes them: ``q`` [T, Hq, D],
``k``/``v`` [T, Hkv, D], ``cu_seqlens`` int32 [B+1] = (0, len0, len0+len1, ...), causal within
each sequence, query head h reading kv head h // (Hq // Hkv).

The pre-pass, exactly (x is fp32 throughout; "/" is IEEE division, never a reciprocal multiply):

1. blocks: each sequence is cut into blocks of ``block`` consecutive tokens from its first token
   (the last block may be short); blocks never straddle two sequences;
2. K's mean per (sequence, kv head, channel): within each block, a running fp32 sum over the
   block's tokens in token order starting from +0.0; then a running fp32 sum of the block sums
   in block order starting from +0.0; then that total / float(length);
3. ``ks = float(k) - mean`` (softmax is invariant to it: q·(k−m) shifts a query's whole row of
   scores by one constant, so only the quantization grid changes — outlier channels shared by
   all tokens stop stretching it);
4. per (block, head): ``amax = max |x|`` over the block's tokens × D (x = float(q) or ks);
   ``scale = max(amax, float32(1e-6)) / 127``; ``x_i8 = clamp(rint(x / scale), -127, 127)``
   with rint rounding half to even; every token carries its block's scale.
"""

from __future__ import annotations

import math

import torch

QUANT_BLOCK = 64
"""Tokens per quantization block (the pre-pass's ``block``); the one place its default lives."""

SCALE_FLOOR = 1e-6
"""Smallest absmax a block's scale is computed from (an all-zero block must not divide by 0)."""

INT8_MAX = 127
"""Symmetric int8 range: -127..127 (−128 is never produced, so negation stays exact)."""


def check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cu_seqlens: torch.Tensor,
                 max_seqlen: int) -> None:
    """Refuse malformed packed inputs with an error that names the tensor and what is wrong.

    Checked here, once, because a wrong shape inside a kernel reads out of bounds instead of
    failing; the values of ``cu_seqlens`` are not read (that would synchronise with the GPU).
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [tokens, heads, head_dim]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} must have q's tokens and head_dim (q {tuple(q.shape)})")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 [batch+1]; got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if int(max_seqlen) < 1:
        raise ValueError(f"max_seqlen must be >= 1; got {max_seqlen}")
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must share one device")


def _lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence lengths (int64) from the cumulative offsets."""
    cu = cu_seqlens.long()
    return cu[1:] - cu[:-1]


def _token_blocks(cu_seqlens: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """Where each token sits: its sequence, its global block (blocks restart at each sequence's
    start) and its slot inside that block; plus each block's sequence and position in it.

    Everything else in the pre-pass is indexed by these, so the block rule is written once.
    """
    lens = _lengths(cu_seqlens)
    dev = cu_seqlens.device
    nblk = (lens + block - 1) // block
    first_blk = torch.cumsum(nblk, 0) - nblk
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens)
    pos = torch.arange(seq.numel(), device=dev) - cu_seqlens.long()[:-1][seq]
    blk_seq = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), nblk)
    blk_pos = torch.arange(blk_seq.numel(), device=dev) - first_blk[blk_seq]
    return {"lens": lens, "nblk": nblk, "seq": seq, "block": first_blk[seq] + pos // block,
            "slot": pos % block, "blk_seq": blk_seq, "blk_pos": blk_pos}


def _ordered_sum(padded: torch.Tensor) -> torch.Tensor:
    """fp32 running sum over dim 1 in index order from +0.0 (zero padding adds nothing).

    A loop, not ``sum``: torch's reductions pick their own order, and the CUDA pre-pass must be
    able to reproduce this one exactly.
    """
    acc = torch.zeros_like(padded[:, 0])
    for j in range(padded.shape[1]):
        acc = acc + padded[:, j]
    return acc


def channel_mean(k: torch.Tensor, cu_seqlens: torch.Tensor, block: int = QUANT_BLOCK,
                 where: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 mean of k per (sequence, kv head, channel) [B, Hkv, D], summed in the spec's order.

    ``where`` is ``_token_blocks(cu_seqlens, block)`` when the caller has it already.
    """
    where = _token_blocks(cu_seqlens, block) if where is None else where
    n_blocks = where["blk_seq"].numel()
    tokens = torch.zeros(n_blocks, block, *k.shape[1:], dtype=torch.float32, device=k.device)
    tokens[where["block"], where["slot"]] = k.float()
    block_sums = _ordered_sum(tokens)
    lens = where["lens"]
    per_seq = torch.zeros(lens.numel(), max(int(where["nblk"].max()), 1), *k.shape[1:],
                          dtype=torch.float32, device=k.device)
    per_seq[where["blk_seq"], where["blk_pos"]] = block_sums
    total = _ordered_sum(per_seq)
    return total / lens.to(torch.float32).clamp_min(1.0)[:, None, None]


def quantize_blocks(x: torch.Tensor, cu_seqlens: torch.Tensor, block: int = QUANT_BLOCK,
                    where: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per (block, head) of fp32 ``x`` [T, H, D]: (x_i8 [T, H, D], scale [T, H]).

    Scales are divided, not multiplied by a reciprocal, and by a tensor, not a Python number
    (torch's CUDA division by a scalar multiplies by its reciprocal, which rounds differently).
    """
    where = _token_blocks(cu_seqlens, block) if where is None else where
    n_blocks = where["blk_seq"].numel()
    token_amax = x.abs().amax(dim=2)
    amax = torch.zeros(n_blocks, x.shape[1], dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, where["block"][:, None].expand_as(token_amax), token_amax, "amax")
    floor = torch.full_like(amax, SCALE_FLOOR)
    scale = torch.maximum(amax, floor) / torch.full_like(amax, float(INT8_MAX))
    token_scale = scale[where["block"]]
    x_i8 = torch.round(x / token_scale[:, :, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return x_i8, token_scale


def smooth_quant(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 block: int = QUANT_BLOCK, smooth: bool = True,
                 checked: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-pass: (q_i8 [T,Hq,D], q_scale fp32 [T,Hq], k_i8 [T,Hkv,D], k_scale fp32 [T,Hkv]).

    ``smooth=False`` skips the K mean (the tests' negative control: outlier channels then stretch
    every block's scale); the kernel path always smooths. ``max_seqlen`` is accepted for the
    shared signature and checked, not needed here. ``checked``: the caller has run
    ``check_varlen`` on these inputs already (``attn.int8_prefill_attention`` does, once per call).
    """
    if not checked:
        check_varlen(q, k, None, cu_seqlens, max_seqlen)
    return smooth_quant_prefix(q, k, cu_seqlens, cu_seqlens, block, smooth)


def default_sm_scale(head_dim: int) -> float:
    """1/sqrt(head_dim): the softmax scale when the caller gives none."""
    return 1.0 / math.sqrt(head_dim)


def _rows_per_chunk(keys: int, heads: int, budget_bytes: int) -> int:
    """Query rows per chunk so that one chunk's fp32 scores stay within ``budget_bytes``."""
    return max(1, budget_bytes // max(1, keys * heads * 4))


def _attend(scores: torch.Tensor, v: torch.Tensor, p_dtype: torch.dtype | None) -> torch.Tensor:
    """Causal-masked scores [Hq, rows, keys] against v [keys, Hq, D] → [rows, Hq, D] in fp32.

    With ``p_dtype`` the unnormalised probabilities are rounded to it before P·V, as the kernel
    does; the normaliser is summed from the unrounded ones, as the kernel's is.
    """
    row_max = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    if p_dtype is not None:
        p = p.to(p_dtype).float()
    return (torch.einsum("hqk,khd->qhd", p, v) / denom.permute(1, 0, 2))


def _causal_chunks(length: int, heads: int, budget_bytes: int):
    """(start, end) query-row chunks of one sequence; keys of a chunk end where its rows end."""
    start = 0
    while start < length:
        rows = _rows_per_chunk(length, heads, budget_bytes)
        end = min(length, start + rows)
        yield start, end
        start = end


def _causal_mask(start: int, end: int, device: torch.device) -> torch.Tensor:
    """True where key j may be seen by query row i (j <= i) for rows start..end−1, keys 0..end−1."""
    rows = torch.arange(start, end, device=device)[:, None]
    cols = torch.arange(end, device=device)[None, :]
    return cols <= rows


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  sm_scale: float | None = None, budget_bytes: int = 1 << 30) -> torch.Tensor:
    """Exact causal GQA attention in fp32 → [T, Hq, D] fp32 (the accuracy tests' yardstick).

    Computed per sequence in chunks of query rows whose fp32 score matrix stays within
    ``budget_bytes``, so a 65,536-token sequence fits in a GPU's memory.
    """
    check_varlen(q, k, v, cu_seqlens, 1)
    scale = default_sm_scale(q.shape[2]) if sm_scale is None else sm_scale
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        kf = k[a:b].float().repeat_interleave(group, dim=1)
        vf = v[a:b].float().repeat_interleave(group, dim=1)
        for s, e in _causal_chunks(b - a, q.shape[1], budget_bytes):
            scores = torch.einsum("qhd,khd->hqk", q[a + s:a + e].float(), kf[:e]) * scale
            scores.masked_fill_(~_causal_mask(s, e, q.device), float("-inf"))
            out[a + s:a + e] = _attend(scores, vf[:e], None)
    return out


def attention_int8_ref(q_i8: torch.Tensor, q_scale: torch.Tensor, k_i8: torch.Tensor, k_scale: torch.Tensor,
                       v: torch.Tensor, cu_seqlens: torch.Tensor, sm_scale: float,
                       budget_bytes: int = 1 << 30) -> torch.Tensor:
    """The kernel's arithmetic in torch → [T, Hq, D] fp32: int8 scores (exact: |Σ| ≤ 256·127² < 2²⁴
    in fp32), scaled per row and column, softmax in fp32, P rounded to v's dtype, fp32 P·V.

    It differs from the kernel only in where the running maximum is taken (per row here, per
    tile there), so it predicts the kernel's error on a CPU, where triton does not run.
    """
    check_varlen(q_i8, k_i8, v, cu_seqlens, 1)
    group = q_i8.shape[1] // k_i8.shape[1]
    out = torch.empty(q_i8.shape, dtype=torch.float32, device=q_i8.device)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        kf = k_i8[a:b].float().repeat_interleave(group, dim=1)
        kscale = k_scale[a:b].repeat_interleave(group, dim=1)
        vf = v[a:b].float().repeat_interleave(group, dim=1)
        for s, e in _causal_chunks(b - a, q_i8.shape[1], budget_bytes):
            dots = torch.einsum("qhd,khd->hqk", q_i8[a + s:a + e].float(), kf[:e])
            row = (q_scale[a + s:a + e] * sm_scale).t()[:, :, None]
            scores = dots * row * kscale[:e].t()[:, None, :]
            scores.masked_fill_(~_causal_mask(s, e, q_i8.device), float("-inf"))
            out[a + s:a + e] = _attend(scores, vf[:e], v.dtype)
    return out


# ------------------------------------------------------------------------------------------------
# A later chunk: queries over a cached prefix (bottom-right causal alignment)


def check_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int) -> None:
    """``check_varlen`` for a chunk over a prefix: q [Tq, Hq, D] with ``cu_seqlens_q``, k and v [Tk, Hkv, D]
    (each sequence's cached prefix, then the chunk's own keys) with ``cu_seqlens_k``, one entry per
    sequence in both. Each sequence must have at least as many keys as queries: checked here only where
    the offsets are on the CPU (reading device values would synchronise; the caller plans from CPU copies).
    """
    check_varlen(q, q, None, cu_seqlens_q, max_seqlen_q)
    if k.dim() != 3 or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"k {tuple(k.shape)} must be [keys, kv heads, head_dim] with q's head_dim and a divisor of "
                         f"its heads (q {tuple(q.shape)})")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    if cu_seqlens_k.dtype != torch.int32 or cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must be int32 {tuple(cu_seqlens_q.shape)} like cu_seqlens_q; got "
                         f"{cu_seqlens_k.dtype} {tuple(cu_seqlens_k.shape)}")
    for name, t in (("k", k), ("v", v), ("cu_seqlens_k", cu_seqlens_k)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must share one device")
    if cu_seqlens_q.device.type == "cpu":
        short = (_lengths(cu_seqlens_k) < _lengths(cu_seqlens_q)).nonzero().flatten().tolist()
        if short:
            raise ValueError(f"sequence {short[0]} has fewer keys than queries: cu_seqlens_k must count each "
                             "sequence's cached prefix and its chunk (keys >= queries)")


def smooth_quant_prefix(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                        block: int = QUANT_BLOCK, smooth: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-pass of a chunk over a prefix: Q in blocks from each chunk's start, K smoothed by the mean over
    all of its sequence's keys (prefix and chunk) and quantized in blocks from the sequence's first key.

    With no prefix (``cu_seqlens_k`` the same tensor as ``cu_seqlens_q``, the same tokens) it is ``smooth_quant``,
    which calls it so (and the token blocks are then worked out once, for Q and K).
    """
    if block < 1:
        raise ValueError(f"block must be >= 1; got {block}")
    wk = _token_blocks(cu_seqlens_k, block)
    ks = k.float()
    if smooth and k.shape[0] > 0:
        ks = ks - channel_mean(k, cu_seqlens_k, block, wk)[wk["seq"]]
    q_i8, q_scale = quantize_blocks(q.float(), cu_seqlens_q, block, wk if cu_seqlens_q is cu_seqlens_k else None)
    k_i8, k_scale = quantize_blocks(ks, cu_seqlens_k, block, wk)
    return q_i8, q_scale, k_i8, k_scale


def _prefix_rows(q_shape: torch.Size, k: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, budget_bytes: int):
    """Per sequence and chunk of query rows: (the rows, their causal mask, the keys they see, the GQA group),
    chunks sized so one chunk's fp32 scores over all of the sequence's keys stay within ``budget_bytes``."""
    group = q_shape[1] // k.shape[1]
    for (a, b), (c, d) in zip(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], strict=True),
                              zip(cu_k.tolist()[:-1], cu_k.tolist()[1:], strict=True), strict=True):
        ctx = (d - c) - (b - a)
        step = _rows_per_chunk(d - c, q_shape[1], budget_bytes)
        for s in range(0, b - a, step):
            e = min(b - a, s + step)
            keys = ctx + e
            rows = torch.arange(ctx + s, ctx + e, device=k.device)[:, None]
            mask = torch.arange(keys, device=k.device)[None, :] <= rows
            yield slice(a + s, a + e), mask, slice(c, c + keys), group


def attention_prefix_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, sm_scale: float | None = None,
                         budget_bytes: int = 1 << 30) -> torch.Tensor:
    """Exact attention of a chunk over its prefix in fp32 → [Tq, Hq, D]: query i of a sequence with ``ctx``
    cached keys sits at position ctx + i and sees keys 0 .. ctx + i (the accuracy tests' yardstick)."""
    check_prefix(q, k, v, cu_seqlens_q.cpu(), cu_seqlens_k.cpu(), 1)
    scale = default_sm_scale(q.shape[2]) if sm_scale is None else sm_scale
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for rows, mask, keys, group in _prefix_rows(q.shape, k, cu_seqlens_q, cu_seqlens_k, budget_bytes):
        kf = k[keys].float().repeat_interleave(group, dim=1)
        vf = v[keys].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), kf) * scale
        scores.masked_fill_(~mask, float("-inf"))
        out[rows] = _attend(scores, vf, None)
    return out


def attention_prefix_int8_ref(q_i8: torch.Tensor, q_scale: torch.Tensor, k_i8: torch.Tensor, k_scale: torch.Tensor,
                              v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                              sm_scale: float, budget_bytes: int = 1 << 30) -> torch.Tensor:
    """The prefix kernel's arithmetic in torch (as ``attention_int8_ref`` for a chunk over its prefix)."""
    out = torch.empty(q_i8.shape, dtype=torch.float32, device=q_i8.device)
    for rows, mask, keys, group in _prefix_rows(q_i8.shape, k_i8, cu_seqlens_q, cu_seqlens_k, budget_bytes):
        kf = k_i8[keys].float().repeat_interleave(group, dim=1)
        kscale = k_scale[keys].repeat_interleave(group, dim=1)
        vf = v[keys].float().repeat_interleave(group, dim=1)
        dots = torch.einsum("qhd,khd->hqk", q_i8[rows].float(), kf)
        scores = dots * (q_scale[rows] * sm_scale).t()[:, :, None] * kscale.t()[:, None, :]
        scores.masked_fill_(~mask, float("-inf"))
        out[rows] = _attend(scores, vf, v.dtype)
    return out


def rel_err_per_head(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """‖out − ref‖ / ‖ref‖ per head over all tokens, in fp64 → [H] (the accuracy bound's measure)."""
    diff = (out.double() - ref.double()).pow(2).sum(dim=(0, 2)).sqrt()
    norm = ref.double().pow(2).sum(dim=(0, 2)).sqrt()
    return diff / norm.clamp_min(torch.finfo(torch.float64).tiny)
