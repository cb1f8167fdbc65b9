"""Fine-tuning ingest benchmark: records/s and peak RSS of the streamed ingest beside the old whole-file read.

Records files of LLaVA-style instruction records are generated once under ``.bench/ingest/``
(``--jsonl-gb`` and ``--json-gb`` sizes; each record has an id, one image path or none (one
in ten is text-only), 2 to 8 turns of 5 to 120 words; one in 50 has its roles swapped, and in
the JSONL files one line in 1,000 is not JSON (not in the arrays: the old reader fails a whole
array on one broken element; tests/test_records.py covers that path)). For each file and round, methods
alternate, each in a fresh child process:

- ``new``: ``tasks.finetune.ingest`` as the flow runs it, without Prefect: ``plan_ingest``
  (hash + per-range record count) in the child, ``ingest_range`` for every range over a pool of
  ``--workers`` processes, then ``finish_ingest``;
- ``old``: the ingest of commit ``OLD_REV`` (the ``tasks`` package of that commit, taken from
  git into ``.bench/trees/``): one task reads the file whole, then checks it.

Printed per run: records, seconds, records/s, CPU seconds (child and workers), and peak RSS (the largest ``ru_maxrss`` of the
child and of its pool workers); then medians per method and size, the ratio new/old where
both ran, and the ratio of each method's peak RSS at the largest size to its smallest (1.0x:
memory does not grow with the file). ``--parsers`` adds a parse-only comparison on the JSON
array: the stdlib streaming reader (``tasks.finetune.records``) beside ``ijson.items`` (yajl2_c) when
ijson is importable (it is not a project dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from harness.procs import REPO, clock, peak_rss_mb, process_cpu, run_json
from harness.report import in_turn
from harness.tools import tree_at

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BENCH = REPO / ".bench" / "ingest"
OLD_REV = "54abba3"  # the last commit with the whole-file ingest
WORDS = "the a cat dog image shows what is on of in person table red blue car street sky tree building people standing sitting".split()


def record(rng: random.Random, i: int) -> dict:
    turns = []
    for t in range(rng.choice((2, 2, 4, 6, 8))):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60) if t % 2 == 0 else rng.randint(10, 120)))
        turns.append({"from": "human" if (t % 2 == 0) != (i % 50 == 7) else "gpt", "value": text})
    rec: dict = {"id": f"{i:012d}", "conversations": turns}
    if i % 10:
        rec["image"] = f"coco/train2017/{i:012d}.jpg"
        turns[0]["value"] = "<image>\n" + turns[0]["value"]
    return rec


def generate(path: Path, gigabytes: float) -> int:
    """Write records until the file reaches the size; returns the record count (kept in a sidecar).

    Conversations come from a pool of 997 made once (writing gigabytes one random word at a
    time takes longer than reading them); ids and image paths are unique per record.
    """
    meta = path.with_suffix(path.suffix + ".records")
    if path.exists() and meta.exists():
        return int(meta.read_text())
    rng = random.Random(0)
    pool = [json.dumps(record(rng, i)).replace(f"{i:012d}", "@ID@").encode() for i in range(997)]
    target = int(gigabytes * 1e9)
    tmp = path.with_suffix(".tmp")
    n = size = 0
    array = path.suffix == ".json"
    with open(tmp, "wb") as fh:
        fh.write(b"[\n" if array else b"")
        while size < target:
            # Not JSON, in JSONL only: the old reader fails a whole array on one broken element.
            line = (
                b'{"id": "broken", "conversations": ['
                if n % 1000 == 500 and not array
                else pool[n % 997].replace(b"@ID@", b"%012d" % n)
            )
            sep = (b",\n" if n else b"") if array else b""
            fh.write(sep + line + (b"" if array else b"\n"))
            size += len(sep) + len(line) + 1
            n += 1
        fh.write(b"\n]\n" if array else b"")
    tmp.rename(path)
    meta.write_text(str(n))
    return n


# --- child runs -----------------------------------------------------------------------------


def _range_job(job):
    from tasks.finetune.ingest import ingest_range

    storage, plan, part, cfg = job
    return ingest_range(storage, plan, part, cfg, {})


def run_new(path: Path, out: Path, workers: int, rows_per_shard: int) -> int:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from tasks.finetune.ingest import finish_ingest, plan_ingest
    from tasks.formats.recipe_download import SourceConfig
    from tasks.formats.recipe_finetune import FinetuneConfig
    from tasks.formats.storage import Storage

    storage = Storage(str(out))
    source = SourceConfig(name="llava", manifest=str(path), rows_per_shard=rows_per_shard)
    cfg = FinetuneConfig()
    plan = plan_ingest(storage, "bench", source, cfg, {})
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
        parts = list(pool.map(_range_job, [(storage, plan, r, cfg) for r in plan.ranges]))
    return finish_ingest(storage, plan, parts).rows


def run_old(path: Path, out: Path, rows_per_shard: int) -> int:
    """The whole-file ingest, ``tasks`` being the package at ``OLD_REV`` in this process (see child)."""
    from tasks.finetune import ingest_source
    from tasks.recipe import FinetuneConfig, SourceConfig
    from tasks.storage import Storage

    source = SourceConfig(name="llava", manifest=str(path), rows_per_shard=rows_per_shard)
    return ingest_source(Storage(str(out)), "bench", source, FinetuneConfig(), {}).rows


def child(method: str, path: Path, out: Path, workers: int, rows_per_shard: int) -> None:
    if method == "old":  # the old code whole: its modules have moved or gone since
        sys.path.insert(0, str(tree_at(OLD_REV)))
        import tasks.finetune  # noqa: F401 - imports are set-up, not ingest
    else:
        import tasks.finetune.ingest  # noqa: F401

    shutil.rmtree(out, ignore_errors=True)

    with clock(process_cpu) as lap:
        rows = run_new(path, out, workers, rows_per_shard) if method == "new" else run_old(path, out, rows_per_shard)
    peak = max(peak_rss_mb(), peak_rss_mb(children=True))
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"rows": rows, "seconds": lap.wall, "cpu": lap.cpu, "peak_mb": peak}))


def parse_only(path: Path) -> dict[str, float]:
    """Elements per CPU second of a JSON array: the stdlib streaming reader and, when
    importable, ijson (CPU time, as the other work on a shared machine would skew wall time)."""
    from tasks.finetune.records import iter_records

    out = {}
    with open(path, "rb") as fh:
        start = time.process_time()
        n = sum(1 for _ in iter_records(fh, path.name, 1 << 20))
        out["stdlib raw_decode (tasks.finetune.records)"] = n / (time.process_time() - start)
    try:
        import ijson
    except ImportError:
        return out
    with open(path, "rb") as fh:
        start = time.process_time()
        n = sum(1 for _ in ijson.items(fh, "item"))
        out[f"ijson.items ({ijson.backend})"] = n / (time.process_time() - start)
    return out


# --- driver ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl-gb", default="0.2,2", help="JSONL sizes in GB (comma-separated)")
    parser.add_argument("--json-gb", default="0.1,1", help="JSON array sizes in GB")
    parser.add_argument("--methods", default="new,old")
    parser.add_argument("--old-max-gb", type=float, default=0.5, help="run the old path only up to this size")
    parser.add_argument("--repeats", type=int, default=3, help="rounds at the smallest size")
    parser.add_argument("--large-repeats", type=int, default=1, help="rounds at larger sizes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rows-per-shard", type=int, default=5000)
    parser.add_argument("--parsers", action="store_true")
    parser.add_argument(
        "--parsers-only", action="store_true", help="only the parse comparison (on existing or new files)"
    )
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), BENCH / f"out-{args.child[0]}", args.workers, args.rows_per_shard)
        return

    BENCH.mkdir(parents=True, exist_ok=True)
    files = [(BENCH / f"llava-{gb}gb.jsonl", float(gb)) for gb in args.jsonl_gb.split(",") if gb] + [
        (BENCH / f"llava-{gb}gb.json", float(gb)) for gb in args.json_gb.split(",") if gb
    ]
    counts = {}
    for path, gb in files:
        t = time.perf_counter()
        counts[path] = generate(path, gb)
        print(
            f"{path.name}: {counts[path]} records, {path.stat().st_size / 1e9:.2f} GB ({time.perf_counter() - t:.0f} s to make or find)",
            flush=True,
        )
    results: dict[tuple[str, str], list[dict]] = {}
    methods = [] if args.parsers_only else args.methods.split(",")
    for path, gb in files:
        smallest = gb == min(g for p, g in files if p.suffix == path.suffix)
        here = [m for m in methods if m != "old" or gb <= args.old_max_gb]
        for r in range(args.repeats if smallest else args.large_repeats):
            for m in in_turn(here, r, first=0):
                cmd = [sys.executable, __file__, "--child", m, str(path), "--workers", str(args.workers)]
                cmd += ["--rows-per-shard", str(args.rows_per_shard)]
                res = run_json(cmd, {**os.environ, "PYTHONPATH": str(REPO)})
                if res["rows"] != counts[path]:
                    raise SystemExit(f"{m} on {path.name}: {res['rows']} rows, the file has {counts[path]} records")
                results.setdefault((path.name, m), []).append(res)
                print(
                    f"round {r + 1} {path.name:22s} {m:4s} {res['rows']:9d} records {res['seconds']:8.1f} s {res['rows'] / res['seconds']:9.0f} records/s {res['cpu']:8.1f} CPU s peak {res['peak_mb']:7.0f} MB",
                    flush=True,
                )
    load = os.getloadavg()
    print(
        f"\n{os.cpu_count()} CPUs, {platform.machine()}, python {platform.python_version()}, {args.workers} workers, rows_per_shard {args.rows_per_shard}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print(f"{'file':22s} {'method':6s} {'records/s':>10s} {'per CPU s':>10s} {'peak MB':>8s} {'vs old':>7s}")
    for path, _gb in files:
        for m in methods:
            runs = results.get((path.name, m))
            if not runs:
                print(f"{path.name:22s} {m:6s} {'(not run: over --old-max-gb)':>30s}")
                continue
            rate = statistics.median(r["rows"] / r["seconds"] for r in runs)
            old = results.get((path.name, "old"))
            ratio = (
                f"{rate / statistics.median(r['rows'] / r['seconds'] for r in old):6.2f}x" if old and m != "old" else ""
            )
            per_cpu = statistics.median(r["rows"] / r["cpu"] for r in runs)
            print(
                f"{path.name:22s} {m:6s} {rate:10.0f} {per_cpu:10.0f} {statistics.median(r['peak_mb'] for r in runs):8.0f} {ratio:>7s}"
            )
    for suffix in (".jsonl", ".json"):
        sized = sorted((gb, p) for p, gb in files if p.suffix == suffix)
        for m in methods:
            ends = [results.get((p.name, m)) for _, p in (sized[0], sized[-1])] if len(sized) > 1 else []
            if ends and all(ends):
                small, large = (statistics.median(r["peak_mb"] for r in e) for e in ends)
                print(
                    f"peak RSS {suffix} {m}: {large:.0f} MB at {sized[-1][0]} GB / {small:.0f} MB at {sized[0][0]} GB = {large / small:.2f}x"
                )
    if args.parsers or args.parsers_only:
        for path, _ in files:
            if path.suffix == ".json":
                for name, rate in parse_only(path).items():
                    print(f"parse only {path.name}: {name}: {rate:,.0f} elements per CPU s")


if __name__ == "__main__":
    main()
