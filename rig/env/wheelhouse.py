"""A wheelhouse: every file of a lock for one Python and platform, in a folder, for offline installs.

GPU hosts without internet are common. ``inv env.wheelhouse`` fetches, on a host with network,
the exact files a lock names (pip download --no-deps --require-hashes: pip resolves nothing and
refuses a file whose sha256 is not in the lock), for the lock's target rather than this host's
interpreter, then holds the folder against the lock again, has pip install it offline in a dry
run (as bootstrap will: the folder alone) and writes a manifest. On the offline
host ``python3 bootstrap.py --wheelhouse DIR <task>`` installs from that folder alone.

pip's own configuration is used while fetching (its cache, index, find-links), so a wheel that
only a local folder holds (this host's torch +cpu in /opt/wheels, say) is found the same way
``bootstrap.py`` finds it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rig.env import bootstrap

MANIFEST = "manifest.json"


class WheelhouseError(RuntimeError):
    """A wheelhouse that could not be made complete; the message names what and how to fix it."""


@dataclass(frozen=True)
class Row:
    """One file of the manifest."""

    name: str
    version: str
    file: str
    sha256: str
    size: int


def pip_platforms(platform: str) -> list[str]:
    """pip ``--platform`` tags that a ``<arch>-manylinux_2_<N>`` target accepts, newest first.

    pip matches a custom platform exactly (it does not widen manylinux_2_28 to older glibc
    tags as it does for the running host), and some wheels are published with one old tag only
    (nvidia-nccl-cu13 2.29.7: manylinux_2_18), so every older tag is named.
    """
    m = re.fullmatch(r"(x86_64|aarch64)-manylinux_2_(\d+)", platform)
    if not m:
        raise WheelhouseError(f"platform {platform!r}: expected <arch>-manylinux_2_<glibc minor>, "
                              "e.g. x86_64-manylinux_2_28")
    arch, glibc = m.group(1), int(m.group(2))
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 16, -1)]
    tags.append(f"manylinux2014_{arch}")
    if arch == "x86_64":
        tags += [f"manylinux_2_{n}_{arch}" for n in range(min(glibc, 16), 4, -1)]
        tags += [f"manylinux2010_{arch}", f"manylinux1_{arch}"]
    return tags


def download_command(lock: Path, out: Path, python: str, platform: str) -> list[str]:
    """The pip command that fetches exactly the lock's files for (python, platform) into ``out``."""
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
           "--progress-bar", "off", "--no-deps", "--require-hashes", "-r", str(lock), "-d", str(out),
           "--python-version", python, "--implementation", "cp"]
    for tag in pip_platforms(platform):
        cmd += ["--platform", tag]
    if re.search(r"^\S+\+cpu ", lock.read_text(), re.M) and bootstrap.TORCH_INDEX \
            and bootstrap.reachable(bootstrap.TORCH_INDEX):
        cmd += ["--extra-index-url", bootstrap.TORCH_INDEX]
    return cmd


def _fetch(lock: Path, out: Path, python: str, platform: str, sink, progress: Progress, task) -> tuple[int, str]:
    """One pip download run, its output appended to ``sink``, the bar advanced per requirement: (exit code, output)."""
    proc = subprocess.Popen(download_command(lock, out, python, platform), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=bootstrap.ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # a live bar, not 8 KiB bursts
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        sink.write(line)
        lines.append(line)
        m = re.match(r"(?:Collecting|Processing) (\S+)", line)  # Processing: a file of a local index
        if m:
            progress.update(task, advance=1, description=m.group(1).rsplit("/", 1)[-1])
    return proc.wait(), "".join(lines)


def failure(text: str, python: str, platform: str, log: Path) -> tuple[str, bool]:
    """What a failed pip download run's output says went wrong, and whether running it again may help.

    A missing file or an sdist that does not build fails the same way every time. Anything else
    is taken as the network's: pip retries a refused connection itself, but a read that times out
    or a connection dropped mid-file ends the run with ``ERROR: Exception:`` and a traceback (or,
    when the cut body is taken whole, a hash mismatch); a second run fetches only what the first
    did not save, since pip saves a file only once its hash is checked.
    """
    missing = re.search(r"No matching distribution found for (\S+)", text)
    if missing:
        return (f"no file of {missing.group(1)} for Python {python} on {platform} on the reachable indexes "
                f"(log: {log}); check pip's index / find-links"), False
    at = [n.rsplit("/", 1)[-1] for n in re.findall(r"^(?:Collecting|Processing) (\S+)", text, re.M)[-1:]] or ["?"]
    if "metadata-generation-failed" in text:
        return (f"{at[0]} has no wheel for Python {python} on {platform}, and its sdist does not build here "
                f"(log: {log}); pick a newer --platform if the target host allows"), False
    lines = text.splitlines()
    errors = [ln for ln in lines if ln.startswith("ERROR")][-1:] or ["see the log"]
    cause = errors[0]
    if cause.startswith("ERROR: Exception"):  # the traceback's last line names what broke
        raised = [ln.strip() for ln in lines if re.match(r"\s*[\w.]+(Error|Exception|Timeout)\b.*:", ln)][-1:]
        cause = f"{cause} {raised[0]}" if raised else cause
    return f"pip download failed at {at[0]}: {cause} (log: {log})", True


def download(lock: Path, out: Path, python: str, platform: str, log: Path, console: Console,
             attempts: int = bootstrap.PIP_RUNS, delay_s: float = bootstrap.RETRY_DELAY_S) -> None:
    """Run pip download with a progress bar over the lock's requirements; pip's output goes to ``log``.

    A run that fails the way a network fails (see ``failure``) is run again, up to ``attempts``
    runs in all: a wheelhouse of the whole CPU lock is ~3.4 GB from several hosts, and one read
    that times out should not cost the files already saved, nor the caller's whole job.
    """
    if attempts < 1:
        raise ValueError(f"attempts={attempts}: expected at least 1 (one pip download run)")
    total = len(bootstrap.read_lock(lock))
    out.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("fetching"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with log.open("w") as sink:
        for attempt in range(1, attempts + 1):
            with Progress(*columns, console=console, transient=True) as progress:
                rc, text = _fetch(lock, out, python, platform, sink, progress, progress.add_task("", total=total))
            if rc == 0:
                return
            message, transient = failure(text, python, platform, log)
            if not transient or attempt == attempts:
                break
            wait = bootstrap.backoff(attempt, delay_s)
            console.print(f"[yellow]{message}; run {attempt} of {attempts}, again in {wait:.0f} s "
                          "(the files already saved are kept)[/]")
            sink.write(f"\n== run {attempt + 1} of {attempts}\n")
            time.sleep(wait)
    if transient and attempts > 1:
        message += f"; {attempts} runs all failed: run the same command again, saved files are kept"
    raise WheelhouseError(message)


def offline_check(lock: Path, out: Path, python: str, platform: str, log: Path) -> None:
    """Ask pip, as bootstrap.py --wheelhouse will run it (folder only, no index, no config), to install the lock.

    ``--dry-run --target``: pip picks a file for every requirement for (python, platform), checks
    its hash and prepares the sdists (their build requirements must be in the folder too), but
    installs nothing — what an install on the offline host would find missing, found here.
    """
    args, env = bootstrap.offline_pip(out)
    with tempfile.TemporaryDirectory() as target:
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--dry-run",
               "--no-deps", "--require-hashes", "-r", str(lock), *args, "--target", target,
               "--python-version", python, "--implementation", "cp"]
        for tag in pip_platforms(platform):
            cmd += ["--platform", tag]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log.write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        missing = re.search(r"No matching distribution found for (\S+)", r.stdout + r.stderr)
        what = f"pip finds no file of {missing.group(1)} in it" if missing else "pip refuses it"
        raise WheelhouseError(f"{out} does not install offline for Python {python} on {platform}: {what} (log: {log})")


def verify(lock: Path, out: Path, console: Console) -> list[Row]:
    """Hash every file again and hold the folder against the lock: the manifest, or an error naming the wheel."""
    files = [f for f in out.iterdir() if f.is_file() and bootstrap.dist_name(f.name)]
    columns = (TextColumn("hashing"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("", total=sum(f.stat().st_size for f in files))
        match = bootstrap.match_wheelhouse(lock, out, lambda f: progress.advance(task, f.stat().st_size))
    if match.problems:
        raise WheelhouseError(f"{out} does not hold {lock.name}: {'; '.join(match.problems[:3])}")
    entries = bootstrap.read_lock(lock)
    return [Row(name, entries[name].version, f.name, match.digests[f], f.stat().st_size)
            for name, f in sorted(match.files.items())]


def write_manifest(rows: list[Row], lock: Path, out: Path, python: str, platform: str) -> Path:
    """manifest.json beside the wheels: what they are for and every file's name, version, sha256, size."""
    doc = {"lock": lock.name, "lock_sha256": bootstrap.sha256_file(lock), "python": python, "platform": platform,
           "total_bytes": sum(r.size for r in rows), "files": [asdict(r) for r in rows]}
    path = out / MANIFEST
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_manifest(out: Path) -> list[Row]:
    """The rows of a wheelhouse's manifest.json."""
    path = out / MANIFEST
    if not path.is_file():
        raise WheelhouseError(f"{path} is missing: make the wheelhouse with `inv env.wheelhouse`")
    return [Row(**r) for r in json.loads(path.read_text())["files"]]


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("not reached")


def show(rows: list[Row], out: Path, console: Console) -> None:
    """Print the manifest and the total."""
    table = Table("name", "version", "sha256", "size", title=f"wheelhouse {out}", title_justify="left")
    table.columns[2].overflow = "fold"  # the whole hash, wrapped on a narrow terminal, never cut
    for r in rows:
        table.add_row(r.name, r.version, r.sha256, human(r.size))
    console.print(table)
    console.print(f"{len(rows)} files, {human(sum(r.size for r in rows))} in all "
                  f"({sum(r.size for r in rows)} bytes); manifest: {out / MANIFEST}")


def build(lock: Path, out: Path, python: str, platform: str, console: Console | None = None) -> list[Row]:
    """Fetch, verify and describe the wheelhouse of ``lock`` in ``out``; files already there are reused."""
    console = console or Console()
    from rig import paths

    download(lock, out, python, platform, paths.logs_dir() / "wheelhouse.log", console)
    rows = verify(lock, out, console)
    with console.status("pip: installing it offline (a dry run)"):
        offline_check(lock, out, python, platform, paths.logs_dir() / "wheelhouse-offline.log")
    write_manifest(rows, lock, out, python, platform)
    extra = sorted({f.name for f in out.iterdir() if bootstrap.dist_name(f.name)} - {r.file for r in rows})
    if extra:
        console.print(f"[yellow]not in {lock.name} (left out of the manifest): {', '.join(extra)}[/]")
    return rows
