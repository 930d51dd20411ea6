"""Pieces to carry a wheelhouse to an offline host by a channel with a size limit, and the script that installs them.

Some ways onto a GPU host take files of a bounded size only (an upload form, a transfer that
carries at most so many MiB a call). ``pack`` writes the wheels a host needs as one
uncompressed tar (wheels are zips already) cut into pieces of at most ``piece_size`` bytes, a
SHA256SUMS of the pieces, the wheels' own sha256 list, and ``install.sh``: on the host, it checks
every piece, joins them, checks every wheel, and installs them with ``pip install --no-index
--no-deps --target SITE`` — a folder beside the host's own site-packages, so libraries the host
already has at usable versions (its CUDA libraries, say) are used from there and not carried.

Which wheels a host lacks is the caller's choice (``select``: glob patterns of names to leave
out, names to keep anyway); nothing here knows any particular host.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from rig.env.bootstrap import normalize
from rig.env.wheelhouse import Row

TAR = "wheels.tar"
INSTALL = "install.sh"
# The install script, with {python} and {count} filled in. POSIX sh and coreutils only: it runs on
# a bare host before anything is installed there.
INSTALL_SH = """#!/bin/sh
# Install {count} wheels carried from a rig wheelhouse (made by bench/scripts/gpu_carry.py; Python {python}).
#   sh install.sh SITE      then   export PYTHONPATH=SITE
# Checks every piece and every wheel against their sha256 first; installs nothing if one is wrong.
set -eu
site=${{1:?usage: sh install.sh SITE  (the folder to install into; then export PYTHONPATH=SITE)}}
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
fail() {{ echo "install.sh: $1" >&2; exit 2; }}
sha256sum --quiet -c SHA256SUMS || fail "a piece is missing or damaged (above): carry it again"
rm -rf wheels && mkdir wheels
cat {tar}.* | tar -x -C wheels -f -
(cd wheels && sha256sum --quiet -c ../WHEELS.sha256) || fail "a wheel does not match its sha256 (above)"
"${{PYTHON:-python3}}" -m pip install --disable-pip-version-check --no-index --find-links wheels --no-deps \\
    --no-compile --no-cache-dir --upgrade --target "$site" wheels/*
echo "installed {count} wheels into $site: export PYTHONPATH=$site"
"""


class CarryError(ValueError):
    """A selection or piece size that cannot work; the message names it."""


@dataclass(frozen=True)
class Packed:
    """What ``pack`` wrote."""

    pieces: list[Path]
    wheels: list[Row]
    tar_bytes: int


def parse_size(text: str) -> int:
    """``63M`` / ``1.5G`` / ``512K`` / ``1000`` -> bytes (binary units, as split(1) reads them)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", text.strip().upper())
    if not m:
        raise CarryError(f"piece size {text!r}: expected a number with K, M or G, e.g. 60M")
    size = int(float(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)])
    if size < 10240:
        raise CarryError(f"piece size {text!r}: at least 10K (a tar block is 10 KiB)")
    return size


def select(names: list[str], leave_out: list[str], keep: list[str]) -> list[str]:
    """The names to carry: all but those matching a ``leave_out`` glob, unless named in ``keep``.

    A glob or kept name that matches nothing is refused: it is a typo, or a lock that changed.
    """
    names = sorted({normalize(n) for n in names})
    for pattern in leave_out:
        if not fnmatch.filter(names, normalize(pattern)):
            raise CarryError(f"--leave-out {pattern!r} matches no requirement of the lock")
    kept = {normalize(k) for k in keep}
    unknown = kept - set(names)
    if unknown:
        raise CarryError(f"--keep {', '.join(sorted(unknown))}: not in the lock")
    return [n for n in names if n in kept or not any(fnmatch.fnmatch(n, normalize(p)) for p in leave_out)]


class _Pieces(io.RawIOBase):
    """A write-only stream that cuts what is written into files ``<stem>.000``, ``.001``… of ``size`` bytes."""

    def __init__(self, stem: Path, size: int) -> None:
        self.stem, self.size = stem, size
        self.paths: list[Path] = []
        self._file = None
        self._left = 0
        self.total = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        while view:
            if self._left == 0:
                self._next()
            n = min(self._left, len(view))
            self._file.write(view[:n])
            view, self._left, self.total = view[n:], self._left - n, self.total + n
        return len(data)

    def _next(self) -> None:
        if self._file:
            self._file.close()
        path = self.stem.with_name(f"{self.stem.name}.{len(self.paths):03d}")
        self.paths.append(path)
        self._file = path.open("wb")
        self._left = self.size

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
        super().close()


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def pack(wheelhouse: Path, rows: list[Row], out: Path, piece_size: int, python: str) -> Packed:
    """Write the pieces, SHA256SUMS, WHEELS.sha256 and install.sh for ``rows`` of ``wheelhouse`` into ``out``.

    The tar is deterministic (sorted names, zero times and owners): the same wheels give the same
    pieces, so a piece carried twice is the same file. GNU format, not ustar: wheel names with
    several platform tags pass ustar's 100-character limit (pybase64's cp312 wheel has 112), and
    every ``tar -x`` a host has reads GNU long names.
    """
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{TAR}.*"):
        old.unlink()
    stream = _Pieces(out / TAR, piece_size)
    with tarfile.open(fileobj=stream, mode="w|", format=tarfile.GNU_FORMAT) as tar:
        for r in sorted(rows, key=lambda r: r.file):
            src = wheelhouse / r.file
            info = tarfile.TarInfo(r.file)
            info.size, info.mode, info.mtime = src.stat().st_size, 0o644, 0
            with src.open("rb") as f:
                tar.addfile(info, f)
    stream.close()
    (out / "SHA256SUMS").write_text("".join(f"{_sha256(p)}  {p.name}\n" for p in stream.paths))
    (out / "WHEELS.sha256").write_text("".join(f"{r.sha256}  {r.file}\n" for r in sorted(rows, key=lambda r: r.file)))
    script = out / INSTALL
    script.write_text(INSTALL_SH.format(python=python, count=len(rows), tar=TAR))
    script.chmod(0o755)
    return Packed(stream.paths, rows, stream.total)
