"""rig's own GPU kernels: the folders under ``kernels/`` (sources, kernel.toml) and their builds.

- ``spec``: a folder's ``kernel.toml`` (name, archs, CUDA sources, Triton modules), validated;
- ``build``: ``inv kernels.build`` — nvcc with pinned flags and Triton's ahead-of-time compiler,
  deterministic, into ``.rig/kernels/<name>/`` with a manifest of hashes;
- ``manifest``: that record and the checks serve's preflight, verify and the fingerprint make;
- ``cubin``: loads a built fatbin through the CUDA driver API and launches its kernels on torch's stream.

Kernel folders have hyphens in their names, so their Python files are loaded by path (``load``),
never imported as packages. A vLLM server finds them through two environment variables the plan
sets (``plan_env``), made absolute when the server starts (``server_env``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from rig import paths

ENV_DIR = "VLLM_RIG_KERNELS_DIR"
"""The server's variable naming the kernels/ folder (sources: the Triton modules are loaded from there)."""
ENV_BUILD = "VLLM_RIG_KERNELS_BUILD"
"""The server's variable naming the build root (.rig/kernels: the fatbins, manifests)."""


def build_root() -> Path:
    """Where builds are: ``$VLLM_RIG_KERNELS_BUILD`` inside a server rig started, else ``<state dir>/kernels``
    (``.rig/kernels`` unless RIG_STATE_DIR moves it)."""
    given = os.environ.get(ENV_BUILD)
    return Path(given) if given else paths.state_dir() / "kernels"


def build_folder(name: str, root: Path | None = None) -> Path:
    """The build folder of kernel ``name``."""
    return (root or build_root()) / name


def module_name(kernel: str, stem: str) -> str:
    """The sys.modules name of a kernel folder's file: unique per kernel, as the folder's own loaders use it."""
    return f"rig_kernel_{kernel.replace('-', '_')}_{stem}"


def load(name: str, module: str | None = None, root: Path | None = None, fresh: bool = False) -> ModuleType:
    """Kernel ``name``'s Python module, loaded by path: ``module`` (a file stem), else its first [[triton]] module.

    Registered in sys.modules before it runs (a dataclass or a sibling loader needs that), once
    per process: a second call returns the same module. ``fresh`` (the build) executes the file
    anew under a name of its own path, so a build never compiles a module loaded earlier from
    another folder or before an edit.
    """
    from rig.kernels import spec as kspec

    ks = kspec.load_named(name, root)
    if module is None:
        if not ks.triton:
            raise kspec.KernelSpecError(f"kernel {name!r} declares no [[triton]] module to load")
        module = Path(ks.triton[0].module).stem
    path = kspec.folder_of(name, root) / f"{module}.py"
    if not path.is_file():
        raise kspec.KernelSpecError(f"kernel {name!r} has no module {module!r} ({path} does not exist)")
    mod_name = module_name(name, module)
    if fresh:
        mod_name += "_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return load_file(path, mod_name, fresh)


def load_file(path: Path, name: str, fresh: bool = False) -> ModuleType:
    """The Python file at ``path`` as module ``name``: what ``load`` does once it has the path, and how tests and
    bench scripts load a kernel folder's file that no kernel.toml declares (kernels/kvarn).

    Registered in sys.modules before it runs (a dataclass or a sibling loader looks its module up while the file
    runs) and removed again when it raises; once per process: a second call returns the same module, unless
    ``fresh``, which executes the file anew.
    """
    if not fresh and name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        del sys.modules[name]
        raise
    return loaded


def _in_checkout(path: Path) -> str:
    """A path as a plan writes it: relative to the checkout when inside it, so plans do not depend on where
    the checkout lies (the plan is a pure function of the repository and the inputs)."""
    try:
        return str(path.relative_to(paths.ROOT))
    except ValueError:
        return str(path)


def plan_env() -> dict[str, str]:
    """The variables a plan that needs kernels sets: the sources' folder and the build root."""
    return {ENV_DIR: _in_checkout(paths.KERNELS), ENV_BUILD: _in_checkout(build_root())}


ENV_KVARN = "VLLM_RIG_KVARN_DIR"
"""The server's variable naming kernels/kvarn, whose vllm_backend.py is KV=kvarn's backend (patch kvarn-cache)."""


def kvarn_env() -> dict[str, str]:
    """The variable a KV=kvarn plan sets: kernels/kvarn (Python sources only: nothing is built for it yet)."""
    return {ENV_KVARN: _in_checkout(paths.KERNELS / "kvarn")}


def server_env(env: dict[str, str]) -> dict[str, str]:
    """A plan's env for the server process: the kernel paths made absolute (the server's working
    directory is its caller's, not the checkout)."""
    out = dict(env)
    for key in (ENV_DIR, ENV_BUILD, ENV_KVARN):
        if key in out and not Path(out[key]).is_absolute():
            out[key] = str(paths.ROOT / out[key])
    return out
