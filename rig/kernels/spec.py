"""``kernels/<name>/kernel.toml``: what a kernel folder declares, validated before anything is built.

A kernel folder holds sources (CUDA files built by nvcc, Triton modules compiled ahead of time)
and says in its kernel.toml which of its files are build inputs: only those feed the build's
input hash, so a README or benchmark edit does not make a build stale, and a source edit does.
Loaders forbid unknown keys, so a typo is an error naming the file and the key, not a silently
ignored setting. Discovery is a sorted glob of ``kernels/*/kernel.toml``; the folder name is the
kernel's name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rig import paths, tomlfile

SPEC_FILE = "kernel.toml"
Arch = Literal["sm86", "sm90"]
"""Targets a kernel may declare: the users' RTX 3090 (sm86) and the H200 rig is tested on (sm90)."""
ARCHS: tuple[str, ...] = get_args(Arch)

_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class KernelSpecError(ValueError):
    """A kernel folder or its kernel.toml is missing or malformed; the message names file and key."""


def _relative_file(value: str) -> str:
    """A file name inside the kernel folder: relative, no '..', so the build can copy it to a temp dir."""
    p = Path(value)
    if p.is_absolute() or ".." in p.parts or not value:
        raise ValueError(f"{value!r} must be a path inside the kernel folder (relative, no '..')")
    return value


class CudaSource(BaseModel):
    """One CUDA file, compiled by nvcc to a fatbin for the kernel's archs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="the .cu file, relative to the kernel folder")
    headers: list[str] = Field(default_factory=list, description="files it includes (build inputs too)")
    entry_points: list[str] = Field(min_length=1, description="extern \"C\" __global__ functions it must define")

    @field_validator("source")
    @classmethod
    def _cu(cls, v: str) -> str:
        if not v.endswith(".cu"):
            raise ValueError(f"{v!r} must be a .cu file")
        return _relative_file(v)

    @field_validator("headers")
    @classmethod
    def _headers(cls, v: list[str]) -> list[str]:
        return [_relative_file(h) for h in v]

    @field_validator("entry_points")
    @classmethod
    def _symbols(cls, v: list[str]) -> list[str]:
        bad = [s for s in v if not _SYMBOL.match(s)]
        if bad:
            raise ValueError(f"{bad} are not C identifiers")
        return v


class TritonModule(BaseModel):
    """One Python module of Triton kernels whose ``aot_specs()`` lists what to compile ahead of time."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    module: str = Field(description="the .py file, relative to the kernel folder")
    depends: list[str] = Field(default_factory=list, description="sibling files it loads (build inputs too)")

    @field_validator("module")
    @classmethod
    def _py(cls, v: str) -> str:
        if not v.endswith(".py"):
            raise ValueError(f"{v!r} must be a .py file")
        return _relative_file(v)

    @field_validator("depends")
    @classmethod
    def _depends(cls, v: list[str]) -> list[str]:
        return [_relative_file(d) for d in v]


class KernelSpec(BaseModel):
    """The whole kernel.toml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["kernel"] = Field(description="always `kernel`")
    name: str = Field(description="the kernel's name: must equal its folder's name")
    description: str = Field(min_length=1, description="one line: what the kernel does")
    archs: list[Arch] = Field(min_length=1, description="GPU targets it is built for")
    cuda: list[CudaSource] = Field(default_factory=list, description="CUDA sources built by nvcc")
    triton: list[TritonModule] = Field(default_factory=list, description="Triton modules compiled ahead of time")

    @model_validator(mode="after")
    def _something_to_build(self) -> KernelSpec:
        if not self.cuda and not self.triton:
            raise ValueError("declares neither [[cuda]] nor [[triton]]: nothing to build")
        if len(set(self.archs)) != len(self.archs):
            raise ValueError(f"archs {self.archs} lists an arch twice")
        return self

    def inputs(self) -> list[str]:
        """Every file the build reads, kernel.toml first, each once (the input hash covers exactly these)."""
        files = [SPEC_FILE]
        for c in self.cuda:
            files += [c.source, *c.headers]
        for t in self.triton:
            files += [t.module, *t.depends]
        return list(dict.fromkeys(files))

    def cuda_inputs(self) -> list[str]:
        """kernel.toml and the CUDA part's files."""
        return list(dict.fromkeys([SPEC_FILE, *(f for c in self.cuda for f in (c.source, *c.headers))]))

    def triton_inputs(self) -> list[str]:
        """kernel.toml and the Triton part's files."""
        return list(dict.fromkeys([SPEC_FILE, *(f for t in self.triton for f in (t.module, *t.depends))]))


def load(folder: Path) -> KernelSpec:
    """Read and validate ``folder/kernel.toml``; every declared file must exist in the folder."""
    path = folder / SPEC_FILE
    shown = tomlfile.shown(path)
    if not path.is_file():
        raise KernelSpecError(f"{shown}: no such file (a kernel folder declares itself in {SPEC_FILE})")
    spec = tomlfile.validate(KernelSpec, tomlfile.read(path, KernelSpecError, shown), KernelSpecError, shown)
    if spec.name != folder.name:
        raise KernelSpecError(f"{shown}: name: {spec.name!r} must equal the folder's name {folder.name!r}")
    missing = [f for f in spec.inputs() if not (folder / f).is_file()]
    if missing:
        raise KernelSpecError(f"{shown}: declares {', '.join(missing)}, which the folder does not have")
    return spec


def folder_of(name: str, root: Path | None = None) -> Path:
    """The folder of kernel ``name`` under ``root`` (default: the checkout's kernels/)."""
    return (root or paths.KERNELS) / name


def available(root: Path | None = None) -> list[str]:
    """Names of every kernel folder that has a kernel.toml, sorted."""
    root = root or paths.KERNELS
    return sorted(p.parent.name for p in root.glob(f"*/{SPEC_FILE}"))


def load_named(name: str, root: Path | None = None) -> KernelSpec:
    """The spec of kernel ``name``; an unknown name is an error listing the known ones."""
    folder = folder_of(name, root)
    if not (folder / SPEC_FILE).is_file():
        known = ", ".join(available(root)) or "none"
        raise KernelSpecError(f"unknown kernel {name!r}: {tomlfile.shown(folder / SPEC_FILE)} does not exist "
                              f"(kernels in this checkout: {known})")
    return load(folder)


def buildable(name: str, arch: str, root: Path | None = None) -> bool:
    """True when kernel ``name`` exists here with a valid kernel.toml that declares ``arch``."""
    try:
        return arch in load_named(name, root).archs
    except KernelSpecError:
        return False
