"""sha256 manifests of checkpoints rig does not build: what `inv model.fetch` downloads and checks.

One TOML file per checkpoint in ``models/manifests/<name>.toml``, committed. ``<name>`` is the
checkpoint's folder name (``MODEL=.rig/models/<name>``, ``DRAFT_MODEL=...``), so a profile names its
checkpoint by folder and the manifest pins where that folder comes from: the Hugging Face repository
id **and** the commit, beside the size and sha256 of every file. Revision and hashes live in one file
because one is only true of the other: a new revision without new hashes cannot be written.

A manifest may know where a checkpoint lives before anyone has hashed a trusted copy of it (this
workplace cannot reach the hub): then it has no ``[[files]]``, fetch refuses it and serve's preflight
says that the folder is not verified. ``inv model.manifest DIR`` writes the hashes from a local copy.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rig import paths, tomlfile

KIND = "model-manifest"
# Folders a download tool keeps inside a checkout of a repository (huggingface_hub's local_dir metadata):
# never part of a checkpoint, never hashed. Every other file of a verified folder must be in its manifest.
IGNORED_DIRS = frozenset({".cache", ".git"})
HASH_CHUNK = 8 * 2**20


class ManifestError(ValueError):
    """A manifest that cannot be used as asked (unknown, malformed, without hashes); the message names it."""


class VerifyError(RuntimeError):
    """A checkpoint folder differs from its manifest; ``problems`` names every file that does."""

    def __init__(self, folder: Path, source: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{folder} does not match {source}: {'; '.join(problems)}")


class FileEntry(BaseModel):
    """One file of a checkpoint, as a trusted copy had it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="path inside the checkpoint folder, POSIX separators (as in the repository)")
    size: int = Field(ge=0, description="bytes")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the file's bytes, lowercase hex")

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        p = PurePosixPath(v)
        if not v or p.is_absolute() or ".." in p.parts or "\\" in v or str(p) != v:
            raise ValueError(f"{v!r}: must be a plain relative path inside the folder (no '..', no leading '/')")
        return v


class Manifest(BaseModel):
    """Where a checkpoint comes from and the bytes it must have."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["model-manifest"] = Field(description="file kind")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="the checkpoint's folder name")
    description: str = Field(min_length=1, description="one line: what this checkpoint is")
    repo: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$",
                             description="Hugging Face repository id (owner/name); absent when not known")
    revision: str | None = Field(default=None, pattern=r"^[0-9a-f]{40}$",
                                 description="the repository's commit (40 hex digits, never a branch)")
    notes: list[str] = Field(default_factory=list, description="what is known about it and where that comes from")
    files: list[FileEntry] = Field(default_factory=list, description="every file of the checkpoint")

    @model_validator(mode="after")
    def _unique(self) -> Manifest:
        seen = [f.path for f in self.files]
        dup = sorted({p for p in seen if seen.count(p) > 1})
        if dup:
            raise ValueError(f"files listed twice: {', '.join(dup)}")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def manifests_dir() -> Path:
    """The committed manifests (``RIG_MANIFESTS_DIR`` moves them, for tests that bring their own)."""
    return Path(os.environ.get("RIG_MANIFESTS_DIR", paths.ROOT / "models" / "manifests")).resolve()


def available() -> list[str]:
    """Names (file stems) of every committed manifest, sorted."""
    return sorted(p.stem for p in manifests_dir().glob("*.toml"))


def where(path: Path) -> str:
    """A manifest's path as users see it: relative to the checkout when inside it."""
    return tomlfile.shown(path)


def load(path: Path) -> Manifest:
    """Parse and validate one manifest file; ManifestError names the file and every bad key."""
    m = tomlfile.validate(Manifest, tomlfile.read(path, ManifestError, where(path)), ManifestError, where(path))
    if m.name != path.stem and path.resolve().parent == manifests_dir():
        raise ManifestError(f"{where(path)}: name = {m.name!r}, but a committed manifest is named by its file "
                            f"({path.stem!r})")
    return m


def find(name: str) -> tuple[Manifest, Path]:
    """The committed manifest of checkpoint ``name``; ManifestError lists the known ones."""
    path = manifests_dir() / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(available()) or "none"
        raise ManifestError(f"no manifest for {name!r} in {where(manifests_dir())}/ (known: {known}); "
                            f"write one with `inv model.manifest DIR` from a trusted copy")
    return load(path), path


def for_folder(folder: Path) -> tuple[Manifest, Path] | None:
    """The committed manifest named like ``folder`` (its last component), or None."""
    path = manifests_dir() / f"{folder.name}.toml"
    return (load(path), path) if path.is_file() else None


def require_hashes(m: Manifest, source: str) -> None:
    """Fetch and verify need a file list with hashes; without one, say how to make it."""
    if not m.files:
        raise ManifestError(f"no sha256 manifest for {m.name} ({source} lists no files): run "
                            f"`inv model.manifest` on a trusted copy (`inv model.manifest DIR "
                            f"--repo {m.repo or 'OWNER/NAME'} --revision {m.revision or 'COMMIT'}`)")


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in chunks (a checkpoint shard is gigabytes; hashlib releases the GIL)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def local_files(folder: Path) -> list[str]:
    """Every regular file under ``folder`` (POSIX relative paths, sorted), download-tool folders left out."""
    out = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if rel.parts[0] in IGNORED_DIRS or not p.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def file_problem(folder: Path, entry: FileEntry) -> str | None:
    """Why one file is not the manifest's (missing, other size, other sha256), or None when it is."""
    f = folder / entry.path
    if not f.is_file():
        return f"{entry.path}: missing"
    size = f.stat().st_size
    if size != entry.size:
        return f"{entry.path}: {size} bytes, the manifest has {entry.size}"
    got = sha256_file(f)
    if got != entry.sha256:
        return f"{entry.path}: sha256 {got[:16]}…, the manifest has {entry.sha256[:16]}…"
    return None


def problems(m: Manifest, folder: Path, workers: int | None = None) -> list[str]:
    """Every way ``folder`` differs from ``m``: files missing, resized, altered, and files it does not list
    (vLLM loads every *.safetensors of a folder without an index, so an extra file is not harmless)."""
    if not folder.is_dir():
        return [f"{folder}: no such folder"]
    workers = workers or min(len(m.files), os.cpu_count() or 1) or 1
    with ThreadPoolExecutor(workers) as pool:
        found = [p for p in pool.map(lambda e: file_problem(folder, e), m.files) if p]
    listed = {f.path for f in m.files}
    found += [f"{p}: not in the manifest" for p in local_files(folder) if p not in listed]
    return found


def verify(m: Manifest, folder: Path, source: str) -> str:
    """Check ``folder`` against ``m`` (every byte hashed); VerifyError names every differing file."""
    require_hashes(m, source)
    bad = problems(m, folder)
    if bad:
        raise VerifyError(folder, source, bad)
    return f"{folder}: {len(m.files)} files, {m.total_bytes:,} bytes match {source}"


def from_folder(folder: Path, name: str, description: str, repo: str | None, revision: str | None,
                notes: list[str]) -> Manifest:
    """A manifest of what ``folder`` holds now: run it on a trusted copy only."""
    if not folder.is_dir():
        raise ManifestError(f"{folder}: no such folder")
    names = local_files(folder)
    if not names:
        raise ManifestError(f"{folder}: no files to hash")
    with ThreadPoolExecutor(min(len(names), os.cpu_count() or 1)) as pool:
        hashes = list(pool.map(lambda n: sha256_file(folder / n), names))
    files = [{"path": n, "size": (folder / n).stat().st_size, "sha256": h} for n, h in zip(names, hashes, strict=True)]
    try:
        return Manifest(schema_version=1, kind=KIND, name=name, description=description, repo=repo or None,
                        revision=revision or None, notes=notes, files=files)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ManifestError(f"manifest of {folder}: {bad}") from None


def _toml_str(s: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's for the characters json.dumps escapes)."""
    import json

    return json.dumps(s, ensure_ascii=False)


def to_toml(m: Manifest) -> str:
    """The manifest as the TOML file ``load`` reads back to an equal Manifest."""
    lines = [f"# sha256 manifest of {m.name}: written by `inv model.manifest`; read by `inv model.fetch`,",
             "# `inv model.verify` and serve's preflight (rig/models/manifest.py).",
             "schema_version = 1", f'kind = "{KIND}"', f"name = {_toml_str(m.name)}",
             f"description = {_toml_str(m.description)}"]
    if m.repo:
        lines.append(f"repo = {_toml_str(m.repo)}")
    if m.revision:
        lines.append(f"revision = {_toml_str(m.revision)}")
    lines.append("notes = [" + "".join(f"\n  {_toml_str(n)}," for n in m.notes) + ("\n]" if m.notes else "]"))
    for f in m.files:
        lines += ["", "[[files]]", f"path = {_toml_str(f.path)}", f"size = {f.size}", f'sha256 = "{f.sha256}"']
    return "\n".join(lines) + "\n"


def write(m: Manifest, path: Path) -> Path:
    """Write ``m`` atomically (beside, fsync, rename) and check that it reads back equal."""
    from rig.atomic import write_atomic

    text = to_toml(m)
    if Manifest(**tomllib.loads(text)) != m:
        raise ManifestError(f"{where(path)}: the TOML written does not read back equal (a bug in to_toml)")
    write_atomic(path, text)
    return path



def write_from_folder(folder: Path, name: str, repo: str, revision: str, description: str,
                      out: Path | None) -> tuple[Path, Manifest]:
    """`inv model.manifest`: hash ``folder`` into ``out`` (default: the committed manifest of ``name``).

    What only a person knows (repository, commit, description, notes) is kept from an existing manifest
    unless given, so filling in the hashes of a manifest that had none changes nothing else.
    """
    name = name or folder.resolve().name
    path = out or manifests_dir() / f"{name}.toml"
    old = load(path) if path.is_file() else None
    m = from_folder(folder, name, description or (old.description if old else f"checkpoint {name}"),
                    repo or (old.repo if old else None), revision or (old.revision if old else None),
                    old.notes if old else [])
    return write(m, path), m
