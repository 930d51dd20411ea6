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
                                         "no_live": "skip starting a server",
                                         "running": "check the server `inv serve` recorded instead of starting one",
                                         "url": "check a server rig did not start, at this base URL",
                                         "key_file": "with --url: its API key file (default: the plan's)"})
def verify(c, profile="batch", overlay=None, set=None, no_live=False, running=False, url="", key_file=""):
    """Check install, pins, patches, model and a live server (or --running / --url); exit 1 on the first failure."""
    from functools import partial

    from rig import verify as v
    from rig.cli.common import plan_from_args, read_key

    plan = plan_from_args(profile, overlay, set, "")
    server = None
    if running:
        from rig.running import RunningError, find

        try:  # bad input (nothing recorded) is exit 2 before any check runs
            find()
        except RunningError as e:
            raise Exit(f"rig: error: {e}", code=2) from None
        server = v.check_recorded
    elif url:
        server = partial(v.check_foreign, url, read_key(key_file, plan))
    if not v.run(plan, live=not no_live, server=server):
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
