"""Run one battery against one server and judge it: the machinery behind `inv quality`.

Order of work: everything that can fail without a server fails first (suites, gates, reference,
plan — the recorded server's plan too); then the server — started here with the quality overlay,
or, given a URL, checked on its /metrics and refused with the reason when it was not started that
way; then the components (digest first, on a quiet server, then perplexity, lm-eval, garbage, tool
calls), each followed by a check that the server is still the one measured; then the gates.

A server that dies, restarts or fails a request mid-battery ends the run: what was measured is
saved as a partial result (``verdict: invalid``, its ``problems``, ``not_run``), nothing is judged —
figures from two servers, or from none, are not one server's quality.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from rig import paths
from rig.atomic import write_json
from rig.plan import Plan
from rig.quality import digest, garbage, gates, lmeval, perplexity, requirements, suite, toolcall
from rig.quality.client import Client, ServerRefused


class QualityError(RuntimeError):
    """The battery cannot run (bad input, a refused server); the message says what to do."""


class BatteryAborted(RuntimeError):
    """The server died or failed mid-battery; ``result`` is the partial result, already saved (exit 1)."""

    def __init__(self, result: dict) -> None:
        super().__init__(f"{result['summary']}; partial result: {result['path']}")
        self.result = result


# What a component raises when the server fails under it (no answer, an error status, output that cannot
# be scored, lm-eval failing): the run is invalid, not crashed. Anything else is a bug and propagates.
FAILURES = (httpx.HTTPError, ServerRefused, lmeval.LmEvalError, perplexity.PerplexityError, suite.SuiteError)

Component = tuple[str, Callable[[], dict]]


@dataclass
class Measured:
    """What the components produced; ``problems`` non-empty: the run stopped and ``not_run`` never ran."""

    found: dict
    problems: list[str]
    not_run: list[str]


def battery_name(name: str, plan: Plan) -> str:
    """`auto`: the public sets on a GPU host, the tiny model's own domain on CPU."""
    return ("online" if plan.platform == "gpu" else "tiny") if name == "auto" else name


def reference_path(model_name: str, battery: str) -> Path:
    """Where a reference result lives: quality/references/ (committed) before the state folder."""
    stem = f"{model_name}--{battery}.json"
    shipped = paths.QUALITY / "references" / stem
    return shipped if shipped.exists() else paths.state_dir() / "quality-references" / stem


def load_reference(path: Path | None) -> dict | None:
    if path is None or not path.exists():
        return None
    try:
        ref = json.loads(path.read_text())
    except ValueError as e:
        raise QualityError(f"reference {path} is not valid JSON ({e}); delete it or pass another --reference") from None
    if ref.get("verdict") == "invalid":
        raise QualityError(f"reference {path} is a partial result of a run that stopped ({ref.get('summary')}); "
                           "pass a complete run's result.json with --reference")
    return ref


def _model_name(plan: Plan, served_root: str | None) -> tuple[str, str | None]:
    """(name, local folder or None): the folder the server loaded when it is on this host."""
    for cand in (served_root, plan.model):
        if cand:
            p = Path(cand) if Path(cand).is_absolute() else paths.ROOT / cand
            if (p / "config.json").exists():
                return p.name, str(p)
    return Path(served_root or plan.model).name, None


def check_server(client: Client, needs: requirements.Needs, how: str | None = None) -> dict:
    """The server's cache config; QualityError listing every reason it cannot be measured (``how``: the
    fix each reason names, default: let `inv quality` start the server)."""
    try:
        text = client.metrics()
    except Exception as e:  # noqa: BLE001 - any failure to read /metrics is a refusal with its reason
        raise QualityError(f"cannot read {client.url}/metrics ({e}); is the server up and the key right?") from None
    reasons = requirements.refusals(text, needs, *([how] if how else []))
    if reasons:
        raise QualityError("refusing to measure the server at " + client.url + ":\n  - " + "\n  - ".join(reasons))
    return requirements.cache_config(text)


def components(client: Client, res: suite.Resolved, model_dir: str | None, out: Path) -> list[Component]:
    """The battery's parts in the order they run: the digest first, on a quiet server."""
    parts: list[Component] = [
        ("digest", lambda: digest.run(client, res.digest)),
        ("perplexity", lambda: perplexity.summarize(perplexity.measure(client, res.perplexity, res.sets))),
    ]
    if res.lmeval:
        lm = res.lmeval
        parts.append(("lmeval", lambda: lmeval.run(lm, client.url, client.key, client.model, model_dir,
                                                   out / "lm_eval")))
    parts.append(("garbage", lambda: garbage.summarize(garbage.run(client, res.garbage))))
    if res.toolcall:
        tc = res.toolcall
        parts.append(("toolcall", lambda: toolcall.run(client, tc)))
    return parts


SAID: dict[str, Callable[[dict], str]] = {
    "digest": lambda f: f"digest {f['digest'][:16]}",
    "perplexity": lambda f: f"perplexity {f['overall']:.4g} overall",
    "lmeval": lambda f: f"lm-eval {f['task']} {f['score']:.1f}",
    "garbage": lambda f: f"garbage {f['greedy']} / {f['sampled']}",
    "toolcall": lambda f: f"tool calls {f['passed']} of {f['total']} parsed",
}


def _one_line(e: BaseException) -> str:
    """An exception as one short line (lm-eval's carries a log tail; the log path is in its first line)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def measure(parts: list[Component], alive: Callable[[], str | None], log: Callable = print) -> Measured:
    """Each component, then ``alive()`` (None: still the server measured). A component's failure or a dead
    server stops the run there: later components would measure another server or none, so they are not
    run, and what was measured is kept for the partial result."""
    found: dict = {}
    for i, (name, fn) in enumerate(parts):
        t = time.monotonic()
        problems = []
        try:
            found[name] = fn()
            said = SAID[name](found[name]) if name in SAID else name
            log(f"quality: {said}  ({time.monotonic() - t:.0f} s)")
        except FAILURES as e:
            problems.append(f"{name} failed: {_one_line(e)}")
        if gone := (_settled(alive) if problems else alive()):
            problems.append(f"{gone} (checked after {name})")
        if problems:
            return Measured(found, problems, [n for n, _ in parts[i + 1:]])
    return Measured(found, [], [])


def _settled(alive: Callable[[], str | None], wait_s: float = 5.0) -> str | None:
    """After a failed component: a server that is dying (its sockets already reset) may not have exited yet;
    give it a few seconds, so a death is reported as the death and not only as the part that failed."""
    deadline = time.monotonic() + wait_s
    while (gone := alive()) is None and time.monotonic() < deadline:
        time.sleep(0.25)
    return gone


def liveness(server, record, client: Client) -> Callable[[], str | None]:
    """The check after each component: the recorded server's pid, start time and /health; its own server's
    process; a foreign server's /health."""
    if record is not None:
        return record.check
    if server is not None:
        return lambda: None if server.alive() else (
            f"the server rig started (pid {server.proc.pid}) exited with code {server.proc.returncode}; "
            f"log {server.log_path}")
    return lambda: None if client.healthy() else f"the server at {client.url} stopped answering /health"


def save_partial(header: dict, measured: Measured, out: Path) -> dict:
    """The result of a run that stopped: what was measured, why it stopped, what never ran; never judged.
    Saved like a complete result (same folder, atomic) so nothing measured is lost."""
    from rig.quality import report

    summary = (f"INVALID: {'; '.join(measured.problems)}; not run: {', '.join(measured.not_run) or 'nothing'}; "
               "nothing was judged")
    result = {**header, **measured.found, "passed": False, "verdict": "invalid", "summary": summary,
              "problems": measured.problems, "not_run": measured.not_run, "gates": []}
    result["path"] = str(report.save(result, out.parent))
    return result


def restart_hint(plan: Plan) -> str:
    """How to restart a recorded server so the battery can measure it: its profile and overlays, plus quality."""
    extra = "".join(f" --overlay {o}" for o in plan.overlays if o not in ("cpu", "gpu", "quality"))
    return f"restart it with `inv serve --profile {plan.profile}{extra} --overlay quality` (and no --set undoing it)"


def refuse_plan(plan: Plan, needs: requirements.Needs, url: str | None, record) -> None:
    """Refuse, before a request is sent, a plan without the quality settings: the plan the battery would
    start, or the one the recorded server runs. A --url server has no plan: its /metrics are checked."""
    if url is None and (why := requirements.plan_refusals(plan, needs)):
        raise QualityError("refusing to start the server for the battery:\n  - " + "\n  - ".join(why))
    if record is not None and (why := requirements.plan_refusals(plan, needs, restart_hint(plan))):
        raise QualityError(f"refusing to measure the running server at {record.url} (pid {record.pid}): its plan "
                           "lacks what the battery needs (nothing was sent):\n  - " + "\n  - ".join(why))


def _served_models(client: Client) -> list[dict]:
    try:
        return client.models()
    except httpx.HTTPError as e:
        raise QualityError(f"cannot read {client.url}/v1/models ({_one_line(e)}); is the server up?") from None


def run(plan: Plan, battery: str = "auto", url: str | None = None, key: str | None = None,
        reference: Path | None = None, save_reference: bool = False, results_root: Path | None = None,
        log: Callable = print, record=None) -> dict:
    """Run the battery; returns the result (with ``gates`` and ``passed``), saved under results_dir().

    ``record`` (rig.running.Record): the server `serve` recorded — ``plan`` is its plan, refused before
    a request is sent when it lacks the quality settings. With a bare ``url`` the server is someone
    else's: the result carries what it says about itself, not a plan digest. A server that dies,
    restarts or fails a request mid-battery raises BatteryAborted after the partial result is saved.
    """
    from rig import fingerprint

    name = battery_name(battery, plan)
    try:
        res = suite.resolve(name)
        gate_cfg = suite.gates_for(plan.profile)
    except suite.SuiteError as e:
        raise QualityError(str(e)) from None
    if reference is not None and not save_reference and not reference.exists():
        raise QualityError(f"--reference {reference}: no such file")
    needs = requirements.Needs.of_overlay()
    refuse_plan(plan, needs, url, record)
    utc = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = (results_root or paths.results_dir()) / f"quality-{utc.replace(':', '').replace('-', '')}-{plan.profile}"
    server = None
    try:
        if url is None:
            from rig.serve import start

            log(f"quality: starting {plan.profile} with the quality overlay ({plan.model})")
            server = start(plan, log_path=out / "vllm.log")
            url, key = server.url, server.api_key
        client = Client(url, key, plan.served_name)
        cache_cfg = check_server(client, needs, restart_hint(plan) if record is not None else None)
        server_info = _server_info(server, record, url, key, plan)
        served = _served_models(client)
        if not any(m["id"] == plan.served_name for m in served):
            raise QualityError(f"the server at {url} serves {[m['id'] for m in served]}, not {plan.served_name!r}; "
                               f"pass --set SERVED_NAME=... to match it")
        model_name, model_dir = _model_name(plan, served[0].get("root"))
        measured = measure(components(client, res, model_dir, out), liveness(server, record, client), log)
    finally:
        if server is not None:
            server.stop()
    header = {
        "schema_version": 1, "kind": "quality-result", "utc": utc, "battery": name, "profile": plan.profile,
        "platform": plan.platform, "model": {"name": model_name, "path": model_dir, "served_name": plan.served_name},
        "server": {**server_info, "cache_config": cache_cfg},
        "plan_digest": None if server_info["started_by"] == "external" else plan.digest,
        "fingerprint": fingerprint.collect(plan),
    }
    if measured.problems:
        raise BatteryAborted(save_partial(header, measured, out))
    found = {"lmeval": None, "toolcall": None, **measured.found}
    ref_path = reference or reference_path(model_name, name)
    ref = None if save_reference else load_reference(ref_path)
    result = {
        **header, **found,
        "reference": {"path": str(ref_path), "utc": ref.get("utc") if ref else None,
                      "digest_matches": (ref or {}).get("digest", {}).get("digest") == found["digest"]["digest"]
                      if ref else None},
    }
    if ref:
        try:
            gates.check_reference(result, ref)
            gates.check_setup(result["fingerprint"], ref.get("fingerprint"))
        except gates.ReferenceMismatch as e:
            raise QualityError(f"reference {ref_path} cannot be compared with this run: {e}") from None
        setup = gates.setup_comparison(result["fingerprint"], ref.get("fingerprint"))
        result["reference"]["fingerprint"] = setup.to_json() if setup else None
    judged = gates.judge(result, gate_cfg, res.floors, ref, is_ref=save_reference)
    result["floors"] = res.floors.model_dump()
    result["gates"] = [g.to_json() for g in judged]
    result["passed"], result["summary"] = gates.verdict(judged)
    from rig.quality import report

    if save_reference:
        dest = reference or paths.state_dir() / "quality-references" / ref_path.name
        result["reference"]["saved"] = save_as_reference(result, dest, log)
    result["path"] = str(report.save(result, out.parent))
    return result


def _server_info(server, record, url: str, key: str | None, plan: Plan) -> dict:
    """Which server the battery measures: one it started, the recorded one, or someone else's (as it says)."""
    if server is not None:
        return {"url": url, "started_by": "rig", "plan_digest": plan.digest}
    if record is not None:
        return {"url": url, "started_by": "rig serve (recorded)", "plan_digest": record.plan_digest,
                "pid": record.pid, "start_time": record.start_time, "recorded_utc": record.recorded_utc}
    from rig.running import describe_foreign

    return describe_foreign(url, key)


def save_as_reference(result: dict, dest: Path, log: Callable = print) -> bool:
    """Write ``result`` as the model's reference — only when it passed every absolute gate: a reference
    that is itself garbage would make every later run "pass" relative to it."""

    if not result["passed"]:
        log(f"quality: NOT saved as the reference ({result['summary']}): a reference must pass the absolute gates")
        return False
    write_json(dest, result, sort_keys=True, ensure_ascii=False)
    log(f"quality: saved as the reference of {result['model']['name']} / {result['battery']}: {dest}")
    return True


def main_error(e: Exception) -> int:
    print(f"rig: error: {e}", file=sys.stderr)
    return 2
