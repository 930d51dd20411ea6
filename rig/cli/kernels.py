"""`inv kernels.*`: build rig's GPU kernels (kernels/) ahead of time and say whether each build is usable."""

from __future__ import annotations

from invoke import Collection, Exit, task

HELP = {
    "arch": "comma-separated archs to build for, e.g. sm86 (RTX 3090) or sm86,sm90 (default: every arch the "
            "kernel.toml declares)",
    "kernel": "one kernel folder under kernels/ (default: every kernel)",
}


@task(help=HELP)
def build(c, arch="", kernel=""):
    """Compile the kernels (nvcc fatbins, Triton cubins) into .rig/kernels/<name>/ with a manifest of hashes."""
    import sys
    import time

    from rich.console import Console

    from rig.kernels import build as kbuild
    from rig.kernels import spec, toolchain

    con = Console(stderr=True)
    t0 = time.monotonic()
    try:
        with con.status("kernels.build…") as status:
            def say(msg: str) -> None:
                status.update(f"kernels.build: {msg}")
                con.print(f"[{time.monotonic() - t0:5.1f} s] {msg}", highlight=False)

            built = kbuild.build_all([kernel] if kernel else [], arch, say=say)
    except (kbuild.BuildError, spec.KernelSpecError, toolchain.ToolchainError) as e:
        raise Exit(f"rig: error: {e}", code=2) from None
    for m in built:
        print(kbuild.summary(m))
    print(f"built {len(built)} kernel(s) in {time.monotonic() - t0:.1f} s", file=sys.stdout)


@task(help={"arch": "the arch to check for (default: sm86, the RTX 3090)", "kernel": HELP["kernel"]})
def status(c, arch="sm86", kernel=""):
    """Is each kernel's build usable for ARCH (serve's preflight check)? Names what is wrong; exit 1 if any is not."""
    from rig.kernels import manifest, spec

    names = [kernel] if kernel else spec.available()
    bad = 0
    for name in names:
        problems = manifest.problems(name, arch)
        bad += bool(problems)
        print(f"{name}: " + ("ok for " + arch if not problems else "; ".join(problems)))
    if bad:
        raise Exit(f"rig: {bad} kernel(s) not usable for {arch}: `inv kernels.build --arch {arch}`", code=1)


ns = Collection("kernels")
ns.add_task(build)
ns.add_task(status)
