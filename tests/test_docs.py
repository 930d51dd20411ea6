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


def test_readme_says_serve_kvarn_does_not_run_yet():
    """vLLM refuses the kvarn plan on a GPU (tests/test_plan.py) until its kernels and patch land: the
    README must say so where it names the task, and what it needs."""
    readme = (paths.ROOT / "README.md").read_text()
    paragraph = next(p for p in readme.split("\n\n") if "`pixi run serve-kvarn`" in p)
    assert "does **not**" in paragraph and "KVarN kernels" in paragraph and "--kv-cache-dtype kvarn" in paragraph
    code = readme.split("## On a GPU host", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert "serve-kvarn" not in code  # not among the commands that run
