"""`inv bench.compare A B`: the differences between two runs of one protocol, when they are comparable.

Two runs compare when the reproducibility verdict over their fingerprints (``rig.repro.diff.compare``:
GPUs, engine, patch files, kernels, plan, model, locks, rig commit and its uncommitted changes) finds no
difference that touches results but the one knob under test, and their scales agree. The plan's digest,
profile and overlays are judged through the knobs they set. PORT and API_KEY_FILE do not touch results:
they say where a server listens, not what it computes. Anything else differing is refused with the list
of differences, most impact first, unless ``force``. A run of uncommitted code compares only with a run
of the same changes, and the header says so.
"""

from __future__ import annotations

from typing import Any

from rig.bench.results import RunResult
from rig.repro.diff import INERT_KNOBS, Difference, compare

__all__ = ["INERT_KNOBS", "CompareError", "check", "differences", "render"]


class CompareError(ValueError):
    """The runs are not comparable; the message lists why and how to override."""


KNOB = "plan.knobs."


def differences(a: RunResult, b: RunResult) -> tuple[dict[str, tuple[Any, Any]], list[Difference]]:
    """(knob differences, other differences that touch results, most impact first) between two runs'
    fingerprints and scales. With knobs on both sides, the rest of the plan (digest, profile, overlays)
    is what the knobs make it and is not counted again."""
    touching = compare(a.fingerprint, b.fingerprint).touching
    knobs = {d.key[len(KNOB):]: (d.a, d.b) for d in touching if d.key.startswith(KNOB)}
    both = all(a_or_b.fingerprint.get("plan", {}).get("knobs") for a_or_b in (a, b))
    other = [d for d in touching if not d.key.startswith(KNOB) and not (both and d.group == "plan")]
    if a.scale != b.scale:
        other.append(Difference("scale", a.scale.get("factor"), b.scale.get("factor"), "bench", True,
                                "the bench's scale factor"))
    return dict(sorted(knobs.items())), other


def check(a: RunResult, b: RunResult, force: bool = False) -> list[str]:
    """Header lines naming the knob under test; CompareError when the runs may not be compared."""
    if a.protocol_kind != b.protocol_kind:
        raise CompareError(f"different protocols: {a.protocol} ({a.protocol_kind}) vs {b.protocol} "
                           f"({b.protocol_kind}); compare runs of the same protocol")
    knobs, other = differences(a, b)
    problems = [d.line() for d in other]
    if len(knobs) > 1:
        listed = ", ".join(f"{k}={x!r} vs {y!r}" for k, (x, y) in knobs.items())
        problems.append(f"more than one knob differs: {listed}")
    head = [f"knob under test: {k} = {x!r} (A) vs {y!r} (B)" for k, (x, y) in knobs.items()] or \
        ["same knobs (a repeat of one configuration)"]
    if problems and not force:
        raise CompareError("runs are not comparable — their fingerprints differ in more than the knob under test:\n  "
                           + "\n  ".join(problems) + "\nre-run one of them, or pass --force to compare anyway")
    if problems:
        head += [f"FORCED despite: {p}" for p in problems]
    head += [f"NOTE: {note}" for note in compare(a.fingerprint, b.fingerprint).notes]
    if not (a.valid and b.valid):
        head.append(f"WARNING: invalid run(s): A valid={a.valid}, B valid={b.valid}")
    return head


def render(a: RunResult, b: RunResult, force: bool = False) -> str:
    """The comparison as text: every figure both runs measured, A, B and the change."""
    lines = check(a, b, force)
    lines += ["", f"{'cell':<44} {'figure':<26} {'A':>12} {'B':>12} {'change':>9}"]
    cells_b = {(c.label, c.variant): c for c in b.cells}
    for ca in a.cells:
        cb = cells_b.get((ca.label, ca.variant))
        if cb is None:
            lines.append(f"{ca.label[:44]:<44} (only in A)")
            continue
        for fig in sorted(set(ca.summary) & set(cb.summary)):
            va, vb = ca.summary[fig].median, cb.summary[fig].median
            change = f"{(vb - va) / va * 100:+.1f}%" if va else "—"
            lines.append(f"{ca.label[:44]:<44} {fig:<26} {va:>12.4g} {vb:>12.4g} {change:>9}")
    for k in sorted(set(a.derived) & set(b.derived)):
        va, vb = a.derived[k], b.derived[k]
        if va is not None and vb is not None:
            lines.append(f"{'(derived)':<44} {k[:26]:<26} {va:>12.4g} {vb:>12.4g} {(vb - va) / va * 100:>+8.1f}%")
    return "\n".join(lines) + "\n"
