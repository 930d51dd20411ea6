"""Profile + overlays + environment + --set -> one Plan: the `vllm serve` argv, its env, what it needs.

Resolution is a pure function of the repository's files and the given inputs, so the same
inputs give a byte-identical plan on any host (golden files in tests/golden/ hold us to it).
Precedence, lowest first: base < profile (its extends chain) < overlays in the order given <
the platform overlay (cpu/gpu: it states what the hardware can do) < environment knobs <
``--set KNOB=value``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rig import profiles
from rig.knobs import INT8_LAYER_ALIASES, KVARN_GROUP_TOKENS, KnobError, Knobs, coerce, validate

LOOPBACK = ("127.0.0.1", "localhost", "::1")
KEEP_MAX_ENV = "VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX"
FP8_ACT_ARCHS = ("sm89", "sm120")
# The shortest prompt at which rig's int8 prefill attention (pre-pass + kernel) measured faster than
# FlashAttention: 1.19x at 4,096 tokens, 0.83x at 2,048, 0.57x at 1,024 (H100, 2026-12-05,
# kernels/int8-prefill-attn/README.md). It gets a prompt a step at a time (the whole prompt or its first
# chunk fresh; later chunks of 512+ queries over their cached prefix, not yet measured on a GPU), so a
# step budget below this never hands it a fresh piece long enough to pay.
INT8_PREFILL_PAYS_FROM = 4096

# vLLM 0.28's quantized KV caches that only one CUDA attention backend runs: dtype -> (that backend, the oldest
# compute capability it runs the dtype on, 0 = every card). Read from vLLM's code, and asked of vLLM's own classes
# on every GPU_ARCH by tests/test_plan.py::test_kv_dtype_rules_are_what_vllms_backends_say:
# - the CUDA selector keeps the first of FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION, TURBOQUANT whose
#   validate_configuration passes (vllm/platforms/cuda.py _get_backend_priorities and get_valid_backends;
#   vllm/v1/attention/backend.py: supports_kv_cache_dtype, supports_compute_capability);
# - *_per_token_head: only TritonAttentionBackend lists them (supported_kv_cache_dtypes,
#   vllm/v1/attention/backends/triton_attn.py) and it takes every card (supports_compute_capability), but
#   TritonAttentionImpl.__init__ refuses any fp8* cache below SM89 ("native FP8 (fp8e4nv) requires SM89+");
# - turboquant_*: only TurboQuantAttentionBackend takes them (supports_kv_cache_dtype,
#   vllm/v1/attention/backends/turboquant_attn.py), on every card: below SM89 its fp8 keys (k8v4) are Triton's
#   fp8e4b15 (_use_fp8_e4b15, vllm/v1/attention/ops/triton_turboquant_decode.py);
# - vLLM's CPU backend runs none of them (CPUAttentionBackend.supported_kv_cache_dtypes is auto, fp8, fp8_e4m3,
#   fp8_e5m2: vllm/v1/attention/backends/cpu_attn.py), and vLLM does not refuse them there itself
#   (CpuPlatform.get_attn_backend_cls, vllm/platforms/cpu.py, never asks): rig refuses them.
_TRITON_FP8 = ("TritonAttentionImpl refuses an fp8 cache below SM89: native fp8e4nv "
               "(vllm/v1/attention/backends/triton_attn.py)")
KV_CUDA_ONLY: dict[str, tuple[str, int, str]] = {
    "int8_per_token_head": ("TRITON_ATTN", 0, ""),
    "int4_per_token_head": ("TRITON_ATTN", 0, ""),
    "fp8_per_token_head": ("TRITON_ATTN", 89, _TRITON_FP8),
    "turboquant_k8v4": ("TURBOQUANT", 0, ""),
    "turboquant_4bit_nc": ("TURBOQUANT", 0, ""),
    "turboquant_k3v4_nc": ("TURBOQUANT", 0, ""),
    "turboquant_3bit_nc": ("TURBOQUANT", 0, ""),
}


def _capability(arch: str) -> int:
    """GPU_ARCH as vLLM's DeviceCapability.to_int(): sm86 -> 86, sm120 -> 120."""
    return int(arch.removeprefix("sm"))


def kv_allowed(platform: str, arch: str) -> list[str]:
    """The KV values a plan may use on this platform and GPU_ARCH (every knob value the rules below do not refuse)."""
    values = Knobs.model_fields["KV"].annotation.__args__
    if platform == "cpu":
        return [v for v in values if v not in KV_CUDA_ONLY]
    return [v for v in values if KV_CUDA_ONLY.get(v, ("", 0, ""))[1] <= _capability(arch)]


def kv_rules(k: Knobs, platform: str) -> list[str]:
    """KV against the platform and GPU_ARCH, and kvarn's block size: the errors, each with what is allowed."""
    errors = []
    if k.KV == "kvarn" and (k.BLOCK_SIZE == 0 or k.BLOCK_SIZE % KVARN_GROUP_TOKENS):
        errors.append(f"BLOCK_SIZE={k.BLOCK_SIZE}: KV='kvarn' stores whole {KVARN_GROUP_TOKENS}-token groups, and "
                      f"vLLM aligns a hybrid model's attention block to BLOCK_SIZE, so only a multiple of "
                      f"{KVARN_GROUP_TOKENS} keeps every group inside one block (docs/kvarn.md); allowed: "
                      f"{KVARN_GROUP_TOKENS}, {2 * KVARN_GROUP_TOKENS}, ...; set BLOCK_SIZE={KVARN_GROUP_TOKENS}")
    if k.KV == "kvarn" and k.PREFILL_ATTN == "int8":
        errors.append("PREFILL_ATTN='int8' with KV='kvarn': rig's int8 prefill hooks FLASH_ATTN and FLASHINFER, "
                      "and a kvarn cache runs on rig's kvarn backend, so the kernel would never run; allowed with "
                      "it: 'auto'")
    if k.KV == "kvarn" and k.PREFIX_CACHE:
        errors.append("PREFIX_CACHE=1 with KV='kvarn': each request's newest < 128 tokens stay unpacked in a "
                      "per-request slot outside vLLM's blocks, which hybrid prefix caching (mamba cache mode "
                      "align) cannot checkpoint (docs/kvarn.md, \"The backend in vLLM\"); allowed with kvarn: 0")
    if platform == "cpu":
        allowed_here = ", ".join(repr(v) for v in kv_allowed("cpu", "cpu"))
        if k.KV in KV_CUDA_ONLY:
            errors.append(f"KV={k.KV!r}: vLLM 0.28 runs it only on CUDA ({KV_CUDA_ONLY[k.KV][0]}); its CPU attention "
                          "backend takes auto, fp8, fp8_e4m3, fp8_e5m2 (vllm/v1/attention/backends/cpu_attn.py) and "
                          "vLLM would not refuse it there: the CPU kernels would read it as "
                          + ("fp8" if k.KV.endswith("_per_token_head") else "a plain byte cache")
                          + f"; allowed on cpu: {allowed_here}")
        return errors
    backend, need, why = KV_CUDA_ONLY.get(k.KV, ("", 0, ""))
    if backend and k.PREFILL_ATTN == "int8":
        errors.append(f"PREFILL_ATTN='int8' with KV={k.KV!r}: rig's int8 prefill hooks FLASH_ATTN and FLASHINFER "
                      f"(patches/prefill-attn-int8.patch), and vLLM runs this cache on {backend}, so the kernel "
                      "would never run; allowed with it: 'auto'; or a KV that runs on FlashAttention/FlashInfer "
                      "('auto', 'fp8', 'bfloat16', ...)")
    if k.GPU_ARCH != "cpu" and need > _capability(k.GPU_ARCH):
        allowed_here = ", ".join(repr(v) for v in kv_allowed(platform, k.GPU_ARCH))
        newer = ", ".join(a for a in Knobs.model_fields["GPU_ARCH"].annotation.__args__
                          if a != "cpu" and _capability(a) >= need)
        errors.append(f"KV={k.KV!r}: vLLM 0.28 runs it on {backend} from SM{need} on ({why}); the target is "
                      f"GPU_ARCH={k.GPU_ARCH!r} (the RTX 3090 is sm86); allowed there: {allowed_here}; or a "
                      f"GPU_ARCH of {newer}")
    return errors


class PlanError(ValueError):
    """The inputs cannot make a valid plan; ``messages`` name each knob, value and what is allowed."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("\n".join(messages))
        self.messages = messages


class Plan(BaseModel):
    """Everything `serve` needs to start one server, and nothing host-specific."""

    model_config = ConfigDict(frozen=True)

    schema_version: Literal[1] = 1
    profile: str = Field(description="profile name (file stem under profiles/)")
    overlays: list[str] = Field(description="overlays applied, in order (the platform overlay last)")
    platform: Literal["cpu", "gpu"] = Field(description="where it runs: vLLM's CPU backend or CUDA")
    knobs: dict[str, Any] = Field(description="every knob's resolved value")
    sources: dict[str, str] = Field(description="where each knob's value came from")
    model: str = Field(description="checkpoint folder, relative to the repository when inside it")
    served_name: str = Field(description="--served-model-name")
    argv: list[str] = Field(description="the `vllm serve` command line")
    env: dict[str, str] = Field(description="environment variables the server needs (besides caches, API key)")
    patches: list[str] = Field(description="vLLM patches (patches/series) the plan relies on")
    kernels: list[str] = Field(description="rig kernels (kernels/) the plan relies on")
    api_key_file: str = Field(description="where the API key is read from (and generated if absent)")
    warnings: list[str] = Field(description="knob values that were adjusted or ignored, and why")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=2, sort_keys=True) + "\n"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def detect_platform() -> Literal["cpu", "gpu"]:
    """gpu when NVML finds a CUDA device, else cpu (the embedded default)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return "gpu" if pynvml.nvmlDeviceGetCount() > 0 else "cpu"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: a CPU host
        return "cpu"


def _layer(values: dict, sources: dict, knobs: Mapping[str, Any], source: str) -> None:
    for k, v in knobs.items():
        values[k] = v
        sources[k] = source


def gather(profile: str, overlays: Sequence[str], platform: str, environ: Mapping[str, str],
           sets: Mapping[str, str]) -> tuple[dict, dict, profiles.ProfileFile, list[str]]:
    """Knob values and their sources, layer by layer, before validation."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    lineage = profiles.chain(profile)
    for link in lineage:
        _layer(values, sources, profiles.load_file(link).knobs, f"profile:{link}")
    names = [o for o in overlays if o not in ("cpu", "gpu")] + [platform]
    pf = profiles.merged(profile)
    serve, env = dict(pf.serve), dict(pf.env)
    for name in names:
        ov = profiles.load_file(name, "overlay")
        _layer(values, sources, ov.knobs, f"overlay:{name}")
        serve.update(ov.serve)  # an overlay's always-on options and environment win over the profile's
        env.update(ov.env)
        for link in lineage:
            if link in ov.profiles:
                _layer(values, sources, ov.profiles[link].knobs, f"overlay:{name}[{link}]")
    known = set(Knobs.model_fields)
    _layer(values, sources, {k: coerce(k, v) for k, v in environ.items() if k in known}, "env")
    bad = [k for k in sets if k not in known]
    if bad:
        raise PlanError([f"--set {k}: unknown knob; known knobs are {', '.join(sorted(known))}" for k in bad])
    _layer(values, sources, {k: coerce(k, v) for k, v in sets.items()}, "--set")
    return values, sources, pf.model_copy(update={"serve": serve, "env": env}), names


def rules(k: Knobs, pf: profiles.ProfileFile, platform: str) -> tuple[list[str], list[str], dict[str, Any]]:
    """Cross-knob rules: (errors, warnings, knob overrides the rules impose)."""
    errors: list[str] = []
    warnings: list[str] = []
    fix: dict[str, Any] = {}
    if k.SPEC != "off" and not pf.speculative:
        warnings.append(f"SPEC={k.SPEC!r} is ignored on this profile (speculative decoding costs batch throughput)")
        fix["SPEC"] = "off"
    errors += kv_rules(k, platform)
    if k.KV == "kvarn" and platform == "gpu":
        warnings.append("KV='kvarn' on a GPU runs rig's kvarn backend with its Triton engine, eager (no CUDA graphs: "
                        "each step is planned on the host), and a prompt's later chunks attend over their dequantized "
                        "context with a dense mask (chunk x context booleans): slower than vLLM's own caches "
                        "(docs/kvarn.md, \"The backend in vLLM\"). KV=fp8 is the fast choice today")
    if k.INT8_ACT == "fp8" and k.GPU_ARCH not in FP8_ACT_ARCHS:
        errors.append(f"INT8_ACT='fp8': fp8 activations need SM89 or SM12x, the target is {k.GPU_ARCH} "
                      f"(the RTX 3090 is sm86); allowed there: '', 'int8'")
    if platform == "cpu":
        if k.GPU_ARCH != "cpu":
            errors.append(f"GPU_ARCH={k.GPU_ARCH!r}: the cpu platform needs GPU_ARCH='cpu'")
        if k.INT8_ACT:
            errors.append(f"INT8_ACT={k.INT8_ACT!r}: Marlin int8 activations are CUDA-only; allowed on cpu: ''")
        if k.PREFILL_ATTN != "auto":
            errors.append(f"PREFILL_ATTN={k.PREFILL_ATTN!r}: a CUDA kernel; allowed on cpu: 'auto'")
        if k.SPEC != "off" and fix.get("SPEC") != "off":
            errors.append(f"SPEC={k.SPEC!r}: vLLM 0.28's CPU backend cannot decode speculatively on this hybrid "
                          "model (its GDN decode kernel fails on a burst of short requests; docs/profiles.md); "
                          "allowed on cpu: 'off'")
    elif k.GPU_ARCH == "cpu":
        errors.append("GPU_ARCH='cpu' on the gpu platform; allowed: sm86, sm89, sm90, sm100, sm120")
    if k.KEEP_CHECKPOINTS and not k.PREFIX_CACHE:
        errors.append("KEEP_CHECKPOINTS=1: keeps prefix-cache checkpoints, so it needs PREFIX_CACHE=1; allowed: 0")
    if k.MODEL.startswith("fixture:") and "fixture" not in k.SERVED_NAME:
        fix["SERVED_NAME"] = f"{k.MODEL.split(':', 1)[1]}-FIXTURE-random-weights"
        warnings.append(f"MODEL={k.MODEL!r} is a benchmark fixture (random weights, its text is noise): served as "
                        f"{fix['SERVED_NAME']!r} so no result mistakes it for a model")
    chunk = int(pf.serve.get("max_num_batched_tokens") or 0)
    if platform == "gpu" and k.PREFILL_ATTN == "int8" and 0 < chunk < INT8_PREFILL_PAYS_FROM:
        warnings.append(f"PREFILL_ATTN='int8' gets a prompt's tokens a step at a time (its first chunk fresh, later "
                        f"chunks over their cached prefix), and this profile's steps take {chunk:,} tokens "
                        f"(max_num_batched_tokens): a fresh piece of 2,048 tokens or fewer measured slower than "
                        f"FlashAttention (0.83x at 2,048, H100), faster from {INT8_PREFILL_PAYS_FROM:,}, and "
                        f"later chunks over a prefix are not measured on a GPU yet "
                        f"(kernels/int8-prefill-attn/README.md); keep 'auto' unless the profile's steps take at "
                        f"least {INT8_PREFILL_PAYS_FROM:,} tokens")
    if k.HOST not in LOOPBACK:
        warnings.append(f"HOST={k.HOST!r} is reachable from the network: every request needs the API key")
    if k.TOOLS and k.TOOL_PARSER == "hermes":
        warnings.append("TOOL_PARSER='hermes' parses JSON calls; this model emits XML calls, which will come back "
                        "as plain text (use qwen3_coder)")
    if k.EXECUTOR == "ray" and k.PP * k.TP == 1:
        warnings.append("EXECUTOR='ray' with TP=1 and PP=1 runs on one GPU: the Ray cluster is unused")
    return errors, warnings, fix


def environment_rules(k: Knobs, environ: Mapping[str, str]) -> list[str]:
    """Patch variables set directly in the environment that the server would see: refused when they clash.

    The server starts with this environment under the plan's env, so with KEEP_CHECKPOINTS=1 the
    knob's value replaces a direct VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX; a different one (a typo,
    a malformed value) is refused here, before a server starts, instead of being silently replaced.
    """
    errors = []
    direct = environ.get(KEEP_MAX_ENV)
    if k.KEEP_CHECKPOINTS and direct is not None and direct.strip() != str(k.KEEP_CHECKPOINTS_MAX):
        errors.append(f"{KEEP_MAX_ENV}={direct!r} (set in the environment): with KEEP_CHECKPOINTS=1 rig sets it "
                      f"from the knob KEEP_CHECKPOINTS_MAX (now {k.KEEP_CHECKPOINTS_MAX}); allowed: unset, or "
                      f"the same value; to change it unset {KEEP_MAX_ENV} and set KEEP_CHECKPOINTS_MAX=<int >= 1>")
    return errors


def _flag(name: str, value: Any) -> list[str]:
    """vLLM's own convention: snake -> --kebab, bool -> --x / --no-x, dict -> JSON."""
    opt = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [opt] if value else ["--no-" + name.replace("_", "-")]
    if isinstance(value, dict):
        return [opt, json.dumps(value, sort_keys=True, separators=(",", ":"))]
    return [opt, str(value)]


def model_path(ref: str) -> str:
    """`tiny:<arch>` / `fixture:<shape>` -> the folder rig builds it in (relative to the repo when inside it)."""
    if ref.startswith("fixture:"):
        from rig import paths
        from rig.models import fixture

        try:
            folder = paths.models_dir() / fixture.FixtureSpec(ref.split(":", 1)[1]).name
        except fixture.FixtureError as e:
            raise PlanError([f"MODEL={ref!r}: {e}"]) from None
        try:
            return str(folder.relative_to(paths.ROOT))
        except ValueError:
            return str(folder)
    if ref.startswith("tiny:"):
        from rig import paths
        from rig.models.tiny import TinySpec

        arch = ref.split(":", 1)[1]
        if arch not in ("hybrid", "dense"):
            raise PlanError([f"MODEL={ref!r}: unknown tiny model; allowed: tiny:hybrid, tiny:dense"])
        folder = paths.models_dir() / TinySpec(arch=arch).name
        try:
            return str(folder.relative_to(paths.ROOT))
        except ValueError:
            return str(folder)
    return ref


def build_argv(k: Knobs, pf: profiles.ProfileFile, model: str) -> list[str]:
    """The `vllm serve` command line for validated knobs (pure)."""
    argv = ["vllm", "serve", model,
            "--host", k.HOST, "--port", str(k.PORT), "--served-model-name", k.SERVED_NAME,
            "--max-model-len", str(k.MAX_LEN), "--max-num-seqs", str(k.MAX_SEQS),
            "--gpu-memory-utilization", str(k.GPU_UTIL), "--mamba-ssm-cache-dtype", k.MAMBA_SSM_DTYPE]
    if k.PREFIX_CACHE:
        argv += ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    else:
        argv += ["--no-enable-prefix-caching"]
    if k.KV_MEM:
        argv += ["--kv-cache-memory-bytes", str(k.KV_MEM)]
    if k.KV != "auto":
        argv += ["--kv-cache-dtype", k.KV]
    if k.BLOCK_SIZE:
        argv += ["--block-size", str(k.BLOCK_SIZE)]
    if k.TOOLS:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", k.TOOL_PARSER]
    if k.SPEC == "mtp":
        argv += _flag("speculative_config", {"method": "mtp", "num_speculative_tokens": k.SPEC_K})
    elif k.SPEC == "dflash2":
        argv += _flag("speculative_config",
                      {"method": "dflash", "model": k.DRAFT_MODEL, "num_speculative_tokens": k.SPEC_K})
    if k.TP > 1:
        argv += ["--tensor-parallel-size", str(k.TP)]
    if k.PP > 1:
        argv += ["--pipeline-parallel-size", str(k.PP)]
    if k.EXECUTOR == "ray":
        argv += ["--distributed-executor-backend", "ray"]
    if k.ENFORCE_EAGER:
        argv += ["--enforce-eager"]
    for name in sorted(pf.serve):
        argv += _flag(name, pf.serve[name])
    return argv


def needs(k: Knobs) -> tuple[dict[str, str], list[str], list[str]]:
    """(env, patches, kernels) the knobs imply."""
    # Every server has an API key; with this patch knob it guards every path but /health, /ping, /version.
    env: dict[str, str] = {"VLLM_AUTH_DENY_DEFAULT": "1"}
    patches = ["auth-deny-default"]
    kernels: list[str] = []
    if k.INT8_ACT:
        env["VLLM_MARLIN_INPUT_DTYPE"] = k.INT8_ACT
        env["VLLM_MARLIN_INT8_INCLUDE_RE"] = INT8_LAYER_ALIASES.get(k.INT8_LAYERS, k.INT8_LAYERS)
        # On Hopper vLLM 0.28 picks Machete for W4A16 and hands it the int8 input dtype, which it
        # cannot prepack ("prepack_B_dispatch ... not implemented for atype = Char", seen on an
        # H200, docs/gpu.md); with Machete off every card runs Marlin, the 3090's kernel.
        env["VLLM_DISABLED_KERNELS"] = "MacheteLinearKernel"
        patches.append("marlin-int8-layer-select")
    if k.TOOLS:  # a required or named tool_choice is enforced (vLLM 0.28 ignores it with qwen3 + qwen3_coder)
        env["VLLM_TOOL_CHOICE_SHARED_ENGINE"] = "1"
        patches.append("tool-choice-shared-engine")
    if k.KEEP_CHECKPOINTS:
        env["VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS"] = "1"
        env[KEEP_MAX_ENV] = str(k.KEEP_CHECKPOINTS_MAX)  # read by the patch only with the knob on
        patches.append("mamba-align-checkpoint-order")
    if k.KV == "kvarn":  # rig's backend (kernels/kvarn/vllm_backend.py), loaded by the patch from this folder
        from rig.kernels import kvarn_env

        env.update(kvarn_env())
        patches.append("kvarn-cache")
    if k.PREFILL_ATTN == "int8":  # fresh prefills on rig's int8-QK kernel (patch prefill-attn-int8)
        env["VLLM_RIG_PREFILL_ATTN"] = "int8"
        patches.append("prefill-attn-int8")
        kernels.append("int8-prefill-attn")
    if kernels:  # where the server finds kernels/ and their builds (made absolute when it starts)
        from rig.kernels import plan_env

        env.update(plan_env())
    return env, sorted(patches), kernels


def platform_needs(platform: str, model: str) -> tuple[dict[str, str], list[str]]:
    """(env, patches) the platform implies for this model, beyond what the knobs do.

    On CPU a quantized checkpoint (a ``quantization_config`` in its config.json) runs vLLM's CPU W4A16
    linear kernel, and beside it vLLM's AMX attention kernel killed the worker with SIGILL on an AMX
    host (patch cpu-attn-amx-off, docs/patches.md): such a model gets the vector attention kernel. Where
    vLLM's CPU build has no W4A16 kernel (its AVX2 build) the layers multiply dequantized weights instead
    (patch cpu-wna16-dense-fallback, VLLM_RIG_CPU_WNA16_DENSE=1). Both are asked on every CPU host,
    whatever its ISA, so that a plan never depends on the host's ISA.
    """
    if platform != "cpu":
        return {}, []
    from rig.capacity.cpuisa import quantized_checkpoint

    if not quantized_checkpoint(Path(model)):
        return {}, []
    return ({"VLLM_RIG_CPU_ATTN_AMX": "0", "VLLM_RIG_CPU_WNA16_DENSE": "1"},
            ["cpu-attn-amx-off", "cpu-wna16-dense-fallback"])


def resolve(profile: str, overlays: Sequence[str] = (), platform: str | None = None,
            environ: Mapping[str, str] | None = None, sets: Mapping[str, str] | None = None) -> Plan:
    """The plan for these inputs; PlanError (listing every problem) when they are invalid."""
    platform = platform or detect_platform()
    environ = os.environ if environ is None else environ
    try:
        values, sources, pf, applied = gather(profile, overlays, platform, environ, sets or {})
    except profiles.ProfileError as e:
        raise PlanError([str(e)]) from None
    try:
        knobs = validate(values)
    except KnobError as e:
        raise PlanError([f"{m} (set by {sources.get(m.split('=')[0], '?')})" for m in e.messages]) from None
    errors, warnings, fix = rules(knobs, pf, platform)
    errors += environment_rules(knobs, environ)
    if errors:
        raise PlanError(errors)
    knobs = knobs.model_copy(update=fix)
    for name in fix:
        sources[name] = "rule"
    model = model_path(knobs.MODEL)
    env, patches, kernels = needs(knobs)
    host_env, host_patches = platform_needs(platform, model)
    env.update(host_env)
    patches = sorted(patches + host_patches)
    return Plan(
        profile=profile, overlays=applied, platform=platform,
        knobs=knobs.model_dump(), sources=dict(sorted(sources.items())),
        model=model, served_name=knobs.SERVED_NAME, argv=build_argv(knobs, pf, model),
        env={**pf.env, **env}, patches=patches, kernels=kernels,
        api_key_file=knobs.API_KEY_FILE, warnings=warnings,
    )


def check_with_vllm(argv: Sequence[str]) -> None:
    """Parse the argv with vLLM 0.28's own `serve` parser (imported, not copied): PlanError if it refuses."""
    import contextlib
    import io

    # Importing vLLM logs platform chatter: quiet it for the import only. Left in os.environ, the
    # setting would reach every server this process starts later and hide their INFO lines (the
    # KV pool, the attention backend) from the logs rig reads back.
    saved = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ["VLLM_LOGGING_LEVEL"] = saved or "ERROR"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
            from vllm.utils.argparse_utils import FlexibleArgumentParser
    finally:
        if saved is None:
            del os.environ["VLLM_LOGGING_LEVEL"]

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(list(argv[2:]))
        validate_parsed_serve_args(args)
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        raise PlanError([f"vLLM's serve parser refused the plan: {msg[-1] if msg else 'unknown error'}"]) from None
    except (TypeError, ValueError) as e:
        raise PlanError([f"vLLM's serve parser refused the plan: {e}"]) from None
