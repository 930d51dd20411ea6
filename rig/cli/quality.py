"""`inv quality`: the quality battery with pass/fail gates (exit 0 only when every gate passes)."""

from __future__ import annotations

from pathlib import Path

from invoke import Exit, task

HELP = {
    "profile": "profile to judge (profiles/*.toml): batch, single-user, kvarn",
    "overlay": "extra overlay(s) before `quality` (tp2, ...), repeatable; the quality overlay is always applied",
    "set": "KNOB=value, repeatable (e.g. INT8_ACT= for the plain W4A16 reference run)",
    "platform": "cpu or gpu; default: gpu when NVML finds a CUDA device, else cpu",
    "url": "measure an already running server at this URL instead of starting one; it is refused unless its "
           "/metrics show the quality settings (prefix caching off, GPU_UTIL within the overlay's)",
    "running": "measure the server `inv serve` started and recorded (.rig/servers/): its own plan is judged, "
               "refused unless it has the quality settings",
    "key_file": "with --url: file holding that server's API key (default: the plan's API_KEY_FILE)",
    "suite": "battery in quality/battery.toml: online, offline, tiny; auto = online on GPU, tiny on CPU",
    "reference": "reference result JSON to gate against (default: quality/references/ or .rig/quality-references/ "
                 "for this model and battery)",
    "save_reference": "record this run as the model's reference (run it on the known-good plan)",
    "docs": "update the generated section of docs/quality.md (default on; --no-docs to skip)",
}


def quality_plan(profile: str, overlay: list[str] | None, set: list[str] | None, platform: str):
    """The plan the battery serves: the profile with the given overlays, then `quality`."""
    from rig.cli.common import plan_from_args

    return plan_from_args(profile, [o for o in overlay or [] if o != "quality"] + ["quality"], set, platform)


def _recorded():
    """The server `serve` recorded, and its plan; exit 2 when there is none."""
    from rig.running import RunningError, find

    try:
        rec = find()
        return rec, rec.plan_obj(), rec.key()
    except RunningError as e:
        raise Exit(f"rig: error: {e}", code=2) from None


@task(iterable=["overlay", "set"], help=HELP)
def quality(c, profile="batch", overlay=None, set=None, platform="", url="", key_file="", suite="auto",
            reference="", save_reference=False, docs=True, running=False):
    """Quality battery: perplexity, lm-eval, garbage, tool calls, greedy digest; gates; table, JSON, docs."""
    from rig.cli.common import read_key
    from rig.plan import PlanError
    from rig.quality import battery, report
    from rig.quality.client import ServerRefused
    from rig.running import RunningError
    from rig.serve import PreflightError
    from rig.server import ServerError

    if running and (url or set or overlay):
        raise Exit("rig: error: --running measures the recorded server with its own plan: drop --url, --set and "
                   "--overlay (or restart it with `inv serve` and the knobs you want)", code=2)
    record = None
    if running:
        record, plan, key = _recorded()
        url = record.url
    else:
        plan = quality_plan(profile, overlay, set, platform)
        key = read_key(key_file, plan) if url else None
    try:
        result = battery.run(plan, suite, url=url or None, key=key, reference=Path(reference) if reference else None,
                             save_reference=save_reference, record=record)
    except (battery.QualityError, PreflightError, PlanError, RunningError) as e:
        raise Exit(f"rig: error: {e}", code=2) from None
    except battery.BatteryAborted as e:  # the partial result is saved; one line, no traceback
        raise Exit(f"rig: {e}", code=1) from None
    except (ServerError, ServerRefused) as e:
        raise Exit(f"rig: error: the server failed during the battery: {e}", code=1) from None
    report.print_table(result)
    print(f"rig: result: {result['path']}")
    if docs:
        print(f"rig: updated {report.update_docs(result)}")
    if not result["passed"]:
        raise Exit(code=1)
