"""Curation's decisions in flat memory: the dataset-wide cuts from passes over the score columns
alone, exactly the sorted cut, and each shard's fates exactly as they were decided row by row."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.curate import decide as decide_mod
from tasks.curate.decide import ShardInput, decide, fates_path
from tasks.curate.scores import cuts, cuts_over, fate, score_names
from tasks.formats.ledger import write_parquet
from tasks.formats.names import digest_of
from tasks.formats.recipe_curate import CurateConfig, HeadConfig, ScoreRule
from tasks.formats.storage import Storage


def _fraction_cut(values: np.ndarray, fraction: float, top: bool) -> float | None:
    """The cut as it was computed before it streamed: every value sorted, the ``ceil(fraction * n)``-th
    from the kept side (at least one); the reference, written out here."""
    if not len(values):
        return None
    ordered = np.sort(values)[::-1] if top else np.sort(values)
    keep = max(1, math.ceil(fraction * len(ordered) - 1e-9))
    return float(ordered[min(keep, len(ordered)) - 1])


def _column(rng: np.random.Generator, n: int, dtype: type = np.float32, nulls: float = 0.05) -> pa.Array:
    """Scores with many ties (a coarse grid), some spread, NaNs, nulls, zeros of both signs, infinities."""
    grid = rng.integers(-20, 40, n) / 40.0
    spread = rng.normal(0.25, 0.08, n)
    v = np.where(rng.random(n) < 0.5, grid, spread).astype(dtype)
    special = rng.random(n)
    v[special < 0.03] = np.nan
    v[(special >= 0.03) & (special < 0.04)] = -0.0
    v[(special >= 0.04) & (special < 0.045)] = 0.0
    v[(special >= 0.045) & (special < 0.047)] = np.inf
    v[(special >= 0.047) & (special < 0.048)] = -np.inf
    return pa.array(v, mask=rng.random(n) < nulls)


def _parts(rng: np.random.Generator, sizes: list[int], dtype: type = np.float32) -> list[pa.Table]:
    return [pa.table({"score": _column(rng, n, dtype)}) for n in sizes]


def _sorted_cut(parts: list[pa.Table], fraction: float, top: bool, name: str = "score") -> float | None:
    """The cut as it was: every value at once, sorted (``_fraction_cut``)."""
    values = np.concatenate(
        [
            p.column(name).drop_null().to_numpy(zero_copy_only=False).astype(np.float64)
            for p in parts
            if name in p.column_names
        ]
    )
    return _fraction_cut(values[~np.isnan(values)], fraction, top)


def _rule(fraction: float, top: bool) -> CurateConfig:
    side = {"keep_top": fraction} if top else {"keep_bottom": fraction}
    return CurateConfig(model="m", heads={"score": HeadConfig(path="x", **side)})


FRACTIONS = [1.0, 0.999, 0.5, 0.3, 0.01, 1e-4, 1e-9]


@pytest.mark.parametrize("top", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_streamed_cut_is_the_sorted_cut_over_shards_with_ties_nans_nulls_and_empty_ones(seed, top):
    rng = np.random.default_rng(seed)
    parts = _parts(rng, [0, 3_000, 1, 0, 5_000, 17, 2_000])
    parts.insert(2, pa.table({"other": pa.array([1.0, 2.0], pa.float32())}))  # a shard without the score
    for fraction in FRACTIONS:
        (cut,) = cuts_over(_rule(fraction, top), lambda names: iter(parts))
        got, other = (cut.low, cut.high) if top else (cut.high, cut.low)
        want = _sorted_cut(parts, fraction, top)
        assert want is not None and got == want and other is None, (fraction, got, want)
        assert cuts(_rule(fraction, top), pa.concat_tables(parts, promote_options="default"))[0] == cut


def test_the_cut_is_exact_on_float64_scores_and_on_all_equal_negative_and_unscored_ones():
    rng = np.random.default_rng(5)
    for parts in (
        _parts(rng, [4_000, 0, 3_000], dtype=np.float64),
        [pa.table({"score": pa.array([0.25] * 100, pa.float32())})],
        [pa.table({"score": pa.array(-rng.random(999).astype(np.float32))})],
        [pa.table({"score": pa.array([1e300, -1e-300, 5e-324, 0.0, -2.5], pa.float64())})],
        [pa.table({"score": pa.array([np.nan, None, np.nan], pa.float32())})],
        [pa.table({"score": pa.array([], pa.float32())})],
        [],
    ):
        for fraction in FRACTIONS:
            for top in (True, False):
                (cut,) = cuts_over(_rule(fraction, top), lambda names, parts=parts: iter(parts))
                want = _sorted_cut(parts, fraction, top) if parts else None
                got, other = (cut.low, cut.high) if top else (cut.high, cut.low)
                assert got == want and (got is None) == (want is None) and other is None


def test_float32_scores_take_two_passes_over_the_fraction_columns_only_and_thresholds_none():
    rng = np.random.default_rng(3)
    parts = [
        pa.table({"alignment": _column(rng, 1_000), "aesthetic": _column(rng, 1_000), "nsfw": _column(rng, 1_000)})
        for _ in range(4)
    ]
    asked: list[list[str]] = []

    def read(names: list[str]):
        asked.append(list(names))
        for p in parts:  # a shard at a time, only the columns asked for
            yield p.select([n for n in names if n in p.column_names])

    cfg = CurateConfig(
        model="m",
        alignment=ScoreRule(keep_top=0.3),
        heads={"aesthetic": HeadConfig(path="x", keep_top=0.5), "nsfw": HeadConfig(path="x", max=0.5)},
    )
    align, aes, nsfw = cuts_over(cfg, read)
    assert asked == [["alignment", "aesthetic"], ["alignment", "aesthetic"]]
    assert align.low == _sorted_cut(parts, 0.3, True, "alignment") and align.rule == "keep_top 0.3"
    assert aes.low == cuts(cfg, pa.concat_tables(parts))[1].low
    assert (nsfw.low, nsfw.high, nsfw.rule) == (None, 0.5, "max 0.5")
    asked.clear()
    only_thresholds = CurateConfig(model="m", alignment=ScoreRule(min=0.2))
    assert cuts_over(only_thresholds, read)[0].low == 0.2 and asked == []


# ------------------------------------------------------------------------------ whole decisions


def _decide_as_before(storage, dataset, cfg, shards, duplicates):
    """``decide`` as it was before it streamed: every scores table concatenated, the cuts
    sorted, each row's fate from ``scores.fate``. The reference the new one must equal."""

    def finite(value):
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(np.float32(value))

    names = score_names(cfg)
    tables = {s.scores: pq.read_table(storage.path(s.scores)) for s in shards}
    all_scores = pa.concat_tables([tables[s.scores] for s in shards])
    applied = []
    for cut in cuts(cfg, pa.table({})):  # the thresholds; the fractions sorted below
        rule = cfg.alignment if cut.name == "alignment" else cfg.heads[cut.name]
        values = all_scores.column(cut.name).drop_null().to_numpy(zero_copy_only=False).astype(np.float64)
        values = values[~np.isnan(values)]
        low = _fraction_cut(values, rule.keep_top, True) if rule.keep_top is not None else cut.low
        high = _fraction_cut(values, rule.keep_bottom, False) if rule.keep_bottom is not None else cut.high
        applied.append(type(cut)(cut.name, low, high, cut.rule))
    out = []
    for s in shards:
        t = tables[s.scores]
        cols = {n: t.column(n).to_pylist() for n in names if n in t.column_names}
        errors = t.column("error").to_pylist() if "error" in t.column_names else [None] * t.num_rows
        rows = []
        for i, key in enumerate(t.column("key").to_pylist()):
            scored = {n: finite(cols[n][i]) for n in cols}
            dup = duplicates.get(key)
            reason, detail = fate(scored, applied, dup, errors[i])
            rows.append(
                {
                    "key": key,
                    "reason": reason,
                    "detail": detail,
                    "duplicate_of": dup[0] if dup else None,
                    "similarity": dup[1] if dup else None,
                    **scored,
                }
            )
        out.append((digest_of(s.ledger, s.embedded_by, rows), rows))
    return applied, out


def _scores_shards(storage: Storage, rng: np.random.Generator, sizes: list[int]) -> list[ShardInput]:
    shards = []
    for j, n in enumerate(sizes):
        errors = [f"broken {i}" if rng.random() < 0.02 else None for i in range(n)]
        table = pa.table(
            {
                "key": pa.array([f"s{j}-{i:06d}" for i in range(n)], pa.string()),
                "source": pa.array(["s"] * n, pa.string()),
                "row": pa.array(range(n), pa.int64()),
                "error": pa.array(errors, pa.string()),
                "alignment": _column(rng, n),
                "aesthetic": pa.array((rng.normal(5, 1, n)).astype(np.float32), mask=rng.random(n) < 0.02),
                "watermark": _column(rng, n, dtype=np.float64),  # a float64 one: rounded to float32 as before
            }
        )
        rel = f"ds/curate/scores/h/{j:03d}.parquet"
        write_parquet(storage, rel, table)
        shards.append(ShardInput(f"t{j}.tar", f"l{j}.parquet", "s", j, f"e{j}", rel, f"run-{j % 2}"))
    return shards


@pytest.mark.parametrize(
    "alignment, heads",
    [
        (
            ScoreRule(keep_top=0.3),
            {"aesthetic": HeadConfig(path="x", min=4.5), "watermark": HeadConfig(path="x", max=0.4)},
        ),
        (ScoreRule(min=0.2), {"aesthetic": HeadConfig(path="x", keep_bottom=0.8), "watermark": HeadConfig(path="x")}),
        (ScoreRule(keep_top=1.0), {"watermark": HeadConfig(path="x", keep_top=1e-6, max=0.6)}),
    ],
)
def test_decide_gives_the_same_cuts_fates_and_names_as_sorting_everything(tmp_path, alignment, heads):
    storage = Storage(str(tmp_path))
    rng = np.random.default_rng(11)
    shards = _scores_shards(storage, rng, [700, 0, 1, 1_200, 300])
    dups = {f"s0-{i:06d}": ("s3-000001", 0.951234567) for i in range(0, 700, 9)}
    dups["s3-000100"] = ("s0-000000", 0.99)
    cfg = CurateConfig(model="m", alignment=alignment, heads=heads)

    applied, decisions = decide(storage, "ds", cfg, shards, dups, threads=3)
    before, rows_before = _decide_as_before(storage, "ds", cfg, shards, dups)

    assert applied == before
    assert [d.shard for d in decisions] == shards
    for d, (digest, rows) in zip(decisions, rows_before):
        assert d.digest == digest and d.fates == fates_path("ds", digest)
        assert d.removed == sum(r["reason"] is not None for r in rows)
        table = pq.read_table(tmp_path / d.fates)
        names = [n for n in ("alignment", "aesthetic", "watermark") if n in {"alignment", *heads}]
        assert table.column_names == ["key", "reason", "detail", "duplicate_of", "similarity", *names]
        want = pa.Table.from_pylist(rows, schema=table.schema) if rows else table.slice(0, 0)
        assert table.equals(want)
    reasons = {r["reason"] for _, rows in rows_before for r in rows}
    assert "undecodable_image" in reasons and None in reasons and len(reasons) >= 4


def test_decide_reads_each_scores_table_whole_only_once_and_the_cut_columns_alone_otherwise(tmp_path, monkeypatch):
    storage = Storage(str(tmp_path))
    shards = _scores_shards(storage, np.random.default_rng(2), [50, 60, 0, 70])
    reads: list[tuple[str, tuple[str, ...]]] = []
    real = decide_mod._read

    def spy(storage, rel, columns):
        table = real(storage, rel, columns)
        reads.append((rel, tuple(table.column_names)))
        return table

    monkeypatch.setattr(decide_mod, "_read", spy)
    cfg = CurateConfig(model="m", alignment=ScoreRule(keep_top=0.5), heads={"aesthetic": HeadConfig(path="x", min=5)})
    decide(storage, "ds", cfg, shards, {}, threads=2)
    cut_reads = [r for r in reads if r[1] == ("alignment",)]
    whole = [r for r in reads if r[1] != ("alignment",)]
    assert sorted(cut_reads) == sorted([(s.scores, ("alignment",)) for s in shards] * 2)  # two passes
    assert sorted(r[0] for r in whole) == sorted(s.scores for s in shards)  # in threads: any order
    assert all(cols == ("key", "error", "alignment", "aesthetic") for _, cols in whole)
    assert decide(storage, "ds", cfg, [], {}) == ([], [])


def test_the_fates_digest_written_column_by_column_is_digest_of_the_rows():
    from decimal import Decimal

    from tasks.curate.decide import rows_digest

    columns = {
        "key": ["a", 'quote " and \\ back', "ünï, cödé %s", "tab\tnew\nline"],
        "reason": [None, "low_alignment", "semantic_duplicate_of:x, y", None],
        "detail": ["100% sure", None, "{not: json}", "\u2028"],
        "duplicate_of": [None, "k", None, "k2"],
        "similarity": [None, 0.951234567, 1, Decimal("0.5")],  # whatever the caller gave
        "alignment": [0.30629605054855347, None, float("inf"), -0.0],
        "zeta": [1e-05, 5e-324, -float("inf"), 123456789.0],
    }
    columns["nothing"] = [None] * 4
    rows = [dict(zip(columns, r)) for r in zip(*columns.values())]
    floats, strings = {"alignment", "zeta", "nothing"}, {"key", "reason", "detail"}
    want = digest_of("led/ger.parquet", "run-ü", rows)
    assert rows_digest("led/ger.parquet", "run-ü", columns, floats, strings) == want
    assert rows_digest("led/ger.parquet", "run-ü", columns, set(), set()) == want
    empty = {name: [] for name in columns}
    assert rows_digest("l", "", empty, floats, strings) == digest_of("l", "", [])
