"""Where rig keeps things: the repository's content folders and one git-ignored state folder.

Everything rig makes at run time (caches, built models, logs, API keys, results) lives under
``.rig/`` in the checkout, never in the user's home, so a clone is self-contained and
``rm -rf .rig`` is a complete reset. ``RIG_STATE_DIR`` moves it (tests use that for isolation).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"
PATCHES = ROOT / "patches"
KERNELS = ROOT / "kernels"
BENCH = ROOT / "bench"
QUALITY = ROOT / "quality"
DOCS = ROOT / "docs"
LOCKS = ROOT / "locks"
PIXI_TOML = ROOT / "pixi.toml"


def state_dir() -> Path:
    """The git-ignored folder for everything rig writes (``.rig/`` unless ``RIG_STATE_DIR``)."""
    return Path(os.environ.get("RIG_STATE_DIR", ROOT / ".rig")).resolve()


def cache_dir() -> Path:
    """Caches that are safe to delete: compile caches, downloaded wheels, HF home."""
    return state_dir() / "cache"


def models_dir() -> Path:
    """Models rig builds (tiny test models) or downloads (the real checkpoint)."""
    return Path(os.environ.get("RIG_MODELS_DIR", state_dir() / "models")).resolve()


def logs_dir() -> Path:
    """Server and task logs."""
    return state_dir() / "logs"


def results_dir() -> Path:
    """Bench and quality results, one folder per run."""
    return state_dir() / "results"


def cache_env() -> dict[str, str]:
    """Environment that keeps every cache of vLLM, torch, HF and pip inside the project.

    Without these a vLLM start leaves compile caches in ~/.cache and IPC files in /tmp, and
    transformers may try the hub; with them, a run touches nothing outside the checkout.
    """
    c = cache_dir()
    tmp = state_dir() / "tmp"
    env = {
        "VLLM_CACHE_ROOT": str(c / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(c / "inductor"),
        "TRITON_CACHE_DIR": str(c / "triton"),
        "HF_HOME": str(c / "hf"),
        "XDG_CACHE_HOME": str(c / "xdg"),
        "PIP_CACHE_DIR": str(c / "pip"),
        "NUMBA_CACHE_DIR": str(c / "numba"),
        "TMPDIR": str(tmp),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME", "TMPDIR"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    return env
