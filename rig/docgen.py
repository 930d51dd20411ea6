"""Generated parts of docs/: the knob reference and profile tables come from the code and data.

Each generated block sits between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED:
name -->`` markers; everything outside the markers is hand-written. A test fails when a
committed doc differs from what ``inv docs`` would write, so the reference cannot drift.
"""

from __future__ import annotations

import re
from collections.abc import Callable

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


BLOCKS: dict[str, dict[str, Callable[[], str]]] = {
    "profiles.md": {"knobs": knob_table, "overlays": overlay_table, "serve-flags": serve_flags,
                    "dry-run": dry_run_example},
}


def render(doc: str, current: str) -> str:
    """``current`` with every generated block of ``doc`` replaced by fresh output."""
    for name, fn in BLOCKS[doc].items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S)
        if not pattern.search(current):
            raise ValueError(f"docs/{doc}: markers for generated block {name!r} are missing")
        current = pattern.sub(lambda m, fn=fn: m.group(1) + fn() + "\n" + m.group(2), current)
    return current


def write_all() -> list[str]:
    """Regenerate every generated block; returns the docs that changed."""
    changed = []
    for doc in BLOCKS:
        path = paths.DOCS / doc
        old = path.read_text()
        new = render(doc, old)
        if new != old:
            path.write_text(new)
            changed.append(doc)
    return changed
