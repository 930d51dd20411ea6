"""Profiles and overlays: declarative TOML files under profiles/, discovered by a sorted glob.

A profile may ``extends`` another (local keys win; cycles are an error). Overlays are small
knob sets applied on top, in order. Loaders forbid unknown keys, so a typo in a file is an
error that names the file and the key, not a silently ignored setting.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rig import paths

SCHEMA_VERSION = 1


class ProfileError(ValueError):
    """A profile or overlay file is missing, unknown or malformed."""


class ProfileAdjust(BaseModel):
    """Knobs an overlay sets for one profile only."""

    model_config = ConfigDict(extra="forbid")
    knobs: dict[str, Any] = Field(default_factory=dict, description="knob values for this profile only")


class ProfileFile(BaseModel):
    """One file of profiles/ (kind = profile) or profiles/overlays/ (kind = overlay)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["profile", "overlay"] = Field(description="profile (a whole configuration) or overlay")
    description: str = Field(description="one line: what this is for")
    extends: str | None = Field(default=None, description="profile this one builds on (local keys win)")
    speculative: bool = Field(default=True, description="false = SPEC is ignored here, with a warning")
    platform: Literal["cpu", "gpu"] | None = Field(default=None, description="platform overlay: which platform")
    knobs: dict[str, Any] = Field(default_factory=dict, description="knob values (names: rig/knobs.py)")
    serve: dict[str, Any] = Field(default_factory=dict, description="always-on `vllm serve` options")
    env: dict[str, str] = Field(default_factory=dict, description="environment variables for the server")
    profiles: dict[str, ProfileAdjust] = Field(default_factory=dict, description="per-profile knob adjustments")


def _folder(kind: str) -> Path:
    return paths.PROFILES if kind == "profile" else paths.PROFILES / "overlays"


def available(kind: str = "profile") -> list[str]:
    """Names (file stems) of every profile or overlay, sorted."""
    return sorted(p.stem for p in _folder(kind).glob("*.toml"))


def load_file(name: str, kind: str = "profile") -> ProfileFile:
    path = _folder(kind) / f"{name}.toml"
    if not path.is_file():
        raise ProfileError(f"unknown {kind} {name!r}: available {kind}s are {', '.join(available(kind))}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path.relative_to(paths.PROFILES.parent)}: not valid TOML: {e}") from None
    try:
        pf = ProfileFile(**data)
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ProfileError(f"{path.relative_to(paths.PROFILES.parent)}: {where}") from None
    if pf.kind != kind:
        raise ProfileError(f"{path.relative_to(paths.PROFILES.parent)}: kind = {pf.kind!r}, expected {kind!r}")
    _known_knobs(pf, path)
    return pf


def _known_knobs(pf: ProfileFile, path: Path) -> None:
    """A knob name no Knobs field has is a typo: name the file and line, not just the knob."""
    from rig.knobs import Knobs

    tables = [("knobs", pf.knobs), *((f"profiles.{p}.knobs", a.knobs) for p, a in pf.profiles.items())]
    for table, knobs in tables:
        for name in knobs:
            if name not in Knobs.model_fields:
                where = f"{path.relative_to(paths.PROFILES.parent)}:{_line_of(path, name)}"
                raise ProfileError(f"{where}: unknown knob {name} in [{table}]; known knobs are "
                                   f"{', '.join(Knobs.model_fields)}")


def _line_of(path: Path, key: str) -> int:
    """The first line that assigns ``key`` (1-based; 0 when it cannot be found, e.g. an inline table)."""
    pattern = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if pattern.match(line):
            return n
    return 0


def chain(name: str) -> list[str]:
    """The extends chain from the root to ``name`` (cycle -> ProfileError)."""
    seen: list[str] = []
    cur: str | None = name
    while cur is not None:
        if cur in seen:
            raise ProfileError(f"profile {name!r}: extends cycle {' -> '.join([*seen, cur])}")
        seen.append(cur)
        cur = load_file(cur).extends
    return list(reversed(seen))


def merged(name: str) -> ProfileFile:
    """A profile with its whole extends chain folded in (later files win, key by key)."""
    out: dict[str, Any] = {"knobs": {}, "serve": {}, "env": {}}
    pf = None
    for link in chain(name):
        pf = load_file(link)
        for table in ("knobs", "serve", "env"):
            out[table].update(getattr(pf, table))
        out["speculative"] = pf.speculative
    assert pf is not None
    return pf.model_copy(update={**out, "extends": None})
