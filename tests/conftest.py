"""Shared fixtures: a real `vllm serve` (CPU backend, tiny hybrid model) for the whole session.

The server runs in its own process group and is stopped — with every process it forked — at the
end of the session, when a test fails, on Ctrl-C (pytest tears fixtures down on
KeyboardInterrupt) and on SIGTERM (turned into KeyboardInterrupt below).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rig import paths
from rig.plan import Plan, resolve
from rig.server import VllmServer, free_port


def _sigterm(signum, frame):
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _sigterm)


def cpu_plan(profile: str, tmp: Path, **sets: str) -> Plan:
    """A plan of `profile` on the cpu platform, on a free port, with a key file under ``tmp``."""
    base = {"PORT": str(free_port()), "API_KEY_FILE": str(tmp / "api_key")}
    return resolve(profile, platform="cpu", environ={}, sets={**base, **sets})


def gpu_script_refuses(script: Path, bad: list[str], says: str) -> None:
    """A GPU bench script's two refusals on any host: ``bad`` arguments exit 2 with ``says`` on stderr (before any
    device work); on a host without CUDA a plain run says so and exits 2 (skipped where CUDA is present)."""
    import torch

    r = subprocess.run([sys.executable, str(script), *bad], capture_output=True, text=True)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the no-CUDA refusal is not reachable here")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert r.returncode == 2 and "no CUDA device" in r.stderr, r.stderr


def interpreter_child(test_file: str, flag: str) -> tuple[int, str, str]:
    """Run ``test_file``'s non-gpu cases in a child pytest under Triton's interpreter, with ``flag``=1 telling the
    file it is the child: (exit code, stdout, the last 6,000 characters of its output for a failure message).

    Triton decorates its own library when it is imported, in the mode TRITON_INTERPRET says then, so one
    process cannot hold interpreted and compiled kernels (and in a full run vLLM may import triton first).
    """
    env = {**os.environ, "TRITON_INTERPRET": "1", flag: "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-o", "addopts=", "-q",
                           "-rfEs", "-p", "no:cacheprovider", "-m", "not gpu"], cwd=paths.ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout, (proc.stdout + proc.stderr)[-6000:]


def start_server(plan: Plan, log_dir: Path) -> VllmServer:
    """Start a plan's server the way `serve` does (preflight, readiness burst) and return it."""
    from rig.serve import start

    return start(plan, log_path=log_dir / f"vllm-{plan.profile}-{plan.knobs['PORT']}.log")


def _run_task(argv: list[str]) -> int:
    """Run `inv <argv>` in this process through invoke's own Program (as a user's shell would); its exit code."""
    import sys

    from invoke import Program

    sys.path.insert(0, str(paths.ROOT))
    import tasks

    try:
        Program(namespace=tasks.ns).run(["inv", *argv], exit=True)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.fixture(scope="session")
def inv():
    """``inv("verify", "--no-live")`` -> exit code: the CLI in-process, output captured by pytest's capsys."""
    return lambda *argv: _run_task(list(argv))


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rig")


@pytest.fixture(scope="session")
def batch_server(session_tmp: Path) -> Iterator[VllmServer]:
    """The batch profile on CPU with the tiny hybrid model: what `serve-batch` runs on a CPU host."""
    server = start_server(cpu_plan("batch", session_tmp), session_tmp)
    try:
        yield server
    finally:
        pids = server.pids()
        server.stop()
        leftover = [p for p in pids if _alive(p)]
        assert not leftover, f"processes survived the server's stop: {leftover}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny hybrid model folder (built once, deterministic)."""
    from rig.models.tiny import default_hybrid

    return default_hybrid()


@pytest.fixture(scope="session", autouse=True)
def _project_caches() -> None:
    """Keep every cache of the code under test inside the project, as the servers do."""
    os.environ.update(paths.cache_env())


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one CPU thread for the test, the setting restored after: the KVarN tests' CPU math (and the
    Triton interpreter's, numpy underneath) would otherwise take every core of a host that a CI run shares."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
