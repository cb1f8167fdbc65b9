"""Existing data as sources (tasks/sources/): WebDataset shards and parquet with embedded images, read through the real reader into download shards, ledgers and candidates."""

from __future__ import annotations

import io
import json
import tarfile
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from byo_fixtures import JPEG, good_samples, hostile_shards, images_parquet, img2dataset_shard, sample, tar_bytes

from tasks.formats.ledger import read_ledger
from tasks.formats.manifests import ManifestError
from tasks.formats.reasons import REASONS
from tasks.formats.recipe_download import DownloadConfig, SourceConfig, ValidateConfig
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.sources import ingest_rows, plan_ingest
from tasks.stages.download import download_shard, shard_paths
from tasks.stages.onepass import download_and_validate
from tasks.stages.validate import candidate_paths


def ingest(source: SourceConfig, out: Path, options: dict | None = None, cfg: DownloadConfig = DownloadConfig()):
    """Plan the source and ingest every chunk as the download phase does; returns (plan,
    {input file name: (ShardResult of its last chunk, ledger rows of all its chunks)}, storage)."""
    storage = Storage(str(out))
    plan = plan_ingest(source, options)
    results: dict = {}
    for ref in plan.chunks:
        tar, ledger = shard_paths("ds", ref, "cfg")
        result = download_shard(ref, storage, cfg, tar, ledger, options, partial(ingest_rows, source))
        name = ref.path.rsplit("/", 1)[-1]
        results[name] = (result, results.get(name, (None, []))[1] + read_ledger(storage, ledger).to_pylist())
    return plan, results, storage


def tar_samples(storage: Storage, rel: str) -> dict[str, dict[str, bytes]]:
    with storage.open(rel, "rb") as fh:
        return {s.key: s.members for s in iter_samples(fh)}


def by_origin_key(rows: list[dict]) -> dict[str, dict]:
    return {r["origin"].rsplit(":", 1)[1]: r for r in rows}


def test_every_odd_sample_gets_its_own_verdict_and_the_rest_are_kept(tmp_path):
    members = [("__index__.json", b"{}"), (".nv-meta/dataset.yaml", b"x: 1")]
    members += good_samples("a", 2)
    members += [("a0000.jpg", JPEG), ("a0000.txt", b"a repeat after other keys")]  # repeated key
    members += [("b.jpg", JPEG), ("b.jpg", JPEG)]  # the same member twice in a row
    members += [("c.txt", b"caption but no image"), ("c.json", b"{}")]  # incomplete
    members += sample("d", "has a pickle") + [("d.pth", b"\x80\x04K\x01.")]  # forbidden member type
    members += sample("e", "latent as a pickle") + [("e.latent.pkl", b"\x80\x04.")]
    members += sample("rtl\u202egpj.exe", "bidi override")  # unsafe: format character
    members += sample("bell\x07", "control character")
    members += sample("dir\\f", "backslash (folder keys with / are rekeyed: tests/test_byo_keys.py)")
    members += sample("k" * 201, "over-long key")
    members += [("README", b"no extension")]
    members += sample("g", "html, not an image", image=b"<html><body>nope</body></html>")
    members += sample("h", "too big for max_bytes", image=JPEG + bytes(5000))
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "00000.tar").write_bytes(tar_bytes(members))
    source = SourceConfig(name="wds", manifest=str(folder), kind="webdataset")
    _, results, storage = ingest(source, tmp_path / "out", cfg=DownloadConfig(max_bytes=len(JPEG) + 100))
    result, rows = results["00000.tar"]
    got = [(r["origin"].split("00000.tar:", 1)[1], r["status"], r["reason"]) for r in rows]
    assert got == [
        ("a0000", "ok", None),
        ("a0001", "ok", None),
        ("a0000", "rejected", "duplicate_key"),
        ("b", "ok", None),
        ("b", "rejected", "duplicate_key"),
        ("c", "rejected", "incomplete_sample"),
        ("d", "rejected", "forbidden_member"),
        ("e", "rejected", "forbidden_member"),
        ("rtl\\u202egpj", "rejected", "unsafe_key"),  # escaped in the ledger; webdataset's key stops at the first dot
        ("bell\\x07", "rejected", "unsafe_key"),
        ("dir\\f", "rejected", "unsafe_key"),
        ("k" * 120 + "...", "rejected", "unsafe_key"),
        ("README", "rejected", "incomplete_sample"),
        ("g", "rejected", "not_an_image"),
        ("h", "rejected", "too_large"),
    ]
    details = {g[0]: r["detail"] for g, r in zip(got, rows)}
    assert "U+202E (RIGHT-TO-LEFT OVERRIDE)" in details["rtl\\u202egpj"]
    assert "backslash" in details["dir\\f"] and "201 characters" in details["k" * 120 + "..."]
    assert "pth" in details["d"] and "latent.pkl" in details["e"] and "has: txt, json" in details["c"]
    # Meta members are not samples: 15 samples, 15 rows, none for __index__.json or .nv-meta/.
    assert result.counts.rows == 15 and result.counts.ok == 3
    assert all(r["reason"] is None or r["reason"] in REASONS for r in rows)
    # Only the ok samples are in the shard, under keys of their own; the json says where each came from.
    written = tar_samples(storage, result.tar)
    ok = [r for r in rows if r["status"] == "ok"]
    assert sorted(written) == sorted(r["key"] for r in ok) and len(set(written)) == 3
    first = written[ok[0]["key"]]
    meta = json.loads(first["json"])
    assert meta["origin"]["shard"].endswith("shards/00000.tar") and meta["origin"]["key"] == "a0000"
    assert meta["upstream"]["url"] == "https://example.org/a0.jpg" and meta["url"] == "https://example.org/a0.jpg"
    assert first["jpg"] == JPEG and first["txt"] == b"a photo number 0 of a" and meta["license"] == "CC-BY-4.0"
    assert ok[0]["url"] == "https://example.org/a0.jpg" and ok[0]["sha256"] and ok[0]["shard"] == result.tar


def test_a_shard_fault_keeps_the_samples_before_it_and_the_run_goes_on(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    reasons = hostile_shards(folder)
    (folder / "z-good.tar").write_bytes(tar_bytes(good_samples("z", 3)))
    source = SourceConfig(name="wds", manifest=str(folder), kind="webdataset")
    _, results, _ = ingest(source, tmp_path / "out")
    assert set(results) == set(reasons) | {"z-good.tar"}
    for name, reason in reasons.items():
        _, rows = results[name]
        # A fault that names no member (a bad checksum) leaves the sample before it in doubt: dropped.
        before = {"tar_compressed": 0, "not_a_tar": 0, "tar_bad_checksum": 1}.get(reason, 2)
        assert [r["status"] for r in rows] == ["ok"] * before + ["error"], name
        last = rows[-1]
        assert last["reason"] == reason and last["status"] == "error" and reason in REASONS, name
        assert f"{before} samples read before the fault" in last["detail"] and "rest of the shard" in last["detail"], (
            name
        )
        assert last["origin"].endswith(f"{name}:after sample {before}"), name
    # The cut names the third sample's member: the second is whole and kept; a bad checksum
    # names none, so the sample in progress is dropped with the fault, and said so.
    assert "in progress" not in results["a-truncated.tar"][1][-1]["detail"]
    assert "sample 'k0001' in progress dropped" in results["f-checksum.tar"][1][-1]["detail"]
    assert [r["status"] for r in results["z-good.tar"][1]] == ["ok"] * 3


def test_img2dataset_output_keeps_url_status_and_original_row(tmp_path):
    folder = tmp_path / "i2d"
    folder.mkdir()
    rows = [
        {"url": "https://example.org/0.jpg", "caption": "first", "license": "CC0-1.0"},
        {
            "url": "https://example.org/1.jpg",
            "status": "failed_to_download",
            "error_message": "HTTP Error 404: Not Found",
        },
        {"url": "https://example.org/2.jpg", "caption": "third", "license": "CC0-1.0"},
        {"url": "https://example.org/3.jpg", "status": "failed_to_resize", "error_message": "image too small"},
        {"url": "https://example.org/4.jpg", "caption": "listed, but not in the tar"},
    ]
    img2dataset_shard(folder, 0, rows, missing=["000000004"])
    source = SourceConfig(name="laion", manifest=str(folder), kind="webdataset")
    plan, results, storage = ingest(source, tmp_path / "out")
    assert plan.files == 1 and not plan.rows_known  # the .parquet and _stats.json are side files, not shards
    result, ledger = results["00000.tar"]
    base = plan.chunks[0].first_row
    assert [(r["row"] - base, r["status"], r["reason"], r["url"]) for r in ledger] == [
        (0, "ok", None, "https://example.org/0.jpg"),
        (1, "error", "upstream_failed", "https://example.org/1.jpg"),
        (2, "ok", None, "https://example.org/2.jpg"),
        (3, "error", "upstream_failed", "https://example.org/3.jpg"),
        (4, "error", "sample_missing", "https://example.org/4.jpg"),
    ]  # in the order of img2dataset's rows: the ledger row id is the original row
    by_row = {r["row"] - base: r for r in ledger}
    assert by_row[0]["detail"] == "img2dataset status success (00000.parquet:1)"
    assert by_row[1]["detail"] == "img2dataset status failed_to_download (00000.parquet:2): HTTP Error 404: Not Found"
    assert by_row[3]["origin"].endswith("i2d/00000.parquet:4") and by_row[0]["origin"].endswith(
        "i2d/00000.tar:000000000"
    )
    assert "has no sample '000000004'" in by_row[4]["detail"]
    written = tar_samples(storage, result.tar)
    meta = json.loads(written[by_row[2]["key"]]["json"])
    assert meta["upstream_row"]["key"] == "000000002" and meta["upstream_row"]["status"] == "success"
    assert meta["origin"]["key"] == "000000002" and meta["caption"] == "third" and meta["license"] == "CC0-1.0"


def test_shards_added_later_are_ingested_and_the_others_skipped(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(2):
        (folder / f"{i:05d}.tar").write_bytes(tar_bytes(good_samples(f"s{i}-", 2)))
    source = SourceConfig(name="wds", manifest=str(folder / "*.tar"), kind="webdataset")
    first, results, _ = ingest(source, tmp_path / "out")
    assert not any(r.skipped for r, _ in results.values())
    (folder / "00002.tar").write_bytes(tar_bytes(good_samples("s2-", 2)))
    second, results, _ = ingest(source, tmp_path / "out")
    assert second.chunks[:2] == first.chunks  # same chunk numbers, hashes, so the same output names
    assert [results[f"{i:05d}.tar"][0].skipped for i in range(3)] == [True, True, False]
    keys = [r["key"] for _, rows in results.values() for r in rows]
    assert len(keys) == len(set(keys)) == 6
    # A brace pattern names the same files, and the same chunks.
    braces = SourceConfig(name="wds", manifest=str(folder) + "/{00000,00001}.tar", kind="webdataset")
    assert plan_ingest(braces).chunks == first.chunks
    # A rewritten shard is a new version: ingested again.
    (folder / "00001.tar").write_bytes(tar_bytes(good_samples("s1-", 3)))
    import os

    os.utime(folder / "00001.tar", (1, 1))
    third = plan_ingest(source)
    assert third.chunks[0] == first.chunks[0] and third.chunks[1].content_hash != first.chunks[1].content_hash
    assert third.chunks[1].index == first.chunks[1].index


def test_no_shards_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ManifestError, match="no input files; a webdataset source takes .tar"):
        plan_ingest(SourceConfig(name="wds", manifest=str(tmp_path), kind="webdataset"))


def test_shards_on_s3(s3_bucket, tmp_path):
    import s3fs

    bucket, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    fs.pipe(f"{bucket}/shards/00000.tar", tar_bytes(good_samples("a", 2)))
    fs.pipe(f"{bucket}/shards/00001.tar", tar_bytes(good_samples("b", 1) + [("b0001.jpg", JPEG), ("b0001.pyd", b"MZ")]))
    fs.pipe(f"{bucket}/shards/00002.tar", tar_bytes(good_samples("c", 2))[:1500])
    source = SourceConfig(name="wds", manifest=f"s3://{bucket}/shards/", kind="webdataset")
    plan, results, _ = ingest(source, tmp_path / "out", options)
    assert plan.files == 3 and all(c.path.startswith(f"s3://{bucket}/shards/") for c in plan.chunks)
    assert [r["reason"] for r in results["00000.tar"][1]] == [None, None]
    assert [r["reason"] for r in results["00001.tar"][1]] == [None, "forbidden_member"]
    assert [r["reason"] for r in results["00002.tar"][1]][-1] == "tar_truncated"
    assert results["00000.tar"][1][0]["origin"] == f"s3://{bucket}/shards/00000.tar:a0000"


def test_parquet_with_raw_bytes_and_hugging_face_structs(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    bad = [
        {"id": "only-path", "image": {"bytes": None, "path": "elsewhere.jpg"}, "caption": "x", "license": "CC0-1.0"},
        {"id": "null", "image": None, "caption": "x", "license": "CC0-1.0"},
        {"id": "html", "image": {"bytes": b"<!doctype html>", "path": None}, "caption": "x", "license": "CC0-1.0"},
    ]
    images_parquet(folder / "train-00000-of-00002.parquet", 6, struct=True, extra_rows=bad)
    images_parquet(folder / "train-00001-of-00002.parquet", 3, struct=True)
    source = SourceConfig(
        name="hf",
        manifest=str(folder),
        kind="parquet_images",
        id_column="id",
        extra_columns=("author",),
        rows_per_shard=4,
    )
    plan, results, storage = ingest(source, tmp_path / "out")
    assert plan.rows == 12 and plan.rows_known and [c.rows for c in plan.chunks] == [4, 4, 1, 3]
    first = [r for (res, rows) in results.values() for r in rows if "00000-of" in r["origin"]]
    assert len(first) == 9  # every row once, across the file's three chunks
    by_line = {int(r["origin"].rsplit(":", 1)[1]): r for r in first}
    assert [by_line[i]["status"] for i in range(1, 7)] == ["ok"] * 6
    assert by_line[7]["reason"] == "incomplete_sample" and "only the path 'elsewhere.jpg'" in by_line[7]["detail"]
    assert by_line[8]["reason"] == "incomplete_sample" and "is null" in by_line[8]["detail"]
    assert by_line[9]["reason"] == "not_an_image"
    ok = by_line[2]
    written = tar_samples(storage, ok["shard"])[ok["key"]]
    meta = json.loads(written["json"])
    assert meta["id"] == "img-1" and meta["author"] == "author 1" and meta["image_path"] == "1.jpg"
    assert meta["origin"] == {"file": str(folder / "train-00000-of-00002.parquet"), "row": 1}
    assert "png" in written and written["txt"] == b"picture 1 of a thing" and meta["license"] == "CC0-1.0"


def test_parquet_with_raw_bytes_and_wrong_types(tmp_path):
    import pyarrow as pa

    path = tmp_path / "raw.parquet"
    images_parquet(path, 2, struct=False)
    table = pq.read_table(path)
    no_caption = pa.table(
        {"id": ["no-caption"], "image": [JPEG], "caption": [None], "license": ["CC0-1.0"], "author": ["x"]},
        schema=table.schema,
    )
    pq.write_table(pa.concat_tables([table, no_caption]), path)
    rows = ingest(SourceConfig(name="raw", manifest=str(path), kind="parquet_images"), tmp_path / "out")[1][
        "raw.parquet"
    ][1]
    # A single file keeps single-file keys; no caption is the caption rules' business, later.
    assert [(r["key"], r["status"]) for r in rows] == [
        ("raw-000000000", "ok"),
        ("raw-000000001", "ok"),
        ("raw-000000002", "ok"),
    ]

    # Lists and strings are never taken for captions or images.
    odd = tmp_path / "odd"
    odd.mkdir()
    pq.write_table(
        pa.table({"image": [JPEG], "caption": [["a", "list"]], "license": ["CC0-1.0"]}), odd / "list-caption.parquet"
    )
    pq.write_table(
        pa.table({"image": ["/path/to/x.jpg"], "caption": ["a path, not bytes"], "license": ["CC0-1.0"]}),
        odd / "string-image.parquet",
    )
    _, results, _ = ingest(SourceConfig(name="odd", manifest=str(odd), kind="parquet_images"), tmp_path / "out2")
    listed = results["list-caption.parquet"][1][0]
    assert listed["reason"] == "wrong_type" and "column 'caption' holds list" in listed["detail"]
    string = results["string-image.parquet"][1][0]
    assert string["reason"] == "wrong_type" and "column 'image' holds str" in string["detail"]
    # The image column must be there: said at planning, naming the columns found.
    with pytest.raises(ManifestError, match="no image column 'picture'"):
        plan_ingest(SourceConfig(name="raw", manifest=str(path), kind="parquet_images", image_column="picture"))


def test_one_pass_validates_ingested_samples_and_keeps_their_origin(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    members = good_samples("a", 3, license="CC-BY-4.0") + sample("b", "no license here", meta={"url": "u"})
    members += sample("c", "its json is broken") + [("c.json", b'{"license": "CC-BY-4.0",')]
    (folder / "00000.tar").write_bytes(tar_bytes(members))
    source = SourceConfig(name="wds", manifest=str(folder), kind="webdataset")
    storage = Storage(str(tmp_path / "out"))
    ref = plan_ingest(source).chunks[0]
    down = shard_paths("ds", ref, "cfg")
    cand = candidate_paths("ds", ref.source, ref.index, down[0], "v")
    vcfg = ValidateConfig.model_validate({"license": {"allow": ["CC-BY-4.0"]}, "image": {"min_side": 32}})
    got, validated = download_and_validate(
        ref, storage, DownloadConfig(), vcfg, down, cand, None, partial(ingest_rows, source)
    )
    assert got.counts.ok == 5 and validated.counts.ok == 3
    rows = read_ledger(storage, cand[1]).to_pylist()
    assert {r["reason"] for r in rows} == {None, "license_missing"}
    # a json that could not be read is said where its license is missing, not silently dropped
    broken = next(r for r in rows if r["origin"].endswith(":c"))
    assert (
        broken["reason"] == "license_missing" and "the sample's json member was not read: not JSON" in broken["detail"]
    )
    assert all(r["origin"].startswith(str(folder / "00000.tar") + ":") for r in rows)
    kept = tar_samples(storage, cand[0])
    metas = [json.loads(members["json"]) for members in kept.values()]
    assert sorted(m["origin"]["key"] for m in metas) == ["a0000", "a0001", "a0002"]
    assert {m["origin"]["shard"] for m in metas} == {str(folder / "00000.tar")}


def test_hostile_names_are_never_written_to_disk(tmp_path):
    """Ingest never extracts: a member named like a path outside the folder is a fault, nothing is created."""
    folder = tmp_path / "shards"
    folder.mkdir()
    evil = tarfile.TarInfo("../../escaped.jpg")
    evil.size = len(JPEG)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.addfile(evil, io.BytesIO(JPEG))
    (folder / "00000.tar").write_bytes(buf.getvalue())
    _, results, _ = ingest(SourceConfig(name="wds", manifest=str(folder), kind="webdataset"), tmp_path / "out")
    assert [r["reason"] for r in results["00000.tar"][1]] == ["tar_parent_reference"]
    assert not (tmp_path / "escaped.jpg").exists() and not (tmp_path.parent / "escaped.jpg").exists()


def test_parquet_on_s3_by_pattern(s3_bucket, tmp_path):
    import s3fs

    bucket, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    for i in range(2):
        images_parquet(tmp_path / f"part-{i}.parquet", 3, struct=True)
        fs.put(str(tmp_path / f"part-{i}.parquet"), f"{bucket}/hf/part-{i}.parquet")
    fs.pipe(f"{bucket}/hf/README.md", b"not a part")
    source = SourceConfig(
        name="hf", manifest=f"s3://{bucket}/hf/part-*.parquet", kind="parquet_images", rows_per_shard=2
    )
    plan, results, _ = ingest(source, tmp_path / "out", options)
    assert plan.rows == 6 and [c.rows for c in plan.chunks] == [2, 1, 2, 1]
    rows = results["part-1.parquet"][1]
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert [r["origin"] for r in rows] == [f"s3://{bucket}/hf/part-1.parquet:{n}" for n in (1, 2, 3)]


def _verdicts(data: bytes) -> list:
    from tasks.sources.tarsamples import ShardFault, iter_tar_samples

    items = list(iter_tar_samples(io.BytesIO(data), max_member_bytes=1 << 20, skip_larger_than=1 << 16))
    faults = [i for i, item in enumerate(items) if isinstance(item, ShardFault)]
    assert faults in ([], [len(items) - 1])  # at most one fault, and it ends the shard
    for item in items:
        reason = item.reason
        assert reason is None or reason in REASONS
        if not isinstance(item, ShardFault):
            assert [s.ordinal for s in items[: item.ordinal + 1] if not isinstance(s, ShardFault)] == list(
                range(item.ordinal + 1)
            )
    return items


def test_mutated_shards_give_verdicts_never_exceptions():
    """Bytes flipped anywhere in a shard (names, sizes, types, checksums, data): every sample gets
    a verdict or the shard a fault with a known reason; nothing raises."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    base = tar_bytes(good_samples("a", 2) + [("a0000.jpg", JPEG), ("b\u202e.jpg", JPEG), ("c.pth", b"x")])

    @settings(max_examples=100, deadline=None, derandomize=True)
    @given(
        st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)), min_size=1, max_size=8),
        st.integers(0, len(base)),
    )
    def check(flips, cut):
        raw = bytearray(base)
        for pos, value in flips:
            raw[pos] = value
        _verdicts(bytes(raw[:cut]))

    check()
    assert [getattr(i, "reason", None) for i in _verdicts(base)] == [
        None,
        None,
        "duplicate_key",
        "unsafe_key",
        "forbidden_member",
    ]


def test_an_unreadable_side_file_is_said_and_the_shard_still_read(tmp_path):
    folder = tmp_path / "i2d"
    folder.mkdir()
    img2dataset_shard(folder, 0, [{"url": "https://example.org/0.jpg", "caption": "zero", "license": "CC0-1.0"}])
    (folder / "00000.parquet").write_bytes(b"PAR1 but not really parquet")
    _, results, _ = ingest(SourceConfig(name="laion", manifest=str(folder), kind="webdataset"), tmp_path / "out")
    [row] = results["00000.tar"][1]
    assert row["status"] == "ok" and "side file 00000.parquet not read" in row["detail"]
    assert row["url"] == "https://example.org/0.jpg"  # from the sample's own json


def test_a_recipe_mixes_url_manifests_and_ingested_sources(tmp_path):
    """The CLI's planning (flows/preflight.py) plans URL manifests and ingest sources side by side, in recipe order."""
    from flows.preflight import combine_groups, list_groups, plan_here
    from tasks.formats.recipe import parse_recipe

    (tmp_path / "m.csv").write_text("url,caption,license\nhttps://example.org/a.jpg,a,CC0-1.0\n")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "00000.tar").write_bytes(tar_bytes(good_samples("a", 2)))
    recipe = parse_recipe({
        "dataset": "mixed", "storage": str(tmp_path / "store"),
        "sources": [
            {"name": "wds", "kind": "webdataset", "manifest": str(tmp_path / "shards")},
            {"name": "urls", "manifest": str(tmp_path / "m.csv")},
        ],
    })  # fmt: skip
    groups = list_groups(recipe)
    assert [s.name for s, _ in groups] == ["urls"]
    plans = combine_groups(recipe, groups, plan_here(recipe, Storage(recipe.storage), groups))
    assert [(p.source, p.rows, p.rows_known, len(p.chunks)) for p in plans] == [
        ("wds", 0, False, 1),
        ("urls", 1, True, 1),
    ]


@pytest.mark.parametrize("name", ["b.jpg", "README", "dir/fifo1"])
def test_a_refused_member_of_another_key_keeps_the_sample_before_it(name):
    # A name without an extension is a key of its own (as the reader keys it): the sample in
    # progress is complete, not dropped
    link = tarfile.TarInfo(name)
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    items = _verdicts(tar_bytes([*sample("a", "a cat"), link, *sample("c", "a dog")]))
    assert [(getattr(i, "key", None), i.reason) for i in items] == [("a", None), (None, "tar_symlink")]
    assert "in progress dropped" not in items[1].detail


def test_a_key_listed_twice_in_the_side_file_is_one_sample_and_a_duplicate_row(tmp_path):
    # The tar's sample goes to the key's first listing; the second says so, not that the
    # sample is missing from a tar that has it
    folder = tmp_path / "i2d"
    folder.mkdir()
    rows = [{"url": f"https://example.org/{i}.jpg", "caption": f"c{i}", "license": "CC0-1.0"} for i in range(3)]
    img2dataset_shard(folder, 0, rows)
    side = pq.read_table(folder / "00000.parquet").to_pylist()
    pq.write_table(
        pa.Table.from_pylist([*side, {**side[1], "url": "https://example.org/again.jpg"}]), folder / "00000.parquet"
    )
    plan, results, _ = ingest(SourceConfig(name="laion", manifest=str(folder), kind="webdataset"), tmp_path / "out")
    _, ledger = results["00000.tar"]
    base = plan.chunks[0].first_row
    got = [(r["row"] - base, r["status"], r["reason"], r["url"]) for r in ledger]
    assert got == [
        (0, "ok", None, "https://example.org/0.jpg"),
        (1, "ok", None, "https://example.org/1.jpg"),
        (2, "ok", None, "https://example.org/2.jpg"),
        (3, "rejected", "duplicate_key", "https://example.org/again.jpg"),
    ]
    detail = ledger[3]["detail"]
    assert detail.startswith("img2dataset status success (00000.parquet:4): key '000000001' is listed again")
    assert "its first listing, row 2, is the one " in detail and detail.endswith("i2d/00000.tar's sample goes with")


def test_a_parquet_file_rewritten_shorter_after_planning_ends_every_planned_row(tmp_path):
    """A file that changed between the plan and the read (rewritten with fewer rows) still gives
    every planned row one ledger row: those it no longer has are ``source_changed``, naming it."""
    folder = tmp_path / "pq"
    folder.mkdir()
    images_parquet(folder / "part.parquet", 6, struct=False)
    source = SourceConfig(name="pq", manifest=str(folder), kind="parquet_images", rows_per_shard=4)
    storage = Storage(str(tmp_path / "out"))
    plan = plan_ingest(source)
    assert [c.rows for c in plan.chunks] == [4, 2]
    images_parquet(folder / "part.parquet", 3, struct=False)  # rewritten between the plan and the read
    rows = []
    for ref in plan.chunks:
        tar, ledger = shard_paths("ds", ref, "cfg")
        download_shard(ref, storage, DownloadConfig(), tar, ledger, None, partial(ingest_rows, source))
        rows += read_ledger(storage, ledger).to_pylist()
    assert sorted(r["row"] for r in rows) == [r for c in plan.chunks for r in range(c.first_row, c.first_row + c.rows)]
    fates = [(r["status"], r["reason"]) for r in sorted(rows, key=lambda r: r["row"])]
    assert fates == [("ok", None)] * 3 + [("error", "source_changed")] * 3
    changed = [r for r in rows if r["reason"] == "source_changed"]
    assert [r["detail"].rsplit("/", 1)[1] for r in changed] == [
        "part.parquet ends before its row 4: it changed after the run planned 4 rows",
        "part.parquet ends before its row 5: it changed after the run planned 6 rows",
        "part.parquet ends before its row 6: it changed after the run planned 6 rows",
    ]
