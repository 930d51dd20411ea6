"""Offline installs: wheelhouses made from the locks, bootstrap.py --wheelhouse, and the pieces for a GPU host.

The fast tests use a real wheelhouse of a seven-entry sub-lock of locks/cpu.txt (a pure-Python
sdist among them, built offline from the folder's own setuptools); the slow one makes the
wheelhouse of the whole CPU lock and installs a working venv from it with every index cut off.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from rich.console import Console

from rig import paths
from rig.env import bootstrap, carry, wheelhouse
from rig.env import lock as envlock

ROOT = paths.ROOT
# word2number is an sdist only: it builds offline from the folder's setuptools, wheel and packaging.
SMALL = {"invoke", "iniconfig", "six", "word2number", "setuptools", "wheel", "packaging"}
UNREACHABLE = "http://127.0.0.1:9/simple"


def offline_env(tmp: Path, **extra: str) -> dict[str, str]:
    """This environment with every way to an index cut: no pip config, an unreachable index, no find-links."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": UNREACHABLE, "PIP_FIND_LINKS": "",
            "PIP_EXTRA_INDEX_URL": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5", "RIG_TORCH_INDEX": "",
            "RIG_STATE_DIR": str(tmp / "state"), **extra}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, Path, list[wheelhouse.Row]]:
    """(sub-lock, wheelhouse, manifest rows) of SMALL, fetched the way `inv env.wheelhouse` fetches."""
    tmp = tmp_path_factory.mktemp("wheelhouse")
    lock = envlock.sublock(paths.LOCKS / "cpu.txt", SMALL, tmp / "small.txt")
    rows = wheelhouse.build(lock, tmp / "wheels", "3.11", envlock.WHEELHOUSE_PLATFORM, Console(file=io.StringIO()))
    return lock, tmp / "wheels", rows


def copy_house(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_sublock_keeps_the_entries_and_their_hashes(small, tmp_path):
    lock, _, _ = small
    full, part = bootstrap.read_lock(paths.LOCKS / "cpu.txt"), bootstrap.read_lock(lock)
    assert set(part) == SMALL and all(part[n] == full[n] for n in SMALL)
    with pytest.raises(ValueError, match="no-such-thing: not in cpu.txt"):
        envlock.sublock(paths.LOCKS / "cpu.txt", {"six", "no-such-thing"}, tmp_path / "x.txt")


def test_manifest_lists_every_file_with_its_sha256_and_size(small):
    lock, house, rows = small
    doc = json.loads((house / wheelhouse.MANIFEST).read_text())
    assert {r["name"] for r in doc["files"]} == SMALL and doc["python"] == "3.11"
    assert doc["total_bytes"] == sum(r.size for r in rows) == sum((house / r.file).stat().st_size for r in rows)
    entries = bootstrap.read_lock(lock)
    for r in rows:
        assert r.sha256 == bootstrap.sha256_file(house / r.file) and r.sha256 in entries[r.name].hashes
        assert r.version == entries[r.name].version
    assert not next(r.file for r in rows if r.name == "word2number").endswith(".whl")  # an sdist (.zip)
    out = io.StringIO()
    wheelhouse.show(rows, house, Console(file=out, width=200))
    total = doc["total_bytes"]
    assert f"{len(SMALL)} files, {wheelhouse.human(total)} in all ({total} bytes)" in out.getvalue()


def test_pip_platforms_reach_old_manylinux_tags():
    tags = wheelhouse.pip_platforms("x86_64-manylinux_2_28")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_18_x86_64" in tags  # nvidia-nccl-cu13 2.29.7
    assert {"manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"} <= set(tags)
    with pytest.raises(wheelhouse.WheelhouseError, match="expected <arch>-manylinux_2_<glibc minor>"):
        wheelhouse.pip_platforms("linux")


@pytest.mark.slow  # makes a venv / installs with pip: ~15-25 s
def test_an_intact_wheelhouse_installs_offline(small, tmp_path, monkeypatch):
    """bootstrap's install, offline: a venv whose packages all came from the folder (the sdist built there)."""
    lock, house, _ = small
    for k, v in offline_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    assert bootstrap.wheelhouse_problems(lock, house) == []
    venv = tmp_path / "venv"
    bootstrap.install(venv, lock, tmp_path / "install.log", house)
    log = (tmp_path / "install.log").read_text()
    assert "Building wheel for word2number" in log  # no cache: built from the folder's sdist and setuptools
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import invoke, six, word2number, iniconfig; "
                        "from importlib.metadata import version; print(version('invoke'), version('word2number'))"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [bootstrap.read_lock(lock)["invoke"].version, "1.1"]


def test_a_removed_wheel_is_named(small, tmp_path):
    lock, house, rows = small
    broken = copy_house(house, tmp_path / "wheels")
    (broken / next(r.file for r in rows if r.name == "six")).unlink()
    assert bootstrap.wheelhouse_problems(lock, broken) == [
        f"six=={bootstrap.read_lock(lock)['six'].version} is missing (no file with a hash of {lock})"]


def test_an_altered_wheel_is_named(small, tmp_path):
    lock, house, rows = small
    broken = copy_house(house, tmp_path / "wheels")
    name = next(r.file for r in rows if r.name == "invoke")
    with (broken / name).open("ab") as f:
        f.write(b"\0")
    with pytest.raises(bootstrap.BootstrapError) as e:
        bootstrap.check_wheelhouse(lock, broken, "cpu")
    assert f"{name} does not match invoke==" in e.value.message and "altered" in e.value.message
    assert "inv env.wheelhouse --env cpu" in e.value.message


@pytest.mark.slow  # makes a venv / installs with pip: ~15-25 s
def test_pip_itself_refuses_an_altered_wheel(small, tmp_path, monkeypatch):
    """Past the check (a file changed after it), pip's --require-hashes stops the install, and we name the file."""
    lock, house, rows = small
    broken = copy_house(house, tmp_path / "wheels")
    name = next(r.file for r in rows if r.name == "iniconfig")
    with (broken / name).open("ab") as f:
        f.write(b"\0")
    for k, v in offline_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(bootstrap.BootstrapError) as e:
        bootstrap.install(tmp_path / "venv", lock, tmp_path / "install.log", broken)
    assert e.value.message.startswith(f"wheelhouse {broken}: {name} does not match the hash of iniconfig==")


def _bootstrap(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bootstrap.py"), *args], env=env, capture_output=True,
                          text=True, timeout=3000)


def test_bootstrap_refuses_a_missing_folder_before_making_a_venv(tmp_path):
    venv = tmp_path / "venv"
    env = offline_env(tmp_path, RIG_ENV="cpu", RIG_VENV=str(venv))
    r = _bootstrap(env, "--wheelhouse", str(tmp_path / "nowhere"), "--list")
    assert r.returncode == 2 and not venv.exists()
    assert r.stderr.strip() == (f"rig: error: --wheelhouse {tmp_path / 'nowhere'}: no such folder; make one on a "
                                f"host with network: `inv env.wheelhouse --env cpu --out {tmp_path / 'nowhere'}`")
    r = _bootstrap(env, "--wheelhouse")
    assert r.returncode == 2 and "--wheelhouse needs a folder" in r.stderr


def test_bootstrap_names_the_wheels_a_partial_folder_lacks(small, tmp_path):
    """The real CPU lock against the seven-wheel folder: refused, naming what is missing, nothing made."""
    _, house, _ = small
    venv = tmp_path / "venv"
    r = _bootstrap(offline_env(tmp_path, RIG_ENV="cpu", RIG_VENV=str(venv)), f"--wheelhouse={house}", "--list")
    assert r.returncode == 2 and not venv.exists()
    assert r.stderr.startswith(f"rig: error: wheelhouse {house} cannot install locks/cpu.txt: "
                               "absl-py==2.5.1 is missing (no file with a hash of locks/cpu.txt); ")
    assert "more); rebuild it with `inv env.wheelhouse --env cpu --out DIR`" in r.stderr


def test_a_missing_build_requirement_is_found_before_the_host(small, tmp_path):
    """Without `wheel`, pip cannot build word2number's sdist offline: the dry run says so, naming it."""
    lock, house, rows = small
    part = envlock.sublock(paths.LOCKS / "cpu.txt", SMALL - {"wheel"}, tmp_path / "part.txt")
    broken = copy_house(house, tmp_path / "wheels")
    (broken / next(r.file for r in rows if r.name == "wheel")).unlink()
    assert bootstrap.wheelhouse_problems(part, broken) == []  # every file of the lock is there...
    with pytest.raises(wheelhouse.WheelhouseError, match="pip finds no file of wheel in it"):
        wheelhouse.offline_check(part, broken, "3.11", envlock.WHEELHOUSE_PLATFORM, tmp_path / "dry.log")
    wheelhouse.offline_check(lock, house, "3.11", envlock.WHEELHOUSE_PLATFORM, tmp_path / "dry.log")


# --- pieces for a GPU host ------------------------------------------------------------------


def test_select_leaves_out_globs_but_keeps_named():
    names = ["torch", "nvidia-cublas", "nvidia-nccl-cu13", "vllm"]
    assert carry.select(names, ["nvidia-*"], ["nvidia-nccl-cu13"]) == ["nvidia-nccl-cu13", "torch", "vllm"]
    with pytest.raises(carry.CarryError, match="'cuda-\\*' matches no requirement"):
        carry.select(names, ["cuda-*"], [])
    with pytest.raises(carry.CarryError, match="--keep triton: not in the lock"):
        carry.select(names, [], ["triton"])
    assert carry.parse_size("63M") == 63 * 1024**2
    with pytest.raises(carry.CarryError, match="expected a number with K, M or G"):
        carry.parse_size("63MB")


@pytest.mark.slow  # makes a venv / installs with pip: ~15-25 s
def test_pieces_reassemble_and_install_with_the_generated_script(small, tmp_path):
    _, house, rows = small
    out = tmp_path / "carry"
    packed = carry.pack(house, rows, out, 64 * 1024, "3.11")
    assert len(packed.pieces) > 3 and all(p.stat().st_size <= 64 * 1024 for p in packed.pieces)
    assert sum(p.stat().st_size for p in packed.pieces) == packed.tar_bytes
    again = carry.pack(house, rows, tmp_path / "again", 64 * 1024, "3.11")
    assert [bootstrap.sha256_file(p) for p in again.pieces] == [bootstrap.sha256_file(p) for p in packed.pieces]
    # On the "host": only the carried files, and pip with no index.
    host = tmp_path / "host"
    host.mkdir()
    for f in out.iterdir():
        shutil.copy(f, host)
    env = offline_env(tmp_path, PYTHON=sys.executable)
    r = subprocess.run(["sh", str(host / carry.INSTALL), str(tmp_path / "site")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"installed {len(SMALL)} wheels into {tmp_path / 'site'}" in r.stdout
    probe = subprocess.run([sys.executable, "-c", "import word2number, invoke; print(invoke.__file__)"],
                           env={**env, "PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stdout.startswith(str(tmp_path / "site")), probe.stderr


def test_a_wheel_name_longer_than_ustar_allows_is_packed_whole(tmp_path):
    """pybase64's cp312 wheel is named with 112 characters: ustar (100) refused it; tar -x must get it back."""
    name = ("pybase64-1.5.1-cp312-cp312-manylinux1_x86_64.manylinux2014_x86_64.manylinux_2_17_x86_64."
            "manylinux_2_5_x86_64.whl")
    house = tmp_path / "house"
    house.mkdir()
    (house / name).write_bytes(b"PK wheel bytes")
    row = wheelhouse.Row("pybase64", "1.5.1", name, bootstrap.sha256_file(house / name), 14)
    packed = carry.pack(house, [row], tmp_path / "carry", 64 * 1024, "3.12")
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in packed.pieces))
    listed = subprocess.run(["tar", "-t", "-f", str(joined)], capture_output=True, text=True, check=True)
    assert listed.stdout.splitlines() == [name]


def test_a_damaged_piece_stops_the_install_script(small, tmp_path):
    _, house, rows = small
    out = tmp_path / "carry"
    packed = carry.pack(house, rows, out, 64 * 1024, "3.11")
    with packed.pieces[1].open("r+b") as f:
        f.write(b"X")
    packed.pieces[2].unlink()
    r = subprocess.run(["sh", str(out / carry.INSTALL), str(tmp_path / "site")], capture_output=True, text=True,
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 2 and not (tmp_path / "site").exists()
    assert f"{packed.pieces[1].name}: FAILED" in r.stdout + r.stderr
    assert "a piece is missing or damaged (above): carry it again" in r.stderr


def test_gpu_carry_script_refuses_a_glob_that_matches_nothing(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "scripts" / "gpu_carry.py"), "--wheels",
                        str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--leave-out", "nvidia-cublass"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "gpu_carry: error: --leave-out 'nvidia-cublass' matches no requirement of the lock"


# --- a network that fails mid-file ------------------------------------------------------------


def _wheel(name: str, payload: bytes) -> bytes:
    """A minimal valid wheel (pip reads its metadata once downloaded) carrying ``payload`` uncompressed."""
    dist, version = name.split("-")[:2]
    info = f"{dist}-{version}.dist-info"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{dist}/data.bin", payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: rig-test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return buf.getvalue()


class _Index:
    """A loopback package index of one made-up wheel whose first ``stalls`` downloads stop halfway and hang.

    What a slow mirror does to pip: the headers and half the body arrive, then nothing, until
    pip's read timeout ends the run with ``ERROR: Exception:`` and a ReadTimeoutError.
    """

    def __init__(self, tmp: Path, stalls: int):
        self.name = "rigstall-1.0-py3-none-any.whl"
        self.body = _wheel(self.name, os.urandom(256 * 1024))
        self.sha = hashlib.sha256(self.body).hexdigest()
        self.stalls, self.gets, self.release = stalls, 0, threading.Event()
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.rstrip("/") == "/simple/rigstall":
                    page = f'<a href="/f/{index.name}#sha256={index.sha}">{index.name}</a>'.encode()
                    return self._send(page, "text/html")
                if self.path == f"/f/{index.name}":
                    index.gets += 1
                    if index.gets <= index.stalls:
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(index.body)))
                        self.end_headers()
                        self.wfile.write(index.body[: len(index.body) // 2])
                        self.wfile.flush()
                        index.release.wait(30)  # past pip's timeout; let go when the test ends
                        return None
                    return self._send(index.body, "application/octet-stream")
                self.send_error(404)
                return None

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.lock = tmp / "stall.txt"
        self.lock.write_text(f"rigstall==1.0 \\\n    --hash=sha256:{self.sha}\n")

    def env(self, monkeypatch) -> None:
        """pip sees this index alone, no cache, a 2 s read timeout."""
        for k in [k for k in os.environ if k.startswith("PIP_")]:
            monkeypatch.delenv(k)
        for k, v in {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_NO_CACHE_DIR": "1",
                     "PIP_INDEX_URL": f"http://127.0.0.1:{self.server.server_address[1]}/simple",
                     "PIP_TIMEOUT": "2", "PIP_RETRIES": "0", "RIG_TORCH_INDEX": ""}.items():
            monkeypatch.setenv(k, v)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()


@pytest.fixture
def stalling(tmp_path, monkeypatch):
    made = []

    def make(stalls: int) -> _Index:
        made.append(_Index(tmp_path, stalls))
        made[-1].env(monkeypatch)
        return made[-1]
    yield make
    for index in made:
        index.close()


def test_a_download_that_times_out_mid_file_is_run_again(stalling, tmp_path):
    index = stalling(1)
    out, log, console = tmp_path / "wheels", tmp_path / "log.txt", Console(file=io.StringIO(), width=300)
    wheelhouse.download(index.lock, out, "3.11", envlock.WHEELHOUSE_PLATFORM, log, console, attempts=2, delay_s=0)
    assert (out / index.name).read_bytes() == index.body and index.gets == 2
    text = log.read_text()
    assert "Read timed out" in text and "== run 2 of 2" in text
    assert "run 1 of 2, again in 0 s" in console.file.getvalue()


def test_a_download_that_keeps_timing_out_names_the_file_and_the_cause(stalling, tmp_path):
    index = stalling(9)
    out, log = tmp_path / "wheels", tmp_path / "log.txt"
    with pytest.raises(wheelhouse.WheelhouseError) as e:
        wheelhouse.download(index.lock, out, "3.11", envlock.WHEELHOUSE_PLATFORM, log, Console(file=io.StringIO()),
                            attempts=2, delay_s=0)
    msg = str(e.value)
    assert msg.startswith("pip download failed at rigstall==1.0: ERROR: Exception") and "Read timed out" in msg
    assert "2 runs all failed: run the same command again" in msg and index.gets == 2
    assert not (out / index.name).exists()  # pip saves nothing it has not checked


def test_a_file_the_index_lacks_is_not_fetched_again(stalling, tmp_path):
    index = stalling(0)
    index.lock.write_text(f"rigstall==2.0 \\\n    --hash=sha256:{index.sha}\n")
    with pytest.raises(wheelhouse.WheelhouseError, match=r"no file of rigstall==2\.0 for Python 3\.11") as e:
        wheelhouse.download(index.lock, tmp_path / "w", "3.11", envlock.WHEELHOUSE_PLATFORM, tmp_path / "log.txt",
                            Console(file=io.StringIO()), attempts=3, delay_s=0)
    assert "runs all failed" not in str(e.value) and "== run 2" not in (tmp_path / "log.txt").read_text()


def test_bootstrap_installs_again_when_a_download_breaks_off(stalling, tmp_path, monkeypatch):
    """bootstrap's first install, from an index: a download that times out mid-file is run again, then named."""
    monkeypatch.setattr(bootstrap, "RETRY_DELAY_S", 0.0)
    index, venv, log = stalling(1), tmp_path / "venv", tmp_path / "bootstrap.log"
    bootstrap.install(venv, index.lock, log)
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert (site / "rigstall" / "data.bin").is_file() and index.gets == 2
    assert "Read timed out" in log.read_text() and "== run 2 of 3" in log.read_text()

    index.stalls = 99
    with pytest.raises(bootstrap.BootstrapError) as e:
        bootstrap.install(tmp_path / "venv2", index.lock, log)
    assert "broke off 3 runs in a row (ReadTimeoutError) although the index answers" in e.value.message
    assert index.gets == 5


# --- the whole CPU lock ---------------------------------------------------------------------


@pytest.mark.slow
def test_cpu_wheelhouse_is_complete_offline_and_refused_when_broken(tmp_path):
    """`inv env.wheelhouse --env cpu` of the whole lock; pip installs it from the folder alone (dry run);
    bootstrap.py --wheelhouse, with the network cut, refuses it with torch removed and with six altered.

    The full offline install of this folder into a venv (3.4 GB, 15 min on a loaded host) is not
    repeated here: the dry run is pip's own check of every file against the lock for this
    interpreter, sdists prepared from the folder; the sub-lock tests install for real.
    """
    house = tmp_path / "wheels"
    inv = Path(sys.executable).with_name("inv")
    made = subprocess.run([str(inv), "env.wheelhouse", "--env", "cpu", "--out", str(house)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3000)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    lock = bootstrap.read_lock(paths.LOCKS / "cpu.txt")
    rows = wheelhouse.read_manifest(house)
    assert {r.name for r in rows} == set(lock)
    assert f"{len(lock)} files, " in made.stdout
    assert "pip installs it from the folder alone (dry run, --no-index) for Python 3.11" in made.stdout

    venv = tmp_path / "venv"
    env = offline_env(tmp_path, RIG_ENV="cpu", RIG_VENV=str(venv))
    torch = next(r for r in rows if r.name == "torch")
    (house / torch.file).rename(tmp_path / torch.file)
    r = _bootstrap(env, "--wheelhouse", str(house), "--list")
    assert r.returncode == 2 and not venv.exists()
    assert f"torch=={lock['torch'].version} is missing" in r.stderr
    (tmp_path / torch.file).rename(house / torch.file)
    six = next(r for r in rows if r.name == "six")
    (house / six.file).write_bytes((house / six.file).read_bytes()[:-1])
    r = _bootstrap(env, "--wheelhouse", str(house), "--list")
    assert r.returncode == 2 and not venv.exists()
    assert f"{six.file} does not match six==" in r.stderr
