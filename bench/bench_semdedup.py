"""Semantic dedup at scale: N stored 512-d embeddings through the SemDeDup steps on a 2-worker Dask cluster.

Synthesises ``--rows`` float16 embeddings as side shards of 10,000 rows under ``.bench/semdedup/``
(once per size): points around 2,000 topics on the unit sphere (cosine about 0.5 within a
topic), 2% of them copied later at cosine 0.96-0.99 (the planted duplicates), 1% near others at
cosine 0.85-0.90 (near misses that must stay). Then runs ``tasks.curate.semdedup`` as the
curation flow does (fit on one worker, assign and compare mapped over a Dask LocalCluster of two
single-threaded workers) and prints wall seconds per step, peak resident memory of the whole
process tree (this process and the workers, sampled every 0.2 s), and recall and precision of
the planted duplicates. ``--exact`` adds the baseline beside it: exact all-pairs greedy dedup
(blocked matrix products over every pair, the same rule) on the same rows, for time and for the
share of its duplicates the clustered method finds.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from harness.procs import REPO, TreeSampler

sys.path.insert(0, str(REPO))

DIM, PER_FILE, TOPICS = 512, 10_000, 2_000


def synthesise(base: Path, rows: int, seed: int = 0) -> tuple[list[str], set[tuple[str, str]]]:
    """Side shards of ``rows`` embeddings and the planted (copy key, original key) pairs."""
    import pyarrow as pa

    from tasks.curate.embed import embedding_schema
    from tasks.formats.ledger import write_parquet
    from tasks.formats.storage import Storage

    storage = Storage(str(base))
    rng = np.random.default_rng(seed)
    topics = rng.normal(size=(TOPICS, DIM)).astype(np.float32)
    topics /= np.linalg.norm(topics, axis=1, keepdims=True)
    files, planted = [], set()
    recent: list[tuple[str, np.ndarray]] = []
    n_files = -(-rows // PER_FILE)
    for f in range(n_files):
        n = min(PER_FILE, rows - f * PER_FILE)
        t = topics[rng.integers(TOPICS, size=n)]
        x = t + rng.normal(size=(n, DIM)).astype(np.float32) * (1.0 / np.sqrt(DIM))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        keys = [f"bench-{f * PER_FILE + i:09d}" for i in range(n)]
        # Copies and near misses of rows of earlier files (or earlier in this one).
        pool = recent + list(zip(keys[: n // 2], x[: n // 2]))
        for kind, share, lo, hi in (("copy", 0.02, 0.96, 0.99), ("miss", 0.01, 0.85, 0.90)):
            for i in rng.choice(np.arange(n // 2, n), size=int(n * share), replace=False):
                okey, ovec = pool[rng.integers(len(pool))]
                cos = rng.uniform(lo, hi)
                noise = rng.normal(size=DIM).astype(np.float32)
                noise -= (noise @ ovec) * ovec
                noise /= np.linalg.norm(noise)
                x[i] = cos * ovec + np.sqrt(1 - cos * cos) * noise
                if kind == "copy":
                    planted.add((keys[i], okey))
        recent = list(zip(keys[: n // 2], x[: n // 2]))[:2000]
        path = f"emb/{f:05d}.parquet"
        vec = pa.FixedSizeListArray.from_arrays(pa.array(x.astype(np.float16).reshape(-1)), DIM)
        table = pa.table(
            {
                "key": keys,
                "source": ["bench"] * n,
                "row": pa.array(range(f * PER_FILE, f * PER_FILE + n), pa.int64()),
                "image": vec,
                "text": vec,
                "error": pa.nulls(n, pa.string()),
            },
            schema=embedding_schema(DIM),
        )
        if not (base / path).exists():
            write_parquet(storage, path, table)
        files.append(path)
    return files, planted


def exact(storage, files: list[str], threshold: float) -> dict[str, str]:
    """The baseline: the same greedy rule over every pair (no clusters)."""
    from tasks.curate import semdedup as sd
    from tasks.formats.ledger import read_parquet

    xs, keys = [], []
    for f in files:
        t = read_parquet(storage, f, ["key", "image"])
        col = t.column("image").combine_chunks()
        xs.append(col.values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(col), DIM))
        keys += t.column("key").to_pylist()
    x = np.concatenate(xs)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    by, _ = sd._greedy(x, threshold)
    return {keys[i]: keys[by[i]] for i in np.nonzero(by >= 0)[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--exact", action="store_true", help="also the exact all-pairs baseline (only for <= 200,000 rows)")
    args = ap.parse_args()

    from dask.distributed import Client, LocalCluster

    from tasks.curate import semdedup as sd
    from tasks.formats.storage import Storage

    for rows in args.rows:
        base = REPO / ".bench" / "semdedup" / str(rows)
        t = time.perf_counter()
        files, planted = synthesise(base, rows)
        made = time.perf_counter() - t
        shutil.rmtree(base / "sd", ignore_errors=True)
        storage = Storage(str(base))
        steps: dict[str, float] = {}
        with (
            TreeSampler(interval=0.2) as mem,
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster,
            Client(cluster) as client,
        ):

            def mapper(fn, arglist, steps=steps, client=client):
                name = fn.__name__
                t0 = time.perf_counter()
                out = client.gather(client.map(fn, *zip(*arglist), pure=False)) if arglist else []
                steps[name] = steps.get(name, 0.0) + time.perf_counter() - t0
                return out

            t = time.perf_counter()
            decisions, done = sd.semantic_duplicates(storage, "sd", files, args.threshold, {"bench": 0}, map_fn=mapper)
            wall = time.perf_counter() - t
        found = sd.read_duplicates(storage, decisions)
        pairs = {(k, v[0]) for k, v in found.items()}
        copies = {c for c, _ in planted}
        recall = len(copies & set(found)) / max(len(copies), 1)
        precision = len(pairs & planted) / max(len(pairs), 1)
        step_text = ", ".join(f"{k} {v:.1f} s" for k, v in steps.items())
        print(
            f"{rows:,} rows ({len(files)} side shards, made in {made:.0f} s): semdedup {wall:.1f} s ({step_text}); "
            f"peak RSS of the process tree {mem.peak_rss / 2**30:.2f} GiB; planted copies {len(copies):,}: "
            f"recall {recall:.4f}, precision {precision:.4f} (duplicates found {len(found):,}; {done})"
        )
        if args.exact and rows <= 200_000:
            t = time.perf_counter()
            ex = exact(storage, files, args.threshold)
            et = time.perf_counter() - t
            agree = len(set(found) & set(ex)) / max(len(ex), 1)
            print(
                f"  baseline, exact all pairs: {et:.1f} s ({et / wall:.2f}x the clustered method's time); "
                f"{len(ex):,} duplicates, of which the clustered method finds {agree:.4f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
