"""Pieces to carry rig's GPU environment to an offline GPU host, and the commands that install it there.

A GPU host often has a driver, CUDA libraries and a Python, but no network; the way onto it may
take files of a bounded size only. This fetches the wheels of a lock (the wheelhouse machinery
of ``inv env.wheelhouse``: hash-checked, for the target Python and platform), leaves out what
the host already provides (``--leave-out`` globs, ``--keep`` names to carry anyway), and writes
them as tar pieces of at most ``--piece-size`` with ``install.sh``, which checks, joins and
installs them on the host with ``pip install --no-index --no-deps --target SITE``.

    python bench/scripts/gpu_carry.py --env gpu --python 3.12 --wheels .rig/wheels-gpu-py312 \\
        --out .rig/carry --leave-out 'nvidia-*' --keep nvidia-nccl-cu13 --piece-size 60M

Then carry every file of --out to one folder on the host and run the printed commands there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from rig.env import bootstrap, carry, wheelhouse
from rig.env import lock as envlock


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="gpu", choices=sorted(envlock.LOCK_FEATURES))
    ap.add_argument("--python", default="3.12", help="the host's CPython (default 3.12)")
    ap.add_argument("--platform", default=envlock.WHEELHOUSE_PLATFORM, help="<arch>-manylinux_2_<glibc minor>")
    ap.add_argument("--wheels", required=True, type=Path, help="wheelhouse folder (files already there are reused)")
    ap.add_argument("--out", required=True, type=Path, help="folder for the pieces and install.sh (old pieces removed)")
    ap.add_argument("--leave-out", action="append", default=[], metavar="GLOB",
                    help="names the host already provides (repeatable), e.g. 'nvidia-*'")
    ap.add_argument("--keep", action="append", default=[], metavar="NAME",
                    help="carry this one even if a --leave-out matches it (repeatable)")
    ap.add_argument("--piece-size", default="60M", help="largest piece (binary units, like split -b; default 60M)")
    ap.add_argument("--site", default="/tmp/rig-site", help="where install.sh is told to install on the host")
    args = ap.parse_args(argv)
    console = Console()
    try:
        size = carry.parse_size(args.piece_size)
        lock = envlock.lock_file(args.env, args.python)
        if not lock.is_file():
            raise carry.CarryError(f"{lock.name} is missing: make it with `inv env.lock --env {args.env} "
                                   f"--python {args.python}`")
        names = carry.select(list(bootstrap.read_lock(lock)), args.leave_out, args.keep)
        with tempfile.TemporaryDirectory() as tmp:
            part = envlock.sublock(lock, set(names), Path(tmp, lock.name))
            rows = wheelhouse.build(part, args.wheels.resolve(), args.python, args.platform, console)
        packed = carry.pack(args.wheels.resolve(), rows, args.out.resolve(), size, args.python)
    except (carry.CarryError, wheelhouse.WheelhouseError, ValueError) as e:
        print(f"gpu_carry: error: {e}", file=sys.stderr)
        return 2
    total = sum(r.size for r in rows)
    console.print(f"{len(rows)} of {len(bootstrap.read_lock(lock))} wheels of {lock.name}, "
                  f"{wheelhouse.human(total)} ({total} bytes) -> {len(packed.pieces)} pieces of at most "
                  f"{args.piece_size} in {args.out}")
    console.print(f"left out: {', '.join(sorted(set(bootstrap.read_lock(lock)) - set(names))) or 'nothing'}")
    console.print("on the host, with every file of the folder in one place:")
    console.print(f"  sh install.sh {args.site} && export PYTHONPATH={args.site}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
