"""Generated docs cannot drift from the code and data they describe."""

from __future__ import annotations

import pytest

from rig import docgen, paths

DOCS = docgen.documents()


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_generated_blocks_are_current(doc):
    text = doc.read_text()
    stale = docgen.stale(text, doc.name)
    assert not stale, f"{doc.name}: generated blocks {stale} are stale: run `inv docs`"
    assert docgen.render(text, doc.name) == text


def test_every_doc_with_a_marker_is_checked():
    """The glob finds the docs that have generated blocks today; a new doc with one is found the same way."""
    names = {d.name for d in DOCS}
    assert {"profiles.md", "patches.md"} <= names
    every = [paths.ROOT / "README.md", *paths.DOCS.glob("*.md")]
    assert {d.name for d in every if docgen.MARKER in d.read_text()} == names


def test_a_stale_block_is_reported(tmp_path):
    """Edit one block of a copy of docs/profiles.md (the real file is not touched): the check names that block."""
    doc = tmp_path / "profiles.md"
    doc.write_text((paths.DOCS / "profiles.md").read_text())
    text = doc.read_text()
    assert docgen.stale(text) == []
    edited = text.replace("- `generation_config = 'auto'`\n", "- `generation_config = 'vllm'`\n", 1)
    assert edited != text
    doc.write_text(edited)
    assert docgen.stale(doc.read_text()) == ["serve-flags"]
    assert docgen.render(doc.read_text()) == text  # regenerating restores exactly the committed text


def test_a_block_edited_at_its_end_or_emptied_is_stale():
    text = (paths.DOCS / "patches.md").read_text()
    name, start, end = next(b for b in docgen.blocks(text) if b[0] == "patch table")
    assert docgen.stale(text[:end - 1] + " \n" + text[end:]) == ["patch table"]
    assert docgen.stale(text[:start] + text[end:]) == ["patch table"]


@pytest.mark.parametrize("marker, why", [
    ("<!-- BEGIN GENERATED: no-such-table -->\nx\n<!-- END GENERATED: no-such-table -->\n", "names no generator"),
    ("<!-- BEGIN GENERATED: knobs -->\nx\n", "no '<!-- END GENERATED: knobs -->' marker"),
    ("<!-- BEGIN GENERATED: knobs\nx\n<!-- END GENERATED: knobs -->\n", "malformed"),
])
def test_a_bad_marker_is_an_error_naming_it(marker, why):
    with pytest.raises(docgen.DocgenError, match=why):
        docgen.stale("# a doc\n\n" + marker, "new.md")


def test_every_knob_is_documented():
    from rig.knobs import Knobs

    text = (paths.DOCS / "profiles.md").read_text()
    for name in Knobs.model_fields:
        assert f"| `{name}` |" in text


def test_readme_commands_are_what_ci_runs():
    readme = (paths.ROOT / "README.md").read_text()
    ci = (paths.ROOT / ".ci" / "run").read_text()
    assert "python3 bootstrap.py test " in readme and "exec python3 bootstrap.py test\n" in ci
    assert "python3 bootstrap.py serve --profile batch" in readme


def test_readme_says_serve_kvarn_is_not_fast_on_a_gpu_yet():
    """The kvarn backend is eager on a GPU and its decode kernel slower than fp16 (the plan warns): the README must
    say so where it names the task, and what is missing."""
    readme = (paths.ROOT / "README.md").read_text()
    paragraph = next(p for p in readme.split("\n\n") if "`pixi run serve-kvarn`" in p)
    assert "is **not** fast" in paragraph and "Triton kernels" in paragraph and "--kv-cache-dtype kvarn" in paragraph
    code = readme.split("## On a GPU host", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert "serve-kvarn" not in code  # not among the commands that run


# ---- the `inv quality` section: written by a run, checked against the result it names ------------------


QUALITY_DOCS = docgen.quality_docs()


def test_the_quality_section_is_found():
    assert [d.name for d in QUALITY_DOCS] == ["quality.md"]


@pytest.mark.parametrize("doc", QUALITY_DOCS, ids=[d.name for d in QUALITY_DOCS])
def test_the_quality_section_regenerates_from_its_kept_result(doc):
    """The section names the committed result JSON it came from; regenerating from that file gives it byte for byte."""
    from rig.quality import report

    section, fresh = docgen.quality_section(doc)
    source = report.source_of(section)
    assert source.startswith(f"{report.RUNS}/") and (doc.parent / source).is_file()
    assert section == fresh, f"{doc.name}: the `inv quality` section differs from {source}: run `inv docs`"


def _quality_result(utc: str, ppl: float) -> dict:
    """A result with the fields the section reads (values as a battery writes them)."""
    return {"utc": utc, "battery": "tiny", "profile": "batch", "model": {"name": "m"}, "platform": "cpu",
            "passed": True, "summary": "every absolute gate passed",
            "gates": [{"name": "ppl.overall.absolute", "value": ppl, "limit": "<= 20", "passed": True,
                       "verdict": "pass", "detail": ""}],
            "perplexity": {"sets": [{"name": "s", "domain": "english", "windows": 4, "tokens": 1196, "ppl": ppl,
                                     "origin": "corpus", "sha256": "h" * 64}]},
            "digest": {"digest": "ab" * 32, "prompts": 4, "max_tokens": 32}}


def test_a_quality_section_that_drifts_from_its_source_or_loses_it_is_caught(tmp_path):
    """On a copy (the real doc is not touched): an edited figure, an edited source, a missing or unnamed source."""
    from rig.quality import report

    doc = tmp_path / "quality.md"
    doc.write_text(f"# Quality\n\nintro\n\n{report.BEGIN}\nold\n{report.END}\n")
    report.update_docs(_quality_result("2026-12-02T10:00:00Z", 5.0), doc)
    first = tmp_path / report.RUNS / "quality-20261202T100000Z-batch.json"
    assert first.is_file()
    section, fresh = docgen.quality_section(doc)
    assert section == fresh and "| ppl.overall.absolute | 5 | <= 20 | PASS |" in section
    doc.write_text(doc.read_text().replace("| 5 | <= 20 |", "| 4 | <= 20 |"))  # a hand-edited figure
    section, fresh = docgen.quality_section(doc)
    assert section != fresh
    report.update_docs(_quality_result("2026-12-03T10:00:00Z", 6.0), doc)  # the next run replaces its source
    second = tmp_path / report.RUNS / "quality-20261203T100000Z-batch.json"
    assert second.is_file() and not first.exists()
    second.write_text(second.read_text().replace("6.0", "7.0"))  # the source changed, the section did not
    section, fresh = docgen.quality_section(doc)
    assert section != fresh and "| 7 |" in fresh
    second.unlink()
    with pytest.raises(docgen.DocgenError, match="does not exist"):
        docgen.quality_section(doc)
    doc.write_text(f"# Quality\n\n{report.markdown(_quality_result('2026-12-02T10:00:00Z', 5.0))}\n")
    with pytest.raises(docgen.DocgenError, match="names no source"):
        docgen.quality_section(doc)


# ---- markers nothing checks --------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", [paths.ROOT / "README.md", *sorted(paths.DOCS.glob("*.md"))],
                         ids=lambda d: d.name)
def test_every_generated_or_rig_marker_is_one_docgen_checks(doc):
    assert docgen.unknown_markers(doc.read_text()) == [], \
        f"{doc.name}: markers nothing regenerates or checks; register them in rig/docgen.py or remove them"


@pytest.mark.parametrize("marker", [
    "<!-- generated by hand from a run -->",
    "<!-- rig:bench:begin -->",
    "<!-- BEGIN GENERATED: no-such-table -->",
    "<!-- END GENERATED: no-such-table -->",
    "<!-- rig:quality:begin -->",  # not the exact marker inv quality writes
    "<!-- Generated\n  over two lines -->",
])
def test_an_unknown_marker_is_named(marker):
    assert docgen.unknown_markers(f"# doc\n\n{marker}\ntext\n") == [marker]


def test_known_markers_and_plain_comments_pass():
    from rig.quality import report

    text = (f"<!-- BEGIN GENERATED: knobs -->\n<!-- END GENERATED: knobs -->\n"
            f"<!-- BEGIN GENERATED: patch table (a note) -->\n{report.BEGIN}\n{report.END}\n<!-- a plain note -->\n")
    assert docgen.unknown_markers(text) == []
