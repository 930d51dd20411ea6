"""The golden plans: every profile x overlay combination the docs show, resolved and written as JSON.

``tests/test_plan.py`` only compares a fresh resolution with these files; writing them is a separate,
deliberate command (``inv golden``), so a test run can never rewrite the file it then compares with.
They describe the default layout (.rig/ in the checkout): ``write_all`` resolves with RIG_STATE_DIR
and RIG_MODELS_DIR unset, as the test does.
"""

from __future__ import annotations

import os
from pathlib import Path

from rig import paths

GOLDEN = paths.ROOT / "tests" / "golden" / "plans"
# Every profile x overlay combination the docs show (docs/profiles.md).
CASES: list[tuple[str, tuple[str, ...], str]] = [
    ("batch", (), "cpu"), ("single-user", (), "cpu"), ("kvarn", (), "cpu"), ("batch", ("quality",), "cpu"),
    ("batch", (), "gpu"), ("single-user", (), "gpu"), ("kvarn", (), "gpu"),
    ("batch", ("tp2",), "gpu"), ("batch", ("tp4",), "gpu"), ("batch", ("quality",), "gpu"),
    ("batch", ("multinode",), "gpu"), ("single-user", ("tp2",), "gpu"),
]
LAYOUT_VARS = ("RIG_STATE_DIR", "RIG_MODELS_DIR")


def case_id(profile: str, overlays: tuple[str, ...], platform: str) -> str:
    return "__".join([profile, *overlays, platform])


def path(profile: str, overlays: tuple[str, ...], platform: str) -> Path:
    return GOLDEN / f"{case_id(profile, overlays, platform)}.json"


def render(profile: str, overlays: tuple[str, ...], platform: str) -> str:
    """The plan's JSON as the golden file holds it (caller's RIG_STATE_DIR / RIG_MODELS_DIR ignored)."""
    from rig.plan import resolve

    saved = {k: os.environ.pop(k) for k in LAYOUT_VARS if k in os.environ}
    try:
        return resolve(profile, overlays, platform, environ={}).to_json()
    finally:
        os.environ.update(saved)


def write_all() -> list[str]:
    """Rewrite every golden plan and delete files no case names; returns the names that changed."""
    GOLDEN.mkdir(parents=True, exist_ok=True)
    changed = []
    for case in CASES:
        f, text = path(*case), render(*case)
        if not f.exists() or f.read_text() != text:
            f.write_text(text)
            changed.append(f.name)
    wanted = {path(*c).name for c in CASES}
    for f in sorted(GOLDEN.glob("*.json")):
        if f.name not in wanted:
            f.unlink()
            changed.append(f"{f.name} (deleted)")
    return changed
