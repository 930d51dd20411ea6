"""`inv test` and `inv verify`: the test suite, and the check that a host is set up right."""

from __future__ import annotations

import subprocess
import sys

from invoke import Exit, task


@task(help={"args": "extra pytest arguments, e.g. \"-k plan -x\"", "fast": "skip the slow tests (servers, training)",
            "gpu": "run the GPU tier only (tests marked gpu: the serving path on CUDA)"})
def test(c, args="", fast=False, gpu=False):
    """Run the whole test suite (real vLLM servers on CPU) and ruff; --gpu: the GPU tier on a CUDA host."""
    from rig import paths

    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "."], cwd=paths.ROOT)
    marks = ["-m", "gpu"] if gpu else (["-m", "not slow"] if fast else [])
    cmd = [sys.executable, "-m", "pytest", *marks, *args.split()]
    code = subprocess.run(cmd, cwd=paths.ROOT).returncode
    if code or lint.returncode:
        raise Exit(code=code or lint.returncode)


@task(iterable=["overlay", "set"], help={"profile": "profile whose server is checked live",
                                         "overlay": "overlay (repeatable)", "set": "KNOB=value (repeatable)",
                                         "no_live": "offline rows only: start no server",
                                         "running": "check the server `inv serve` recorded instead of starting one",
                                         "url": "check a server rig did not start, at this base URL",
                                         "key_file": "with --url: its API key file (default: the plan's)",
                                         "report_dir": "write the JSON report here (default: .rig/results/)"})
def verify(c, profile="batch", overlay=None, set=None, no_live=False, running=False, url="", key_file="",
           report_dir=""):
    """Check the environment against the lock, pins, patches, model, capacity, then a live server (one it starts,
    --running or --url): every row runs; exit 1 when any failed; a JSON report under .rig/results/."""
    from pathlib import Path

    from rig import verify as v
    from rig.cli.common import plan_from_args, read_key

    if sum(map(bool, (no_live, running, url))) > 1:
        raise Exit("rig: error: --no-live, --running and --url each pick the server to check; give one of them",
                   code=2)
    plan = plan_from_args(profile, overlay, set, "")
    mode = v.Mode("offline") if no_live else v.Mode("start")
    if running:
        from rig.running import RunningError, find

        try:  # bad input (nothing recorded) is exit 2 before any check runs
            mode = v.Mode("running", record=find())
        except RunningError as e:
            raise Exit(f"rig: error: {e}", code=2) from None
    elif url:
        mode = v.Mode("url", url=url, key=read_key(key_file, plan))
    ok, _ = v.run(plan, mode, Path(report_dir) if report_dir else None)
    if not ok:
        raise Exit(code=1)


@task
def docs(c):
    """Regenerate the generated blocks of README.md and docs/ (knob reference, profile tables, dry run, patch table)."""
    from rig.docgen import write_all

    changed = write_all()
    print(f"updated: {', '.join(changed)}" if changed else "docs are current")


@task
def golden(c):
    """Rewrite the golden plans of tests/test_plan.py after an intended change to profiles or knobs
    (review the diff: the test only compares, it never writes)."""
    from rig.golden import write_all

    changed = write_all()
    print(f"updated: {', '.join(changed)}" if changed else "golden plans are current")


@task(help={"which": "comma-separated: install, serve, suite (default: all three)"})
def figures(c, which="install,serve,suite"):
    """Measure the development figures of docs/development.md (install, time-to-ready, suite, memory)."""
    from rig.devfigures import main

    main(which)
