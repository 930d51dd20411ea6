"""The no-pixi path: make ``.venv`` from the hash-locked files, apply the install fixes, run invoke.

Standard library only: this runs under whatever ``python3`` the host has, before anything is
installed. It is idempotent — a stamp of the lock and of the fix code sits in the venv, and when
neither changed the whole set-up is a few file reads — so every command of the README can go
through it. Bad hosts fail here, in one line each, before anything is half-written.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_PYTHON = (3, 11)
# Wheels with a local version label (+cpu) come from PyTorch's index, not PyPI.
TORCH_INDEX = os.environ.get("RIG_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^ \\;]+)")


class BootstrapError(SystemExit):
    """A host problem the user must fix; printed as one line, exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


def venv_dir() -> Path:
    return Path(os.environ.get("RIG_VENV", ROOT / ".venv")).resolve()


def check_python(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> None:
    """vLLM 0.28 and our locks target CPython 3.11+; older interpreters fail obscurely later."""
    if tuple(version[:2]) < MIN_PYTHON:
        have = ".".join(map(str, version))
        raise BootstrapError(
            f"rig needs Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}, this is {have}: "
            f"run bootstrap.py with python3.11 (or newer), e.g. `python3.11 bootstrap.py ...`"
        )


def detect_env() -> str:
    """``RIG_ENV`` if set, else ``gpu`` when an NVIDIA driver answers, else ``cpu``."""
    env = os.environ.get("RIG_ENV", "").strip()
    if env:
        if env not in ("cpu", "gpu"):
            raise BootstrapError(f"RIG_ENV={env!r}: expected 'cpu' or 'gpu'; unset it to auto-detect")
        return env
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True).returncode == 0:
        return "gpu"
    return "cpu"


def check_compiler(env: str) -> None:
    """torch.compile (vLLM's default) builds C++ on CPU hosts and nvcc is needed for kernels/."""
    if env == "cpu" and not (shutil.which("g++") or shutil.which("c++")):
        raise BootstrapError(
            "no C++ compiler on PATH: vLLM's CPU backend compiles its kernels with one; "
            "install it (Debian/Ubuntu: `apt-get install g++`) and run again"
        )


def parse_lock(path: Path) -> dict[str, str]:
    """Name -> version of every requirement; refuses a lock that pip would half-install."""
    if not path.is_file():
        raise BootstrapError(f"{path.relative_to(ROOT)} is missing: restore it (`git checkout -- locks/`)")
    pins: dict[str, str] = {}
    entry: str | None = None
    hashed: set[str] = set()
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("--hash=sha256:"):
            if entry is None or not re.fullmatch(r"--hash=sha256:[0-9a-f]{64}( \\)?", line):
                raise BootstrapError(f"{path.name}:{n}: malformed hash line {line!r}; regenerate with `inv env.lock`")
            hashed.add(entry)
            continue
        m = _REQ.match(line)
        if not m:
            raise BootstrapError(f"{path.name}:{n}: not a pinned requirement: {line!r}; regenerate with `inv env.lock`")
        entry = m.group(1).lower().replace("_", "-")
        pins[entry] = m.group(3)
    unhashed = sorted(set(pins) - hashed)
    if not pins or unhashed:
        what = ", ".join(unhashed[:5]) or "no requirements"
        raise BootstrapError(f"{path.name} is broken ({what} without --hash); regenerate with `inv env.lock`")
    return pins


def reachable(url: str, timeout: float = 3.0) -> bool:
    """A quick TCP probe, so an unreachable extra index is left out instead of stalling pip."""
    parts = urllib.parse.urlparse(url)
    if not parts.hostname:
        return False
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _stamp(lock: Path) -> str:
    h = hashlib.sha256()
    for f in (lock, Path(__file__), ROOT / "rig" / "envfix.py"):
        h.update(f.read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()


def _index_url() -> str:
    """The index pip will use (its own configuration decides; PyPI unless told otherwise)."""
    r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                       text=True)
    return os.environ.get("PIP_INDEX_URL") or r.stdout.strip() or "https://pypi.org/simple"


def _pip_failure(log: str) -> str:
    offline = re.search(r"NewConnectionError|Name or service not known|Temporary failure in name resolution|"
                        r"Network is unreachable|Connection refused|ConnectTimeout|ReadTimeout", log)
    if offline or not reachable(_index_url()):
        return ("no network: the first install downloads ~3.5 GB of wheels from PyPI; connect this host "
                "(or point PIP_INDEX_URL / PIP_FIND_LINKS at a mirror) and run again")
    if "THESE PACKAGES DO NOT MATCH THE HASHES" in log:
        return ("a downloaded wheel does not match its hash in the lock: regenerate with `inv env.lock` "
                "or check your mirror")
    m = re.search(r"No matching distribution found for (\S+\+cpu)", log)
    if m:
        return (f"no wheel for {m.group(1)} on the reachable indexes (torch +cpu builds come from {TORCH_INDEX}; "
                "set RIG_TORCH_INDEX or PIP_FIND_LINKS to a folder holding it)")
    tail = [ln for ln in log.splitlines() if ln.startswith("ERROR")][-1:] or ["see the log"]
    return f"pip failed: {tail[0]}"


def install(venv: Path, lock: Path, log_path: Path) -> None:
    """Create the venv and install the lock exactly (no resolver: --no-deps, --require-hashes)."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    cmd = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
           "--require-hashes", "--no-input", "-r", str(lock)]
    if TORCH_INDEX and re.search(r"^\S+\+cpu ", lock.read_text(), re.M) and reachable(TORCH_INDEX):
        cmd += ["--extra-index-url", TORCH_INDEX]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"rig: installing {lock.relative_to(ROOT)} into {venv} (first time: a few minutes; log: {log_path})",
          flush=True)
    with log_path.open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        raise BootstrapError(_pip_failure(log_path.read_text(errors="replace")))
    # rig itself is used from the checkout: a .pth line is an editable install without a build step.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "rig-checkout.pth").write_text(str(ROOT) + "\n")


def ensure(env: str | None = None) -> Path:
    """Make the venv match the lock (fast no-op when it already does) and apply the fixes."""
    check_python()
    env = env or detect_env()
    lock = ROOT / "locks" / f"{env}.txt"
    parse_lock(lock)
    check_compiler(env)
    venv = venv_dir()
    stamp_file = venv / ".rig-stamp"
    stamp = _stamp(lock)
    if not (stamp_file.exists() and stamp_file.read_text() == stamp):
        state = Path(os.environ.get("RIG_STATE_DIR", ROOT / ".rig"))
        install(venv, lock, state / "logs" / "bootstrap.log")
        stamp_file.write_text(stamp)
    fix = subprocess.run([str(venv / "bin" / "python"), "-m", "rig.envfix"], cwd=ROOT)
    if fix.returncode != 0:
        raise BootstrapError("the install fixes failed (see above); `rm -rf .venv` and run again")
    return venv


def main(argv: list[str]) -> int:
    try:
        venv = ensure()
    except BootstrapError as e:
        print(f"rig: error: {e.message}", file=sys.stderr)
        return e.code if isinstance(e.code, int) else 2
    inv = venv / "bin" / "inv"
    if not argv:
        argv = ["--list"]
    os.chdir(ROOT)
    os.execv(str(inv), [str(inv), *argv])
    return 0  # not reached
