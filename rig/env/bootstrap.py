"""The no-pixi path: make ``.venv`` from the hash-locked files, apply the install fixes, run invoke.

Standard library only: this runs under whatever ``python3`` the host has, before anything is
installed. It is idempotent — a stamp of the lock and of the fix code sits in the venv, and when
neither changed the whole set-up is a few file reads — so every command of the README can go
through it. Bad hosts fail here, in one line each, before anything is half-written.

``--wheelhouse DIR`` installs from a folder made by ``inv env.wheelhouse`` and nothing else (no
index, no pip configuration): a host without network. The folder is checked against the lock's
hashes first, so a missing or altered wheel is named before the venv is touched.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
MIN_PYTHON = (3, 11)
# Wheels with a local version label (+cpu) come from PyTorch's index, not PyPI.
TORCH_INDEX = os.environ.get("RIG_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
SDISTS = (".tar.gz", ".zip")
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^ \\;]+)")


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


class LockEntry(NamedTuple):
    """One requirement of a lock: its version and every sha256 the lock accepts for it."""

    version: str
    hashes: frozenset[str]


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def read_lock(path: Path) -> dict[str, LockEntry]:
    """Name -> (version, hashes) of every requirement; refuses a lock that pip would half-install."""
    if not path.is_file():
        raise BootstrapError(f"{_shown(path)} is missing: restore it (`git checkout -- locks/`)")
    versions: dict[str, str] = {}
    hashes: dict[str, set[str]] = {}
    entry: str | None = None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("--hash=sha256:"):
            if entry is None or not re.fullmatch(r"--hash=sha256:[0-9a-f]{64}( \\)?", line):
                raise BootstrapError(f"{path.name}:{n}: malformed hash line {line!r}; regenerate with `inv env.lock`")
            hashes.setdefault(entry, set()).add(line[len("--hash=sha256:"):][:64])
            continue
        m = REQUIREMENT.match(line)
        if not m:
            raise BootstrapError(f"{path.name}:{n}: not a pinned requirement: {line!r}; regenerate with `inv env.lock`")
        entry = normalize(m.group(1))
        versions[entry] = m.group(3)
    unhashed = sorted(set(versions) - set(hashes))
    if not versions or unhashed:
        what = ", ".join(unhashed[:5]) or "no requirements"
        raise BootstrapError(f"{path.name} is broken ({what} without --hash); regenerate with `inv env.lock`")
    return {name: LockEntry(v, frozenset(hashes[name])) for name, v in versions.items()}


def parse_lock(path: Path) -> dict[str, str]:
    """Name -> version of every requirement (see read_lock)."""
    return {name: e.version for name, e in read_lock(path).items()}


def normalize(name: str) -> str:
    """A project name as PEP 503 compares them (``Foo_Bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_path(env: str, version: tuple[int, ...] = tuple(sys.version_info[:2])) -> Path:
    """``locks/<env>-pyXY.txt`` when a lock was made for this Python, else ``locks/<env>.txt`` (Python 3.11)."""
    own = ROOT / "locks" / f"{env}-py{version[0]}{version[1]}.txt"
    return own if own.is_file() else ROOT / "locks" / f"{env}.txt"


def dist_name(filename: str) -> str | None:
    """The project a wheel or sdist file is of, from its name alone (None: not a distribution)."""
    if filename.endswith(".whl"):
        return normalize(filename.split("-", 1)[0])
    for ext in SDISTS:
        if filename.endswith(ext) and "-" in filename:
            return normalize(filename[: -len(ext)].rsplit("-", 1)[0])
    return None


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Match(NamedTuple):
    """A folder held against a lock: the file of each requirement, every file's sha256, what is wrong."""

    files: dict[str, Path]
    digests: dict[Path, str]
    problems: list[str]


def match_wheelhouse(lock: Path, folder: Path, on_file: Callable[[Path], None] | None = None) -> Match:
    """Which file of ``folder`` installs each requirement of ``lock``, by sha256 alone.

    A file whose name says it is that project but whose sha256 the lock does not accept is named
    as altered (a truncated copy, a rebuilt wheel, another release); an entry with no such file
    is named as missing. ``problems`` is empty when every requirement has a file the lock accepts.
    """
    entries = read_lock(lock)
    digests: dict[Path, str] = {}
    by_name: dict[str, list[Path]] = {}
    for f in sorted(folder.iterdir()):
        name = dist_name(f.name)
        if name and f.is_file():
            digests[f] = sha256_file(f)
            by_name.setdefault(name, []).append(f)
            if on_file:
                on_file(f)
    by_hash = {d: f for f, d in digests.items()}
    files: dict[str, Path] = {}
    problems = []
    for name, e in sorted(entries.items()):
        found = sorted(e.hashes & by_hash.keys())
        if found:
            files[name] = by_hash[found[0]]
            continue
        wrong = [f.name for f in by_name.get(name, []) if digests[f] not in e.hashes]
        if wrong:
            problems.append(f"{', '.join(wrong)} does not match {name}=={e.version} in {_shown(lock)} "
                            f"(its sha256 is none of the lock's: altered, truncated or another build)")
        else:
            problems.append(f"{name}=={e.version} is missing (no file with a hash of {_shown(lock)})")
    return Match(files, digests, problems)


def wheelhouse_problems(lock: Path, folder: Path) -> list[str]:
    """What keeps ``folder`` from installing ``lock`` offline (empty: nothing)."""
    return match_wheelhouse(lock, folder).problems


def check_wheelhouse(lock: Path, folder: Path, env: str) -> None:
    """Refuse, naming the wheels, a folder that cannot install the lock offline; before anything is made."""
    if not folder.is_dir():
        raise BootstrapError(f"--wheelhouse {folder}: no such folder; make one on a host with network: "
                             f"`inv env.wheelhouse --env {env} --out {folder}`")
    problems = wheelhouse_problems(lock, folder)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise BootstrapError(f"wheelhouse {folder} cannot install {_shown(lock)}: {'; '.join(problems[:3])}{more}; "
                             f"rebuild it with `inv env.wheelhouse --env {env} --out DIR` or copy the wheel in")


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
    for f in (lock, Path(__file__), ROOT / "rig" / "env" / "fix.py"):
        h.update(f.read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()


def _index_url() -> str:
    """The index pip will use (its own configuration decides; PyPI unless told otherwise)."""
    r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                       text=True)
    return os.environ.get("PIP_INDEX_URL") or r.stdout.strip() or "https://pypi.org/simple"


PIP_RUNS = 3  # pip runs, the first included, while its downloads break off (this install; inv env.wheelhouse)
RETRY_DELAY_S = 5.0  # seconds before the second run, doubled before each later one


def backoff(run: int, delay_s: float) -> float:
    """Seconds to wait after failed run ``run`` (1-based) before the next: ``delay_s``, then doubled each time."""
    return delay_s * 2 ** (run - 1)


def transient(log: str) -> str:
    """What in a failed pip run's output says a download broke off mid-file ('' if nothing does).

    pip retries a connection it cannot open, but not a read that times out or a connection cut
    once a file is under way: the run ends with ``ERROR: Exception:`` and a traceback (or, a cut
    body taken whole, a hash mismatch). A second run usually gets the file; a missing
    distribution or an index that cannot be reached at all fails the same way again.
    """
    m = re.search(r"ReadTimeoutError|IncompleteRead|ProtocolError|Connection broken|ConnectionResetError|"
                  r"THESE PACKAGES DO NOT MATCH THE HASHES", log)
    if not m or not reachable(_index_url()):
        return ""
    return "a hash mismatch" if m.group(0).startswith("THESE") else m.group(0)


def _pip_failure(log: str) -> str:
    broke = transient(log)
    if broke:
        return (f"pip's downloads broke off {PIP_RUNS} runs in a row ({broke}) although the index answers: "
                "a slow mirror or a flaky link; run the same command again (pip's cache keeps finished files), "
                "or point PIP_INDEX_URL at a closer mirror")
    offline = re.search(r"NewConnectionError|Name or service not known|Temporary failure in name resolution|"
                        r"Network is unreachable|Connection refused|ConnectTimeout|ReadTimeout", log)
    if offline or not reachable(_index_url()):
        return ("no network: the first install downloads over 1 GB of wheels from PyPI; connect this host "
                "(or point PIP_INDEX_URL / PIP_FIND_LINKS at a mirror, or use `--wheelhouse DIR`) and run again")
    if "THESE PACKAGES DO NOT MATCH THE HASHES" in log:
        return ("a downloaded wheel does not match its hash in the lock: regenerate with `inv env.lock` "
                "or check your mirror")
    m = re.search(r"No matching distribution found for (\S+\+cpu)", log)
    if m:
        return (f"no wheel for {m.group(1)} on the reachable indexes (torch +cpu builds come from {TORCH_INDEX}; "
                "set RIG_TORCH_INDEX or PIP_FIND_LINKS to a folder holding it)")
    tail = [ln for ln in log.splitlines() if ln.startswith("ERROR")][-1:] or ["see the log"]
    return f"pip failed: {tail[0]}"


def offline_pip(folder: Path) -> tuple[list[str], dict[str, str]]:
    """pip arguments and environment that install from ``folder`` alone.

    ``--no-index`` drops every index; pip's configuration files and PIP_* variables are left out
    too, since a find-links there (a local wheel folder, a mirror) would otherwise still be read;
    no cache, so what installs is what the folder holds, and sdists build from its setuptools.
    ``--use-pep517``: pip 23 builds an sdist without a pyproject.toml in the running environment
    when `wheel` is installed there, so the folder's own build requirements went unchecked.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return ["--no-index", "--find-links", str(folder), "--no-cache-dir", "--use-pep517"], env


def _wheelhouse_failure(log: str, folder: Path) -> str:
    m = re.search(r"No matching distribution found for (\S+)", log)
    if m:
        here = f"Python {sys.version_info[0]}.{sys.version_info[1]}"
        return (f"wheelhouse {folder} has no file of {m.group(1)} that installs on this host ({here}): build it "
                f"for this Python (`inv env.wheelhouse --python {here[7:]} ...`)")
    bad = re.findall(r"^\s+(\S+==\S+) from (\S+)", log, re.M)
    if bad:
        return f"wheelhouse {folder}: {bad[0][1].rsplit('/', 1)[-1]} does not match the hash of {bad[0][0]} in the lock"
    tail = [ln for ln in log.splitlines() if ln.startswith("ERROR")][-1:] or ["see the log"]
    return f"pip failed installing from {folder}: {tail[0]}"


def install(venv: Path, lock: Path, log_path: Path, wheelhouse: Path | None = None) -> None:
    """Create the venv and install the lock exactly (no resolver: --no-deps, --require-hashes)."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    cmd = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
           "--require-hashes", "--no-input", "-r", str(lock)]
    env = None
    if wheelhouse:
        extra, env = offline_pip(wheelhouse)
        cmd += extra
    elif TORCH_INDEX and re.search(r"^\S+\+cpu ", lock.read_text(), re.M) and reachable(TORCH_INDEX):
        cmd += ["--extra-index-url", TORCH_INDEX]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    source = f" from {wheelhouse} (offline)" if wheelhouse else ""
    print(f"rig: installing {_shown(lock)}{source} into {venv} (first time: a few minutes; log: {log_path})",
          flush=True)
    runs = 1 if wheelhouse else PIP_RUNS
    with log_path.open("w") as log:
        for run in range(1, runs + 1):
            start = log.tell()
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
            if rc == 0:
                break
            log.flush()
            text = log_path.read_bytes()[start:].decode(errors="replace")
            broke = "" if run == runs else transient(text)
            if not broke:
                raise BootstrapError(_wheelhouse_failure(text, wheelhouse) if wheelhouse else _pip_failure(text))
            wait = backoff(run, RETRY_DELAY_S)
            print(f"rig: pip's download broke off ({broke}); run {run} of {runs}, again in {wait:.0f} s", flush=True)
            log.write(f"\n== run {run + 1} of {runs}\n")
            log.flush()
            time.sleep(wait)
    # rig itself is used from the checkout: a .pth line is an editable install without a build step.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "rig-checkout.pth").write_text(str(ROOT) + "\n")


def ensure(env: str | None = None, wheelhouse: Path | None = None) -> Path:
    """Make the venv match the lock (fast no-op when it already does) and apply the fixes.

    With ``wheelhouse``, the install reads that folder only; it is checked against the lock
    (every requirement has a file of one of its hashes) before the venv is touched.
    """
    check_python()
    env = env or detect_env()
    lock = lock_path(env)
    parse_lock(lock)
    check_compiler(env)
    if wheelhouse and not wheelhouse.is_dir():
        check_wheelhouse(lock, wheelhouse, env)
    venv = venv_dir()
    stamp_file = venv / ".rig-stamp"
    stamp = _stamp(lock)
    if not (stamp_file.exists() and stamp_file.read_text() == stamp):
        if wheelhouse:
            check_wheelhouse(lock, wheelhouse, env)
        state = Path(os.environ.get("RIG_STATE_DIR", ROOT / ".rig"))
        install(venv, lock, state / "logs" / "bootstrap.log", wheelhouse)
        stamp_file.write_text(stamp)
    fix = subprocess.run([str(venv / "bin" / "python"), "-m", "rig.env.fix"], cwd=ROOT)
    if fix.returncode != 0:
        raise BootstrapError("the install fixes failed (see above); `rm -rf .venv` and run again")
    return venv


def split_args(argv: list[str]) -> tuple[Path | None, list[str]]:
    """bootstrap's own leading option (``--wheelhouse DIR``), and the invoke arguments after it."""
    if argv and argv[0].startswith("--wheelhouse="):
        return Path(argv[0].split("=", 1)[1]).resolve(), argv[1:]
    if argv and argv[0] == "--wheelhouse":
        if len(argv) < 2 or argv[1].startswith("-"):
            raise BootstrapError("--wheelhouse needs a folder: `python3 bootstrap.py --wheelhouse DIR <task>`")
        return Path(argv[1]).resolve(), argv[2:]
    return None, argv


def main(argv: list[str]) -> int:
    try:
        wheelhouse, argv = split_args(argv)
        venv = ensure(wheelhouse=wheelhouse)
    except BootstrapError as e:
        print(f"rig: error: {e.message}", file=sys.stderr)
        return e.code if isinstance(e.code, int) else 2
    inv = venv / "bin" / "inv"
    if not argv:
        argv = ["--list"]
    os.chdir(ROOT)
    os.execv(str(inv), [str(inv), *argv])
    return 0  # not reached
