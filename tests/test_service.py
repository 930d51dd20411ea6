"""`inv service` writes a systemd unit and a compose service that re-resolve the same plan."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from rig import paths
from rig.plan import resolve
from rig.service import write


def test_unit_and_compose_come_from_the_plan(tmp_path):
    plan = resolve("single-user", ("tp2",), "gpu", environ={"MAX_SEQS": "3"}, sets={"PORT": "18555"})
    unit_path, compose_path = write(plan, tmp_path)
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(unit_path.read_text())
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[0] == str(Path(sys.executable).with_name("inv"))
    assert argv[1:5] == ["serve", "--profile", "single-user", "--platform"]
    assert unit["Service"]["KillMode"] == "control-group" and unit["Install"]["WantedBy"] == "default.target"
    # the unit's arguments resolve to the very same plan, with no environment
    sets = dict(a.split("=", 1) for a in argv[argv.index("--set") + 1::2])
    overlays = [argv[i + 1] for i, a in enumerate(argv) if a == "--overlay"]
    again = resolve("single-user", overlays, "gpu", environ={}, sets=sets)
    assert again.argv == plan.argv and again.knobs == plan.knobs
    assert f"# plan sha256: {plan.digest}" in unit_path.read_text()

    svc = yaml.safe_load(compose_path.read_text())["services"]["rig-single-user"]
    assert svc["ports"] == ["127.0.0.1:18555:18555"]  # loopback on the host
    assert "HOST=0.0.0.0" in svc["command"] and svc["command"][:2] == ["python3", "bootstrap.py"]
    assert svc["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    assert svc["volumes"] == [f"{paths.ROOT}:/rig"]


def test_verify_without_a_live_server_checks_install_pins_patches_model_capacity(tmp_path):
    r = subprocess.run([str(Path(sys.executable).with_name("inv")), "verify", "--no-live", "--report-dir",
                        str(tmp_path)], cwd=paths.ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    for row in ("install", "pins", "patches", "model", "kernels", "capacity"):
        assert row in r.stdout
    assert "FAIL" not in r.stdout and "patches applied" in r.stdout and "no others" in r.stdout
    [report] = tmp_path.glob("verify-*.json")
    doc = json.loads(report.read_text())
    assert doc["passed"] is True and [x["status"] for x in doc["rows"]] == ["pass"] * 6
