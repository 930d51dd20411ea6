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
import json
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


def test_ncu_regions_splits_a_source_page_at_its_loops(tmp_path):
    """bench/scripts/ncu_regions.py on a hand-made ncu source page: an outer loop holding an inner one; each
    region's samples are the sum of its rows, the inner loop is the shortest loop, and a file that is not a source
    page is refused by name."""
    import subprocess
    import sys

    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
            "stall_long_sb", "stall_wait (Not Issued)"]
    body = [("0x100", "MOV R1, R2", 1, 1, 0, 1), ("0x110", "LDG.E R3, [R4]", 5, 8, 0, 5),     # prologue / outer
            ("0x120", "HMMA.16816.F32 R4, R8, R12, R4", 7, 80, 7, 0), ("0x130", "@P0 BRA 0x120", 1, 80, 1, 0),
            ("0x140", "@P1 BRA 0x110", 2, 8, 0, 2), ("0x150", "EXIT", 0, 1, 0, 0)]
    lines = ['"Kernel Name","toy",'] + [",".join(f'"{h}"' for h in head)]
    lines += [",".join(f'"{v}"' for v in (*row, 0)) for row in body]
    page = tmp_path / "page.csv"
    page.write_text("\n".join(lines) + "\n")
    out = tmp_path / "regions.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "scripts" / "ncu_regions.py"
    run = subprocess.run([sys.executable, str(script), str(page), "--least", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got = {p["region"]: (p["instructions"], p["samples"]) for p in json.loads(out.read_text())["regions"]}
    assert got == {"prologue": (1, 1), "outer loop, before the inner": (1, 5), "inner loop": (2, 8),
                   "outer loop, after the inner": (1, 2), "epilogue": (1, 0)}, got
    assert "| inner loop | 2 | 8 | 50.0 % |" in run.stdout, run.stdout
    bad = tmp_path / "bad.csv"
    bad.write_text('"a","b"\n')
    run = subprocess.run([sys.executable, str(script), str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "not an ncu source page" in run.stderr + run.stdout
