"""`inv plan`: predict a profile's memory, pool, seats and speed before anything starts."""

from __future__ import annotations

import sys

from invoke import Exit, task

from rig.cli.common import plan_from_args
from rig.cli.serve import HELP


@task(iterable=["overlay", "set"], help={
    **{k: HELP[k] for k in ("profile", "overlay", "set")},
    "platform": "cpu or gpu; default: gpu with --gpu or when NVML finds a CUDA device, else cpu",
    "gpu": "a card of hardware/gpus.toml (rtx3090, rtx4090, a100-80, h200) instead of the device NVML reports",
    "context": "tokens per request for the speed bounds (default: MAX_LEN, at most 4096)",
    "json": "print the capacity report as JSON (for tools)",
})
def plan(c, profile="batch", overlay=None, set=None, platform="", gpu="", context=0, json=False):
    """Predict memory, KV pool, seats and speed bounds of a profile; exit 2 for a plan that cannot start."""
    from rig.capacity import cards, report, shape

    card = None
    if gpu:
        try:
            card = cards.card(gpu)
        except ValueError as e:
            raise Exit(f"rig: error: {e}", code=2) from None
    the_plan = plan_from_args(profile, overlay, set, platform or ("gpu" if gpu else ""))
    if the_plan.platform == "gpu" and card is None:
        card = cards.nvml()
        if card is None:
            raise Exit("rig: error: no CUDA GPU answers NVML: name the card to plan for with --gpu NAME "
                       f"(known: {', '.join(cards.known())})", code=2)
    try:
        r = report.for_plan(the_plan, card, context or None)
    except shape.ShapeError as e:
        raise Exit(f"rig: error: {e}", code=2) from None
    for w in the_plan.warnings:  # what serve would print first (stderr: --json's stdout stays JSON)
        print(f"rig: warning: {w}", file=sys.stderr, flush=True)
    sys.stdout.write(r.to_json() if json else report.render(r))
    if r.budget.errors:
        raise Exit(code=2)
