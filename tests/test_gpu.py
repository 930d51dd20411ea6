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

pytestmark = pytest.mark.gpu


def _cuda_device() -> tuple[str, str] | None:
    """(name, smXY) of GPU 0 through NVML, or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            return str(pynvml.nvmlDeviceGetName(h)), f"sm{major}{minor}"
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def _memory() -> tuple[int, int]:
    """(total, free) bytes of GPU 0 through NVML."""
    import pynvml

    pynvml.nvmlInit()
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        return int(mem.total), int(mem.free)
    finally:
        pynvml.nvmlShutdown()


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
    card = cards.from_device(info["device"], *_memory())
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
