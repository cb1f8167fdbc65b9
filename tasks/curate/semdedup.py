"""Semantic deduplication (SemDeDup): k-means over image embeddings, pairs compared within clusters, out of core.

The steps are Prefect-free functions over stored side shards (``tasks/curate/embed.py``) that
the flow maps over the cluster:

1. ``fit_centroids``: spherical k-means on a uniform sample of the embeddings (at most
   ``SAMPLE_PER_CLUSTER`` per centroid; faiss trains on at most 256), read file by file; one task.
2. ``assign_file``: every row of one side shard to its nearest centroid, written out by bucket
   of clusters (``parts/.../bucket-NNN.parquet``): one task per side shard.
3. ``dedup_bucket``: one bucket's rows from every part, cluster by cluster, in the recipe's
   order (source order, source, row): a sample whose cosine with an earlier *kept* sample is at
   least the threshold is a duplicate of the earliest such one. Blocks of rows against the
   rest keep a large cluster's pairs out of memory at once. One task per bucket.

Memory is bounded by the sample (step 1), one side shard (step 2) and one bucket (step 3), never
by the dataset. Incremental (``previous``): rows of side shards an earlier decision covered keep
their fate (what was kept stays kept); rows of new side shards are assigned to the same
centroids and compared with the kept rows of their cluster and with each other, never old with
old. A full run over the same files gives the same decisions whenever no new row comes before an
old one in the recipe's order (new shards of appended manifest rows come after).

These decisions are over every row and do not depend on the filters. The filters come first:
``among_survivors`` (called by ``decide``) decides again, from the stored parts, the clusters
where a sample the filters remove kept others, so a group is led by its earliest sample the
filters keep.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.formats.ledger import read_parquet, write_parquet
from tasks.formats.names import digest_of
from tasks.formats.storage import Storage

SAMPLE_PER_CLUSTER = 64  # k-means trains on at most this many samples per centroid
ROWS_PER_BUCKET = 65_536  # about 128 MB of float32 512-d embeddings per bucket task
BLOCK = 2048  # rows compared at once against the rest of their cluster
ITERATIONS = 10
DECISION_SCHEMA = pa.schema(
    [("key", pa.string()), ("duplicate_of", pa.string()), ("similarity", pa.float32()), ("cluster", pa.int32())]
)


@dataclass(frozen=True)
class Space:
    """Where one embedding space's dedup state lives, and its centroids once fitted.

    Args:
        root: the folder under the storage root (named by the model and the k-means settings).
        clusters: k.
        buckets: how the clusters are split into tasks (cluster ``c`` is in bucket ``c % buckets``).
        digest: of the centroids (names the parts made with them).
    """

    root: str
    clusters: int
    buckets: int
    digest: str

    @property
    def centroids(self) -> str:
        return f"{self.root}/centroids.npy"

    def parts(self, side_shard: str) -> list[str]:
        base = f"{self.root}/parts/{digest_of(side_shard, self.digest)}"
        return [f"{base}/bucket-{b:04d}.parquet" for b in range(self.buckets)]


def space_root(dataset: str, model: str, clusters: int | None, seed: int) -> str:
    return f"{dataset}/curate/semdedup/{digest_of(model, clusters, seed, ITERATIONS)}"


def _read_images(storage: Storage, path: str) -> tuple[pa.Table, np.ndarray]:
    """A side shard's rows with an image embedding, and those embeddings as float32 (N, D)."""
    table = read_parquet(storage, path, ["key", "source", "row", "image"])
    table = table.filter(pc.is_valid(table.column("image")))
    col = table.column("image").combine_chunks()
    if len(col) == 0:
        return table, np.zeros((0, 0), np.float32)
    values = col.values.to_numpy(zero_copy_only=False).astype(np.float32)
    return table, values.reshape(len(col), col.type.list_size)


def _unit_images(rows: pa.Table) -> np.ndarray:
    """The rows' image embeddings as float32 unit vectors (N, D), for cosine similarity."""
    col = rows.column("image").combine_chunks()
    x = col.values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(col), col.type.list_size)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return x


def _count(storage: Storage, path: str) -> int:
    with storage.open(path, "rb") as fh:
        return pq.ParquetFile(fh).metadata.num_rows


def fit_centroids(storage: Storage, files: list[str], root: str, clusters: int | None, seed: int) -> Space:
    """Fit spherical k-means on a uniform sample of the files' image embeddings; write the
    centroids under ``root`` and return the space. Deterministic for the files and ``seed``."""
    counts = [_count(storage, f) for f in files]
    n = sum(counts)
    k = max(1, min(clusters or round(math.sqrt(n)), max(n, 1)))
    cap = SAMPLE_PER_CLUSTER * k
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(n, size=min(n, cap), replace=False)) if n else np.zeros(0, int)
    sample: list[np.ndarray] = []
    start = 0
    for f, c in zip(files, counts):
        mine = chosen[(chosen >= start) & (chosen < start + c)] - start
        if len(mine):
            table = read_parquet(storage, f, ["image"])
            col = table.column("image").combine_chunks()
            valid = col.is_valid().to_numpy(zero_copy_only=False)
            values = col.values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(col), col.type.list_size)
            keep = mine[valid[mine]]
            sample.append(values[keep])
        start += c
    x = np.concatenate(sample) if sample else np.zeros((0, 1), np.float32)
    centroids = _kmeans(x, min(k, max(len(x), 1)), rng)
    buf = _npy(centroids)
    storage.write_bytes(f"{root}/centroids.npy", buf)
    buckets = max(1, min(len(centroids), math.ceil(n / ROWS_PER_BUCKET)))
    meta = {"clusters": len(centroids), "buckets": buckets, "samples": int(len(x)), "rows": n}
    storage.write_bytes(f"{root}/centroids.json", json.dumps(meta, sort_keys=True).encode())
    return Space(root, len(centroids), buckets, hashlib.sha256(buf).hexdigest()[:16])


def stored_space(storage: Storage, root: str) -> Space | None:
    """The space whose centroids are stored under ``root``, or None (to be fitted)."""
    try:
        buf = storage.read_bytes(f"{root}/centroids.npy")
        meta = json.loads(storage.read_bytes(f"{root}/centroids.json"))
    except FileNotFoundError:
        return None
    return Space(root, int(meta["clusters"]), int(meta["buckets"]), hashlib.sha256(buf).hexdigest()[:16])


def _npy(a: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    np.save(out, a.astype(np.float32), allow_pickle=False)
    return out.getvalue()


def _centroids(storage: Storage, space: Space) -> np.ndarray:
    import io

    return np.load(io.BytesIO(storage.read_bytes(space.centroids)), allow_pickle=False)


def _kmeans(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Spherical k-means (cosine): k-means++ seeding, then Lloyd iterations on unit vectors."""
    if len(x) == 0:
        return np.zeros((1, max(x.shape[1], 1)), np.float32)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    centres = [x[rng.integers(len(x))]]
    dist = 1.0 - x @ centres[0]
    for _ in range(1, k):
        p = np.maximum(dist, 0)
        total = p.sum()
        idx = rng.choice(len(x), p=p / total) if total > 0 else rng.integers(len(x))
        centres.append(x[idx])
        dist = np.minimum(dist, 1.0 - x @ x[idx])
    c = np.stack(centres)
    for _ in range(ITERATIONS):
        labels = np.argmax(x @ c.T, axis=1)
        sums = np.zeros_like(c)
        np.add.at(sums, labels, x)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        moved = np.where(norms > 0, sums / np.maximum(norms, 1e-12), c)
        if np.allclose(moved, c, atol=1e-6):
            break
        c = moved
    return c.astype(np.float32)


def assign_file(storage: Storage, space: Space, side_shard: str) -> list[str]:
    """Every row of ``side_shard`` with an image embedding, assigned to its nearest centroid,
    written into one part per bucket (kept when already there)."""
    parts = space.parts(side_shard)
    if all(storage.exists(p) for p in parts):
        return parts
    table, x = _read_images(storage, side_shard)
    c = _centroids(storage, space)
    labels = np.argmax(x @ c.T, axis=1).astype(np.int32) if len(x) else np.zeros(0, np.int32)
    table = table.append_column("cluster", pa.array(labels, pa.int32()))
    for b, part in enumerate(parts):
        write_parquet(storage, part, table.filter(pa.array(labels % space.buckets == b)))
    return parts


def _order(rows: pa.Table, source_order: dict[str, int]) -> np.ndarray:
    """Positions of the rows in the recipe's order: (source order, source, row)."""
    sources = rows.column("source").to_pylist()
    keys = list(zip([source_order.get(s, len(source_order)) for s in sources], sources, rows.column("row").to_pylist()))
    return np.array(sorted(range(len(keys)), key=lambda i: keys[i]), dtype=np.int64)


def _greedy(x: np.ndarray, threshold: float, by: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``x`` (unit vectors) in priority order: (index of the kept row each duplicates, or
    -1; cosine with it). A row is a duplicate of the earliest *kept* row whose cosine with it is
    at least ``threshold``. ``by``: rows already decided elsewhere (not -1) neither claim nor are
    claimed. Blocks of ``BLOCK`` rows against every later row keep a large cluster's pairs out of
    memory at once."""
    n = len(x)
    by = np.full(n, -1, dtype=np.int64) if by is None else by.copy()
    sim = np.zeros(n, dtype=np.float32)
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        s = x[lo:hi] @ x[lo:].T
        for i in range(lo, hi):
            if by[i] != -1:
                continue  # a duplicate claims nothing
            row = s[i - lo, i - lo + 1 :]
            later = np.nonzero(row >= threshold)[0] + i + 1
            later = later[by[later] == -1]
            by[later] = i
            sim[later] = row[later - i - 1]
    return by, sim


def _against_kept(new: np.ndarray, kept: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Each new row's earliest kept row (priority order) with cosine >= threshold, or -1; and the cosine."""
    by = np.full(len(new), -1, dtype=np.int64)
    sim = np.zeros(len(new), dtype=np.float32)
    if not len(kept):
        return by, sim
    for lo in range(0, len(new), BLOCK):
        s = new[lo : lo + BLOCK] @ kept.T
        hit = s >= threshold
        first = np.argmax(hit, axis=1)
        any_hit = hit[np.arange(len(s)), first]
        by[lo : lo + len(s)] = np.where(any_hit, first, -1)
        sim[lo : lo + len(s)] = np.where(any_hit, s[np.arange(len(s)), first], 0.0)
    return by, sim


def dedup_bucket(
    storage: Storage,
    parts: list[str],
    threshold: float,
    source_order: dict[str, int],
    out: str,
    previous: dict[str, Any] | None = None,
) -> str:
    """The duplicates among one bucket's rows (``parts``: that bucket's part of every side
    shard), written to ``out`` (key, duplicate_of, similarity, cluster; one row per duplicate).

    ``previous``: ``{"parts": [...], "decisions": path}``, an earlier decision of this bucket
    over some of these parts: their rows keep their fate, and only the other rows are compared:
    with the old kept rows of their cluster first, then with each other. Old pairs are never
    compared again.
    """
    if storage.exists(out):
        return out
    old_parts = set(previous["parts"]) if previous else set()
    carried = read_parquet(storage, previous["decisions"]) if previous else DECISION_SCHEMA.empty_table()
    old_dups = set(carried.column("key").to_pylist())
    tables = [read_parquet(storage, p) for p in parts]
    is_new = (
        np.concatenate([np.full(t.num_rows, p not in old_parts) for p, t in zip(parts, tables)])
        if tables
        else np.zeros(0, bool)
    )
    rows = pa.concat_tables(tables) if tables else pa.table({})
    found: list[dict[str, Any]] = carried.to_pylist()
    if rows.num_rows and is_new.any():
        keys = rows.column("key").to_pylist()
        clusters = rows.column("cluster").to_numpy()
        x = _unit_images(rows)
        order = _order(rows, source_order)
        for cluster in np.unique(clusters[is_new]):
            idx = order[clusters[order] == cluster]
            new = idx[is_new[idx]]
            kept_old = np.array([i for i in idx if not is_new[i] and keys[i] not in old_dups], dtype=np.int64)
            by_old, sim_old = _against_kept(x[new], x[kept_old], threshold)
            claimed = np.where(by_old >= 0, -2, -1)
            by_new, sim_new = _greedy(x[new], threshold, claimed)
            for j, row in enumerate(new):
                if by_old[j] >= 0:
                    kept, similarity = kept_old[by_old[j]], sim_old[j]
                elif by_new[j] >= 0:
                    kept, similarity = new[by_new[j]], sim_new[j]
                else:
                    continue
                found.append(
                    {
                        "key": keys[row],
                        "duplicate_of": keys[kept],
                        "similarity": float(similarity),
                        "cluster": int(cluster),
                    }
                )
    write_parquet(storage, out, pa.Table.from_pylist(found, schema=DECISION_SCHEMA))
    return out


Mapper = Callable[[Callable[..., Any], Iterable[tuple[Any, ...]]], list[Any]]


def plain_map(fn: Callable[..., Any], args: Iterable[tuple[Any, ...]]) -> list[Any]:
    return [fn(*a) for a in args]


STATE = "state.json"


def bucket_decisions(space: Space, threshold: float, parts: list[str], previous: dict[str, Any] | None) -> str:
    """The name of one bucket's decision: its threshold, parts and the decision it extends."""
    return f"{space.root}/decisions/{digest_of(threshold, parts, previous)}.parquet"


def usable_state(storage: Storage, space: Space, threshold: float, files: list[str]) -> dict[str, Any] | None:
    """The last decision of this space, when a run can extend it: same threshold, every side
    shard it covered still among ``files``, and every part and decision it names still stored
    (the storage decides, not the note)."""
    try:
        state = json.loads(storage.read_bytes(f"{space.root}/{STATE}"))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("threshold") != threshold or state.get("digest") != space.digest:
        return None
    if not set(state.get("files", [])) <= set(files):
        return None
    named = [p for b in state.get("buckets", []) for p in (*b["parts"], b["decisions"])]
    if len(state.get("buckets", [])) != space.buckets or not all(storage.exists(p) for p in named):
        return None
    return state


def save_state(
    storage: Storage, space: Space, threshold: float, files: list[str], buckets: list[dict[str, Any]]
) -> None:
    state = {"threshold": threshold, "digest": space.digest, "files": sorted(files), "buckets": buckets}
    storage.write_bytes(f"{space.root}/{STATE}", json.dumps(state, sort_keys=True).encode())


def read_duplicates(storage: Storage, decisions: list[str]) -> dict[str, tuple[str, float]]:
    """key -> (kept key, cosine) over the buckets' decisions."""
    out: dict[str, tuple[str, float]] = {}
    for path in decisions:
        t = read_parquet(storage, path, ["key", "duplicate_of", "similarity"])
        for k, d, s in zip(
            t.column("key").to_pylist(), t.column("duplicate_of").to_pylist(), t.column("similarity").to_pylist()
        ):
            out[k] = (d, s)
    return out


def among_survivors(
    storage: Storage,
    decisions: list[str],
    files: list[str],
    duplicates: dict[str, tuple[str, float]],
    fallen: set[str],
    removed: Callable[[pa.Table], np.ndarray],
    threshold: float,
    source_order: dict[str, int],
    map_fn: Mapper = plain_map,
) -> dict[str, tuple[str, float]]:
    """``duplicates`` (key -> (kept key, cosine), found over every row by ``semantic_duplicates``)
    decided again among the samples the filters keep: a group is led by its earliest *kept*
    sample, never by one a filter removed.

    ``fallen``: the kept samples of those decisions that a filter removes; ``removed(rows)``: of a
    table with ``source`` and ``row`` columns, which rows a filter removes. Only the clusters
    where a fallen sample kept others are compared again (every other cluster's decisions are
    what the comparison over its survivors gives: no removed sample led anyone there), from the
    stored parts: nothing is embedded or assigned again, and ``decisions`` stay as stored (they
    do not depend on the filters, so a new filter threshold reuses them). A removed sample keeps
    what the comparison over every row said of it (its ``duplicate_of``, shown beside its filter's
    reason). ``map_fn`` maps over the buckets of those clusters."""
    if not fallen or not decisions:
        return duplicates
    root = decisions[0].rsplit("/decisions/", 1)[0]
    space = stored_space(storage, root)
    if space is None:
        raise FileNotFoundError(f"semantic dedup {root}: no centroids stored beside its decisions")
    wanted = pa.array(sorted(fallen), pa.string())
    clusters: set[int] = set()
    for path in decisions:
        t = read_parquet(storage, path, ["duplicate_of", "cluster"])
        hit = pc.is_in(t.column("duplicate_of"), value_set=wanted)
        clusters.update(t.filter(hit).column("cluster").to_pylist())
    by_bucket: dict[int, list[int]] = {}
    for c in sorted(clusters):
        by_bucket.setdefault(c % space.buckets, []).append(c)
    out = dict(duplicates)
    args = [(storage, space, files, b, cs, removed, threshold, source_order) for b, cs in sorted(by_bucket.items())]
    for survivors, found in map_fn(_survivors_bucket, args):
        for key in survivors:
            out.pop(key, None)
        out.update(found)
    return out


def _survivors_bucket(
    storage: Storage,
    space: Space,
    files: list[str],
    bucket: int,
    clusters: list[int],
    removed: Callable[[pa.Table], np.ndarray],
    threshold: float,
    source_order: dict[str, int],
) -> tuple[list[str], dict[str, tuple[str, float]]]:
    """The surviving rows of ``clusters`` (of one bucket) and their duplicates among themselves:
    ``_greedy`` over them in the recipe's order, as ``dedup_bucket`` compares."""
    wanted = pa.array(clusters, pa.int32())
    tables = []
    for f in files:
        t = read_parquet(storage, space.parts(f)[bucket])
        t = t.filter(pc.is_in(t.column("cluster"), value_set=wanted))
        if t.num_rows:
            t = t.filter(pa.array(~removed(t)))
        if t.num_rows:
            tables.append(t)
    if not tables:
        return [], {}
    rows = pa.concat_tables(tables)
    keys = rows.column("key").to_pylist()
    labels = rows.column("cluster").to_numpy()
    x = _unit_images(rows)
    order = _order(rows, source_order)
    found: dict[str, tuple[str, float]] = {}
    for cluster in clusters:
        idx = order[labels[order] == cluster]
        by, sim = _greedy(x[idx], threshold)
        for j in np.flatnonzero(by >= 0).tolist():
            found[keys[idx[j]]] = (keys[idx[by[j]]], float(sim[j]))
    return keys, found


def semantic_duplicates(
    storage: Storage,
    root: str,
    files: list[str],
    threshold: float,
    source_order: dict[str, int],
    clusters: int | None = None,
    seed: int = 0,
    map_fn: Mapper = plain_map,
) -> tuple[list[str], dict[str, int]]:
    """Every step in order, each mapped with ``map_fn`` (a plain loop by default; the flow passes
    one that submits to the cluster). Returns the buckets' decision files and what was computed
    now (``fitted``, ``assigned`` side shards, ``compared`` buckets, ``incremental`` 0/1)."""
    space = stored_space(storage, root)
    fitted = space is None
    if space is None:
        space = map_fn(fit_centroids, [(storage, files, root, clusters, seed)])[0]
    todo = [f for f in files if not all(storage.exists(p) for p in space.parts(f))]
    map_fn(assign_file, [(storage, space, f) for f in todo])
    state = usable_state(storage, space, threshold, files)
    buckets, args = [], []
    for b in range(space.buckets):
        parts = [space.parts(f)[b] for f in files]
        previous = state["buckets"][b] if state else None
        if previous is not None and previous["parts"] == parts:
            buckets.append(previous)  # nothing new in this bucket: the decision stands
            continue
        out = bucket_decisions(space, threshold, parts, previous)
        buckets.append({"parts": parts, "decisions": out})
        if not storage.exists(out):
            args.append((storage, parts, threshold, source_order, out, previous))
    map_fn(dedup_bucket, args)
    save_state(storage, space, threshold, files, buckets)
    done = {"fitted": int(fitted), "assigned": len(todo), "compared": len(args), "incremental": int(state is not None)}
    return [b["decisions"] for b in buckets], done
