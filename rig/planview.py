"""A plan for people: the knob table with sources, the command line, env, needs, warnings."""

from __future__ import annotations

import io
import shlex

from rich.console import Console
from rich.table import Table

from rig.plan import Plan


def render(plan: Plan, width: int = 120) -> str:
    """The dry-run text (deterministic: fixed width, no colour)."""
    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None, force_terminal=False)
    con.print(f"profile {plan.profile}  overlays {', '.join(plan.overlays)}  platform {plan.platform}")
    table = Table("knob", "value", "from", title=None, box=None, pad_edge=False)
    for name, value in plan.knobs.items():
        table.add_row(name, repr(value), plan.sources.get(name, ""))
    con.print(table)
    con.print("command:")
    con.print("  " + shlex.join(plan.argv), soft_wrap=True)
    for k, v in sorted(plan.env.items()):
        con.print(f"env: {k}={v}", soft_wrap=True)
    con.print(f"patches: {', '.join(plan.patches) or '-'}   kernels: {', '.join(plan.kernels) or '-'}")
    con.print(f"api key file: {plan.api_key_file}   plan sha256: {plan.digest[:16]}")
    for w in plan.warnings:
        con.print(f"warning: {w}", soft_wrap=True)
    return buf.getvalue()
