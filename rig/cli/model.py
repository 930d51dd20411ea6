"""`inv model.fixture`: build a random-weight benchmark fixture of a real model's shape (models/*.toml)."""

from __future__ import annotations

import sys

from invoke import Collection, Exit, task

HELP = {
    "shape": "models/<shape>.toml to build, e.g. qwen3.5-27b-class",
    "seed": "seed of every tensor's random stream (same shape and seed -> same bytes)",
    "out": "folder to build into; default: .rig/models/<fixture name> (where MODEL=fixture:<shape> finds it)",
}


@task(help=HELP)
def fixture(c, shape="qwen3.5-27b-class", seed=0, out=""):
    """Build a W4A16 random-weight fixture (never a model: its text is noise); prints its folder."""
    from pathlib import Path

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    from rig.models import fixture as fx

    try:
        spec = fx.FixtureSpec(shape, int(seed))
        total = fx.weights_bytes(spec)
    except fx.FixtureError as e:
        raise Exit(f"rig: error: {e}", code=2) from None
    dest = Path(out) if out else None
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  transient=True, disable=not sys.stderr.isatty()) as bar:
        t = bar.add_task(f"fixture {spec.name}", total=total)
        folder = fx.build(spec, dest, progress=lambda done, _name: bar.update(t, completed=done))
    print(f"{folder}  ({total / 2**30:.2f} GiB of weights; {fx.WARNING})")


ns = Collection("model")
ns.add_task(fixture)
