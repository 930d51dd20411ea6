"""`inv model.fetch` / `inv model.verify`: checkpoints from a pinned repository commit, every byte checked.

A profile names its checkpoints by folder (``MODEL``, and ``DRAFT_MODEL`` when ``SPEC=dflash2``); the
committed manifest of that folder name (rig.models.manifest) pins the repository id, the commit and
the sha256 of every file. Files come through huggingface_hub (``hf_hub_download`` with
``revision=``; ``HF_ENDPOINT`` picks the server, e.g. a mirror, or the tests' loopback hub), which
resumes a file whose connection drops with a Range request.

Atomic: files land in ``.<name>.partial`` beside the target and are hashed as they arrive; a file
that differs from the manifest is deleted and named. The folder is renamed to its real name only
when every file verified, so an interrupted or failed fetch leaves no folder under the name serve
loads. The next fetch resumes the partial folder: files already there that verify are kept, the
rest are downloaded again (huggingface_hub 2.4 discards its own half-written file when a download
call fails, so a file cut off across a process exit restarts from its first byte).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rig import paths
from rig.models import manifest as mf
from rig.models.manifest import Manifest, ManifestError


class FetchError(RuntimeError):
    """A fetch that did not complete; the message names every file that failed and what was left."""


@dataclass(frozen=True)
class Target:
    """One checkpoint to fetch or verify: which knob asked for it, its manifest, where it goes."""

    label: str
    manifest: Manifest
    source: str
    folder: Path


def _abs(folder: str | Path) -> Path:
    """A knob's folder as serve resolves it: relative to the checkout."""
    p = Path(folder)
    return p if p.is_absolute() else paths.ROOT / p


def plan_folders(plan) -> list[tuple[str, Path]]:
    """(knob, folder) of every checkpoint the plan loads that rig does not build itself."""
    k = plan.knobs
    out = []
    if not k["MODEL"].startswith(("tiny:", "fixture:")):
        out.append(("MODEL", _abs(plan.model)))
    if k["SPEC"] == "dflash2":
        out.append(("DRAFT_MODEL", _abs(k["DRAFT_MODEL"])))
    return out


def plan_targets(plan) -> list[Target]:
    """Targets of a profile's plan; ManifestError when one of its folders has no committed manifest."""
    folders = plan_folders(plan)
    if not folders:
        raise ManifestError(f"profile {plan.profile}: MODEL={plan.knobs['MODEL']!r} is built by rig, and it loads "
                            "no other checkpoint: nothing to fetch (use --platform gpu for the real checkpoint)")
    out = []
    for knob, folder in folders:
        found = mf.for_folder(folder)
        if found is None:
            raise ManifestError(f"{knob}={folder}: no manifest named {folder.name!r} in "
                                f"{mf.where(mf.manifests_dir())}/ (known: {', '.join(mf.available()) or 'none'}); "
                                "write one with `inv model.manifest` from a trusted copy, or fetch by --model NAME")
        m, path = found
        out.append(Target(knob, m, mf.where(path), folder))
    return out


def named_target(name: str, manifest_file: str, folder: str) -> Target:
    """A target by manifest name (models/manifests/NAME.toml) or file; default folder: the models folder."""
    if bool(name) == bool(manifest_file):
        raise ManifestError("give one of --model NAME or --manifest FILE")
    if name:
        m, path = mf.find(name)
    else:
        path = Path(manifest_file)
        m = mf.load(path)
    dest = Path(folder).resolve() if folder else paths.models_dir() / m.name
    return Target("checkpoint", m, mf.where(path), dest)


def require_source(t: Target) -> None:
    """Fetch needs a repository, a commit and hashes; say which is missing and how to add it."""
    mf.require_hashes(t.manifest, t.source)
    missing = [k for k in ("repo", "revision") if not getattr(t.manifest, k)]
    if missing:
        raise ManifestError(f"{t.source}: no {' and no '.join(missing)}: fetch downloads a pinned commit only; "
                            "add them (`inv model.manifest DIR --repo OWNER/NAME --revision COMMIT`)")


def _offline() -> bool:
    """huggingface_hub's offline switch (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, read once at its import)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """One fetch per target at a time (two would write one partial folder)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FetchError(f"{dest}: another fetch of it is running") from None
        yield


class _Abort(Exception):  # noqa: N818 - control flow: a failure every further file would repeat
    """The repository, the revision or the endpoint failed: no later file can succeed."""


def _download(t: Target, entry: mf.FileEntry, work: Path, endpoint: str | None) -> str | None:
    """Download one file into ``work`` and hash it; the reason it failed (file deleted), or None."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    m = t.manifest
    target = work / entry.path
    try:
        hf_hub_download(m.repo, entry.path, revision=m.revision, local_dir=work, endpoint=endpoint,
                        force_download=target.exists())
    except RevisionNotFoundError:
        raise _Abort(f"revision {m.revision} not found in {m.repo}") from None
    except RepositoryNotFoundError as e:
        raise _Abort(f"repository {m.repo} not found or not accessible ({type(e).__name__}; a gated or private "
                     "repository needs HF_TOKEN)") from None
    except RemoteEntryNotFoundError:
        return f"{entry.path}: missing from {m.repo} at {m.revision[:12]} (HTTP 404)"
    except LocalEntryNotFoundError as e:
        raise _Abort(f"cannot reach {endpoint or 'the hub'}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # noqa: BLE001 - any other failure is this file's, named; the fetch goes on
        target.unlink(missing_ok=True)
        return f"{entry.path}: download failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    bad = mf.file_problem(work, entry)
    if bad:
        target.unlink(missing_ok=True)
        return f"{bad} (downloaded; deleted)"
    return None


def _fsync(path: Path) -> None:
    """Flush one file or folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(t: Target, work: Path) -> None:
    """Drop the download tool's metadata, refuse strays, flush, and rename the partial folder into place."""
    shutil.rmtree(work / ".cache", ignore_errors=True)
    listed = {f.path for f in t.manifest.files}
    extra = [p for p in mf.local_files(work) if p not in listed]
    if extra:
        raise FetchError(f"{work}: files not in {t.source}: {', '.join(extra)}; delete them and fetch again")
    for p in [*sorted(work.rglob("*"), reverse=True), work]:  # on disk before the rename makes the folder real
        _fsync(p)
    work.rename(t.folder)
    _fsync(t.folder.parent)


def fetch(t: Target, endpoint: str | None = None, log: Callable[[str], None] | None = None) -> str:
    """Fetch ``t`` into its folder (atomic, resumable); a summary line, FetchError naming every bad file."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    require_source(t)
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    m, dest = t.manifest, t.folder
    with _locked(dest):
        if dest.exists():
            bad = mf.problems(m, dest)
            if bad:
                raise FetchError(f"{dest} exists and differs from {t.source}: {'; '.join(bad)}; fetch never "
                                 "overwrites a folder: move it away and fetch again")
            return f"{t.label}: {dest} already matches {t.source} ({len(m.files)} files, {m.total_bytes:,} bytes)"
        if _offline():
            raise FetchError("HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE, which huggingface_hub also reads) is set: "
                             "fetching needs the hub or a mirror (HF_ENDPOINT); unset it for this command")
        work = dest.with_name(f".{dest.name}.partial")
        work.mkdir(exist_ok=True)
        started = time.monotonic()
        log(f"rig: fetching {t.label} {m.name}: {m.repo} at {m.revision}, {len(m.files)} files, "
            f"{m.total_bytes:,} bytes, from {endpoint or 'the hub'} into {work}")
        errors, kept = [], 0
        for entry in m.files:
            if (work / entry.path).is_file() and mf.file_problem(work, entry) is None:
                kept += 1
                continue
            try:
                why = _download(t, entry, work, endpoint)
            except _Abort as e:
                raise FetchError(f"{t.label} {m.name}: {e}; partial files kept in {work}") from None
            if why:
                errors.append(why)
        if errors:
            raise FetchError(f"{t.label} {m.name}: {len(errors)} of {len(m.files)} files failed: "
                             f"{'; '.join(errors)}; {dest} was not created (verified files stay in {work}, "
                             "for the next fetch to resume)")
        _finish(t, work)
    took = time.monotonic() - started
    return (f"{t.label}: {dest}: {len(m.files)} files, {m.total_bytes:,} bytes match {t.source} "
            f"({kept} kept from an earlier partial fetch; {took:.2f} s)")


def verify(t: Target) -> str:
    """Offline: hash every file of ``t``'s folder against its manifest; VerifyError names every bad file."""
    started = time.monotonic()
    detail = mf.verify(t.manifest, t.folder, t.source)
    return f"{t.label}: {detail} ({time.monotonic() - started:.2f} s)"


@dataclass(frozen=True)
class Check:
    """What serve's preflight found for one checkpoint folder with a committed manifest."""

    verified: bool
    detail: str


def preflight(plan) -> list[Check]:
    """Every present checkpoint folder of the plan that has a committed manifest, hashed against it.

    VerifyError when one differs. A manifest without hashes (the real checkpoint's, until someone with
    a trusted copy runs `inv model.manifest`) cannot verify anything: reported, not refused.
    """
    out = []
    for knob, folder in plan_folders(plan):
        found = mf.for_folder(folder)
        if found is None or not folder.exists():
            continue
        m, path = found
        t = Target(knob, m, mf.where(path), folder)
        if not m.files:
            out.append(Check(False, f"{knob}={folder} not verified: no sha256 manifest for {m.name} "
                                    f"({t.source} lists no files): run `inv model.manifest` on a trusted copy"))
        else:
            out.append(Check(True, verify(t)))
    return out

