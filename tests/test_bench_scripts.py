"""The bench scripts read only names their rig modules have.

Most of bench/scripts/ runs on a GPU host only, so nothing here runs them to the end: a name a refactor moved
(``pb.write_json`` after rig.atomic took the writers, 2026-12-07) surfaced as an AttributeError at the end
of a paid GPU window, after the measurements. This reads each script's syntax tree instead: every
``alias.name`` where ``alias`` is a rig module the script imported must be an attribute of that module.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "bench" / "scripts").glob("*.py"))


def _is_module(parent: str, name: str) -> bool:
    """Whether ``parent.name`` is a module (a package's submodule), not a name defined in ``parent``."""
    package = hasattr(importlib.import_module(parent), "__path__")
    return package and importlib.util.find_spec(f"{parent}.{name}") is not None


def _module_aliases(tree: ast.Module, missing: list[str]) -> dict[str, str]:
    """alias -> dotted rig module name, for ``import rig.x as a`` and ``from rig[.x] import m [as a]`` (m a module);
    a ``from rig.x import name`` whose name rig.x lacks goes to ``missing``."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("rig.") and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rig":
            for a in node.names:
                if _is_module(node.module, a.name):
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
                elif not hasattr(importlib.import_module(node.module), a.name):
                    missing.append(f"line {node.lineno}: from {node.module} import {a.name} ({node.module} has no "
                                   f"{a.name!r})")
    return out


def _missing(path: Path) -> list[str]:
    """``alias.name`` reads in the script that its rig module does not define."""
    tree = ast.parse(path.read_text(), filename=str(path))
    missing: list[str] = []
    aliases = _module_aliases(tree, missing)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            mod = importlib.import_module(aliases[node.value.id])
            if not hasattr(mod, node.attr):
                missing.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({aliases[node.value.id]} has no "
                               f"{node.attr!r})")
    return missing


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_a_bench_script_reads_only_names_its_rig_modules_have(path: Path):
    assert not _missing(path), f"{path.name}: " + "; ".join(_missing(path))


def test_the_check_sees_a_moved_name(tmp_path: Path):
    """Negative control: the stop-39 break (prefill_bench lost write_json) is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from rig.kernels import prefill_bench as pb\nfrom rig.atomic import write_jsn\n"
                   "pb.write_json('x', {})\npb.HQ\n")
    assert _missing(bad) == ["line 2: from rig.atomic import write_jsn (rig.atomic has no 'write_jsn')",
                             "line 3: pb.write_json (rig.kernels.prefill_bench has no 'write_json')"]
