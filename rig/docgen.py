"""Generated parts of the docs: the knob reference, profile tables and patch table come from code and data.

Each generated block sits between a ``<!-- BEGIN GENERATED: name -->`` line (the line may carry a
note after the name: ``<!-- BEGIN GENERATED: name (note) -->``) and ``<!-- END GENERATED: name -->``;
everything outside the markers is hand-written. ``name`` is a key of ``GENERATORS``, in whichever
of README.md and docs/*.md the block sits, so a block added to any doc is checked without
registering the doc anywhere. A test fails when a committed doc differs from what ``inv docs``
would write, and when a marker names no generator, so the reference cannot drift.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from rig import paths, profiles
from rig.knobs import Knobs, allowed
from rig.plan import resolve


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def knob_table() -> str:
    """Every knob: default (profiles/base.toml), per-profile values, allowed values, doc."""
    names = [n for n in profiles.available() if n != "base"]
    values = {n: profiles.merged(n).knobs for n in ["base", *names]}
    head = "| knob | default | " + " | ".join(names) + " | allowed | what it does |"
    rows = [head, "|" + "---|" * (len(names) + 4)]
    for name, field in Knobs.model_fields.items():
        base = values["base"][name]
        per = [("" if values[n][name] == base else f"`{values[n][name]!r}`") for n in names]
        rows.append(f"| `{name}` | `{base!r}` | " + " | ".join(per) + f" | {_md_escape(allowed(name))} | "
                    f"{_md_escape(field.description or '')} |")
    return "\n".join(rows)


def overlay_table() -> str:
    rows = ["| overlay | sets | what it is for |", "|---|---|---|"]
    for name in profiles.available("overlay"):
        ov = profiles.load_file(name, "overlay")
        sets = ", ".join(f"`{k}={v!r}`" for k, v in ov.knobs.items())
        for prof, adj in ov.profiles.items():
            sets += f"; on {prof}: " + ", ".join(f"`{k}={v!r}`" for k, v in adj.knobs.items())
        rows.append(f"| `{name}` | {sets or '-'} | {_md_escape(ov.description)} |")
    return "\n".join(rows)


def serve_flags() -> str:
    pf = profiles.merged("base")
    return "\n".join(f"- `{k} = {v!r}`" for k, v in sorted(pf.serve.items()))


def dry_run_example() -> str:
    from rig import planview

    return "```text\n$ inv serve --profile batch --platform gpu --dry-run\n" + \
        planview.render(resolve("batch", (), "gpu", environ={})) + "```"


def patch_table() -> str:
    from rig import patches

    return patches.render_table()


GENERATORS: dict[str, Callable[[], str]] = {
    "knobs": knob_table, "overlays": overlay_table, "serve-flags": serve_flags, "dry-run": dry_run_example,
    "patch table": patch_table,
}

MARKER = "<!-- BEGIN GENERATED: "
_BEGIN = re.compile(r"^<!-- BEGIN GENERATED: (?P<name>[^()\n]+?)(?: \((?P<note>[^)\n]*)\))? -->\n", re.M)


class DocgenError(ValueError):
    """A generated block that cannot be regenerated: unknown generator or a missing END marker."""


def documents() -> list[Path]:
    """README.md and every docs/*.md that holds at least one generated block."""
    candidates = [paths.ROOT / "README.md", *sorted(paths.DOCS.glob("*.md"))]
    return [p for p in candidates if MARKER in p.read_text()]


def blocks(text: str, doc: str = "doc") -> list[tuple[str, int, int]]:
    """(name, start, end) of each generated block's body in ``text``: the text between its markers."""
    found = []
    for m in _BEGIN.finditer(text):
        name = m.group("name")
        if name not in GENERATORS:
            raise DocgenError(f"{doc}: the marker {m.group(0).strip()!r} names no generator; known: "
                              f"{', '.join(sorted(GENERATORS))} (rig/docgen.py GENERATORS)")
        end = text.find(f"<!-- END GENERATED: {name} -->", m.end())
        if end < 0:
            raise DocgenError(f"{doc}: generated block {name!r} has no '<!-- END GENERATED: {name} -->' marker")
        found.append((name, m.end(), end))
    if text.count(MARKER) != len(found):
        raise DocgenError(f"{doc}: a '{MARKER}...' line is malformed: expected '{MARKER}name -->' or "
                          f"'{MARKER}name (note) -->' on a line of its own")
    return found


def render(text: str, doc: str = "doc") -> str:
    """``text`` with every generated block replaced by its generator's fresh output."""
    out, pos = [], 0
    for name, start, end in blocks(text, doc):
        out += [text[pos:start], GENERATORS[name]() + "\n"]
        pos = end
    return "".join(out) + text[pos:]


def stale(text: str, doc: str = "doc") -> list[str]:
    """Names of the generated blocks of ``text`` whose body differs from the generator's output."""
    return [name for name, start, end in blocks(text, doc) if text[start:end] != GENERATORS[name]() + "\n"]


def write_all() -> list[str]:
    """Regenerate every generated block of every doc; returns the docs that changed."""
    changed = []
    for path in documents():
        old = path.read_text()
        new = render(old, path.name)
        if new != old:
            path.write_text(new)
            changed.append(path.relative_to(paths.ROOT).as_posix())
    return changed
