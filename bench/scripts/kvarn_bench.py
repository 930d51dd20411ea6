"""KVarN kernels on a GPU: decode-attention error per context length, bytes per token, decode time vs fp16 SDPA.

One run, one table (also written as JSON with --json PATH). For one attention layer of this model
(24 query / 4 KV heads, head_dim 256):

* error rows (lengths --lengths, default 1k, 4k, 16k, 32k, 128k): K and V from
  ``reference.synthetic`` (Gaussian, hot channels, one outlier-scale token in 128), 4 decode
  queries; the reference is fp32 attention over the original K/V. Formats: ``kvarn`` (our
  quantize-on-write + our decode kernel on the packed paged cache), ``plain RTN`` (the same
  kernels and layout with rotation and normalization off: the reference's rotate=normalize=False
  option), ``fp8 e4m3`` (cast, scale 1, fp32 attention), ``fp16`` (cast, fp32 attention), and
  vLLM's ``turboquant_3bit_nc`` / ``turboquant_4bit_nc`` through vLLM's own Triton store and
  decode kernels when the installed vLLM has them (else a line says why not). Bytes per token per
  layer come from the allocated tensors.
* time rows (--time-lengths, default 8k, 32k, 128k; --batch 8 sequences): decode attention of one
  fp16 query token per sequence, ours (all launches: query rotation, split kernel, combine,
  un-rotation) vs torch SDPA over an fp16 cache [batch, 4, L, 256] (enable_gqa); torch.cuda.Event
  per iteration, --warmup then the median of --iters (>= 20). Effective bandwidth of ours = packed
  cache bytes read / time, against a measured device copy bandwidth (read + write of a 2 GiB
  tensor, same timing).
* long decode (its own table; JSON key ``long_decode``; --decode-checkpoints, default 128, 512, 2k,
  8k, 32k steps; --decode-prefill 1024 tokens; --decode-seqs 1): error accumulation over a
  synthetic autoregressive decode. A state x_t gives q_t, k_t, v_t by fixed random projections,
  shaped like the error rows' data (reference.synthetic's per-channel means and spreads, hot
  channels, and its outlier-scale tokens); k_t, v_t are appended to the cache one token at a time
  and o_t = attention of q_t over it; x_{t+1} = rmsnorm(0.5 W_x x_t + f W_o rmsnorm(o_t) + e_{t+1})
  (f: --decode-feedback, 0.25; e: exogenous inputs), so a cache's error changes later tokens,
  which are cached in turn. The same process (same seed, weights, inputs and prefilled context)
  runs with an fp32 cache (the reference), an fp32 rerun, fp16 and fp8 e4m3 (rounded on write,
  fp32 torch attention), ``kvarn`` and ``plain RTN`` (PagedKvarnCache, rotated or not, and its
  decode kernels), each also as a no-feedback control (no o_t term: the states are the format's
  and the reference's alike, so o's error is the per-step error). At each checkpoint: relative
  error and cosine of o and of x against the fp32 process, pooled over the last --decode-window
  (32) steps.

``--smoke``: tiny sizes on CPU through Triton's interpreter, to check the script end to end; its
time columns are printed as "smoke" (interpreter timings are not speeds). The long decode's smoke
prefills 252 tokens (one group and a 124-token tail) and decodes 8 steps (a group is quantized at
the 4th), checkpoints 2, 4, 8.

    python bench/scripts/kvarn_bench.py [--json PATH] [--smoke] [--seed 0] [--decode-checkpoints 128,512]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rig.kernels import load_file  # noqa: E402

KV_HEADS, HEAD_DIM, Q_HEADS, GROUP = 4, 256, 24, 128


def load_kernels(smoke: bool):
    """kernels/kvarn/kvarn_triton.py; --smoke sets TRITON_INTERPRET=1 first (triton reads it when it loads)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    return load_file(ROOT / "kernels" / "kvarn" / "kvarn_triton.py", "rig_kernel_kvarn_triton", fresh=True)


# ----------------------------------------------------------------------------- helpers

def attention_gqa(q, k, v):
    """fp32 softmax(q k^T / sqrt(d)) v for q [n, 24, d] over k, v [L, 4, d], without expanding K/V per query head."""
    import torch

    n, hq, d = q.shape
    hkv = k.shape[1]
    qq = q.float().view(n, hkv, hq // hkv, d)
    logits = torch.einsum("nhgd,lhd->nhgl", qq, k.float()) / math.sqrt(d)
    return torch.einsum("nhgl,lhd->nhgd", logits.softmax(-1), v.float()).reshape(n, hq, d)


def timed(fn, device, warmup: int, iters: int) -> float:
    """Median seconds of fn() over iters runs after warmup: CUDA events per iteration on a GPU, perf_counter on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_graph(fn, warmup: int, iters: int, reps: int = 10) -> float:
    """Median seconds of fn()'s GPU work alone: fn captured once in a CUDA graph, each timed sample ``reps``
    replays between two CUDA events, divided by reps. Eager timing (``timed``) also counts the host's launches
    when they are slower than the kernels (a few small kernels launched from Python are); this is what a decode
    step under CUDA graphs pays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a graph's first run compiles and allocates: not inside the capture
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replays():
        for _ in range(reps):
            graph.replay()

    return timed(replays, torch.device("cuda"), warmup, iters) / reps


def host_time(fn, calls: int, warmup: int = 5) -> float:
    """Mean host seconds of one fn() call over ``calls`` back-to-back calls, the GPU drained before and after: the
    host's cost of an eager call (Python and its launches) where the GPU's work is shorter (a short context)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return dt


def kvarn_cache(kt, k, v, seqs: int, rotated: bool):
    """One packed cache of k, v [L, 4, 256] (L % 128 == 0) shared by ``seqs`` sequences (same block table)."""
    import torch

    groups = k.shape[0] // GROUP
    pool = torch.empty(groups, kt.MODEL_LAYOUT.page_bytes, dtype=torch.uint8, device=k.device)
    pages = torch.arange(groups, dtype=torch.int32, device=k.device)
    shape = (groups, GROUP, KV_HEADS, HEAD_DIM)
    kt.quantize_groups(pool, pages, k.reshape(shape), v.reshape(shape), rotate_=rotated, normalize=rotated)
    return pool, pages.expand(seqs, groups).contiguous()


def decode_args(kt, pool, block_table, groups: int, dtype):
    """The decode_attention arguments after q for full groups and empty tails."""
    import torch

    s, dev = block_table.shape[0], pool.device
    n_groups = torch.full((s,), groups, dtype=torch.int32, device=dev)
    tail = torch.zeros(s, GROUP, KV_HEADS, HEAD_DIM, dtype=dtype, device=dev)
    return (pool, block_table, n_groups, groups, tail, tail, torch.zeros(s, dtype=torch.int32, device=dev))


# ----------------------------------------------------------------------------- vLLM TurboQuant

def turboquant(name: str):
    """vLLM's TurboQuant store + decode for preset ``name``: callable(q, k, v) -> (out, bytes/token), or why not."""
    try:
        from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
        from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention
        from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
    except Exception as e:  # noqa: BLE001 - any import failure is reported, not raised
        return f"{type(e).__name__}: {e}"

    def run(q, k, v):
        import torch

        dev, length, block = k.device, k.shape[0], 16
        cfg = TurboQuantConfig.from_cache_dtype(name, HEAD_DIM)
        h = _hadamard(HEAD_DIM, dev)
        cent = get_centroids(HEAD_DIM, cfg.centroid_bits).to(device=dev, dtype=torch.float32)
        srt = cent.sort().values
        blocks = math.ceil(length / block)
        cache = torch.zeros(blocks, block, KV_HEADS, cfg.slot_size_aligned, dtype=torch.uint8, device=dev)
        slots = torch.arange(length, dtype=torch.int32, device=dev)
        triton_turboquant_store(k.float(), v.float(), cache, slots, h, (srt[:-1] + srt[1:]) / 2,
                                mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                                value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
        n = q.shape[0]
        table = torch.arange(blocks, dtype=torch.int32, device=dev).expand(n, blocks).contiguous()
        lens = torch.full((n,), length, dtype=torch.int32, device=dev)
        out = triton_turboquant_decode_attention(
            q.half(), cache, table, lens, h, cent, 1 / math.sqrt(HEAD_DIM), cfg.mse_bits, cfg.key_packed_size,
            cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8, norm_correction=cfg.norm_correction, PiT=h)
        return out.float(), cache.nbytes / (blocks * block)

    return run


def _hadamard(d: int, device):
    """The normalized Sylvester Hadamard matrix (vLLM's TurboQuant uses the same rotation)."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device)


# ----------------------------------------------------------------------------- the measurements

def error_rows(kt, length: int, seed: int, device, tq: dict) -> list[dict]:
    """Attention-output error per format at one length (4 decode queries, fp32 reference over the original K/V)."""
    import torch

    r = kt.reference
    q, k, v = (t.to(device) for t in r.synthetic(length, seed, queries=4))
    exact = attention_gqa(q, k, v)
    rows = []

    def add(fmt, got, nbytes):
        rel, cos = r.errors(exact, got)
        rows.append({"tokens": length, "format": fmt, "rel_error": rel, "cosine": cos, "bytes_per_token": nbytes})

    groups = length // GROUP
    for fmt, rotated in (("kvarn", True), ("plain RTN", False)):
        pool, table = kvarn_cache(kt, k, v, q.shape[0], rotated)
        out = kt.decode_attention(q, *decode_args(kt, pool, table, groups, torch.float16), rotated=rotated)
        add(fmt, out, pool.nbytes / length)
        del pool
    for fmt, dtype in (("fp8 e4m3", torch.float8_e4m3fn), ("fp16", torch.float16)):
        kk, vv = k.to(dtype), v.to(dtype)
        add(fmt, attention_gqa(q, kk.float(), vv.float()), (kk.nbytes + vv.nbytes) / length)
    for name, run in tq.items():
        if isinstance(run, str):
            continue
        try:
            out, nbytes = run(q, k, v)
            add(name, out, nbytes)
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            tq[name] = f"failed at {length} tokens: {type(e).__name__}: {str(e)[:200]}"
    return rows


def copy_bandwidth(device, nbytes: int, warmup: int, iters: int) -> float:
    """Bytes/s of a device-to-device tensor copy (read + write counted)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, warmup, iters)


def decode_setup(kt, length: int, batch: int, device) -> dict:
    """The time rows' inputs: ``batch`` sequences of ``length`` random tokens (seeded by length) quantized into a
    packed pool (pages in order) and kept as an fp16 cache [batch, 4, L, 256]; an fp16 query [batch, 24, 256].

    Returns q, out (an fp16 buffer like q), args (decode_attention's arguments after q), pool, kf, vf and
    sdpa (a callable: torch SDPA of q over kf, vf with enable_gqa, the fp16 baseline).
    """
    import torch

    g = torch.Generator(device=device).manual_seed(length)
    groups = length // GROUP
    pool = torch.empty(batch * groups, kt.MODEL_LAYOUT.page_bytes, dtype=torch.uint8, device=device)
    kf = torch.empty(batch, KV_HEADS, length, HEAD_DIM, dtype=torch.float16, device=device)
    vf = torch.empty_like(kf)
    for s in range(batch):  # one sequence at a time bounds the fp32 scratch
        k = torch.randn(length, KV_HEADS, HEAD_DIM, generator=g, device=device)
        v = torch.randn(length, KV_HEADS, HEAD_DIM, generator=g, device=device)
        pages = torch.arange(s * groups, (s + 1) * groups, dtype=torch.int32, device=device)
        shape = (groups, GROUP, KV_HEADS, HEAD_DIM)
        kt.quantize_groups(pool, pages, k.reshape(shape), v.reshape(shape))
        kf[s], vf[s] = k.transpose(0, 1), v.transpose(0, 1)
        del k, v
    table = torch.arange(batch * groups, dtype=torch.int32, device=device).view(batch, groups)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=g, device=device).half()
    qs = q.view(batch, Q_HEADS, 1, HEAD_DIM)
    return {"q": q, "out": torch.empty_like(q), "args": decode_args(kt, pool, table, groups, torch.float16),
            "pool": pool, "kf": kf, "vf": vf,
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qs, kf, vf, enable_gqa=True)}


def time_rows(kt, length: int, batch: int, device, warmup: int, iters: int, copy_bps: float,
              tiles: dict) -> list[dict]:
    """Decode time of ours on the packed cache vs torch SDPA over an fp16 cache, ``batch`` sequences of ``length``."""
    x = decode_setup(kt, length, batch, device)
    q, out, args, pool, kf, vf = x["q"], x["out"], x["args"], x["pool"], x["kf"], x["vf"]
    ours = timed(lambda: kt.decode_attention(q, *args, out=out, **tiles), device, warmup, iters)
    sdpa = timed(x["sdpa"], device, warmup, iters)
    packed, plain = pool.nbytes, kf.nbytes + vf.nbytes
    return [
        {"tokens": length, "format": f"kvarn decode x{batch}", "seconds": ours, "speedup_vs_sdpa": sdpa / ours,
         "bytes_read": packed, "GBps": packed / ours / 1e9, "pct_of_copy": 100 * packed / ours / copy_bps,
         "bytes_per_token": packed / (batch * length)},
        {"tokens": length, "format": f"fp16 SDPA x{batch}", "seconds": sdpa, "speedup_vs_sdpa": 1.0,
         "bytes_read": plain, "GBps": plain / sdpa / 1e9, "pct_of_copy": 100 * plain / sdpa / copy_bps,
         "bytes_per_token": plain / (batch * length)},
    ]


# ----------------------------------------------------------------------------- long synthetic decode

STATE_DIM = 1024
"""The synthetic decode's state size (the process's own, not the model's hidden size)."""
MEMORY, FEEDBACK = 0.5, 0.25
"""x_{t+1} = rmsnorm(MEMORY W_x x_t + FEEDBACK W_o rmsnorm(o_t) + e_{t+1}); the no-feedback control drops o_t."""
TORCH_FORMATS = ("fp32", "fp32 (rerun)", "fp16", "fp8 e4m3")
"""Formats kept as fp32 K/V rounded on write (fp32 is not), attended in fp32 by torch; the first is the reference."""
PACKED_FORMATS = (("kvarn", True), ("plain RTN", False))
"""Formats held in a PagedKvarnCache (rotated or not) and attended by its decode kernels."""
MODES = ("feedback", "no feedback")


def rmsnorm(x):
    """x / RMS(x) over the last axis."""
    return x * x.square().mean(-1, keepdim=True).add(1e-12).rsqrt()


def attention_batched(q, k, v):
    """fp32 softmax(q k^T / sqrt(d)) v for one query per slot: q [S, 24, d] over k, v [S, 4, L, d] (head-major).

    attention_gqa's math with a cache per slot; the buffers' [:, :, :L] views go to matmul uncopied.
    """
    import torch

    s, hq, d = q.shape
    hkv = k.shape[1]
    qq = q.float().view(s, hkv, hq // hkv, d)
    logits = torch.matmul(qq, k.transpose(-1, -2)) / math.sqrt(d)
    return torch.matmul(logits.softmax(-1), v).reshape(s, hq, d)


def decode_process(r, prefill: int, steps: int, seqs: int, seed: int, device) -> dict:
    """The synthetic decode's fixed parts, all drawn from ``seed`` (the same for every format).

    The prefilled context is the error rows' data: the first ``prefill`` tokens of
    ``reference.synthetic(prefill + steps, seed)``. The decode tokens take that data's shape: each
    K/V channel's mean and spread over its ordinary tokens, and each token's outlier scale (a token
    whose RMS is over 3x the median's keeps its RMS / median, 6-10x in reference.synthetic; others 1),
    so a decode token at position n is k = scale_k[n] (mean_k + spread_k * z_k) with z_k from the state.
    Weights: W_qkv [24*256 + 2*4*256, STATE_DIM], W_x, W_o (Gaussian, unit gain); x_0 [seqs, STATE_DIM]
    and the exogenous inputs e [steps, seqs, STATE_DIM] (unit RMS), one per step and sequence.
    """
    import torch

    _, k, v = r.synthetic(prefill + steps, seed)

    def shape_of(x):
        norms = x.flatten(1).norm(dim=1)
        med = norms.median()
        scale = torch.where(norms > 3 * med, norms / med, torch.ones_like(norms))
        plain = x[scale == 1]
        return plain.mean(0), plain.std(0), scale

    g = torch.Generator().manual_seed(seed + 1)
    qd, kd = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"k_prefill": k[:prefill], "v_prefill": v[:prefill],
           "w_qkv": torch.randn(qd + 2 * kd, STATE_DIM, generator=g) / math.sqrt(STATE_DIM),
           "w_x": torch.randn(STATE_DIM, STATE_DIM, generator=g) / math.sqrt(STATE_DIM),
           "w_o": torch.randn(STATE_DIM, qd, generator=g) / math.sqrt(qd),
           "x0": torch.randn(seqs, STATE_DIM, generator=g),
           "e": torch.randn(steps, seqs, STATE_DIM, generator=g)}
    for name, x in (("k", k), ("v", v)):
        mean, spread, scale = shape_of(x)
        out |= {f"mean_{name}": mean, f"spread_{name}": spread, f"scale_{name}": scale}
    return {n: t.to(device) for n, t in out.items()}


def long_decode_rows(kt, prefill: int, checkpoints: list[int], seqs: int, window: int, seed: int, device,
                     feedback: float = FEEDBACK, packed: tuple = PACKED_FORMATS) -> list[dict]:
    """The synthetic autoregressive decode, run in every format side by side, against the fp32 trajectory.

    Processes: (TORCH_FORMATS + ``packed``) x MODES x ``seqs`` sequences, each with its own cache (torch formats:
    slots of one fp32 buffer; packed formats: slots of a PagedKvarnCache each), all starting from the
    same prefilled context and x_0. Step t: (q, k, v) from x_t; k, v appended to the cache; o_t =
    attention of q over the whole cache (prefill + t + 1 tokens); x_{t+1} from x_t, o_t (feedback only)
    and e_{t+1}. At each checkpoint c: relative error and cosine of o and of the state x against the
    fp32 process of the same mode and sequence, pooled over the last min(window, c) steps and all
    sequences. The no-feedback control's states are the same in every format by construction.
    """
    import torch

    r = kt.reference
    steps = max(checkpoints)
    p = decode_process(r, prefill, steps, seqs, seed, device)
    formats = TORCH_FORMATS + tuple(f for f, _ in packed)
    nf, nt, slots = len(formats), len(TORCH_FORMATS), len(MODES) * seqs
    length = prefill + steps
    qd, kd = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    kv_shape = (nt * slots, KV_HEADS, length, HEAD_DIM)
    kbuf = torch.zeros(kv_shape, device=device)
    vbuf = torch.zeros(kv_shape, device=device)
    kbuf[:, :, :prefill] = p["k_prefill"].transpose(0, 1).float()
    vbuf[:, :, :prefill] = p["v_prefill"].transpose(0, 1).float()
    # the dtype each torch format rounds to on write (None: kept in fp32)
    rounded = [{"fp16": torch.float16, "fp8 e4m3": torch.float8_e4m3fn}.get(f) for f in TORCH_FORMATS]
    for i, dt in enumerate(rounded):
        if dt is not None:
            for buf in (kbuf, vbuf):
                part = buf[i * slots:(i + 1) * slots, :, :prefill]
                part.copy_(part.to(dt).float())
    groups = -(-length // GROUP)
    caches = []
    for _, rotated in packed:
        cache = kt.PagedKvarnCache(slots * groups, slots, groups, device=device, rotated=rotated)
        for s in range(slots):
            cache.append(s, p["k_prefill"], p["v_prefill"])
        caches.append(cache)
    x = p["x0"].expand(nf, len(MODES), seqs, STATE_DIM).contiguous()  # [format, mode, seq, state]
    keep = {c: min(window, c) for c in checkpoints}
    outs, states, rows = [], [], []
    for t in range(steps):
        n = prefill + t  # the new token's position
        z = x.view(-1, STATE_DIM) @ p["w_qkv"].T
        q = z[:, :qd].reshape(nf, slots, Q_HEADS, HEAD_DIM)
        k = p["scale_k"][n] * (p["mean_k"] + p["spread_k"] * z[:, qd:qd + kd].view(nf, slots, KV_HEADS, HEAD_DIM))
        v = p["scale_v"][n] * (p["mean_v"] + p["spread_v"] * z[:, qd + kd:].view(nf, slots, KV_HEADS, HEAD_DIM))
        kw, vw = k[:nt].clone(), v[:nt].clone()
        for i, dt in enumerate(rounded):
            if dt is not None:
                kw[i], vw[i] = kw[i].to(dt).float(), vw[i].to(dt).float()
        kbuf[:, :, n] = kw.view(nt * slots, KV_HEADS, HEAD_DIM)
        vbuf[:, :, n] = vw.view(nt * slots, KV_HEADS, HEAD_DIM)
        o = torch.empty(nf, slots, Q_HEADS, HEAD_DIM, device=device)
        o[:nt] = attention_batched(q[:nt].reshape(-1, Q_HEADS, HEAD_DIM), kbuf[:, :, :n + 1],
                                   vbuf[:, :, :n + 1]).view(nt, slots, Q_HEADS, HEAD_DIM)
        for i, cache in enumerate(caches):
            f = nt + i
            for s in range(slots):
                cache.append(s, k[f, s:s + 1], v[f, s:s + 1])
            cache.decode(q[f].contiguous(), out=o[f])
        mix = MEMORY * (x @ p["w_x"].T) + p["e"][t]
        mix[:, 0] += feedback * (rmsnorm(o[:, :seqs].reshape(nf, seqs, qd)) @ p["w_o"].T)
        x = rmsnorm(mix)
        c = t + 1
        if any(0 <= cp - c < w for cp, w in keep.items()):
            outs.append((c, o.view(nf, len(MODES), seqs, qd).clone()))
            states.append((c, x.clone()))
        if c in keep:
            lo = c - keep[c]
            o_win = torch.stack([a for i, a in outs if i > lo], 1)  # [format, steps, mode, seq, ...]
            x_win = torch.stack([a for i, a in states if i > lo], 1)
            for f, fmt in enumerate(formats[1:], 1):
                for m, mode in enumerate(MODES):
                    o_rel, o_cos = r.errors(o_win[0, :, m].cpu(), o_win[f, :, m].cpu())
                    x_rel, x_cos = r.errors(x_win[0, :, m].cpu(), x_win[f, :, m].cpu())
                    rows.append({"decode_steps": c, "tokens": prefill + c, "format": fmt, "mode": mode,
                                 "window_steps": keep[c], "sequences": seqs, "out_rel_error": o_rel,
                                 "out_cosine": o_cos, "state_rel_error": x_rel, "state_cosine": x_cos})
            outs = [(i, a) for i, a in outs if any(0 <= cp - i < w for cp, w in keep.items() if cp > c)]
            states = [(i, a) for i, a in states if any(0 <= cp - i < w for cp, w in keep.items() if cp > c)]
    return rows


def decode_table(rows: list[dict]) -> str:
    """The long decode's table: per checkpoint and format, o and x against fp32 with feedback, then without."""
    by = {(r["decode_steps"], r["format"], r["mode"]): r for r in rows}
    lines = ["| decode steps | tokens | format | out rel. error | out cosine | state rel. error | state cosine "
             "| no feedback: out rel. error | out cosine | state rel. error |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in sorted({r["decode_steps"] for r in rows}):
        for fmt in dict.fromkeys(r["format"] for r in rows):
            fb, ctl = by.get((c, fmt, "feedback")), by.get((c, fmt, "no feedback"))
            if fb is None or ctl is None:
                continue
            lines.append(f"| {c:,} | {fb['tokens']:,} | {fmt} | {fb['out_rel_error']:.4f} | {fb['out_cosine']:.4f} | "
                         f"{fb['state_rel_error']:.4f} | {fb['state_cosine']:.4f} | {ctl['out_rel_error']:.4f} | "
                         f"{ctl['out_cosine']:.4f} | {ctl['state_rel_error']:.4f} |")
    return "\n".join(lines)


def table(rows: list[dict], smoke: bool) -> str:
    """The one markdown table: error columns for error rows, time columns for time rows ('-' where not measured)."""
    def f(row, key, fmt):
        if key not in row:
            return "-"
        if smoke and key in ("seconds", "speedup_vs_sdpa", "GBps", "pct_of_copy"):
            return "smoke"
        return fmt.format(row[key] * (1e6 if key == "seconds" else 1))

    lines = ["| tokens | format | rel. error | cosine | bytes/token/layer | decode µs | vs fp16 SDPA | GB/s "
             "| % of copy |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in sorted(rows, key=lambda x: (x["tokens"], "seconds" in x)):
        lines.append(f"| {row['tokens']:,} | {row['format']} | {f(row, 'rel_error', '{:.4f}')} | "
                     f"{f(row, 'cosine', '{:.4f}')} | {f(row, 'bytes_per_token', '{:,.0f}')} | "
                     f"{f(row, 'seconds', '{:,.1f}')} | {f(row, 'speedup_vs_sdpa', '{:.2f}x')} | "
                     f"{f(row, 'GBps', '{:,.0f}')} | {f(row, 'pct_of_copy', '{:.0f}%')} |")
    return "\n".join(lines)


def goals(rows: list[dict], batch: int) -> str:
    """The issue's two speed goals, checked against this run's rows (>= 3x fp16 SDPA at 32k; >= 60% of copy)."""
    ours = {r["tokens"]: r for r in rows if r["format"] == f"kvarn decode x{batch}"}
    lines = []
    if 32768 in ours:
        x = ours[32768]["speedup_vs_sdpa"]
        lines.append(f"goal >= 3x fp16 SDPA at 32k: {'met' if x >= 3 else 'NOT met'} ({x:.2f}x)")
    for n, r in sorted(ours.items()):
        p = r["pct_of_copy"]
        lines.append(f"goal >= 60% of copy bandwidth at {n:,}: {'met' if p >= 60 else 'NOT met'} ({p:.0f}%)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768,131072", help="error rows: cache lengths")
    ap.add_argument("--time-lengths", default="8192,32768,131072", help="time rows: context lengths")
    ap.add_argument("--batch", type=int, default=8, help="sequences in the time rows")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations (median; >= 20 on a GPU)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-t", type=int, default=0,
                    help="decode kernel: tokens per inner tile (16 ... 128); 0 = the variant's default")
    ap.add_argument("--num-warps", type=int, default=0, help="decode kernel: warps per program; 0 = the variant's")
    ap.add_argument("--variant", default="", help="decode split kernel: v1 ... v4 (kvarn_decode_sweep.py); "
                                                  "'' = decode_attention's default")
    ap.add_argument("--decode-checkpoints", default="128,512,2048,8192,32768",
                    help="long decode: steps at which to report (the last is the number of steps); '' skips it")
    ap.add_argument("--decode-prefill", type=int, default=1024, help="long decode: prefilled context tokens")
    ap.add_argument("--decode-seqs", type=int, default=1, help="long decode: sequences per mode (feedback, control)")
    ap.add_argument("--decode-window", type=int, default=32, help="long decode: steps pooled up to each checkpoint")
    ap.add_argument("--decode-feedback", type=float, default=FEEDBACK,
                    help="long decode: the weight of rmsnorm(o) in the next state (0 makes both modes the control)")
    ap.add_argument("--json", default="", help="also write the rows and the run's facts here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in Triton's interpreter (no speeds)")
    a = ap.parse_args()
    if a.smoke:
        a.lengths, a.time_lengths, a.batch, a.iters, a.warmup = "256,384", "256", 2, 2, 1
        # 124 tokens in the tail: the 4th decode step fills it and a group is quantized mid-decode
        a.decode_checkpoints, a.decode_prefill, a.decode_seqs = "2,4,8", 2 * GROUP - 4, 1
    lengths = [int(x) for x in a.lengths.split(",") if x]
    time_lengths = [int(x) for x in a.time_lengths.split(",") if x]
    checkpoints = sorted({int(x) for x in a.decode_checkpoints.split(",") if x})
    bad = [n for n in lengths + time_lengths if n <= 0 or n % GROUP]
    if bad:
        print(f"lengths {bad} are not positive multiples of {GROUP}", file=sys.stderr)
        return 2
    if any(c <= 0 for c in checkpoints) or min(a.decode_prefill, a.decode_seqs, a.decode_window) <= 0:
        print("--decode-checkpoints, --decode-prefill, --decode-seqs and --decode-window must be positive",
              file=sys.stderr)
        return 2
    kt = load_kernels(a.smoke)
    if a.variant and a.variant not in kt.DECODE_DEFAULTS:
        ap.error(f"--variant {a.variant!r}: one of {sorted(kt.DECODE_DEFAULTS)}")
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter check", file=sys.stderr)
        return 2
    if not a.smoke and a.iters < 20:
        print("--iters: at least 20 on a GPU (the median of fewer is noise)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references stay fp32
    device = torch.device("cpu" if a.smoke else "cuda")
    a.variant = a.variant or kt.default_variant(device)
    a.block_t = a.block_t or kt.DECODE_DEFAULTS[a.variant][0]  # the record names the tiles that ran
    a.num_warps = a.num_warps or kt.DECODE_DEFAULTS[a.variant][1]
    a.stages = kt.DECODE_DEFAULTS[a.variant][2]
    name = "CPU, Triton interpreter (smoke)" if a.smoke else torch.cuda.get_device_name(device)
    tq = {n: turboquant(n) for n in ("turboquant_3bit_nc", "turboquant_4bit_nc")}
    rows = []
    for length in lengths:
        rows += error_rows(kt, length, a.seed, device, tq)
    copy_bps = copy_bandwidth(device, (16 << 20) if a.smoke else (2 << 30), a.warmup, a.iters)
    for length in time_lengths:
        rows += time_rows(kt, length, a.batch, device, a.warmup, a.iters, copy_bps,
                          {"block_t": a.block_t, "num_warps": a.num_warps, "variant": a.variant, "stages": a.stages})
    decode_rows, decode_s = [], 0.0
    if checkpoints:
        t0 = time.perf_counter()
        decode_rows = long_decode_rows(kt, a.decode_prefill, checkpoints, a.decode_seqs, a.decode_window, a.seed,
                                       device, a.decode_feedback)
        decode_s = time.perf_counter() - t0
    import triton

    print(f"KVarN kernels, {name}, torch {torch.__version__}, triton {triton.__version__}, seed {a.seed}; "
          f"error rows: 4 queries x {Q_HEADS} heads, KV {KV_HEADS} x {HEAD_DIM}, fp32 reference; "
          f"time rows: {a.batch} sequences, median of {a.iters} after {a.warmup} warmup, decode {a.variant} "
          f"block_t {a.block_t}, {a.num_warps} warps")
    for n, why in tq.items():
        if isinstance(why, str):
            print(f"{n}: not importable: {why}" if not why.startswith("failed") else f"{n}: {why}")
    print("device copy bandwidth: " + ("smoke" if a.smoke else f"{copy_bps / 1e9:,.0f} GB/s (read + write)"))
    print()
    print(table(rows, a.smoke))
    if not a.smoke:
        print()
        print(goals(rows, a.batch))
    if decode_rows:
        print()
        print(f"long decode: {a.decode_seqs} sequence(s) a mode, {a.decode_prefill:,} prefilled tokens "
              f"(reference.synthetic), {checkpoints[-1]:,} steps one token at a time, in {decode_s:,.1f} s; "
              f"x' = rmsnorm({MEMORY} W_x x + {a.decode_feedback} W_o rmsnorm(o) + e), state {STATE_DIM}, no o term "
              f"without feedback; o and x against the fp32 process, pooled over the last "
              f"min({a.decode_window}, steps) steps")
        print()
        print(decode_table(decode_rows))
    if a.json:
        facts = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "seed": a.seed,
                 "smoke": a.smoke, "batch": a.batch, "variant": a.variant, "block_t": a.block_t,
                 "num_warps": a.num_warps, "iters": a.iters, "warmup": a.warmup,
                 "copy_Bps": copy_bps, "turboquant": {n: (w if isinstance(w, str) else "ran") for n, w in tq.items()},
                 "long_decode": {"checkpoints": checkpoints, "prefill": a.decode_prefill, "seqs": a.decode_seqs,
                                 "window": a.decode_window, "state_dim": STATE_DIM, "memory": MEMORY,
                                 "feedback": a.decode_feedback, "seconds": decode_s}}
        Path(a.json).write_text(json.dumps({"facts": facts, "rows": rows, "long_decode": decode_rows}, indent=1)
                                + "\n")
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
