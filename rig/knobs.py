"""The knobs users turn, typed and documented in one place; their defaults live in profiles/base.toml.

Names are the environment variables users already type (``PREFIX_CACHE=1``, ``KV=kvarn`` …), as
in the stack rig rebuilds. Each field's ``description`` is its one line of doc: docs/profiles.md
and ``inv serve --help-knobs`` are generated from it, so the reference cannot drift.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# INT8_LAYERS shorthands -> regex searched in each linear layer's prefix.
INT8_LAYER_ALIASES = {"mlp": r"\.mlp\.", "gate_up": r"\.mlp\.gate_up_proj", ".": "."}
# The real model: 24 query heads, 4 KV heads. Tensor parallel must divide both.
QUERY_HEADS, KV_HEADS = 24, 4
# KV=kvarn keeps whole 128-token groups in a vLLM block: BLOCK_SIZE must be a multiple of the group
# (GROUP_TOKENS of kernels/kvarn/reference.py, which imports torch: resolving a plan does not, so the number
# is written here too and tests/test_plan.py holds the two equal; docs/kvarn.md "vLLM integration" says why).
KVARN_GROUP_TOKENS = 128


class Knobs(BaseModel):
    """Every knob of a profile. No defaults here: profiles/base.toml holds them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    PREFIX_CACHE: Literal[0, 1] = Field(
        description=(
            "1 = reuse a shared prompt prefix across requests (--enable-prefix-caching --mamba-cache-mode align); "
            "0 = explicitly off (--no-enable-prefix-caching: 0.28 turns it on by default for these models)"
        )
    )
    KV: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "int8_per_token_head",
                "int4_per_token_head", "fp8_per_token_head", "turboquant_k8v4", "turboquant_4bit_nc",
                "turboquant_k3v4_nc", "turboquant_3bit_nc", "kvarn"] = Field(
        description=(
            "KV cache dtype (--kv-cache-dtype); `*_per_token_head` (Triton backend) and `turboquant_*` (TurboQuant "
            "backend) are vLLM's own, CUDA only, `fp8_per_token_head` from sm89; `kvarn` = the KVarN 4/2-bit cache "
            "(262k context: rig's backend, patch kvarn-cache; BLOCK_SIZE a multiple of 128, PREFIX_CACHE=0)"
        )
    )
    INT8_ACT: Literal["", "int8", "fp8"] = Field(
        description=(
            "activations on the Marlin int4 GEMMs: `int8` (int8 tensor cores, weights stay int4), "
            "empty = plain W4A16; `fp8` is refused on SM86 (RTX 3090)"
        )
    )
    INT8_LAYERS: str = Field(
        description=(
            "which layers get int8 activations: `mlp`, `gate_up` (gentle), `.` (every linear) or a regex "
            "searched in the layer name"
        )
    )
    MAX_SEQS: int = Field(ge=1, le=1024, description="scheduler slots (--max-num-seqs)")
    MAX_LEN: int = Field(ge=256, le=1_048_576, description="max context in tokens (--max-model-len)")
    TOOLS: Literal[0, 1] = Field(
        description=(
            "tool calling (--enable-auto-tool-choice --tool-call-parser TOOL_PARSER); 0 = off, and "
            "`tool_choice: auto` then answers 400"
        )
    )
    TOOL_PARSER: Literal["qwen3_coder", "qwen3_xml", "hermes"] = Field(
        description=(
            "tool-call parser; must match the model's XML call format (`qwen3_coder`); `hermes` parses JSON calls "
            "this model never emits and fails silently"
        )
    )
    PORT: int = Field(ge=1, le=65535, description="TCP port of the OpenAI-compatible server")
    HOST: str = Field(
        min_length=1,
        pattern=r"^[^\s]+$",
        description="bind address; loopback by default, 0.0.0.0 only with the API key (always on)",
    )
    GPU_UTIL: float = Field(
        gt=0,
        lt=1,
        description=("share of GPU memory vLLM may use (on CPU: of the NUMA node's RAM); use 0.93 for prompt_logprobs"),
    )
    GPU_MEM: int = Field(
        ge=0,
        le=2**50,
        description=(
            "GPU memory to plan for, in bytes (vLLM's syntax: 24G = 24 GiB); vLLM may use GPU_UTIL of it in all "
            "(weights, activations, CUDA graphs, KV). 0 = the whole card. The gpu24 overlay sets 24G: a bigger "
            "GPU then sizes its KV pool as an RTX 3090 does; also keeps room for a desktop"
        ),
    )
    KV_MEM: int = Field(
        ge=0,
        le=2**50,
        description=(
            "KV cache size in bytes (--kv-cache-memory-bytes; vLLM's syntax: 3G = 3 GiB, 3g = 3e9); "
            "0 = sized by GPU_UTIL. The cpu overlay fixes it so the pool is the same on every host"
        ),
    )
    SPEC: Literal["off", "mtp", "dflash2"] = Field(
        description=(
            "speculative decoding: `dflash2` (DFlash2 drafter, DRAFT_MODEL), `mtp` (the model's MTP head), `off`"
        )
    )
    SPEC_K: int = Field(ge=1, le=32, description="draft tokens per step (num_speculative_tokens)")
    DRAFT_MODEL: str = Field(min_length=1, description="DFlash2 drafter checkpoint (SPEC=dflash2)")
    PREFILL_ATTN: Literal["auto", "int8"] = Field(
        description=("prefill attention kernel: `auto` (vLLM's choice) or `int8` (needs kernels/int8-prefill-attn)")
    )
    MODEL: str = Field(
        min_length=1,
        description=("checkpoint folder, or `tiny:hybrid` / `tiny:dense` for a model rig builds, or "
                     "`fixture:<shape>` for a random-weight benchmark fixture of models/<shape>.toml (never a model)"),
    )
    SERVED_NAME: str = Field(min_length=1, description="model name clients send (--served-model-name)")
    API_KEY_FILE: str = Field(min_length=1, description="file holding the API key (generated, mode 0600, when absent)")
    TP: int = Field(ge=1, le=8, description="tensor-parallel GPUs (--tensor-parallel-size); must divide 24 and 4")
    PP: int = Field(ge=1, le=8, description="pipeline-parallel stages (--pipeline-parallel-size), e.g. across hosts")
    EXECUTOR: Literal["mp", "ray"] = Field(description="distributed executor: `mp` (one host) or `ray` (multi-node)")
    MAMBA_SSM_DTYPE: Literal["float16", "bfloat16", "float32"] = Field(
        description=("recurrent (GDN) state dtype (--mamba-ssm-cache-dtype): fp16 fits ~2x the requests of fp32 "
                     "(the reference stack's figure, RTX 3090: ~70 requests with fp16, 37 with fp32)")
    )
    BLOCK_SIZE: int = Field(ge=0, le=4096, description="KV block size in tokens; 0 = vLLM's choice")
    GPU_ARCH: Literal["sm86", "sm89", "sm90", "sm100", "sm120", "cpu"] = Field(
        description=(
            "the target the plan is validated for (the RTX 3090 is sm86); serve checks the real device matches"
        )
    )
    KEEP_CHECKPOINTS: Literal[0, 1] = Field(
        description=(
            "1 = keep a conversation's mamba state checkpoints until its attention blocks go (patch "
            "mamba-align-checkpoint-order, VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS); needs PREFIX_CACHE=1"
        )
    )
    KEEP_CHECKPOINTS_MAX: int = Field(
        ge=1,
        description=(
            "checkpoints kept per request and mamba group with KEEP_CHECKPOINTS=1 (exported as "
            "VLLM_MAMBA_ALIGN_KEEP_CHECKPOINTS_MAX only then; the patch also caps them at 1/16 of the pool)"
        ),
    )
    ENFORCE_EAGER: Literal[0, 1] = Field(description="1 = no torch.compile / CUDA graphs (faster start, slower run)")

    @field_validator("INT8_LAYERS")
    @classmethod
    def _regex(cls, v: str) -> str:
        try:
            re.compile(INT8_LAYER_ALIASES.get(v, v))
        except re.error as e:
            raise ValueError(f"not a valid regex ({e}); use mlp, gate_up, . or a Python regex") from e
        return v

    @field_validator("INT8_LAYERS")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("empty: an empty include regex would match every layer; to turn int8 activations off "
                             "set INT8_ACT='' (empty), for every layer say '.'")
        return v

    @field_validator("KV_MEM", "GPU_MEM", mode="before")
    @classmethod
    def _bytes(cls, v: Any) -> Any:
        return parse_bytes(v) if isinstance(v, str) else v

    @field_validator("TP")
    @classmethod
    def _tp(cls, v: int) -> int:
        if QUERY_HEADS % v or KV_HEADS % v:
            raise ValueError(f"must divide the {QUERY_HEADS} query and {KV_HEADS} KV heads: 1, 2 or 4")
        return v


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")
_UNIT = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int | str:
    """A byte count the way `vllm serve` reads --kv-cache-memory-bytes: 1G = 2**30, 1g = 10**9, 1024.

    The grammar of vLLM's ``human_readable_int`` (tests hold the two equal), written out so that
    resolving a plan does not import vLLM and torch. Text it cannot read is returned unchanged,
    for the validator to refuse with the allowed forms.
    """
    value = text.strip()
    m = _SIZE.fullmatch(value)
    if m:
        number, unit = m.groups()
        if unit.islower():
            return int(float(number) * _UNIT[unit])
        return int(number) * _UNIT[unit] if number.isdigit() else text
    try:
        return int(value)
    except ValueError:
        return text


def coerce(name: str, raw: Any) -> Any:
    """Turn an environment / --set string into the knob's type (TOML values pass through)."""
    if not isinstance(raw, str):
        return raw
    ann = Knobs.model_fields[name].annotation
    if ann is int or (getattr(ann, "__args__", None) and all(isinstance(a, int) for a in ann.__args__)):
        try:
            return int(raw)
        except ValueError:
            return raw
    if ann is float:
        try:
            return float(raw)
        except ValueError:
            return raw
    return raw


def allowed(name: str) -> str:
    """Human text for the values a knob accepts (for error messages and docs)."""
    field = Knobs.model_fields[name]
    args = getattr(field.annotation, "__args__", None)
    if args:
        return ", ".join(repr(a) for a in args)
    if field.annotation is str:
        return "mlp, gate_up, . or a regex" if name == "INT8_LAYERS" else "a string"
    if name == "KV_MEM":
        return "bytes >= 0, e.g. 3221225472, 3G (GiB) or 3g (10**9); 0 = sized by GPU_UTIL"
    if name == "GPU_MEM":
        return "bytes >= 0, e.g. 24G (GiB) or 24g (10**9); 0 = the whole card"
    bounds = []
    for m in field.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{op} {getattr(m, attr)}")
    text = f"{field.annotation.__name__} " + " and ".join(bounds)
    return text + ("; one of 1, 2, 4" if name == "TP" else "")


def validate(values: dict[str, Any]) -> Knobs:
    """Build Knobs or raise KnobError naming every bad knob, its value and what is allowed."""
    unknown = sorted(set(values) - set(Knobs.model_fields))
    if unknown:
        raise KnobError([f"unknown knob {u}: known knobs are {', '.join(Knobs.model_fields)}" for u in unknown])
    try:
        return Knobs(**values)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else "?"
            got = values.get(name, "<missing>")
            why = err["msg"].removeprefix("Value error, ")
            msgs.append(f"{name}={got!r}: {why}; allowed: {allowed(name) if name in Knobs.model_fields else '?'}")
        raise KnobError(msgs) from None


class KnobError(ValueError):
    """One or more knobs have bad values; each message names knob, value and what is allowed."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("\n".join(messages))
        self.messages = messages
