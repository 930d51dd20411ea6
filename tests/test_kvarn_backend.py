"""rig's KV=kvarn backend for vLLM 0.28 (kernels/kvarn/vllm_backend.py, patch kvarn-cache), below a server.

The live server is tests/test_profiles_live.py's kvarn test; here the backend's own arithmetic is held
against the format's reference computed independently, and its page size against the planner and
vLLM's own hybrid block rule.
"""

from __future__ import annotations

import math

import pytest
import torch

from rig import paths
from rig.capacity import kvarn, pages, shape
from rig.kernels import load_file, module_name

KVARN = paths.ROOT / "kernels" / "kvarn"
r = load_file(KVARN / "reference.py", module_name("kvarn", "reference"))
pytestmark = pytest.mark.usefixtures("one_torch_thread")
HQ, HKV, D, G = 8, 4, 256, 128
TOL = 2e-5
"""Relative error allowed between the backend and the independent reference (both float32)."""


@pytest.fixture(scope="module")
def backend():
    """vllm_backend.py as the patch loads it (module vllm_rig_kvarn)."""
    return load_file(KVARN / "vllm_backend.py", "vllm_rig_kvarn")


def _expected(q, k_ctx, v_ctx, k_new, v_new, ctx):
    """Causal attention of each new query over the cached context + the new tokens up to itself."""
    k_all, v_all = torch.cat([k_ctx, k_new.float()]), torch.cat([v_ctx, v_new.float()])
    return r.causal_attention(q, k_all, v_all, ctx)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("method", ["kvarn", "rtn"])
def test_a_request_through_chunks_and_decode_matches_the_format_reference(backend, monkeypatch, method):
    """One request's life through KvarnAttentionImpl: a 300-token chunk, a 200-token chunk, then 70 decode steps
    (crossing the 512-token group boundary), pages scattered in a pool. Each step's output equals causal
    attention over reference.cached_context (packed groups round-tripped, the unpacked tail and the step's
    tokens as they are) within TOL; every full group's page holds the reference's bytes for those tokens.
    Negative control: attention over the exact K/V (no cache quantization) misses by far more than TOL once a
    group is packed, so the check sees the quantization. ``rtn`` (VLLM_RIG_KVARN_METHOD, the baseline at the same
    bytes) is held to the reference with rotation and normalization off."""
    monkeypatch.setattr(backend, "METHOD", method)
    on = method == "kvarn"
    g = torch.Generator().manual_seed(5)
    total = 300 + 200 + 70
    k = (torch.randn(total, HKV, D, generator=g) * torch.linspace(0.5, 4, D)).to(torch.bfloat16)
    v = torch.randn(total, HKV, D, generator=g).to(torch.bfloat16)
    q = torch.randn(total, HQ, D, generator=g).to(torch.bfloat16)
    impl = backend.KvarnAttentionImpl(HQ, D, 1 / math.sqrt(D), HKV, None, None, "kvarn")
    pool = torch.full((9, impl.page_bytes), 0xA5, dtype=torch.uint8)
    table = torch.tensor([7, 2, 5, 0, 8], dtype=torch.int32)
    tail_k = torch.full((G, HKV, D), float("nan"), dtype=torch.bfloat16)
    tail_v = tail_k.clone()
    steps = [(0, 300), (300, 500), *((t, t + 1) for t in range(500, total))]
    worst, exact_gap = 0.0, 0.0
    for a, b in steps:
        out = torch.full((b - a, HQ, D), float("nan"), dtype=torch.float32)
        impl._request(q[a:b], k[a:b], v[a:b], out, pool, table, tail_k, tail_v, b)
        k_ctx = r.cached_context(k[:a].float(), r.K_BITS, on, on)
        v_ctx = r.cached_context(v[:a].float(), r.V_BITS, on, on)
        want = _expected(q[a:b], k_ctx, v_ctx, k[a:b], v[a:b], a)
        worst = max(worst, _rel(out, want))
        if a >= G:
            exact_gap = max(exact_gap, _rel(out, _expected(q[a:b], k[:a].float(), v[:a].float(), k[a:b], v[a:b], a)))
    assert worst < TOL, worst
    assert exact_gap > 100 * TOL, exact_gap
    for grp in range(total // G):
        sl = slice(grp * G, (grp + 1) * G)
        want = torch.cat([r.quantize(k[sl], r.K_BITS, on, on).to_tensor(),
                          r.quantize(v[sl], r.V_BITS, on, on).to_tensor()])
        assert torch.equal(pool[int(table[grp])], want), grp
    held = total % G
    assert torch.equal(tail_k[:held], k[total - held:]) and torch.equal(tail_v[:held], v[total - held:])
    untouched = sorted(set(range(9)) - {int(t) for t in table[: total // G]})
    assert all(bool((pool[p] == 0xA5).all()) for p in untouched)


def test_unsupported_attention_is_refused_by_name(backend):
    with pytest.raises(NotImplementedError, match="causal decoder attention only.*sliding_window"):
        backend.KvarnAttentionImpl(HQ, D, 0.06, HKV, None, 4096, "kvarn")
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        backend.KvarnAttentionImpl(HQ, D, 0.06, HKV, None, None, "kvarn", logits_soft_cap=30.0)


def test_the_backends_page_is_the_planners(backend):
    """What the backend publishes to vLLM (customize_spec: 208 B per KV head and token; kernel block 128; one
    page row per kernel block; a tail of K and V a group long in the model's dtype) is the format's layout and
    the planner's figures (rig/capacity/kvarn.py); vLLM's hybrid block rule run with this class is in
    tests/test_capacity.py."""
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=G, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16)
    packed = backend.KvarnAttentionBackend.customize_spec(spec)
    assert packed == replace(spec, dtype=torch.uint8, state_content_bytes=208)
    assert packed.page_size_bytes == r.page_bytes() == G * HKV * kvarn.head_token_bytes(D)
    assert backend.KvarnAttentionBackend.get_kv_cache_shape(11, G, HKV, D) == (11, r.page_bytes())
    assert backend.KvarnAttentionBackend.get_supported_kernel_block_sizes() == [kvarn.group_tokens()]
    assert backend.tail_bytes(HKV, D, torch.bfloat16) == r.tail_bytes() == 524_288
    assert pages.tail_layer_bytes(shape.real_shape(), "kvarn") == 524_288
    with pytest.raises(ValueError, match="one 128-token group"):
        backend.KvarnAttentionBackend.get_kv_cache_shape(11, 64, HKV, D)


def test_the_patched_platforms_load_rigs_backend_for_kvarn_and_name_the_missing_folder(monkeypatch, tmp_path):
    """kvarn-cache's hook in the installed vLLM: with VLLM_RIG_KVARN_DIR unset or not rig's folder the engine
    stops naming the knob and the path; with the folder the CPU platform (and the CUDA one, same hook) returns
    the backend's class path, which resolves to the module the patch loaded; other dtypes keep vLLM's choice."""
    import sys

    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import rig_kvarn_backend
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.delitem(sys.modules, "vllm_rig_kvarn", raising=False)
    monkeypatch.delenv("VLLM_RIG_KVARN_DIR", raising=False)
    with pytest.raises(ValueError, match=r"VLLM_RIG_KVARN_DIR='' must be the absolute path of rig's kernels/kvarn"):
        rig_kvarn_backend()
    monkeypatch.setenv("VLLM_RIG_KVARN_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=rf"'{tmp_path}/vllm_backend.py' is not a file"):
        rig_kvarn_backend()
    assert "vllm_rig_kvarn" not in sys.modules
    monkeypatch.setenv("VLLM_RIG_KVARN_DIR", str(KVARN))
    cfg = dict(head_size=256, dtype=torch.bfloat16, block_size=None)
    path = CpuPlatform.get_attn_backend_cls(None, AttentionSelectorConfig(kv_cache_dtype="kvarn", **cfg))
    assert path == "vllm_rig_kvarn.KvarnAttentionBackend"
    assert resolve_obj_by_qualname(path) is sys.modules["vllm_rig_kvarn"].KvarnAttentionBackend
    auto = CpuPlatform.get_attn_backend_cls(None, AttentionSelectorConfig(kv_cache_dtype="auto", **cfg))
    assert auto.endswith("CPUAttentionBackend")


def test_engine_perplexity_bench_refuses_bad_input_before_any_server_starts():
    """bench/scripts/kvarn_engine_ppl.py: an unknown method or set, or windows no longer than a step (no token
    would attend over the cache), stop it with the reason before a server is started."""
    import subprocess
    import sys

    script = paths.ROOT / "bench" / "scripts" / "kvarn_engine_ppl.py"
    for args, why in ((["--methods", "auto,fp4"], "--methods 'auto,fp4': each of auto, kvarn, rtn"),
                      (["--sets", "wikitext3"], "--sets 'wikitext3': sets of quality/perplexity.toml"),
                      (["--window-tokens", "2048"], "--window-tokens 2048 must exceed the step of 2048 tokens")):
        r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and why in r.stderr, (args, r.stderr[-2000:])
        assert "vllm serve" not in r.stderr and "Starting vLLM" not in r.stderr


def test_the_engine_choice_follows_the_device_and_names_a_bad_value(backend):
    """VLLM_RIG_KVARN_ENGINE: auto takes the Triton engine on CUDA and the torch one elsewhere; an explicit choice
    wins; anything else stops the engine naming the variable and the allowed values."""
    assert [backend.engine_for(d, "auto") for d in ("cuda", "cpu")] == ["triton", "torch"]
    assert backend.engine_for("cuda", "torch") == "torch" and backend.engine_for("cpu", "triton") == "triton"
    with pytest.raises(ValueError, match=r"VLLM_RIG_KVARN_ENGINE='fast': expected one of auto, torch, triton"):
        backend.engine_for("cuda", "fast")
