"""What `inv repro` compares: a fingerprint from a file, a result, a results run folder, or this host now."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Keys every fingerprint rig has written carries (rig.fingerprint.collect).
REQUIRED = ("rig", "packages", "locks", "patches")
EXPECTED = ("expected a fingerprint JSON (an object with 'rig', 'packages', 'locks', 'patches', as "
            "`inv repro --save FILE` writes), a result.json of `inv bench` or `inv quality` (it has a "
            "'fingerprint'), or a results run folder holding one")


class InputError(ValueError):
    """The thing named is not something that holds a fingerprint; the message says what was expected."""


def is_fingerprint(obj: Any) -> bool:
    return isinstance(obj, dict) and all(isinstance(obj.get(k), dict) for k in REQUIRED)


def load(path: Path) -> dict[str, Any]:
    """The fingerprint ``path`` holds: the file itself, its ``fingerprint``, or the run folder's result.json."""
    p = path
    if p.is_dir():
        p = next((p / n for n in ("result.json", "fingerprint.json") if (p / n).is_file()), p / "result.json")
    if not p.is_file():
        raise InputError(f"{path}: no such file{' (the folder has no result.json)' if path.is_dir() else ''}; "
                         f"{EXPECTED}")
    try:
        obj = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{p}: not JSON ({e}); {EXPECTED}") from None
    if isinstance(obj, dict) and is_fingerprint(obj.get("fingerprint")):
        return obj["fingerprint"]
    if is_fingerprint(obj):
        return obj
    keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
    raise InputError(f"{p}: not a fingerprint (found {keys}); {EXPECTED}")


def default_plan(fp: dict[str, Any]):
    """The plan to fingerprint this host with, when only A is given: the profile and overlays A's plan
    records, with A's knobs set where this host's default differs (so the diff shows the host, not a
    plan change); when A has no plan, or its knobs do not resolve here (another platform), the profile's
    plan on this host (``batch`` when A names none). Returns (plan, how it was chosen)."""
    from rig.plan import PlanError, detect_platform, resolve

    recorded = fp.get("plan") or {}
    profile = recorded.get("profile")
    if not profile:
        return None, "A records no plan: this host without a plan"
    platform = detect_platform()
    overlays = [o for o in recorded.get("overlays") or [] if o not in ("cpu", "gpu")]
    try:
        base = resolve(profile, overlays, platform)
    except PlanError as e:
        return None, f"A's profile {profile} {overlays} does not resolve here ({e.messages[0]}): no plan"
    sets = {k: "" if v is None else str(v) for k, v in (recorded.get("knobs") or {}).items()
            if base.knobs.get(k) != v}
    if not sets:
        return base, f"A's plan ({profile} {overlays}) on this host ({platform})"
    try:
        return resolve(profile, overlays, platform, sets=sets), \
            f"A's plan ({profile} {overlays}, {len(sets)} knob(s) set as A had them) on this host ({platform})"
    except PlanError as e:
        return base, f"A's profile {profile} {overlays} on this host ({platform}); A's knobs do not resolve here " \
                     f"({e.messages[0]})"
