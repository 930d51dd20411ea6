"""A real vLLM server (CPU, the trained tiny hybrid) answers the endpoints rig relies on, and README's request."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_chat_completion_streams_with_usage(batch_server):
    body = {
        "model": batch_server.served_name,
        "messages": [{"role": "user", "content": "What is there to see in Oslo?"}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,  # the trained default may finish its sentence sooner; usage must count all 12
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks, usage = [], None
    with httpx.stream("POST", f"{batch_server.url}/v1/chat/completions", json=body,
                      headers=batch_server.headers(), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                delta = choice["delta"]  # the qwen3 reasoning parser puts text before </think> apart
                chunks.append(delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content") or "")
    assert usage is not None and usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] > 5
    assert len([c for c in chunks if c]) >= 1


def test_completion_returns_prompt_logprobs(batch_server):
    body = {"model": batch_server.served_name, "prompt": "The quiet river of Oslo is old.",
            "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0, "echo": False}
    r = httpx.post(f"{batch_server.url}/v1/completions", json=body, headers=batch_server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None  # the first token has no context
    values = [next(iter(d.values()))["logprob"] for d in plp[1:]]
    assert len(values) >= 5 and all(v <= 0 for v in values)


def test_metrics_count_generated_tokens(batch_server):
    def generated() -> float:
        text = httpx.get(f"{batch_server.url}/metrics", headers=batch_server.headers(), timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))

    before = generated()
    body = {"model": batch_server.served_name, "prompt": "Hello", "max_tokens": 7, "temperature": 0,
            "ignore_eos": True}
    assert httpx.post(f"{batch_server.url}/v1/completions", json=body, headers=batch_server.headers(),
                      timeout=120).status_code == 200
    assert generated() - before == 7


def test_requests_without_the_key_are_refused(batch_server):
    body = {"model": batch_server.served_name, "prompt": "Hi", "max_tokens": 1}
    assert httpx.post(f"{batch_server.url}/v1/completions", json=body, timeout=30).status_code == 401
    # the plan turns on the auth-deny-default patch: /metrics needs the key too, /health does not
    assert httpx.get(f"{batch_server.url}/metrics", timeout=30).status_code == 401
    assert httpx.get(f"{batch_server.url}/health", timeout=30).status_code == 200


def test_server_runs_in_its_own_process_group_in_the_callers_session(batch_server):
    """Its own group: stop() signals the whole tree. The caller's session: with autogroup, a
    server in a session of its own starved its callers (docs/development.md, "Host stalls")."""
    pid = batch_server.proc.pid
    assert os.getpgid(pid) == pid != os.getpgid(0)
    assert os.getsid(pid) == os.getsid(0)


def test_cpu_pool_is_fixed_in_bytes_and_holds_every_seat_at_full_length(batch_server):
    """KV_MEM makes the pool a property of the plan, not of the host: the log's pool is the same on any
    machine, holds MAX_SEQS sequences of MAX_LEN tokens, and the logged KV size is exactly KV_MEM."""
    import re

    from rig.plan import resolve

    knobs = resolve("batch", (), "cpu", environ={}).knobs
    log = batch_server.log_path.read_text(errors="replace")
    explicit = re.search(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", log)
    assert explicit, "the worker did not log an explicit KV size: --kv-cache-memory-bytes did not reach it"
    assert float(explicit.group(1)) == round(knobs["KV_MEM"] / 2**30, 2)
    pool = int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    assert pool >= knobs["MAX_SEQS"] * knobs["MAX_LEN"]


def test_a_live_cpu_server_stays_within_what_preflight_reserves_for_it(batch_server):
    """The preflight's host-memory estimate (model + KV_MEM + measured overhead) is an upper bound."""
    import psutil

    from rig.capacity import host
    from rig.plan import resolve

    knobs = resolve("batch", (), "cpu", environ={}).knobs
    root = psutil.Process(batch_server.proc.pid)
    # PSS: shared pages (torch, vLLM's libraries) split between the three processes, as the host counts
    # them in MemAvailable; a sum of RSS would count them three times.
    pss = sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)])
    need = host.need(knobs, batch_server.log_path.parent / "no-model")  # the model's 17 MiB aside
    assert pss <= need.total, f"server PSS {pss / 2**30:.2f} GiB > preflight's {need.describe()}"


def test_capacity_plan_matches_what_the_live_cpu_server_built(batch_server):
    """The planner's block size, page padding and pool (vLLM's pages and pool code, no server) equal what
    the running server logged for the same plan: the restated hybrid block-size rule included."""
    from rig import enginelog
    from rig.capacity import report
    from rig.plan import resolve

    pool = report.for_plan(resolve("batch", (), "cpu", environ={}), None).budget.pool
    seen = enginelog.read(batch_server.log_path)
    assert None not in (seen.pool_tokens, seen.block_size, seen.padding_pct), \
        f"the server did not log its pool, block size and page padding: {seen}"
    assert seen.pool_tokens == pool.reported_tokens
    assert seen.block_size == pool.block_size
    assert seen.padding_pct == round(100 * pool.padding, 2)


def test_the_readmes_curl_gets_a_sensible_answer(batch_server):
    """README's first request, its JSON body as written there, to what `serve` runs on a CPU host: the trained
    default answers about the city it is asked about, in words the garbage detector passes."""
    from rig import paths
    from rig.quality import garbage

    readme = (paths.ROOT / "README.md").read_text()
    body = json.loads(re.search(r"-d '(\{.*?\})'", readme, re.S).group(1))
    assert body["model"] == batch_server.served_name
    r = httpx.post(f"{batch_server.url}/v1/chat/completions", json=body, headers=batch_server.headers(),
                   timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    print(f"\nREADME's curl -> {answer!r}")
    assert "Lima" in answer and len(answer.split()) >= 5, answer
    assert garbage.check(answer) == [], answer
