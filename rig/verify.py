"""`verify`: is this host set up as rig expects? Install, pins, patches, model, and a live server.

Each check prints one row; the first failing row says what to do. The live check starts the
profile's server, asks it one completion and one chat turn, reads /metrics and stops it — the
smallest proof that the numbers `bench` would print come from a working server.
"""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Callable

import httpx
from rich.console import Console
from rich.table import Table

from rig.plan import Plan


def check_installed(env: str) -> str:
    """Every package of the lock is installed at the locked version."""
    from rig.bootstrap import lock_path, parse_lock

    wrong = []
    lock = lock_path(env)
    for name, version in parse_lock(lock).items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have != version:
            wrong.append(f"{name} {have or 'missing'} (lock: {version})")
    if wrong:
        raise RuntimeError(f"{len(wrong)} packages differ from locks/{lock.name}: {', '.join(wrong[:4])}; "
                           "rerun `python3 bootstrap.py` (or `pixi install`)")
    return f"{env} lock: all packages at their locked versions"


def check_pins() -> str:
    from rig.envlock import all_locks, disagreements

    bad = [d for env, python in all_locks() for d in disagreements(env, python)]
    if bad:
        raise RuntimeError(f"locks disagree with pixi.toml: {bad[0]}; run `inv env.lock`")
    return "locks/ agree with pixi.toml"


def check_patches() -> str:
    from rig import patches

    st = patches.state()
    bad = [f"{p.name}: {p.state}" for p in st.patches if p.state != patches.APPLIED]
    if bad:
        raise RuntimeError(f"patches not applied: {', '.join(bad)}; run `inv patch.apply`")
    return f"vLLM {st.version}: {len(st.patches)} patches applied"


def check_model(plan: Plan) -> str:
    from rig.serve import ensure_model

    return f"model ready: {ensure_model(plan)}"


def probe(url: str, headers: dict[str, str], served_name: str | None) -> None:
    """One chat turn, /metrics, and a refusal without the key: the smallest proof a server works."""
    with httpx.Client(timeout=120, headers=headers) as c:
        chat = c.post(f"{url}/v1/chat/completions", json={
            "model": served_name, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}})
        chat.raise_for_status()
        metrics = c.get(f"{url}/metrics").text
        if "vllm:generation_tokens_total" not in metrics:
            raise RuntimeError("/metrics has no vllm:generation_tokens_total")
        if httpx.get(f"{url}/v1/models", timeout=30).status_code != 401:
            raise RuntimeError("the server answers without the API key")


def check_live(plan: Plan) -> str:
    from rig.serve import start

    server = start(plan)
    try:
        probe(server.url, server.headers(), plan.served_name)
    finally:
        server.stop()
    return f"live server ({plan.profile}, {plan.platform}): completion, chat, metrics, auth ok"


def check_recorded() -> str:
    """The server `serve` recorded (no server is started): still the recorded process, and it answers."""
    from rig.running import find

    rec = find()
    if why := rec.check():
        raise RuntimeError(why)
    probe(rec.url, rec.headers(), rec.served_name)
    return (f"running server at {rec.url} (pid {rec.pid}, plan {rec.plan_digest[:12]}, recorded by serve): "
            "chat, metrics, auth ok")


def check_foreign(url: str, key: str | None) -> str:
    """A server rig did not start: what it says it is, and the same probe."""
    from rig.running import describe_foreign

    desc = describe_foreign(url, key)
    name = (desc.get("models") or [{}])[0].get("id")
    probe(url.rstrip("/"), {"Authorization": f"Bearer {key}"} if key else {}, name)
    return f"server at {url} (not started by rig: vLLM {desc.get('version')}, model {name}): chat, metrics, auth ok"


def run(plan: Plan, live: bool = True, server: Callable[[], str] | None = None) -> bool:
    """Run every check, print the table; True when all passed. ``server``: the live check of a server
    that is already up (check_recorded, check_foreign) instead of starting the plan's."""
    from rig.bootstrap import detect_env

    checks: list[tuple[str, Callable[[], str]]] = [
        ("install", lambda: check_installed(detect_env())),
        ("pins", check_pins),
        ("patches", check_patches),
        ("model", lambda: check_model(plan)),
    ]
    if server is not None:
        checks.append(("server", server))
    elif live:
        checks.append(("server", lambda: check_live(plan)))
    table = Table("check", "result", "detail")
    ok = True
    con = Console()
    for name, fn in checks:
        with con.status(f"verify: {name}…"):
            try:
                table.add_row(name, "ok", fn())
            except Exception as e:
                ok = False
                table.add_row(name, "[red]FAIL[/red]", str(e).splitlines()[0])
                break
    con.print(table)
    return ok
