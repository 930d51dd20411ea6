"""What every task that takes a profile shares: `--set KNOB=value` parsing and plan resolution."""

from __future__ import annotations

from invoke import Exit


def parse_sets(items: list[str] | None) -> dict[str, str]:
    """`--set KNOB=value` items -> {KNOB: value}; exit 2 on an item without '='."""
    sets = {}
    for item in items or []:
        if "=" not in item:
            raise Exit(f"rig: error: --set {item!r}: expected KNOB=value, e.g. --set PREFIX_CACHE=1", code=2)
        k, v = item.split("=", 1)
        sets[k.strip()] = v.strip()
    return sets


def plan_from_args(profile: str, overlay: list[str] | None, set: list[str] | None, platform: str):
    """Resolve the plan a task's arguments describe; every PlanError message becomes exit 2."""
    from rig.plan import PlanError, resolve

    try:
        return resolve(profile, overlay or [], platform or None, sets=parse_sets(set))
    except PlanError as e:
        raise Exit("\n".join(f"rig: error: {m}" for m in e.messages), code=2) from None


def read_key(key_file: str, plan) -> str | None:
    """The API key of a server rig did not start: --key-file, else the plan's API_KEY_FILE; exit 2 when missing."""
    from pathlib import Path

    from rig import paths

    path = Path(key_file or plan.api_key_file)
    path = path if path.is_absolute() else paths.ROOT / path
    if not path.exists():
        raise Exit(f"rig: error: --key-file {path}: no such file; pass the running server's key file", code=2)
    return path.read_text().strip() or None
