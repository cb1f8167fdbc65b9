"""Reshard benchmark: tasks.reshard beside `cp` of the same bytes, in one run.

One invocation generates (or reuses) a corpus of input shards under ``.bench/reshard/``:
``--shards`` WebDataset tars of ``--samples`` samples each (``--sample-kb`` KB of random bytes
as the jpg, a caption txt and a json), written with ShardWriter, with their ledgers (a
rejected row after every tenth sample, as real ledgers have). The inputs are read once with
``cp`` to warm the page cache (it cannot be dropped without root), then each round runs, in
turn, into a fresh folder that is removed after it is measured:

- ``cp``: ``cp -r`` of the input folder (the baseline); ``cp+sync`` adds ``sync`` of the
  copies, since the reshard fsyncs every output as its atomic writer must;
- ``reshard``: ``plan_reshard`` and every ``build_output`` in this process, one after another,
  no shuffle;
- ``reshard-shuffle``: the same with a seed (reads grouped per input inside 64 MiB windows,
  writes in permutation order);
- ``reshard-nofsync``: the unshuffled reshard through a bench-only storage whose atomic
  writer renames without fsync, as ``cp`` does: the copy path alone, for comparison;
- ``tarfile``: Python tarfile re-packing member by member (read, then addfile), on the first
  ``--tarfile-shards`` inputs only, scaled by the bytes it handled.

Printed: median MB/s over the rounds (input bytes / wall seconds) and the ratio to ``cp`` and
to ``cp+sync`` of the same rounds, then plan time for a synthetic 10,000-shard, 10M-sample
dataset (with and without a seed) and output-ledger (index) writing time per 100k samples.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tasks.ledger import LedgerRow, write_ledger  # noqa: E402
from tasks.reshard import InputShard, build_output, plan_reshard  # noqa: E402
from tasks.shards import ShardWriter  # noqa: E402
from tasks.storage import Storage  # noqa: E402

BENCH_DIR = REPO / ".bench" / "reshard"
CORPUS_VERSION = 1  # bump when the generator changes
METHODS = ("cp", "cp+sync", "reshard", "reshard-shuffle", "reshard-nofsync", "tarfile")


class NoSyncStorage(Storage):
    """Bench only: an atomic writer without the fsyncs, to compare with plain ``cp``."""

    @contextlib.contextmanager
    def atomic_writer(self, rel):
        target = self.path(rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = target + ".tmp"
        with open(tmp, "wb") as fh:
            yield fh
        os.replace(tmp, target)


def ensure_corpus(shards: int, samples: int, sample_kb: int) -> tuple[Storage, list[InputShard]]:
    """The input shards and ledgers, made once and reused (a marker file says complete)."""
    name = f"v{CORPUS_VERSION}-s{shards}-n{samples}-kb{sample_kb}"
    storage = Storage(str(BENCH_DIR / name))
    inputs = []
    rng = __import__("numpy").random.default_rng(0)
    for i in range(shards):
        tar, ledger = f"inputs/{i:04d}.tar", f"ledgers/{i:04d}.ledger.parquet"
        inputs.append(InputShard(tar, ledger, samples))
        if storage.exists(ledger):
            continue
        rows = []
        with storage.atomic_writer(tar) as fh, ShardWriter(fh) as writer:
            row = 0
            for n in range(samples):
                key = f"src{i:04d}-{row:07d}"
                size = int(sample_kb * 1024 * rng.uniform(0.5, 1.5))
                members = {
                    "jpg": rng.bytes(size),
                    "txt": f"caption of sample {row} of shard {i}".encode(),
                    "json": f'{{"row": {row}, "shard": {i}}}'.encode(),
                }
                rec = writer.write_sample(key, members)
                rows.append(
                    LedgerRow(key=key, source=f"src{i:04d}", row=row, shard=tar, bytes=size, offset=rec.offset,
                              length=rec.length, members=rec.members_as_dicts())
                )
                row += 1
                if n % 10 == 9:
                    rows.append(LedgerRow(key=f"src{i:04d}-{row:07d}", source=f"src{i:04d}", row=row, reason="too_large"))
                    row += 1
        write_ledger(storage, ledger, rows)
    return storage, inputs


def _cpu() -> float:
    """CPU seconds of this process and its finished children (cp, sync)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_cp(src: Path, dst: Path) -> tuple[tuple[float, float], tuple[float, float]]:
    """((wall, cpu) of cp -r, (wall, cpu) of cp -r then sync of the copies)."""
    t0, c0 = time.perf_counter(), _cpu()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    t1, c1 = time.perf_counter(), _cpu()
    subprocess.run(["sync", *map(str, sorted(dst.iterdir()))], check=True)
    t2, c2 = time.perf_counter(), _cpu()
    return (t1 - t0, c1 - c0), (t2 - t0, c2 - c0)


def run_reshard(storage: Storage, inputs: list[InputShard], n: int, seed: int | None, prefix: str):
    t0, c0 = time.perf_counter(), _cpu()
    plan = plan_reshard(inputs, n, prefix=prefix, seed=seed)
    results = [build_output(storage, out) for out in plan.outputs]
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    if sum(r.samples for r in results) != plan.total:
        raise SystemExit("reshard lost samples")
    return (wall, cpu), results


def run_tarfile(src_paths: list[Path], dst: Path) -> tuple[float, float]:
    dst.mkdir(parents=True)
    t0, c0 = time.perf_counter(), _cpu()
    for path in src_paths:
        with tarfile.open(path) as tin, tarfile.open(dst / path.name, "w") as tout:
            for info in tin:
                tout.addfile(info, tin.extractfile(info))
    return time.perf_counter() - t0, _cpu() - c0


def plan_times(repeats: int = 1) -> dict[str, float]:
    inputs = [InputShard(f"in/{i:06d}.tar", f"in/{i:06d}.ledger.parquet", 1000) for i in range(10_000)]
    out = {}
    for label, seed in (("plan 10k shards x 1k, no shuffle", None), ("plan 10k shards x 1k, shuffle", 7)):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = plan_reshard(inputs, 1000, prefix="p", seed=seed)
            best = min(best, time.perf_counter() - t0)
            del plan
        out[label] = best
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=20, help="input shards (default 20)")
    p.add_argument("--samples", type=int, default=500, help="samples per input shard (default 500)")
    p.add_argument("--sample-kb", type=int, default=100, help="mean jpg size in KB (default 100)")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="N of the outputs (default 1000)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--tarfile-shards", type=int, default=2, help="inputs the tarfile baseline repacks (default 2)")
    p.add_argument("--no-plan", action="store_true", help="skip the 10k-shard planning measurement")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    storage, inputs = ensure_corpus(args.shards, args.samples, args.sample_kb)
    in_dir = Path(storage.path("inputs"))
    tar_paths = sorted(in_dir.iterdir())
    total_bytes = sum(p.stat().st_size for p in tar_paths)
    tar_bytes = sum(p.stat().st_size for p in tar_paths[: args.tarfile_shards])
    work = Path(storage.path("work"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    run_cp(in_dir, work / "warm")  # warm the page cache
    shutil.rmtree(work / "warm")
    # and the imports and first calls (pyarrow compute kernels), so round 1 is like the others
    build_output(storage, plan_reshard(inputs[:1], args.samples_per_shard, prefix="work/warm-reshard").outputs[0])
    shutil.rmtree(work / "warm-reshard")

    wall: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    ledger = {"fsync": [0.0, 0], "nofsync": [0.0, 0]}
    nosync = NoSyncStorage(storage.root)
    for r in range(args.repeats):
        for method, (w, c) in zip(("cp", "cp+sync"), run_cp(in_dir, work / f"cp-{r}")):
            wall[method].append(w)
            cpu[method].append(c)
        shutil.rmtree(work / f"cp-{r}")
        for method, seed, where in (
            ("reshard", None, storage),
            ("reshard-shuffle", 1000 + r, storage),
            ("reshard-nofsync", None, nosync),
        ):
            (w, c), results = run_reshard(where, inputs, args.samples_per_shard, seed, f"work/{method}-{r}")
            wall[method].append(w)
            cpu[method].append(c)
            acc = ledger["fsync" if where is storage else "nofsync"]
            acc[0] += sum(x.ledger_seconds for x in results)
            acc[1] += sum(x.samples for x in results)
            shutil.rmtree(work / f"{method}-{r}")
        w, c = run_tarfile(tar_paths[: args.tarfile_shards], work / f"tarfile-{r}")
        wall["tarfile"].append(w * total_bytes / tar_bytes)
        cpu["tarfile"].append(c * total_bytes / tar_bytes)
        shutil.rmtree(work / f"tarfile-{r}")

    mb = total_bytes / 1e6
    print(f"# reshard benchmark: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"# {args.shards} input shards x {args.samples} samples, ~{args.sample_kb} KB each, {mb:.0f} MB; "
          f"N={args.samples_per_shard}; {args.repeats} rounds; page cache warm; tarfile on {args.tarfile_shards} shards, scaled")
    print()
    print("| method | median wall s | MB/s | x cp | x cp+sync | CPU s | CPU x cp+sync |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = {m: statistics.median(v) for m, v in wall.items()}
    cmed = {m: statistics.median(v) for m, v in cpu.items()}
    for m in METHODS:
        print(
            f"| {m} | {med[m]:.2f} | {mb / med[m]:.0f} | {med['cp'] / med[m]:.2f} | {med['cp+sync'] / med[m]:.2f} "
            f"| {cmed[m]:.2f} | {cmed['cp+sync'] / cmed[m]:.2f} |"
        )
    print()
    for label, (s, n) in ledger.items():
        print(f"output ledger (index) writing, {label}: {s / n * 1e5:.2f} s per 100k samples "
              f"({int(n)} samples in outputs of {args.samples_per_shard})")
    if not args.no_plan:
        for label, s in plan_times().items():
            print(f"{label}: {s:.2f} s")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
