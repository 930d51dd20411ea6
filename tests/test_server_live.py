"""A real vLLM server (CPU, tiny hybrid model) answers the endpoints rig relies on."""

from __future__ import annotations

import json
import os

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_chat_completion_streams_with_usage(batch_server):
    body = {
        "model": batch_server.served_name,
        "messages": [{"role": "user", "content": "What is there to see in Oslo?"}],
        "max_tokens": 12,
        "temperature": 0,
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
