"""Atomic files: every file rig writes for a user (results, reports, manifests, fingerprints, kernel artefacts)
goes through here, so a reader, or a run interrupted half-way, sees the old content or the new, never a torn one.

One writer for the whole package: a temporary file beside the target (same filesystem, so the rename is atomic),
flushed and fsynced, then renamed over it; on any failure the temporary file is removed and the target is
untouched. (The patch series' multi-file writer in ``rig.patches`` builds its all-or-nothing tree on the same
idea and keeps each file's mode.)"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    """The process umask, read without changing it (os.umask can only be read by setting it, a race for other
    threads creating files); Linux reports it in /proc, elsewhere the common 022."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def write_atomic(path: Path | str, data: str | bytes) -> Path:
    """Write ``data`` (text is UTF-8) to ``path``, creating its folder; returns the path. The file keeps the mode
    it had (a private file stays private), a new one gets what open() would give it (0666 less the umask), not
    the temporary file's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path | str, obj: Any, *, sort_keys: bool = False, **dumps: Any) -> Path:
    """``obj`` as indented JSON with a final newline, atomically (``dumps``: more json.dumps arguments)."""
    return write_atomic(path, json.dumps(obj, indent=2, sort_keys=sort_keys, **dumps) + "\n")
