"""Perplexity through the server: the prompt's own log-probabilities, window by window.

Each set's text is tokenized by the server (/tokenize, so the model's own tokenizer) and cut into
fixed windows of ``window_tokens`` from the start; each window goes to /v1/completions as token ids
with ``prompt_logprobs: 0`` (the log-probability of every prompt token given the ones before it),
greedy, one output token. The first token of a window has no context and is not counted.
PPL = exp(mean negative log-likelihood), per domain and over all scored tokens.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from rig import paths
from rig.quality.client import Client
from rig.quality.suite import PerplexitySuite, SuiteError, TextSource


@dataclass(frozen=True)
class Text:
    """One set's text and where exactly it came from."""

    name: str
    domain: str
    text: str
    origin: str
    sha256: str


def _corpus(src: TextSource) -> str:
    from rig.models import corpus

    if src.corpus_domain is None or src.seed is None:
        raise SuiteError("a source=corpus set needs corpus_domain and seed")
    gen = corpus.GENERATORS[{"german": "german", "english": "english", "code": "code"}[src.corpus_domain]]
    rng = random.Random(src.seed)
    return "\n".join(gen(rng) for _ in range(src.lines)) + "\n"


def _stdlib(src: TextSource) -> tuple[bytes, str]:
    if not src.path:
        raise SuiteError("a source=stdlib set needs path")
    path = Path(sysconfig.get_paths()["stdlib"]) / src.path
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SuiteError(f"stdlib set {src.path}: cannot read {path} ({e.strerror})") from None
    if src.path == "pydoc_data/topics.py":  # the Python reference's prose, held as a dict of strings
        ns: dict = {}
        exec(compile(raw, str(path), "exec"), ns)  # noqa: S102 - the interpreter's own stdlib file
        return raw, "\n\n".join(ns["topics"][k] for k in sorted(ns["topics"]))
    return raw, raw.decode("utf-8")


def _url(src: TextSource) -> bytes:
    """Fetched once into the cache; later runs read the cached bytes."""
    import httpx

    if not src.url:
        raise SuiteError("a source=url set needs url")
    cached = paths.cache_dir() / "quality-sets" / hashlib.sha256(src.url.encode()).hexdigest()[:16]
    if not cached.exists():
        try:
            r = httpx.get(src.url, follow_redirects=True, timeout=120)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise SuiteError(f"cannot fetch {src.url} ({e}); on an offline host use --suite offline") from None
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".partial")
        tmp.write_bytes(r.content)
        tmp.replace(cached)
    return cached.read_bytes()


def _decode(src: TextSource, raw: bytes) -> str:
    if src.format == "text":
        return raw.decode("utf-8")
    import io

    import pyarrow.parquet as pq

    rows = pq.read_table(io.BytesIO(raw)).column("text").to_pylist()
    return "".join(rows)


def load_text(name: str, src: TextSource) -> Text:
    """The set's text; SuiteError when a pinned sha256 does not match what was read."""
    if src.source == "corpus":
        text = _corpus(src)
        raw = text.encode()
        origin = f"rig.models.corpus {src.corpus_domain} seed={src.seed} lines={src.lines}"
    elif src.source == "stdlib":
        raw, text = _stdlib(src)
        origin = f"Python {sys.version.split()[0]} stdlib {src.path}"
    else:
        raw = _url(src)
        text = _decode(src, raw)
        origin = src.url or ""
    digest = hashlib.sha256(raw).hexdigest()
    pinned = src.sha256 if src.source != "stdlib" or src.python == sys.version.split()[0] else None
    if pinned and pinned != digest:
        raise SuiteError(f"set {name!r} ({origin}): sha256 {digest}, expected {pinned}; the source changed — "
                         f"pin the new hash in quality/perplexity.toml only if the change is intended")
    return Text(name=name, domain=src.domain, text=text, origin=origin, sha256=digest)


@dataclass
class SetResult:
    """Perplexity of one set."""

    name: str
    domain: str
    origin: str
    sha256: str
    windows: int
    tokens: int
    nll: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens)

    def to_json(self) -> dict:
        return {**asdict(self), "ppl": round(self.ppl, 4)}


class PerplexityError(RuntimeError):
    """The server's answer cannot be scored (too few prompt logprobs, a token missing): the run is invalid."""


def window_nll(client: Client, ids: list[int]) -> tuple[float, int]:
    """(sum of -logprob over tokens 2..n, count) of one window, from the server's prompt_logprobs."""
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    plp = client.completion(body)["choices"][0]["prompt_logprobs"]
    if plp is None or len(plp) != len(ids):
        raise PerplexityError(f"server returned {0 if plp is None else len(plp)} prompt logprobs for {len(ids)} tokens "
                           "(prefix caching on? cached prefixes return none)")
    total = 0.0
    for tok, entry in zip(ids[1:], plp[1:], strict=True):
        lp = entry.get(str(tok))
        if lp is None:
            raise PerplexityError(f"prompt_logprobs lacks the prompt token {tok}: {list(entry)[:3]}")
        value = lp["logprob"]
        total -= value if math.isfinite(value) else -1e4
    return total, len(ids) - 1


def measure(client: Client, suite: PerplexitySuite, sets: dict[str, TextSource]) -> list[SetResult]:
    """Every set of the suite, its windows in order."""
    results = []
    for name, src in sets.items():
        t = load_text(name, src)
        ids = client.tokenize(t.text)
        n = min(suite.max_windows, len(ids) // suite.window_tokens)
        if n == 0:
            raise SuiteError(f"set {name!r} has {len(ids)} tokens, fewer than one window of {suite.window_tokens}")
        nll, count = 0.0, 0
        for w in range(n):
            a, b = window_nll(client, ids[w * suite.window_tokens:(w + 1) * suite.window_tokens])
            nll, count = nll + a, count + b
        results.append(SetResult(name, t.domain, t.origin, t.sha256, n, count, nll))
    return results


def summarize(results: list[SetResult]) -> dict:
    """Per-domain and overall (token-weighted) perplexity."""
    domains: dict[str, list[SetResult]] = {}
    for r in results:
        domains.setdefault(r.domain, []).append(r)
    per = {d: math.exp(sum(r.nll for r in rs) / sum(r.tokens for r in rs)) for d, rs in domains.items()}
    overall = math.exp(sum(r.nll for r in results) / sum(r.tokens for r in results))
    return {"overall": round(overall, 4), "domains": {d: round(v, 4) for d, v in sorted(per.items())},
            "sets": [r.to_json() for r in results]}
