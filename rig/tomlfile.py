"""TOML files users write (kernel.toml, model manifests, quantization recipes), read with one error style.

Each reader raises its own error class, but the message always starts with the file as a user
would look for it (relative to the checkout when inside it) and names the TOML key that is wrong,
as ``cuda[0].source`` rather than pydantic's tuple location.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from rig import paths

M = TypeVar("M", bound=BaseModel)


def shown(path: Path) -> str:
    """``path`` as messages show it: relative to the checkout when inside it, else as given."""
    try:
        return str(path.resolve().relative_to(paths.ROOT))
    except ValueError:
        return str(path)


def read(path: Path, error: type[Exception], label: str | None = None) -> dict:
    """The file's TOML as a dict; ``error`` naming the file when it cannot be read or parsed."""
    label = label or shown(path)
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise error(f"{label}: cannot read it ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{label}: not valid TOML: {e}") from None


def key(err: dict) -> str:
    """A pydantic error's location as the TOML key a user would look for; ``(file)`` for the top level."""
    out = ""
    for part in err["loc"]:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(file)"


def validate(model: type[M], data: dict, error: type[Exception], label: str) -> M:
    """``model`` built from ``data``; ``error`` naming the file and every bad key, in one line."""
    try:
        return model(**data)
    except ValidationError as e:
        raise error(f"{label}: " + "; ".join(f"{key(err)}: {err['msg']}" for err in e.errors())) from None
