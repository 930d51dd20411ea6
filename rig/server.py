"""Run ``vllm serve`` as a child process tree we fully own: start, wait until ready, stop.

vLLM forks an engine core and workers; a plain ``terminate()`` of the API server can leave them
running and holding memory. The child therefore gets its own process group (session), and
stopping signals the whole group, waits, then kills whatever is left — including any
descendant that moved to another group, found through psutil before the signal is sent.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil


class ServerError(RuntimeError):
    """The server died or never became ready; carries the relevant tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def log_tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log that say what went wrong (errors first, then the plain tail)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keys = ("Error", "error:", "Traceback", "raise ", "ValueError", "RuntimeError", "CUDA out of memory")
    relevant = [ln for ln in text if any(k in ln for k in keys)]
    picked = relevant[-lines // 2:] + ["..."] + text[-lines // 2:] if relevant else text[-lines:]
    return "\n".join(picked)


@dataclass
class VllmServer:
    """One ``vllm serve`` child. Use as a context manager, or call start()/stop()."""

    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    served_name: str | None = None
    echo: bool = False
    # a session of its own instead of the caller's: how rig used to start servers; only
    # bench/scripts/host_stalls.py sets it, to show the stalls that caused (see start())
    own_session: bool = False
    proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            list(self.argv),
            env={**os.environ, **self.env},
            stdout=subprocess.PIPE if self.echo else log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # its own process group (stop() signals the whole tree) but the caller's session: with
            # the kernel's autogroup scheduling (one CPU group per session, on by default) a server
            # in a session of its own starved the caller's processes for seconds at a time on a
            # small host (docs/development.md, "Host stalls"; bench/scripts/host_stalls.py)
            **({"start_new_session": True} if self.own_session else {"process_group": 0}),
        )
        if self.echo:
            self._tee(log)

    def _tee(self, log) -> None:
        """Copy the child's output to the log file and the console (serve's foreground mode)."""
        import sys
        import threading

        def pump() -> None:
            assert self.proc and self.proc.stdout
            for chunk in iter(self.proc.stdout.readline, b""):
                log.write(chunk)
                log.flush()
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()

        threading.Thread(target=pump, daemon=True).start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 600.0, probe: bool = True) -> None:
        """Until /health answers and (with probe) a 1-token completion succeeds."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=10.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise ServerError(f"vllm serve exited with code {self.proc.returncode} during start:\n"
                                      f"{log_tail(self.log_path)}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
            else:
                raise ServerError(f"vllm serve not healthy after {timeout:.0f} s:\n{log_tail(self.log_path)}")
            if probe:
                self.complete_one(client)

    def complete_one(self, client: httpx.Client) -> dict:
        """A 1-token greedy completion; raises ServerError with the log tail when it fails."""
        body = {"model": self.served_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        try:
            r = client.post(f"{self.url}/v1/completions", json=body, headers=self.headers(), timeout=120.0)
            r.raise_for_status()
            return r.json()
        except httpx.HTTPError as e:
            raise ServerError(f"first completion failed ({e}):\n{log_tail(self.log_path)}") from e

    def _tree(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the group, wait ``grace`` seconds, SIGKILL every survivor. Idempotent."""
        if self.proc is None:
            return
        tree = self._tree()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        for p in tree:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(tree, timeout=grace)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def pids(self) -> list[int]:
        return [p.pid for p in self._tree()]

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
