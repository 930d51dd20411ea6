"""The few HTTP calls the battery makes to an OpenAI-compatible vLLM server (sync, httpx)."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx


class ServerRefused(RuntimeError):
    """The server answered an error for a request the battery needs; carries status and body."""


@dataclass
class Client:
    """A base URL, an API key and the served model name."""

    url: str
    key: str | None
    model: str
    timeout: float = 600.0
    _http: httpx.Client = field(init=False, repr=False)

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self._http = httpx.Client(base_url=self.url.rstrip("/"), headers=headers, timeout=self.timeout)

    def post(self, path: str, body: dict) -> dict:
        r = self._http.post(path, json={"model": self.model, **body})
        if r.status_code != 200:
            raise ServerRefused(f"POST {path}: HTTP {r.status_code}: {r.text[:400]}")
        return r.json()

    def completion(self, body: dict) -> dict:
        return self.post("/v1/completions", body)

    def chat(self, body: dict) -> dict:
        return self.post("/v1/chat/completions", body)

    def tokenize(self, text: str) -> list[int]:
        """The model's own tokenization (vLLM's /tokenize), without special tokens."""
        return self.post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def healthy(self, timeout: float = 5.0) -> bool:
        """/health answers 200: the liveness check of a server rig has no process of (a --url server)."""
        try:
            return self._http.get("/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        r = self._http.get("/metrics")
        r.raise_for_status()
        return r.text

    def models(self) -> list[dict]:
        r = self._http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"]

    def close(self) -> None:
        self._http.close()
