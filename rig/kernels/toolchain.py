"""The compilers a kernel build uses, pinned: nvcc (CUDA 13.0, from pixi.toml) and Triton's ahead-of-time compiler.

Everything that can change a build's bytes is decided here and recorded in its manifest: which
nvcc (found, then checked against the pin), its exact flags, and the Triton version with its
compile settings. The flags are chosen for reproducible output: no debug or line information
(nvcc's ``-G``/``-lineinfo``, Triton's line info both embed the source's absolute path), no
fatbin compression (the entry-point check reads the ELF names), and nvcc's
``NVCC_PREPEND_FLAGS``/``NVCC_APPEND_FLAGS`` are cleared so the environment cannot add flags the
manifest does not show.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from rig import paths

NVCC_FALLBACKS = (Path("/usr/local/cuda/bin/nvcc"),)
"""Where nvcc is looked for when it is not on PATH (CUDA's default install prefix)."""

NVCC_BASE_FLAGS = ("-fatbin", "-O3", "-std=c++17", "--no-compress")
"""Every nvcc call's flags but the per-arch -gencode ones (order kept: it is part of the input hash)."""

NVCC_ENV_DROPPED = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")
"""Environment variables nvcc reads that would change a build without changing its recorded flags."""

TRITON_SETTINGS = ("line_info=off", "enable_fp_fusion=default-on")
"""How the Triton part is compiled, recorded in the manifest (see ``rig.kernels.build.compile_triton``)."""


class ToolchainError(RuntimeError):
    """A compiler is missing or is not the pinned one; the message names it and what to do."""


def pinned_cuda() -> str:
    """The CUDA release nvcc must be (major.minor), read from pixi.toml's ``cuda-nvcc`` pin: its one place."""
    doc = tomllib.loads(paths.PIXI_TOML.read_text())
    spec = doc.get("feature", {}).get("gpu", {}).get("dependencies", {}).get("cuda-nvcc")
    m = re.fullmatch(r"(\d+\.\d+)\.\*", spec or "")
    if not m:
        raise ToolchainError(f"pixi.toml: feature.gpu.dependencies.cuda-nvcc = {spec!r}: expected 'MAJOR.MINOR.*'")
    return m.group(1)


def find_nvcc() -> Path | None:
    """nvcc on PATH, else under $CUDA_HOME/bin, else in CUDA's default prefix; None when there is none."""
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    candidates = [Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"] if os.environ.get("CUDA_HOME") else []
    for path in [*candidates, *NVCC_FALLBACKS]:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def nvcc_env() -> dict[str, str]:
    """The environment nvcc runs in: this one without the variables that inject flags."""
    return {k: v for k, v in os.environ.items() if k not in NVCC_ENV_DROPPED}


def nvcc_version(nvcc: Path) -> str:
    """nvcc's full version (``13.0.88``) from ``nvcc --version``."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60,
                             env=nvcc_env()).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"{nvcc} --version failed: {e}") from None
    m = re.search(r"release \d+\.\d+, V(\d+\.\d+\.\d+)", out)
    if not m:
        raise ToolchainError(f"{nvcc} --version printed no 'release X.Y, VX.Y.Z' line:\n{out.strip()}")
    return m.group(1)


def check_nvcc_pin(version: str, where: str) -> None:
    """Refuse an nvcc whose major.minor is not the pinned release, naming it."""
    pin = pinned_cuda()
    if ".".join(version.split(".")[:2]) != pin:
        raise ToolchainError(f"{where} is nvcc {version}; rig builds kernels with nvcc {pin} only (pixi.toml's "
                             f"cuda-nvcc pin): put CUDA {pin}'s nvcc first on PATH (`pixi run` does)")


def pinned_nvcc() -> tuple[Path, str]:
    """(path, version) of the pinned nvcc; ToolchainError when it is missing or another release."""
    nvcc = find_nvcc()
    if nvcc is None:
        where = ", ".join(str(p) for p in NVCC_FALLBACKS)
        raise ToolchainError(f"nvcc not found (not on PATH, not in $CUDA_HOME/bin, not at {where}); install CUDA "
                             f"{pinned_cuda()}'s nvcc (the gpu environment of pixi.toml has it)")
    version = nvcc_version(nvcc)
    check_nvcc_pin(version, str(nvcc))
    return nvcc, version


def gencode(arch: str, ptx: bool) -> str:
    """nvcc's -gencode for one arch: its SASS, plus its PTX when ``ptx`` (for GPUs newer than every arch built)."""
    cc = arch.removeprefix("sm")
    code = f"[sm_{cc},compute_{cc}]" if ptx else f"sm_{cc}"
    return f"-gencode=arch=compute_{cc},code={code}"


def nvcc_flags(archs: list[str]) -> list[str]:
    """The full, ordered flag list for a fatbin of ``archs``: SASS for each, PTX of the newest."""
    ordered = sorted(archs, key=lambda a: int(a.removeprefix("sm")))
    return [*NVCC_BASE_FLAGS, *(gencode(a, ptx=a == ordered[-1]) for a in ordered)]


def triton_version() -> str | None:
    """The installed Triton's version, or None (read from its metadata: importing Triton takes seconds)."""
    try:
        return md.version("triton")
    except md.PackageNotFoundError:
        return None
