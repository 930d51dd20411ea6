"""How fast this host hashes a checkpoint, and what that predicts for the real one's `inv model.verify`.

Writes a file of random bytes under the state folder's tmp/, hashes it with rig's own reader
(rig.models.manifest.sha256_file, the one fetch, verify and serve's preflight use) from the page cache,
once on one thread and then as N copies on N threads (verify hashes the files of a folder in parallel),
and scales the rate to the bytes of the real checkpoint's tensors (the W4A16 shape of
models/qwen3.5-27b-class.toml, rig.models.fixture.weights_bytes). An estimate: a cold read from disk
can be slower than the hash, and the real checkpoint's file count is not known.

    python bench/scripts/hash_rate.py [--mib 512]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

from rig import paths
from rig.models import fixture
from rig.models.manifest import sha256_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="size of the file hashed, MiB")
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    tmp = paths.state_dir() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    files = [tmp / f"hash-rate-{i}.bin" for i in range(threads)]
    size = args.mib * 2**20
    try:
        for f in files:
            f.write_bytes(os.urandom(size))
        t = time.perf_counter()
        sha256_file(files[0])
        one = size / (time.perf_counter() - t)
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(sha256_file, files))
        many = threads * size / (time.perf_counter() - t)
    finally:
        for f in files:
            f.unlink(missing_ok=True)
    real = fixture.weights_bytes(fixture.FixtureSpec("qwen3.5-27b-class"))
    print(f"sha256 from the page cache, {args.mib} MiB per file: 1 thread {one / 2**20:,.0f} MiB/s; "
          f"{threads} threads {many / 2**20:,.0f} MiB/s")
    print(f"real checkpoint's tensors (W4A16 shape of models/qwen3.5-27b-class.toml): {real / 2**30:.2f} GiB -> "
          f"verify estimate {real / one:.0f} s on 1 thread, {real / many:.0f} s on {threads} "
          "(estimate: hash-bound, files already in the page cache)")


if __name__ == "__main__":
    main()
