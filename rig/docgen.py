"""Generated parts of the docs: the knob reference, profile tables and patch table come from code and data.

Each generated block sits between a ``<!-- BEGIN GENERATED: name -->`` line (the line may carry a
note after the name: ``<!-- BEGIN GENERATED: name (note) -->``) and ``<!-- END GENERATED: name -->``;
everything outside the markers is hand-written. ``name`` is a key of ``GENERATORS``, in whichever
of README.md and docs/*.md the block sits, so a block added to any doc is checked without
registering the doc anywhere. A test fails when a committed doc differs from what ``inv docs``
would write, and when a marker names no generator, so the reference cannot drift.

One block is written by a run, not by code: ``inv quality``'s section of docs/quality.md
(``rig.quality.report``'s ``<!-- rig:quality:begin ... -->`` markers). It names the result JSON it
was generated from, kept beside the doc; ``quality_problems`` regenerates it from that file. Any
other HTML comment mentioning "generated" or "rig:" is a marker nothing checks: ``unknown_markers``
names it.
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
        sets = ", ".join([f"`{k}={v!r}`" for k, v in ov.knobs.items()]
                         + [f"`--{k.replace('_', '-')} {v}`" for k, v in ov.serve.items()])
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


_COMMENT = re.compile(r"<!--.*?-->", re.S)


def known_markers() -> set[str]:
    """The HTML comments of a doc that something here checks (the quality section's are exact strings)."""
    from rig.quality import report

    return {report.BEGIN, report.END}


def unknown_markers(text: str) -> list[str]:
    """HTML comments that mention "generated" or "rig:" but are no marker this module checks."""
    bad = []
    for m in _COMMENT.finditer(text):
        comment = m.group(0)
        if "generated" not in comment.lower() and "rig:" not in comment.lower():
            continue
        if comment in known_markers():
            continue
        begin = _BEGIN.fullmatch(comment + "\n")
        if begin and begin.group("name") in GENERATORS:
            continue
        end = re.fullmatch(r"<!-- END GENERATED: (?P<name>[^\n]+?) -->", comment)
        if end and end.group("name") in GENERATORS:
            continue
        bad.append(comment)
    return bad


def quality_docs() -> list[Path]:
    """README.md and every docs/*.md that holds an ``inv quality`` section."""
    from rig.quality import report

    candidates = [paths.ROOT / "README.md", *sorted(paths.DOCS.glob("*.md"))]
    return [p for p in candidates if report.BEGIN in p.read_text()]


def quality_section(doc: Path) -> tuple[str, str]:
    """(the committed ``inv quality`` section, the section regenerated from the result it names);
    DocgenError when it names none, or the file is missing."""
    import json

    from rig.quality import report

    text = doc.read_text()
    section = report.section_of(text)
    if section is None:
        raise DocgenError(f"{doc.name}: '{report.BEGIN}' has no '{report.END}' after it")
    source = report.source_of(section)
    if source is None:
        raise DocgenError(f"{doc.name}: the `inv quality` section names no source (a 'Source: [`{report.RUNS}/"
                          "<run>.json`](...)' line): regenerate it with `inv quality` and commit the result JSON it "
                          f"keeps in {report.RUNS}/")
    path = doc.parent / source
    if not path.is_file():
        raise DocgenError(f"{doc.name}: the `inv quality` section's source {source} does not exist: commit the "
                          f"result JSON `inv quality` kept there, or regenerate the section")
    return section, report.markdown(json.loads(path.read_text()), source)


def write_all() -> list[str]:
    """Regenerate every generated block of every doc, and each ``inv quality`` section from the result it
    names; returns the docs that changed."""
    changed = []
    for path in sorted({*documents(), *quality_docs()}):
        old = path.read_text()
        new = render(old, path.name)
        if path in quality_docs():
            section, fresh = quality_section(path)
            new = new.replace(section, fresh, 1)
        if new != old:
            path.write_text(new)
            changed.append(path.relative_to(paths.ROOT).as_posix())
    return changed
