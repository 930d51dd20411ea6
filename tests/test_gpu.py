"""The GPU tier: rig's serving path on a real CUDA GPU with vLLM's CUDA build (`inv test --gpu`).

One server for the module: the batch profile on the gpu platform through the same
``rig.serve.start`` that `serve` uses — vLLM's parser, NVML preflight, the patch series checked on
the installed CUDA tree, the readiness burst — with the tiny hybrid model rig builds (bf16),
PREFIX_CACHE=1 so the shared-prefix hit can be shown on the same server, GPU_ARCH set to the
device's own, and a KV cache of KV_MEM bytes (a tiny model needs no 0.972 of a large card).
``RIG_GPU_SETS`` ("KNOB=value KNOB=value") adds knobs, e.g. ``ENFORCE_EAGER=1`` for a faster
start. What the server chose (device, arch, attention backend, KV pool) is read back from its
log and NVML and written to ``<state>/results/gpu-tier.json``.

Skipped, with the reason, on a host without a CUDA device or without vLLM's CUDA build.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rig.serve import nvml_device

pytestmark = pytest.mark.gpu


def _cuda_device() -> tuple[str, str] | None:
    """(name, smXY) of GPU 0 through NVML (serve's own probe), or None."""
    try:
        dev = nvml_device()
    except Exception:
        return None
    return dev.name, dev.arch


def _memory() -> tuple[int, int]:
    """(total, free) bytes of GPU 0 through NVML (serve's own probe)."""
    dev = nvml_device()
    return dev.total_bytes, dev.free_bytes


def _skip_reason() -> str | None:
    if _cuda_device() is None:
        return "no CUDA GPU answers NVML on this host (the GPU tier runs on a CUDA host: `inv test --gpu`)"
    import importlib.metadata as md

    try:
        version = md.version("vllm")
    except md.PackageNotFoundError:
        return "vLLM is not installed"
    if "cpu" in version:
        return f"vLLM here is the CPU build ({version}); the GPU tier needs vLLM's CUDA build"
    return None


REASON = _skip_reason()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

PROMPT = " ".join(["The quiet river of Oslo is old, and Ana visited it last spring."] * 60)
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _sets(tmp: Path, arch: str) -> dict[str, str]:
    from rig.server import free_port

    sets = {"PORT": str(free_port()), "API_KEY_FILE": str(tmp / "api_key"), "MODEL": "tiny:hybrid",
            "SERVED_NAME": "rig-tiny-hybrid", "MAX_LEN": "32768", "KV_MEM": "4G", "GPU_ARCH": arch,
            # Two servers share the card (auto and PREFILL_ATTN=int8): each plans for 24 GiB of it, so
            # vLLM's start check (GPU_UTIL x the card <= free memory) passes for the second one too.
            "GPU_MEM": "24G",
            "PREFIX_CACHE": "1"}
    for item in os.environ.get("RIG_GPU_SETS", "").split():
        k, _, v = item.partition("=")
        sets[k] = v
    return sets


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory) -> Iterator:
    from rig import patches, paths
    from rig.plan import resolve
    from rig.serve import start

    os.environ.update(paths.cache_env())
    patches.ensure_applied(quiet=False)  # the series on the CUDA wheel's installed tree
    name, arch = _cuda_device()
    tmp = tmp_path_factory.mktemp("gpu")
    plan = resolve("batch", platform="gpu", environ={}, sets=_sets(tmp, arch))
    t0 = time.monotonic()
    server = start(plan, log_path=tmp / "vllm-gpu.log")
    ready_s = time.monotonic() - t0
    pids = server.pids()
    try:
        yield server, plan, {"device": name, "arch": arch, "ready_s": round(ready_s, 1)}
    finally:
        server.stop()
        time.sleep(1)
        leftover = [p for p in pids if Path(f"/proc/{p}").exists()
                    and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]
        assert not leftover, f"processes survived the server's stop: {leftover}"


def _post(server, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=timeout)


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers(), timeout=30).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "{") or ln == name)


def test_ready_on_cuda_and_records_what_vllm_chose(gpu_server):
    from rig import enginelog, paths
    from rig.capacity import cards, report
    from rig.fingerprint import collect

    server, plan, info = gpu_server
    log = server.log_path.read_text(errors="replace")
    seen = enginelog.parse(log)
    assert seen.pool_tokens, "no KV pool line in the server's log"
    record = {**info, "plan_digest": plan.digest, "argv": plan.argv,
              "attention_backend": seen.attention_backend, "kv_pool_tokens": seen.pool_tokens,
              "block_size": seen.block_size, "mamba_padding_pct": seen.padding_pct,
              "gdn_prefill": "triton" if "Triton/FLA GDN prefill" in log else None,
              "fingerprint": collect(plan), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = paths.results_dir() / "gpu-tier.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    print(json.dumps({k: record[k] for k in ("device", "arch", "ready_s", "attention_backend", "kv_pool_tokens",
                                             "block_size", "mamba_padding_pct")}))
    assert record["arch"] == plan.knobs["GPU_ARCH"]
    # The capacity planner (vLLM's page and pool code, run without a server) predicted all three.
    total, _ = _memory()  # the card as preflight saw it, before this server took its share
    card = cards.from_device(info["device"], total, total)
    pool = report.for_plan(plan, card).budget.pool
    assert (seen.pool_tokens, seen.block_size) == (pool.reported_tokens, pool.block_size)
    assert seen.padding_pct is None or seen.padding_pct == round(100 * pool.padding, 2)


def test_streaming_chat_with_usage(gpu_server):
    server, _, _ = gpu_server
    body = {"model": server.served_name, "messages": [{"role": "user", "content": "What is there to see in Oslo?"}],
            "max_tokens": 16, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    usage, deltas, events = None, 0, []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                events.append(event)
                usage = event.get("usage") or usage
                deltas += len(event.get("choices", []))
    assert usage, f"no usage in the stream; its last events: {events[-3:]}"
    assert 1 <= usage["completion_tokens"] <= 16 and deltas >= 1


def test_tool_calls_through_the_qwen3_coder_parser(gpu_server):
    server, plan, _ = gpu_server
    assert plan.knobs["TOOLS"] == 1 and plan.knobs["TOOL_PARSER"] == "qwen3_coder"
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    auto = _post(server, "/v1/chat/completions", {"model": server.served_name, "messages": msgs, "tools": [TOOL],
                                                  "tool_choice": "auto", "max_tokens": 16, "temperature": 0})
    assert auto.status_code == 200, auto.text  # the parser ran over whatever the random weights said
    message = auto.json()["choices"][0]["message"]
    assert message.get("content") is not None or message.get("reasoning") is not None, message


def test_named_tool_choice_is_enforced(gpu_server):
    """A named tool_choice comes back as that call (patch tool-choice-shared-engine; thinking off, since
    vLLM starts a structured output only after the reasoning ends)."""
    server, _, _ = gpu_server
    forced = _post(server, "/v1/chat/completions", {
        "model": server.served_name, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [TOOL],
        "max_tokens": 64, "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "chat_template_kwargs": {"enable_thinking": False}})
    assert forced.status_code == 200, forced.text
    message = forced.json()["choices"][0]["message"]
    assert message.get("tool_calls"), f"no tool call in the forced reply: {message}"
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_metrics_count_generated_tokens(gpu_server):
    server, _, _ = gpu_server
    before = _metric(server, "vllm:generation_tokens_total")
    r = _post(server, "/v1/completions", {"model": server.served_name, "prompt": "Hello", "max_tokens": 7,
                                          "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    for _ in range(20):  # the counter is updated by the engine's stats loop, just after the response
        if _metric(server, "vllm:generation_tokens_total") - before >= 7:
            break
        time.sleep(0.25)
    assert _metric(server, "vllm:generation_tokens_total") - before == 7


def test_prefix_cache_hits_on_a_shared_prefix(gpu_server):
    server, _, _ = gpu_server
    before = _metric(server, "vllm:prefix_cache_hits_total")
    for _ in range(2):
        r = _post(server, "/v1/completions", {"model": server.served_name, "prompt": PROMPT, "max_tokens": 2,
                                              "temperature": 0})
        assert r.status_code == 200, r.text
    assert _metric(server, "vllm:prefix_cache_hits_total") - before > 0


def test_key_required_everywhere_but_health(gpu_server):
    server, _, _ = gpu_server
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("OPTIONS", "/metrics"), ("HEAD", "/metrics")):
        r = httpx.request(method, f"{server.url}{path}", timeout=30)
        assert r.status_code == 401, f"{method} {path} without the key: {r.status_code}"
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


# --------------------------------------------------------------------------------------------
# PREFILL_ATTN=int8: fresh prefills on rig's int8-QK kernel (patch prefill-attn-int8). A second
# server with the module server's plan plus PREFILL_ATTN=int8; the same requests to both.
# Needs the kernel's build on this host (`inv kernels.build --arch <this GPU's>`): serve's
# preflight refuses the plan without it, naming the command.

# Prompt logprobs of the two servers agree within this (nats, max over every prompt token). The
# kernel's relative error on the attention output is bounded by 2e-2 (kernels/int8-prefill-attn
# tests); the tiny hybrid's one attention layer in four adds that to a residual stream that three
# GDN layers and the MLPs carry unchanged, and its random-weight logits are small (near-uniform
# over 2,048 tokens), so a logprob moves by far less than 0.05. On fp8 KV (the module's plan)
# the reference is itself approximate: FA3 computes it on fp8 Q/K/V.
INT8_LOGPROB_TOL = 0.05
# Greedy texts may part only where the reference's top two tokens were this close (nats): if
# every logprob moves by at most INT8_LOGPROB_TOL, a flip needs a gap under twice that.
INT8_GREEDY_GAP_TOL = 2 * INT8_LOGPROB_TOL
INT8_NAMES = ["Ana", "Bruno", "Chiara", "Dmitri", "Eun-ji", "Farid"]


def _int8_prompts(topic: str) -> list[str]:
    """Distinct prompts of a few hundred tokens (distinct from their first block: no prefix-cache hit)."""
    return [f"Report {n} on {topic}, by {who}. " + " ".join(
        f"{who} counted {i + 3 * n} {topic} near the old harbour and wrote the number in a blue notebook."
        for i in range(24)) for n, who in enumerate(INT8_NAMES)]


@pytest.fixture(scope="module")
def int8_server(gpu_server, tmp_path_factory) -> Iterator:
    from rig.plan import resolve
    from rig.serve import start

    _, base_plan, info = gpu_server
    tmp = tmp_path_factory.mktemp("gpu-int8")
    plan = resolve("batch", platform="gpu", environ={}, sets={**_sets(tmp, info["arch"]), "PREFILL_ATTN": "int8"})
    own = ("PORT", "API_KEY_FILE", "PREFILL_ATTN")
    assert {k: v for k, v in plan.knobs.items() if k not in own} == \
        {k: v for k, v in base_plan.knobs.items() if k not in own}
    assert plan.env["VLLM_RIG_PREFILL_ATTN"] == "int8" and "prefill-attn-int8" in plan.patches
    server = start(plan, log_path=tmp / "vllm-gpu-int8.log")
    pids = server.pids()
    try:
        yield server
    finally:
        server.stop()
        time.sleep(1)
        leftover = [p for p in pids if Path(f"/proc/{p}").exists()
                    and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]
        assert not leftover, f"processes survived the int8 server's stop: {leftover}"


def _greedy(server, prompt: str) -> tuple[list[str], list[dict[str, float]]]:
    """32 greedy tokens (as token ids) and the top-5 logprobs at each."""
    r = _post(server, "/v1/completions", {"model": server.served_name, "prompt": prompt, "max_tokens": 32,
                                          "temperature": 0, "ignore_eos": True, "logprobs": 5,
                                          "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["top_logprobs"]


def _prompt_logprobs(server, prompt: str) -> list[float]:
    """The logprob of every prompt token after the first (prompt_logprobs skip the prefix cache)."""
    ids = _post(server, "/tokenize", {"model": server.served_name, "prompt": prompt}).json()["tokens"]
    r = _post(server, "/v1/completions", {"model": server.served_name, "prompt": prompt, "max_tokens": 1,
                                          "temperature": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    return [row[str(i)]["logprob"] for i, row in zip(ids[1:], rows[1:], strict=True)]


def _greedy_partings(reference, server, prompts) -> tuple[int, list[tuple[int, float]]]:
    """Greedy continuations of each prompt on both servers: (how many are identical, and for each other one the
    first token where they part with the gap between the reference's top token and ``server``'s choice there)."""
    same, parted = 0, []
    for prompt in prompts:
        ref_tokens, ref_top = _greedy(reference, prompt)
        tokens, _ = _greedy(server, prompt)
        if tokens == ref_tokens:
            same += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(ref_tokens, tokens, strict=True)) if a != b)
        parted.append((i, round(ref_top[i][ref_tokens[i]] - ref_top[i].get(tokens[i], float("-inf")), 4)))
    return same, parted


def test_int8_greedy_agrees_with_auto(gpu_server, int8_server):
    same, parted = _greedy_partings(gpu_server[0], int8_server, _int8_prompts("herons"))
    print(json.dumps({"int8_greedy_identical": same, "of": len(INT8_NAMES), "parted_at_token_gap": parted}))
    assert all(gap <= INT8_GREEDY_GAP_TOL for _, gap in parted), \
        f"greedy text parted where auto's top two were further apart than {INT8_GREEDY_GAP_TOL}: {parted}"


def test_int8_prompt_logprobs_agree_with_auto(gpu_server, int8_server):
    base = gpu_server[0]
    diffs = []
    for prompt in _int8_prompts("lanterns"):
        ref, got = _prompt_logprobs(base, prompt), _prompt_logprobs(int8_server, prompt)
        assert len(ref) == len(got) > 200, len(ref)
        diffs += [abs(a - b) for a, b in zip(ref, got, strict=True)]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    print(json.dumps({"int8_prompt_logprob_max_abs_diff": worst, "mean_abs_diff": mean, "tokens": len(diffs)}))
    assert worst <= INT8_LOGPROB_TOL, f"prompt logprobs differ by up to {worst} (tolerance {INT8_LOGPROB_TOL})"


def _jit_functions() -> list[str]:
    """Names of the Triton kernels in kernels/int8-prefill-attn/attn.py (loaded here by path)."""
    import importlib.util

    import triton

    from rig import paths

    spec = importlib.util.spec_from_file_location("rig_gpu_tier_int8_attn",
                                                  paths.ROOT / "kernels" / "int8-prefill-attn" / "attn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [n for n, f in vars(mod).items() if isinstance(f, triton.runtime.JITFunction)]


def test_int8_server_routes_prefills_and_compiled_before_traffic(int8_server):
    import re

    r = _post(int8_server, "/v1/completions", {"model": int8_server.served_name, "prompt": _int8_prompts("owls")[0],
                                               "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    log = int8_server.log_path.read_text(errors="replace")
    assert "rig int8 prefill attention: warmed up for" in log
    assert re.search(r"rig int8 prefill attention: routed \d+ tokens on \S+", log), "no routing line in the log"
    kernels = _jit_functions()
    late = [ln for ln in log.splitlines() if "during inference" in ln and any(k in ln for k in kernels)]
    assert not late, f"the int8 kernel compiled during inference (no warm-up covered it): {late}"


def test_int8_mixed_batch_leaves_decodes_to_vllm(int8_server):
    """A prompt arriving while another request decodes: the step holds a decode and a fresh prefill."""
    long_body = {"model": int8_server.served_name, "prompt": _int8_prompts("kites")[0], "max_tokens": 256,
                 "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{int8_server.url}/v1/completions", json=long_body, headers=int8_server.headers(),
                      timeout=300) as stream:
        lines = stream.iter_lines()
        while not next(lines).startswith("data: "):  # its first token: it is decoding now
            pass
        r = _post(int8_server, "/v1/completions", {"model": int8_server.served_name,
                                                    "prompt": _int8_prompts("kites")[1], "max_tokens": 4})
        assert r.status_code == 200, r.text
        for _ in lines:
            pass
    log = int8_server.log_path.read_text(errors="replace")
    assert "left to vLLM's kernel" in log, "no mixed batch was split (the route's once-per-process line is missing)"


def test_route_stays_out_of_cuda_graph_capture():
    """A captured graph is replayed for decode batches: the route must leave a capture to vLLM."""
    import importlib.util
    from types import SimpleNamespace

    import torch

    from rig import paths

    spec = importlib.util.spec_from_file_location("rig_gpu_tier_int8_route",
                                                  paths.ROOT / "kernels" / "int8-prefill-attn" / "vllm_route.py")
    route = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = route  # dataclasses look their module up there
    spec.loader.exec_module(route)
    dev = torch.device("cuda")
    qsl = torch.tensor([0, 64], dtype=torch.int32, device=dev)
    plan = route.StepPlan(first=0, last=1, token_start=0, token_end=64, max_seqlen=64, rest_max_query_len=0,
                          rest_max_seq_len=0, query_start_loc=qsl)
    impl = SimpleNamespace(rig_prefill_reason=None, scale=1 / 16)
    q = torch.randn(64, 8, 256, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(64, 4, 256, device=dev, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    graph, routed = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        routed.append(plan.route(impl, SimpleNamespace(layer_name="l"), q, kv, kv, out))
    assert routed == [False] and route.stats() == {"fallback:CUDA graph capture": 1}


# --------------------------------------------------------------------------------------------
# KV=kvarn: the kvarn profile (patch kvarn-cache, rig's backend in kernels/kvarn/vllm_backend.py) on
# the CUDA build, beside a KV=auto server of the same plan otherwise. The trained tiny hybrid (its
# logits mean something, unlike tiny:hybrid's near-uniform ones), eager: rig's backend (its Triton
# engine on CUDA) plans each step on the host, which no CUDA graph can hold.

# Greedy continuation: auto's top two this close (nats) may swap under a 4/2-bit cache.
KVARN_GREEDY_GAP_TOL = 0.2
# The first 2,048-token step of a prompt attends over its own new tokens only (exact keys and values,
# fp32 attention on rig's backend, FlashAttention on bf16 under auto): every token's logprob within
# this. The trained model's logits are sharper than tiny:hybrid's: 0.061 was the largest difference
# over 6,141 tokens on an H100 (2026-12-06), numerics alone, since no cache is read in that step.
KVARN_FIRST_STEP_TOL = 0.1
# Tokens of the later steps attend over the packed groups the first step wrote: their perplexity within
# this of auto's (the CPU engine measured < 0.6 % on rig's corpus, docs/kvarn.md).
KVARN_CACHED_PPL_TOL = 0.02


def _kvarn_sets(tmp: Path, arch: str) -> dict[str, str]:
    return {**_sets(tmp, arch), "MODEL": "models/trained/tiny-hybrid", "PREFIX_CACHE": "0", "ENFORCE_EAGER": "1"}


@pytest.fixture(scope="module")
def kvarn_pair(tmp_path_factory) -> Iterator:
    """(auto server, kvarn server, kvarn plan, card): started one after the other, stopped together."""
    from rig import patches, paths
    from rig.capacity import cards
    from rig.plan import resolve
    from rig.serve import start

    os.environ.update(paths.cache_env())
    patches.ensure_applied(quiet=False)
    name, arch = _cuda_device()
    total, _ = _memory()
    card = cards.from_device(name, total, total)
    servers = []
    try:
        for profile, kv in (("batch", {"KV": "auto"}), ("kvarn", {})):
            tmp = tmp_path_factory.mktemp(f"gpu-{profile}")
            plan = resolve(profile, platform="gpu", environ={}, sets={**_kvarn_sets(tmp, arch), **kv})
            servers.append((start(plan, log_path=tmp / f"vllm-gpu-{profile}.log"), plan))
        (auto, _), (kvarn, plan) = servers
        yield auto, kvarn, plan, card
    finally:
        for server, _ in servers:
            server.stop()


def _kvarn_prompts(server, n: int, tokens: int) -> list[list[int]]:
    """``n`` distinct passages of ``tokens`` token ids: held-out text of rig's corpus (the trained model's domain),
    1,400 lines: about 27,000 tokens, within the 32,768 a request (here: /tokenize's) may hold."""
    from rig.quality import suite
    from rig.quality.perplexity import load_text

    src = suite.load("perplexity").sets["corpus-english"].model_copy(update={"lines": 1400})
    ids = _post(server, "/tokenize", {"model": server.served_name, "prompt": load_text("corpus-english", src).text}
                ).json()["tokens"]
    assert len(ids) >= n * tokens, f"the held-out corpus set has {len(ids)} tokens, fewer than {n} x {tokens}"
    return [ids[i * tokens:(i + 1) * tokens] for i in range(n)]


def test_kvarn_serves_on_cuda_with_the_planned_pool(kvarn_pair):
    from rig import enginelog
    from rig.capacity import report

    auto, kvarn, plan, card = kvarn_pair
    assert plan.knobs["KV"] == "kvarn" and "kvarn-cache" in plan.patches
    log = kvarn.log_path.read_text(errors="replace")
    assert "rig kvarn backend (triton engine" in log, "the kvarn server did not run rig's backend's Triton engine"
    seen, seen_auto = enginelog.parse(log), enginelog.parse(auto.log_path.read_text(errors="replace"))
    predicted = report.for_plan(plan, card).budget.pool
    fp8_plan = plan.model_copy(update={"knobs": {**plan.knobs, "KV": "fp8", "BLOCK_SIZE": 0}})
    fp8 = report.for_plan(fp8_plan, card).budget.pool
    print(json.dumps({"kvarn_pool_tokens": seen.pool_tokens, "kvarn_block_size": seen.block_size,
                      "planned_kvarn": predicted.reported_tokens, "planned_fp8_same_bytes": fp8.reported_tokens,
                      "auto_pool_tokens": seen_auto.pool_tokens,
                      "auto_attention_backend": seen_auto.attention_backend}))
    assert (seen.pool_tokens, seen.block_size) == (predicted.reported_tokens, predicted.block_size)
    assert seen.pool_tokens > fp8.reported_tokens, "the kvarn cache holds no more tokens than fp8 in the same bytes"


def test_kvarn_greedy_agrees_with_auto(kvarn_pair):
    """1,500-token prompts: every decode step reads the 11 groups the prefill packed."""
    import re

    auto, kvarn, _, _ = kvarn_pair
    same, parted = _greedy_partings(auto, kvarn, _kvarn_prompts(auto, 6, 1500))
    print(json.dumps({"kvarn_greedy_identical": same, "of": 6, "parted_at_token_gap": parted}))
    assert all(gap <= KVARN_GREEDY_GAP_TOL for _, gap in parted), \
        f"greedy text parted where auto's top two were further apart than {KVARN_GREEDY_GAP_TOL}: {parted}"
    packed = [int(n) for n in re.findall(r"rig kvarn \(triton engine\): (\d+) groups packed",
                                         kvarn.log_path.read_text(errors="replace"))]
    assert packed and max(packed) >= 11, "the backend's log counts fewer packed groups than the prompts fill"


def test_kvarn_prompt_logprobs_agree_with_auto(kvarn_pair):
    """4,096-token prompts in two steps: the first exact, the second over the 16 groups the first packed."""
    import math

    auto, kvarn, plan, _ = kvarn_pair
    step = int(plan.argv[plan.argv.index("--max-num-batched-tokens") + 1])  # the prompts' first step
    assert 4096 > step, f"a step of {step} tokens holds the whole 4,096-token prompt: no token reads the cache"
    first, cached = [], {"auto": [], "kvarn": []}
    for ids in _kvarn_prompts(auto, 3, 4096):
        rows = {}
        for name, server in (("auto", auto), ("kvarn", kvarn)):
            r = _post(server, "/v1/completions", {"model": server.served_name, "prompt": ids, "max_tokens": 1,
                                                  "temperature": 0, "prompt_logprobs": 0})
            assert r.status_code == 200, r.text
            plp = r.json()["choices"][0]["prompt_logprobs"]
            rows[name] = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], plp[1:], strict=True)]
            cached[name] += rows[name][step - 1:]
        first += [abs(a - b) for a, b in zip(rows["auto"][:step - 1], rows["kvarn"][:step - 1],
                                             strict=True)]
    ppl = {k: math.exp(-sum(v) / len(v)) for k, v in cached.items()}
    print(json.dumps({"kvarn_first_step_max_abs_diff": max(first), "first_step_mean_abs_diff": sum(first) / len(first),
                      "first_step_tokens": len(first),
                      "cached_ppl": ppl, "cached_vs_auto": ppl["kvarn"] / ppl["auto"] - 1,
                      "cached_tokens": len(cached["auto"])}))
    assert max(first) <= KVARN_FIRST_STEP_TOL, f"first-step logprobs differ by up to {max(first)}"
    assert abs(ppl["kvarn"] / ppl["auto"] - 1) <= KVARN_CACHED_PPL_TOL, ppl
