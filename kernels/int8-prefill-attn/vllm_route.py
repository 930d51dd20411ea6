"""Which rows of a vLLM 0.28 step go to rig's int8 prefill attention, and running them there.

Loaded by path inside a vLLM server process by ``patches/prefill-attn-int8.patch`` (from
``$VLLM_RIG_KERNELS_DIR/int8-prefill-attn/``) when ``VLLM_RIG_PREFILL_ATTN=int8``; with the knob
unset vLLM never reads this file. The patch calls three functions and keeps no logic of its own:

* ``attach(impl, vllm_config)`` when a FlashAttention or FlashInfer layer is built: decides once
  whether that layer can ever be routed (no sliding window, ALiBi, softcap, sinks, KV sharing or
  decode context parallelism; a head_dim and dtype the kernel has) and compiles the kernel for
  its shapes, so the first request compiles nothing;
* ``plan_flash_attn`` / ``plan_flashinfer`` once per step in the metadata builder: from the
  step's CPU copies of the query start offsets and sequence lengths, which requests are fresh
  prefills (query length == sequence length: no cached prefix, no earlier chunk, not a
  decode) and, on FlashAttention, later chunks of at least CHUNK_MIN_QUERIES queries over a
  cached prefix (their keys, prefix and chunk, are then gathered from the layer's paged cache
  and attended by ``attn.int8_prefill_attention_prefix``). FlashAttention computes every row in
  one call, so the routable requests at the end of the batch are split off and the rows before
  them run on FlashAttention with sliced metadata;
  FlashInfer already runs decodes and prefills apart, so its prefill part is routed when every
  prefill row is fresh (one chunked or prefix-cached prefill among them: all stay on FlashInfer);
* ``StepPlan.route`` in the layer's forward: computes those rows with
  ``attn.int8_prefill_attention`` into the layer's output, or returns False and vLLM's own code
  runs untouched (never while a CUDA graph is being captured: a graph replays decode batches,
  whose rows need the KV cache).

The KV cache write is not ours: in vLLM 0.28 both backends write K/V to the cache in their own
``do_kv_cache_update`` before ``forward`` runs (``forward_includes_kv_cache_update = False``),
so later decode steps find the routed prompt's keys there as usual.

``COUNTERS`` counts what happened in this process (routed calls, tokens, requests; every
fallback by reason); the first routed call logs one INFO line naming the layer.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ATTN_MODULE = "rig_kernel_int8_prefill_attn_attn"  # the name attn.py's own sibling loader would give it
DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

logger = logging.getLogger("vllm.rig_int8_prefill_attn")  # under vLLM's logger: its handler and format
COUNTERS: collections.Counter[str] = collections.Counter()
_LOGGED: set[str] = set()
# False when the step's CPU query offsets may disagree with the device's (adaptive draft verification)
_STATE: dict[str, Any] = {"cpu_offsets_exact": True}


def stats() -> dict[str, int]:
    """A copy of the counters (tests and logs read these; the process keeps counting)."""
    return dict(COUNTERS)


def reset() -> None:
    """Zero the counters and the once-per-process log lines (tests start from a clean slate)."""
    COUNTERS.clear()
    _LOGGED.clear()


def _once(key: str, message: str, *args: object) -> None:
    """Log ``message`` at INFO the first time ``key`` is seen in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(message, *args)


def _fallback(reason: str) -> None:
    COUNTERS[f"fallback:{reason}"] += 1


def attn_module() -> Any:
    """The kernel's ``attn.py`` beside this file, imported once (a missing file fails the engine start)."""
    if ATTN_MODULE in sys.modules:
        return sys.modules[ATTN_MODULE]
    path = HERE / "attn.py"
    if not path.is_file():
        raise RuntimeError(f"VLLM_RIG_PREFILL_ATTN=int8: the kernel {path} does not exist (VLLM_RIG_KERNELS_DIR "
                           f"points at {HERE.parent}); use a rig checkout with kernels/int8-prefill-attn")
    spec = importlib.util.spec_from_file_location(ATTN_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[ATTN_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[ATTN_MODULE]
        raise
    return module


# --------------------------------------------------------------------------------------------
# Per layer, once: attach


def _enum_value(x: object) -> str:
    return str(getattr(x, "value", x))


def layer_reason(impl: Any, dtype: torch.dtype | None, head_dims: tuple[int, ...]) -> str | None:
    """Why this layer can never be routed, or None when it can.

    Read from the backend impl's own attributes, which FlashAttention and FlashInfer both set:
    the kernel is plain causal softmax attention over one sequence's own tokens and nothing else.
    """
    window = tuple(getattr(impl, "sliding_window", None) or (-1, -1))
    checks = [
        (_enum_value(getattr(impl, "attn_type", "decoder")) != "decoder",
         f"attention type {_enum_value(getattr(impl, 'attn_type', '?'))}"),
        (getattr(impl, "alibi_slopes", None) is not None, "ALiBi"),
        (window != (-1, -1), f"sliding window {window}"),
        (bool(getattr(impl, "logits_soft_cap", None)), "logits softcap"),
        (getattr(impl, "sinks", None) is not None, "attention sinks"),
        (getattr(impl, "kv_sharing_target_layer_name", None) is not None, "KV shared with another layer"),
        (getattr(impl, "dcp_world_size", 1) > 1, "decode context parallelism"),
        (impl.head_size not in head_dims, f"head_dim {impl.head_size} (the kernel has {head_dims})"),
        (impl.num_heads % impl.num_kv_heads != 0, f"{impl.num_heads} query heads over {impl.num_kv_heads} KV heads"),
        (dtype is not None and dtype not in DTYPES, f"model dtype {dtype}"),
    ]
    return next((why for failed, why in checks if failed), None)


_WARMED: set[tuple] = set()


def _warm(impl: Any, dtype: torch.dtype) -> None:
    """Compile or load everything this layer's shapes need, once per shape in the process."""
    device = torch.device("cuda", torch.cuda.current_device())
    key = (impl.num_heads, impl.num_kv_heads, impl.head_size, dtype, device)
    if key in _WARMED:
        return
    t0 = time.monotonic()
    attn_module().warmup(impl.num_heads, impl.num_kv_heads, impl.head_size, dtype, device)
    _WARMED.add(key)
    logger.info("rig int8 prefill attention: warmed up for %d/%d heads, head_dim %d, %s on %s in %.1f s",
                impl.num_heads, impl.num_kv_heads, impl.head_size, dtype, device, time.monotonic() - t0)


def attach(impl: Any, vllm_config: Any) -> None:
    """Called when a FlashAttention/FlashInfer layer is built: decide its eligibility, warm up.

    Sets ``impl.rig_prefill_reason`` (None: routable). Loads the kernel now, so a missing or
    broken kernel stops the engine at start; warms it up on CUDA so no request compiles it.
    """
    attn = attn_module()
    model = getattr(vllm_config, "model_config", None)
    dtype = getattr(model, "dtype", None)
    reason = layer_reason(impl, dtype, tuple(getattr(attn, "HEAD_DIMS", (256,))))
    impl.rig_prefill_reason = reason
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and getattr(spec, "enable_adaptive_verification", False):
        _STATE["cpu_offsets_exact"] = False  # its draft split is decided on the device, after our plan
    if reason is not None:
        _once(f"layer:{reason}", "rig int8 prefill attention: not for %s layers (%s): vLLM's kernel runs them",
              type(impl).__name__, reason)
        return
    _once("attached", "rig int8 prefill attention: on for %s layers (%d/%d heads, head_dim %d)",
          type(impl).__name__, impl.num_heads, impl.num_kv_heads, impl.head_size)
    if dtype is not None and torch.cuda.is_available():
        _warm(impl, dtype)


# --------------------------------------------------------------------------------------------
# Per step, once: the plan


@dataclass
class StepPlan:
    """The requests ``[first, last)`` of one step that the int8 kernel computes: fresh prefills and, on
    FlashAttention, later chunks of at least CHUNK_MIN_QUERIES queries over a cached prefix.

    Rows ``[0, first)`` stay on the backend's kernel (FlashAttention runs them with its metadata
    sliced to them, using the ``rest_*`` maxima); rows from ``last`` on are padding. With a prefix
    among them (``key_lens`` set) every routed request's keys are read from the paged cache.
    """

    first: int
    last: int
    token_start: int
    token_end: int
    max_seqlen: int
    rest_max_query_len: int
    rest_max_seq_len: int
    query_start_loc: torch.Tensor = field(repr=False)  # the step's device offsets
    # Later chunks (a cached prefix before the step's queries): the routed requests' key counts (CPU),
    # None when every routed request is fresh, and their block table rows (device)
    key_lens: np.ndarray | None = field(default=None, repr=False)
    block_table: torch.Tensor | None = field(default=None, repr=False)
    with_prefix: int = 0  # how many of the routed requests have a cached prefix
    _cu: torch.Tensor | None = field(default=None, repr=False)
    _gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def cu_seqlens(self) -> torch.Tensor:
        """Offsets of the routed requests from 0, on the device (computed once per step)."""
        if self._cu is None:
            cu = self.query_start_loc[self.first:self.last + 1]
            self._cu = cu if self.first == 0 else cu - self.token_start
        return self._cu

    def gather_index(self, block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block ids, offsets in the block, cu_seqlens_k) of every key of the routed requests, their cached
        prefix then their chunk, in order: the same for every layer of the step (computed once)."""
        if self._gather is None:
            lens = torch.as_tensor(self.key_lens, dtype=torch.int64)
            seq = torch.repeat_interleave(torch.arange(lens.numel()), lens)
            pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
            seq, pos = seq.to(device), pos.to(device)
            blocks = self.block_table[seq, pos // block_size].long()
            cu_k = torch.zeros(lens.numel() + 1, dtype=torch.int32)
            cu_k[1:] = torch.cumsum(lens, 0)
            self._gather = (blocks, pos % block_size, cu_k.to(device))
        return self._gather

    def route(self, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              output: torch.Tensor) -> bool:
        """Compute the routed rows into ``output``; False leaves every row to vLLM's kernel."""
        return route(self, impl, layer, query, key, value, output)


CHUNK_MIN_QUERIES = 512
"""A request with a cached prefix (a prompt's later chunk, or a prefix-cache hit) is routed from this many
queries in the step on. Shorter ones (speculative verification, a prompt's short tail) stay on vLLM's kernel:
routing one re-reads and re-quantizes its whole prefix for few queries. A design choice, not yet tuned on a
GPU (kernels/int8-prefill-attn/README.md)."""


def _rows(cm: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray] | str:
    """(offsets, query lengths, routable mask, real request count, sequence lengths) from the step's CPU
    copies, or why not.

    A request is fresh when its query length equals its sequence length: the whole prompt is in
    this step (no prefix cache hit, no earlier chunk) and it is not decoding. One with a cached
    prefix is routable from CHUNK_MIN_QUERIES queries on. Padding rows (CUDA graph padding) have
    query length 0 and come last.
    """
    if not _STATE["cpu_offsets_exact"]:
        return "adaptive draft verification"
    seq = getattr(cm, "seq_lens_cpu_upper_bound", None)
    if seq is None:
        return "no CPU sequence lengths"
    n = cm.num_reqs
    offsets = cm.query_start_loc_cpu[:n + 1].numpy()
    qlen = np.diff(offsets)
    real = np.flatnonzero(qlen > 0)
    n_real = int(real[-1]) + 1 if real.size else 0
    seq_lens = seq[:n].numpy()
    fresh = (qlen == seq_lens) & (qlen > 0)
    chunk = (seq_lens > qlen) & (qlen >= CHUNK_MIN_QUERIES)
    return offsets, qlen, (fresh | chunk)[:n_real], n_real, seq_lens


def _common_reason(cm: Any, md: Any) -> str | None:
    if md.use_cascade:
        return "cascade attention"
    if md.causal is not True:
        return "not causal"
    if getattr(cm, "mm_req_doc_ranges", None) is not None:
        return "multimodal prefix ranges"
    return None


def _plan(cm: Any, first: int, offsets: np.ndarray, qlen: np.ndarray, n_real: int, seq_lens: np.ndarray,
          block_table: torch.Tensor | None = None) -> StepPlan:
    seq = seq_lens[:first]
    keys = seq_lens[first:n_real]
    with_prefix = int((keys > qlen[first:n_real]).sum())
    prefix = with_prefix > 0
    COUNTERS["planned_steps"] += 1
    return StepPlan(
        first=first, last=n_real, token_start=int(offsets[first]), token_end=int(offsets[n_real]),
        max_seqlen=int(qlen[first:n_real].max()),
        rest_max_query_len=int(qlen[:first].max()) if first else 0,
        rest_max_seq_len=int(seq.max()) if first else 0,
        query_start_loc=cm.query_start_loc,
        key_lens=keys.astype(np.int64) if prefix else None,
        block_table=block_table[first:n_real] if prefix and block_table is not None else None,
        with_prefix=with_prefix)


def plan_flash_attn(cm: Any, md: Any) -> StepPlan | None:
    """FlashAttention: the fresh prefills at the end of the batch (vLLM puts decodes first), if any.

    ``cm`` is the step's CommonAttentionMetadata, ``md`` the FlashAttentionMetadata just built.
    """
    why = _common_reason(cm, md)
    if why is None and md.mm_prefix_query_range_tensor is not None:
        why = "multimodal prefix ranges"
    if why is None and md.rswa_prefix_lens is not None:
        why = "reference sliding window"
    if why is None and md.dcp_context_kv_lens is not None:
        why = "decode context parallelism"
    rows = _rows(cm) if why is None else why
    if isinstance(rows, str):
        _fallback(rows)
        return None
    offsets, qlen, routable, n_real, seq_lens = rows
    stale = np.flatnonzero(~routable)
    first = int(stale[-1]) + 1 if stale.size else 0
    if first >= n_real:
        _fallback("no fresh prefill")
        return None
    return _plan(cm, first, offsets, qlen, n_real, seq_lens, md.block_table)


def plan_flashinfer(cm: Any, md: Any) -> StepPlan | None:
    """FlashInfer: its prefill rows ``[num_decodes, end)`` when every one of them is a fresh prefill."""
    why = _common_reason(cm, md)
    rows = _rows(cm) if why is None else why
    if isinstance(rows, str):
        _fallback(rows)
        return None
    offsets, qlen, _, n_real, seq_lens = rows
    first = md.num_decodes
    if first >= n_real:
        _fallback("no fresh prefill")
        return None
    if not (qlen[first:n_real] == seq_lens[first:n_real]).all():  # FlashInfer's later chunks are not routed yet
        _fallback("chunked or prefix-cached prefill")
        return None
    return _plan(cm, first, offsets, qlen, n_real, seq_lens)


# --------------------------------------------------------------------------------------------
# Per layer and step: the forward


def _query_rows(query: torch.Tensor, key: torch.Tensor, layer: Any, t0: int, t1: int) -> torch.Tensor | None:
    """The routed query rows in k's dtype: FlashAttention on fp8 KV (Hopper) quantizes the query
    to fp8 before the backend sees it; it is brought back with its scalar scale."""
    q = query[t0:t1]
    if q.dtype == key.dtype:
        return q
    scale = getattr(layer, "_q_scale", None)
    if q.dtype in FP8_DTYPES and scale is not None and scale.numel() == 1:
        return (q.to(torch.float32) * scale.to(torch.float32)).to(key.dtype)
    return None


def _refusal(impl: Any, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None) -> str | None:
    """Why these rows cannot go to the kernel in this call, or None."""
    reason = getattr(impl, "rig_prefill_reason", "layer not attached")
    if reason is not None:
        return reason
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return "CUDA graph capture"
    if key is None or value is None or key.dtype not in DTYPES or value.dtype != key.dtype:
        return f"key/value dtype {getattr(key, 'dtype', None)}/{getattr(value, 'dtype', None)}"
    return None


def _cached_keys(plan: StepPlan, impl: Any, layer: Any, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | str:
    """(k, v, cu_seqlens_k) of the routed requests read from the layer's paged cache — each one's prefix and
    this step's chunk, which vLLM wrote there before ``forward`` — in ``dtype``; or why they cannot be.

    vLLM 0.28's FlashAttention cache is logically [blocks, kv heads, block_size, 2 × head_dim], K and V
    packed in the last dim (``layer.kv_cache``, the tensor its forward is given), split here as its
    forward splits it; an fp8 cache is dequantized with the layer's scalar K and V scales, so the
    kernel sees the keys FlashAttention would have read.
    """
    cache = getattr(layer, "kv_cache", None)
    if (not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.shape[-1] != 2 * impl.head_size
            or plan.block_table is None):
        return "no paged KV cache on the layer"
    key_cache, value_cache = cache.transpose(1, 2).split(impl.head_size, dim=-1)  # each [blocks, N, H, D]
    blocks, offsets, cu_k = plan.gather_index(cache.shape[2], cache.device)
    k, v = key_cache[blocks, offsets], value_cache[blocks, offsets]
    kv_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    if kv_dtype.startswith("fp8"):
        fp8 = torch.float8_e5m2 if kv_dtype == "fp8_e5m2" else torch.float8_e4m3fn
        scales = (getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None))
        if any(sc is None or sc.numel() != 1 for sc in scales):
            return "fp8 KV cache without scalar scales"
        k, v = ((x.view(fp8).to(torch.float32) * sc.to(torch.float32)).to(dtype) for x, sc in zip((k, v), scales,
                                                                                                   strict=True))
    elif k.dtype != dtype:
        return f"KV cache dtype {k.dtype}"
    return k.contiguous(), v.contiguous(), cu_k


def route(plan: StepPlan, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          output: torch.Tensor) -> bool:
    """Run the plan's rows through ``attn.int8_prefill_attention`` into ``output``; False: vLLM's kernel."""
    t0, t1 = plan.token_start, plan.token_end
    reason = _refusal(impl, query, key, value)
    q = _query_rows(query, key, layer, t0, t1) if reason is None else None
    if reason is None and q is None:
        reason = f"query dtype {query.dtype}"
    if reason is not None:
        _fallback(reason)
        return False
    out = output[t0:t1]
    target = out if out.is_contiguous() and out.dtype == value.dtype else None
    if plan.key_lens is not None:
        kv = _cached_keys(plan, impl, layer, key.dtype)
        if isinstance(kv, str):
            _fallback(kv)
            return False
        result = attn_module().int8_prefill_attention_prefix(
            q.contiguous(), kv[0], kv[1], plan.cu_seqlens(), kv[2], plan.max_seqlen, impl.scale, out=target)
        COUNTERS["routed_with_prefix"] += plan.with_prefix
    else:
        result = attn_module().int8_prefill_attention(
            q.contiguous(), key[t0:t1].contiguous(), value[t0:t1].contiguous(), plan.cu_seqlens(),
            plan.max_seqlen, impl.scale, out=target)
    if target is None:
        out.copy_(result)
    COUNTERS["routed_calls"] += 1
    COUNTERS["routed_tokens"] += t1 - t0
    COUNTERS["routed_requests"] += plan.last - plan.first
    name = getattr(layer, "layer_name", type(layer).__name__)
    _once("routed", "rig int8 prefill attention: routed %d tokens on %s", t1 - t0, name)
    if plan.first:
        _once("split", "rig int8 prefill attention: a mixed batch on %s: %d leading requests (decodes, chunks) "
              "left to vLLM's kernel, %d fresh prefills routed", name, plan.first, plan.last - plan.first)
    return True
