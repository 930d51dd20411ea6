"""The configuration ladder against the reference's (rig.bench.ladder, bench/scripts/ladder_chart.py), on the
H200 ladder run's own files (docs/gpu-runs/2026-12-05-h200-ladder)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from rig import paths
from rig.bench import ladder

RUN = paths.ROOT / "docs" / "gpu-runs" / "2026-12-05-h200-ladder"
SCRIPT = paths.ROOT / "bench" / "scripts" / "ladder_chart.py"


def test_the_gpu_sessions_default_ladder_is_the_reference_ladders_rungs():
    """gpu_session.sh's default LADDER runs each reference rung with the knobs bench/reference/ladder.toml gives it
    (in its own order: the profile's rung first)."""
    out = subprocess.run(["bash", "-c", "set --; source bench/scripts/gpu_session.sh; echo \"$LADDER\""],
                         cwd=paths.ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                                             "OUT": "/tmp/rig-ladder-test"})
    default = dict(r.split(":", 1) for r in out.stdout.strip().split(";"))
    assert default == {r.name: r.knobs for r in ladder.load().rungs}


def test_the_h200_ladder_reads_as_ratios_beside_the_references(tmp_path):
    """The rungs that ran give their kept-pass medians and ratios to fp16 (mlp 0.92x e2e here, 1.24x on the
    reference's 3090); the ones that did not are "not run", not zero and not a guess; the PNG is written."""
    rows = {r.rung.name: r for r in ladder.rows(ladder.load(), RUN)}
    assert rows["fp16"].e2e_ratio == 1.0 and rows["fp16"].got.e2e == pytest.approx(3589.04, abs=0.01)
    assert rows["mlp"].e2e_ratio == pytest.approx(0.917, abs=0.001)
    assert rows["mlp"].ref_e2e_ratio == pytest.approx(876 / 707)
    assert rows["gate_up"].got.why_not == "not run" and rows["gate_up"].e2e_ratio is None
    text, png = ladder.write(RUN, tmp_path / "ladder.png")
    assert "| mlp (int8 activations, MLP (default)) | 3,292 | 3,743 | 0.92× / 1.24× | 0.96× / 1.27× |" in text
    assert "| gate_up (int8 activations, gate/up) | not run |" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_folder_without_rungs_is_refused_naming_it(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, str(SCRIPT), str(empty)], capture_output=True, text=True)
    assert r.returncode == 2 and f"{empty}: none of the ladder's rungs" in r.stderr
    assert not (empty / "ladder.png").exists()
    bad = tmp_path / "ladder.toml"
    shutil.copy(ladder.LADDER_FILE, bad)
    bad.write_text(bad.read_text().replace('baseline = "fp16"', 'baseline = "fp8"'))
    with pytest.raises(ValueError, match="baseline 'fp8' is not one of its rungs"):
        ladder.load(bad)
