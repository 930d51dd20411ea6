"""Bench protocols as data: bench/*.toml, one pydantic model per kind, loaded by a sorted glob.

Every file declares ``schema_version`` and ``kind``; unknown keys and unknown kinds are errors
that name the file, the key and what is allowed. Protocol names are file stems. The sizes in the
files are the reference's (RTX 3090); :class:`Scale` shrinks every token length and request
count by one factor for CPU runs — the same code path, smaller numbers.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from rig import paths

SCHEMA_VERSION = 1
# One factor for every size on the CPU backend (tests, the embedded default): 1/8 turns the
# 100k-token prefill into 12.5k tokens (the tiny model's context is 32k) and 256 prompts into 32,
# which a 2-core host runs in minutes with decode windows long enough to sample.
CPU_SCALE = 1 / 8


class BenchError(ValueError):
    """A bench file or argument is invalid; the message names it, what was expected and the fix."""


class Scale(BaseModel):
    """How sizes shrink: ``max(floor, ceil(n * factor))`` for token lengths and request counts."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    factor: float = Field(1.0, gt=0, le=1, description="multiplier for every token length and request count")
    min_tokens: int = Field(4, description="no scaled token length goes below this")
    min_requests: int = Field(1, description="no scaled request count goes below this")

    def tokens(self, n: int) -> int:
        """A scaled token length; a length already under the floor (a 1-token output) stays as it is."""
        return n if self.factor == 1 else max(min(self.min_tokens, n), math.ceil(n * self.factor))

    def count(self, n: int) -> int:
        return n if self.factor == 1 else max(self.min_requests, math.ceil(n * self.factor))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RandomCell(_Strict):
    """One `vllm bench serve` call on the random dataset."""

    input_len: int = Field(gt=0, description="prompt tokens per request (--random-input-len)")
    output_len: int = Field(gt=0, description="generated tokens per request (--random-output-len, with --ignore-eos)")
    concurrency: int = Field(gt=0, description="requests in flight at once (--max-concurrency)")
    num_prompts: int = Field(gt=0, description="requests in the pass (--num-prompts)")

    def scaled(self, s: Scale, max_concurrency: int) -> RandomCell:
        """The cell at scale ``s``: concurrency capped by the server's slots, at least one full round of it."""
        conc = min(self.concurrency, max_concurrency)
        n = self.num_prompts if s.factor == 1 else max(conc, s.count(self.num_prompts))
        return RandomCell(input_len=s.tokens(self.input_len), output_len=s.tokens(self.output_len),
                          concurrency=min(conc, n), num_prompts=n)

    @property
    def label(self) -> str:
        return f"{self.input_len}/{self.output_len} c{self.concurrency} n{self.num_prompts}"


class _Protocol(_Strict):
    schema_version: Literal[1] = Field(description="format version of this file")
    description: str = Field(description="one line: what this protocol measures")
    requires: dict[str, Any] = Field(default_factory=dict,
                                     description="knob values the server must have (checked before anything runs)")


class ThroughputProtocol(_Protocol):
    """Aggregate decode throughput on the random dataset (the reference's Benchmarks table)."""

    kind: Literal["throughput"] = Field(description="protocol kind")
    cells: list[RandomCell] = Field(min_length=1, description="workloads, in table order")
    steady_state: bool = Field(True, description="sample /metrics for steady-state decode")


class PrefillProtocol(_Protocol):
    """Prompt processing with 1-token outputs, by input length and concurrency (the Prefill table)."""

    kind: Literal["prefill"] = Field(description="protocol kind")
    cells: list[RandomCell] = Field(min_length=1, description="workloads; output_len must be 1")


class RawProtocol(_Protocol):
    """The raw-engine cells: PP from 1-token runs, TG = C x 1000 / mean TPOT, one token per round."""

    kind: Literal["raw"] = Field(description="protocol kind")
    input_len: int = Field(gt=0, description="prompt tokens per request")
    output_len: int = Field(gt=1, description="generated tokens per request in the TG runs")
    concurrencies: list[int] = Field(min_length=1, description="C values, one cell each")
    rounds: int = Field(2, gt=0, description="requests per cell = C x rounds")
    tokens_per_round_tolerance: float = Field(
        0.25, gt=0, description="the cell fails when TG per stream x round latency is off 1 token by more")


class CohortProtocol(_Protocol):
    """C concurrent chat requests on realistic prompts, model-default sampling (the Cohort table)."""

    kind: Literal["cohort"] = Field(description="protocol kind")
    prompts: str = Field(description="prompt set: file stem of a kind = 'prompts' file in bench/")
    cohorts: list[int] = Field(min_length=1, description="cohort sizes C")
    max_tokens: int = Field(gt=1, description="answer length in tokens")
    ignore_eos: bool = Field(True, description="every answer runs to max_tokens, so cohorts compare")
    enable_thinking: bool = Field(False, description="chat_template_kwargs.enable_thinking")


class SharedPrefixProtocol(_Protocol):
    """Many requests sharing one long system prompt, with and without prefix caching."""

    kind: Literal["shared-prefix"] = Field(description="protocol kind")
    prompts: str = Field(description="prompt set for the user turns (file stem)")
    system_prompt_tokens: int = Field(gt=0, description="length of the shared system prompt in tokens")
    num_requests: int = Field(gt=0, description="requests in the pass")
    concurrency: int = Field(gt=0, description="requests in flight at once")
    max_tokens: int = Field(gt=0, description="answer length in tokens")
    ignore_eos: bool = Field(True, description="every answer runs to max_tokens")
    variants: dict[str, dict[str, Any]] = Field(
        min_length=1, description="name -> knobs of the server for that variant (e.g. PREFIX_CACHE)")


class LongProtocol(_Protocol):
    """Long contexts: one 100k prompt alone, four 60k prompts at once."""

    kind: Literal["long"] = Field(description="protocol kind")
    cells: list[RandomCell] = Field(min_length=1, description="workloads")


class PromptSet(_Strict):
    """Realistic chat prompts (cohort, shared-prefix user turns)."""

    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["prompts"] = Field(description="a prompt set")
    description: str = Field(description="one line: what these prompts are")
    system_prompt: str = Field("", description="text the shared-prefix protocol repeats to build its system prompt")
    prompts: list[str] = Field(min_length=1, description="user messages, one request each (cycled)")


Protocol = Annotated[ThroughputProtocol | PrefillProtocol | RawProtocol | CohortProtocol | SharedPrefixProtocol
                     | LongProtocol, Field(discriminator="kind")]
BenchFile = Annotated[ThroughputProtocol | PrefillProtocol | RawProtocol | CohortProtocol | SharedPrefixProtocol
                      | LongProtocol | PromptSet, Field(discriminator="kind")]
KINDS = ("throughput", "prefill", "raw", "cohort", "shared-prefix", "long", "prompts")
_ADAPTER: TypeAdapter = TypeAdapter(BenchFile)


def _files(folder: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


def load_path(path: Path) -> Any:
    """Parse and validate one bench file; BenchError naming the file and key otherwise."""
    where = path.relative_to(paths.ROOT) if path.is_relative_to(paths.ROOT) else path
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise BenchError(f"{where}: not valid TOML: {e}") from None
    if data.get("kind") not in KINDS:
        raise BenchError(f"{where}: kind = {data.get('kind')!r}; expected one of {', '.join(KINDS)}")
    try:
        obj = _ADAPTER.validate_python(data)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc'][1:]))}: {err['msg']}" for err in e.errors())
        raise BenchError(f"{where}: {msgs} (fields and their meaning: docs/bench.md)") from None
    if isinstance(obj, PrefillProtocol) and any(c.output_len != 1 for c in obj.cells):
        raise BenchError(f"{where}: prefill cells need output_len = 1 (pure prompt processing)")
    return obj


def available(folder: Path | None = None) -> dict[str, str]:
    """name -> kind of every protocol file (prompt sets excluded), sorted by name."""
    out = {}
    for name, path in _files(folder or paths.BENCH).items():
        kind = tomllib.loads(path.read_text()).get("kind")
        if kind != "prompts":
            out[name] = kind
    return out


def load(name: str, folder: Path | None = None) -> Any:
    """A protocol by name (file stem), or a path to a .toml file."""
    if name.endswith(".toml"):
        p = Path(name)
        if not p.is_file():
            raise BenchError(f"protocol file {name!r} does not exist")
        return load_path(p)
    files = _files(folder or paths.BENCH)
    if name not in files:
        raise BenchError(f"unknown protocol {name!r}: available are "
                         f"{', '.join(available(folder)) or '(none)'}; or give a path to a .toml file")
    obj = load_path(files[name])
    if isinstance(obj, PromptSet):
        raise BenchError(f"{name!r} is a prompt set, not a protocol; protocols: {', '.join(available(folder))}")
    return obj


def load_prompts(name: str, folder: Path | None = None) -> PromptSet:
    files = _files(folder or paths.BENCH)
    obj = load_path(files[name]) if name in files else None
    if not isinstance(obj, PromptSet):
        sets = [n for n, p in files.items() if tomllib.loads(p.read_text()).get("kind") == "prompts"]
        raise BenchError(f"prompt set {name!r} not found in bench/; available: {', '.join(sets) or '(none)'}")
    return obj
