"""The battery as data: pydantic models of the files in quality/, and their strict loader.

Every file declares ``schema_version`` and ``kind``; unknown keys are errors (a typo in a threshold
must not silently mean "no threshold"). Each field's ``description`` is its documentation.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rig import paths


class SuiteError(ValueError):
    """A quality/ file is missing or invalid; the message names the file, the key and what is allowed."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextSource(Strict):
    """Where one perplexity set's text comes from."""

    domain: Literal["english", "second-language", "code"] = Field(description="what the text is")
    source: Literal["corpus", "stdlib", "url"] = Field(description=(
        "`corpus`: rig.models.corpus with a held-out seed (derived, offline); `stdlib`: a file of the Python "
        "standard library of this interpreter (pinned by sha256); `url`: a public set fetched once, checksummed"))
    corpus_domain: Literal["english", "german", "code"] | None = Field(
        default=None, description="source=corpus: which generator of rig.models.corpus")
    seed: int | None = Field(default=None, description="source=corpus: the seed (held out from every training seed)")
    lines: int = Field(default=400, ge=1, description="source=corpus: how many generated lines")
    path: str | None = Field(default=None, description=(
        "source=stdlib: path relative to the standard library folder; the module's text, or for "
        "`pydoc_data/topics.py` the prose of the Python reference it holds"))
    url: str | None = Field(default=None, description="source=url: where to fetch the set from")
    format: Literal["text", "parquet-text-column"] = Field(
        default="text", description="source=url: plain text, or a parquet file whose `text` column is joined")
    sha256: str | None = Field(default=None, description=(
        "expected sha256 of the fetched / read bytes; a mismatch is an error. Unset: the hash is recorded in "
        "the result (trust on first use) and printed so it can be pinned here"))
    python: str | None = Field(default=None, description=(
        "source=stdlib: the Python version whose file `sha256` pins; on another version the file's own hash is "
        "recorded instead (a reference then compares only with runs of the same hash)"))
    description: str = Field(description="one line: what the set is and why it is here")


class PerplexitySuite(Strict):
    """Which sets one perplexity run uses, and how they are cut."""

    sets: list[str] = Field(min_length=1, description="names of [sets.*] to evaluate")
    window_tokens: int = Field(ge=16, le=8192, description="tokens per window (the model's own tokenizer)")
    max_windows: int = Field(ge=1, description="windows per set, taken from the start of the text")
    description: str = Field(description="what the suite is for")


class PerplexityFile(Strict):
    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["perplexity"] = Field(description="file kind")
    sets: dict[str, TextSource] = Field(description="text sets by name")
    suites: dict[str, PerplexitySuite] = Field(description="suites by name")


class LmEvalSuite(Strict):
    """One lm-eval run (GSM8K or its offline stand-in) through the server."""

    task: str = Field(description="lm-eval task name")
    include_path: str | None = Field(default=None, description="folder of task YAMLs, relative to the repository")
    api: Literal["local-completions", "local-chat-completions"] = Field(description=(
        "lm-eval model: raw prompts (/v1/completions) or chat (/v1/chat/completions, thinking off "
        "through the task's generation_kwargs)"))
    limit: int = Field(ge=1, description="first N questions of the test split")
    num_concurrent: int = Field(default=4, ge=1, description="concurrent requests lm-eval sends")
    offline: bool = Field(default=True, description=(
        "run with HF_DATASETS_OFFLINE=1 (a task whose data ships in quality/); false for hub datasets"))
    max_gen_toks: int = Field(default=256, ge=1, description="tokens per answer")
    metric: str = Field(default="exact_match", description="the metric gated")
    filter: str = Field(default="flexible-extract", description="lm-eval filter whose score is gated")
    description: str = Field(description="what the suite is for")


class LmEvalFile(Strict):
    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["lmeval"] = Field(description="file kind")
    suites: dict[str, LmEvalSuite] = Field(description="suites by name")


class Prompt(Strict):
    """A realistic prompt and what a relevant answer must mention."""

    text: str = Field(description="the user message")
    expect_any: list[str] = Field(default_factory=list, description=(
        "an answer mentioning none of these (case-insensitive) ignores the prompt; empty = not checked"))


class GarbageSuite(Strict):
    prompts: list[Prompt] = Field(min_length=1, description="chat prompts, sent with thinking off")
    greedy: int = Field(ge=0, description="greedy completions (one per prompt, cycling)")
    sampled: int = Field(ge=0, description="sampled completions (temperature / top_p below, seeded)")
    temperature: float = Field(default=0.7, ge=0, description="sampling temperature of the sampled completions")
    top_p: float = Field(default=0.8, gt=0, le=1, description="top_p of the sampled completions")
    max_tokens: int = Field(ge=1, description="tokens per completion")
    description: str = Field(description="what the suite is for")


class GarbageFile(Strict):
    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["garbage"] = Field(description="file kind")
    suites: dict[str, GarbageSuite] = Field(description="suites by name")


class ToolCase(Strict):
    prompt: str = Field(description="the user message")
    tool: dict = Field(description="one OpenAI tools entry (type function, name, parameters)")
    expect_name: str = Field(description="the function the call must name")
    required: list[str] = Field(default_factory=list, description="argument keys the parsed JSON must hold")


class ToolSuite(Strict):
    cases: list[ToolCase] = Field(min_length=1, description="requests sent with tools and tool_choice auto")
    max_tokens: int = Field(ge=8, description="tokens per answer")
    description: str = Field(description="what the suite is for")


class ToolFile(Strict):
    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["toolcall"] = Field(description="file kind")
    suites: dict[str, ToolSuite] = Field(description="suites by name")


class DigestSuite(Strict):
    prompts: list[str] = Field(min_length=1, description="raw completion prompts, greedy")
    max_tokens: int = Field(ge=1, description="tokens per completion")
    description: str = Field(description="what the suite is for")


class DigestFile(Strict):
    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["digest"] = Field(description="file kind")
    suites: dict[str, DigestSuite] = Field(description="suites by name")


class Gates(Strict):
    """Pass/fail thresholds of one profile: relative to a reference result of the same model, absolute for
    garbage and tool calls. The absolute perplexity and lm-eval floors are per suite (``Floors``)."""

    ppl_max_increase_pct: float = Field(ge=0, description=(
        "overall perplexity may exceed the reference's by at most this many percent"))
    gsm8k_max_drop_points: float = Field(ge=0, description="lm-eval score may be lower by at most these points")
    garbage_greedy_max: int = Field(ge=0, description="flagged greedy completions allowed")
    garbage_sampled_max_pct: float = Field(ge=0, le=100, description="flagged sampled completions allowed, percent")
    toolcall_min_pct: float = Field(ge=0, le=100, description="tool-call cases that must come back parsed, percent")


class Floors(Strict):
    """Absolute floors per suite: what a run must reach on its own merits, reference or not. Every
    perplexity and lm-eval suite has one (a suite without is an error when a battery resolves)."""

    perplexity: dict[str, float] = Field(description=(
        "perplexity suite -> the highest overall perplexity that passes (> 1)"))
    lmeval: dict[str, float] = Field(description="lm-eval suite -> the lowest score that passes, points (0-100)")
    lmeval_format: dict[str, float] = Field(default_factory=dict, description=(
        "lm-eval suite -> the lowest share of answers in the task's strict format (`#### N`) that passes, "
        "percent; for a suite whose score no honest floor can judge (the tiny models'), it is the floor"))


class SuiteFloors(Strict):
    """The floors of one resolved battery."""

    ppl_max: float = Field(gt=1, description="overall perplexity above this fails")
    lmeval_min: float | None = Field(default=None, ge=0, le=100, description="lm-eval score below this fails")
    lmeval_format_min: float | None = Field(default=None, ge=0, le=100, description=(
        "share of answers in the strict format below this fails, percent"))


class GatesFile(Strict):
    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["gates"] = Field(description="file kind")
    default: Gates = Field(description="gates of every profile without its own entry")
    profiles: dict[str, Gates] = Field(default_factory=dict, description="per-profile gates, by profile name")
    floors: Floors = Field(description="absolute floors, per perplexity and lm-eval suite")


class Battery(Strict):
    """A named battery: which suite of each kind runs (empty = that component is skipped)."""

    perplexity: str = Field(description="suite name in quality/perplexity.toml")
    lmeval: str = Field(default="", description="suite name in quality/lmeval.toml; empty = skipped")
    garbage: str = Field(description="suite name in quality/garbage.toml")
    toolcall: str = Field(default="", description="suite name in quality/toolcall.toml; empty = skipped")
    digest: str = Field(description="suite name in quality/digest.toml")
    description: str = Field(description="when to use this battery")


class BatteryFile(Strict):
    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["battery"] = Field(description="file kind")
    batteries: dict[str, Battery] = Field(description="batteries by name")


FILES: dict[str, type[Strict]] = {
    "battery": BatteryFile, "perplexity": PerplexityFile, "lmeval": LmEvalFile, "garbage": GarbageFile,
    "toolcall": ToolFile, "digest": DigestFile, "gates": GatesFile,
}


def load(kind: str, folder: Path | None = None) -> Strict:
    """quality/<kind>.toml, validated; SuiteError naming the file and every bad key."""
    path = (folder or paths.QUALITY) / f"{kind}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise SuiteError(f"{path}: cannot read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(f"{path}: not valid TOML ({e})") from None
    if data.get("kind") != kind:
        raise SuiteError(f"{path}: kind = {data.get('kind')!r}, expected {kind!r}")
    try:
        return FILES[kind].model_validate(data)
    except ValidationError as e:
        lines = [f"{path}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise SuiteError("\n".join(lines)) from None


class Resolved(BaseModel):
    """A battery with every suite looked up (what one run executes)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    battery: Battery
    perplexity: PerplexitySuite
    sets: dict[str, TextSource]
    lmeval: LmEvalSuite | None
    garbage: GarbageSuite
    toolcall: ToolSuite | None
    digest: DigestSuite
    floors: SuiteFloors


def _pick(kind: str, table: dict, name: str) -> Strict:
    if name not in table:
        raise SuiteError(f"quality/{kind}.toml has no suite {name!r}; it has: {', '.join(sorted(table))}")
    return table[name]


def resolve(name: str, folder: Path | None = None) -> Resolved:
    """Battery ``name`` with its suites; SuiteError for any missing name (before anything starts)."""
    batteries = load("battery", folder).batteries
    if name not in batteries:
        raise SuiteError(f"--suite {name!r}: no such battery in quality/battery.toml; "
                         f"choose one of: {', '.join(sorted(batteries))}")
    b = batteries[name]
    ppl = load("perplexity", folder)
    suite = _pick("perplexity", ppl.suites, b.perplexity)
    missing = [s for s in suite.sets if s not in ppl.sets]
    if missing:
        raise SuiteError(f"quality/perplexity.toml: suite {b.perplexity!r} names unknown sets {missing}")
    floors = load("gates", folder).floors
    check_floors(floors, ppl.suites, load("lmeval", folder).suites)
    return Resolved(
        name=name, battery=b, perplexity=suite, sets={s: ppl.sets[s] for s in suite.sets},
        lmeval=_pick("lmeval", load("lmeval", folder).suites, b.lmeval) if b.lmeval else None,
        garbage=_pick("garbage", load("garbage", folder).suites, b.garbage),
        toolcall=_pick("toolcall", load("toolcall", folder).suites, b.toolcall) if b.toolcall else None,
        digest=_pick("digest", load("digest", folder).suites, b.digest),
        floors=SuiteFloors(ppl_max=floors.perplexity[b.perplexity],
                           lmeval_min=floors.lmeval.get(b.lmeval) if b.lmeval else None,
                           lmeval_format_min=floors.lmeval_format.get(b.lmeval) if b.lmeval else None),
    )


def check_floors(floors: Floors, perplexity: dict, lmeval: dict) -> None:
    """Every perplexity suite has a ceiling and every lm-eval suite a score or a format floor (or both),
    each floor names a suite, each value is in range (an lm-eval floor of 0 passes a model that answers
    nothing)."""
    problems = [f"suite {n!r} of quality/perplexity.toml has no floor: add it under [floors.perplexity]"
                for n in sorted(set(perplexity) - set(floors.perplexity))]
    bare = set(lmeval) - set(floors.lmeval) - set(floors.lmeval_format)
    problems += [f"suite {n!r} of quality/lmeval.toml has no floor: add it under [floors.lmeval] (score) or "
                 f"[floors.lmeval_format]" for n in sorted(bare)]
    for kind, suites, table in (("perplexity", perplexity, floors.perplexity), ("lmeval", lmeval, floors.lmeval),
                                ("lmeval_format", lmeval, floors.lmeval_format)):
        problems += [f"[floors.{kind}] {n!r}: no such suite in quality/{kind.split('_')[0]}.toml"
                     for n in sorted(set(table) - set(suites))]
    problems += [f"[floors.perplexity] {n} = {v}: expected a perplexity > 1"
                 for n, v in floors.perplexity.items() if v <= 1]
    problems += [f"[floors.{kind}] {n} = {v}: expected points in (0, 100]"
                 for kind, table in (("lmeval", floors.lmeval), ("lmeval_format", floors.lmeval_format))
                 for n, v in table.items() if not 0 < v <= 100]
    if problems:
        raise SuiteError("quality/gates.toml: " + "; ".join(problems))


def gates_for(profile: str, folder: Path | None = None) -> Gates:
    g = load("gates", folder)
    return g.profiles.get(profile, g.default)
