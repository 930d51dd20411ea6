"""The servable folder a trained (or degraded) tiny model is written to: one writer for every caller.

``rig.models.train.save`` (the trained hybrid) and ``rig.quality.controls`` (the battery's dense control and
its degraded copy) both write through ``write``, so the files a server loads and the manifest ``tiny.verify``
checks are laid out the same way whichever produced the weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rig.models import tiny


def write(dest: Path, config: dict, tokenizer, state: dict, record: dict) -> Path:
    """Write a servable folder atomically (built aside in ``<dest>.partial``, renamed): the tokenizer, bf16
    safetensors, config.json, generation_config.json and a manifest (``tiny.MANIFEST``) of ``record`` plus
    every file's sha256 under ``files``. A folder already at ``dest`` is moved aside first and removed only
    once the new one is in place."""
    import torch
    from safetensors.torch import save_file

    work = dest.with_name(dest.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tokenizer.save_pretrained(work)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(state.items())}
    save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
    (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (work / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
         "pad_token_id": config["pad_token_id"]}, indent=2, sort_keys=True) + "\n")
    files = {p.name: tiny._sha256(p) for p in sorted(work.iterdir()) if p.is_file()}
    (work / tiny.MANIFEST).write_text(json.dumps({**record, "files": files}, indent=2, sort_keys=True) + "\n")
    if dest.exists():
        old = dest.with_name(dest.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        dest.rename(old)
        work.rename(dest)
        shutil.rmtree(old)
    else:
        work.rename(dest)
    return dest
