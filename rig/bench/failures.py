"""Failed requests summarised by kind: a count and the first message, one line each.

`vllm bench serve` records a whole Python traceback per failed request; 64 of them ("Connection
refused" after an engine death) made a 21 KB tables.md and a console nobody could read. The
summary keeps the kind (the exception's name, or the HTTP status) and the first message of that
kind; the raw errors stay in requests.jsonl.
"""

from __future__ import annotations

import re
from collections import Counter

FIRST_MESSAGE_CHARS = 200
_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Refused|Timeout)\w*)\b:?\s*(.*)$")


def kind_and_message(error: str) -> tuple[str, str]:
    """(kind, message) of one error: the last exception line of a traceback, or the error's first line."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    if not lines:
        return "unknown", ""
    for ln in reversed(lines):
        m = _EXC.match(ln)
        if m:
            return m.group(1).rsplit(".", 1)[-1], m.group(2) or ln
    first = lines[0]
    m = re.match(r"^(HTTP \d{3})", first)
    return (m.group(1) if m else first.split(":", 1)[0][:60]), first


def summarize(errors: list[str | None], limit: int = 3) -> list[str]:
    """One line per kind, most frequent first: ``N x Kind: first message``; the rest counted in one line."""
    kinds: Counter[str] = Counter()
    first: dict[str, str] = {}
    for e in errors:
        if not e:
            continue
        k, msg = kind_and_message(e)
        kinds[k] += 1
        first.setdefault(k, msg[:FIRST_MESSAGE_CHARS])
    lines = [f"{n} x {k}: {first[k]}" for k, n in kinds.most_common(limit)]
    rest = sum(n for _, n in kinds.most_common()[limit:])
    if rest:
        lines.append(f"{rest} more of {len(kinds) - limit} other kinds (requests.jsonl has every error)")
    return lines


def line(failed: int, total: int, errors: list[str | None], done: int | None = None) -> str:
    """The problem line of a pass with failed requests."""
    head = f"{failed} of {total} requests failed" + (f" ({done} completed)" if done is not None else "")
    kinds = summarize(errors)
    return head + (": " + "; ".join(kinds) if kinds else "")
