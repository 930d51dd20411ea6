"""The GPU window's shell scripts (bench/scripts/gpu_window.sh, gpu_session.sh), run for real by bash here.

A GPU window is 30 minutes a session: a script that breaks there costs the window. What does not need a
GPU is run here on real files: the compile caches' round trip (caches-out on one "machine", install's
caches_in on another), the ladder's DEADLINE and MAX_SEQS=fit (the planner's real seats, the card told
by a stand-in nvidia-smi).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from rig import paths

SCRIPTS = paths.ROOT / "bench" / "scripts"


def _checkout(tmp: Path, name: str) -> Path:
    """A folder with the scripts where the device's checkout has them (both scripts use relative paths)."""
    root = tmp / name
    (root / "bench").mkdir(parents=True)
    shutil.copytree(SCRIPTS, root / "bench" / "scripts")
    return root


def _bash(cwd: Path, script: str, env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=cwd, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout)


def test_compile_caches_come_back_in_pieces_and_unpack_whole_or_not_at_all(tmp_path):
    """caches-out packs .rig/cache/{vllm,inductor,triton} (not the rest of .rig/cache) into 16 MiB pieces and
    their sha256s, 7 a call; install's caches_in on a fresh checkout unpacks them byte for byte, and a
    missing piece leaves the caches out (a cold start), saying so."""
    here = _checkout(tmp_path, "device")
    cache = here / ".rig" / "cache"
    blobs = {"vllm/torch_compile_cache/a.bin": os.urandom(20 * 2**20), "triton/b.bin": os.urandom(3 * 2**20),
             "inductor/c.txt": b"inductor\n"}
    for rel, data in blobs.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    (cache / "hf").mkdir()
    (cache / "hf" / "skip.txt").write_text("not a compile cache")
    out, pieces = tmp_path / "out", tmp_path / "pieces"
    out.mkdir()
    env = {"OUT": str(out), "GS": str(tmp_path / "gs"), "CACHES_OUT": str(pieces)}
    r = _bash(here, "bash bench/scripts/gpu_window.sh caches-out 0", env)
    assert r.returncode == 0, r.stderr
    assert "caches: 2 pieces of at most 16 MiB" in r.stdout and "call caches-out 0 .. 0" in r.stdout
    got = sorted(p.name for p in out.iterdir())
    assert got == ["caches.sha256", "caches.tgz.000", "caches.tgz.001"]
    assert max(p.stat().st_size for p in out.iterdir()) <= 16 * 2**20

    there = _checkout(tmp_path, "next-window")
    carry = tmp_path / "carry"
    shutil.copytree(out, carry)
    run_in = "set --; source bench/scripts/gpu_session.sh; caches_in"
    env2 = {"CARRY": str(carry), "OUT": str(tmp_path / "gs2")}
    r = _bash(there, run_in, env2)
    assert r.returncode == 0, r.stderr
    assert "caches: unpacked into .rig/cache" in r.stdout
    for rel, data in blobs.items():
        assert (there / ".rig" / "cache" / rel).read_bytes() == data
    assert not (there / ".rig" / "cache" / "hf").exists()

    shutil.rmtree(there / ".rig")
    (carry / "caches.tgz.001").unlink()
    r = _bash(there, run_in, env2)
    assert "caches: a piece is missing or damaged (above): not used, the serves start cold" in r.stdout
    assert not (there / ".rig" / "cache").exists()


def test_the_ladder_stops_before_a_rung_its_deadline_would_cut(tmp_path):
    """DEADLINE: a rung starts only with RUNG_S seconds to spare; without DEADLINE every rung runs."""
    root = _checkout(tmp_path, "device")
    ladder = ("set --; source bench/scripts/gpu_session.sh; inv() { :; }; "
              "serve_cell() { echo \"cell $1\"; }; step_ladder")
    env = {"OUT": str(tmp_path / "gs"), "LADDER": "a:X=1;b:X=2", "RUNG_S": "300"}
    late = _bash(root, f"DEADLINE=$(( $(date +%s) + 100 )); {ladder}", env)
    assert "stopping before a" in late.stdout and "cell " not in late.stdout
    early = _bash(root, f"DEADLINE=$(( $(date +%s) + 1000 )); {ladder}", env)
    assert "cell a" in early.stdout and "cell b" in early.stdout and "stopping" not in early.stdout
    assert "cell b" in _bash(root, ladder, env).stdout


def test_max_seqs_fit_is_the_planners_seats_on_the_pinned_3090_pool(tmp_path):
    """A rung's MAX_SEQS=fit: on an H200 (a stand-in nvidia-smi names it) pool_pin pins the rtx3090 plan's
    KV_MEM, and fit_seats reads the plan's seats: 36 with float32 state (the planner refuses 64), 64 with
    float16 (71 fit; the profile's MAX_SEQS caps it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200'\n")
    smi.chmod(0o755)
    script = """
set --; source bench/scripts/gpu_session.sh
# no GPU here: a plan that names no card is planned for the H200 the stand-in nvidia-smi names
inv() { case " $* " in *" --gpu "*) ;; *) [ "$1" = plan ] && set -- "$@" --gpu h200 ;; esac; "$PY" -m invoke "$@"; }
for ssm in float32 float16; do
  sets=(--set MODEL=fixture:qwen3.5-27b-class --set GPU_ARCH=sm90 --set INT8_ACT= --set MAMBA_SSM_DTYPE=$ssm)
  kv=$(pool_pin --profile batch --overlay gpu24 "${sets[@]}")
  echo "$ssm kv=$kv seats=$(fit_seats --profile batch --overlay gpu24 "${sets[@]}" --set KV_MEM=$kv)"
done
"""
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PY": sys.executable, "OUT": str(tmp_path / "gs"),
           "PYTHONPATH": str(paths.ROOT)}
    r = _bash(paths.ROOT, script, env, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.split("\n") if line.startswith("float"))
    kv32 = int(lines["float32"].split()[0].removeprefix("kv="))
    assert kv32 > 7 * 10**9 and lines["float32"].endswith("seats=36")
    assert lines["float16"].endswith("seats=64")


def test_a_rungs_overlays_and_protocol_replace_the_ladders_for_that_rung_only(tmp_path):
    """OVERLAYS=a,b, PROTOCOL=file and POOL_OF= in a rung reach that rung's plan, serve and bench (the 16k
    prefill under long-steps, its pool left to vLLM's profiling, beside ladder rungs under gpu24 alone on
    the pinned 3090 pool) and are not passed on as knobs; the next rung gets REAL_OVERLAYS, PROTOCOL and
    POOL_OF again. python is a stand-in that records its arguments (the pin's plan prints no JSON: the
    stand-in's KV_MEM is empty, so the pin shows as pool_pin's plan call, not as a KV_MEM set)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    fake_py = bin_dir / "fake-python"
    fake_py.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\necho 'rig: ready'\n"
                       "case \"$*\" in *serve*) exec sleep 30 ;; esac\n")
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 0\n")
    for f in (fake_py, smi):
        f.chmod(0o755)
    root = _checkout(tmp_path, "device")
    ladder = ("p16k:OVERLAYS=gpu24,long-steps PROTOCOL=bench/cells/prefill-16k.toml POOL_OF= PREFILL_ATTN=int8;"
              "fp16:INT8_ACT=")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PY": str(fake_py), "OUT": str(tmp_path / "gs"),
           "ARCH": "sm90", "POOL_OF": "rtx3090", "FIXTURE": "", "REAL_OVERLAYS": "gpu24",
           "PROTOCOL": "bench/cells/ladder-64.toml", "LADDER": ladder}
    r = _bash(root, "set --; source bench/scripts/gpu_session.sh; step_ladder", env)
    assert r.returncode == 0, r.stderr
    lines = calls.read_text().splitlines()
    p16k = [line for line in lines if "PREFILL_ATTN=int8" in line]
    fp16 = [line for line in lines if "INT8_ACT=" in line and "PREFILL_ATTN" not in line]
    assert any(" serve " in line for line in p16k) and any(" serve " in line for line in fp16)
    for line in p16k:
        assert "--overlay gpu24 --overlay long-steps" in line and "OVERLAYS" not in line and "PROTOCOL" not in line
    for line in fp16:
        assert "long-steps" not in line and "--overlay gpu24" in line
    pins = [line for line in lines if " plan " in line and "--gpu rtx3090" in line]
    assert pins and all("PREFILL_ATTN" not in line for line in pins)
    benches = [line for line in lines if " bench " in line]
    assert [b.split("--protocol ")[1].split()[0] for b in benches] == ["bench/cells/prefill-16k.toml",
                                                                        "bench/cells/ladder-64.toml"]


def test_the_ncu_step_profiles_each_config_and_splits_its_samples_by_region(tmp_path):
    """gpu_session.sh's ncu step with a stand-in ncu on PATH (it records its arguments; asked for the source page it
    prints a small real one) and python as stand-in sweep: one profile per NCU_ONLY config, each profiling only the
    decode split kernel of that config at 32k, and ncu_regions.py's table (the real script) in the step's files.
    Without ncu (NCU set empty: none found) the step says so and fails."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    page = ('"Kernel Name","decode_split_v5",\n"Address","Source","Warp Stall Sampling (All Samples)",'
            '"Instructions Executed","stall_wait"\n"0x10","MOV R1, R2","1","1","0"\n'
            '"0x20","HMMA.16816.F32 R4, R8, R12, R4","6","64","6"\n"0x30","@P0 BRA 0x20","1","64","1"\n'
            '"0x40","EXIT","0","1","0"\n')
    ncu = bin_dir / "ncu"
    ncu.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\ncase \"$*\" in *--page\\ source*) cat <<'EOF'\n{page}EOF\n"
                   ";; esac\n")
    ncu.chmod(0o755)
    root = _checkout(tmp_path, "device")
    out = tmp_path / "gs"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PY": sys.executable, "OUT": str(out), "NCU_ONLY": "35 52",
           "NCU_LEAST": "2"}
    (root / "bench" / "scripts" / "kvarn_decode_sweep.py").write_text("print('stand-in sweep')\n")
    r = _bash(root, f"mkdir -p {out}; set --; source bench/scripts/gpu_session.sh; step_ncu", env)
    assert r.returncode == 0, r.stderr + r.stdout
    runs = [line for line in calls.read_text().splitlines() if "--set full" in line]
    # --profile: the config's own launches only (a timing run launches the v1 reference's split kernel first)
    assert len(runs) == 2 and all("-k regex:decode_split -c 1" in line and "--lengths 32768 --profile" in line
                                  for line in runs), runs
    assert [line.split("--only ")[1].split()[0] for line in runs] == ["35", "52"], runs
    for idx in ("35", "52"):
        assert "| inner loop | 2 | 7 | 87.5 % |" in (out / f"ncu-{idx}-regions.txt").read_text()
    r = _bash(root, "set --; source bench/scripts/gpu_session.sh; step_ncu", {**env, "NCU": ""})
    assert r.returncode != 0 and "ncu: not found" in r.stdout, r.stdout + r.stderr
