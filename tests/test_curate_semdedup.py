"""Semantic dedup over stored side shards: the order rule, chains, big clusters, incremental runs, storage as the truth."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.curate import semdedup as sd
from tasks.curate.embed import embedding_schema
from tasks.formats.ledger import write_parquet
from tasks.formats.storage import Storage

DIM = 32


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def _near(v: np.ndarray, cos: float, rng: np.random.Generator) -> np.ndarray:
    """A unit vector at cosine ``cos`` from unit vector ``v``."""
    noise = rng.normal(size=v.shape)
    noise -= (noise @ v) * v
    noise = _unit(noise)
    return cos * v + np.sqrt(1 - cos * cos) * noise


def _side(storage: Storage, path: str, source: str, rows: list[int], vectors: np.ndarray) -> str:
    keys = [f"{source}-{r:09d}" for r in rows]
    flat = pa.array(vectors.astype(np.float16).reshape(-1), pa.float16())
    vec = pa.FixedSizeListArray.from_arrays(flat, DIM)
    table = pa.table(
        {
            "key": keys,
            "source": [source] * len(rows),
            "row": pa.array(rows, pa.int64()),
            "image": vec,
            "text": vec,
            "error": pa.nulls(len(rows), pa.string()),
        },
        schema=embedding_schema(DIM),
    )
    write_parquet(storage, path, table)
    return path


def _dups(storage: Storage, decisions: list[str]) -> dict[str, tuple[str, float]]:
    return sd.read_duplicates(storage, decisions)


def test_planted_copies_point_at_the_earliest_sample_by_source_order_then_row(tmp_path):
    rng = np.random.default_rng(0)
    storage = Storage(str(tmp_path))
    base = _unit(rng.normal(size=(40, DIM)))
    # "b" comes first in the recipe; its row 5 is the original of copies in both sources.
    copies = np.stack([_near(base[5], 0.98, rng), _near(base[5], 0.97, rng), _near(base[7], 0.96, rng)])
    a = _side(storage, "e/a.parquet", "a", list(range(40)) + [40, 41, 42], np.concatenate([base, copies]))
    b = _side(storage, "e/b.parquet", "b", [5, 6], np.stack([_near(base[5], 0.99, rng), _unit(rng.normal(size=DIM))]))
    order = {"b": 0, "a": 1}
    decisions, done = sd.semantic_duplicates(storage, "sd", [a, b], 0.95, order, clusters=4)
    dups = _dups(storage, decisions)
    assert set(dups) == {"a-000000005", "a-000000040", "a-000000041", "a-000000042"}
    assert dups["a-000000005"][0] == "b-000000005" and dups["a-000000040"][0] == "b-000000005"
    assert dups["a-000000042"][0] == "a-000000007"
    assert all(s >= 0.95 for _, s in dups.values())
    assert done == {"fitted": 1, "assigned": 2, "compared": 1, "incremental": 0}
    # File order does not change a decision.
    again, _ = sd.semantic_duplicates(storage, "sd2", [b, a], 0.95, order, clusters=4)
    assert _dups(storage, again) == dups


def test_a_chain_keeps_its_ends_when_they_are_not_alike(tmp_path):
    storage = Storage(str(tmp_path))
    a = _unit(np.eye(DIM)[0])
    c = _unit(np.eye(DIM)[0] * np.cos(0.6) + np.eye(DIM)[1] * np.sin(0.6))  # cos(a, c) = 0.83
    b = _unit(a + c)  # cos(a, b) = cos(b, c) = 0.95
    f = _side(storage, "e/x.parquet", "x", [0, 1, 2], np.stack([a, b, c]))
    decisions, _ = sd.semantic_duplicates(storage, "sd", [f], 0.94, {"x": 0}, clusters=1)
    # b is a duplicate of a (kept); c is close only to b, which is not kept, so c stays.
    assert {k: v[0] for k, v in _dups(storage, decisions).items()} == {"x-000000001": "x-000000000"}


def test_a_cluster_larger_than_a_block_is_compared_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(sd, "BLOCK", 7)
    rng = np.random.default_rng(3)
    storage = Storage(str(tmp_path))
    base = _unit(rng.normal(size=(30, DIM)))
    vecs = np.concatenate([base, np.stack([_near(base[i], 0.98, rng) for i in range(0, 30, 3)])])
    f = _side(storage, "e/x.parquet", "x", list(range(len(vecs))), vecs)
    decisions, _ = sd.semantic_duplicates(storage, "sd", [f], 0.95, {"x": 0}, clusters=1)
    got = {k: v[0] for k, v in _dups(storage, decisions).items()}
    assert got == {f"x-{30 + j:09d}": f"x-{3 * j:09d}" for j in range(10)}


def test_incremental_runs_compare_only_new_rows_and_recompute_when_a_part_is_gone(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    storage = Storage(str(tmp_path))
    base = _unit(rng.normal(size=(60, DIM)))
    old = np.concatenate([base[:50], np.stack([_near(base[1], 0.98, rng)])])  # row 50 copies row 1
    f1 = _side(storage, "e/1.parquet", "s", list(range(51)), old)
    first, done1 = sd.semantic_duplicates(storage, "sd", [f1], 0.95, {"s": 0}, clusters=3)
    assert _dups(storage, first) == {"s-000000050": ("s-000000001", pytest.approx(0.98, abs=5e-3))}

    # A nightly: new rows, one copying an old kept row, one copying another new row.
    new = np.concatenate([base[50:60], np.stack([_near(base[2], 0.97, rng), _near(base[55], 0.97, rng)])])
    f2 = _side(storage, "e/2.parquet", "s", list(range(100, 112)), new)
    sizes = []
    real = sd._against_kept
    monkeypatch.setattr(sd, "_against_kept", lambda n, k, t: sizes.append(len(n)) or real(n, k, t))
    second, done2 = sd.semantic_duplicates(storage, "sd", [f1, f2], 0.95, {"s": 0})
    assert done2 == {"fitted": 0, "assigned": 1, "compared": done2["compared"], "incremental": 1}
    assert sum(sizes) == 12  # only the new rows were compared, never old with old
    got = {k: v[0] for k, v in _dups(storage, second).items()}
    assert got == {"s-000000050": "s-000000001", "s-000000110": "s-000000002", "s-000000111": "s-000000105"}

    # The same decision, made from scratch over both files, agrees (new rows come last).
    full, _ = sd.semantic_duplicates(storage, "sd-full", [f1, f2], 0.95, {"s": 0}, clusters=3)
    assert {k: v[0] for k, v in _dups(storage, full).items()} == got

    # A part is gone: it is made again from its side shard, and the decision stands.
    space = sd.stored_space(storage, "sd")
    storage.rm(space.parts(f1)[0])
    third, done3 = sd.semantic_duplicates(storage, "sd", [f1, f2], 0.95, {"s": 0})
    assert (done3["assigned"], done3["compared"]) == (1, 0) and third == second
    # A decision the state names is gone: the next run decides from scratch, not from the note.
    storage.rm(second[0])
    fourth, done4 = sd.semantic_duplicates(storage, "sd", [f1, f2], 0.95, {"s": 0})
    assert done4["incremental"] == 0 and done4["compared"] == space.buckets
    assert {k: v[0] for k, v in _dups(storage, fourth).items()} == got


def test_rows_without_an_image_embedding_are_left_out(tmp_path):
    storage = Storage(str(tmp_path))
    v = _unit(np.ones((2, DIM)))
    path = _side(storage, "e/x.parquet", "x", [0, 1], v)
    t = pa.parquet.read_table(tmp_path / path)
    img = t.column("image").combine_chunks()
    masked = pa.FixedSizeListArray.from_arrays(img.values, DIM, mask=pa.array([False, True]))
    write_parquet(storage, path, t.set_column(3, "image", masked))
    decisions, _ = sd.semantic_duplicates(storage, "sd", [path], 0.9, {"x": 0}, clusters=1)
    assert _dups(storage, decisions) == {}


def test_semantic_dedup_on_s3(s3_bucket):
    bucket, options = s3_bucket
    storage = Storage(f"s3://{bucket}/root", options)
    rng = np.random.default_rng(9)
    base = _unit(rng.normal(size=(20, DIM)))
    f = _side(storage, "e/x.parquet", "x", list(range(21)), np.concatenate([base, _near(base[4], 0.99, rng)[None]]))
    decisions, _ = sd.semantic_duplicates(storage, "sd", [f], 0.95, {"x": 0}, clusters=2)
    assert {k: v[0] for k, v in _dups(storage, decisions).items()} == {"x-000000020": "x-000000004"}


def _scores(storage: Storage, path: str, source: str, rows: list[int], alignment: list[float]) -> str:
    table = pa.table(
        {
            "key": [f"{source}-{r:09d}" for r in rows],
            "source": [source] * len(rows),
            "row": pa.array(rows, pa.int64()),
            "error": pa.nulls(len(rows), pa.string()),
            "alignment": pa.array(alignment, pa.float32()),
        }
    )
    write_parquet(storage, path, table)
    return path


@pytest.mark.parametrize("clusters", [1, 3])
def test_duplicates_are_decided_among_the_samples_the_filters_keep(tmp_path, monkeypatch, clusters):
    """A group whose first sample a filter removes is led by its earliest surviving sample: its
    later copies are duplicates of that one, never of the removed one (the whole group gone)."""
    from tasks.curate.decide import ShardInput, decide
    from tasks.formats.recipe_curate import CurateConfig, ScoreRule, SemDedupRule

    rng = np.random.default_rng(3)
    storage = Storage(str(tmp_path))
    base = _unit(rng.normal(size=(30, DIM)))
    # Row 3 (removed by the filter) leads copies 30, 31 and 32; row 7 (kept) leads copy 33.
    copies = np.stack([_near(base[3], c, rng) for c in (0.995, 0.99, 0.985)] + [_near(base[7], 0.98, rng)])
    rows = list(range(34))
    vectors = np.concatenate([base, copies])
    half = 17
    files = [
        _side(storage, "e/0.parquet", "s", rows[:half], vectors[:half]),
        _side(storage, "e/1.parquet", "s", rows[half:], vectors[half:]),
    ]
    alignment = [0.5] * 34
    alignment[3] = 0.1  # below min: removed as low_alignment
    alignment[31] = 0.15  # a copy the filter removes too
    scores = [
        _scores(storage, "sc/0.parquet", "s", rows[:half], alignment[:half]),
        _scores(storage, "sc/1.parquet", "s", rows[half:], alignment[half:]),
    ]
    shards = [ShardInput(f"t{i}.tar", f"l{i}.parquet", "s", i, files[i], scores[i], "run") for i in range(2)]
    decisions, _ = sd.semantic_duplicates(storage, "sd", files, 0.95, {"s": 0}, clusters=clusters)
    every_row = _dups(storage, decisions)
    assert {k: d for k, (d, _) in every_row.items()} == {
        "s-000000030": "s-000000003",
        "s-000000031": "s-000000003",
        "s-000000032": "s-000000003",
        "s-000000033": "s-000000007",
    }
    cfg = CurateConfig(model="m", alignment=ScoreRule(min=0.2), semdedup=SemDedupRule(threshold=0.95))
    _, fates = decide(storage, "ds", cfg, shards, every_row, dedup=decisions, source_order={"s": 0})
    got = {
        r["key"]: (r["reason"], r["duplicate_of"]) for d in fates for r in pq.read_table(tmp_path / d.fates).to_pylist()
    }
    assert got["s-000000003"] == ("low_alignment", None)
    assert got["s-000000031"][0] == "low_alignment"  # a filter's reason comes first
    assert got["s-000000030"] == (None, None)  # the earliest survivor of the group is kept
    assert got["s-000000032"] == ("semantic_duplicate_of:s-000000030", "s-000000030")
    assert got["s-000000033"] == ("semantic_duplicate_of:s-000000007", "s-000000007")
    kept = {k for k, (reason, _) in got.items() if reason is None}
    assert kept == {f"s-{r:09d}" for r in rows} - {"s-000000003", "s-000000031", "s-000000032", "s-000000033"}
    # The stored decisions (over every row) are not touched: a new threshold reuses them.
    assert _dups(storage, decisions) == every_row
    again, done = sd.semantic_duplicates(storage, "sd", files, 0.95, {"s": 0}, clusters=clusters)
    assert again == decisions and done["compared"] == 0 and done["assigned"] == 0
    # Without a removed leader the decisions stand as they are, and nothing is compared again.
    calls: list[object] = []
    real = sd._survivors_bucket
    monkeypatch.setattr(sd, "_survivors_bucket", lambda *a: calls.append(a) or real(*a))
    keep_all = CurateConfig(model="m", alignment=ScoreRule(min=0.0), semdedup=SemDedupRule(threshold=0.95))
    _, fates = decide(storage, "ds", keep_all, shards, every_row, dedup=decisions, source_order={"s": 0})
    assert calls == []
    got = {r["key"]: r["duplicate_of"] for d in fates for r in pq.read_table(tmp_path / d.fates).to_pylist()}
    assert {k: v for k, v in got.items() if v} == {k: d for k, (d, _) in every_row.items()}
