"""KV=kvarn inside vLLM 0.28: the attention backend, its metadata, and the companion layer for the tail.

Loaded by path by the ``kvarn-cache`` patch (``vllm/platforms/interface.py::rig_kvarn_backend``) from
``$VLLM_RIG_KERNELS_DIR/kvarn/vllm_backend.py`` under the module name ``vllm_rig_kvarn``; vLLM then
resolves ``vllm_rig_kvarn.KvarnAttentionBackend`` as it resolves its own backends.

How the format (reference.py) maps onto vLLM's cache (docs/kvarn.md, "The backend in vLLM"):

- **Pages.** The attention layer's KV cache spec publishes 208 B per KV head and token (the layout's
  832 B for 4 heads of 256) as ``state_content_bytes``, as TurboQuant publishes its packed slots, and
  the backend's kernel block is the 128-token group, so each kernel block of vLLM's pool is one page:
  one group's K then V, reference.py's bytes. A request's block table lists the page of each group.
- **The tail.** A group is packed only when its 128 tokens are all there; the newest ``len % 128``
  tokens of a request stay unpacked. vLLM gives a layer per-request memory only through a
  ``MambaSpec`` (one block a request while it lives, with prefix caching off), so the kvarn
  attention layers get companion layers (``KvarnTail``, made through the patch's hook in
  ``Attention.__init__``; ``tails_per_companion`` layers share one) whose state is their tails: K and
  V, [layers, 128, kv heads, head_dim] in the model's dtype. The patch raises the hybrid model's mamba
  page to hold a companion, so the tail group shares vLLM's common page size.
- **Forward**, two engines with the same order of work (attend, then pack what filled a group):
  ``torch``: per request, the context = the request's packed groups dequantized (reference.read_page)
  + its tail + the step's new tokens at full precision; causal attention in float32; then every group
  the tail and the new tokens fill is quantized into its page (reference.write_page), the rest
  becomes the tail. The reference's arithmetic run inside vLLM, on the host: any device, slow.
  ``triton`` (kvarn_triton.py): the step's decodes in one batch — each new token written into its
  tail row, then ``decode_attention`` on the packed pages and the tails in place (the companions'
  rows, by slot), then ``quantize_groups`` for the tails that became full; each chunk of a prompt
  attends over its pages dequantized on the device (``dequantize_pages``) a block of pages at a time +
  its tail + itself (``chunk_attention``: float32, a running max and sum across blocks, so memory is
  bounded by its CHUNK_SCORE_BYTES whatever the context), then its full groups are quantized on the device.
  ``VLLM_RIG_KVARN_ENGINE`` chooses (``auto``: triton on CUDA, torch elsewhere).

Refused, with the reason, at construction: sliding windows, ALiBi, logit soft-capping, attention
sinks, encoder attention, KV sharing, and prefix caching (the tail is not block-aligned state that
vLLM's ``align`` mode could checkpoint).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

HERE = Path(__file__).resolve().parent
logger = init_logger("vllm.rig_kvarn")  # under vLLM's logger, so its handler prints it


def _load_sibling(stem: str):
    """``<stem>.py`` of this folder under the module name the kernels and tests load it by (one module object)."""
    name = f"rig_kernel_kvarn_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{stem}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


reference = _load_sibling("reference")
GROUP = reference.GROUP_TOKENS
METHOD = "kvarn"
"""What the pages store: "kvarn" (rotation + dual normalization + RTN) or "rtn" (the same layout, plain per-token
RTN: the baseline at the same bytes). The kvarn-cache patch sets it from VLLM_RIG_KVARN_METHOD after loading."""
ENGINE = os.environ.get("VLLM_RIG_KVARN_ENGINE", "auto")
"""Which arithmetic a step runs: "torch", "triton" or "auto" (triton on CUDA, torch elsewhere); the module
docstring says what each does. Read once, when the patch loads this module in the engine process."""
ENGINES = ("auto", "torch", "triton")
LOG_EVERY_S = 10.0
"""Seconds between the backend's progress lines in the server log (the first group packed logs at once)."""
STATS = {"groups_packed": 0, "group_reads": 0, "steps": 0, "decode_plans": 0}
"""What this process's kvarn layers did, summed over layers (the log line reports it)."""
_logged = [0.0]
COMPANION = "rig_companion"
"""The attribute (and the name suffix) the kvarn-cache patch gives an attention layer's companion."""


def engine_for(device_type: str, choice: str | None = None) -> str:
    """The engine a layer on ``device_type`` runs for ``choice`` (default ENGINE): "torch" or "triton"."""
    choice = ENGINE if choice is None else choice
    if choice not in ENGINES:
        raise ValueError(f"VLLM_RIG_KVARN_ENGINE={choice!r}: expected one of {', '.join(ENGINES)} (auto: triton "
                         "on CUDA, torch elsewhere)")
    if choice == "auto":
        return "triton" if device_type == "cuda" else "torch"
    return choice


def _kernels():
    """kvarn_triton.py, loaded on first use (a CPU host serving with the torch engine needs no Triton)."""
    return _load_sibling("kvarn_triton")


def tail_bytes(num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    """One layer's tail for one request, K and V (reference.tail_bytes, in the model's dtype)."""
    return reference.tail_bytes(num_kv_heads, head_size, get_dtype_size(dtype), GROUP)


def tails_per_companion(attention_layers: int, tail: int, state_page: int) -> int:
    """How many attention layers share one tail companion.

    The most whose tails fit the model's own state page (so the companions never raise the hybrid
    block) and that divide the attention layers evenly: vLLM puts layers in groups of the smallest
    layer kind's count and pads the others up to a multiple of it, so an uneven split would pad the
    attention groups. 1 when not even two tails fit. The real shape: 16 layers, 524,288 B tails, a
    1,634,304 B fp16 state page -> 2 (8 companions, 8 pages a seat instead of 16).
    """
    fits = [k for k in range(1, attention_layers + 1) if attention_layers % k == 0 and k * tail <= state_page]
    return max(fits, default=1)


def _layout(vllm_config) -> tuple[int, int, int]:
    """(attention layers, one layer's tail bytes, tails a companion) of the model vLLM is building."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    state_page = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                           dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                           block_size=-1).page_size_bytes
    layers = mc.get_num_layers_by_block_type(pc, "attention")
    tail = tail_bytes(mc.get_num_kv_heads(pc), mc.get_head_size(), mc.dtype)
    return layers, tail, tails_per_companion(layers, tail, state_page)


# ----------------------------------------------------------------------------- the tail companion

@dataclass
class KvarnTailMetadata:
    """Each request's tail slot this step: its block in the tail group (one block a request), batch order."""

    slots: torch.Tensor
    _host: list[int] | None = field(default=None, repr=False)

    def slots_host(self) -> list[int]:
        """slots as a host list, read from the device once a step (the step's first kvarn layer waits for it; the
        other layers of the step reuse it rather than each stalling the GPU queue on a device-to-host copy)."""
        if self._host is None:
            self._host = self.slots.tolist()
        return self._host


class KvarnTailMetadataBuilder(AttentionMetadataBuilder[KvarnTailMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvarnTailMetadata:
        c = common_attn_metadata
        return KvarnTailMetadata(slots=c.block_table_tensor[: c.num_reqs, 0])


class KvarnTailBackend(AttentionBackend):
    """The companions' backend: it only tells vLLM how to build their metadata (they compute nothing)."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_builder_cls():
        return KvarnTailMetadataBuilder

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the KVarN tail companion has no attention of its own")

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        raise NotImplementedError("the KVarN tail is a MambaSpec state, shaped by KvarnTail.get_state_shape")

    @classmethod
    def is_ssm(cls) -> bool:
        return True  # never taken as the model's attention backend (Platform._find_non_ssm_backend)


class KvarnTail(MambaBase):
    """The tails of ``slots`` kvarn attention layers: K and V [slots, 128, kv heads, head_dim] per request,
    a MambaSpec state; each layer reads its own slot (``layer.rig_kvarn_slot``).

    vLLM allocates one block of it per request with prefix caching off, keeps it while the request
    lives (scheduled or not), frees it at the end and at preemption (which recomputes the request, so
    the tail is rewritten). Blocks are not zeroed: rows past ``len % 128`` are never read.
    """

    def __init__(self, layer: torch.nn.Module, prefix: str, vllm_config, slots: int = 1) -> None:
        super().__init__()
        cache = vllm_config.cache_config
        if cache.mamba_cache_mode != "none":
            raise ValueError(
                f"KV=kvarn: prefix caching must be off (mamba cache mode is {cache.mamba_cache_mode!r}): each "
                "request's unpacked tail is not block-aligned state vLLM could checkpoint; serve with "
                "PREFIX_CACHE=0 (--no-enable-prefix-caching)")
        self.prefix = prefix
        self.layer_name = prefix
        self.num_kv_heads, self.head_size = layer.num_kv_heads, layer.head_size
        self.slots, self.used = slots, 0
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def get_state_shape(self):
        shape = (self.slots, GROUP, self.num_kv_heads, self.head_size)
        return shape, shape

    def get_state_dtype(self):
        return self.dtype, self.dtype

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.CUSTOM

    def get_kv_cache_spec(self, vllm_config):
        """MambaBase's spec, padded to the attention page (block x kv heads x 208 B): the common page size."""
        spec = super().get_kv_cache_spec(vllm_config)
        page = vllm_config.cache_config.block_size * self.num_kv_heads * reference.head_token_bytes(self.head_size)
        need = self.slots * tail_bytes(self.num_kv_heads, self.head_size, self.dtype)
        if page < need:
            raise ValueError(f"KV=kvarn: the attention page ({page} B) cannot hold a request's tail ({need} B); "
                             "the kvarn-cache patch raises the hybrid block so that it does: is it applied?")
        return replace(spec, page_size_padded=page)

    def get_attn_backend(self):
        return KvarnTailBackend


# ----------------------------------------------------------------------------- the attention backend

@dataclass
class KvarnMetadata:
    """What a kvarn layer needs of a step: where each request's queries are, its length, its pages."""

    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    plans: dict = field(default_factory=dict, repr=False)
    """What every kvarn layer of this step derives alike from the step (host lists, the decodes' index tensors),
    built by the first layer that needs it: the metadata object lives one step and is shared by the step's
    layers."""

    def host(self) -> tuple[list[int], list[int]]:
        """(query start offsets, sequence lengths) as host lists, once a step."""
        if "host" not in self.plans:
            self.plans["host"] = (self.query_start_loc_cpu.tolist(), self.seq_lens_cpu.tolist())
        return self.plans["host"]


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvarnMetadata:
        c = common_attn_metadata
        return KvarnMetadata(num_actual_tokens=c.num_actual_tokens,
                             query_start_loc_cpu=c.query_start_loc_cpu[: c.num_reqs + 1],
                             seq_lens_cpu=c.seq_lens_cpu[: c.num_reqs],
                             block_table=c.block_table_tensor[: c.num_reqs])


@dataclass
class _DecodePlan:
    """The decodes of one step (one new token a request), as every kvarn layer of the step indexes them: which
    tokens, which tail rows and positions, each request's groups and pages, which tails fill and where they are
    packed. Layer-independent (the block table and the slots are the step's), so a step builds it once, not once a
    layer: a dozen small host-to-device copies and gathers fewer per layer."""

    at: torch.Tensor            # the decode tokens' rows in the step's batch
    slots: torch.Tensor         # their tail rows (int64, for indexing)
    slots32: torch.Tensor       # the same, int32 (decode_attention's tail_rows)
    held: torch.Tensor          # where the new token goes in its tail (tokens cached % 128)
    tail_len: torch.Tensor      # int32: held + 1
    table: torch.Tensor         # the decoding requests' rows of the block table
    groups: torch.Tensor        # int32: full groups a request has
    max_groups: int
    group_reads: int
    full_pages: torch.Tensor | None   # pages the tails that fill this step are packed into (None: none fill)
    full_slots: torch.Tensor | None   # those tails' rows

    @classmethod
    def build(cls, one: list[int], qsl: list[int], lens: list[int], slots: list[int], table: torch.Tensor,
              dev: torch.device) -> _DecodePlan:
        """The plan of requests ``one`` (each decoding one token; batch order) of a step."""
        ctx = [lens[r] - 1 for r in one]
        done = [c // GROUP for c in ctx]
        rows = torch.tensor(one, device=dev)
        slot = torch.tensor([slots[r] for r in one], device=dev)
        held = torch.tensor([c % GROUP for c in ctx], device=dev)
        full = [i for i, c in enumerate(ctx) if c % GROUP == GROUP - 1]
        fi = torch.tensor(full, device=dev) if full else None
        STATS["decode_plans"] += 1
        return cls(at=torch.tensor([qsl[r] for r in one], device=dev), slots=slot, slots32=slot.to(torch.int32),
                   held=held, tail_len=(held + 1).to(torch.int32), table=table[rows],
                   groups=torch.tensor(done, dtype=torch.int32, device=dev), max_groups=max(done),
                   group_reads=sum(done),
                   full_pages=None if fi is None else table[rows[fi], torch.tensor([done[i] for i in full],
                                                                                    device=dev)],
                   full_slots=None if fi is None else slot[fi])


class KvarnAttentionImpl(AttentionImpl):
    """Attention over a KVarN cache; see the module docstring for the forward."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window, kv_cache_dtype: str, logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra) -> None:
        refused = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                   "logits_soft_cap": logits_soft_cap or None, "kv_sharing_target_layer_name":
                   kv_sharing_target_layer_name, "sinks": extra.get("sinks")}
        refused = {k: v for k, v in refused.items() if v is not None}
        if refused or attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"KV=kvarn supports causal decoder attention only; this layer has "
                                      f"{refused or {'attn_type': attn_type}}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.page_bytes = reference.page_bytes(num_kv_heads, head_size, GROUP)
        from vllm.platforms import current_platform

        self.engine = engine_for(current_platform.device_type)
        logger.info_once("rig kvarn backend (%s engine, method %s): %d B pages of %d-token groups (%d B a token and "
                         "layer), each request's tail in a companion state layer", self.engine, METHOD,
                         self.page_bytes, GROUP, self.page_bytes // GROUP)

    @functools.cached_property
    def layout(self):
        """The page layout the Triton kernels read: built once a layer, on first use (the torch engine needs no
        Triton, so a CPU host without it never builds one)."""
        return _kernels().page_layout(self.num_kv_heads, self.head_size, GROUP)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KvarnMetadata | None, output: torch.Tensor | None = None, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("KV=kvarn does not produce quantized attention outputs")
        if attn_metadata is None:  # the profiling run: no cache yet
            return output.fill_(0)
        tail = getattr(layer, COMPANION)
        tail_k, tail_v = (t[:, layer.rig_kvarn_slot] for t in tail.kv_cache)
        slots = get_forward_context().attn_metadata[tail.prefix].slots_host()
        pages = kv_cache.view(-1, self.page_bytes)
        qsl, lens = attn_metadata.host()
        packed = STATS["groups_packed"]
        if self.engine == "triton":
            self.step_triton(query, key, value, output, pages, qsl, lens, attn_metadata.block_table, slots, tail_k,
                             tail_v, plans=attn_metadata.plans)
        else:
            self.step_torch(query, key, value, output, pages, qsl, lens, attn_metadata.block_table, slots, tail_k,
                            tail_v)
        STATS["steps"] += 1
        _report(self.engine, first=packed == 0 < STATS["groups_packed"])
        return output

    def step_torch(self, query, key, value, output, pages, qsl: list[int], lens: list[int], table: torch.Tensor,
                   slots: list[int], tail_k, tail_v) -> None:
        """One step of every request with the torch engine: request by request, on the host."""
        table = table.cpu()
        for r, (slot, length) in enumerate(zip(slots, lens, strict=True)):
            q0, q1 = qsl[r], qsl[r + 1]
            if q1 > q0:
                self._request(query[q0:q1], key[q0:q1], value[q0:q1], output[q0:q1], pages, table[r],
                              tail_k[slot], tail_v[slot], length)

    def step_triton(self, query, key, value, output, pages, qsl: list[int], lens: list[int], table: torch.Tensor,
                    slots: list[int], tail_k, tail_v, plans: dict | None = None) -> None:
        """One step of every request with the Triton engine: the decodes batched, each chunk on its own.

        ``pages`` [blocks, page_bytes] uint8, ``table`` [requests, blocks] int32 (a request's page of each group),
        ``tail_k``/``tail_v`` [slots, 128, kv heads, head_size] (the companion's rows of this layer), all on the
        device; ``qsl``, ``lens`` and ``slots`` (each request's tail row) on the host, batch order. ``plans``: the
        step's shared dict (KvarnMetadata.plans), where the decodes' plan is built once for all layers.
        """
        kt, rot, lay = _kernels(), METHOD == "kvarn", self.layout
        one = [r for r in range(len(lens)) if qsl[r + 1] - qsl[r] == 1]
        if one:
            plans = {} if plans is None else plans
            pk = ("decodes", tuple(slots))
            if pk not in plans:
                plans[pk] = _DecodePlan.build(one, qsl, lens, slots, table, query.device)
            self._decodes(kt, lay, rot, query, key, value, output, pages, tail_k, tail_v, plans[pk])
        for r in range(len(lens)):
            q0, q1 = qsl[r], qsl[r + 1]
            if q1 - q0 > 1:
                self._chunk(kt, lay, rot, query[q0:q1], key[q0:q1], value[q0:q1], output[q0:q1], pages, table[r],
                            tail_k[slots[r]], tail_v[slots[r]], lens[r])

    def _decodes(self, kt, lay, rot: bool, query, key, value, output, pages, tail_k, tail_v,
                 plan: _DecodePlan) -> None:
        """Decode tokens (one a request, per ``plan``): write, attend, pack full tails."""
        tail_k[plan.slots, plan.held] = key[plan.at].to(tail_k.dtype)
        tail_v[plan.slots, plan.held] = value[plan.at].to(tail_v.dtype)
        q = query[plan.at]
        if not math.isclose(self.scale * math.sqrt(self.head_size), 1.0, rel_tol=1e-6):
            q = q * (self.scale * math.sqrt(self.head_size))  # decode_attention scales by 1/sqrt(head_size)
        out = kt.decode_attention(q, pages, plan.table, plan.groups, plan.max_groups, tail_k, tail_v, plan.tail_len,
                                  layout=lay, rotated=rot, tail_rows=plan.slots32,
                                  out=torch.empty(q.shape, dtype=torch.float32, device=q.device))  # one rounding
        output[plan.at] = out.to(output.dtype)
        STATS["group_reads"] += plan.group_reads
        if plan.full_pages is not None:
            kt.quantize_groups(pages, plan.full_pages, tail_k[plan.full_slots], tail_v[plan.full_slots], lay, rot,
                               rot)
            STATS["groups_packed"] += plan.full_pages.numel()

    def _chunk(self, kt, lay, rot: bool, q, k_new, v_new, out, pages, table, tail_k, tail_v, length: int) -> None:
        """A chunk of ``n`` > 1 tokens of one request: attend over its pages, dequantized on the device a block of
        pages at a time, + its tail + itself (kvarn_triton.chunk_attention), then quantize the groups they fill
        and keep the rest as the tail."""
        n = q.shape[0]
        ctx = length - n
        done, held = divmod(ctx, GROUP)
        fresh_k = torch.cat([tail_k[:held].float(), k_new.float()])
        fresh_v = torch.cat([tail_v[:held].float(), v_new.float()])
        out.copy_(kt.chunk_attention(q, pages, table[:done], fresh_k, fresh_v, ctx, lay, rot, self.scale).to(out.dtype))
        STATS["group_reads"] += done
        full, rest = divmod(held + n, GROUP)
        if full:
            shape = (full, GROUP, self.num_kv_heads, self.head_size)
            kt.quantize_groups(pages, table[done:done + full], fresh_k[:full * GROUP].reshape(shape),
                               fresh_v[:full * GROUP].reshape(shape), lay, rot, rot)
            STATS["groups_packed"] += full
        tail_k[:rest].copy_(fresh_k[full * GROUP:].to(tail_k.dtype))
        tail_v[:rest].copy_(fresh_v[full * GROUP:].to(tail_v.dtype))

    def _request(self, q, k_new, v_new, out, pages, table, tail_k, tail_v, length: int) -> None:
        """One request's step: attend over packed groups + tail + new tokens, then write tail + new tokens."""
        n = q.shape[0]
        ctx = length - n
        done, held = divmod(ctx, GROUP)
        heads, dim = self.num_kv_heads, self.head_size
        ks, vs = [], []
        for g in range(done):
            k, v = reference.read_page(pages[int(table[g])], heads, dim, GROUP, rotated=METHOD == "kvarn")
            ks.append(k)
            vs.append(v)
        STATS["group_reads"] += done
        fresh_k = torch.cat([tail_k[:held].float().cpu(), k_new.float().cpu()])
        fresh_v = torch.cat([tail_v[:held].float().cpu(), v_new.float().cpu()])
        k_all, v_all = torch.cat([*ks, fresh_k]), torch.cat([*vs, fresh_v])
        out.copy_(self._attend(q.float().cpu(), k_all, v_all, ctx).to(out.dtype))
        full, rest = divmod(held + n, GROUP)
        kvarn = METHOD == "kvarn"
        for i in range(full):
            sl = slice(i * GROUP, (i + 1) * GROUP)
            reference.write_page(pages[int(table[done + i])], fresh_k[sl], fresh_v[sl], kvarn, kvarn)
        STATS["groups_packed"] += full
        tail_k[:rest].copy_(fresh_k[full * GROUP:].to(tail_k.dtype))
        tail_v[:rest].copy_(fresh_v[full * GROUP:].to(tail_v.dtype))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
        """Causal GQA attention in float32: query i (position ctx + i) sees keys 0..ctx + i."""
        n, total = q.shape[0], k.shape[0]
        rep = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(rep, 1).transpose(0, 1)
        v = v.repeat_interleave(rep, 1).transpose(0, 1)
        s = torch.einsum("nhd,htd->hnt", q, k) * self.scale
        pos = torch.arange(total)
        mask = pos[None, :] > (ctx + torch.arange(n))[:, None]
        s = s.masked_fill(mask, float("-inf"))
        return torch.einsum("hnt,htd->nhd", s.softmax(-1), v)


def _report(engine: str, first: bool = False) -> None:
    """A progress line in the server log: at the first packed group, then at most every LOG_EVERY_S."""
    now = time.monotonic()
    if first or now - _logged[0] >= LOG_EVERY_S:
        _logged[0] = now
        logger.info("rig kvarn (%s engine): %d groups packed, %d group reads, %d layer steps so far", engine,
                    STATS["groups_packed"], STATS["group_reads"], STATS["steps"])


class KvarnAttentionBackend(AttentionBackend):
    """KV=kvarn: KVarN's 4-bit-K / 2-bit-V cache for causal decoder attention (rig, issue 14)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["kvarn"]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [GROUP]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64, 128, 256, 512]

    @staticmethod
    def get_impl_cls():
        return KvarnAttentionImpl

    @staticmethod
    def get_builder_cls():
        return KvarnMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """One row of bytes per kernel block: the block's page (one 128-token group, K then V)."""
        if block_size != GROUP:
            raise ValueError(f"KV=kvarn pages hold one {GROUP}-token group; got a kernel block of {block_size}")
        return num_blocks, block_size * num_kv_heads * reference.head_token_bytes(head_size)

    @classmethod
    def customize_spec(cls, spec):
        """The packed page: uint8, 208 B per KV head and token (reference.py's layout)."""
        return replace(spec, dtype=torch.uint8, state_content_bytes=reference.head_token_bytes(spec.head_size))

    @classmethod
    def companion_page_bytes(cls, vllm_config) -> int:
        """The page a tail companion needs (the patch raises the hybrid mamba page to it when larger)."""
        _, tail, per = _layout(vllm_config)
        return per * tail

    @classmethod
    def make_companion(cls, layer: torch.nn.Module, prefix: str, vllm_config) -> KvarnTail:
        """The layer's tail companion: the open one while it has a free slot (``tails_per_companion`` layers
        share one), else a new one registered in vLLM's forward context as ``<prefix>.rig_companion``. The
        layer's slot in it is ``layer.rig_kvarn_slot``."""
        ctx = vllm_config.compilation_config.static_forward_context
        tail = _OPEN.get(id(ctx))
        if tail is None or tail.used == tail.slots:
            tail = KvarnTail(layer, f"{prefix}.{COMPANION}", vllm_config, _layout(vllm_config)[2])
            _OPEN[id(ctx)] = tail
        layer.rig_kvarn_slot = tail.used
        tail.used += 1
        return tail


_OPEN: dict[int, KvarnTail] = {}
"""The companion still taking layers, per model being built (keyed by its forward context)."""
