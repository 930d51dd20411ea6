"""The mamba-align-checkpoint-order scenario on a real CPU `vllm serve`: knob off vs on.

A multi-turn chat runs against the tiny hybrid model with a small KV pool
(``--num-gpu-blocks-override``) and chunked prefill (``--max-num-batched-tokens``, so a prompt's
chunks end on block boundaries and leave state checkpoints inside it, as long prompts do on the
real server). While each turn decodes, unrelated requests (random token prompts, no shared
prefix) run beside it and cycle the pool. The next turn's prompt is the previous prompt, then
the assistant turn as the chat template re-renders it (not the sampled tokens: Qwen3.5's
template drops the reasoning), then the new user message, all as token ids. So what the next
turn can resume from is a checkpoint inside the previous prompt. Without the patch that
checkpoint is freed while the turn still decodes, is older than the unrelated traffic and gets
evicted; the next turn finds its attention blocks but no state, and re-prefills from 0. With
``VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS=1`` it is kept until the turn ends and freed last.

The order of events is set inside the engine, not left to the client's timing: at the turn's
first token (its prefill is done, its lookup counted) all of the turn's unrelated requests follow
in one batch request. The engine runs them ``max_seqs - 1`` at a time beside the turn's decode;
they need ~50 engine steps, far fewer than the turn's ``turn_output`` tokens, so they end inside
the turn even when the client or the API server of a small, busy host stalls for seconds (seen
here: up to ~20 s, the engine decoding on). Nothing else runs between turns: the next turn starts
when /metrics shows the server idle.

The same function serves ``bench/scripts/mamba_checkpoint_order.py`` (prints the figures) and
``tests/test_patch_mamba.py`` (asserts on them). Greedy decoding with ``ignore_eos`` makes the
outputs of both runs comparable token for token.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import httpx

from rig import paths
from rig.bench.metrics import totals
from rig.server import VllmServer, free_port

KNOB = "VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS"


@dataclass(frozen=True)
class Scenario:
    """Everything that shapes the workload (the defaults are what the docs' figures used)."""

    turns: int = 4
    first_prompt: int = 300  # tokens of the conversation's first prompt
    user_tokens: int = 64  # new tokens each later turn appends after the history
    turn_output: int = 2048  # tokens each turn decodes (ignore_eos): ~40x what its unrelated traffic needs
    max_len: int = 4096  # --max-model-len
    reply_tokens: int = 96  # the assistant turn as re-rendered into the next prompt
    unrelated_prompt: int = 320  # tokens per unrelated request
    unrelated_output: int = 4
    num_blocks: int = 128  # --num-gpu-blocks-override
    kv_bytes: int = 64 << 20  # --kv-cache-memory-bytes (rig's KV_MEM): the same pool on every host, never a
    # share of the host's RAM (~256 KiB a block for the tiny model: 256 blocks; the override keeps 128)
    max_seqs: int = 3  # --max-num-seqs: the turn + 2 unrelated requests run, the others wait queued (no blocks)
    unrelated_per_turn: int = 16  # sent in one batch at each turn's first token
    chunk: int = 128  # --max-num-batched-tokens
    stream_interval: int = 16  # a turn streams its first token, then every 16 (less work for a small host)
    seed: int = 0
    replay_tokens: int = 32  # each turn replayed alone after the traffic, twice: from its cache, from scratch


@dataclass
class Side:
    """What one server (knob off or on) measured."""

    knob: bool
    hits: float = 0.0  # Δ vllm:prefix_cache_hits_total over the whole run after warm-up (tokens)
    queries: float = 0.0  # Δ vllm:prefix_cache_queries_total, same window (the unrelated requests too)
    turn_ttft_ms: list[float] = field(default_factory=list)  # turns 2.. (turn 1 has nothing to hit)
    turn_cached: list[int] = field(default_factory=list)  # usage cached_tokens per turn 2..
    turn_prompt: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # conversation turns' output ids
    prompts: list[list[int]] = field(default_factory=list)  # each turn's prompt
    unrelated_sent: int = 0
    preemptions: float = 0.0
    # turns 2.. replayed alone after the traffic phase (replay_prompts): as the cache left them, resumed
    # one token before their end, and from scratch (a cache_salt: no hit possible)
    first: list[Completion] = field(default_factory=list)
    resumed: list[Completion] = field(default_factory=list)
    scratch: list[Completion] = field(default_factory=list)


@dataclass
class Completion:
    """One greedy completion with the logprobs of its tokens and of the runner-up at each."""

    ids: list[int]
    logprobs: list[float]  # of each chosen token
    top: list[dict[int, float]]  # the top-2 tokens at each position, id -> logprob
    cached: int  # prompt tokens served from the prefix cache (usage)


# Logprob tolerance of the identity check (nats): measured |Δ| between a turn resumed from a checkpoint
# and the same turn from scratch, both alone, on this CPU: docs/patches.md, "Identity".
TOLERANCE = 0.05


def serve_argv(model: Path, port: int, sc: Scenario) -> list[str]:
    """The CPU serve line for the tiny hybrid model with prefix caching and a small pool."""
    return [
        str(Path(sys.executable).with_name("vllm")), "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
        "--max-model-len", str(sc.max_len), "--max-num-seqs", str(sc.max_seqs),
        "--max-num-batched-tokens", str(sc.chunk),
        "--kv-cache-memory-bytes", str(sc.kv_bytes), "--mamba-ssm-cache-dtype", "float32", "--block-size", "32",
        "--enable-prefix-caching", "--enforce-eager", "--enable-prompt-tokens-details",
        "--num-gpu-blocks-override", str(sc.num_blocks),
    ]


def metrics(client: httpx.Client, url: str, headers: dict[str, str]) -> dict[str, float]:
    """Every metric on /metrics by name, its labelled series summed."""
    return totals(client.get(f"{url}/metrics", headers=headers).text)


def _stream(client: httpx.Client, server: VllmServer, prompt: list[int], max_tokens: int, interval: int = 1,
            on_first: Callable[[], None] | None = None) -> tuple[float, list[int], int]:
    """(TTFT in ms, output token ids, cached prompt tokens from usage) of one greedy streamed
    completion; ``on_first`` runs at its first token."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_interval": interval,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    cached = -1
    out: list[int] = []
    with client.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers(),
                       timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = ((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
            ids = (chunk.get("choices") or [{}])[0].get("token_ids") or []
            if ids and ttft is None:
                ttft = (time.perf_counter() - t0) * 1000
                if on_first:
                    on_first()
            out.extend(ids)
    if len(out) != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {len(out)}")
    if cached < 0:
        raise RuntimeError("no usage.prompt_tokens_details in the stream: is --enable-prompt-tokens-details set?")
    return ttft or 0.0, out, cached


def complete(client: httpx.Client, server: VllmServer, prompt: list[int], max_tokens: int,
             salt: str | None = None) -> Completion:
    """A greedy completion of ``prompt`` alone with top-2 logprobs; ``salt`` (vLLM's cache_salt) keeps it
    from hitting anything cached without one."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_tokens_as_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = client.post(f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=600)
    r.raise_for_status()
    data = r.json()
    lp = data["choices"][0]["logprobs"]

    def tid(token: str) -> int:
        return int(token.removeprefix("token_id:"))

    cached = ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Completion(ids=[tid(x) for x in lp["tokens"]], logprobs=list(lp["token_logprobs"]),
                      top=[{tid(k): v for k, v in d.items()} for d in lp["top_logprobs"]], cached=cached)


def disagreement(ref: Completion, cand: Completion, tol: float = TOLERANCE) -> str | None:
    """None when ``cand`` is ``ref`` up to rounding: the same greedy tokens with logprobs within ``tol``,
    until (if ever) a position where ``ref``'s top two are within ``tol`` of each other and ``cand``
    took the other one (a near-tie, where the argmax may flip; after it the contexts differ and there
    is nothing more to compare). Else what differs, where."""
    for i, (a, b) in enumerate(zip(ref.ids, cand.ids, strict=True)):
        if a == b:
            d = abs(ref.logprobs[i] - cand.logprobs[i])
            if d > tol:
                return (f"token {i + 1} ({a}): logprob {cand.logprobs[i]:.4f} vs {ref.logprobs[i]:.4f}, "
                        f"|Δ| {d:.4f} > {tol}")
            continue
        alt = ref.top[i].get(b)
        if alt is None or ref.logprobs[i] - alt > tol:
            gap = "not in the top 2" if alt is None else f"{ref.logprobs[i] - alt:.4f} below"
            return f"token {i + 1}: {b} instead of {a}, which the reference had {gap} (not a near-tie)"
        return None
    return None


def max_logprob_delta(ref: Completion, cand: Completion) -> float:
    """The largest |Δ logprob| over the positions before the first differing token."""
    d = 0.0
    for i, (a, b) in enumerate(zip(ref.ids, cand.ids, strict=True)):
        if a != b:
            break
        d = max(d, abs(ref.logprobs[i] - cand.logprobs[i]))
    return d


def replay_prompts(prompts: list[list[int]], block: int = 64) -> list[list[int]]:
    """For each turn 2..: its prompt cut one token past the previous prompt's last block boundary,
    where the next turn resumes (its checkpoint is the one the patch keeps first). One token past
    it, because the tiny model's recurrent state decays within a few tokens (its GDN decay,
    ``-exp(A_log) * softplus(a + dt_bias)``, is -2.6 per token at the slowest head, and the conv
    window is 4 tokens): after a longer suffix a wrong state no longer shows in the outputs."""
    return [cur[: block * (len(prev) // block) + 1] for prev, cur in zip(prompts, prompts[1:], strict=False)]


def replay(client: httpx.Client, server: VllmServer, prompts: list[list[int]], max_tokens: int,
           side: Side) -> None:
    """Each replay prompt alone, nothing else running: first as the cache left it after the traffic
    (``side.first``), then again (resumed from the checkpoint one token before its end, which the
    first one left at the latest: ``side.resumed``), then from scratch (a cache salt)."""
    for turn, prompt in enumerate(replay_prompts(prompts), 2):
        side.first.append(complete(client, server, prompt, max_tokens))
        side.resumed.append(complete(client, server, prompt, max_tokens))
        side.scratch.append(complete(client, server, prompt, max_tokens, salt=f"scratch-{turn}"))


def _unrelated(server: VllmServer, sc: Scenario, rng: random.Random, sent: list[int]) -> None:
    """The turn's unrelated requests in one batch (a list of prompts: one round trip, all queued in
    the engine at once, which admits ``max_seqs - 1`` at a time and needs nothing more from the
    client or the API server until they end). Random prompts share no prefix."""
    prompts = [[rng.randrange(16, 2000) for _ in range(sc.unrelated_prompt)] for _ in range(sc.unrelated_per_turn)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": sc.unrelated_output, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(timeout=600) as client:
        r = client.post(f"{server.url}/v1/completions", json=body, headers=server.headers())
        r.raise_for_status()
    sent[0] += len(r.json()["choices"])


def settled(client: httpx.Client, server: VllmServer, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once the server is idle (nothing running or waiting: an aborted turn has been
    freed) and its counters have stopped moving (the last steps' stats have arrived)."""
    deadline = time.monotonic() + timeout
    last: dict[str, float] | None = None
    while time.monotonic() < deadline:
        m = metrics(client, server.url, server.headers())
        idle = m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
        if idle and last is not None and m.get("vllm:prefix_cache_queries_total") == last.get(
                "vllm:prefix_cache_queries_total"):
            return m
        last = m if idle else None
        time.sleep(0.3)
    raise RuntimeError(f"{server.url} did not go idle within {timeout:.0f} s (requests still running or waiting)")


def run_conversation(server: VllmServer, sc: Scenario, knob: bool) -> Side:
    """The conversation: each turn, its unrelated traffic right behind it, then an idle server."""
    rng = random.Random(sc.seed)
    side = Side(knob)
    history = [rng.randrange(16, 2000) for _ in range(sc.first_prompt)]
    with httpx.Client(timeout=600) as client:
        _stream(client, server, [rng.randrange(16, 2000) for _ in range(64)], 4)  # warm-up, not counted
        m0 = settled(client, server)
        for turn in range(sc.turns):
            sent = [0]
            side.prompts.append(history)
            # moderate pressure: the LRU queue churns but the pool is not saturated (under saturation
            # the patch gives kept checkpoints back rather than have a running request refused a block)
            noise = threading.Thread(target=_unrelated, args=(server, sc, random.Random(sc.seed * 1000 + turn), sent))
            try:
                ttft, out, cached = _stream(client, server, history, sc.turn_output, sc.stream_interval,
                                            on_first=noise.start if sc.unrelated_per_turn else None)
            finally:
                if noise.ident is not None:
                    noise.join()
            settled(client, server)
            side.unrelated_sent += sent[0]
            side.outputs.append(out)
            if turn > 0:
                side.turn_ttft_ms.append(round(ttft, 1))
                side.turn_prompt.append(len(history))
                side.turn_cached.append(cached)
            reply = [rng.randrange(16, 2000) for _ in range(sc.reply_tokens)]
            history = history + reply + [rng.randrange(16, 2000) for _ in range(sc.user_tokens)]
        m1 = settled(client, server)
        side.hits = m1["vllm:prefix_cache_hits_total"] - m0["vllm:prefix_cache_hits_total"]
        side.queries = m1["vllm:prefix_cache_queries_total"] - m0["vllm:prefix_cache_queries_total"]
        side.preemptions = m1.get("vllm:num_preemptions_total", 0.0) - m0.get("vllm:num_preemptions_total", 0.0)
        if sc.replay_tokens:
            replay(client, server, side.prompts, sc.replay_tokens, side)
    return side


def run_side(model: Path, sc: Scenario, knob: bool, log_dir: Path, extra_env: dict[str, str] | None = None) -> Side:
    """One fresh server with the knob off or on, and the conversation on it."""
    port = free_port()
    env = {**paths.cache_env(), KNOB: "1" if knob else "0", **(extra_env or {})}
    log = log_dir / f"mamba-checkpoint-{'on' if knob else 'off'}-{port}.log"
    argv = serve_argv(model, port, sc)
    with VllmServer(argv, env, log, port=port, served_name="tiny") as server:
        return run_conversation(server, sc, knob)


def compare(model: Path, sc: Scenario | None = None, log_dir: Path | None = None,
            knobs: tuple[bool, bool] = (False, True)) -> tuple[Side, Side]:
    """Both sides, off first: two server starts (``knobs=(False, False)``: the same configuration
    twice, to see what differs between two runs without the patch)."""
    sc = sc or Scenario()
    log_dir = log_dir or paths.logs_dir()
    return run_side(model, sc, knobs[0], log_dir), run_side(model, sc, knobs[1], log_dir)


def first_divergence(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(turn, token index), both from 1, of the first token where two runs' turns differ."""
    for turn, (x, y) in enumerate(zip(a, b, strict=False), 1):
        for i, (u, v) in enumerate(zip(x, y, strict=False), 1):
            if u != v:
                return turn, i
        if len(x) != len(y):
            return turn, min(len(x), len(y)) + 1
    return None


def identity_lines(s: Side) -> list[str]:
    """The replay's verdicts for one server (after traffic and resumed, each vs from scratch)."""
    name = "knob " + ("on" if s.knob else "off")
    out = []
    for label, runs in (("after traffic", s.first), ("resumed", s.resumed)):
        pairs = list(zip(s.scratch, runs, strict=True))
        verdicts = [disagreement(a, b) for a, b in pairs]
        out.append(f"  {name}, {label} vs scratch: same tokens {[a.ids == b.ids for a, b in pairs]}, "
                   f"max |Δ logprob| {max(max_logprob_delta(a, b) for a, b in pairs):.4g}, "
                   f"agree within {TOLERANCE}: {all(v is None for v in verdicts)}")
        out.extend(f"    turn {i}: {v}" for i, v in enumerate(verdicts, 2) if v)
    return out


def report(sc: Scenario, off: Side, on: Side) -> str:
    """The figures as printed by the bench script (and copied into docs/patches.md)."""
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    lines = [
        f"scenario: {sc.turns} turns, first prompt {sc.first_prompt} tok, each next prompt +{sc.reply_tokens} "
        f"re-rendered reply +{sc.user_tokens} user tok, {sc.turn_output} tok decoded/turn; unrelated "
        f"{sc.unrelated_per_turn} x {sc.unrelated_prompt}+{sc.unrelated_output} tok from each "
        f"turn on (one batch, sent at its first token); "
        f"--max-num-seqs {sc.max_seqs} --num-gpu-blocks-override {sc.num_blocks} "
        f"--max-num-batched-tokens {sc.chunk} (block 64); a turn streams every {sc.stream_interval} tokens",
        f"{'':34}{'knob ' + ('on' if off.knob else 'off'):>12}{'knob ' + ('on' if on.knob else 'off'):>12}",
        f"{'turn prompts (tok)':34}{str(off.turn_prompt):>12}",
        f"{'cached tokens per turn 2.. (usage)':34}{str(off.turn_cached):>12}  {on.turn_cached}",
        f"{'turn 2.. prompt tokens cached':34}{sum(off.turn_cached) / max(sum(off.turn_prompt), 1):>12.1%}"
        f"{sum(on.turn_cached) / max(sum(on.turn_prompt), 1):>12.1%}",
        f"{'Δ prefix_cache_hits_total (run)':34}{off.hits:>12.0f}{on.hits:>12.0f}",
        f"{'Δ prefix_cache_queries_total (run)':34}{off.queries:>12.0f}{on.queries:>12.0f}",
        f"{'mean TTFT turns 2.. (ms)':34}{mean(off.turn_ttft_ms):>12.1f}{mean(on.turn_ttft_ms):>12.1f}",
        f"{'median TTFT turns 2.. (ms)':34}{median(off.turn_ttft_ms):>12.1f}{median(on.turn_ttft_ms):>12.1f}",
        f"{'TTFT per turn (ms)':34}{str(off.turn_ttft_ms):>12}  {on.turn_ttft_ms}",
        f"{'unrelated requests sent':34}{off.unrelated_sent:>12}{on.unrelated_sent:>12}",
        f"{'preemptions':34}{off.preemptions:>12.0f}{on.preemptions:>12.0f}",
        f"outputs identical (conversation turns, under traffic): {off.outputs == on.outputs}"
        + ("" if off.outputs == on.outputs else " (first difference: turn {}, token {})".format(
            *first_divergence(off.outputs, on.outputs))),
    ]
    if off.scratch and on.scratch:
        lines += [
            f"replayed alone, {sc.replay_tokens} tok/turn:",
            f"{'  cached tok/turn, after traffic':34}{str([c.cached for c in off.first]):>12}  "
            f"{[c.cached for c in on.first]}",
            f"{'  cached tok/turn, resumed':34}{str([c.cached for c in off.resumed]):>12}  "
            f"{[c.cached for c in on.resumed]}",
            f"  from scratch identical on both servers: {[c.ids for c in off.scratch] == [c.ids for c in on.scratch]}",
        ]
        for s in (off, on):
            lines.extend(identity_lines(s))
    return "\n".join(lines)
