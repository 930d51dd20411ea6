"""The development figures of docs/development.md, measured: install time, suite time, time-to-ready.

Each figure comes from running the real thing on this host: a fresh clone installed through
``bootstrap.py`` into an empty venv with an empty pip cache; ``serve``'s CPU batch plan started
from an empty state folder (cold compile cache) and again from the same folder (warm); the whole
test suite with the peak resident memory of its entire process tree sampled twice a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from rig import paths


def fresh_clone(dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(paths.ROOT), str(dest)], check=True)
    return dest


def _tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_measured(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[int, float, int]:
    """(exit code, wall seconds, peak RSS bytes of the whole process tree); output goes to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.5)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    code = proc.wait()
    done.set()
    t.join()
    return code, time.monotonic() - start, peak


def install_time(work: Path) -> tuple[float, Path, dict[str, str]]:
    """Seconds for a fresh clone's first `bootstrap.py` (empty venv, empty pip cache); the clone and its env."""
    clone = fresh_clone(work / "clone")
    env = {**os.environ, "RIG_VENV": str(work / "venv"), "RIG_STATE_DIR": str(work / "state"),
           "PIP_CACHE_DIR": str(work / "pip-cache")}
    code, wall, _ = run_measured([sys.executable, "bootstrap.py", "--list"], clone, env,
                                 paths.logs_dir() / "figures-install.log")
    if code:
        raise RuntimeError(f"fresh-clone install failed (exit {code})")
    return wall, clone, env


def time_to_ready(state: Path) -> float:
    """Seconds from `serve` start to ready (health, 1-token completion, MAX_SEQS burst) for the CPU batch plan."""
    from rig.plan import resolve
    from rig.serve import start
    from rig.server import free_port

    os.environ["RIG_STATE_DIR"] = str(state)
    try:
        plan = resolve("batch", (), "cpu", environ={}, sets={"PORT": str(free_port()),
                                                             "API_KEY_FILE": str(state / "key")})
        t0 = time.monotonic()
        server = start(plan, log_path=state / "serve.log")
        wall = time.monotonic() - t0
        server.stop()
        return wall
    finally:
        os.environ.pop("RIG_STATE_DIR", None)


def suite(clone: Path, env: dict[str, str]) -> tuple[int, float, int]:
    """The README's test command: (exit code, wall seconds, peak RSS of its whole process tree)."""
    return run_measured([sys.executable, "bootstrap.py", "test"], clone, env, paths.logs_dir() / "figures-suite.log")


def main(which: str = "install,serve,suite") -> None:
    parts = set(which.split(","))
    paths.state_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=paths.state_dir()) as tmp:
        work = Path(tmp)
        clone, env = paths.ROOT, dict(os.environ)
        if "install" in parts:
            wall, clone, env = install_time(work)
            print(f"fresh-clone install (empty venv, empty pip cache): {wall:.0f} s", flush=True)
        if "serve" in parts:
            state = work / "serve-state"
            print(f"serve-batch on CPU, time to ready, cold compile cache: {time_to_ready(state):.0f} s", flush=True)
            print(f"serve-batch on CPU, time to ready, warm compile cache: {time_to_ready(state):.0f} s", flush=True)
        if "suite" in parts:
            code, wall, peak = suite(clone, env)
            where = "the fresh clone" if clone != paths.ROOT else "this checkout"
            print(f"test suite (python3 bootstrap.py test, {where}): {wall / 60:.1f} min, exit {code}, "
                  f"peak RSS of the whole process tree {peak / 2**30:.1f} GiB", flush=True)
