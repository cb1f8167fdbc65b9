"""Digest benchmark: CPU seconds per GB of the digests a shard's checksum could use, beside SHA-256.

The reshard phase hashes every output byte with SHA-256 (the checksum in the ledger and in a
release's ``index.json``) while the kernel copies it; on 2 cores that hash is most of the
phase's floor (bench/RESULTS.md, issue 17). This prints what each candidate digest costs on
this CPU over the 1 GB reshard corpus (``bench_reshard.py`` makes it), each input mapped and
hashed in 8 MB updates, as the build's hashing thread does; the best of ``--rounds``, page
cache warm. Digests from outside the standard library (``blake3``, ``xxhash``) are measured
when installed and listed as absent otherwise: this project does not depend on them.

    .venv/bin/python bench/bench_digest.py [--gb 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import platform
import time
from collections.abc import Callable
from typing import Any

from harness.report import table

CHUNK = 8 << 20


def candidates() -> dict[str, Callable[[], Any] | None]:
    found: dict[str, Callable[[], Any] | None] = {
        "sha256 (hashlib, the baseline)": hashlib.sha256,
        "sha1 (hashlib)": hashlib.sha1,
        "blake2b (hashlib)": hashlib.blake2b,
        "md5 (hashlib)": hashlib.md5,
    }
    try:
        import blake3

        found["blake3 (one thread)"] = blake3.blake3
    except ImportError:
        found["blake3 (one thread)"] = None
    try:
        import xxhash

        found["xxh3_128 (not cryptographic)"] = xxhash.xxh3_128
    except ImportError:
        found["xxh3_128 (not cryptographic)"] = None
    return found


def cpu_s_per_gb(make: Callable[[], Any], maps: list[mmap.mmap], rounds: int) -> float:
    total = sum(len(m) for m in maps)
    best = float("inf")
    for _ in range(rounds):
        t = time.process_time()
        for m in maps:
            view, h = memoryview(m), make()
            for i in range(0, len(view), CHUNK):
                h.update(view[i : i + CHUNK])
            h.digest()
            view.release()
        best = min(best, time.process_time() - t)
    return best / total * 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="size of the reshard corpus to hash")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    from bench_reshard import ensure_corpus

    samples, sample_kb = 500, 100  # bench_reshard.py's defaults: its corpus is reused
    storage, validated = ensure_corpus(max(1, round(args.gb * 1e9 / (samples * sample_kb * 1024))), samples, sample_kb)
    files = [open(storage.path(t), "rb") for t in validated.tars]  # noqa: SIM115 - closed below
    maps = [mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) for f in files]
    try:
        for m in maps:
            hashlib.sha256(m)  # page cache warm, pages mapped
        gb = sum(len(m) for m in maps) / 1e9
        print(f"# digest benchmark: {platform.machine()}, Python {platform.python_version()}, {gb:.2f} GB")
        rows, base = [], None
        for name, make in candidates().items():
            if make is None:
                rows.append([name, "not installed", ""])
                continue
            s = cpu_s_per_gb(make, maps, args.rounds)
            base = base or s
            rows.append([name, f"{s:.2f}", f"{s / base:.2f}x"])
        print("\n" + "\n".join(table(["digest", "CPU s per GB", "/ sha256"], rows)))
    finally:
        for m in maps:
            m.close()
        for f in files:
            f.close()


if __name__ == "__main__":
    main()
