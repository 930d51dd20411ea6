"""Causal varlen prefill attention with int8 QKᵀ (the SageAttention idea), in Triton.

Q and K arrive quantized to int8 per 64-token block (K smoothed first: see reference.py, which
specifies the pre-pass to the bit); this kernel multiplies them on int8 tensor cores into int32,
scales each score by its row's and column's block scale, runs an online softmax in fp32 (in
base 2: log2(e) is folded into the row scale so the exponential is one ``exp2``), rounds P to
v's dtype and accumulates P·V in fp32. Tiles wholly above the causal diagonal are never visited.

Why int8 only for QKᵀ: the scores tolerate 8-bit inputs once K's shared per-channel offset is
removed, while P·V feeds the output directly and stays in 16 bit. On an RTX 3090 a 16-bit MMA
with fp32 accumulation runs at half of GA102's fp16 rate and int8 at four times that; QKᵀ is
half of the attention's matmul work.

Entry points (the kernel folder's contract): ``int8_prefill_attention`` (pre-pass + attention),
``attn_int8`` (attention on already-quantized inputs), ``warmup`` (compile before traffic) and
``aot_specs`` (what the build machinery compiles ahead of time). This file is loaded by path
(``rig.kernels.load("int8-prefill-attn")``): the folder name has hyphens.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

KERNEL = "int8-prefill-attn"
HERE = Path(__file__).resolve().parent
LOG2E = 1.4426950408889634


def _load_sibling(name: str):
    """Import ``<name>.py`` from this folder under a package-unique module name.

    The folder is not a package (its name has hyphens) and two kernels may each have a
    ``reference.py``: a plain ``import reference`` would pick whichever came first on sys.path.
    """
    mod_name = f"rig_kernel_{KERNEL.replace('-', '_')}_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


reference = _load_sibling("reference")


class Tiles(NamedTuple):
    """One launch configuration: query rows and keys per tile, warps, software-pipeline stages.

    A NamedTuple, not a dataclass: this file is loaded by path, and a dataclass needs its module
    registered in sys.modules, which a loader may not do.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Per architecture family and head_dim. sm86 (RTX 3090): 100 KB of shared memory per SM and
# 64K registers a SM; a [64, 256] fp32 accumulator is 64 KB of registers, so 64 query rows and
# 8 warps (4 warps spill); keys 64 at a time, two stages: 73,984 bytes of shared memory and 255
# registers without spills for head_dim 256 (ptxas -v on triton.compile's PTX for sm_86; not
# timed on an sm86 card yet). sm90 (H100/H200): 228 KB of shared memory and wgmma.
TILES: dict[tuple[str, int], Tiles] = {
    ("sm86", 64): Tiles(64, 64, 4, 2),
    ("sm86", 128): Tiles(64, 64, 4, 2),
    ("sm86", 256): Tiles(64, 64, 8, 2),
    ("sm90", 64): Tiles(128, 64, 8, 3),
    ("sm90", 128): Tiles(128, 64, 8, 3),
    ("sm90", 256): Tiles(128, 64, 8, 3),
}
HEAD_DIMS = (64, 128, 256)
AOT_ARCHS = {"sm86": 86, "sm90": 90}
AOT_HEAD_DIM = 256
AOT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_HEADS = (24, 4)
"""(query heads, kv heads) of the served model's attention layers: the shapes compiled ahead of time."""


def arch_family(capability: tuple[int, int]) -> str:
    """The TILES family a compute capability runs with: Hopper/Blackwell datacenter → sm90,
    everything else (Ampere, Ada, GeForce Blackwell: ~100 KB of shared memory) → sm86."""
    return "sm90" if capability[0] in (9, 10) else "sm86"


def tiles_for(family: str, head_dim: int) -> Tiles:
    """The launch configuration for an arch family and head_dim, or a ValueError naming both."""
    try:
        return TILES[(family, head_dim)]
    except KeyError:
        raise ValueError(f"{KERNEL}: no tile configuration for {family} with head_dim {head_dim}"
                         f" (head_dim must be one of {HEAD_DIMS})") from None


@triton.jit
def _attend_tile(acc, l_i, m_i, q, q_row, k_base, ks_base, v_base, start_n, offs_m, offs_n, offs_d, seq_len,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIAG: tl.constexpr):
    """One BLOCK_N slice of keys for the tile's rows: int8 scores, online softmax, P·V.

    ``DIAG`` tiles straddle the causal diagonal (and possibly the sequence's end) and are masked;
    all others are wholly below it and skip the masks.
    """
    cols = start_n + offs_n
    k_ptrs = k_base + cols[:, None] * (NUM_KV_HEADS * HEAD_DIM) + offs_d[None, :]
    v_ptrs = v_base + cols[:, None] * (NUM_KV_HEADS * HEAD_DIM) + offs_d[None, :]
    if DIAG:
        col_ok = cols < seq_len
        k = tl.load(k_ptrs, mask=col_ok[:, None], other=0)
        k_scale = tl.load(ks_base + cols * NUM_KV_HEADS, mask=col_ok, other=0.0)
        v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        k_scale = tl.load(ks_base + cols * NUM_KV_HEADS)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * q_row[:, None] * k_scale[None, :]
    if DIAG:
        s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd(Q, QS, K, KS, V, OUT, CU_SEQLENS, qk_scale,
              NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M query rows of one head of one sequence (grid: tiles × heads × seqs).

    Tiles run heaviest first (the last rows of a causal sequence see the most keys), so the
    short tiles fill the tail of the launch. ``qk_scale`` is sm_scale·log2(e).
    """
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_start = tl.load(CU_SEQLENS + seq).to(tl.int64)
    seq_len = (tl.load(CU_SEQLENS + seq + 1) - seq_start).to(tl.int32)
    m_start = tile * BLOCK_M
    if m_start >= seq_len:
        return
    kv_head = head // (NUM_Q_HEADS // NUM_KV_HEADS)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    rows = seq_start + offs_m
    q = tl.load(Q + (rows[:, None] * NUM_Q_HEADS + head) * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0)
    q_row = tl.load(QS + rows * NUM_Q_HEADS + head, mask=row_ok, other=0.0) * qk_scale
    kv_off = seq_start * NUM_KV_HEADS + kv_head
    k_base = K + kv_off * HEAD_DIM
    v_base = V + kv_off * HEAD_DIM
    ks_base = KS + kv_off
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for start_n in range(0, m_start, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_row, k_base, ks_base, v_base, start_n, offs_m, offs_n,
                                     offs_d, seq_len, NUM_KV_HEADS, HEAD_DIM, False)
    for start_n in range(m_start, tl.minimum(m_start + BLOCK_M, seq_len), BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_row, k_base, ks_base, v_base, start_n, offs_m, offs_n,
                                     offs_d, seq_len, NUM_KV_HEADS, HEAD_DIM, True)
    out = acc / l_i[:, None]
    o_ptrs = OUT + (rows[:, None] * NUM_Q_HEADS + head) * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attn_fwd_prefix(Q, QS, K, KS, V, OUT, CU_SEQLENS_Q, CU_SEQLENS_K, qk_scale,
                     NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_attn_fwd`` for a later chunk of a prompt: a sequence's queries are its last ``q_len`` positions and
    its keys are the cached prefix then the chunk (``k_len`` >= ``q_len``), so query row m sits at
    ctx + m (ctx = k_len − q_len) and sees keys 0 .. ctx + m (bottom-right causal alignment).

    Key tiles wholly left of the tile's first position skip the masks; the masked run starts at the
    BLOCK_N boundary at or below it, since ctx need not be a multiple of BLOCK_N. With ctx = 0 it
    visits the same tiles as ``_attn_fwd``. ``_attend_tile`` is shared: its row positions are ctx + m.
    """
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(CU_SEQLENS_Q + seq).to(tl.int64)
    q_len = (tl.load(CU_SEQLENS_Q + seq + 1) - q_start).to(tl.int32)
    k_start = tl.load(CU_SEQLENS_K + seq).to(tl.int64)
    k_len = (tl.load(CU_SEQLENS_K + seq + 1) - k_start).to(tl.int32)
    m_start = tile * BLOCK_M
    if m_start >= q_len:
        return
    ctx = k_len - q_len
    kv_head = head // (NUM_Q_HEADS // NUM_KV_HEADS)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    rows = q_start + offs_m
    q = tl.load(Q + (rows[:, None] * NUM_Q_HEADS + head) * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0)
    q_row = tl.load(QS + rows * NUM_Q_HEADS + head, mask=row_ok, other=0.0) * qk_scale
    kv_off = k_start * NUM_KV_HEADS + kv_head
    k_base = K + kv_off * HEAD_DIM
    v_base = V + kv_off * HEAD_DIM
    ks_base = KS + kv_off
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    pos = ctx + offs_m
    first = ctx + m_start
    masked_from = (first // BLOCK_N) * BLOCK_N
    for start_n in range(0, masked_from, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_row, k_base, ks_base, v_base, start_n, pos, offs_n,
                                     offs_d, k_len, NUM_KV_HEADS, HEAD_DIM, False)
    for start_n in range(masked_from, tl.minimum(first + BLOCK_M, k_len), BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_row, k_base, ks_base, v_base, start_n, pos, offs_n,
                                     offs_d, k_len, NUM_KV_HEADS, HEAD_DIM, True)
    out = acc / l_i[:, None]
    o_ptrs = OUT + (rows[:, None] * NUM_Q_HEADS + head) * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def _interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tensors are then allowed: Triton runs the kernel in numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_attention(v: torch.Tensor, cu_seqlens: torch.Tensor, q_shape: torch.Size,
                     out: torch.Tensor | None) -> None:
    """What the attention kernel needs beyond ``reference.check_varlen`` (which put q, k, v and
    cu_seqlens on one device): v's dtype, the head_dim, v and cu_seqlens contiguous on a CUDA
    device, and ``out`` when given. Refused with the tensor's name (the kernel itself cannot check)."""
    if v.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"v must be bfloat16 or float16; got {v.dtype}")
    if q_shape[2] not in HEAD_DIMS:
        raise ValueError(f"head_dim {q_shape[2]} is not supported (one of {HEAD_DIMS})")
    for name, t in (("v", v), ("cu_seqlens", cu_seqlens)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel derives its strides from the head counts)")
        if not (t.is_cuda or _interpreting()):
            raise ValueError(f"{name} is on {t.device}: the kernel runs on a CUDA device")
    if out is not None and (out.shape != q_shape or out.dtype != v.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous {v.dtype} {tuple(q_shape)}; got {out.dtype} {tuple(out.shape)}")


def _check_quantized(q_i8: torch.Tensor, q_scale: torch.Tensor, k_i8: torch.Tensor, k_scale: torch.Tensor,
                     v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, out: torch.Tensor | None) -> None:
    """Refuse inputs the kernel would misread, naming the tensor (the kernel itself cannot check)."""
    reference.check_varlen(q_i8, k_i8, v, cu_seqlens, max_seqlen)
    expected = {"q_i8": (q_i8, torch.int8, q_i8.shape), "k_i8": (k_i8, torch.int8, k_i8.shape),
                "q_scale": (q_scale, torch.float32, q_i8.shape[:2]),
                "k_scale": (k_scale, torch.float32, k_i8.shape[:2])}
    for name, (t, dtype, shape) in expected.items():
        if t.dtype != dtype or t.shape != shape:
            raise ValueError(f"{name} must be {dtype} {tuple(shape)}; got {t.dtype} {tuple(t.shape)}")
    _check_attention(v, cu_seqlens, q_i8.shape, out)
    for name, t in (("q_i8", q_i8), ("q_scale", q_scale), ("k_i8", k_i8), ("k_scale", k_scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel derives its strides from the head counts)")
        if not (t.is_cuda or _interpreting()):
            raise ValueError(f"{name} is on {t.device}: the kernel runs on a CUDA device")


@functools.cache
def _family_of(device: torch.device) -> str:
    """The TILES family of a tensor's device (sm86 under the CPU interpreter); looked up once per device."""
    if device.type != "cuda":
        return "sm86"
    return arch_family(torch.cuda.get_device_capability(device))


def _launch(q_i8: torch.Tensor, q_scale: torch.Tensor, k_i8: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor,
            cu_seqlens: torch.Tensor, max_seqlen: int, sm_scale: float, out: torch.Tensor | None) -> torch.Tensor:
    """The attention kernel on inputs already checked (``_check_quantized``, or ``int8_prefill_attention``'s checks)."""
    tokens, hq, head_dim = q_i8.shape
    if out is None:
        out = torch.empty(tokens, hq, head_dim, dtype=v.dtype, device=v.device)
    if tokens == 0:
        return out
    t = tiles_for(_family_of(v.device), head_dim)  # not cached: the bench's --sweep-tiles edits TILES
    grid = (triton.cdiv(int(max_seqlen), t.block_m), hq, cu_seqlens.numel() - 1)
    with torch.cuda.device(v.device) if v.is_cuda else contextlib.nullcontext():
        _attn_fwd[grid](q_i8, q_scale, k_i8, k_scale, v, out, cu_seqlens, float(sm_scale) * LOG2E,
                        NUM_Q_HEADS=hq, NUM_KV_HEADS=k_i8.shape[1], HEAD_DIM=head_dim,
                        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def attn_int8(q_i8: torch.Tensor, q_scale: torch.Tensor, k_i8: torch.Tensor, k_scale: torch.Tensor,
              v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, sm_scale: float,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention on pre-quantized Q/K → [T, Hq, D] in v's dtype (written into ``out`` if given).

    ``max_seqlen`` must be at least the longest sequence: rows past it are not computed.
    """
    _check_quantized(q_i8, q_scale, k_i8, k_scale, v, cu_seqlens, max_seqlen, out)
    return _launch(q_i8, q_scale, k_i8, k_scale, v, cu_seqlens, max_seqlen, sm_scale, out)


def _cuda_prepass() -> Callable | None:
    """The CUDA pre-pass (smooth_quant.cu through rig.kernels.cubin) when its build exists, else None.

    Looked up once; rig may not be importable (a kernel folder used on its own) and the build
    may be missing or stale (``inv kernels.build`` not run): each means the torch pre-pass.
    """
    try:
        from rig.kernels import cubin

        return cubin.smooth_quant_or_none(KERNEL)
    except ImportError:  # rig, or one of its dependencies, is not importable here
        return None


@functools.cache
def prepass() -> Callable:
    """The pre-pass this process uses: the CUDA build's, or the torch one with a one-time warning."""
    cuda = _cuda_prepass()
    if cuda is not None:
        return cuda
    warnings.warn(f"{KERNEL}: the CUDA pre-pass is not built (`inv kernels.build`); using the torch pre-pass "
                  "from reference.py (same bytes, slower)", RuntimeWarning, stacklevel=2)
    return reference.smooth_quant


def int8_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, sm_scale: float | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen GQA prefill attention: smooth + quantize Q/K to int8 per block, then the attention.

    Inputs are checked once, before anything is launched: ``check_varlen`` and the attention's
    needs here, what only the pre-pass needs inside it (``checked=True``: not ``check_varlen`` again);
    the pre-pass's outputs go to the kernel unchecked (they are made to its contract).
    """
    reference.check_varlen(q, k, v, cu_seqlens, max_seqlen)
    _check_attention(v, cu_seqlens, q.shape, out)
    scale = reference.default_sm_scale(q.shape[2]) if sm_scale is None else sm_scale
    q_i8, q_scale, k_i8, k_scale = prepass()(q, k, cu_seqlens, max_seqlen, checked=True)
    return _launch(q_i8, q_scale, k_i8, k_scale, v, cu_seqlens, max_seqlen, scale, out)


def int8_prefill_attention_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                  cu_seqlens_k: torch.Tensor, max_seqlen_q: int, sm_scale: float | None = None,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    """A later chunk of each prompt over its cached prefix: q [Tq, Hq, D] the chunks' queries, k and v
    [Tk, Hkv, D] each sequence's prefix keys then its chunk's (contiguous, in v's dtype), ``cu_seqlens_k``
    their offsets. Query i of a sequence with ``ctx`` = keys − queries sees keys 0 .. ctx + i.

    The pre-pass is ``reference.smooth_quant_prefix`` in torch (K's mean over the prefix and the chunk);
    the CUDA pre-pass has no prefix form yet. Checked once, before anything is launched.
    """
    reference.check_prefix(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    _check_attention(v, cu_seqlens_k, k.shape, None)
    _check_attention(q, cu_seqlens_q, q.shape, out)
    if v.dtype != q.dtype:
        raise ValueError(f"v ({v.dtype}) must have q's dtype ({q.dtype})")
    scale = reference.default_sm_scale(q.shape[2]) if sm_scale is None else sm_scale
    q_i8, q_scale, k_i8, k_scale = reference.smooth_quant_prefix(q, k, cu_seqlens_q, cu_seqlens_k)
    tokens, hq, head_dim = q.shape
    if out is None:
        out = torch.empty(tokens, hq, head_dim, dtype=v.dtype, device=v.device)
    if tokens == 0:
        return out
    t = tiles_for(_family_of(v.device), head_dim)
    grid = (triton.cdiv(int(max_seqlen_q), t.block_m), hq, cu_seqlens_q.numel() - 1)
    with torch.cuda.device(v.device) if v.is_cuda else contextlib.nullcontext():
        _attn_fwd_prefix[grid](q_i8, q_scale, k_i8, k_scale, v, out, cu_seqlens_q, cu_seqlens_k,
                               float(scale) * LOG2E, NUM_Q_HEADS=hq, NUM_KV_HEADS=k.shape[1], HEAD_DIM=head_dim,
                               BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def warmup(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
           device: torch.device | str) -> None:
    """Compile (or load from Triton's cache) everything a model with these shapes needs.

    Run before a server takes traffic: the kernel specialises on the head counts, head_dim and
    v's dtype only (no length is a kernel argument), so one small run covers every request.
    Two sequences, one of them longer than a tile, take both the masked and unmasked paths.
    """
    device = torch.device(device)
    lens = [1, 2 * TILES[(_family_of(device), head_dim)].block_m + 3] if head_dim in HEAD_DIMS else [1]
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(sum(lens), num_q_heads, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(sum(lens), num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    int8_prefill_attention(q, k, k.clone(), cu, max(lens))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _signature(dtype: str) -> dict[str, str]:
    """The kernel's Triton signature for v/out of ``dtype`` ("bf16" or "fp16")."""
    ptrs = {"Q": "*i8", "QS": "*fp32", "K": "*i8", "KS": "*fp32", "V": f"*{dtype}", "OUT": f"*{dtype}",
            "CU_SEQLENS": "*i32"}
    consts = {name: "constexpr" for name in ("NUM_Q_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "BLOCK_M", "BLOCK_N")}
    return {**ptrs, "qk_scale": "fp32", **consts}


def aot_specs(num_q_heads: int = MODEL_HEADS[0], num_kv_heads: int = MODEL_HEADS[1]) -> list[dict]:
    """What the build machinery compiles ahead of time: head_dim 256 × {bf16, fp16} × {sm86, sm90}.

    Each dict: ``fn``, ``signature``, ``constexprs`` and ``attrs`` (the 16-byte pointer alignment
    the JIT assumes for torch's allocations, so the AOT artefact is the one the JIT would build),
    ``options`` (num_warps, num_stages), ``arch`` ("sm86"/"sm90"), ``target`` (compute capability)
    and a unique ``name``. Compile with ``triton.compile(ASTSource(fn, signature, constexprs,
    attrs), target=GPUTarget("cuda", target, 32), options=options)``.
    """
    specs = []
    names = list(_signature("bf16"))
    pointer_attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, ty in _signature("bf16").items()
                     if ty.startswith("*")}
    for arch, target in AOT_ARCHS.items():
        t = tiles_for(arch, AOT_HEAD_DIM)
        for dname in AOT_DTYPES:
            constexprs = {"NUM_Q_HEADS": num_q_heads, "NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": AOT_HEAD_DIM,
                          "BLOCK_M": t.block_m, "BLOCK_N": t.block_n}
            specs.append({
                "fn": _attn_fwd, "signature": _signature(dname), "constexprs": constexprs, "attrs": pointer_attrs,
                "options": {"num_warps": t.num_warps, "num_stages": t.num_stages}, "arch": arch, "target": target,
                "name": f"attn_int8_{arch}_d{AOT_HEAD_DIM}_{dname}_h{num_q_heads}x{num_kv_heads}",
            })
    return specs


def aot_report() -> list[str]:
    """Compile every ``aot_specs()`` entry for its target (no GPU needed) → one line each with the
    shared memory Triton reserves and ptxas's registers/spills: what must fit an sm86 SM.

    The loop is rig's (``rig.kernels.build.compile_check``, the one the KVarN compile check runs too),
    imported here and not at the top: this file is loaded by path inside a vLLM server, without rig.
    """
    from rig.kernels.build import compile_check

    return [f"{c.name}: {c.options}, " + (f"FAILED: {c.error}" if c.error else
                                          f"shared {c.shared_bytes} bytes; {c.ptxas}")
            for c in compile_check(aot_specs())]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))  # the checkout, for rig.kernels.build
    print(f"triton {triton.__version__}")
    report = aot_report()
    print("\n".join(report))
    sys.exit(1 if any(": FAILED: " in line for line in report) else 0)
