"""`inv model.*`: a random-weight fixture of a real shape, W4A16 with auto-round, fetch / verify / manifest."""

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


QUANTIZE_HELP = {
    "recipe": "recipe file, or the name of one in models/recipes/ (w4a16-rtn, w4a16-tiny-tuned, w4a16-autoround)",
    "model": "16-bit checkpoint folder to quantize, or tiny:hybrid / tiny:dense",
    "out": "folder to write (must not exist); written beside it as .<name>.partial and renamed when complete",
}


@task(help=QUANTIZE_HELP)
def quantize(c, recipe, model, out):
    """W4A16 with auto-round from a recipe (auto_round:auto_gptq, vLLM's INC path); prints its timing."""
    from pathlib import Path

    from rig.models import quantize as q

    try:
        folder = q.quantize(q.recipe_file(recipe), model, Path(out))
    except q.QuantizeError as e:
        raise Exit("\n".join(f"rig: error: {line}" for line in str(e).splitlines()), code=2) from None
    print(folder)


CHECKPOINT_HELP = {
    "profile": "profile whose MODEL (and DRAFT_MODEL with SPEC=dflash2) it is (profiles/*.toml)",
    "overlay": "overlay to apply (profiles/overlays/*.toml), repeatable",
    "set": "KNOB=value, repeatable (e.g. MODEL=/data/Qwen3.8-27B-W4A16-AutoRound)",
    "platform": "the plan's platform; default gpu (on cpu the plan serves a tiny model rig builds: nothing to fetch)",
    "model": "a checkpoint by manifest name (models/manifests/NAME.toml) instead of a profile's",
    "manifest": "a manifest file outside models/manifests/ instead of a profile's",
    "out": "with --model/--manifest: the checkpoint folder; default .rig/models/NAME",
}


def _targets(profile, overlay, set, platform, model, manifest, out):
    """The checkpoints a fetch/verify task names: --model/--manifest, else the profile's."""
    from rig.cli.common import plan_from_args
    from rig.models import fetch

    if model or manifest:
        return [fetch.named_target(model, manifest, out)]
    return fetch.plan_targets(plan_from_args(profile, overlay, set, platform))


@task(iterable=["overlay", "set"], help=CHECKPOINT_HELP)
def fetch(c, profile="batch", overlay=None, set=None, platform="gpu", model="", manifest="", out=""):
    """Download a checkpoint at its pinned commit (HF_ENDPOINT), check every sha256, rename into place."""
    from rig.models import fetch as f

    try:
        for t in _targets(profile, overlay, set, platform, model, manifest, out):
            print(f.fetch(t))
    except f.ManifestError as e:
        raise Exit(f"rig: error: {e}", code=2) from None
    except f.FetchError as e:
        raise Exit(f"rig: error: {e}", code=1) from None


@task(iterable=["overlay", "set"], help={**CHECKPOINT_HELP, "out": "with --model/--manifest: the folder to check"})
def verify(c, profile="batch", overlay=None, set=None, platform="gpu", model="", manifest="", out=""):
    """Offline: hash every file of a checkpoint against its committed manifest (missing, altered, extra)."""
    from rig.models import fetch as f
    from rig.models.manifest import VerifyError

    try:
        targets = _targets(profile, overlay, set, platform, model, manifest, out)
        failed = []
        for t in targets:
            try:
                print(f.verify(t))
            except VerifyError as e:
                failed.append(str(e))
    except f.ManifestError as e:
        raise Exit(f"rig: error: {e}", code=2) from None
    if failed:
        raise Exit("\n".join(f"rig: error: {m}" for m in failed), code=1)


MANIFEST_HELP = {
    "folder": "a trusted local copy of the checkpoint",
    "name": "checkpoint name (its folder name under .rig/models/); default: the folder's name",
    "repo": "Hugging Face repository id (OWNER/NAME); default: the existing manifest's",
    "revision": "the repository commit the copy is of (40 hex digits); default: the existing manifest's",
    "description": "one line; default: the existing manifest's",
    "out": "manifest file to write; default models/manifests/NAME.toml",
}


@task(help=MANIFEST_HELP)
def manifest(c, folder, name="", repo="", revision="", description="", out=""):
    """Write a sha256 manifest from a local folder (keeps an existing manifest's repo, revision, notes)."""
    from pathlib import Path

    from rig.models import manifest as mf

    try:
        path, m = mf.write_from_folder(Path(folder), name, repo, revision, description, Path(out) if out else None)
    except mf.ManifestError as e:
        raise Exit(f"rig: error: {e}", code=2) from None
    print(f"{mf.where(path)}: {m.name}, {len(m.files)} files, {m.total_bytes:,} bytes"
          f"{f', {m.repo} at {m.revision}' if m.repo and m.revision else ''}")


ns = Collection("model")
ns.add_task(fixture)
ns.add_task(quantize)
ns.add_task(fetch)
ns.add_task(verify)
ns.add_task(manifest)
