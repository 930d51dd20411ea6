"""`inv model.fetch` / `inv model.verify` / `inv model.manifest` against a hub the test owns, on loopback.

The server answers what huggingface_hub 2.4's ``hf_hub_download`` asks an ``HF_ENDPOINT`` for: ``HEAD`` and
``GET /{owner}/{name}/resolve/{revision}/{path}``, with the hub's headers (``X-Repo-Commit``, ``ETag``,
``Content-Length``, ``Accept-Ranges``; ``X-Error-Code`` on a 404) and ``Range: bytes=N-`` answered with 206.
It can cut a file's first GET off mid-body, serve other bytes of the same length, leave a file out, or
hold a GET open until the test kills the fetch. The checkpoint is the tiny hybrid rig builds (its real
file names and sizes); fetch runs as a user runs it, `python -m invoke` in a process of its own.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from rig import paths
from rig.models import manifest as mf
from rig.models.tiny import MANIFEST

REPO = "rig-test/tiny-hybrid"
REVISION = "0123456789abcdef0123456789abcdef01234567"
NAME = "rig-fetch-test"


@dataclass
class Request:
    method: str
    path: str
    range: str | None


@dataclass
class Hub:
    """What the loopback hub serves and what it was asked."""

    files: dict[str, bytes]
    revision: str = REVISION
    cut_once: set[str] = field(default_factory=set)      # first GET closes one byte before the end
    corrupt: set[str] = field(default_factory=set)       # served with other bytes of the same length
    hold: set[str] = field(default_factory=set)          # GET sends half, then waits for `release`
    requests: list[Request] = field(default_factory=list)
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def gets(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(f"/{name}")]


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    resolve = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the test reads hub.requests
            pass

        def _error(self, code: str) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _answer(self, body: bool) -> None:
            hub.requests.append(Request(self.command, unquote(self.path), self.headers.get("Range")))
            m = resolve.match(unquote(self.path))
            if not m or m["repo"] != REPO:
                return self._error("RepoNotFound")
            if m["rev"] != hub.revision:
                return self._error("RevisionNotFound")
            name = m["file"]
            if name not in hub.files:
                return self._error("EntryNotFound")
            data = hub.files[name]
            if name in hub.corrupt:
                data = bytes(b ^ 0x5A for b in data)
            start = 0
            rng = self.headers.get("Range")
            if body and rng:
                start = int(re.fullmatch(r"bytes=(\d+)-", rng)[1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", hub.revision)
            self.send_header("ETag", f'"{hashlib.sha256(hub.files[name]).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return None
            half = len(data) // 2
            if name in hub.cut_once and len(hub.gets(name)) == 1:
                self.wfile.write(data[:-1])  # all but the last byte: the client has whole chunks to keep
                self.wfile.flush()
                self.close_connection = True
                return None
            if name in hub.hold:
                self.wfile.write(data[:half])
                self.wfile.flush()
                hub.reached.set()
                hub.release.wait(60)
                self.close_connection = True
                return None
            self.wfile.write(data[start:])
            return None

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

    return Handler


@pytest.fixture
def checkpoint(tiny_model: Path, tmp_path: Path) -> Path:
    """The trusted copy: the tiny hybrid's files without rig's own record (rig-model.json), so that only the
    manifest under test can vouch for them."""
    out = tmp_path / "trusted" / NAME
    out.mkdir(parents=True)
    for name in mf.local_files(tiny_model):
        if name != MANIFEST:
            shutil.copyfile(tiny_model / name, out / name)
    return out


@pytest.fixture
def hub(checkpoint: Path) -> Iterator[Hub]:
    files = {p: (checkpoint / p).read_bytes() for p in mf.local_files(checkpoint)}
    h = Hub(files)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(h))
    server.daemon_threads = True
    h.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield h
    h.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def manifest_file(checkpoint: Path, tmp_path: Path) -> Path:
    """A manifest of the test checkpoint, written by `inv model.manifest` as a user would from a trusted copy."""
    out = tmp_path / "manifests" / f"{NAME}.toml"
    r = run_inv("model.manifest", str(checkpoint), "--repo", REPO, "--revision", REVISION,
                "--description", "the tiny hybrid, served by the test's loopback hub", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


def fetch_env(hub: Hub, tmp_path: Path) -> dict[str, str]:
    """A user's shell pointed at the loopback hub: no offline switch, an HF home of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def run_inv(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", *argv], cwd=paths.ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


def fetch(hub: Hub, manifest_file: Path, dest: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return run_inv("model.fetch", "--manifest", str(manifest_file), "--out", str(dest), env=fetch_env(hub, tmp_path))


def test_manifest_written_by_the_task_reads_back_with_every_file(manifest_file, checkpoint):
    m = mf.load(manifest_file)
    assert (m.name, m.repo, m.revision) == (NAME, REPO, REVISION)  # the name: the folder's own
    assert [f.path for f in m.files] == mf.local_files(checkpoint) and len(m.files) >= 6
    weights = next(f for f in m.files if f.path == "model.safetensors")
    assert weights.sha256 == hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
    assert weights.size == (checkpoint / "model.safetensors").stat().st_size
    # Run again with nothing but the folder: the repository, commit and description are kept.
    r = run_inv("model.manifest", str(checkpoint), "--out", str(manifest_file))
    assert r.returncode == 0, r.stderr
    assert mf.load(manifest_file) == m


def test_clean_fetch_verifies_and_asks_for_the_pinned_revision(hub, manifest_file, tmp_path):
    dest = tmp_path / "models" / NAME
    started = time.monotonic()
    r = fetch(hub, manifest_file, dest, tmp_path)
    print(f"inv model.fetch, wall time with the process start: {time.monotonic() - started:.2f} s\n{r.stdout}")
    assert r.returncode == 0, r.stderr
    m = mf.load(manifest_file)
    assert mf.problems(m, dest) == []
    assert sorted(p.name for p in dest.parent.iterdir() if not p.name.endswith(".lock")) == [NAME]  # no partial
    assert not (dest / ".cache").exists()
    resolved = [r for r in hub.requests if "/resolve/" in r.path]
    assert resolved == hub.requests  # nothing but the files: no listing, no other revision
    assert {r.path for r in resolved if r.method == "GET"} == {f"/{REPO}/resolve/{REVISION}/{f.path}" for f in m.files}
    assert all(f"/resolve/{REVISION}/" in r.path for r in resolved)
    started = time.monotonic()
    v = run_inv("model.verify", "--manifest", str(manifest_file), "--out", str(dest))
    print(f"inv model.verify, wall time with the process start: {time.monotonic() - started:.2f} s\n{v.stdout}")
    assert v.returncode == 0 and f"{len(m.files)} files" in v.stdout, v.stderr
    again = fetch(hub, manifest_file, dest, tmp_path)  # present and verified: nothing downloaded
    assert again.returncode == 0 and "already matches" in again.stdout
    assert len([r for r in hub.requests if r.method == "GET"]) == len(m.files)


def test_a_cut_connection_resumes_with_a_range_request(hub, manifest_file, tmp_path):
    hub.cut_once = {"model.safetensors"}
    dest = tmp_path / NAME
    r = fetch(hub, manifest_file, dest, tmp_path)
    assert r.returncode == 0, r.stderr
    from huggingface_hub import constants

    first, second = hub.gets("model.safetensors")
    size = len(hub.files["model.safetensors"])
    # huggingface_hub writes what it received in chunks of DOWNLOAD_CHUNK_SIZE and resumes after the last one.
    assert size > constants.DOWNLOAD_CHUNK_SIZE, "the test file must span more than one download chunk"
    assert first.range is None and second.range is not None
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", second.range)[1])
    assert 0 < resumed_at < size
    assert "Trying to resume download" in r.stderr
    assert mf.problems(mf.load(manifest_file), dest) == []


def test_a_corrupted_file_is_named_and_no_folder_is_made(hub, manifest_file, tmp_path):
    hub.corrupt = {"tokenizer.json"}
    dest = tmp_path / NAME
    r = fetch(hub, manifest_file, dest, tmp_path)
    assert r.returncode == 1
    assert "tokenizer.json: sha256" in r.stderr and "1 of" in r.stderr
    assert not dest.exists()
    partial = tmp_path / f".{NAME}.partial"
    assert not (partial / "tokenizer.json").exists() and (partial / "model.safetensors").is_file()
    assert run_inv("model.verify", "--manifest", str(manifest_file), "--out", str(dest)).returncode == 1
    # The hub is fixed: the next fetch keeps what verified and downloads the one file again.
    hub.corrupt = set()
    before = len(hub.gets("model.safetensors"))
    r = fetch(hub, manifest_file, dest, tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(hub.gets("model.safetensors")) == before and len(hub.gets("tokenizer.json")) == 2
    m = mf.load(manifest_file)
    assert f"({len(m.files) - 1} kept from an earlier partial fetch" in r.stdout
    assert mf.problems(m, dest) == [] and not partial.exists()


def test_a_file_missing_on_the_hub_is_named(hub, manifest_file, tmp_path):
    del hub.files["generation_config.json"]
    dest = tmp_path / NAME
    r = fetch(hub, manifest_file, dest, tmp_path)
    assert r.returncode == 1
    assert f"generation_config.json: missing from {REPO} at {REVISION[:12]}" in r.stderr
    assert not dest.exists()


def test_a_revision_the_hub_does_not_have_stops_the_fetch(hub, manifest_file, tmp_path):
    hub.revision = "f" * 40
    r = fetch(hub, manifest_file, tmp_path / NAME, tmp_path)
    assert r.returncode == 1 and f"revision {REVISION} not found in {REPO}" in r.stderr
    assert not (tmp_path / NAME).exists()


def test_a_killed_fetch_leaves_no_folder_that_verifies_and_resumes(hub, manifest_file, tmp_path):
    hub.hold = {"model.safetensors"}
    dest = tmp_path / NAME
    cmd = [sys.executable, "-m", "invoke", "model.fetch", "--manifest", str(manifest_file), "--out", str(dest)]
    proc = subprocess.Popen(cmd, cwd=paths.ROOT, env=fetch_env(hub, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert hub.reached.wait(120), "the fetch never reached model.safetensors"
        time.sleep(0.2)  # the first half is on its way to disk
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        hub.release.set()
    assert not dest.exists()
    v = run_inv("model.verify", "--manifest", str(manifest_file), "--out", str(dest))
    assert v.returncode == 1 and "no such folder" in v.stderr
    partial = tmp_path / f".{NAME}.partial"
    assert partial.is_dir() and not (partial / "model.safetensors").exists()
    assert run_inv("model.verify", "--manifest", str(manifest_file), "--out", str(partial)).returncode == 1
    hub.hold = set()
    r = fetch(hub, manifest_file, dest, tmp_path)
    assert r.returncode == 0, r.stderr
    assert mf.problems(mf.load(manifest_file), dest) == [] and not partial.exists()


def test_verify_names_a_file_altered_or_added_after_fetch(hub, manifest_file, tmp_path):
    dest = tmp_path / NAME
    assert fetch(hub, manifest_file, dest, tmp_path).returncode == 0
    cfg = dest / "config.json"
    cfg.write_bytes(cfg.read_bytes().replace(b"256", b"257", 1))  # same size, other bytes
    (dest / "extra.safetensors").write_bytes(b"x")
    v = run_inv("model.verify", "--manifest", str(manifest_file), "--out", str(dest))
    assert v.returncode == 1
    assert "config.json: sha256" in v.stderr and "extra.safetensors: not in the manifest" in v.stderr
    r = fetch(hub, manifest_file, dest, tmp_path)  # fetch never overwrites a folder that differs
    assert r.returncode == 1 and "config.json: sha256" in r.stderr and "move it away" in r.stderr


def test_serve_preflight_hashes_a_checkpoint_that_has_a_committed_manifest(hub, manifest_file, tmp_path,
                                                                           monkeypatch):
    from rig.plan import resolve
    from rig.serve import PreflightError, check_checkpoints
    from rig.verify import Skip, check_model

    dest = tmp_path / NAME
    assert fetch(hub, manifest_file, dest, tmp_path).returncode == 0
    monkeypatch.setenv("RIG_MANIFESTS_DIR", str(manifest_file.parent))
    plan = resolve("batch", platform="gpu", environ={}, sets={"MODEL": str(dest)})
    check_checkpoints(plan)
    assert "match" in check_model(plan)
    (dest / "tokenizer.json").write_bytes(b"{}")
    with pytest.raises(PreflightError, match=r"tokenizer\.json: \d+ bytes, the manifest has"):
        check_checkpoints(plan)
    with pytest.raises(RuntimeError, match="tokenizer.json"):
        check_model(plan)
    # A manifest that knows the folder but has no hashes (the real checkpoint's today): reported, not refused.
    m = mf.load(manifest_file)
    mf.write(m.model_copy(update={"files": []}), manifest_file)
    check_checkpoints(plan)
    with pytest.raises(Skip, match="not verified: no sha256 manifest"):
        check_model(plan)


def test_manifests_without_hashes_or_source_are_refused_with_what_to_do(tmp_path):
    r = run_inv("model.fetch", "--profile", "single-user")
    assert r.returncode == 2
    assert ("no sha256 manifest for Qwen3.8-27B-W4A16-AutoRound" in r.stderr
            and "run `inv model.manifest` on a trusted copy" in r.stderr)
    r = run_inv("model.fetch", "--model", "Qwen3.8-27B-DFlash2")
    assert r.returncode == 2 and "no sha256 manifest for Qwen3.8-27B-DFlash2" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('schema_version = 1\nkind = "model-manifest"\nname = "x"\ndescription = "d"\n'
                   'revision = "main"\n[[files]]\npath = "../a"\nsize = 1\nsha256 = "00"\n')
    r = run_inv("model.fetch", "--manifest", str(bad))
    assert r.returncode == 2 and "revision" in r.stderr
    assert "files[0].path" in r.stderr and "files[0].sha256" in r.stderr
    r = run_inv("model.fetch", "--model", "no-such-checkpoint")
    assert r.returncode == 2 and "no manifest for 'no-such-checkpoint'" in r.stderr


def test_every_committed_manifest_loads_and_profiles_name_one():
    from rig.models.fetch import plan_targets
    from rig.plan import resolve

    names = mf.available()
    assert names, "models/manifests/ is empty"
    for name in names:
        m, _ = mf.find(name)
        assert m.name == name
    targets = plan_targets(resolve("single-user", platform="gpu", environ={}))
    assert [(t.label, t.manifest.name) for t in targets] == [
        ("MODEL", "Qwen3.8-27B-W4A16-AutoRound"), ("DRAFT_MODEL", "Qwen3.8-27B-DFlash2")]
