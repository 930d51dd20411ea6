"""`inv patch.*`: rig's vLLM patch series (patches/series) on the installed vLLM tree."""

from __future__ import annotations

from invoke import Collection, Exit, task


def _root(tree: str):
    from pathlib import Path

    return Path(tree) if tree else None


@task(help={"tree": "directory that contains the vllm package (default: this interpreter's installed vLLM)"})
def apply(c, tree=""):
    """Apply the patch series (all or nothing; idempotent; refuses another vLLM version)."""
    from rig import patches

    try:
        done = patches.apply(_root(tree))
    except patches.PatchError as e:
        raise Exit(f"patch apply: {e}", code=2) from e
    print(f"applied: {', '.join(done)}" if done else "already applied: nothing to do")


@task(help={"tree": "directory that contains the vllm package (default: this interpreter's installed vLLM)"})
def verify(c, tree=""):
    """Per patch applied / not applied / modified, plus the sha256 of every touched file; fails unless all applied."""
    from rig import patches

    try:
        ok, text = patches.verify_report(_root(tree))
    except patches.PatchError as e:
        raise Exit(f"patch verify: {e}", code=2) from e
    print(text)
    if not ok:
        raise Exit("patch verify: the series is not fully applied (run `inv patch.apply`)", code=1)


@task(help={"tree": "directory that contains the vllm package (default: this interpreter's installed vLLM)"})
def revert(c, tree=""):
    """Revert the applied patches, leaving the touched files byte-identical to the release."""
    from rig import patches

    try:
        done = patches.revert(_root(tree))
    except patches.PatchError as e:
        raise Exit(f"patch revert: {e}", code=2) from e
    print(f"reverted: {', '.join(done)}" if done else "nothing applied: nothing to do")


@task(help={"tree": "directory that contains the vllm package (default: this interpreter's installed vLLM)"})
def status(c, tree=""):
    """Say for each patch of the series whether it is applied, not applied or modified."""
    from rig import patches

    try:
        print(patches.status_report(_root(tree)))
    except patches.PatchError as e:
        raise Exit(f"patch status: {e}", code=2) from e


ns = Collection("patch", apply, verify, revert, status)
