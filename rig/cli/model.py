"""`inv model.*`: a random-weight fixture of a real shape, W4A16 with auto-round, fetch / verify / manifest,
INT8_LAYERS calibration."""

from __future__ import annotations

import sys

from invoke import Collection, Exit, task

from rig.models.calibrate import DEFAULT_MAX_ERROR, DEFAULT_RECIPE

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


CALIBRATE_HELP = {
    "model": "16-bit checkpoint folder, or tiny:hybrid / tiny:dense",
    "recipe": f"quantize recipe whose calibration windows to use (models/recipes/; default {DEFAULT_RECIPE})",
    "max_error": "largest acceptable relative output error of a layer under int8 activations, in (0, 1]; "
                 f"default {DEFAULT_MAX_ERROR}",
    "nsamples": "windows to run; 0 = the recipe's",
    "seqlen": "tokens per window; 0 = the recipe's",
    "out": "JSON report to write (atomic); default .rig/calibrate/<model folder>.json",
}


@task(help=CALIBRATE_HELP)
def calibrate(c, model, recipe="", max_error=None, nsamples=0, seqlen=0, out=""):
    """Per-linear int8 activation error on calibration text; ranks layers, recommends INT8_LAYERS."""
    import time
    from pathlib import Path

    from rig import paths
    from rig.models import calibrate as cal
    from rig.models import quantize as q

    t0 = time.monotonic()
    try:
        limit = cal.max_error(max_error)
        report = cal.calibrate(model, recipe or DEFAULT_RECIPE, limit, int(nsamples), int(seqlen))
    except (cal.CalibrateError, q.QuantizeError) as e:
        raise Exit("\n".join(f"rig: error: {line}" for line in str(e).splitlines()), code=2) from None
    dest = Path(out) if out else paths.state_dir() / "calibrate" / f"{Path(report['model']['path']).name}.json"
    cal.write(report, dest)
    _print_calibration(report)
    print(f"{dest}  ({time.monotonic() - t0:.1f} s)")


def _print_calibration(report: dict) -> None:
    """The ranked layers, the presets and the recommendation as rich tables."""
    from rich.console import Console
    from rich.table import Table

    p = report["prompts"]
    layers = Table(title=f"int8 activation error per layer ({p['nsamples']} x {p['seqlen']} tokens, ranked)")
    for col in ("rank", "layer", "absmax", "outliers", "input err", "output err"):
        layers.add_column(col, justify="left" if col == "layer" else "right")
    for name, row in sorted(report["layers"].items(), key=lambda kv: kv[1]["rank"]):
        layers.add_row(str(row["rank"]), name, f"{row['absmax']:.4g}", str(row["outlier_channels"]),
                       f"{row['input_error']:.4%}", f"{row['output_error']:.4%}")
    presets = Table(title=f"INT8_LAYERS presets (max error {report['method']['max_error']:g})")
    for col in ("preset", "regex", "layers", "mean output err", "max output err"):
        presets.add_column(col, justify="right" if "err" in col or col == "layers" else "left")
    for name, row in report["presets"].items():
        presets.add_row(name, row["regex"], str(row["count"]), f"{row['mean_output_error']:.4%}",
                        f"{row['max_output_error']:.4%}")
    console = Console(width=120)
    console.print(layers)
    console.print(presets)
    rec = report["recommended"]
    console.print(f"recommended INT8_LAYERS={rec['INT8_LAYERS']!s}  ({rec['why']})", highlight=False)


TRAIN_HELP = {
    "recipe": "train file (models/recipes/*-train.toml); default models/recipes/tiny-hybrid-train.toml",
    "out": "output folder (atomic); default the recipe's `output` (the committed model: review the diff)",
    "steps": "train only the first N steps (a quick look; the result is not the recipe's model)",
    "device": "cuda or cpu; default cuda when present (the CPU works, at ~6.5 s a step on 2 cores)",
    "eval": "then print the model's recall score and its answer to each chat shape (HF transformers)",
}


@task(help=TRAIN_HELP)
def train(c, recipe="", out="", steps=0, device="", eval=False):
    """Train a tiny model from a train recipe on rig's generated corpus (the embedded default is one)."""
    import json
    from pathlib import Path

    from rig import paths
    from rig.models import train as tr

    try:
        r = tr.load_recipe(Path(recipe) if recipe else tr.DEFAULT_RECIPE)
    except tr.TrainError as e:
        raise Exit(f"rig: error: {e}", code=2) from None
    if device not in ("", "cuda", "cpu"):
        raise Exit(f"rig: error: --device {device!r}: expected cuda or cpu (or leave it out)", code=2)
    dest = tr.save(r, tr.train(r, int(steps) or None, device or None), Path(out) if out else paths.ROOT / r.output)
    print(dest)
    if eval:
        print(json.dumps(tr.evaluate(dest, device=device or None), indent=2, ensure_ascii=False))


ns = Collection("model")
ns.add_task(fixture)
ns.add_task(quantize)
ns.add_task(fetch)
ns.add_task(verify)
ns.add_task(manifest)
ns.add_task(calibrate)
ns.add_task(train)
