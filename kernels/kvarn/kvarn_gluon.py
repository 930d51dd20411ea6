"""KVarN decode split kernels v4 and v5, in Gluon (triton.experimental.gluon): layouts chosen by the kernel.

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

v5 (decode_split_v5) is v4's math fed differently. At 255 registers a thread ptxas serialises v4's loads
within a tile (about five dependent global round trips a 16-token tile: K in three batches, then the token
scales and V after the score mma), with 8 one-warp programs an SM to hide them. v5 copies each tile's codes
and token scales into a ring of STAGES tiles in shared memory with cp.async, STAGES - 1 tiles ahead (into the
next group's page near a group's end), so no global load waits in the token loop; each thread copies exactly
the code bytes it later reads, so only the scales (read by other lanes) need the compiler's one barrier a
tile. It unpacks a 32-bit code word at a time (K_WORD, V_WORDS), with the channel maps that order implies.

v6 (decode_split_v6) is v5 on two warps a program that split the channels: warp w dots K chunks 2 w and 2 w + 1
with its half of the query and accumulates V half w, the tile's two partial scores summed through shared memory (a
rank-3 mma with the warps along the batch dimension), both warps running the same softmax step. Each warp holds
half of v5's accumulator and query operands (ptxas: 223 registers uncapped, none spilled at a cap of 168 on sm86 and
sm90, where v5 needs 255): an Nsight Compute profile put v5's time in warps waiting on their own dependency chains
at 8 warps an SM, and v6 aims at 12 or more.

kvarn_triton loads this file and sets ``unpack_asm`` (its four-codes-at-a-time PTX by (shift, mask)) before
running it, so v3 and v4 unpack with the same instructions. Written for this repo; no code was copied.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

if "unpack_asm" not in globals():
    raise ImportError("kvarn_gluon.py is loaded through kvarn_triton._load_gluon(), which gives it unpack_asm "
                      "(the PTX both kernels unpack with); load kvarn_triton.py and use decode_attention(variant='v4')")
_ASM = globals()["unpack_asm"]
_copy = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
"""cp.async, global -> shared (Triton 3.6 calls it async_copy_global_to_shared, 3.9 async_load)."""
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
"""bar.sync of the program's threads (Triton 3.9 calls it barrier, 3.6 thread_barrier)."""
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
"""Whether a shared-memory view is re-laid out by .reinterpret (Triton 3.9) or ._reinterpret (3.6): _view."""

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
K_SCALES_V5 = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 32], [0, 8], [0, 1], [0, 16], [1, 0], [2, 0], [0, 2], [0, 4]]))
"""A head's 256 K channel scales as stored (channel order) viewed as [chunk C, operand index k]: element (C, k) is
channel _q_channels(k, C, WORDS=True) — channel bit i is the coordinate bit basis i names (v5's CSMEM)."""
V_SCALES = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 8], [0, 16], [0, 32], [0, 64], [1, 0], [0, 1], [0, 2], [0, 4]]))
"""A head's 256 V channel scales as stored viewed as [half c, acc row R]: element (c, R) is channel
32 (R & 7) + 16 c + (R >> 3), the channel of acc_c's row R (_run_start's vch0, vch1; v5's CSMEM)."""

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
def _q_chunk(qrow, qmask, kcs, kb, C: gl.constexpr, WORDS: gl.constexpr):
    """Chunk C of the query, gathered in the K map's channel order (v4's, or v5's for word unpacking: WORDS),
    times the group's K channel scales."""
    kch = _q_channels(kb, C, WORDS)
    return gl.load(qrow + kch[:, None], mask=qmask, other=0.0) * gl.load(kcs + kch).to(gl.float32)[:, None]


@gluon.jit
def _q_channels(kb, C: gl.constexpr, WORDS: gl.constexpr):
    """The channel of chunk C's operand index kb in the K map's order (v4's, or v5's for word unpacking: WORDS;
    K_SCALES_V5 is the WORDS map as a shared-memory view)."""
    if WORDS:
        k = kb
        return 64 * ((k >> 1) & 3) + 16 * C + 8 * ((k >> 4) & 1) + 2 * ((k >> 3) & 1) + 4 * (k & 1) + (k >> 5)
    k = kb + 64 * C
    return 64 * ((k >> 1) & 3) + 4 * (k >> 4) + 2 * ((k >> 3) & 1) + (k & 1)


@gluon.jit
def _query(qrow, qmask, kcs, kb, S_L: gl.constexpr, WORDS: gl.constexpr = False, LO16: gl.constexpr = False):
    """q * K channel scale / its largest |value| (per row) as four (hi, lo) B-operand chunks, with the rows'
    sums (for the token offsets) and largest |values| in the scores' layout S_L. LO16 (v5's in-place unpack, WORDS
    order): the operands of low-nibble channels (k < 32 of a chunk) x 16, as its high nibbles come out 16 x code;
    the dots are then 16 x, which the caller folds into the row scale."""
    return _query_of(_q_chunk(qrow, qmask, kcs, kb, 0, WORDS), _q_chunk(qrow, qmask, kcs, kb, 1, WORDS),
                     _q_chunk(qrow, qmask, kcs, kb, 2, WORDS), _q_chunk(qrow, qmask, kcs, kb, 3, WORDS), kb, S_L, LO16)


@gluon.jit
def _query_of(c0, c1, c2, c3, kb, S_L: gl.constexpr, LO16: gl.constexpr):
    """_query's operands, row sums and largest |values| from the four chunks of q * K channel scale."""
    qsum = gl.sum(c0, axis=0) + gl.sum(c1, axis=0) + gl.sum(c2, axis=0) + gl.sum(c3, axis=0)
    amax = gl.maximum(gl.maximum(gl.max(gl.abs(c0), axis=0), gl.max(gl.abs(c1), axis=0)),
                      gl.maximum(gl.max(gl.abs(c2), axis=0), gl.max(gl.abs(c3), axis=0)))
    amax = gl.where(amax > 0, amax, 1.0)
    r = 1.0 / amax[None, :]
    if LO16:
        r = r * gl.where(kb < 32, 16.0, 1.0)[:, None]
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
def _online_softmax(dots, amax, qsum, ts, to, m_i, l_i):
    """A tile's scores from its raw dots (times the query's scale and the K token scales, plus the token offsets'
    share) and the online softmax's step: (the new running max, alpha, p, the new running sum)."""
    sc = dots * amax[None, :] * ts[:, None] + qsum[None, :] * to[:, None]
    m_new = gl.maximum(m_i, gl.max(sc, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[None, :])
    return m_new, alpha, p, l_i * alpha + gl.sum(p, axis=0)


@gluon.jit
def _softmax_tile(dots, amax, qsum, ts, to, tsv, tov, m_i, l_i, tprev, offacc, B_L: gl.constexpr):
    """One 16-token tile's online-softmax step from its raw dots and token scales/offsets (K: ts, to; V: tsv,
    tov): the new (m, l), the tile's largest V token scale (acc's unit), the offsets' running sum, the factor
    acc is rescaled by (alpha and the unit change) and p * tsv / tmax as hi + lo B operands."""
    m_new, alpha, p, l_i = _online_softmax(dots, amax, qsum, ts, to, m_i, l_i)
    tmax = gl.max(tsv, axis=0)
    tmax = gl.where(tmax > 0, tmax, 1.0)
    f = alpha * (tprev / tmax)          # the softmax's rescale and the unit change to this tile's
    offacc = offacc * f + gl.sum(p * (tov / tmax)[:, None], axis=0)
    p_hi, p_lo = _split16(p * (tsv / tmax)[:, None])
    return m_new, l_i, tmax, offacc, f, gl.convert_layout(p_hi, B_L), gl.convert_layout(p_lo, B_L)


@gluon.jit
def _softmax_tile_unit(dots, amax, qsum, ts, to, tsv, tov, m_i, l_i, offacc, runit, B_L: gl.constexpr):
    """_softmax_tile with one V unit a group (1 / runit, the group's largest V token scale of this head) instead of
    one a tile: acc changes unit only at a group's ends, so the factor it is rescaled by is the softmax's alpha alone,
    which is exactly 1 wherever no row's running max rose (decode_split_v5's LAZY skips that rescale)."""
    m_new, alpha, p, l_i = _online_softmax(dots, amax, qsum, ts, to, m_i, l_i)
    offacc = offacc * alpha + gl.sum(p * (tov * runit)[:, None], axis=0)
    p_hi, p_lo = _split16(p * (tsv * runit)[:, None])
    return m_new, l_i, offacc, alpha, gl.convert_layout(p_hi, B_L), gl.convert_layout(p_lo, B_L)


@gluon.jit
def _store_split(o_ptr, ml_ptr, acc0, acc1, m_i, l_i, vch0, vch1, slot0, QPK: gl.constexpr, NSPLIT: gl.constexpr,
                 D: gl.constexpr, ROWS: gl.constexpr):
    """A program's (acc, m, l) where the combine kernel reads them: row n's slot is slot0 + n NSPLIT."""
    n = gl.arange(0, 8, layout=ROWS)
    slot = (slot0 + n * NSPLIT).to(gl.int64)
    gl.store(o_ptr + slot[None, :] * D + vch0[:, None], acc0, mask=(n < QPK)[None, :])
    gl.store(o_ptr + slot[None, :] * D + vch1[:, None], acc1, mask=(n < QPK)[None, :])
    gl.store(ml_ptr + slot * 2, m_i, mask=n < QPK)
    gl.store(ml_ptr + slot * 2 + 1, l_i, mask=n < QPK)


@gluon.jit
def _program(qr_ptr, ngroups_ptr, gps, HQ: gl.constexpr, QPK: gl.constexpr, D: gl.constexpr, B_L: gl.constexpr):
    """Program (s, h, j)'s identity: its sequence, KV head and split, its groups [g0, g1), and where its query
    rows are (the B operand's channel index kb, row pointers, the mask of real rows among the mma's 8)."""
    s = gl.program_id(0)
    h = gl.program_id(1)
    j = gl.program_id(2)
    g0 = j * gps
    g1 = gl.minimum(g0 + gps, gl.load(ngroups_ptr + s))
    kb = gl.arange(0, D // 4, layout=gl.SliceLayout(1, B_L))
    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, B_L))
    qrow = qr_ptr + (s * HQ + h * QPK + nb).to(gl.int64)[None, :] * D
    return s, h, j, g0, g1, kb, qrow, (nb < QPK)[None, :]


@gluon.jit
def _run_start(D: gl.constexpr, ROWS: gl.constexpr):
    """An empty run: the V channels of acc's rows (two halves), m = -inf, l = 0, acc = 0."""
    rv = gl.arange(0, D // 2, layout=gl.SliceLayout(1, MMA))
    vch0 = ((rv & 7) << 5) | (rv >> 3)
    return (vch0, vch0 + 16, gl.full([8], float("-inf"), gl.float32, layout=ROWS),
            gl.zeros([8], gl.float32, layout=ROWS), gl.zeros([D // 2, 8], gl.float32, layout=MMA),
            gl.zeros([D // 2, 8], gl.float32, layout=MMA))


@gluon.jit
def _group_open(f16_ptr, fb, h, qrow, qmask, kb, acc0, acc1, vch0, vch1, K_CS: gl.constexpr, V_CS: gl.constexpr,
                D: gl.constexpr, ROWS: gl.constexpr, WORDS: gl.constexpr, LO16: gl.constexpr = False):
    """A group's start: the query in its K channel scales (_query), and the running P.V sums moved into this
    group's V channel units (they are kept in units of the current group's scales, see _group_close)."""
    q0, q1, q2, q3, qsum, amax = _query(qrow, qmask, f16_ptr + fb + K_CS // 2 + h * D, kb, ROWS, WORDS, LO16)
    vcs = f16_ptr + fb + V_CS // 2 + h * D
    acc0 = acc0 * _rcp(gl.load(vcs + vch0).to(gl.float32))[:, None]
    acc1 = acc1 * _rcp(gl.load(vcs + vch1).to(gl.float32))[:, None]
    return q0, q1, q2, q3, qsum, amax, vcs, acc0, acc1


@gluon.jit
def _rcp(x):
    """1 / x as one MUFU.RCP (rcp.approx.ftz.f32, within 1 ulp): fp32 `/` compiles to div.full's range checks and
    rescales, ~8 instructions a value, and a group's start divides acc by 32 V channel scales a thread (fp16 values:
    normal, far from the range the checks are for)."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _group_close(vcs, acc0, acc1, vch0, vch1, offacc, tprev):
    """A group's end: the token-offset term added once and the sums scaled back by the V channel scales and the
    last token scale, so the next group (or the store) sees true values."""
    return _group_close_of(gl.load(vcs + vch0).to(gl.float32), gl.load(vcs + vch1).to(gl.float32), acc0, acc1,
                           offacc, tprev)


@gluon.jit
def _group_close_of(vcs0, vcs1, acc0, acc1, offacc, tprev):
    """_group_close with the V channel scales of acc0's and acc1's rows given (fp32)."""
    acc0 = (acc0 + offacc[None, :]) * (vcs0 * tprev)[:, None]
    acc1 = (acc1 + offacc[None, :]) * (vcs1 * tprev)[:, None]
    return acc0, acc1


@gluon.jit
def _cs_fill(csk, csv, b, head_scales, K_CS: gl.constexpr, V_CS: gl.constexpr):
    """A group's K and V channel scales of this head (2 x 512 B; head_scales: the page's fp16 base + this head's
    [256] offsets, 16 B a lane) into buffer b of csk, csv by cp.async (v5's CSMEM); they join the next commit group."""
    _copy(csk.index(b), head_scales + K_CS // 2)
    _copy(csv.index(b), head_scales + V_CS // 2)


@gluon.jit
def _view(buf, shape: gl.constexpr, layout: gl.constexpr):
    """buf (fp16) seen with another shape and shared layout: the same bytes, other coordinates."""
    if _PUBLIC_REINTERPRET:
        v = buf.reinterpret(gl.float16, shape, layout)
    else:
        v = buf._reinterpret(gl.float16, shape, layout)
    return v


@gluon.jit
def _v_scales_smem(csv, b, ROWS16: gl.constexpr):
    """Buffer b's V channel scales of acc0's and acc1's rows (fp32 in ROWS16, acc's row layout): read through
    V_SCALES as [half, row] in a layout with the half in registers and the rows where ROWS16 has them, then split."""
    VL: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [16, 0], [32, 0], [64, 0], [0, 1]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[], block_bases=[], shape=[128, 2])
    x = _view(csv.index(b), [2, 128], V_SCALES).permute([1, 0]).load(VL).to(gl.float32)
    v0, v1 = x.split()
    return gl.convert_layout(v0, ROWS16), gl.convert_layout(v1, ROWS16)


@gluon.jit
def _v_unit_smem(cst, b, h, HKV: gl.constexpr, T: gl.constexpr):
    """LAZY's unit from buffer b of cst (a group's V token scales of all heads, [T, HKV] as [T HKV / 8, 8] rows of
    16 B): the largest of head h's (scales are >= 0, so the other heads' entries masked to 0 change nothing)."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0])
    x = cst.index(b).load(L).to(gl.float32)
    mine = (gl.arange(0, 8, layout=gl.SliceLayout(0, L)) % HKV == h)[None, :]
    return gl.max(gl.max(gl.where(mine, x, 0.0), axis=1), axis=0)


@gluon.jit
def _group_open_smem(csk, csv, b, qr, kb, acc0, acc1, B_L: gl.constexpr, ROWS: gl.constexpr, ROWS16: gl.constexpr,
                     LO16: gl.constexpr):
    """_group_open from shared memory (v5's CSMEM): the query parked once a program (qr, the four chunks in their
    operand layout) times buffer b's K channel scales read through K_SCALES_V5 (as [k, chunk] with the chunk in
    registers and k where the operand has it, then split), and acc into buffer b's V channel units; no global load
    waits at the group's start."""
    KL: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0], [0, 1], [0, 2]],
        lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]], warp_bases=[], block_bases=[], shape=[64, 4])
    x = _view(csk.index(b), [4, 64], K_SCALES_V5).permute([1, 0]).load(KL).to(gl.float32)
    e, o = x.reshape([64, 2, 2]).split()     # chunk 2 a + c: e holds c = 0 (chunks 0, 2), o c = 1 (1, 3)
    k0, k2 = e.split()
    k1, k3 = o.split()
    S: gl.constexpr = gl.SliceLayout(1, B_L)
    q0, q1, q2, q3, qsum, amax = _query_of(qr.index(0).load(B_L) * gl.convert_layout(k0, S)[:, None],
                                           qr.index(1).load(B_L) * gl.convert_layout(k1, S)[:, None],
                                           qr.index(2).load(B_L) * gl.convert_layout(k2, S)[:, None],
                                           qr.index(3).load(B_L) * gl.convert_layout(k3, S)[:, None],
                                           kb, ROWS, LO16)
    vcs0, vcs1 = _v_scales_smem(csv, b, ROWS16)
    return q0, q1, q2, q3, qsum, amax, acc0 * _rcp(vcs0)[:, None], acc1 * _rcp(vcs1)[:, None]


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
    s, h, j, g0, g1, kb, qrow, qmask = _program(qr_ptr, ngroups_ptr, gps, HQ, QPK, D, B_L)
    tk = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, K_CHUNK)))[:, None, None]
    ak = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, K_CHUNK)))[None, :, None]
    ck = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, K_CHUNK)))[None, None, :]
    kbyte = 32 * ak + ck
    tv = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, V_HALF)))[:, None, None]
    xv = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, V_HALF)))[None, :, None]
    yv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, V_HALF)))[None, None, :]
    vbyte = 8 * xv + yv
    tm = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    vch0, vch1, m_i, l_i, acc0, acc1 = _run_start(D, ROWS)
    bt_row = bt_ptr + s.to(gl.int64) * stride_bt
    for g in range(g0, g1):
        base = gl.load(bt_row + g).to(gl.int64) * page_bytes
        fb = base // 2
        q0, q1, q2, q3, qsum, amax, vcs, acc0, acc1 = _group_open(f16_ptr, fb, h, qrow, qmask, kb, acc0, acc1,
                                                                 vch0, vch1, K_CS, V_CS, D, ROWS, False)
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
            tsv = gl.load(f16_ptr + fb + V_TS // 2 + (t0 + tm) * HKV + h).to(gl.float32)
            tov = gl.load(f16_ptr + fb + V_TO // 2 + (t0 + tm) * HKV + h).to(gl.float32)
            m_i, l_i, tprev, offacc, f, p_hi, p_lo = _softmax_tile(dots, amax, qsum, ts, to, tsv, tov, m_i, l_i,
                                                                   tprev, offacc, B_L)
            acc0 = _v_half(vt, p_hi, p_lo, acc0 * f[None, :], A_L, PTX)
            acc1 = _v_half(vt + 4, p_hi, p_lo, acc1 * f[None, :], A_L, PTX)
        acc0, acc1 = _group_close(vcs, acc0, acc1, vch0, vch1, offacc, tprev)
    _store_split(o_ptr, ml_ptr, acc0, acc1, m_i, l_i, vch0, vch1, (s * HQ + h * QPK) * NSPLIT + j, QPK, NSPLIT, D,
                 ROWS)


# ----------------------------------------------------------------------------- v5: v4 fed by a cp.async ring

def _k_word_ptx(subnormal: bool, inplace: bool = False) -> str:
    """One K code word (4 bytes, 8 nibbles) -> 8 fp16 as two outputs of 4 (pack 4: output 0 is $0 $1, output 1 $2
    $3): the low nibbles, then the high ones, each as pairs (byte 0, byte 2), (byte 1, byte 3). Magic: (w >> s) &
    0x000f000f | 0x64006400 is fp16x2 (1024 + code) in one lop3, then one subtraction for two codes (3 shifts, 4
    lop3, 4 sub.f16x2 a word, where v4's per-byte PTX spends 7 instructions on four codes). Subnormal: (w >> s) &
    0x000f000f alone is fp16x2 (code x 2^-24, an exact fp16 subnormal): 3 shifts and 4 lop3, and the kernel scales
    the dots by 2^24 (SUBNORMAL_UNIT). Measured on an H100 (2026-12-07) its output is 1.1e-4 from v1's (the magic
    unpack's: within 1e-5), so its tensor-core products are not exact: within the tests' attention bound."""
    lop = "and.b32 {d}, {s}, {k};" if subnormal else "lop3.b32 {d}, {s}, {k}, 0x64006400, 0xea;"
    out = ["{ .reg .b32 t, m; mov.b32 m, 0x64006400;", lop.format(d="$0", s="$4", k="0x000f000f")]
    if inplace:  # high nibbles masked where they lie (16 x code), one shift a word, not three
        out += [lop.format(d="$2", s="$4", k="0x00f000f0"), "shr.b32 t, $4, 8;",
                lop.format(d="$1", s="t", k="0x000f000f"), lop.format(d="$3", s="t", k="0x00f000f0")]
    else:
        for reg, shift in ((1, 8), (2, 4), (3, 12)):
            out.append(f"shr.b32 t, $4, {shift}; " + lop.format(d=f"${reg}", s="t", k="0x000f000f"))
    if not subnormal:
        out.append("sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; sub.f16x2 $2, $2, m; sub.f16x2 $3, $3, m;")
    return " ".join(out) + " }"


K_WORD = gl.constexpr(_k_word_ptx(False))
"""_k_word_ptx: the magic-number unpack of a K code word."""
K_WORD_SUB = gl.constexpr(_k_word_ptx(True))
"""_k_word_ptx: the subnormal unpack of a K code word (no subtraction; values are code x 2^-24)."""
K_WORD_IP = gl.constexpr(_k_word_ptx(False, True))
"""_k_word_ptx, in place: output 1 (the high nibbles) is 16 x code (v5's INPLACE)."""
K_WORD_SUB_IP = gl.constexpr(_k_word_ptx(True, True))
"""_k_word_ptx, subnormal and in place."""
SUBNORMAL_UNIT = gl.constexpr(16777216.0)
"""2^24: a code unpacked as an fp16 subnormal stands for code x 2^-24, so dot products of such codes are 2^-24 of
the true ones (far above fp32's smallest normal)."""


def _v_word_ptx(subnormal: bool = False, inplace: bool = False) -> str:
    """Two tokens' V code words (t in $16, t + 1 in $17; 16 crumbs each) -> 32 fp16 as four outputs of 8 (pack 8:
    output c is $(4c) ... $(4c + 3)): byte-permute the words to [t.b0, t.b1, t1.b0, t1.b1] and [t.b2, t.b3,
    t1.b2, t1.b3], then (x >> s) & 0x00030003 | 0x64006400 is (token t, token t + 1) of one crumb as fp16x2 -
    the pair the P.V A operand holds in one register (its k is the token) - less 1024 (magic), or (x >> s) &
    0x00030003 alone, the codes x 2^-24 as fp16 subnormals (subnormal; see _k_word_ptx)."""
    out = ["{ .reg .b32 lo, hi, lo8, hi8, t, m; mov.b32 m, 0x64006400; prmt.b32 lo, $16, $17, 0x5410; "
           "prmt.b32 hi, $16, $17, 0x7632;"]
    if inplace:  # bytes 1 and 3 moved down by two more permutes; crumb c masked where it lies (4^c x code)
        out.append("prmt.b32 lo8, $16, $17, 0x4501; prmt.b32 hi8, $16, $17, 0x6723;")
    for crumb in range(4):
        for k, (word, shift) in enumerate((("lo", 0), ("hi", 0), ("lo", 8), ("hi", 8))):
            reg, shift = 4 * crumb + k, shift + 2 * crumb
            if inplace:
                src, arg, mask = "", word + ("8" if shift >= 8 else ""), f"0x{0x00030003 << (2 * crumb):08x}"
            else:
                src, arg, mask = (f"shr.b32 t, {word}, {shift}; " if shift else ""), ("t" if shift else word), \
                    "0x00030003"
            out.append(f"{src}and.b32 ${reg}, {arg}, {mask};" if subnormal else
                       f"{src}lop3.b32 ${reg}, {arg}, {mask}, 0x64006400, 0xea; sub.f16x2 ${reg}, ${reg}, m;")
    return " ".join(out) + " }"


V_WORDS = gl.constexpr(_v_word_ptx())
"""_v_word_ptx(): output c's register 2 T0 + B1 holds crumb c of byte 2 B1 + T0 of tokens (t, t + 1)."""
V_WORDS_SUB = gl.constexpr(_v_word_ptx(True))
"""_v_word_ptx(subnormal=True): the same registers, codes x 2^-24."""
V_WORDS_IP = gl.constexpr(_v_word_ptx(False, True))
"""_v_word_ptx(inplace=True): output c is 4^c x code (v5's INPLACE)."""
V_WORDS_SUB_IP = gl.constexpr(_v_word_ptx(True, True))
"""_v_word_ptx, subnormal and in place."""


@gluon.jit
def _k_words(raw, q, dots, A_L: gl.constexpr, PRECISE: gl.constexpr, SUB: gl.constexpr, IP: gl.constexpr = False):
    """One 64-channel chunk of a 16-token K tile (raw: [16, 4 (a), 8 (byte)] in K_CHUNK) unpacked a word at a
    time (K_WORD, K_WORD_SUB: SUB, and their in-place forms: IP) and dotted with the query's hi (and, PRECISE, its
    lo) operand; channel map: _q_chunk's WORDS order."""
    if SUB and IP:
        asm: gl.constexpr = K_WORD_SUB_IP
    elif SUB:
        asm: gl.constexpr = K_WORD_SUB
    elif IP:
        asm: gl.constexpr = K_WORD_IP
    else:
        asm: gl.constexpr = K_WORD
    # element 2 B0 + B1 of a word's four holds byte 2 B1 + B0 (lop3 pairs bytes 0 and 2): k = nib b2 B0 a1 a0 B1
    a = _k_unpack(raw, asm).reshape([16, 4, 2, 2, 2, 2]).permute([0, 5, 2, 3, 1, 4]).reshape([16, 64])
    return _mma_hi_lo(gl.convert_layout(a, A_L, assert_trivial=True), q[0], q[1], dots, PRECISE)


@gluon.jit
def _k_unpack(raw, asm: gl.constexpr):
    """K code words -> fp16 by ``asm`` (a _k_word_ptx), the low and high nibbles joined along a new last axis."""
    lo, hi = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [raw], dtype=(gl.float16, gl.float16),
                                       is_pure=True, pack=4)
    return gl.join(lo, hi)


@gluon.jit
def _v_unpack(raw, asm: gl.constexpr):
    """Pairs of V code words -> fp16 by ``asm`` (a _v_word_ptx); crumb c = 2 b1 + b0 along two new last axes."""
    c0, c1, c2, c3 = gl.inline_asm_elementwise(asm, "=r," * 16 + "r,r", [raw],
                                               dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                               is_pure=True, pack=8)
    return gl.join(gl.join(c0, c1), gl.join(c2, c3))


@gluon.jit
def _mma_hi_lo(a, hi, lo, acc, PRECISE: gl.constexpr):
    """acc + a @ hi (+ a @ lo where PRECISE: the fp16 hi + lo split of a ~22-bit operand)."""
    acc = mma_v2(a, hi, acc)
    if PRECISE:
        acc = mma_v2(a, lo, acc)
    return acc


@gluon.jit
def _k_tile(ks, sl, q0, q1, q2, q3, A_L: gl.constexpr, PRECISE: gl.constexpr, SUB: gl.constexpr,
            IP: gl.constexpr = False):
    """A 16-token tile's raw dots [16, 8] from ring slot sl: four 64-channel chunks, one mma accumulator chain (two
    or four independent chains measured no faster on an H100, 2026-12-07)."""
    d = _k_words(ks.index(sl * 4 + 0).load(K_CHUNK), q0, gl.zeros([16, 8], gl.float32, layout=MMA), A_L, PRECISE, SUB,
                 IP)
    d = _k_words(ks.index(sl * 4 + 1).load(K_CHUNK), q1, d, A_L, PRECISE, SUB, IP)
    d = _k_words(ks.index(sl * 4 + 2).load(K_CHUNK), q2, d, A_L, PRECISE, SUB, IP)
    return _k_words(ks.index(sl * 4 + 3).load(K_CHUNK), q3, d, A_L, PRECISE, SUB, IP)


@gluon.jit
def _q_park(qs, q0, q1, q2, q3):
    """The group's query operands (four chunks, hi and lo) into shared memory, entry 2 c + (lo) (QSMEM)."""
    qs.index(0).store(q0[0])
    qs.index(1).store(q0[1])
    qs.index(2).store(q1[0])
    qs.index(3).store(q1[1])
    qs.index(4).store(q2[0])
    qs.index(5).store(q2[1])
    qs.index(6).store(q3[0])
    qs.index(7).store(q3[1])


@gluon.jit
def _q_op(qs, c: gl.constexpr, B_L: gl.constexpr, PRECISE: gl.constexpr):
    """Chunk c's (hi, lo) operands read back from shared memory (lo only where PRECISE needs it)."""
    hi = qs.index(2 * c).load(B_L)
    if PRECISE:
        lo = qs.index(2 * c + 1).load(B_L)
    else:
        lo = hi
    return hi, lo


@gluon.jit
def _k_tile_q(ks, sl, qs, q0, q1, q2, q3, A_L: gl.constexpr, B_L: gl.constexpr, PRECISE: gl.constexpr,
              SUB: gl.constexpr, QSMEM: gl.constexpr, IP: gl.constexpr = False):
    """_k_tile with the query's operands from registers, or (QSMEM) read from shared memory for this tile."""
    if QSMEM:
        q0 = _q_op(qs, 0, B_L, PRECISE)
        q1 = _q_op(qs, 1, B_L, PRECISE)
        q2 = _q_op(qs, 2, B_L, PRECISE)
        q3 = _q_op(qs, 3, B_L, PRECISE)
    return _k_tile(ks, sl, q0, q1, q2, q3, A_L, PRECISE, SUB, IP)


@gluon.jit
def _v_words(raw, p_hi, p_lo, acc, A_L: gl.constexpr, PRECISE: gl.constexpr, SUB: gl.constexpr,
             IP: gl.constexpr = False):
    """One 128-channel half of a 16-token V tile (raw: [16 (T), 8 (x), 4 (byte)] in V_HALF) unpacked two tokens'
    words at a time (V_WORDS, V_WORDS_SUB: SUB, and their in-place forms: IP), accumulated with p's hi (and,
    PRECISE, its lo) operand into acc (rows R <-> channel 32 (R & 7) + 16 c + (R >> 3))."""
    if SUB and IP:
        asm: gl.constexpr = V_WORDS_SUB_IP
    elif SUB:
        asm: gl.constexpr = V_WORDS_SUB
    elif IP:
        asm: gl.constexpr = V_WORDS_IP
    else:
        asm: gl.constexpr = V_WORDS
    # element (T0, B1, B0) of output c holds token 2 (T >> 1) + B0, byte 2 B1 + T0, crumb c
    v = _v_unpack(raw, asm).reshape([8, 2, 8, 2, 2, 2, 2])
    av = gl.convert_layout(v.permute([3, 1, 6, 5, 2, 0, 4]).reshape([128, 16]), A_L, assert_trivial=True)
    return _mma_hi_lo(av, p_hi, p_lo, acc, PRECISE)


@gluon.jit
def _ring_fill(ks, vs, ss, slot, kp, vp, sp, K_TS: gl.constexpr, K_TO: gl.constexpr, V_TS: gl.constexpr,
               V_TO: gl.constexpr):
    """One tile into ring slot ``slot`` by cp.async: K codes (4 chunks from kp), V codes (2 halves from vp), the
    four token-scale vectors [16 tokens, all heads] from sp; one commit group. Each thread copies exactly the
    code bytes it later reads (K_CHUNK / V_HALF both ways), so codes need no barrier; the scales are read by
    other lanes than copy them (the compiler's barrier after the wait covers it)."""
    _copy(ks.index(slot * 4 + 0), kp)
    _copy(ks.index(slot * 4 + 1), kp + 8)
    _copy(ks.index(slot * 4 + 2), kp + 16)
    _copy(ks.index(slot * 4 + 3), kp + 24)
    _copy(vs.index(slot * 2 + 0), vp)
    _copy(vs.index(slot * 2 + 1), vp + 4)
    _copy(ss.index(slot * 4 + 0), sp + K_TS // 2)
    _copy(ss.index(slot * 4 + 1), sp + K_TO // 2)
    _copy(ss.index(slot * 4 + 2), sp + V_TS // 2)
    _copy(ss.index(slot * 4 + 3), sp + V_TO // 2)
    async_copy.commit_group()


@gluon.jit
def _prefetch_scales(page, h, K_CS: gl.constexpr, V_CS: gl.constexpr, D: gl.constexpr):
    """Ask L1 for a page's K and V channel scales of head h (2 x 512 B: 8 lines of 128 B, lane i the line i % 8), so
    the group start that reads them (_group_open, _group_close) finds them there rather than in memory: an ncu
    profile of v5 (H100, 2026-12-07) put 26 % of its warps' stall samples at group starts, most waiting on them."""
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0])) % 8
    line = gl.where(lane < 4, K_CS + h * D * 2 + lane * 128, V_CS + h * D * 2 + (lane - 4) * 128)
    gl.inline_asm_elementwise("prefetch.global.L1 [$1]; mov.b32 $0, 0;", "=r,l", [page + line], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _ring_scale(ss, i, hsel, SC_RD: gl.constexpr, ROWS16: gl.constexpr):
    """Ring entry i of the token scales [16 tokens, 4 heads] -> this head's 16 as fp32 in the scores' row layout."""
    x = ss.index(i).load(SC_RD).to(gl.float32)
    return gl.convert_layout(gl.sum(gl.where(hsel, x, 0.0), axis=1), ROWS16)


@gluon.jit
def _tile_scales(ss, sl, hsel, SC_RD: gl.constexpr, ROWS16: gl.constexpr):
    """Ring slot sl's four token-scale vectors of this head (K scale, K offset, V scale, V offset; _ring_fill's
    order), each as fp32 in the scores' row layout."""
    return (_ring_scale(ss, sl * 4 + 0, hsel, SC_RD, ROWS16), _ring_scale(ss, sl * 4 + 1, hsel, SC_RD, ROWS16),
            _ring_scale(ss, sl * 4 + 2, hsel, SC_RD, ROWS16), _ring_scale(ss, sl * 4 + 3, hsel, SC_RD, ROWS16))


@gluon.jit
def _fill_ahead(ks, vs, ss, it, t0, base, base_n, u8_ptr, f16_ptr, kofs, vofs, sofs, K_TS: gl.constexpr,
                K_TO: gl.constexpr, V_TS: gl.constexpr, V_TO: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr,
                T: gl.constexpr, STAGES: gl.constexpr, TWO_WARPS: gl.constexpr = False):
    """Ring step of tile ``it`` (token t0 of its group): tile it + STAGES - 1, this group's or the next one's, into
    slot (it + STAGES - 1) % STAGES (v6's ring: TWO_WARPS)."""
    ahead = t0 + 16 * (STAGES - 1)
    nxt = ahead // T
    nbase = base + nxt * (base_n - base)
    nt = ahead - nxt * T
    kp = u8_ptr + nbase + nt * HKV * (D // 2) + kofs
    vp = u8_ptr + nbase + nt * HKV * (D // 4) + vofs
    sp = f16_ptr + nbase // 2 + nt * HKV + sofs
    if TWO_WARPS:
        _ring_fill3(ks, vs, ss, (it + STAGES - 1) % STAGES, kp, vp, sp, K_TS, K_TO, V_TS, V_TO)
    else:
        _ring_fill(ks, vs, ss, (it + STAGES - 1) % STAGES, kp, vp, sp, K_TS, K_TO, V_TS, V_TO)


@gluon.jit
def _pv_tile(ss, vs, sl, dots, amax, qsum, m_i, l_i, tprev, offacc, runit, acc0, acc1, hsel, SC_RD: gl.constexpr,
             ROWS16: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr, PRECISE_V: gl.constexpr, SUB: gl.constexpr,
             LAZY: gl.constexpr, IP: gl.constexpr = False):
    """A tile's softmax step (its token scales from ring slot sl) and P.V (its V codes from the slot) on its raw
    dots: (m, l, the unit, the offsets' sum, acc0, acc1) after it. LAZY: one unit a group (runit), acc rescaled
    only where a row's running max rose (_softmax_tile_unit); else one unit a tile (_softmax_tile)."""
    ts, to, tsv, tov = _tile_scales(ss, sl, hsel, SC_RD, ROWS16)
    if LAZY:
        m_old = m_i
        m_i, l_i, offacc, f, p_hi, p_lo = _softmax_tile_unit(dots, amax, qsum, ts, to, tsv, tov, m_i, l_i, offacc,
                                                             runit, B_L)
        if gl.max(m_i - m_old, axis=0) > 0:   # a row's max rose: its alpha < 1 (else every alpha is 1)
            acc0 = acc0 * f[None, :]
            acc1 = acc1 * f[None, :]
    else:
        m_i, l_i, tprev, offacc, f, p_hi, p_lo = _softmax_tile(dots, amax, qsum, ts, to, tsv, tov, m_i, l_i, tprev,
                                                               offacc, B_L)
        acc0 = acc0 * f[None, :]
        acc1 = acc1 * f[None, :]
    acc0 = _v_words(vs.index(sl * 2 + 0).load(V_HALF), p_hi, p_lo, acc0, A_L, PRECISE_V, SUB, IP)
    acc1 = _v_words(vs.index(sl * 2 + 1).load(V_HALF), p_hi, p_lo, acc1, A_L, PRECISE_V, SUB, IP)
    return m_i, l_i, tprev, offacc, acc0, acc1


@gluon.jit
def decode_split_v5(qr_ptr, u8_ptr, f16_ptr, bt_ptr, stride_bt, ngroups_ptr, o_ptr, ml_ptr, page_bytes, gps,
                    K_CODES: gl.constexpr, K_TS: gl.constexpr, K_TO: gl.constexpr, K_CS: gl.constexpr,
                    V_CODES: gl.constexpr, V_TS: gl.constexpr, V_TO: gl.constexpr, V_CS: gl.constexpr,
                    HKV: gl.constexpr, QPK: gl.constexpr, D: gl.constexpr, T: gl.constexpr,
                    NSPLIT: gl.constexpr, STAGES: gl.constexpr, PRECISE_K: gl.constexpr = True,
                    PRECISE_V: gl.constexpr = True, SUB: gl.constexpr = False, LAZY: gl.constexpr = False,
                    PREFETCH: gl.constexpr = False, SKEW: gl.constexpr = False, QSMEM: gl.constexpr = False,
                    INPLACE: gl.constexpr = False, CSMEM: gl.constexpr = False):
    """v4's program (s, h, j) with every tile's codes and token scales copied STAGES - 1 tiles ahead into a ring
    of shared memory (cp.async), so no global load waits in the token loop; codes unpacked a word at a time.
    PRECISE_K / PRECISE_V: the query / p as fp16 hi + lo operands (two mma each, v1's precision) or hi alone.
    SUB: codes unpacked as fp16 subnormals (code x 2^-24, no subtraction: _k_word_ptx), the dots' and P.V sums'
    unit 2^-24, undone once a group. LAZY: one V unit a group (_softmax_tile_unit), so acc is rescaled only in tiles
    where a row's running max rose. PREFETCH: the next group's K and V channel scales of this head are asked into L1
    at a group's start (_prefetch_scales), so the next group's start does not wait on them from memory. SKEW: a tile's
    dots are computed before the previous tile's softmax and P.V, two independent chains in one step (needs STAGES
    >= 3: a slot is refilled only after its P.V). QSMEM: the query's operands live in shared memory, stored once a
    group and read by every tile (_q_park, _q_op), not in 32 or 64 registers a thread for the whole run (measured
    4-8 % faster at precise "kv" on an H100; register caps stay slower with it). INPLACE: codes masked where they
    lie in their word, not shifted down first (_k_word_ptx / _v_word_ptx: one shift a K word, not three; two more
    permutes for two V words, not twelve shifts): a K word's high nibbles come out 16 x code, folded into the query's
    low-nibble operands (x 16) and the dots' row scale (/ 16); V crumb c comes out 4^c x code, the channel & 3 of
    acc's row, folded into acc at a group's ends. CSMEM: a group's start reads only shared memory: its K and V channel
    scales were copied there by cp.async a group ahead (_cs_fill, two buffers) and the query's four chunks parked once
    a program (10 KiB), where it otherwise loads both from memory (~160 loads a thread) and waits on them; with LAZY
    also the group's V token scales of all heads (2 x 1 KiB), for the group's unit."""
    gl.static_assert(D == 256, "v5's channel maps are for head_dim 256")
    gl.static_assert(QPK <= 8, "v5 holds a KV head's query rows in the mma's 8 columns")
    gl.static_assert(HKV == 4, "v5 reads a tile's token scales as [16 tokens, 4 heads]")
    gl.static_assert(STAGES >= 2 and STAGES <= T // 16 + 1, "the ring looks ahead at most one group")
    gl.static_assert(not SKEW or STAGES >= 3, "the skewed loop holds two tiles and lands a third: 3 stages or more")
    A_L: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_L: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    ROWS: gl.constexpr = gl.SliceLayout(0, MMA)
    ROWS16: gl.constexpr = gl.SliceLayout(1, MMA)
    HQ: gl.constexpr = HKV * QPK
    RING: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    SC_CP: gl.constexpr = gl.BlockedLayout([1, 2], [16, 2], [1, 1], [1, 0])
    SC_RD: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]], warp_bases=[],
        block_bases=[], shape=[16, 4])
    s, h, j, g0, g1, kb, qrow, qmask = _program(qr_ptr, ngroups_ptr, gps, HQ, QPK, D, B_L)
    tk = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, K_CHUNK)))[:, None, None]
    ak = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, K_CHUNK)))[None, :, None]
    ck = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, K_CHUNK)))[None, None, :]
    kofs = K_CODES + (tk * HKV + h) * (D // 2) + 32 * ak + ck
    tv = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, V_HALF)))[:, None, None]
    xv = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, V_HALF)))[None, :, None]
    yv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, V_HALF)))[None, None, :]
    vofs = V_CODES + (tv * HKV + h) * (D // 4) + 8 * xv + yv
    sofs = (gl.arange(0, 16, layout=gl.SliceLayout(1, SC_CP))[:, None] * HKV
            + gl.arange(0, HKV, layout=gl.SliceLayout(0, SC_CP))[None, :])
    hsel = gl.arange(0, HKV, layout=gl.SliceLayout(0, SC_RD))[None, :] == h
    vch0, vch1, m_i, l_i, acc0, acc1 = _run_start(D, ROWS)
    vf0 = gl.exp2(((vch0 & 3) * 2).to(gl.float32))     # INPLACE: 4^(crumb) of acc's rows
    vf1 = gl.exp2(((vch1 & 3) * 2).to(gl.float32))
    ks = gl.allocate_shared_memory(gl.uint8, [STAGES * 4, 16, 4, 8], RING)
    vs = gl.allocate_shared_memory(gl.uint8, [STAGES * 2, 16, 8, 4], RING)
    ss = gl.allocate_shared_memory(gl.float16, [STAGES * 4, 16, HKV], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    qs = gl.allocate_shared_memory(gl.float16, [8 if QSMEM else 1, D // 4, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    csk = gl.allocate_shared_memory(gl.float16, [2 if CSMEM else 1, D], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    csv = gl.allocate_shared_memory(gl.float16, [2 if CSMEM else 1, D], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    qr = gl.allocate_shared_memory(gl.float32, [4 if CSMEM else 1, D // 4, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    csofs = h * D + gl.arange(0, D, layout=gl.BlockedLayout([8], [32], [1], [0]))   # 16 B a lane
    cst = gl.allocate_shared_memory(gl.float16, [2 if CSMEM and LAZY else 1, T * HKV // 8, 8],
                                    gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    TS_CP: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0])
    tsofs = (V_TS // 2 + gl.arange(0, T * HKV // 8, layout=gl.SliceLayout(1, TS_CP))[:, None] * 8
             + gl.arange(0, 8, layout=gl.SliceLayout(0, TS_CP))[None, :])
    bt_row = bt_ptr + s.to(gl.int64) * stride_bt
    # an empty program (g0 >= g1) fills its ring from page 0 and reads none of it
    base = gl.load(bt_row + g0, mask=g0 < g1, other=0).to(gl.int64) * page_bytes
    if CSMEM:  # the first group's channel scales (a commit group of their own) and the query, parked once
        _cs_fill(csk, csv, 0, f16_ptr + base // 2 + csofs, K_CS, V_CS)
        if LAZY:
            _copy(cst.index(0), f16_ptr + base // 2 + tsofs)
        async_copy.commit_group()
        for c in gl.static_range(4):
            qr.index(c).store(gl.load(qrow + _q_channels(kb, c, True)[:, None], mask=qmask, other=0.0))
    for i in gl.static_range(STAGES - 1):           # the first tiles, all in group g0
        _ring_fill(ks, vs, ss, i, u8_ptr + base + i * 16 * HKV * (D // 2) + kofs,
                   u8_ptr + base + i * 16 * HKV * (D // 4) + vofs, f16_ptr + base // 2 + i * 16 * HKV + sofs,
                   K_TS, K_TO, V_TS, V_TO)
    it = 0
    for g in range(g0, g1):
        fb = base // 2
        base_n = gl.load(bt_row + gl.minimum(g + 1, g1 - 1)).to(gl.int64) * page_bytes   # the last group: itself
        if PREFETCH:
            _prefetch_scales(u8_ptr + base_n, h, K_CS, V_CS, D)
        if CSMEM:
            b = (g - g0) % 2
            # this group's scales landed: they joined the commit group of the last group's first tile (the first
            # group's: one of their own before the ring's), followed by T / 16 - 1 tiles' groups (STAGES - 1 for g0)
            if STAGES - 1 < T // 16:
                async_copy.wait_group(STAGES - 1)
            else:
                async_copy.wait_group(T // 16 - 1)
            _barrier()                           # copied by other lanes than read them
            q0, q1, q2, q3, qsum, amax, acc0, acc1 = _group_open_smem(csk, csv, b, qr, kb, acc0, acc1, B_L, ROWS,
                                                                      ROWS16, INPLACE)
            _cs_fill(csk, csv, 1 - b, f16_ptr + base_n // 2 + csofs, K_CS, V_CS)   # the next group's (last: its own)
            if LAZY:
                _copy(cst.index(1 - b), f16_ptr + base_n // 2 + tsofs)
        else:
            q0, q1, q2, q3, qsum, amax, vcs, acc0, acc1 = _group_open(f16_ptr, fb, h, qrow, qmask, kb, acc0, acc1,
                                                                     vch0, vch1, K_CS, V_CS, D, ROWS, True, INPLACE)
        if INPLACE:  # the dots come out 16 x (the query's low-nibble operands are); acc row R in units 4^-(vch & 3)
            amax = amax * (1.0 / 16.0)
            acc0 = acc0 * vf0[:, None]
            acc1 = acc1 * vf1[:, None]
        if QSMEM:
            _q_park(qs, q0, q1, q2, q3)
        if SUB:  # the dots come out 2^-24 of the true ones, and P.V accumulates in units 2^-24 of acc's
            amax = amax * SUBNORMAL_UNIT
            acc0 = acc0 * (1.0 / SUBNORMAL_UNIT)
            acc1 = acc1 * (1.0 / SUBNORMAL_UNIT)
        tprev = 1.0
        runit = 1.0
        if LAZY:  # the group's largest V token scale of head h: acc's unit for the whole group
            if CSMEM:   # from its copy (all heads' [T, HKV])
                unit = _v_unit_smem(cst, b, h, HKV, T)
            else:
                tg = gl.arange(0, T, layout=gl.BlockedLayout([T // 32], [32], [1], [0]))
                unit = gl.max(gl.load(f16_ptr + fb + V_TS // 2 + tg * HKV + h).to(gl.float32), axis=0)
            tprev = gl.where(unit > 0, unit, 1.0)
            runit = 1.0 / tprev
            acc0 = acc0 * runit
            acc1 = acc1 * runit
        offacc = gl.zeros([8], gl.float32, layout=ROWS)
        if SKEW:
            # tile 0's dots first; then each step computes tile t's dots before tile t - 1's softmax and P.V (two
            # independent chains the scheduler interleaves) and refills tile t - 1's slot only after its P.V
            async_copy.wait_group(STAGES - 2)
            sl = it % STAGES
            dots = _k_tile_q(ks, sl, qs, q0, q1, q2, q3, A_L, B_L, PRECISE_K, SUB, QSMEM, INPLACE)
            _fill_ahead(ks, vs, ss, it, 0, base, base_n, u8_ptr, f16_ptr, kofs, vofs, sofs, K_TS, K_TO, V_TS, V_TO,
                        HKV, D, T, STAGES)
            it += 1
            for t0 in range(16, T, 16):
                async_copy.wait_group(STAGES - 2)
                sp = sl
                sl = it % STAGES
                dots_n = _k_tile_q(ks, sl, qs, q0, q1, q2, q3, A_L, B_L, PRECISE_K, SUB, QSMEM, INPLACE)
                m_i, l_i, tprev, offacc, acc0, acc1 = _pv_tile(ss, vs, sp, dots, amax, qsum, m_i, l_i, tprev, offacc,
                                                               runit, acc0, acc1, hsel, SC_RD, ROWS16, A_L, B_L,
                                                               PRECISE_V, SUB, LAZY, INPLACE)
                dots = dots_n
                _fill_ahead(ks, vs, ss, it, t0, base, base_n, u8_ptr, f16_ptr, kofs, vofs, sofs, K_TS, K_TO, V_TS,
                            V_TO, HKV, D, T, STAGES)
                it += 1
            m_i, l_i, tprev, offacc, acc0, acc1 = _pv_tile(ss, vs, sl, dots, amax, qsum, m_i, l_i, tprev, offacc,
                                                           runit, acc0, acc1, hsel, SC_RD, ROWS16, A_L, B_L,
                                                           PRECISE_V, SUB, LAZY, INPLACE)
        else:
            for t0 in range(0, T, 16):
                # tile it + STAGES - 1 (this group's or the next one's) into the slot tile it - 1 was read from
                _fill_ahead(ks, vs, ss, it, t0, base, base_n, u8_ptr, f16_ptr, kofs, vofs, sofs, K_TS, K_TO, V_TS,
                            V_TO, HKV, D, T, STAGES)
                async_copy.wait_group(STAGES - 1)        # tile it has landed
                sl = it % STAGES
                dots = _k_tile_q(ks, sl, qs, q0, q1, q2, q3, A_L, B_L, PRECISE_K, SUB, QSMEM, INPLACE)
                m_i, l_i, tprev, offacc, acc0, acc1 = _pv_tile(ss, vs, sl, dots, amax, qsum, m_i, l_i, tprev, offacc,
                                                               runit, acc0, acc1, hsel, SC_RD, ROWS16, A_L, B_L,
                                                               PRECISE_V, SUB, LAZY, INPLACE)
                it += 1
        if SUB:
            acc0 = acc0 * SUBNORMAL_UNIT
            acc1 = acc1 * SUBNORMAL_UNIT
        if INPLACE:
            acc0 = acc0 * (1.0 / vf0)[:, None]
            acc1 = acc1 * (1.0 / vf1)[:, None]
        if CSMEM:
            vcs0, vcs1 = _v_scales_smem(csv, b, ROWS16)
            acc0, acc1 = _group_close_of(vcs0, vcs1, acc0, acc1, offacc, tprev)
        else:
            acc0, acc1 = _group_close(vcs, acc0, acc1, vch0, vch1, offacc, tprev)
        base = base_n
    async_copy.wait_group(0)
    _store_split(o_ptr, ml_ptr, acc0, acc1, m_i, l_i, vch0, vch1, (s * HQ + h * QPK) * NSPLIT + j, QPK, NSPLIT, D,
                 ROWS)


# ------------------------------------------------------------------ v6: v5 on two warps, half the channels each

MMA3 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 1, 1], instr_shape=[1, 16, 8]))
"""Two warps' mma.m16n8k16 accumulators, warp w along dim 0: partial scores S^T [w, 16 tokens, 8 rows] (warp w's
two K chunks) and acc [w, 128 channels, 8 rows] (V half w)."""
K_CHUNK3 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 8, 0, 0]],
    lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
    warp_bases=[[1, 0, 0, 0]], block_bases=[], shape=[2, 16, 4, 8]))
"""K_CHUNK with warp w holding chunk 2 w + i (i: the ring entry)."""
V_HALF3 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 8, 0, 0]],
    lane_bases=[[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
    warp_bases=[[1, 0, 0, 0]], block_bases=[], shape=[2, 16, 8, 4]))
"""V_HALF with warp w holding V half w."""


@gluon.jit
def _k_words3(raw, q, dots, A3: gl.constexpr, PRECISE: gl.constexpr):
    """_k_words on both warps' chunks at once (raw [2, 16, 4, 8] in K_CHUNK3; q: (hi, lo) [2, 64, 8])."""
    a = _k_unpack(raw, K_WORD).reshape([2, 16, 4, 2, 2, 2, 2]).permute([0, 1, 6, 3, 4, 2, 5]).reshape([2, 16, 64])
    return _mma_hi_lo(gl.convert_layout(a, A3, assert_trivial=True), q[0], q[1], dots, PRECISE)


@gluon.jit
def _v_words3(raw, p_hi, p_lo, acc, A3: gl.constexpr, PRECISE: gl.constexpr):
    """_v_words on both warps' V halves at once (raw [2, 16, 8, 4] in V_HALF3; p: [2, 16, 8], the same in both)."""
    v = _v_unpack(raw, V_WORDS).reshape([2, 8, 2, 8, 2, 2, 2, 2])
    av = gl.convert_layout(v.permute([0, 4, 2, 7, 6, 3, 1, 5]).reshape([2, 128, 16]), A3, assert_trivial=True)
    return _mma_hi_lo(av, p_hi, p_lo, acc, PRECISE)


@gluon.jit
def _q_chunk3(qrow, qmask, kcs, kb, w, PART: gl.constexpr):
    """Warp w's chunk 2 w + PART of the query ([2, 64, 8]), in v5's word order, times the group's K channel scales."""
    k = kb
    kch = 64 * ((k >> 1) & 3) + 16 * (2 * w + PART) + 8 * ((k >> 4) & 1) + 2 * ((k >> 3) & 1) + 4 * (k & 1) + (k >> 5)
    return gl.load(qrow + kch, mask=qmask, other=0.0) * gl.load(kcs + kch).to(gl.float32)


@gluon.jit
def _query3(qrow, qmask, kcs, kb, w, S_L: gl.constexpr):
    """_query for two warps: each its two chunks as (hi, lo) B operands [2, 64, 8], with the rows' sums and largest
    |values| over all 256 channels in the scores' row layout S_L."""
    c0 = _q_chunk3(qrow, qmask, kcs, kb, w, 0)
    c1 = _q_chunk3(qrow, qmask, kcs, kb, w, 1)
    qsum = gl.sum(gl.sum(c0, axis=1) + gl.sum(c1, axis=1), axis=0)
    amax = gl.max(gl.maximum(gl.max(gl.abs(c0), axis=1), gl.max(gl.abs(c1), axis=1)), axis=0)
    amax = gl.where(amax > 0, amax, 1.0)
    r = gl.expand_dims(gl.expand_dims(1.0 / amax, 0), 1)
    return _split16(c0 * r), _split16(c1 * r), gl.convert_layout(qsum, S_L), gl.convert_layout(amax, S_L)


@gluon.jit
def _rows3(x):
    """A [8] row vector (the scores' row layout) as [1, 1, 8], to scale acc [2, 128, 8]."""
    return gl.expand_dims(gl.expand_dims(x, 0), 0)


@gluon.jit
def decode_split_v6(qr_ptr, u8_ptr, f16_ptr, bt_ptr, stride_bt, ngroups_ptr, o_ptr, ml_ptr, page_bytes, gps,
                    K_CODES: gl.constexpr, K_TS: gl.constexpr, K_TO: gl.constexpr, K_CS: gl.constexpr,
                    V_CODES: gl.constexpr, V_TS: gl.constexpr, V_TO: gl.constexpr, V_CS: gl.constexpr,
                    HKV: gl.constexpr, QPK: gl.constexpr, D: gl.constexpr, T: gl.constexpr,
                    NSPLIT: gl.constexpr, STAGES: gl.constexpr, PRECISE_K: gl.constexpr = True,
                    PRECISE_V: gl.constexpr = True):
    """v5's program (s, h, j) on two warps that split the channels: warp w dots its two K chunks (2 w, 2 w + 1) with
    its half of the query, the two partial scores of a tile are summed (through shared memory), both warps run the
    same softmax step, and warp w accumulates V half w. Each warp holds half of v5's accumulator (32 registers, not
    64) and of the query's operands: aimed at more warps an SM than v5's 8 (docs/kvarn.md). Launch with 2 warps."""
    gl.static_assert(D == 256, "v6's channel maps are for head_dim 256")
    gl.static_assert(QPK <= 8, "v6 holds a KV head's query rows in the mma's 8 columns")
    gl.static_assert(HKV == 4, "v6 reads a tile's token scales as [16 tokens, 4 heads]")
    gl.static_assert(STAGES >= 2 and STAGES <= T // 16 + 1, "the ring looks ahead at most one group")
    A3: gl.constexpr = gl.DotOperandLayout(0, MMA3, 2)
    B3: gl.constexpr = gl.DotOperandLayout(1, MMA3, 2)
    S2: gl.constexpr = gl.SliceLayout(0, MMA3)
    ROWS: gl.constexpr = gl.SliceLayout(0, S2)
    ROWS16: gl.constexpr = gl.SliceLayout(1, S2)
    HQ: gl.constexpr = HKV * QPK
    RING: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    SC_CP: gl.constexpr = gl.BlockedLayout([1, 2], [16, 2], [2, 1], [1, 0])
    SC_RD: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]], warp_bases=[[0, 0]],
        block_bases=[], shape=[16, 4])
    s = gl.program_id(0)
    h = gl.program_id(1)
    j = gl.program_id(2)
    g0 = j * gps
    g1 = gl.minimum(g0 + gps, gl.load(ngroups_ptr + s))
    # the query's operand index: warp w, logical k, row n ([2, 64, 8] in B3)
    wq = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, B3)))[:, None, None]
    kb = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, B3)))[None, :, None]
    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, B3)))[None, None, :]
    qrow = qr_ptr + (s * HQ + h * QPK + nb).to(gl.int64) * D
    qmask = nb < QPK
    # code offsets: warp w copies (and reads) K chunks 2 w, 2 w + 1 and V half w
    wk = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, K_CHUNK3))))[:, None, None, None]
    tk = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, K_CHUNK3))))[None, :, None, None]
    ak = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, K_CHUNK3))))[None, None, :, None]
    ck = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, K_CHUNK3))))[None, None, None, :]
    kofs = K_CODES + (tk * HKV + h) * (D // 2) + 32 * ak + 16 * wk + ck
    wv = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, V_HALF3))))[:, None, None, None]
    tv = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, V_HALF3))))[None, :, None, None]
    xv = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, V_HALF3))))[None, None, :, None]
    yv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, V_HALF3))))[None, None, None, :]
    vofs = V_CODES + (tv * HKV + h) * (D // 4) + 8 * xv + 4 * wv + yv
    sofs = (gl.arange(0, 16, layout=gl.SliceLayout(1, SC_CP))[:, None] * HKV
            + gl.arange(0, HKV, layout=gl.SliceLayout(0, SC_CP))[None, :])
    hsel = gl.arange(0, HKV, layout=gl.SliceLayout(0, SC_RD))[None, :] == h
    # acc's rows: warp w's V half, row R <-> channel 32 (R & 7) + 16 w + (R >> 3)
    ACC_R: gl.constexpr = gl.SliceLayout(2, MMA3)
    rv = gl.arange(0, D // 2, layout=gl.SliceLayout(0, ACC_R))[None, :]
    vch = ((rv & 7) << 5) + (rv >> 3) + 16 * gl.arange(0, 2, layout=gl.SliceLayout(1, ACC_R))[:, None]
    m_i = gl.full([8], float("-inf"), gl.float32, layout=ROWS)
    l_i = gl.zeros([8], gl.float32, layout=ROWS)
    acc = gl.zeros([2, D // 2, 8], gl.float32, layout=MMA3)
    ks = gl.allocate_shared_memory(gl.uint8, [STAGES * 2, 2, 16, 4, 8], RING)
    vs = gl.allocate_shared_memory(gl.uint8, [STAGES, 2, 16, 8, 4], RING)
    ss = gl.allocate_shared_memory(gl.float16, [STAGES * 4, 16, HKV], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    bt_row = bt_ptr + s.to(gl.int64) * stride_bt
    base = gl.load(bt_row + g0, mask=g0 < g1, other=0).to(gl.int64) * page_bytes
    for i in gl.static_range(STAGES - 1):
        _ring_fill3(ks, vs, ss, i, u8_ptr + base + i * 16 * HKV * (D // 2) + kofs,
                    u8_ptr + base + i * 16 * HKV * (D // 4) + vofs, f16_ptr + base // 2 + i * 16 * HKV + sofs,
                    K_TS, K_TO, V_TS, V_TO)
    it = 0
    for g in range(g0, g1):
        fb = base // 2
        base_n = gl.load(bt_row + gl.minimum(g + 1, g1 - 1)).to(gl.int64) * page_bytes
        q0, q1, qsum, amax = _query3(qrow, qmask, f16_ptr + fb + K_CS // 2 + h * D, kb, wq, ROWS)
        vcs = f16_ptr + fb + V_CS // 2 + h * D
        acc = acc * _rcp(gl.load(vcs + vch).to(gl.float32))[:, :, None]
        tprev = 1.0
        offacc = gl.zeros([8], gl.float32, layout=ROWS)
        for t0 in range(0, T, 16):
            _fill_ahead(ks, vs, ss, it, t0, base, base_n, u8_ptr, f16_ptr, kofs, vofs, sofs, K_TS, K_TO, V_TS, V_TO,
                        HKV, D, T, STAGES, True)
            async_copy.wait_group(STAGES - 1)
            sl = it % STAGES
            d3 = _k_words3(ks.index(sl * 2 + 0).load(K_CHUNK3), q0, gl.zeros([2, 16, 8], gl.float32, layout=MMA3),
                           A3, PRECISE_K)
            d3 = _k_words3(ks.index(sl * 2 + 1).load(K_CHUNK3), q1, d3, A3, PRECISE_K)
            dots = gl.sum(d3, axis=0)                    # the two warps' partial scores
            ts, to, tsv, tov = _tile_scales(ss, sl, hsel, SC_RD, ROWS16)
            m_i, l_i, tprev, offacc, f, p_hi, p_lo = _softmax_tile(dots, amax, qsum, ts, to, tsv, tov, m_i, l_i,
                                                                   tprev, offacc, S2)
            acc = acc * _rows3(f)
            p_hi3 = gl.convert_layout(gl.expand_dims(p_hi, 0).broadcast_to([2, 16, 8]), B3)
            p_lo3 = gl.convert_layout(gl.expand_dims(p_lo, 0).broadcast_to([2, 16, 8]), B3)
            acc = _v_words3(vs.index(sl).load(V_HALF3), p_hi3, p_lo3, acc, A3, PRECISE_V)
            it += 1
        acc = (acc + _rows3(offacc)) * (gl.load(vcs + vch).to(gl.float32) * tprev)[:, :, None]
        base = base_n
    async_copy.wait_group(0)
    n = gl.arange(0, 8, layout=ROWS)
    slot = ((s * HQ + h * QPK) * NSPLIT + j + n * NSPLIT).to(gl.int64)
    gl.store(o_ptr + _rows3(slot) * D + vch[:, :, None], acc, mask=_rows3(n < QPK))
    gl.store(ml_ptr + slot * 2, m_i, mask=n < QPK)
    gl.store(ml_ptr + slot * 2 + 1, l_i, mask=n < QPK)


@gluon.jit
def _ring_fill3(ks, vs, ss, slot, kp, vp, sp, K_TS: gl.constexpr, K_TO: gl.constexpr, V_TS: gl.constexpr,
                V_TO: gl.constexpr):
    """_ring_fill for two warps: warp w's K chunks 2 w and 2 w + 1 (ring entries 2 slot, 2 slot + 1), its V half,
    the token scales (both warps copy the same bytes); one commit group."""
    _copy(ks.index(slot * 2 + 0), kp)
    _copy(ks.index(slot * 2 + 1), kp + 8)
    _copy(vs.index(slot), vp)
    _copy(ss.index(slot * 4 + 0), sp + K_TS // 2)
    _copy(ss.index(slot * 4 + 1), sp + K_TO // 2)
    _copy(ss.index(slot * 4 + 2), sp + V_TS // 2)
    _copy(ss.index(slot * 4 + 3), sp + V_TO // 2)
    async_copy.commit_group()
