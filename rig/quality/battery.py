"""Run one battery against one server and judge it: the machinery behind `inv quality`.

Order of work: everything that can fail without a server fails first (suites, gates, reference,
plan); then the server — started here with the quality overlay, or, given a URL, checked on its
/metrics and refused with the reason when it was not started that way; then the components
(digest first, on a quiet server, then perplexity, lm-eval, garbage, tool calls); then the gates.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from rig import paths
from rig.plan import Plan
from rig.quality import digest, garbage, gates, lmeval, perplexity, requirements, suite, toolcall
from rig.quality.client import Client


class QualityError(RuntimeError):
    """The battery cannot run (bad input, a refused server); the message says what to do."""


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
        return json.loads(path.read_text())
    except ValueError as e:
        raise QualityError(f"reference {path} is not valid JSON ({e}); delete it or pass another --reference") from None


def _model_name(plan: Plan, served_root: str | None) -> tuple[str, str | None]:
    """(name, local folder or None): the folder the server loaded when it is on this host."""
    for cand in (served_root, plan.model):
        if cand:
            p = Path(cand) if Path(cand).is_absolute() else paths.ROOT / cand
            if (p / "config.json").exists():
                return p.name, str(p)
    return Path(served_root or plan.model).name, None


def check_server(client: Client, needs: requirements.Needs) -> dict:
    """The server's cache config; QualityError listing every reason it cannot be measured."""
    try:
        text = client.metrics()
    except Exception as e:  # noqa: BLE001 - any failure to read /metrics is a refusal with its reason
        raise QualityError(f"cannot read {client.url}/metrics ({e}); is the server up and the key right?") from None
    reasons = requirements.refusals(text, needs)
    if reasons:
        raise QualityError("refusing to measure the server at " + client.url + ":\n  - " + "\n  - ".join(reasons))
    return requirements.cache_config(text)


def measure(client: Client, res: suite.Resolved, model_dir: str | None, out: Path, log: Callable) -> dict:
    """Every component of the battery; the raw measurements."""
    found: dict = {}
    t = time.monotonic()
    found["digest"] = digest.run(client, res.digest)
    log(f"quality: digest {found['digest']['digest'][:16]}  ({time.monotonic() - t:.0f} s)")
    t = time.monotonic()
    found["perplexity"] = perplexity.summarize(perplexity.measure(client, res.perplexity, res.sets))
    log(f"quality: perplexity {found['perplexity']['overall']:.4g} overall  ({time.monotonic() - t:.0f} s)")
    found["lmeval"] = None
    if res.lmeval:
        t = time.monotonic()
        found["lmeval"] = lmeval.run(res.lmeval, client.url, client.key, client.model, model_dir, out / "lm_eval")
        log(f"quality: lm-eval {res.lmeval.task} {found['lmeval']['score']:.1f}  ({time.monotonic() - t:.0f} s)")
    t = time.monotonic()
    found["garbage"] = garbage.summarize(garbage.run(client, res.garbage))
    log(f"quality: garbage {found['garbage']['greedy']} / {found['garbage']['sampled']}  "
        f"({time.monotonic() - t:.0f} s)")
    found["toolcall"] = toolcall.run(client, res.toolcall) if res.toolcall else None
    return found


def run(plan: Plan, battery: str = "auto", url: str | None = None, key: str | None = None,
        reference: Path | None = None, save_reference: bool = False, results_root: Path | None = None,
        log: Callable = print, record=None) -> dict:
    """Run the battery; returns the result (with ``gates`` and ``passed``), saved under results_dir().

    ``record`` (rig.running.Record): the server `serve` recorded — ``plan`` is its plan, and a
    restart or death during the battery (pid, start time, /health) fails the run. With a bare ``url``
    the server is someone else's: the result carries what it says about itself, not a plan digest.
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
    if url is None and (why := requirements.plan_refusals(plan, needs)):
        raise QualityError("refusing to start the server for the battery:\n  - " + "\n  - ".join(why))
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
        cache_cfg = check_server(client, needs)
        server_info = _server_info(server, record, url, key, plan)
        served = client.models()
        if not any(m["id"] == plan.served_name for m in served):
            raise QualityError(f"the server at {url} serves {[m['id'] for m in served]}, not {plan.served_name!r}; "
                               f"pass --set SERVED_NAME=... to match it")
        model_name, model_dir = _model_name(plan, served[0].get("root"))
        found = measure(client, res, model_dir, out, log)
        if record is not None and (gone := record.check()):
            from rig.server import ServerError

            raise ServerError(f"{gone} during the battery: its figures are not one server's (nothing was judged)")
    finally:
        if server is not None:
            server.stop()
    ref_path = reference or reference_path(model_name, name)
    ref = None if save_reference else load_reference(ref_path)
    result = {
        "schema_version": 1, "kind": "quality-result", "utc": utc, "battery": name, "profile": plan.profile,
        "platform": plan.platform, "model": {"name": model_name, "path": model_dir, "served_name": plan.served_name},
        "server": {**server_info, "cache_config": cache_cfg},
        "plan_digest": None if server_info["started_by"] == "external" else plan.digest, **found,
        "reference": {"path": str(ref_path), "utc": ref.get("utc") if ref else None,
                      "digest_matches": (ref or {}).get("digest", {}).get("digest") == found["digest"]["digest"]
                      if ref else None},
    }
    result["fingerprint"] = fingerprint.collect(plan)
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
    from rig.quality import report

    if not result["passed"]:
        log(f"quality: NOT saved as the reference ({result['summary']}): a reference must pass the absolute gates")
        return False
    report.write_atomic(dest, json.dumps(result, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    log(f"quality: saved as the reference of {result['model']['name']} / {result['battery']}: {dest}")
    return True


def main_error(e: Exception) -> int:
    print(f"rig: error: {e}", file=sys.stderr)
    return 2
