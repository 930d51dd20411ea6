"""Generated docs cannot drift from the code and data they describe."""

from __future__ import annotations

import pytest

from rig import docgen, paths


@pytest.mark.parametrize("doc", sorted(docgen.BLOCKS))
def test_generated_blocks_are_current(doc):
    current = (paths.DOCS / doc).read_text()
    assert docgen.render(doc, current) == current, f"docs/{doc} is stale: run `inv docs`"


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
