"""The server that is already running: `serve` records it, `bench`/`quality`/`verify --running` find it.

A 24 GB card holds one 27B server, so measuring "the server that is up" must not start another.
`serve` writes one record per port under ``<state>/servers/`` once the server is ready (atomic
write) and removes it on stop. A record of a process that is gone — `kill -9` of serve leaves one —
is recognised by its pid *and* that process's start time (a reused pid has another start time),
reported in one line and removed, never trusted.

While a measurement runs, :meth:`Record.check` says whether the server is still the one recorded:
same pid, same start time, and /health answering. A restart or a death makes the run invalid.

A server rig did not start (``--url``) has no record: :func:`describe_foreign` asks it what it is
(/v1/models, /version, /metrics' cache config) so a result can say what it measured, marked as
foreign.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from pydantic import BaseModel, ConfigDict, Field

from rig import paths


class RunningError(RuntimeError):
    """No usable running server (none recorded, several, or a refused one); the message says what to do."""


class Record(BaseModel):
    """<state>/servers/<port>.json: what `serve` started, enough to measure it and to know it is still it."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = Field(1, description="format version of this file")
    kind: str = Field("rig-running-server", description="what this file is")
    plan: dict[str, Any] = Field(description="the resolved plan the server was started from (Plan.model_dump)")
    plan_digest: str = Field(description="Plan.digest of that plan")
    fingerprint: dict[str, Any] = Field(description="rig.fingerprint.collect(plan) at start")
    url: str = Field(description="base URL the server answers on")
    served_name: str = Field(description="--served-model-name")
    api_key_file: str = Field(description="absolute path of the API key file (the key itself is never recorded)")
    pid: int = Field(description="pid of the `vllm serve` process")
    start_time: float = Field(description="that process's start time (psutil create_time, seconds since the epoch)")
    serve_pid: int = Field(description="pid of the `rig serve` process that owns it")
    log_path: str | None = Field(None, description="the server's log")
    recorded_utc: str = Field(description="when the record was written (ISO 8601)")

    def plan_obj(self) -> Any:
        from rig.plan import Plan

        return Plan.model_validate(self.plan)

    def key(self) -> str:
        path = Path(self.api_key_file)
        try:
            return path.read_text().strip()
        except OSError as e:
            raise RunningError(f"the running server's API key file {path} cannot be read ({e.strerror}); "
                               "run as the user who started `serve`") from None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key()}"}

    def same_process(self) -> bool:
        """The recorded pid exists and is the process that was recorded (not a reused pid)."""
        return start_time_of(self.pid) == self.start_time

    def check(self, timeout: float = 5.0) -> str | None:
        """None while the recorded server is up and answering; else why it is not (died, restarted, silent)."""
        if not self.same_process():
            now = start_time_of(self.pid)
            return (f"the server (pid {self.pid}) is gone" if now is None else
                    f"pid {self.pid} now belongs to a process started at {_utc(now)}, not the recorded server "
                    f"(started {_utc(self.start_time)}): it restarted")
        try:
            r = httpx.get(f"{self.url}/health", timeout=timeout)
        except httpx.HTTPError as e:
            return f"the server at {self.url} stopped answering /health ({type(e).__name__})"
        return None if r.status_code == 200 else f"the server at {self.url} answers /health with HTTP {r.status_code}"


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def start_time_of(pid: int) -> float | None:
    """A live, non-zombie process's start time, or None."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def records_dir() -> Path:
    return paths.state_dir() / "servers"


def record_path(port: int) -> Path:
    return records_dir() / f"{port}.json"


def write(plan: Any, server: Any) -> Path:
    """Record a ready server started by this process (atomically: a reader never sees half a record)."""
    from rig import fingerprint
    from rig.atomic import write_atomic

    key_file = Path(plan.api_key_file)
    key_file = key_file if key_file.is_absolute() else paths.ROOT / key_file
    start = start_time_of(server.proc.pid)
    if start is None:
        raise RunningError(f"the server (pid {server.proc.pid}) exited before it could be recorded")
    rec = Record(plan=plan.model_dump(), plan_digest=plan.digest, fingerprint=fingerprint.collect(plan),
                 url=server.url, served_name=plan.served_name, api_key_file=str(key_file.resolve()),
                 pid=server.proc.pid, start_time=start, serve_pid=os.getpid(),
                 log_path=str(server.log_path) if server.log_path else None,
                 recorded_utc=datetime.now(UTC).isoformat(timespec="seconds"))
    path = record_path(plan.knobs["PORT"])
    write_atomic(path, rec.model_dump_json(indent=2) + "\n")
    return path


def remove(path: Path, pid: int | None = None) -> None:
    """Remove a record (serve's stop); with pid, only when the record is still that server's."""
    try:
        if pid is None or json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def _warn(msg: str) -> None:
    print(f"rig: {msg}", file=sys.stderr, flush=True)


def live(warn: Callable[[str], None] = _warn) -> list[tuple[Path, Record]]:
    """Every record whose process still runs; stale ones (dead or reused pid) are named, removed, ignored."""
    out = []
    for path in sorted(records_dir().glob("*.json")):
        try:
            rec = Record.model_validate_json(path.read_text())
        except (OSError, ValueError) as e:
            warn(f"ignoring the unreadable server record {path} ({str(e).splitlines()[0]}); delete it")
            continue
        if not rec.same_process():
            warn(f"ignoring a stale server record {path}: pid {rec.pid} (started {_utc(rec.start_time)}) is no "
                 f"longer running — its `serve` was killed before it could remove the record; removed it")
            remove(path, rec.pid)
            continue
        out.append((path, rec))
    return out


def find(warn: Callable[[str], None] = _warn) -> Record:
    """The one running server `serve` recorded; RunningError when there is none, or more than one."""
    found = live(warn)
    if not found:
        raise RunningError(f"--running: no running server is recorded in {records_dir()}; start one with "
                           "`inv serve` (pixi run serve-batch) or give a server rig did not start with --url URL "
                           "[--key-file FILE]")
    if len(found) > 1:
        urls = ", ".join(r.url for _, r in found)
        raise RunningError(f"--running: {len(found)} servers are recorded ({urls}); pick one with --url URL")
    return found[0][1]


def describe_foreign(url: str, key: str | None) -> dict[str, Any]:
    """What a server rig did not start says about itself: /v1/models, /version, /metrics' cache config."""
    from rig.quality.requirements import cache_config

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out: dict[str, Any] = {"started_by": "external", "url": url,
                           "note": "a server rig did not start: its plan and fingerprint are unknown; "
                                   "this is what it says about itself"}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=30) as c:
        for name, path in (("models", "/v1/models"), ("version", "/version"), ("metrics", "/metrics")):
            try:
                r = c.get(path)
            except httpx.HTTPError as e:
                raise RunningError(f"--url {url}: {path} does not answer ({type(e).__name__}: {e}); is the server "
                                   "up, and the URL its base (http://host:port)?") from None
            if r.status_code != 200:
                raise RunningError(f"--url {url}: {path} answered HTTP {r.status_code}"
                                   + ("; pass its API key with --key-file FILE" if r.status_code == 401 else ""))
            if name == "models":
                out["models"] = [{k: m.get(k) for k in ("id", "root", "max_model_len")} for m in r.json()["data"]]
            elif name == "version":
                out["version"] = r.json().get("version")
            else:
                out["cache_config"] = cache_config(r.text)
    return out
