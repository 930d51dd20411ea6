"""The garbage detector: a pure, cheap function over answer texts, and the run that feeds it.

``check(text, expect_any)`` needs no server, no model and no tokenizer, so ``serve``'s readiness
burst and ``bench`` can call it on whatever they already received. It flags what a broken server
emits — a kernel bug, a wrong quantization, a bad patch — and what a healthy one never does:

- ``empty``: nothing but whitespace;
- ``broken-utf8``: U+FFFD replacement characters or control characters (bytes that did not decode);
- ``char-run``: one character repeated ("!!!!!!", "ĠĠĠĠ"), beyond what markdown rules use;
- ``loop``: the tail of the text repeats itself (a period of 1-200 characters at least 3 times, 40+ chars);
- ``ignores-prompt``: none of the words a relevant answer must mention (the prompt's ``expect_any``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# Markdown draws rules and fences with these; a run of them is layout, not garbage (up to a point).
LAYOUT = set("-=_*.#~`")
RUN_PUNCT = 5  # "!!!!!" — five of one non-layout, non-alphanumeric character
RUN_ANY = 16  # any non-space character 16 times in a row
LOOP_MIN_CHARS = 40
LOOP_MIN_REPEATS = 3


@dataclass(frozen=True)
class Finding:
    """One reason a text is garbage."""

    kind: str
    detail: str


def _runs(text: str) -> Finding | None:
    for m in re.finditer(r"(\S)\1+", text):
        ch, n = m.group(1), len(m.group(0))
        if n >= RUN_ANY or (n >= RUN_PUNCT and not ch.isalnum() and ch not in LAYOUT):
            return Finding("char-run", f"{ch!r} x{n} at {m.start()}")
    return None


def _loop(text: str) -> Finding | None:
    """A tail that repeats with a short period: what a decoder stuck in a cycle leaves behind."""
    t = text.rstrip()
    for period in range(1, min(200, len(t) // LOOP_MIN_REPEATS) + 1):
        same = 0
        while same < len(t) - period and t[-1 - same] == t[-1 - same - period]:
            same += 1
        covered = same + period
        if covered >= max(LOOP_MIN_CHARS, LOOP_MIN_REPEATS * period):
            return Finding("loop", f"the last {covered} chars repeat a {period}-char pattern {t[-period:]!r}")
    return None


def check(text: str, expect_any: Sequence[str] = ()) -> list[Finding]:
    """Every garbage finding of one answer (empty list: looks like a real answer)."""
    if not text.strip():
        return [Finding("empty", "the answer is empty or whitespace")]
    found = []
    bad = text.count("\ufffd") + len(CONTROL.findall(text))
    if bad:
        found.append(Finding("broken-utf8", f"{bad} replacement/control characters"))
    for probe in (_runs, _loop):
        f = probe(text)
        if f:
            found.append(f)
    if expect_any and not any(w.lower() in text.lower() for w in expect_any):
        found.append(Finding("ignores-prompt", f"mentions none of {list(expect_any)}"))
    return found


def flagged(texts: Iterable[str]) -> int:
    """How many texts have at least one finding (the one-number form for readiness bursts and bench)."""
    return sum(1 for t in texts if check(t))


@dataclass
class Sample:
    """One completion of the garbage run and its findings."""

    mode: str
    prompt: str
    text: str
    findings: list[Finding]

    def to_json(self) -> dict:
        return {"mode": self.mode, "prompt": self.prompt, "text": self.text,
                "findings": [asdict(f) for f in self.findings]}


def _ask(client, prompt, mode: str, suite, seed: int) -> Sample:
    body = {"messages": [{"role": "user", "content": prompt.text}], "max_tokens": suite.max_tokens,
            "chat_template_kwargs": {"enable_thinking": False}}
    if mode == "greedy":
        body["temperature"] = 0
    else:
        body.update(temperature=suite.temperature, top_p=suite.top_p, seed=seed)
    msg = client.chat(body)["choices"][0]["message"]
    text = msg.get("content") or ""
    return Sample(mode, prompt.text, text, check(text, prompt.expect_any))


def run(client, suite) -> list[Sample]:
    """``greedy`` + ``sampled`` chat completions of the suite's prompts (cycling), thinking off."""
    jobs = [("greedy", suite.prompts[i % len(suite.prompts)], i) for i in range(suite.greedy)]
    jobs += [("sampled", suite.prompts[i % len(suite.prompts)], 1000 + i) for i in range(suite.sampled)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda j: _ask(client, j[1], j[0], suite, j[2]), jobs))


def summarize(samples: list[Sample]) -> dict:
    """Counts per mode and per finding kind, and the flagged samples themselves (for the report)."""
    out: dict = {"kinds": {}}
    for mode in ("greedy", "sampled"):
        ss = [s for s in samples if s.mode == mode]
        out[mode] = {"total": len(ss), "flagged": sum(1 for s in ss if s.findings)}
    for s in samples:
        for f in s.findings:
            out["kinds"][f.kind] = out["kinds"].get(f.kind, 0) + 1
    out["examples"] = [s.to_json() for s in samples if s.findings][:5]
    out["clean_examples"] = [s.to_json() for s in samples if not s.findings][:3]
    return out
