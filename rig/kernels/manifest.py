"""A kernel build's manifest (``.rig/kernels/<name>/manifest.json``) and the checks made against it.

The manifest records, per part of the build (``cuda``: nvcc's fatbin; ``triton``: the cubins
compiled ahead of time), its inputs — the sha256 of each declared source file, the exact flags,
the compiler versions — their combined input hash, and each artefact's sha256, size and archs.
It holds no timestamp and no absolute path, so two builds from the same inputs write the same
manifest, byte for byte.

``problems`` is what serve's preflight (and verify, and the fingerprint) ask: is the build there,
fresh (its input hash equals the one the current sources, flags and toolchain give), built for
the plan's arch, and are its artefacts the bytes it recorded?
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rig.kernels import spec as kspec
from rig.kernels import toolchain

MANIFEST = "manifest.json"
Part = Literal["cuda", "triton"]


class Artefact(BaseModel):
    """One file the build wrote."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="relative to the kernel's build folder")
    sha256: str = Field(description="sha256 of its bytes")
    size_bytes: int = Field(ge=0, description="its size")
    archs: list[str] = Field(description="GPU archs it has code for")
    source: str = Field(description="the kernel-folder file it was built from")
    meta: dict[str, int | str] = Field(default_factory=dict,
                                       description="Triton: kernel name, shared_bytes, num_warps, num_stages")


class PartBuild(BaseModel):
    """What one part of the build was made from and what it made."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    part: Part = Field(description="cuda (nvcc) or triton (ahead-of-time cubins)")
    built: bool = Field(description="false when this environment could not build it (see why_not)")
    why_not: str | None = Field(default=None, description="why the part was not built")
    archs: list[str] = Field(description="archs the part was built for")
    sources: dict[str, str] = Field(description="sha256 of each input file, by its name in the kernel folder")
    flags: list[str] = Field(description="nvcc flags, or the Triton compile settings")
    toolchain: dict[str, str] = Field(description="compiler versions: nvcc, or triton")
    input_sha256: str = Field(description="sha256 over part, archs, sources, flags and toolchain")
    artefacts: list[Artefact] = Field(default_factory=list, description="files written")


class Manifest(BaseModel):
    """The whole build of one kernel."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    kernel: str = Field(description="the kernel's name (its folder under kernels/)")
    archs: list[str] = Field(description="archs requested for this build")
    input_sha256: str = Field(description="sha256 over the parts' input hashes")
    parts: list[PartBuild] = Field(description="one entry per part the kernel.toml declares")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=2, sort_keys=True) + "\n"

    def part(self, name: Part) -> PartBuild | None:
        return next((p for p in self.parts if p.part == name), None)


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_hashes(folder: Path, files: list[str]) -> dict[str, str]:
    """sha256 of each named file of a kernel folder."""
    return {f: sha256_file(folder / f) for f in files}


def input_hash(part: str, archs: list[str], sources: dict[str, str], flags: list[str],
               toolchain_versions: dict[str, str]) -> str:
    """The input hash of one part: everything that can change its bytes, canonically serialised."""
    doc = {"part": part, "archs": sorted(archs), "sources": sources, "flags": flags, "toolchain": toolchain_versions}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def combined_hash(parts: list[PartBuild]) -> str:
    """The build's input hash: over each part's, in part order."""
    return hashlib.sha256("".join(f"{p.part}:{p.input_sha256}\n" for p in parts).encode()).hexdigest()


def read(build_folder: Path) -> Manifest:
    """The manifest of a build folder; FileNotFoundError when absent, ValueError when malformed."""
    path = build_folder / MANIFEST
    text = path.read_text()
    try:
        return Manifest.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"{path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def flags_now(part: Part, archs: list[str]) -> list[str]:
    """The flags a build of this part for these archs would use today."""
    return toolchain.nvcc_flags(archs) if part == "cuda" else list(toolchain.TRITON_SETTINGS)


def inputs_of(spec: kspec.KernelSpec, part: Part) -> list[str]:
    """The kernel-folder files one part reads."""
    return spec.cuda_inputs() if part == "cuda" else spec.triton_inputs()


def parts_of(spec: kspec.KernelSpec) -> list[Part]:
    """The parts a kernel.toml declares, in build order."""
    return [p for p, present in (("cuda", spec.cuda), ("triton", spec.triton)) if present]


def _toolchain_problems(pb: PartBuild) -> tuple[list[str], dict[str, str]]:
    """(problems, the toolchain a build here would record) for a built part.

    nvcc: the recorded release must be the pinned one; when an nvcc is on this host its version is
    what a build would use (a host without nvcc — a GPU host that runs a build made elsewhere —
    keeps the recorded one). Triton: the installed version must be the recorded one, since the
    server runs the Triton kernels through this Triton.
    """
    if pb.part == "cuda":
        recorded = pb.toolchain.get("nvcc", "?")
        try:
            toolchain.check_nvcc_pin(recorded, "the build's compiler")
        except toolchain.ToolchainError as e:
            return [str(e)], pb.toolchain
        nvcc = toolchain.find_nvcc()
        if nvcc is None:
            return [], pb.toolchain
        try:
            return [], {"nvcc": toolchain.nvcc_version(nvcc)}
        except toolchain.ToolchainError:
            return [], pb.toolchain
    installed = toolchain.triton_version()
    if installed is None:
        return ["triton is not installed in this environment: the Triton kernels cannot run"], pb.toolchain
    return [], {"triton": installed}


def part_problems(spec: kspec.KernelSpec, folder: Path, build_folder: Path, pb: PartBuild, arch: str) -> list[str]:
    """Everything wrong with one built part for ``arch``: stale inputs, wrong arch, missing or altered artefacts."""
    label = "CUDA" if pb.part == "cuda" else "Triton"
    if not pb.built:
        return [f"the {label} part was not built ({pb.why_not})"]
    out = []
    current = source_hashes(folder, inputs_of(spec, pb.part))
    changed = sorted(f for f in set(current) | set(pb.sources) if current.get(f) != pb.sources.get(f))
    if changed:
        out.append(f"stale: {', '.join(changed)} changed since the build")
    flags = flags_now(pb.part, pb.archs)
    if flags != pb.flags:
        out.append(f"stale: the {label} build flags changed ({' '.join(pb.flags)} -> {' '.join(flags)})")
    tool_problems, versions = _toolchain_problems(pb)
    out += tool_problems
    if versions != pb.toolchain:
        out.append(f"stale: built with {_versions(pb.toolchain)}, this environment has {_versions(versions)}")
    if not out and input_hash(pb.part, pb.archs, current, flags, versions) != pb.input_sha256:
        out.append(f"stale: the {label} part's input hash does not match its recorded inputs")
    if arch not in pb.archs:
        out.append(f"the {label} part is built for {', '.join(pb.archs)}, not {arch}")
    out += artefact_problems(build_folder, pb)
    return out


def _versions(v: dict[str, str]) -> str:
    return ", ".join(f"{k} {val}" for k, val in sorted(v.items())) or "nothing"


def artefact_problems(build_folder: Path, pb: PartBuild) -> list[str]:
    """Artefacts missing, or whose bytes are not the recorded ones (altered after the build)."""
    out = []
    for a in pb.artefacts:
        path = build_folder / a.path
        if not path.is_file():
            out.append(f"{a.path} is missing")
        elif path.stat().st_size != a.size_bytes or sha256_file(path) != a.sha256:
            out.append(f"{a.path} differs from the build's record (sha256 {a.sha256[:12]}…): altered after the build")
    return out


def problems(name: str, arch: str, kernels_root: Path | None = None, build_root: Path | None = None) -> list[str]:
    """Why kernel ``name`` cannot be used for ``arch`` as built; empty when it can."""
    from rig.kernels import build_folder

    try:
        spec = kspec.load_named(name, kernels_root)
    except kspec.KernelSpecError as e:
        return [str(e)]
    if arch not in spec.archs:
        return [f"{kspec.SPEC_FILE} declares archs {', '.join(spec.archs)}: {arch} is not one of them"]
    out_dir = build_folder(name, build_root)
    try:
        m = read(out_dir)
    except FileNotFoundError:
        return [f"not built (no {out_dir / MANIFEST})"]
    except ValueError as e:
        return [f"its manifest is unreadable: {e}"]
    if m.kernel != name:
        return [f"{out_dir / MANIFEST} is the manifest of {m.kernel!r}, not {name!r}"]
    out = []
    folder = kspec.folder_of(name, kernels_root)
    for part in parts_of(spec):
        pb = m.part(part)
        out += [f"the {part} part is not in the build"] if pb is None else part_problems(spec, folder, out_dir, pb,
                                                                                         arch)
    if not out and combined_hash(m.parts) != m.input_sha256:
        out.append("stale: the manifest's input hash does not match its parts")
    return out


def artefact_hashes(name: str, build_root: Path | None = None) -> dict[str, str] | str | None:
    """The fingerprint's view of one build: {artefact path: sha256} plus the input hash; None when not built,
    a one-line error when the manifest is unreadable."""
    from rig.kernels import build_folder

    try:
        m = read(build_folder(name, build_root))
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as e:
        return f"unreadable: {str(e).splitlines()[0]}"
    out = {"input_sha256": m.input_sha256}
    for pb in m.parts:
        out.update({a.path: a.sha256 for a in pb.artefacts})
    return out
