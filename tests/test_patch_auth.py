"""auth-deny-default on a real CPU `vllm serve` with --api-key: every path needs the key but
/health, /ping and /version; a trailing slash or an unknown path does not get around it."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rig import patches, paths
from rig.server import VllmServer, free_port

pytestmark = pytest.mark.slow

OPEN = ["/health", "/ping", "/version"]
# (method, path, json body) that upstream 0.28.0 leaves open with --api-key, and some it guards
PROTECTED = [
    ("GET", "/metrics", None),
    ("GET", "/metrics/", None),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hello"}),
    ("POST", "/tokenize/", {"model": "tiny", "prompt": "hello"}),
    ("POST", "/detokenize", {"model": "tiny", "tokens": [1, 2]}),
    ("GET", "/docs", None),
    ("GET", "/openapi.json", None),
    ("GET", "/redoc", None),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/", None),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}),
    ("GET", "/health/", None),
    ("GET", "/no-such-route", None),
]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[VllmServer]:
    patches.ensure_applied()
    key = secrets.token_hex(16)
    port = free_port()
    argv = [str(Path(sys.executable).with_name("vllm")), "serve", str(tiny_model), "--host", "127.0.0.1",
            "--port", str(port),
            "--served-model-name", "tiny", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--gpu-memory-utilization", "0.1", "--mamba-ssm-cache-dtype", "float32", "--block-size", "32",
            "--enforce-eager", "--api-key", key]
    env = {**paths.cache_env(), "VLLM_AUTH_DENY_DEFAULT": "1"}
    log = tmp_path_factory.mktemp("auth") / "vllm.log"
    with VllmServer(argv, env, log, port=port, api_key=key, served_name="tiny") as s:
        yield s


def _call(server: VllmServer, method: str, path: str, body, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=60,
                         follow_redirects=False)


@pytest.mark.parametrize("path", OPEN)
def test_open_paths_answer_without_the_key(server, path):
    assert _call(server, "GET", path, None, None).status_code == 200


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_every_other_path_needs_the_key(server, method, path, body):
    without = _call(server, method, path, body, None)
    assert without.status_code == 401, f"{method} {path} answered {without.status_code} without the key"
    wrong = _call(server, method, path, body, "not-the-key")
    assert wrong.status_code == 401
    with_key = _call(server, method, path, body, server.api_key)
    assert with_key.status_code != 401, f"{method} {path} refused the right key"


def test_metrics_and_tokenize_work_with_the_key(server):
    r = _call(server, "GET", "/metrics", None, server.api_key)
    assert r.status_code == 200 and "vllm:prompt_tokens_total" in r.text
    r = _call(server, "POST", "/tokenize", {"model": "tiny", "prompt": "hello"}, server.api_key)
    assert r.status_code == 200 and r.json()["tokens"]
