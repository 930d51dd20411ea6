"""rig.atomic: the one writer every user-facing file goes through. An interrupted write leaves the old file
whole and nothing beside it; a finished one replaces it in one rename."""

from __future__ import annotations

import json
import os

import pytest

from rig import atomic


def test_a_write_replaces_the_file_whole_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "deep" / "result.json"           # the folder is created
    atomic.write_json(target, {"b": 1, "a": [1, 2]}, sort_keys=True)
    assert target.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    atomic.write_atomic(target, b"\x00binary")
    assert target.read_bytes() == b"\x00binary"
    assert [p.name for p in target.parent.iterdir()] == ["result.json"]


@pytest.mark.parametrize("stage", ["fsync", "replace"])
def test_an_interrupted_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch, stage):
    target = tmp_path / "tables.md"
    target.write_text("the old results\n")

    def fail(*args):
        raise OSError(f"disk full at {stage} (simulated)")

    monkeypatch.setattr(atomic.os, stage, fail)
    with pytest.raises(OSError, match="simulated"):
        atomic.write_atomic(target, "the new results, half written\n")
    monkeypatch.undo()
    assert target.read_text() == "the old results\n"
    assert [p.name for p in tmp_path.iterdir()] == ["tables.md"]


def test_text_is_utf8_and_json_keeps_extra_arguments(tmp_path):
    path = atomic.write_json(tmp_path / "r.json", {"city": "Zürich"}, ensure_ascii=False)
    assert path.read_bytes() == '{\n  "city": "Zürich"\n}\n'.encode()
    assert json.loads(path.read_text()) == {"city": "Zürich"}
    assert os.stat(path).st_size == len('{\n  "city": "Zürich"\n}\n'.encode())


def test_a_new_file_gets_opens_mode_and_a_rewritten_one_keeps_its_own(tmp_path):
    umask = os.umask(0o027)                               # set for this test, restored below
    try:
        fresh = atomic.write_atomic(tmp_path / "report.md", "x")
        assert fresh.stat().st_mode & 0o777 == 0o640      # 0666 less the umask, as open() gives
        private = tmp_path / "secret.json"
        private.write_text("{}")
        private.chmod(0o600)
        atomic.write_json(private, {"a": 1})
        assert private.stat().st_mode & 0o777 == 0o600    # a private file stays private
    finally:
        os.umask(umask)
