"""Folder and pattern sources: files found as Spark and Hugging Face write them, planned a file at a time, keys that never shift, files that disagree named."""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_manifests import CountingStorage

from tasks.audit.reconcile import Reconciliation
from tasks.formats import manifests
from tasks.formats.manifests import (
    ManifestError,
    combine,
    group_files,
    iter_chunks,
    list_manifest_files,
    plan_file,
    plan_files,
    plan_source,
    read_chunk,
    sample_key,
)
from tasks.formats.recipe_download import SourceConfig
from tasks.formats.storage import Storage


def source(manifest: str | Path, **kw) -> SourceConfig:
    return SourceConfig(name="web", manifest=str(manifest), **kw)


def part(folder: Path, name: str, start: int, n: int, **columns) -> Path:
    """A parquet part of ``n`` rows whose urls are numbered from ``start``."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "url": [f"http://example.com/{i}.jpg" for i in range(start, start + n)],
        "caption": [f"c {i}" for i in range(start, start + n)],
    }
    data.update(columns)
    path = folder / name
    pq.write_table(pa.table(data), path)
    return path


def spark_folder(root: Path) -> Path:
    """Spark's layout: part files, _SUCCESS, .crc side files, a _temporary folder, and a README."""
    out = root / "out"
    part(out, "part-00001-5f2c.snappy.parquet", 100, 3)
    part(out, "part-00000-5f2c.snappy.parquet", 0, 4)
    (out / "_SUCCESS").write_bytes(b"")
    (out / "_committed_123").write_bytes(b"{}")
    (out / ".part-00000-5f2c.snappy.parquet.crc").write_bytes(b"crc")
    (out / "_temporary" / "0").mkdir(parents=True)
    (out / "_temporary" / "0" / "part-00009.parquet").write_bytes(b"half written")
    (out / "README.md").write_text("not a manifest")
    return out


def rows_of(storage: Storage, plan) -> list[dict]:
    return [r for ref in plan.chunks for r in read_chunk(storage, ref).to_pylist()]


def tag(rel: str) -> str:
    return hashlib.sha256(rel.encode()).hexdigest()[:8]


# -- finding the files ------------------------------------------------------------------------


def test_a_spark_folder_takes_the_part_files_in_name_order(tmp_path):
    out = spark_folder(tmp_path)
    files = list_manifest_files(source(out))
    assert [f.rel for f in files] == ["part-00000-5f2c.snappy.parquet", "part-00001-5f2c.snappy.parquet"]
    assert [f.tag for f in files] == [tag(f.rel) for f in files]
    assert all(f.fmt == "parquet" and f.multi for f in files)
    assert files[0].display == f"{out}/part-00000-5f2c.snappy.parquet"


def test_a_folder_plans_every_file_with_stable_keys_and_origins(tmp_path):
    out = spark_folder(tmp_path)
    storage = Storage(str(tmp_path / "store"))
    plan = plan_source(source(out, rows_per_shard=2), storage, "demo")
    assert (plan.rows, plan.files, plan.note) == (7, 2, "")
    # Chunks never span files: 4 rows -> 2 + 2, 3 rows -> 2 + 1.
    assert [c.rows for c in plan.chunks] == [2, 2, 2, 1]
    first, second = tag("part-00000-5f2c.snappy.parquet"), tag("part-00001-5f2c.snappy.parquet")
    assert [c.name for c in plan.chunks] == [
        f"{first}-000000",
        f"{first}-000001",
        f"{second}-000000",
        f"{second}-000001",
    ]
    assert plan.chunks[0].path.startswith(f"demo/manifests/web/{first}/000000-")
    rows = rows_of(storage, plan)
    keys = [sample_key("web", r["row"]) for r in rows]
    assert keys == [f"web-{first}-{i:09d}" for i in range(4)] + [f"web-{second}-{i:09d}" for i in range(3)]
    assert [r["url"] for r in rows] == [f"http://example.com/{i}.jpg" for i in (0, 1, 2, 3, 100, 101, 102)]
    assert rows[5]["origin"] == f"{out}/part-00001-5f2c.snappy.parquet:2"
    assert [c.first_row for c in plan.chunks] == [rows[0]["row"], rows[2]["row"], rows[4]["row"], rows[6]["row"]]
    digest = hashlib.sha256()
    for f in list_manifest_files(source(out)):
        digest.update(f"{f.rel}\t{f.size}\t{hashlib.sha256((out / f.rel).read_bytes()).hexdigest()}\n".encode())
    assert plan.manifest_sha256 == digest.hexdigest()
    assert plan.manifest_bytes == sum((out / f.rel).stat().st_size for f in list_manifest_files(source(out)))


def test_adding_or_removing_a_file_rewrites_and_renames_nothing_else(tmp_path):
    out = spark_folder(tmp_path)
    storage = CountingStorage(str(tmp_path / "store"))
    src = source(out, rows_per_shard=2)
    before = plan_source(src, storage, "demo")
    keys_before = {sample_key("web", r["row"]): r["url"] for r in rows_of(storage, before)}

    # A file that sorts first (a new Spark job's part), then one that sorts last.
    part(out, "part-00000-0a1b.snappy.parquet", 500, 3)
    part(out, "part-00002-5f2c.snappy.parquet", 900, 1)
    storage.writes.clear()
    after = plan_source(src, storage, "demo")
    assert after.rows == before.rows + 4
    assert set(before.chunks) <= set(after.chunks)  # same index, rows, hash and path
    assert len(storage.writes) == 3 and all(c.path in storage.writes for c in set(after.chunks) - set(before.chunks))
    keys_after = {sample_key("web", r["row"]): r["url"] for r in rows_of(storage, after)}
    assert {k: keys_after[k] for k in keys_before} == keys_before

    (out / "part-00000-5f2c.snappy.parquet").unlink()
    storage.writes.clear()
    removed = plan_source(src, storage, "demo")
    assert storage.writes == []
    assert set(removed.chunks) == {c for c in after.chunks if tag("part-00000-5f2c.snappy.parquet") not in c.path}


def test_a_single_file_source_keeps_plain_keys(tmp_path):
    path = part(tmp_path, "one.parquet", 0, 3)
    plan = plan_source(source(path), Storage(str(tmp_path / "store")), "demo")
    rows = rows_of(Storage(str(tmp_path / "store")), plan)
    assert [sample_key("web", r["row"]) for r in rows] == ["web-000000000", "web-000000001", "web-000000002"]
    assert [c.name for c in plan.chunks] == ["000000"]
    assert plan.chunks[0].path.startswith("demo/manifests/web/000000-")


def test_symlinked_files_are_files(tmp_path):
    out = spark_folder(tmp_path)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "a.parquet").symlink_to(out / "part-00000-5f2c.snappy.parquet")
    (linked / "b.parquet").symlink_to(Path("..") / "out" / "part-00001-5f2c.snappy.parquet")
    assert [f.rel for f in list_manifest_files(source(linked))] == ["a.parquet", "b.parquet"]
    assert [f.rel for f in list_manifest_files(source(f"{linked}/*.parquet"))] == ["a.parquet", "b.parquet"]


def test_glob_brace_and_recursive_patterns(tmp_path):
    base = tmp_path / "m"
    for split in ("train", "test", "dev"):
        for i in range(2):
            path = base / split / f"{split}-{i:05d}.csv.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(gzip.compress(f"url,caption\nhttp://x/{split}{i}.jpg,c\n".encode()))
    (base / "train" / "notes.txt").write_text("x")

    def rels(pattern: str) -> list[str]:
        return [f.rel for f in list_manifest_files(source(pattern))]

    assert rels(f"{base}/train/*.csv.gz") == ["train-00000.csv.gz", "train-00001.csv.gz"]
    assert rels(f"{base}/{{train,test}}/*-00000.csv.gz") == ["test/test-00000.csv.gz", "train/train-00000.csv.gz"]
    assert rels(f"{base}/**/*-00001.csv.gz") == [
        "dev/dev-00001.csv.gz",
        "test/test-00001.csv.gz",
        "train/train-00001.csv.gz",
    ]
    assert rels(str(base)) == [f"{s}/{s}-{i:05d}.csv.gz" for s in ("dev", "test", "train") for i in range(2)]
    rows = [r for t in iter_chunks(source(f"{base}/train/*.csv.gz")) for r in t.to_pylist()]
    assert [(r["url"], r["origin"]) for r in rows] == [
        ("http://x/train0.jpg", f"{base}/train/train-00000.csv.gz:2"),
        ("http://x/train1.jpg", f"{base}/train/train-00001.csv.gz:2"),
    ]


def test_spark_json_lines_are_taken_when_the_format_says_jsonl(tmp_path):
    out = tmp_path / "json"
    out.mkdir()
    (out / "part-00000-x.json").write_text(json.dumps({"url": "http://a/1.jpg"}) + "\n")
    (out / "_SUCCESS").write_text("")
    with pytest.raises(ManifestError, match="no manifest files \\(found: part-00000-x.json\\)"):
        list_manifest_files(source(out))
    [f] = list_manifest_files(source(out, format="jsonl"))
    assert (f.rel, f.fmt) == ("part-00000-x.json", "jsonl")


@pytest.mark.parametrize(
    "layout, message",
    [
        ({}, "no manifest files"),
        (
            {"a.csv": b"url\n", "b.parquet": None},
            "files of more than one format (a.csv (csv), b.parquet (parquet)); one source takes one format",
        ),
        ({"a.csv.bz2": b""}, "a.csv.bz2: bz2 compression is not supported"),
    ],
)
def test_folders_that_cannot_be_a_source(tmp_path, layout, message):
    out = tmp_path / "f"
    out.mkdir()
    for name, data in layout.items():
        if data is None:
            part(out, name, 0, 1)
        else:
            (out / name).write_bytes(data)
    with pytest.raises(ManifestError) as info:
        list_manifest_files(source(out))
    assert message in str(info.value)


def test_a_pattern_matching_nothing_and_a_missing_folder(tmp_path):
    with pytest.raises(ManifestError, match="no files match"):
        list_manifest_files(source(f"{tmp_path}/*.parquet"))
    with pytest.raises(ManifestError, match="cannot open: No such file or directory"):
        plan_source(
            source(f"{tmp_path}/absent.csv"), Storage(str(tmp_path / "store")), "demo"
        )  # neither folder nor pattern: a missing file


# -- files that disagree ----------------------------------------------------------------------


def test_parquet_files_that_disagree_are_named_with_the_column(tmp_path):
    out = tmp_path / "p"
    part(out, "part-0.parquet", 0, 2, license=["cc0", "mit"])
    part(out, "part-1.parquet", 2, 2, license=[1, 2])
    pq.write_table(pa.table({"url": ["http://a/9.jpg"], "license": ["cc0"]}), out / "part-2.parquet")
    with pytest.raises(ManifestError) as info:
        plan_source(source(out), Storage(str(tmp_path / "store")), "demo")
    assert str(info.value) == (
        f"{out}: the files disagree: part-1.parquet: column 'license' is int64, in part-0.parquet string; "
        "part-2.parquet has no column 'caption' (part-0.parquet has)"
    )
    # Columns the rows are not read from may differ.
    part(out, "part-1.parquet", 2, 2, license=["a", "b"], other=[1, 2])
    (out / "part-2.parquet").unlink()
    assert plan_source(source(out), Storage(str(tmp_path / "store")), "demo").rows == 4


def test_csv_headers_that_differ_are_named(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "a.csv").write_text("url,caption\nhttp://a/1.jpg,x\n")
    (out / "b.csv").write_text("url,text\nhttp://a/2.jpg,y\n")
    (out / "c.csv").write_text("caption,url\nz,http://a/3.jpg\n")  # the same columns in another order: fine
    with pytest.raises(ManifestError) as info:
        plan_source(source(out), Storage(str(tmp_path / "store")), "demo")
    assert (
        str(info.value)
        == f"{out}: the files disagree: b.csv has no column 'caption' (a.csv has); b.csv has a column 'text' that a.csv has not"
    )


def test_a_file_missing_the_url_column_names_itself(tmp_path):
    out = tmp_path / "p"
    part(out, "part-0.parquet", 0, 1)
    pq.write_table(pa.table({"link": ["http://a/1.jpg"]}), out / "part-1.parquet")
    with pytest.raises(ManifestError) as info:
        plan_source(source(out), Storage(str(tmp_path / "store")), "demo")
    assert str(info.value) == f"{out}/part-1.parquet: no column 'url' in the schema (columns: link)"


def test_empty_parts_have_no_rows_and_an_empty_folder_says_so(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "part-0.csv").write_bytes(b"")  # Spark writes empty files for empty partitions
    (out / "part-1.csv").write_text("url,caption\n")
    plan = plan_source(source(out), Storage(str(tmp_path / "store")), "demo")
    assert (plan.rows, plan.chunks, plan.note) == (0, (), "no data rows in any of its 2 files")
    (out / "part-2.csv").write_text("url,caption\nhttp://a/1.jpg,x\n")
    assert plan_source(source(out), Storage(str(tmp_path / "store")), "demo").rows == 1


def test_more_rows_in_one_file_than_its_key_can_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(manifests.chunks, "MAX_FILE_ROWS", 3)
    out = tmp_path / "p"
    part(out, "part-0.parquet", 0, 4)
    with pytest.raises(ManifestError, match="more than 3 rows in one file"):
        list(iter_chunks(source(out)))


# -- planned in parallel ----------------------------------------------------------------------


def test_files_planned_in_other_processes_combine_to_the_sequential_plan(tmp_path):
    out = tmp_path / "p"
    for i in range(4):
        part(out, f"part-{i:05d}.parquet", 10 * i, 5 + i)
    src = source(out, rows_per_shard=3)
    storage = Storage(str(tmp_path / "store"))
    files = list_manifest_files(src)
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        file_plans = list(pool.map(plan_file, [src] * len(files), files, [storage] * len(files), ["demo"] * len(files)))
    assert all(pickle.loads(pickle.dumps(p)) == p for p in file_plans)
    combined = combine(src, list(reversed(file_plans)))  # any order in, file order out
    assert combined == plan_source(src, Storage(str(tmp_path / "store2")), "demo")
    assert combined.rows == 5 + 6 + 7 + 8


def test_small_files_plan_in_groups_and_combine_the_same(tmp_path):
    out = tmp_path / "p"
    for i in range(7):
        part(out, f"part-{i:05d}.parquet", 10 * i, 2)
    src = source(out, rows_per_shard=3)
    files = list_manifest_files(src)
    groups = group_files(files, target_bytes=max(f.size for f in files) * 3)
    assert [len(g) for g in groups] == [3, 3, 1]
    assert [f for g in groups for f in g] == files
    assert group_files(files, target_bytes=1) == [[f] for f in files]  # larger than the target: alone
    storage = Storage(str(tmp_path / "store"))
    plans = [p for g in groups for p in plan_files(src, g, storage, "demo")]
    assert combine(src, plans) == plan_source(src, storage, "demo")


def test_rows_of_a_folder_source_reconcile(tmp_path):
    out = spark_folder(tmp_path)
    storage = Storage(str(tmp_path / "store"))
    plan = plan_source(source(out), storage, "demo")
    rows = [r["row"] for r in rows_of(storage, plan)]
    tally = Reconciliation(plan.rows)
    ledger = pa.table(
        {
            "key": [sample_key("web", r) for r in rows],
            "source": ["web"] * len(rows),
            "row": rows,
            "status": ["ok"] * len(rows),
        }
    )
    tally.add_ledger(ledger)
    tally.add_outputs(ledger.select(["source", "row"]))
    summary = tally.summary()
    assert (summary["accounted"], summary["duplicates"], summary["orphan_outputs"], summary["unreleased_ok"]) == (
        7,
        0,
        0,
        0,
    )
    tally.add_ledger(ledger.slice(5, 1))
    assert tally.summary()["examples"]["duplicates"] == [sample_key("web", rows[5])]


# -- object storage ---------------------------------------------------------------------------


def test_a_folder_and_a_pattern_on_s3(s3_bucket, tmp_path):
    import s3fs

    bucket, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    local = spark_folder(tmp_path)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.pipe(f"{bucket}/laion/{path.relative_to(local).as_posix()}", path.read_bytes())

    for manifest in (f"s3://{bucket}/laion/", f"s3://{bucket}/laion/*.parquet", f"s3://{bucket}/laion"):
        files = list_manifest_files(source(manifest), options)
        assert [f.rel for f in files] == ["part-00000-5f2c.snappy.parquet", "part-00001-5f2c.snappy.parquet"]
        assert files[0].display == f"s3://{bucket}/laion/part-00000-5f2c.snappy.parquet"

    storage = Storage(f"s3://{bucket}/store", options)
    remote = plan_source(source(f"s3://{bucket}/laion/"), storage, "demo", options)
    here = plan_source(source(local), Storage(str(tmp_path / "store")), "demo")
    assert [(c.index, c.rows, c.first_row) for c in remote.chunks] == [
        (c.index, c.rows, c.first_row) for c in here.chunks
    ]
    assert remote.manifest_sha256 == here.manifest_sha256
    rows = rows_of(storage, remote)
    assert rows[0]["origin"] == f"s3://{bucket}/laion/part-00000-5f2c.snappy.parquet:1"
    assert [r["url"] for r in rows] == [r["url"] for r in rows_of(Storage(str(tmp_path / "store")), here)]
