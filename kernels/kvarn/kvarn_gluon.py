"""KVarN decode split kernel v4, in Gluon (triton.experimental.gluon): layouts chosen by the kernel, not by Triton.

Why a second language: v3 (kvarn_triton._decode_split_kernel_v3) spends its time moving codes through shared
memory (47 barriers a 128-token group, 1-2-byte shared loads) because plain Triton picks the register layout
of a tensor-core operand and the codes' byte layout is not it. Gluon lets a kernel state both layouts, so v4
loads each thread's codes from global memory straight into the registers the mma instruction reads:

* one warp a program, each an independent run of whole groups with its own (m, l, acc): no shared memory,
  no barrier; many splits (kvarn_triton.V4_SPLITS) fill the GPU;
* scores S^T [16 tokens, 8 query rows] = K codes [16, 256] @ q'^T [256, 8] (mma m16n8k16: the 6 query rows of
  a KV head pad to 8, not 16). The dot does not care about channel order, so logical k of the operands maps
  to K channel 64 ((k >> 1) & 3) + 4 (k >> 4) + 2 ((k >> 3) & 1) + (k & 1): the A-fragment thread of
  lane % 4 = a owns bytes [32 a, 32 a + 32) of its two tokens' 128-byte code rows, read as 8-byte loads, four
  64-channel chunks a tile (16 registers of codes live at a time, not 64); the query is gathered in the same
  order, times the group's K channel scales, split fp16 hi + lo (two mma, ~22 bits: v1's precision);
* P.V as acc [256 channels, 8 rows] += V codes^T [256, 16 tokens] @ p [16, 8]: accumulator row R holds
  V channel ((R & 7) << 5) | (R >> 3), two 128-channel halves (4-byte loads, 32 code registers at a time);
  p moves from the scores' accumulator layout to the B operand by two shuffles; p * token_scale / the tile's
  largest token scale is split hi + lo;
* the V scales leave the inner loop: acc is kept in units of 1 / (channel_scale * the tile's largest token
  scale) and rescaled like the softmax's alpha (the token offsets' sum p * offset joins once a group).
  Channel scales are never 0 (reference.CHANNEL_RANGE clamps them to float16's normal range).

Its output is v3's (o [S, HQ, NSPLIT, D] unnormalized, natural channel order; ml (max, sum)), so
kvarn_triton's combine kernel reads it unchanged. Gluon has no interpreter: v4 runs compiled on CUDA only
(sm80 and later: mma_v2), and the CPU tests compile it for sm86 and sm90 (kvarn_compile_check.py).

kvarn_triton loads this file and sets ``unpack_asm`` (its four-codes-at-a-time PTX by (shift, mask)) before
running it, so both kernels unpack with the same instructions. Written for this repo; no code was copied.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

if "unpack_asm" not in globals():
    raise ImportError("kvarn_gluon.py is loaded through kvarn_triton._load_gluon(), which gives it unpack_asm "
                      "(the PTX both kernels unpack with); load kvarn_triton.py and use decode_attention(variant='v4')")
_ASM = globals()["unpack_asm"]

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
"""One warp's mma.m16n8k16 accumulator: scores S^T [16 tokens, 8 rows] and acc [256 channels, 8 rows]."""
K_CHUNK = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]], lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0],
                                                                     [4, 0, 0]],
    warp_bases=[], block_bases=[], shape=[16, 4, 8]))
"""K codes of one 64-channel chunk [token, a, byte]: lane (4 t + a) holds tokens t and t + 8, bytes
32 a + 8 c + [0, 8) of chunk c: after the nibble split, exactly the A fragment of the chunk's four k16 steps."""
V_HALF = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [8, 0, 0]], lane_bases=[[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0],
                                                                     [0, 4, 0]],
    warp_bases=[], block_bases=[], shape=[16, 8, 4]))
"""V codes of one 128-channel half [token, x, byte]: lane (4 x + u) holds tokens 2u, 2u + 1, 2u + 8, 2u + 9,
bytes 8 x + 4 c + [0, 4) of half c: after the crumb split and a transpose, the A fragment of P.V."""

_K0, _K4 = _ASM[0, 15], _ASM[4, 15]
_V0, _V2, _V4, _V6 = _ASM[0, 3], _ASM[2, 3], _ASM[4, 3], _ASM[6, 3]


@gluon.jit
def _code(raw, SHIFT: gl.constexpr, MASK: gl.constexpr, PTX: gl.constexpr):
    """uint8 codes -> fp16: the code at bits SHIFT.. (MASK 15: a nibble, 3: a crumb) under the magic number
    (0x6400 | code is fp16 1024 + code), element-wise or four at a time in PTX (kvarn_triton._unpack_ptx)."""
    if PTX:
        if MASK == 15:
            asm: gl.constexpr = _K0 if SHIFT == 0 else _K4
        else:
            asm: gl.constexpr = _V0 if SHIFT == 0 else (_V2 if SHIFT == 2 else (_V4 if SHIFT == 4 else _V6))
        return gl.inline_asm_elementwise(asm, "=r,=r,r", [raw], dtype=gl.float16, is_pure=True, pack=4)
    c = (raw >> SHIFT) & MASK
    return (c.to(gl.uint16) | 0x6400).to(gl.float16, bitcast=True) - 1024.0


@gluon.jit
def _split16(x):
    """x (fp32, |x| <= 1) as fp16 hi + lo: two tensor-core operands carrying ~22 bits of x."""
    hi = x.to(gl.float16)
    return hi, (x - hi.to(gl.float32)).to(gl.float16)


@gluon.jit
def _q_chunk(qrow, qmask, kcs, kb, C: gl.constexpr):
    """Chunk C of the query, gathered in the K map's channel order, times the group's K channel scales."""
    k = kb + 64 * C
    kch = 64 * ((k >> 1) & 3) + 4 * (k >> 4) + 2 * ((k >> 3) & 1) + (k & 1)
    return gl.load(qrow + kch[:, None], mask=qmask, other=0.0) * gl.load(kcs + kch).to(gl.float32)[:, None]


@gluon.jit
def _query(qrow, qmask, kcs, kb, S_L: gl.constexpr):
    """q * K channel scale / its largest |value| (per row) as four (hi, lo) B-operand chunks, with the rows'
    sums (for the token offsets) and largest |values| in the scores' layout S_L."""
    c0 = _q_chunk(qrow, qmask, kcs, kb, 0)
    c1 = _q_chunk(qrow, qmask, kcs, kb, 1)
    c2 = _q_chunk(qrow, qmask, kcs, kb, 2)
    c3 = _q_chunk(qrow, qmask, kcs, kb, 3)
    qsum = gl.sum(c0, axis=0) + gl.sum(c1, axis=0) + gl.sum(c2, axis=0) + gl.sum(c3, axis=0)
    amax = gl.maximum(gl.maximum(gl.max(gl.abs(c0), axis=0), gl.max(gl.abs(c1), axis=0)),
                      gl.maximum(gl.max(gl.abs(c2), axis=0), gl.max(gl.abs(c3), axis=0)))
    amax = gl.where(amax > 0, amax, 1.0)
    r = 1.0 / amax[None, :]
    return (_split16(c0 * r), _split16(c1 * r), _split16(c2 * r), _split16(c3 * r),
            gl.convert_layout(qsum, S_L), gl.convert_layout(amax, S_L))


@gluon.jit
def _k_chunk(kt, q, dots, A_L: gl.constexpr, PTX: gl.constexpr):
    """One 64-channel chunk of a 16-token K tile: 8 bytes a thread a token, nibbles to fp16, dotted hi + lo."""
    raw = gl.load(kt)
    r = raw.reshape([16, 4, 4, 2]).permute([0, 2, 3, 1]).reshape([16, 32])
    a = gl.join(_code(r, 0, 15, PTX), _code(r, 4, 15, PTX)).reshape([16, 64])
    a = gl.convert_layout(a, A_L, assert_trivial=True)
    q_hi, q_lo = q
    return mma_v2(a, q_lo, mma_v2(a, q_hi, dots))


@gluon.jit
def _v_half(vt, p_hi, p_lo, acc, A_L: gl.constexpr, PTX: gl.constexpr):
    """One 128-channel half of a 16-token V tile (4 bytes a thread a token), crumbs to fp16, accumulated
    hi + lo into acc (rows R <-> channel 32 (R & 7) + 16 c + (R >> 3))."""
    raw = gl.load(vt).reshape([16, 32])
    v = gl.join(gl.join(_code(raw, 0, 3, PTX), _code(raw, 4, 3, PTX)),
                gl.join(_code(raw, 2, 3, PTX), _code(raw, 6, 3, PTX))).reshape([16, 128])
    av = gl.convert_layout(v.reshape([16, 8, 16]).permute([2, 1, 0]).reshape([128, 16]), A_L, assert_trivial=True)
    return mma_v2(av, p_lo, mma_v2(av, p_hi, acc))


@gluon.jit
def decode_split_v4(qr_ptr, u8_ptr, f16_ptr, bt_ptr, stride_bt, ngroups_ptr, o_ptr, ml_ptr, page_bytes, gps,
                    K_CODES: gl.constexpr, K_TS: gl.constexpr, K_TO: gl.constexpr, K_CS: gl.constexpr,
                    V_CODES: gl.constexpr, V_TS: gl.constexpr, V_TO: gl.constexpr, V_CS: gl.constexpr,
                    HKV: gl.constexpr, QPK: gl.constexpr, D: gl.constexpr, T: gl.constexpr,
                    NSPLIT: gl.constexpr, PTX: gl.constexpr):
    """Program (s, h, j): groups [j gps, (j + 1) gps) of sequence s, KV head h, its QPK (<= 8) query rows; one
    warp. Arguments are kvarn_triton._decode_split_kernel_v3's (D 256, T a multiple of 16)."""
    gl.static_assert(D == 256, "v4's channel maps are for head_dim 256")
    gl.static_assert(QPK <= 8, "v4 holds a KV head's query rows in the mma's 8 columns")
    A_L: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_L: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    ROWS: gl.constexpr = gl.SliceLayout(0, MMA)
    HQ: gl.constexpr = HKV * QPK
    s = gl.program_id(0)
    h = gl.program_id(1)
    j = gl.program_id(2)
    g0 = j * gps
    g1 = gl.minimum(g0 + gps, gl.load(ngroups_ptr + s))
    kb = gl.arange(0, D // 4, layout=gl.SliceLayout(1, B_L))
    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, B_L))
    qrow = qr_ptr + (s * HQ + h * QPK + nb).to(gl.int64)[None, :] * D
    qmask = (nb < QPK)[None, :]
    tk = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, K_CHUNK)))[:, None, None]
    ak = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, K_CHUNK)))[None, :, None]
    ck = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, K_CHUNK)))[None, None, :]
    kbyte = 32 * ak + ck
    tv = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, V_HALF)))[:, None, None]
    xv = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, V_HALF)))[None, :, None]
    yv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, V_HALF)))[None, None, :]
    vbyte = 8 * xv + yv
    tm = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    rv = gl.arange(0, D // 2, layout=gl.SliceLayout(1, MMA))
    vch0 = ((rv & 7) << 5) | (rv >> 3)
    vch1 = vch0 + 16
    m_i = gl.full([8], float("-inf"), gl.float32, layout=ROWS)
    l_i = gl.zeros([8], gl.float32, layout=ROWS)
    acc0 = gl.zeros([D // 2, 8], gl.float32, layout=MMA)
    acc1 = gl.zeros([D // 2, 8], gl.float32, layout=MMA)
    bt_row = bt_ptr + s.to(gl.int64) * stride_bt
    for g in range(g0, g1):
        base = gl.load(bt_row + g).to(gl.int64) * page_bytes
        fb = base // 2
        q0, q1, q2, q3, qsum, amax = _query(qrow, qmask, f16_ptr + fb + K_CS // 2 + h * D, kb, ROWS)
        vcs = f16_ptr + fb + V_CS // 2 + h * D
        acc0 = acc0 / gl.load(vcs + vch0).to(gl.float32)[:, None]   # into this group's units
        acc1 = acc1 / gl.load(vcs + vch1).to(gl.float32)[:, None]
        tprev = 1.0
        offacc = gl.zeros([8], gl.float32, layout=ROWS)
        for t0 in range(0, T, 16):
            kt = u8_ptr + base + K_CODES + ((t0 + tk) * HKV + h) * (D // 2) + kbyte
            vt = u8_ptr + base + V_CODES + ((t0 + tv) * HKV + h) * (D // 4) + vbyte
            dots = gl.zeros([16, 8], gl.float32, layout=MMA)
            dots = _k_chunk(kt, q0, dots, A_L, PTX)
            dots = _k_chunk(kt + 8, q1, dots, A_L, PTX)
            dots = _k_chunk(kt + 16, q2, dots, A_L, PTX)
            dots = _k_chunk(kt + 24, q3, dots, A_L, PTX)
            ts = gl.load(f16_ptr + fb + K_TS // 2 + (t0 + tm) * HKV + h).to(gl.float32)
            to = gl.load(f16_ptr + fb + K_TO // 2 + (t0 + tm) * HKV + h).to(gl.float32)
            sc = dots * amax[None, :] * ts[:, None] + qsum[None, :] * to[:, None]
            m_new = gl.maximum(m_i, gl.max(sc, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(sc - m_new[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            tsv = gl.load(f16_ptr + fb + V_TS // 2 + (t0 + tm) * HKV + h).to(gl.float32)
            tov = gl.load(f16_ptr + fb + V_TO // 2 + (t0 + tm) * HKV + h).to(gl.float32)
            tmax = gl.max(tsv, axis=0)
            tmax = gl.where(tmax > 0, tmax, 1.0)
            f = alpha * (tprev / tmax)          # the softmax's rescale and the unit change to this tile's
            tprev = tmax
            offacc = offacc * f + gl.sum(p * (tov / tmax)[:, None], axis=0)
            p_hi, p_lo = _split16(p * (tsv / tmax)[:, None])
            p_hi = gl.convert_layout(p_hi, B_L)
            p_lo = gl.convert_layout(p_lo, B_L)
            acc0 = _v_half(vt, p_hi, p_lo, acc0 * f[None, :], A_L, PTX)
            acc1 = _v_half(vt + 4, p_hi, p_lo, acc1 * f[None, :], A_L, PTX)
        acc0 = (acc0 + offacc[None, :]) * (gl.load(vcs + vch0).to(gl.float32) * tprev)[:, None]
        acc1 = (acc1 + offacc[None, :]) * (gl.load(vcs + vch1).to(gl.float32) * tprev)[:, None]
    n = gl.arange(0, 8, layout=ROWS)
    slot = ((s * HQ + h * QPK + n) * NSPLIT + j).to(gl.int64)
    gl.store(o_ptr + slot[None, :] * D + vch0[:, None], acc0, mask=(n < QPK)[None, :])
    gl.store(o_ptr + slot[None, :] * D + vch1[:, None], acc1, mask=(n < QPK)[None, :])
    gl.store(ml_ptr + slot * 2, m_i, mask=n < QPK)
    gl.store(ml_ptr + slot * 2 + 1, l_i, mask=n < QPK)
