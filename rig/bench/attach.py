"""`inv bench --running` / `--url`: the bench on a server it did not start, and what it must refuse there.

A running server's knobs are fixed, so everything a protocol needs is checked against the server's
own plan (its record) before a request is sent: raw's ``requires`` (SPEC=off, PREFIX_CACHE=0), the
shared-prefix protocol's second server (one per variant: a running server is only one of them),
and ``--set``, which cannot change a server that is up. A server rig did not start (``--url``) has
no plan at all: rig cannot see its SPEC, so protocols with ``requires`` are refused there; its
prefix caching comes from its /metrics, and the profile's plan only sizes the requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rig.bench.protocols import SharedPrefixProtocol
from rig.bench.runner import Target
from rig.bench.servers import knob_sets


def recorded_target() -> Target:
    """The server `serve` recorded (rig.running.find: RunningError when none, several or stale)."""
    from rig import running

    return Target.of_record(running.find())


def foreign_target(url: str, key: str | None, plan: Any) -> Target:
    """A server rig did not start, described by what it answers; ``plan`` (the profile's) only sizes requests."""
    from rig import running

    desc = running.describe_foreign(url, key)
    models = desc.get("models") or [{}]
    root = models[0].get("root")
    update: dict[str, Any] = {"served_name": models[0].get("id") or plan.served_name}
    if root and (Path(root) / "config.json").is_file():
        update["model"] = root
    pc = desc.get("cache_config", {}).get("enable_prefix_caching")
    update["knobs"] = {**plan.knobs, "PREFIX_CACHE": int(pc == "True") if pc else plan.knobs["PREFIX_CACHE"]}
    desc["note"] += (f"; request sizes capped by profile {plan.profile}'s MAX_SEQS={plan.knobs['MAX_SEQS']}, "
                     f"prefix caching {pc or 'unknown'} (from /metrics)")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return Target(url.rstrip("/"), headers, update["served_name"], plan.model_copy(update=update),
                  alive=lambda: True, server=desc, foreign=True)


def refusals(protos: list[tuple[str, Any]], t: Target, sets: Mapping[str, str]) -> list[str]:
    """Why these protocols cannot run on this server (empty: they can); each reason says what to do."""
    where = (f"the server at {t.url} (not started by rig)" if t.foreign else
             f"the running server at {t.url} (plan {t.server.get('plan_digest', '')[:12]})")
    out = []
    if sets:
        given = " ".join(f"--set {k}={v}" for k, v in sets.items())
        out.append(f"{given}: {where} is already up with its own knobs; drop --set, or restart it with "
                   f"`inv serve {given}`")
    for name, p in protos:
        if isinstance(p, SharedPrefixProtocol):
            variants = ", ".join(f"{v} ({' '.join(f'{k}={x}' for k, x in kn.items())})" for v, kn in p.variants.items())
            out.append(f"protocol {name!r} compares two servers ({variants}); {where} is one server: run it "
                       f"without --running/--url (the bench starts both; on a 24 GB card stop the running one first)")
            continue
        need = knob_sets(p.requires)
        if not need:
            continue
        if t.foreign:
            out.append(f"protocol {name!r} needs {', '.join(f'{k}={v}' for k, v in need.items())}, which rig "
                       f"cannot verify on {where}; start the server with `inv serve` and use --running")
            continue
        have = knob_sets({k: t.plan.knobs.get(k) for k in need})
        bad = [f"{k}={have[k]} (needs {v})" for k, v in need.items() if have[k] != v]
        if bad:
            fix = " ".join(f"--set {k}={v}" for k, v in need.items())
            out.append(f"protocol {name!r}: {where} has {', '.join(bad)}; restart it with `inv serve {fix}`, "
                       f"or run the protocol without --running (the bench starts a server that fits)")
    return out
