"""The capacity planner: real vLLM 0.28 page and pool code, the reference's published figures, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rig import enginelog, paths
from rig.capacity import cards, pages, report, shape, weights
from rig.plan import resolve
from rig.server import free_port, port_in_use

INV = str(Path(sys.executable).with_name("inv"))
RTX3090 = cards.card("rtx3090")


def budget(**sets: str):
    return report.for_plan(resolve("batch", platform="gpu", environ={}, sets=sets), RTX3090).budget


def test_weights_of_the_published_shape_are_27b_parameters_and_w4a16_bytes():
    """The shape file's layers add up to the model card's 27B; int4 + fp16 group scales + bf16 rest."""
    s = shape.real_shape()
    assert (s.gdn_layers, s.attention_layers) == (48, 16)
    params = sum(i * o for kind in s.layer_types for i, o in weights.layer_linears(s, kind).values())
    params += 2 * s.vocab_size * s.hidden_size
    assert 26.5e9 < params < 27.5e9
    w = weights.count(s)
    assert w.embeddings == w.lm_head == 248320 * 5120 * 2
    assert w.scales * 128 // 2 == w.quantized * 2  # one fp16 scale per 128 int4 weights
    assert w.loaded(with_mtp=True) - w.loaded(with_mtp=False) == w.mtp > 0


def test_state_kv_and_page_sizes_are_vllms_and_agree_with_first_principles():
    s = shape.real_shape()
    st = pages.state_bytes(s, "float16")
    assert st == {"recurrent": 48 * 128 * 128 * 2, "conv": (2 * 16 * 128 + 48 * 128) * 3 * 2}
    assert pages.state_bytes(s, "float32")["recurrent"] == 2 * st["recurrent"]
    assert pages.state_bytes(s, "float16", num_spec=2)["conv"] == st["conv"] // 3 * 5  # a conv row a draft token
    assert pages.mamba_page_bytes(s, "float16") == sum(st.values())
    table = report.kv_table(s, 1)
    assert table["fp8"] == 2 * 4 * 256 and table["bfloat16"] == 2 * 4 * 256 * 2
    assert table["int8_per_token_head"] == table["fp8_per_token_head"] == 2 * 4 * (256 + 4)  # + an fp32 scale
    assert table["int4_per_token_head"] == 2 * 4 * (128 + 4)  # per token and head, K and V
    # TurboQuant slots per head: key (fp8, or 3/4-bit codes + an fp16 norm) + value (codes + fp16 scale and zero)
    assert table["turboquant_k8v4"] == 4 * (256 + 128 + 4)
    assert table["turboquant_4bit_nc"] == 4 * (128 + 2 + 128 + 4)
    assert table["turboquant_k3v4_nc"] == 4 * (96 + 2 + 128 + 4)
    assert table["turboquant_3bit_nc"] == 4 * (96 + 2 + 96 + 4)
    assert table["kvarn"] == 832
    p = pages.pool(s, "fp8", "float16", 8 * 2**30, 150000)
    assert p.block_size == 800 and p.page_bytes == 800 * 2048 >= p.mamba_page_bytes  # raised to the mamba page
    assert (p.groups, p.layers_per_group) == (4, 16)  # 3 GDN groups + 1 attention group of 16 layers


def _vllm_allocates(kv: str, heads: int, head_dim: int) -> int:
    """Bytes per token per attention layer of the KV tensor vLLM 0.28 allocates: the backend's
    get_kv_cache_shape (what the model runner reshapes the raw cache into) x the cache dtype's size."""
    import math

    pages._vllm()
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_dtype_size
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

    # bfloat16/fp8 run on FlashAttention or FlashInfer (not importable on CPU; same (blocks, heads, block, 2 x head)
    # layout for these dtypes), the per-token-head caches on Triton, TurboQuant's on its own backend
    backend = (TurboQuantAttentionBackend if kv.startswith("turboquant_") else
               TritonAttentionBackend if kv.endswith("_per_token_head") else FlashAttentionBackend)
    blocks, block = 3, 16
    shape_ = backend.get_kv_cache_shape(blocks, block, heads, head_dim, kv)
    return math.prod(shape_) * get_dtype_size(STR_DTYPE_TO_TORCH_DTYPE[kv]) // (blocks * block)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kv", pages.KV_DTYPES)
def test_kv_bytes_per_token_are_what_vllm_allocates(kv, tp):
    s = shape.real_shape()
    assert pages.attention_token_bytes(s, kv, tp) == _vllm_allocates(kv, s.num_key_value_heads // tp, s.head_dim)


@pytest.fixture(scope="module")
def vllm_configs(tmp_path_factory):
    """vLLM 0.28's own VllmConfig of the tiny hybrid (its folder) and of the real shape (a config.json of
    models/qwen3.5-27b-class.toml, no weights; the tiny model's tokenizer): what _align_hybrid_block_size reads."""
    pages._vllm()
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    real = shape.real_shape()
    folder = tmp_path_factory.mktemp("real-shape")
    (folder / "config.json").write_text(json.dumps({k: v for k, v in real.config.items()
                                                    if k != "quantization_config"}))
    tiny = paths.ROOT / "models" / "trained" / "tiny-hybrid"
    out = {}
    for name, model, s in (("tiny", tiny, shape.for_model(str(tiny), tiny)), ("real", folder, real)):
        mc = ModelConfig(model=str(model), tokenizer=str(tiny), dtype="bfloat16", max_model_len=4096)
        out[name] = (VllmConfig(model_config=mc, cache_config=CacheConfig()), s)
    return out


def _vllm_hybrid_block(vc, backend, cache_dtype: str, block: int, ssm: str) -> tuple[int, int]:
    """(block size, attention page) vLLM's Platform._align_hybrid_block_size sets for this cache, starting from
    ``block`` (16 = the CUDA default with BLOCK_SIZE=0, or --block-size)."""
    from vllm.platforms.interface import Platform

    cc = vc.cache_config
    cc.cache_dtype, cc.block_size, cc.mamba_page_size_padded, cc.mamba_ssm_cache_dtype = cache_dtype, block, None, ssm
    Platform._align_hybrid_block_size(vc, backend)
    return cc.block_size, cc.mamba_page_size_padded


@pytest.mark.parametrize("ssm", ["float16", "float32"])
@pytest.mark.parametrize("kv", pages.KV_DTYPES)
@pytest.mark.parametrize("model", ["tiny", "real"])
def test_hybrid_block_and_page_are_vllms_own_rule(vllm_configs, model, kv, ssm):
    """The planner's restated hybrid block rule against vLLM's own, run on the model's config, for every dtype."""
    vc, s = vllm_configs[model]
    block, page = _vllm_hybrid_block(vc, pages._backend(kv), kv, 16, ssm)
    p = pages.pool(s, kv, ssm, 2**30, 4096)
    assert (p.block_size, p.page_bytes) == (block, page or p.mamba_page_bytes)


def _kvarn_backend(s, kernel_blocks):
    """What a kvarn backend would tell vLLM (none exists): its packed spec (rig/capacity/kvarn.py's bytes, as
    TurboQuant publishes its slots) and its kernel block, one 128-token group."""
    from dataclasses import replace

    from vllm.v1.attention.backend import AttentionBackend

    packed = pages.attention_spec(s, "kvarn")

    class KvarnStandIn(AttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes():
            return kernel_blocks

        @classmethod
        def customize_spec(cls, spec):
            return replace(spec, dtype=packed.dtype, state_content_bytes=packed.state_content_bytes)

    return KvarnStandIn


@pytest.mark.parametrize("ssm", ["float16", "float32"])
def test_kvarn_block_of_128_holds_whole_groups_by_vllms_rule_and_64_cannot(vllm_configs, ssm):
    """docs/kvarn.md's block-size finding, asked of vLLM 0.28's code on the real shape: with BLOCK_SIZE=128 the
    hybrid block is 2048 (fp16 state) / 3968 (fp32) tokens, whole groups, as the planner has it; BLOCK_SIZE=64 is
    refused by a backend whose kernel block is the group, and a 64-token kernel block would give 1984 / 3904-token
    blocks that split a group, which vLLM then cannot cut into 128-token kernel blocks."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.worker.utils import select_common_block_size

    vc, s = vllm_configs["real"]
    group = _kvarn_backend(s, [128])
    block, page = _vllm_hybrid_block(vc, group, "auto", 128, ssm)
    p = pages.pool(s, "kvarn", ssm, 8 * 2**30, 4096, requested_block=128)
    assert (p.block_size, p.page_bytes) == (block, page) == {"float16": (2048, 2048 * 832),
                                                              "float32": (3968, 3968 * 832)}[ssm]
    assert block % 128 == 0 and select_common_block_size(block, [group]) == 128  # 128-token kernel pages
    assert not group.supports_block_size(64)  # --block-size 64: the backend is refused at selection
    half, _ = _vllm_hybrid_block(vc, _kvarn_backend(s, [MultipleOf(64)]), "auto", 64, ssm)
    assert half == {"float16": 1984, "float32": 3904}[ssm] and half % 128 == 64
    with pytest.raises(ValueError, match="No common block size"):
        select_common_block_size(half, [group])


def test_kvarn_prefix_match_unit_is_the_block():
    """With PREFIX_CACHE=1 vLLM hashes the prompt in blocks of the hybrid block (resolve_kv_cache_block_sizes:
    the gcd of the groups' block sizes, all 2048 here), so a cache hit is a multiple of 2048 tokens."""
    s = shape.real_shape()
    assert pages.pool(s, "kvarn", "float16", 8 * 2**30, 4096, 128, prefix_cache=True).match_unit == 2048
    assert pages.pool(s, "fp8", "float16", 8 * 2**30, 4096, 0, prefix_cache=True).match_unit == 800
    assert pages.pool(s, "fp8", "float16", 8 * 2**30, 4096).match_unit == 0


def _kvarn_backend_class():
    """rig's kvarn backend (kernels/kvarn/vllm_backend.py) as the kvarn-cache patch loads it."""
    from rig.kernels import load_file

    return load_file(paths.ROOT / "kernels" / "kvarn" / "vllm_backend.py", "vllm_rig_kvarn").KvarnAttentionBackend


@pytest.mark.parametrize("ssm", ["float16", "float32"])
@pytest.mark.parametrize("model", ["tiny", "real"])
def test_kvarn_hybrid_block_with_rigs_backend_is_vllms_rule_and_the_planners(vllm_configs, model, ssm):
    """vLLM's own Platform._align_hybrid_block_size, patched by kvarn-cache to fit the backend's companion state,
    run with rig's kvarn backend class: on the real shape the GDN page is larger than a layer's tail and the
    block stays 2048 (fp16 state) / 3968 (fp32); on the tiny hybrid the tail (524,288 B) sets it: 640 tokens,
    what the CPU server logs. The planner predicts the same block and page."""
    vc, s = vllm_configs[model]
    block, page = _vllm_hybrid_block(vc, _kvarn_backend_class(), "kvarn", 128, ssm)
    p = pages.pool(s, "kvarn", ssm, 2**30, 4096, 128)
    assert (p.block_size, p.page_bytes) == (block, page or p.mamba_page_bytes)
    assert block == {"real": {"float16": 2048, "float32": 3968}, "tiny": {"float16": 640, "float32": 640}}[model][ssm]
    assert p.page_bytes >= pages.tail_layer_bytes(s, "kvarn")


@pytest.mark.parametrize(("ssm", "per", "groups", "seat"), [("float16", 2, 9, 8 * 2048 * 832),
                                                            ("float32", 4, 17, 4 * 3968 * 832)])
def test_kvarn_tails_share_companions_that_vllm_groups_as_state(vllm_configs, ssm, per, groups, seat):
    """KV=kvarn keeps each running request's newest < 128 tokens in companion state layers (MambaSpec, one block a
    request: docs/kvarn.md, "The backend in vLLM"). The backend puts as many layers' tails in one companion as
    fit the GDN state page and divide the 16 attention layers (2 with fp16 state, 4 with fp32), so vLLM's own
    grouping makes groups of 8 (4) layers and a seat holds 8 (4) tail pages, not 16. The companions the backend
    builds on a VllmConfig of the real shape have the planner's spec, and the planner's pool counts the extra
    attention group a request then needs (its seats are below the block count / pages arithmetic of one group)."""
    import sys
    import types

    from vllm.platforms.interface import Platform

    vc, s = vllm_configs["real"]
    backend = _kvarn_backend_class()
    mod = sys.modules[backend.__module__]
    cc = vc.cache_config
    cc.cache_dtype, cc.mamba_ssm_cache_dtype, cc.mamba_cache_mode = "kvarn", ssm, "none"
    cc.block_size, cc.mamba_block_size, cc.mamba_page_size_padded = 128, 4096, None
    Platform._align_hybrid_block_size(vc, backend)
    p = pages.pool(s, "kvarn", ssm, 8 * 2**30, 4096, 128)
    assert (cc.block_size, p.block_size) == (p.block_size, {"float16": 2048, "float32": 3968}[ssm])
    assert mod.tails_per_companion(16, 524_288, pages.mamba_page_bytes(s, ssm)) == per
    vc.compilation_config.static_forward_context.clear()
    layers = [types.SimpleNamespace(num_kv_heads=4, head_size=256) for _ in range(s.attention_layers)]
    tails = [backend.make_companion(layer, f"model.layers.{4 * i + 3}.self_attn.attn", vc)
             for i, layer in enumerate(layers)]
    assert [layer.rig_kvarn_slot for layer in layers] == list(range(per)) * (16 // per)
    unique = list(dict.fromkeys(tails))
    planned = pages.tail_specs(s, "kvarn", p.page_bytes, "none", per)
    assert list(planned) == [t.prefix for t in unique] and len(unique) == 16 // per
    spec = unique[0].get_kv_cache_spec(vc)
    assert (spec.shapes, spec.dtypes, spec.page_size_bytes) == (
        planned[unique[0].prefix].shapes, planned[unique[0].prefix].dtypes, p.page_bytes)
    assert p.groups == groups and p.layers_per_group == 16 // per and p.tail_seat_bytes == seat
    assert p.attention_groups == per and p.seats(4096) == (p.blocks - 1) // (p.state_groups + per * 2)
    vc.compilation_config.static_forward_context.clear()


def test_kvarn_plan_shows_the_tail_pages_a_seat_takes():
    plan = resolve("kvarn", platform="gpu", environ={}, sets={"KV_MEM": str(8 * 2**30)})
    r = report.for_plan(plan, RTX3090)
    text = report.render(r)
    assert "kvarn tail" in text and "13,631,488 B / seat" in text and "524,288 B a layer" in text
    assert [w for w in r.budget.warnings if w.startswith("KV='kvarn' (rig's backend") and "13,631,488 B" in w]


def test_tiny_pool_is_what_a_live_cpu_server_reported():
    """KV_MEM=1G on the tiny hybrid: 260,616 tokens, the pool `bench/scripts/server_memory.py --kv-mem 1G`
    read from a running server's log (docs/profiles.md, 2026-12-03)."""
    plan = resolve("batch", platform="cpu", environ={}, sets={"KV_MEM": "1G"})
    assert report.for_plan(plan, None).budget.pool.reported_tokens == 260_616


@pytest.mark.parametrize(("sets", "what", "published"), [
    ({}, "pool", 223_821), ({"PREFIX_CACHE": "1"}, "pool", 193_298),
    ({"MAMBA_SSM_DTYPE": "float32"}, "seats", 37), ({}, "seats", 70),
])
def test_reference_figures_within_3_percent(sets, what, published):
    """The reference stack's RTX 3090 figures (the two pools are what hardware/gpus.toml's overheads were
    calibrated on; the seat counts follow from them and vLLM's pages)."""
    b = budget(**sets)
    got = b.pool.reported_tokens if what == "pool" else b.short_seats
    assert abs(got - published) / published <= 0.03, (got, published)


def test_a_plan_that_cannot_start_is_refused_with_the_value_that_fits():
    fp32 = budget(MAMBA_SSM_DTYPE="float32")
    assert len(fp32.errors) == 1 and "MAX_SEQS=64" in fp32.errors[0] and "MAMBA_SSM_DTYPE=float16" in fp32.errors[0]
    assert not budget(MAMBA_SSM_DTYPE="float32", MAX_SEQS=str(fp32.short_seats)).errors
    long = budget(MAX_LEN="262144")
    assert [e for e in long.errors if e.startswith("MAX_LEN=262144")]
    assert not budget(MAX_LEN=str(long.max_len_fit)).errors
    small = budget(GPU_UTIL="0.6")
    assert small.errors and small.errors[0].startswith("the weights alone") and small.pool is None
    def cpu(kv_mem: str):
        return report.for_plan(resolve("batch", platform="cpu", environ={}, sets={"KV_MEM": kv_mem}), None).budget

    tight = cpu("64M")
    assert tight.errors and "or KV_MEM=135266304 (the 516 blocks it needs)" in tight.errors[0]
    assert not cpu("135266304").errors and cpu("135266303").errors
    near = budget(PREFIX_CACHE="1")
    assert not near.errors and [w for w in near.warnings if f"MAX_SEQS={near.short_seats} fits" in w]


def test_kv_mem_suggested_reproduces_the_pool():
    b = budget()
    again = budget(KV_MEM=str(b.kv_mem_exact))
    assert again.pool.reported_tokens == b.pool.reported_tokens and again.pool.blocks == b.pool.blocks
    assert budget(KV_MEM=str(b.kv_mem_margin)).pool.blocks < b.pool.blocks


def test_cpu_plan_reads_nothing_of_the_host(monkeypatch):
    """On CPU the pool is KV_MEM bytes: the report is the same whatever the host has (psutil unreadable)."""
    import psutil

    plan = resolve("batch", platform="cpu", environ={})
    before = report.for_plan(plan, None).to_json()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: (_ for _ in ()).throw(AssertionError("read the host")))
    assert report.for_plan(plan, None).to_json() == before


def test_inv_plan_prints_json_and_exits_2_for_a_plan_that_cannot_start():
    r = subprocess.run([INV, "plan", "--profile", "batch", "--gpu", "rtx3090", "--json", "--set", "PREFILL_ATTN=int8"],
                       cwd=paths.ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)  # the plan's warnings go to stderr, as serve prints them
    assert data["budget"]["pool"]["reported_tokens"] == 223_821 and data["roofline"]["decode_tok_s"] > 0
    assert "rig: warning: PREFILL_ATTN='int8' gets a prompt's tokens a step at a time" in r.stderr
    r = subprocess.run([INV, "plan", "--gpu", "rtx3090", "--set", "MAMBA_SSM_DTYPE=float32"], cwd=paths.ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "refused: MAX_SEQS=64" in r.stdout
    r = subprocess.run([INV, "plan", "--gpu", "rtx9090"], cwd=paths.ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "--gpu 'rtx9090': not in hardware/gpus.toml; known cards: a100-80" in r.stderr


def test_serve_refuses_a_pool_too_small_for_max_len_before_starting_anything():
    port = free_port()
    r = subprocess.run([INV, "serve", "--platform", "cpu", "--set", f"PORT={port}", "--set", "KV_MEM=64M"],
                       cwd=paths.ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "rig: error: the capacity plan cannot start" in r.stderr
    assert "MAX_LEN=32768: the pool (256 blocks of 64 tokens" in r.stderr and "set MAX_LEN=16128" in r.stderr
    assert not port_in_use(port)


def test_tiny_pool_on_cuda_is_what_the_h200_server_reported():
    """The H200 run of docs/gpu.md (tiny hybrid, fp8 KV, fp16 state, prefix cache, KV_MEM 4 GiB) logged a
    pool of 2,077,843 tokens: the planner, on CPU, predicts exactly that for the same argv."""
    record = json.loads((paths.DOCS / "gpu-runs" / "2026-12-03-h200" / "gpu-tier.json").read_text())
    plan = resolve("batch", platform="gpu", environ={}, sets={
        "MODEL": "tiny:hybrid", "MAX_LEN": "32768", "KV_MEM": "4G", "GPU_ARCH": "sm90", "PREFIX_CACHE": "1"})
    flags = ("--max-model-len", "--max-num-seqs", "--mamba-ssm-cache-dtype", "--kv-cache-memory-bytes",
             "--kv-cache-dtype", "--enable-prefix-caching", "--mamba-cache-mode", "--block-size")

    def chosen(argv: list[str]) -> dict[str, str]:
        return {a: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "")
                for i, a in enumerate(argv) if a in flags}

    assert chosen(record["argv"]) == chosen(plan.argv)
    pool = report.for_plan(plan, cards.card("h200")).budget.pool
    assert pool.reported_tokens == record["kv_pool_tokens"] == 2_077_843


@pytest.mark.parametrize("rung", ["mlp", "fp16"])
def test_seats_of_the_real_shape_are_what_the_h100_engine_ran(rung):
    """The H100 run of 2026-12-05 (the real shape under gpu24, 64 requests of 128/512 sent at once):
    vLLM logged its pool and ran at most R of the 64. The planner's seat rule, given the block count
    behind that pool (vLLM's own grouping, on CPU), says R too: the pool was mispredicted, the seats
    were not (docs/gpu.md, "The real shape served")."""
    run = paths.DOCS / "gpu-runs" / "2026-12-05-h100" / rung
    knobs = json.loads((run / "plan.json").read_text())["knobs"]
    tokens = enginelog.read(run / "serve.log").pool_tokens
    running = _most_running(run / "serve.log")
    cell = 128 + 512
    s = shape.real_shape()

    def at(kv_bytes: int) -> pages.Pool:
        return pages.pool(s, knobs["KV"], knobs["MAMBA_SSM_DTYPE"], kv_bytes, knobs["MAX_LEN"])

    first = at(1 << 33)
    block_bytes = first.page_bytes * first.layers_per_group
    guess = tokens * first.blocks // first.reported_tokens
    match = [p for b in range(guess - 2, guess + 3) if (p := at(b * block_bytes + 1)).reported_tokens == tokens]
    assert match, f"no block count near {guess} gives vLLM's {tokens:,} tokens"
    assert running < 64 and match[0].seats(cell) == running


def _most_running(serve_log: Path) -> int:
    """The most requests a served engine ran at once (its 10 s stats lines: "Running: N reqs")."""
    import re

    return max(int(n) for n in re.findall(r"Running: (\d+) reqs", serve_log.read_text()))


H200_LADDER = paths.DOCS / "gpu-runs" / "2026-12-05-h200-ladder"


def _h200_pinned_budget(rung: str, **sets: str):
    """The planner's budget, on CPU, for a rung of the H200 ladder: the real shape under gpu24 on the H200,
    KV_MEM pinned as gpu_session.sh pinned it there (the rung's pool-of.txt)."""
    import re

    pinned = re.search(r"KV_MEM=(\d+)", (H200_LADDER / rung / "pool-of.txt").read_text())[1]
    plan = resolve("batch", platform="gpu", environ={}, overlays=["gpu24"], sets={
        "MODEL": "fixture:qwen3.5-27b-class", "GPU_ARCH": "sm90", "KV_MEM": pinned, **sets})
    return report.for_plan(plan, cards.card("h200")).budget


@pytest.mark.parametrize("rung", ["mlp", "fp16", "all"])
def test_the_3090_pool_pinned_on_the_h200_is_what_its_engine_allocated(rung):
    """The H200 ladder of 2026-12-05 (night) pinned KV_MEM to the rtx3090 plan's pool: the planner, on CPU,
    gives vLLM's logged pool to the token for that KV_MEM, and its seats (71) held the 64 requests the
    engine ran at once (docs/gpu.md, "The ladder in compile mode")."""
    run = H200_LADDER / rung
    knobs = json.loads((run / "plan.json").read_text())["knobs"]
    # the knobs the pool depends on, as plan.json has them
    b = _h200_pinned_budget(rung, MAMBA_SSM_DTYPE=knobs["MAMBA_SSM_DTYPE"])
    assert knobs["KV_MEM"] == b.kv_bytes  # plan.json's pin is the one pool-of.txt names
    tokens = enginelog.read(run / "serve.log").pool_tokens
    running = _most_running(run / "serve.log")
    assert b.pool.reported_tokens == tokens == 224_607
    assert running == 64 <= b.short_seats and not b.errors


def test_float32_state_on_the_3090_pool_is_refused_at_64_seats_and_fits_36():
    """The ladder's fp32 rung on the H200 (same pin): the planner refused MAX_SEQS=64 before anything
    started (the reference's 3090 ran 37 of 64 with float32 state); the refusal names 36 seats, what
    `gpu_session.sh`'s MAX_SEQS=fit then runs."""
    b = _h200_pinned_budget("fp32", INT8_ACT="", MAMBA_SSM_DTYPE="float32")
    assert b.short_seats == 36 and any("only 36 requests can run" in e for e in b.errors)
    refusal = (H200_LADDER / "fp32" / "plan.txt").read_text().replace("\n", " ")
    assert "only 36 requests can run; set MAX_SEQS=36" in refusal
    assert not _h200_pinned_budget("fp32", INT8_ACT="", MAMBA_SSM_DTYPE="float32", MAX_SEQS="36").errors


def test_a_dense_model_plans_with_no_gdn_state(tmp_path):
    """The quality battery's dense control (Qwen3ForCausalLM: no layer_types, no GDN dims) goes through
    serve's preflight too: every layer is attention, no state, vLLM's plain block size."""
    from rig.models.tiny import TinySpec, _dense_config

    (tmp_path / "config.json").write_text(json.dumps(_dense_config(TinySpec(arch="dense"), {"<|endoftext|>": 0,
                                                                                           "<|im_end|>": 1})))
    plan = resolve("batch", platform="cpu", environ={}, sets={"MODEL": str(tmp_path)})
    r = report.for_plan(plan, None)
    s = shape.for_model(str(tmp_path), tmp_path)
    assert s.gdn_layers == 0 and s.attention_layers == s.num_hidden_layers
    assert r.state_per_seat == 0 and r.budget.pool.state_groups == 0 and r.budget.pool.padding == 0.0
    assert not r.budget.errors and r.budget.pool.reported_tokens > plan.knobs["MAX_LEN"]
    # TurboQuant keeps a dense model's first and last 2 layers unquantized (vLLM's boundary skip): not predicted
    tq = report.for_plan(resolve("batch", platform="gpu", environ={}, sets={"MODEL": str(tmp_path),
                                                                            "KV": "turboquant_4bit_nc"}), RTX3090)
    assert tq.budget.pool is None and [w for w in tq.budget.warnings if "the pool is not predicted" in w]
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    n = s.num_hidden_layers
    dense = SimpleNamespace(is_hybrid=False, hf_text_config=SimpleNamespace(num_hidden_layers=n))
    assert TurboQuantConfig.get_boundary_skip_layers(dense) == ["0", "1", str(n - 2), str(n - 1)]
    real = shape.real_shape()
    hybrid = SimpleNamespace(is_hybrid=True, hf_text_config=SimpleNamespace(layer_types=list(real.layer_types)),
                             hf_config=None)
    assert TurboQuantConfig.get_boundary_skip_layers(hybrid) == []  # all 16 attention layers quantized


def test_gpu_mem_plans_for_that_many_bytes_of_the_card():
    """The gpu24 overlay on an H200: the planner sees a 24 GiB card, as serve's --gpu-memory-utilization does."""
    h200 = cards.card("h200")
    plan = resolve("batch", ("gpu24",), "gpu", environ={})
    r = report.for_plan(plan, h200)
    assert r.card.memory_bytes == 24 * 2**30 and "GPU_MEM" in r.card.name
    full = report.for_plan(resolve("batch", platform="gpu", environ={}), h200)
    assert full.budget.pool.reported_tokens > 4 * r.budget.pool.reported_tokens


def test_a_config_the_planner_cannot_read_is_refused_naming_the_keys(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["X"], "model_type": "x", "hidden_size": 64}')
    with pytest.raises(shape.ShapeError, match="needs num_hidden_layers, intermediate_size"):
        shape.for_model(str(tmp_path), tmp_path)
    r = subprocess.run([INV, "plan", "--platform", "cpu", "--set", f"MODEL={tmp_path}"], cwd=paths.ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "rig: error:" in r.stderr and "config.json: the capacity planner needs" in r.stderr
    assert "Traceback" not in r.stderr


def test_decode_bound_reads_weights_once_and_embedding_rows_only():
    """The roofline by hand: a step moves every loaded weight but the embedding table (its seats' rows),
    each seat's state twice and its KV once; one seat's bound is bandwidth / those bytes."""
    from rig.capacity import roofline

    s = shape.real_shape()
    w = weights.count(s)
    loaded = w.loaded(with_mtp=False)
    read = roofline.decode_weight_bytes(loaded, w, s, 64)
    assert read == loaded - s.vocab_size * s.hidden_size * 2 + 64 * s.hidden_size * 2
    tied = shape.from_config({**s.config, "tie_word_embeddings": True}, "tied")
    assert roofline.decode_weight_bytes(loaded, w, tied, 64) == loaded
    r = roofline.bounds(s, read, 1_000_000, 4_096, 64, 4_096, 936, 71, 284, "", "gate_up")
    sb = read + 64 * (2 * 1_000_000 + 4_096 * 4_096)
    flops = sum(roofline.linear_flops(s, None)) + roofline.attention_flops(s, 4_096)
    assert r.step_bytes == sb and r.decode_memory_tok_s == pytest.approx(64 * 936e9 / sb)
    assert r.decode_compute_tok_s == pytest.approx(71e12 / flops) == pytest.approx(r.prefill_tok_s)
    assert r.decode_tok_s == min(r.decode_memory_tok_s, r.decode_compute_tok_s)
    i8 = roofline.bounds(s, read, 1_000_000, 4_096, 64, 4_096, 936, 71, 284, "int8", ".")
    assert i8.prefill_tok_s > r.prefill_tok_s == pytest.approx(r.prefill_tok_s_fp16)
    assert i8.decode_memory_tok_s == r.decode_memory_tok_s  # int8 activations move no fewer bytes


def test_decode_at_64_seats_is_compute_bound_on_a_3090_and_memory_bound_on_an_h200():
    """Why the ladder's int8 rungs pay on the 3090 and not on the H200 (docs/gpu.md, 2026-12-05 night): at
    64 seats of the 128/512 cell (384 tokens on average) the 3090's fp16 tensor cores bind before its
    bandwidth, so int8 activations raise its decode bound; the H200 stays memory-bound whatever INT8_LAYERS."""
    from rig.capacity import roofline

    s = shape.real_shape()
    w = weights.count(s)
    read = roofline.decode_weight_bytes(w.loaded(with_mtp=False), w, s, 64)
    state = sum(pages.state_bytes(s, "float16", 1, 0).values()) * s.gdn_layers
    kv = 2_048 * s.attention_layers  # fp8

    def bound(card: cards.Card, int8_act: str, layers: str) -> roofline.Roofline:
        return roofline.bounds(s, read, state, kv, 64, 384, card.bandwidth_gbs, card.fp16_tflops,
                               card.int8_tops, int8_act, layers)

    rtx, h200 = RTX3090, cards.card("h200")
    plain, mlp = bound(rtx, "", "mlp"), bound(rtx, "int8", "mlp")
    assert plain.decode_limit == "compute" and mlp.decode_limit == "memory"
    assert mlp.decode_tok_s / plain.decode_tok_s > 1.5
    for layers in ("gate_up", "mlp", "."):
        assert bound(h200, "int8", layers).decode_limit == "memory"
        assert bound(h200, "int8", layers).decode_tok_s == bound(h200, "", layers).decode_tok_s


def test_a_busy_card_is_refused_with_the_gpu_util_that_fits():
    busy = cards.Card(key="rtx3090", name="NVIDIA GeForce RTX 3090", memory_bytes=RTX3090.memory_bytes,
                      free_bytes=20 * 2**30, bandwidth_gbs=936, fp16_tflops=71, int8_tops=284)
    b = report.for_plan(resolve("batch", platform="gpu", environ={}), busy).budget
    assert len(b.errors) == 1 and "has 20.00 GiB free" in b.errors[0] and "GPU_UTIL=0.825" in b.errors[0]


def test_nvml_names_find_the_tables_rates():
    c = cards.from_device("NVIDIA GeForce RTX 3090", 25_769_803_776, 25_000_000_000)
    assert (c.key, c.bandwidth_gbs, c.int8_tops, c.free_bytes) == ("rtx3090", 936, 284, 25_000_000_000)
    h100 = cards.from_device("NVIDIA H100 80GB HBM3", 85_520_809_984, 85_000_000_000)  # docs/gpu-runs/2026-12-05-h100
    assert (h100.key, h100.bandwidth_gbs, h100.fp16_tflops) == ("h100", 3350, 989.5)
    unknown = cards.from_device("NVIDIA Z9000", 10**10, 10**10)
    assert unknown.key == "nvml" and unknown.bandwidth_gbs is None


def test_max_len_near_the_cliff_is_warned_with_the_value_that_leaves_room():
    fit = budget(MAX_LEN="262144").max_len_fit
    near = budget(MAX_LEN=str(fit - 16))
    assert not near.errors and [w for w in near.warnings if w.startswith(f"MAX_LEN={fit - 16} is within")]
    roomy = int(fit / 1.2)
    assert not [w for w in budget(MAX_LEN=str(roomy)).warnings if w.startswith("MAX_LEN=")]


def test_a_pool_on_a_card_the_overheads_were_not_fitted_on_is_called_an_estimate():
    h200 = report.for_plan(resolve("batch", platform="gpu", environ={}), cards.card("h200")).budget
    assert [w for w in h200.warnings if "fitted on the rtx3090" in w and "KV_MEM (bytes) makes it exact" in w]
    assert not [w for w in budget().warnings if "fitted on" in w]
    exact = report.for_plan(resolve("batch", platform="gpu", environ={}, sets={"KV_MEM": "4G"}), cards.card("h200"))
    assert not [w for w in exact.budget.warnings if "fitted on" in w]


def test_a_plan_with_longer_steps_than_the_fit_is_warned_that_its_pool_is_smaller():
    """The runtime overhead was fitted at 2,048-token steps; the long-steps overlay (16,384) makes vLLM's profile
    run measure a larger activation peak, so its pool is warned about (the default's is not), and KV_MEM, which
    vLLM takes as it is, silences it. The step is read from the plan's own command line."""
    long = resolve("batch", ["long-steps"], platform="gpu", environ={})
    assert report.step_tokens(long.argv) == 16384
    assert report.step_tokens(resolve("batch", platform="gpu", environ={}).argv) == 2048
    warned = [w for w in report.for_plan(long, RTX3090).budget.warnings if "fitted at 2,048" in w]
    assert warned and "steps 16,384 tokens" in warned[0] and "smaller pool" in warned[0]
    assert not [w for w in budget().warnings if "fitted at" in w]
    pinned = resolve("batch", ["long-steps"], platform="gpu", environ={}, sets={"KV_MEM": "7G"})
    assert not [w for w in report.for_plan(pinned, RTX3090).budget.warnings if "fitted at" in w]


def test_the_log_reader_takes_the_last_report_and_none_for_a_missing_line():
    from rig import enginelog

    log = ("INFO Setting attention block size to 800 tokens to ensure that attention page size is >= mamba page size.\n"
           "INFO Padding mamba page size by 0.25% to ensure that mamba page size and attention page size are exactly "
           "equal.\nINFO GPU KV cache size: 1,000 tokens\nINFO Using FLASH_ATTN attention backend out of potential "
           "backends\nINFO GPU KV cache size: 223,821 tokens\n")
    assert enginelog.parse(log) == enginelog.EngineLog(223_821, 800, 0.25, "FLASH_ATTN")
    assert enginelog.parse("INFO CPU KV cache size: 9 tokens") == enginelog.EngineLog(9, None, None, None)
