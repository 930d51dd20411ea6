"""`inv repro -a A [-b B]`: may two results be compared? `inv repro --check`: the reproducibility checks.

A and B are flags, not positionals: invoke has no optional positional arguments (one without a default is
required, which would make `inv repro --check` ask for A).
"""

from __future__ import annotations

import json
from pathlib import Path

from invoke import Exit, task

HELP = {
    "a": "fingerprint JSON, result.json or results run folder (e.g. one from another host)",
    "b": "the same kinds of thing; default: this host now, fingerprinted with A's plan (docs/reproducibility.md)",
    "check": "run the reproducibility checks (locks, patch series, golden plans, the greedy digest across two CPU "
             "server starts) instead; exit 1 on a failure; writes a JSON report under .rig/results/",
    "offline": "with --check: skip the digest check, the one that starts servers (minutes); it reports skip",
    "golden_dir": "with --check: compare the golden plans in this folder instead of tests/golden/plans",
    "report_dir": "with --check: write the JSON report into this folder (default: .rig/results/)",
    "save": "write B's fingerprint (this host's, with A's plan when A is given) to this file",
    "json": "print the comparison as JSON instead of a table",
}
MARK = {"pass": "ok  ", "fail": "FAIL", "skip": "skip"}


def _err(msg: str) -> Exit:
    return Exit(f"rig: error: {msg}", code=2)


def _check(golden_dir: str, report_dir: str, offline: bool) -> None:
    from rig.repro import check as checks

    if not offline:
        print("rig: repro check: the digest check starts two CPU servers (minutes; --offline skips it)", flush=True)
    results = checks.run(Path(golden_dir) if golden_dir else None, offline=offline)
    for r in results:
        print(f"rig: repro check {r.name:<8} {MARK[r.status]} {r.line}", flush=True)
        for d in r.details if r.status == "fail" else []:
            print(f"rig:     {d}")
    path = checks.write_report(results, Path(report_dir) if report_dir else None)
    ok = checks.passed(results)
    print(f"rig: repro check {'passed' if ok else 'FAILED'}; report: {path}")
    if not ok:
        raise Exit(code=1)


def _table(cmp, a_name: str, b_name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"A = {a_name}\nB = {b_name}", title_justify="left")
    for col in ("#", "what", "A", "B", "touches results", "why"):
        t.add_column(col, overflow="fold")
    for i, d in enumerate(cmp.differences, 1):
        t.add_row(str(i), d.key, repr(d.a), repr(d.b), "yes" if d.touches else "no", d.why)
    con = Console(width=160)
    if cmp.differences:
        con.print(t)
    for note in cmp.notes:
        print(f"rig: NOTE: {note}")


def _save(fp: dict, dest: str) -> None:
    from rig.atomic import write_atomic

    write_atomic(Path(dest), json.dumps(fp, indent=2, sort_keys=True) + "\n")
    print(f"rig: wrote the fingerprint to {dest}")


@task(help=HELP, positional=[])
def repro(c, a="", b="", check=False, offline=False, golden_dir="", report_dir="", save="", json_=False):
    """Compare two fingerprints (verdict: identical / comparable / not comparable; exit 1 when not comparable)."""
    if check:
        if a or b:
            raise _err("--check takes no A or B; run `inv repro -a A [-b B]` to compare fingerprints")
        return _check(golden_dir, report_dir, offline)
    if offline:
        raise _err("--offline goes with --check (`inv repro --check --offline`: the checks that start no server)")
    from rig import fingerprint
    from rig.repro import diff, inputs

    if not a and save:
        _save(fingerprint.collect(), save)
        return
    if not a:
        raise _err("give A: a fingerprint JSON, result.json or results run folder (`inv repro -a A [-b B]`), "
                   "--save FILE for this host's fingerprint, or --check for the offline checks")

    try:
        fa = inputs.load(Path(a))
        fb = inputs.load(Path(b)) if b else None
    except inputs.InputError as e:
        raise _err(str(e)) from None
    b_name = b
    if fb is None:
        plan, how = inputs.default_plan(fa)
        fb = fingerprint.collect(plan)
        b_name = f"this host now: {how}"
    if save:
        _save(fb, save)
    cmp = diff.compare(fa, fb)
    if json_:
        print(json.dumps({"a": a, "b": b_name, **cmp.to_json()}, indent=2, default=str))
    else:
        _table(cmp, a, b_name)
        print(f"rig: repro: {cmp.summary()}")
    if cmp.verdict == "not comparable":
        raise Exit(code=1)
