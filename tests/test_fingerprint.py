"""The environment fingerprint: a failed GPU probe and uncommitted code never pass for comparable."""

from __future__ import annotations

import subprocess

import pytest

from rig import fingerprint, paths
from rig.bench import compare
from rig.bench.results import CellResult, PassResult, RunResult
from rig.repro import diff


def _run(fp: dict) -> RunResult:
    cell = CellResult(label="C1", params={}, passes=[PassResult(seed=1, warmup=False, ok=True,
                                                                figures={"e2e_tok_per_s": 100.0})])
    cell.summarize()
    return RunResult(protocol="cohort", protocol_kind="cohort", protocol_def={}, profile="batch", plan={},
                     knobs={}, fingerprint=fp, scale={"factor": 1.0}, repeat=1, started_utc="t", cells=[cell])


def _fp(utc: str = "2026-12-03T10:00:00+00:00", **rig) -> dict:
    return {"utc": utc, "rig": {"sha": "abc", "dirty": False, **rig}, "packages": {}, "locks": {}, "gpus": [],
            "gpu_probe": "no GPU: NVMLError_LibraryNotFound", "patches": {"files": {}}, "plan": {"knobs": {}}}


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A real git checkout standing in for rig's (paths.ROOT), one commit."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    monkeypatch.setattr(paths, "ROOT", tmp_path)
    return tmp_path


def test_uncommitted_changes_are_part_of_what_must_match(repo):
    clean = fingerprint._git()
    assert clean["dirty"] is False and clean["changes_sha256"] is None
    (repo / "a.py").write_text("x = 2\n")
    one = fingerprint._git()
    (repo / "new.py").write_text("y = 1\n")  # an untracked file changes the code too
    two = fingerprint._git()
    assert one["sha"] == two["sha"] == clean["sha"] and one["dirty"] and two["dirty"]
    assert len({clean["changes_sha256"], one["changes_sha256"], two["changes_sha256"]}) == 3
    (repo / "new.py").unlink()
    assert fingerprint._git() == one  # the same changes, the same digest


def test_compare_refuses_clean_against_uncommitted_code_and_says_so_when_both_are():
    clean, dirty = _fp(), _fp(dirty=True, changes_sha256="d" * 64)
    with pytest.raises(compare.CompareError, match="rig.changes: None vs 'uncommitted changes dddddddddddd'"):
        compare.render(_run(clean), _run(dirty))
    other = _fp(dirty=True, changes_sha256="e" * 64)
    with pytest.raises(compare.CompareError, match="rig.changes"):
        compare.render(_run(dirty), _run(other))
    text = compare.render(_run(dirty), _run(_fp(utc="later", dirty=True, changes_sha256="d" * 64)))
    assert "NOTE: A was measured on abc plus uncommitted changes dddddddddddd" in text
    assert "NOTE: B was measured on abc plus uncommitted changes dddddddddddd" in text
    assert "NOTE" not in compare.render(_run(clean), _run(_fp(utc="later")))


def test_an_old_dirty_fingerprint_without_a_digest_matches_nothing():
    old = _fp(dirty=True)  # written before changes_sha256 existed
    with pytest.raises(compare.CompareError, match="rig.changes"):
        compare.render(_run(old), _run(_fp(utc="later", dirty=True)))


def test_gpu_probe_on_this_host_says_how_it_went():
    gpus, probe = fingerprint._gpu()
    assert probe == "nvml" or (probe.startswith("no GPU") and gpus == []), probe


def test_a_failed_gpu_probe_is_unknown_not_no_gpus(monkeypatch):
    pynvml = pytest.importorskip("pynvml")

    def broken():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", broken)
    gpus, probe = fingerprint._gpu()
    assert gpus == [] and probe.startswith("failed: "), probe
    a = {**_fp(), "gpu_probe": probe}
    b = {**_fp(utc="later"), "gpu_probe": probe}
    assert diff.compare(a, b).verdict == "not comparable"
    with pytest.raises(compare.CompareError, match="gpus: 'unknown \\(GPU probe failed"):
        compare.render(_run(a), _run(b))
    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    assert fingerprint._gpu()[1].startswith("failed: nvmlInit")


def test_collect_records_the_probe_and_the_changes():
    fp = fingerprint.collect()
    assert isinstance(fp["gpus"], list) and fp["gpu_probe"]
    assert set(fp["rig"]) == {"sha", "dirty", "changes_sha256"}
    assert (fp["rig"]["changes_sha256"] is None) == (not fp["rig"]["dirty"])
