"""`service`: a systemd user unit and a docker compose service, both made from a plan.

Neither is a hand-written copy of the flags: both run `serve` with the plan's profile, overlays
and every knob that did not come from a profile file pinned with ``--set``, so the service
re-resolves exactly the plan it was made from (its sha256 is written beside it) and keeps
serve's preflight, API-key handling and whole-tree shutdown.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import yaml

from rig import paths
from rig.plan import Plan


def serve_args(plan: Plan, host: str | None = None) -> list[str]:
    """`inv serve` arguments that resolve to this plan again."""
    args = ["serve", "--profile", plan.profile, "--platform", plan.platform]
    for ov in plan.overlays:
        if ov != plan.platform:
            args += ["--overlay", ov]
    pinned = {k: v for k, v in plan.knobs.items() if plan.sources.get(k) in ("env", "--set")}
    if host:
        pinned["HOST"] = host
    for k, v in sorted(pinned.items()):
        args += ["--set", f"{k}={v}"]
    return args


def systemd_unit(plan: Plan, root: Path = paths.ROOT) -> str:
    """A user unit (~/.config/systemd/user/rig-<profile>.service)."""
    inv = Path(sys.executable).with_name("inv")  # the environment serving now (.venv or pixi's)
    return "\n".join([
        "[Unit]",
        f"Description=rig: vLLM {plan.profile} profile ({plan.served_name})",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"WorkingDirectory={root}",
        f"ExecStart={shlex.join([str(inv), *serve_args(plan)])}",
        "KillMode=control-group",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=60",
        "Restart=on-failure",
        "RestartSec=10",
        f"# plan sha256: {plan.digest}",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


def compose(plan: Plan, root: Path = paths.ROOT) -> str:
    """A docker compose file with one service running this checkout's `serve` in a CUDA-capable container.

    Inside the container the server binds 0.0.0.0 (or Docker could not forward to it); the host
    side publishes the port on loopback only, so the default stays loopback.
    """
    port = plan.knobs["PORT"]
    service: dict = {
        "image": "python:3.11-bookworm",  # has g++, which the CPU backend compiles with
        "working_dir": "/rig",
        "volumes": [f"{root}:/rig"],
        "command": ["python3", "bootstrap.py", *serve_args(plan, host="0.0.0.0")],
        "ports": [f"127.0.0.1:{port}:{port}"],
        "environment": {"RIG_ENV": "gpu" if plan.platform == "gpu" else "cpu"},
        "stop_signal": "SIGTERM",
        "stop_grace_period": "60s",
        "restart": "unless-stopped",
        "labels": {"rig.source-plan.sha256": plan.digest, "rig.profile": plan.profile},
    }
    if plan.platform == "gpu":
        service["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": max(plan.knobs["TP"] * plan.knobs["PP"], 1), "capabilities": ["gpu"]}]}}}
        service["ipc"] = "host"
    return yaml.safe_dump({"services": {f"rig-{plan.profile}": service}}, sort_keys=True)


def write(plan: Plan, out_dir: Path) -> list[Path]:
    """Write both files (atomically) into out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {out_dir / f"rig-{plan.profile}.service": systemd_unit(plan),
             out_dir / f"compose.{plan.profile}.yaml": compose(plan)}
    for path, text in files.items():
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return list(files)
