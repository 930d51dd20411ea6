"""auth-deny-default on real CPU `vllm serve`s with an API key: every path needs the key but
/health, /ping and /version, for every method; a trailing slash, an unknown path, OPTIONS, HEAD
or a websocket does not get around it; only a genuine CORS preflight passes, with no body.

Two real servers: the session's batch server (rig's own launch: key from the environment, no
root path) and this module's server, started with ``--root-path /api`` and
``VLLM_SERVER_DEV_MODE=1`` (the dev routes rig's bench servers expose). The routes to try are
enumerated from the FastAPI app vLLM builds for each server's own command line and environment
(``build_app``), checked against the server's /openapi.json, so a route added by a later vLLM or
by dev mode is tried without this file changing.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass
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
    ("GET", "/metricsX", None),
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
ORIGIN = "http://evil.example"


@dataclass
class Target:
    """A running server and the URL prefixes a client may put before a route's path."""

    server: VllmServer
    prefixes: tuple[str, ...]


@pytest.fixture(scope="module")
def root_path_server(tiny_model, tmp_path_factory) -> Iterator[VllmServer]:
    patches.ensure_applied()
    key = secrets.token_hex(16)
    port = free_port()
    argv = [str(Path(sys.executable).with_name("vllm")), "serve", str(tiny_model), "--host", "127.0.0.1",
            "--port", str(port),
            "--served-model-name", "tiny", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", "256M", "--mamba-ssm-cache-dtype", "float32", "--block-size", "32",
            "--enforce-eager", "--api-key", key, "--root-path", "/api"]
    env = {**paths.cache_env(), "VLLM_AUTH_DENY_DEFAULT": "1", "VLLM_SERVER_DEV_MODE": "1"}
    log = tmp_path_factory.mktemp("auth") / "vllm.log"
    with VllmServer(argv, env, log, port=port, api_key=key, served_name="tiny") as s:
        yield s


@pytest.fixture(params=["plain", "root_path"])
def target(request) -> Target:
    """plain: the session's batch server (rig's launch); root_path: ``--root-path /api`` + dev mode.
    Behind a proxy that strips /api a client asks for /X; one that does not strip it, /api/X."""
    if request.param == "plain":
        return Target(request.getfixturevalue("batch_server"), ("",))
    return Target(request.getfixturevalue("root_path_server"), ("", "/api"))


_APPS: dict[int, object] = {}


def built_app(server: VllmServer, monkeypatch=None):
    """The FastAPI app vLLM's `serve` builds for this server's argv and environment (not started)."""
    if server.port not in _APPS:
        from vllm.entrypoints.openai.api_server import build_app
        from vllm.entrypoints.openai.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(list(server.argv[2:]))
        saved = {k: os.environ.get(k) for k in server.env}
        os.environ.update(server.env)  # VLLM_SERVER_DEV_MODE decides which routes exist
        try:
            _APPS[server.port] = build_app(args, ("generate",))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return _APPS[server.port]


def route_paths(app) -> list[str]:
    """Every path the app answers: routes (path parameters filled in), mounts and their variants."""
    from starlette.routing import Mount

    out: list[str] = []
    for r in app.routes:
        path = re.sub(r"\{[^}]+\}", "x", r.path)
        out.append(path)
        if isinstance(r, Mount):  # /metrics: the regex ^/metrics(?P<path>.*)$ takes any suffix
            out += [path + "/", path + "X", path + "/x"]
    return list(dict.fromkeys(out))


def _call(server: VllmServer, method: str, path: str, body=None, key: str | None = None,
          headers: dict[str, str] | None = None) -> httpx.Response:
    h = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return httpx.request(method, f"{server.url}{path}", json=body, headers=h, timeout=60, follow_redirects=False)


def test_the_enumerated_routes_are_the_servers_routes(target):
    """The enumeration is of the running server: /openapi.json (read with the key) lists the same
    API routes, dev-mode ones included on the root-path server."""
    app = built_app(target.server)
    r = _call(target.server, "GET", "/openapi.json", key=target.server.api_key)
    assert r.status_code == 200
    served = set(r.json()["paths"])
    built = {route.path for route in app.routes if getattr(route, "include_in_schema", False)}
    assert served == built
    dev = "/reset_prefix_cache" in built
    assert dev == (target.server.env.get("VLLM_SERVER_DEV_MODE") == "1")
    assert "/metrics" in route_paths(app) and "/metricsX" in route_paths(app)


def test_options_and_head_to_every_route_need_the_key(target):
    """Upstream lets every OPTIONS through; /metrics is a Mount whose app ignores the method, so
    OPTIONS /metrics answered the metrics text. Any OPTIONS that is not a full CORS preflight
    (Origin alone, Access-Control-Request-Method alone, neither), and HEAD, must get 401."""
    variants = {
        "OPTIONS": {},
        "OPTIONS+Origin": {"Origin": ORIGIN},
        "OPTIONS+ACRM": {"Access-Control-Request-Method": "GET"},
        "HEAD": {},
    }
    bad = []
    for prefix in target.prefixes:
        for path in route_paths(built_app(target.server)):
            if path in OPEN:
                continue
            for name, headers in variants.items():
                r = _call(target.server, name.split("+")[0], prefix + path, headers=headers)
                if r.status_code != 401 or "vllm:" in r.text:
                    bad.append(f"{name} {prefix + path}: {r.status_code} {r.text[:60]!r}")
    assert not bad, "answered without the key:\n" + "\n".join(bad)


def test_a_cors_preflight_is_answered_without_data(target):
    """A browser's preflight carries no key: it still gets the CORS headers, but no body."""
    for prefix in target.prefixes:
        for path in ("/metrics", "/metricsX", "/v1/completions", "/tokenize"):
            r = _call(target.server, "OPTIONS", prefix + path,
                      headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
            assert r.status_code == 200 and r.headers.get("access-control-allow-origin"), (path, r.status_code)
            assert r.content == b"", (path, r.content[:60])


@pytest.mark.parametrize("path", OPEN)
def test_open_paths_answer_without_the_key(target, path):
    for prefix in target.prefixes[-1:]:
        assert _call(target.server, "GET", prefix + path).status_code == 200


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_every_other_path_needs_the_key(target, method, path, body):
    for prefix in target.prefixes:
        without = _call(target.server, method, prefix + path, body)
        assert without.status_code == 401, f"{method} {prefix + path} answered {without.status_code} without the key"
        assert _call(target.server, method, prefix + path, body, "not-the-key").status_code == 401
        with_key = _call(target.server, method, prefix + path, body, target.server.api_key)
        assert with_key.status_code != 401, f"{method} {prefix + path} refused the right key"


def test_health_with_a_trailing_slash_is_401_not_a_redirect(target):
    """Decided: open paths match exactly, so /health/ is refused before any redirect; with the key
    it gets FastAPI's redirect to /health. Probes must ask for /health."""
    assert _call(target.server, "GET", "/health/").status_code == 401
    r = _call(target.server, "GET", "/health/", key=target.server.api_key)
    assert r.status_code == 307 and r.headers["location"].endswith("/health")


def test_websockets_need_the_key(target):
    """A websocket handshake without the key is refused with 401 (/v1/realtime is not registered
    for a generate model: the middleware refuses it before routing)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    for prefix in target.prefixes:
        for path in ("/v1/realtime", "/metrics"):
            url = f"ws://{target.server.host}:{target.server.port}{prefix}{path}"
            with pytest.raises(InvalidStatus) as e:
                connect(url, open_timeout=30).close()
            assert e.value.response.status_code == 401, (url, e.value.response.status_code)


def test_the_realtime_websocket_route_needs_the_key(monkeypatch):
    """On an app vLLM builds for a realtime model (/v1/realtime registered), in process: the
    handshake without the key, or with a wrong one, is denied with 401."""
    from starlette.testclient import TestClient, WebSocketDenialResponse
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv("VLLM_AUTH_DENY_DEFAULT", "1")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["tiny", "--api-key", "the-key"])
    app = build_app(args, ("generate", "realtime"))
    ws_paths = [r.path for r in app.routes if type(r).__name__.endswith("WebSocketRoute")]
    assert "/v1/realtime" in ws_paths
    client = TestClient(app)
    for path in ws_paths:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            with pytest.raises(WebSocketDenialResponse) as e:
                client.websocket_connect(path, headers=headers).__enter__()
            assert e.value.status_code == 401
    assert client.options("/metrics").status_code == 401


def test_metrics_and_tokenize_work_with_the_key(target):
    server = target.server
    for prefix in target.prefixes:
        r = _call(server, "GET", prefix + "/metrics", key=server.api_key)
        assert r.status_code == 200 and "vllm:prompt_tokens_total" in r.text
    r = _call(server, "POST", "/tokenize", {"model": server.served_name, "prompt": "hello"}, server.api_key)
    assert r.status_code == 200 and r.json()["tokens"]
