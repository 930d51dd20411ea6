"""`inv serve` and `inv service`: resolve a profile into a plan, show it, serve it or write its unit."""

from __future__ import annotations

import sys

from invoke import Exit, task

from rig.cli.common import plan_from_args

HELP = {
    "profile": "profile name (profiles/*.toml): batch, single-user, kvarn",
    "overlay": "overlay to apply (profiles/overlays/*.toml), repeatable, in order: tp2, quality, multinode, ...",
    "set": "KNOB=value, repeatable; wins over everything else (see docs/profiles.md)",
    "platform": "cpu or gpu; default: gpu when NVML finds a CUDA device, else cpu",
    "dry_run": "print the plan and exit without starting anything",
    "json": "with --dry-run: print the plan as JSON",
}


@task(iterable=["overlay", "set"], help=HELP)
def serve(c, profile="batch", overlay=None, set=None, platform="", dry_run=False, json=False):
    """Serve a profile: preflight, start vllm serve, prove it answers, stay up until Ctrl-C."""
    from rig import planview
    from rig.plan import PlanError, check_with_vllm

    plan = plan_from_args(profile, overlay, set, platform)
    if dry_run:
        try:
            check_with_vllm(plan.argv)
        except PlanError as e:
            raise Exit("\n".join(f"rig: error: {m}" for m in e.messages), code=2) from None
        sys.stdout.write(plan.to_json() if json else planview.render(plan))
        return
    from rig.serve import run_foreground

    code = run_foreground(plan)
    if code:
        raise Exit(code=code)


@task(iterable=["overlay", "set"], help={**{k: HELP[k] for k in ("profile", "overlay", "set", "platform")},
                                         "out": "folder to write the unit and compose file into"})
def service(c, profile="batch", overlay=None, set=None, platform="", out=".rig/service"):
    """Write a systemd user unit and a docker compose service for a profile's plan."""
    from pathlib import Path

    from rig import paths
    from rig.service import write

    plan = plan_from_args(profile, overlay, set, platform)
    folder = Path(out) if Path(out).is_absolute() else paths.ROOT / out
    for path in write(plan, folder):
        print(f"wrote {path}")
    print("systemd: cp the .service file to ~/.config/systemd/user/ && systemctl --user daemon-reload && "
          f"systemctl --user enable --now rig-{profile}")
    print(f"docker: docker compose -f {folder}/compose.{profile}.yaml up -d")
