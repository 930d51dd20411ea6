"""`inv bench`: run the bench protocols (bench/*.toml) against servers of a profile; `inv bench.compare`."""

from __future__ import annotations

import sys

from invoke import Collection, Exit, task

from rig.cli.common import parse_sets

# The reference's table order; other protocol files follow, sorted.
ORDER = ("throughput", "cohort", "prefill", "raw", "shared-prefix", "long")

RUN_HELP = {
    "protocol": "protocol name (bench/*.toml) or a path to one, repeatable; default: every protocol",
    "profile": "profile of the server(s) the bench starts: batch, single-user, kvarn",
    "overlay": "overlay to apply (profiles/overlays/*.toml), repeatable",
    "set": "KNOB=value for the server, repeatable (a protocol's own needs, e.g. raw's SPEC=off, are added)",
    "platform": "cpu or gpu; default: gpu when NVML finds a CUDA device, else cpu",
    "repeat": "kept passes per cell (after one discarded warm-up); the tables show median and spread",
    "scale": "multiply every token length and request count by this (0.125 or 1/8); default 1 on gpu, 1/8 on cpu",
    "seed": "first seed (each call gets the next one); default: from the clock",
    "progress": "show rich progress bars (--no-progress for logs)",
    "running": "measure the server `inv serve` started and recorded (.rig/servers/) instead of starting one",
    "url": "measure a server rig did not start, at this base URL (http://host:port); protocols with requires "
           "(raw) and shared-prefix are refused there",
    "key_file": "with --url: file holding that server's API key (default: the profile's API_KEY_FILE)",
}


def _fail(msg: str, code: int = 2) -> Exit:
    return Exit("\n".join(f"rig: error: {m}" for m in msg.splitlines()), code=code)


def _scale(text: str) -> float | None:
    """--scale as a number or a fraction (0.125, 1/8); None = the platform's default."""
    from fractions import Fraction

    if not str(text).strip():
        return None
    try:
        f = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        f = -1.0
    if not 0 < f <= 1:
        raise _fail(f"--scale {text}: expected a factor in (0, 1], e.g. 0.125 or 1/8; leave it out for the "
                    f"platform default (1 on gpu, 1/8 on cpu)")
    return f


def _protocols(names: list[str] | None) -> list[tuple[str, object]]:
    from pathlib import Path

    from rig.bench import protocols

    if not names:
        avail = protocols.available()
        names = [n for n in ORDER if n in avail] + sorted(n for n in avail if n not in ORDER)
    out = []
    for n in names:
        try:
            out.append((Path(n).stem if n.endswith(".toml") else n, protocols.load(n)))
        except protocols.BenchError as e:
            raise _fail(str(e)) from None
    return out


def _preflight(protos, pool, sets) -> None:
    """Every plan the run will need, resolved before any server starts (bad input costs nothing)."""
    from rig.bench.protocols import SharedPrefixProtocol
    from rig.bench.servers import conflicts
    from rig.plan import PlanError

    problems = []
    for name, p in protos:
        variants = list(p.variants.values()) if isinstance(p, SharedPrefixProtocol) else [{}]
        for v in variants:
            need = {**p.requires, **v}
            problems += conflicts(sets, need, f"protocol {name!r}")
            try:
                pool.plan_for(need)
            except PlanError as e:
                problems += [f"protocol {name!r}: {m}" for m in e.messages]
    if problems:
        raise _fail("\n".join(dict.fromkeys(problems)))


def _attached(protos, base, sets, running: bool, url: str, key_file: str):
    """The Target of --running / --url, refused (exit 2) before a request is sent when a protocol cannot run on it."""
    from rig.bench import attach
    from rig.cli.common import read_key
    from rig.running import RunningError

    if running and url:
        raise _fail("--running and --url: give one (--running: the server `inv serve` recorded; --url: another)")
    try:
        t = attach.recorded_target() if running else attach.foreign_target(url, read_key(key_file, base), base)
    except RunningError as e:
        raise _fail(str(e)) from None
    why = attach.refusals(protos, t, sets)
    if why:
        raise _fail("refusing to bench it (nothing was sent):\n" + "\n".join(f"  - {w}" for w in why))
    return t


@task(default=True, iterable=["protocol", "overlay", "set"], help=RUN_HELP)
def run(c, protocol=None, profile="batch", overlay=None, set=None, platform="", repeat=1, scale="", seed=-1,
        progress=True, running=False, url="", key_file=""):
    """Run bench protocols on fresh servers of a profile (or --running / --url); results under .rig/results/."""
    from rig.bench.protocols import CPU_SCALE, BenchError, Scale
    from rig.bench.runner import Run, fixed
    from rig.bench.servers import ServerPool
    from rig.plan import PlanError
    from rig.serve import PreflightError
    from rig.server import ServerError

    sets = parse_sets(set)
    if int(repeat) < 1:
        raise _fail(f"--repeat {repeat}: expected an integer >= 1 (kept passes per cell)")
    factor = _scale(scale)
    protos = _protocols(protocol)
    pool = ServerPool(profile, overlay or [], platform or None, sets)
    try:
        base = pool.plan_for({})
    except PlanError as e:
        raise _fail("\n".join(e.messages)) from None
    attached = _attached(protos, base, sets, running, url, key_file) if running or url else None
    if attached is None:
        _preflight(protos, pool, sets)
    else:
        base = attached.plan
        profile = base.profile
        print(f"rig: measuring {attached.server['started_by']} at {attached.url}", flush=True)
    factor = factor or (CPU_SCALE if base.platform == "cpu" else 1.0)
    acquire = pool.acquire if attached is None else fixed(attached)
    invalid = []
    with pool:
        for i, (name, p) in enumerate(protos):
            print(f"rig: bench {name} on profile {profile} ({base.platform}, scale {factor:g})", flush=True)
            r = Run(name, p, acquire, profile, Scale(factor=factor), int(repeat),
                    None if int(seed) < 0 else int(seed) + 1_000_000 * i, progress=progress)
            try:
                res = r.execute()
            except (ServerError, PreflightError, BenchError) as e:
                raise Exit(f"rig: error: {name}: {e}\nrig: results so far: {r.dir.root}", code=1) from None
            print((r.dir.root / "tables.md").read_text() if (r.dir.root / "tables.md").exists() else "", flush=True)
            print(f"rig: {name}: {'valid' if res.valid else 'INVALID'} -> {r.dir.root}", flush=True)
            if not res.valid:
                invalid.append(name)
                for why in res.problems:
                    print(f"rig: {name}: {why}", file=sys.stderr)
            if r.server_died:
                rest = [n for n, _ in protos[i + 1:]]
                if rest:
                    print(f"rig: not run (the server died or restarted): {', '.join(rest)}", file=sys.stderr)
                invalid += rest
                break
    if invalid:
        raise Exit(f"rig: error: invalid run(s): {', '.join(invalid)} (everything measured is in the run folders)",
                   code=1)


@task(help={"a": "run folder (or its result.json): the baseline", "b": "run folder to compare with A",
            "force": "compare even when the fingerprints differ in more than one knob"})
def compare(c, a, b, force=False):
    """Print the differences between two runs of a protocol; refuses incomparable runs unless --force."""
    from pathlib import Path

    from rig.bench import results
    from rig.bench.compare import CompareError, render

    try:
        ra, rb = results.load(Path(a)), results.load(Path(b))
        sys.stdout.write(render(ra, rb, force))
    except (FileNotFoundError, CompareError) as e:
        raise _fail(str(e)) from None


ns = Collection("bench", run, compare)
