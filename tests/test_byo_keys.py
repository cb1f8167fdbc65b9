"""WebDataset keys in folders (``train/cats/0001.jpg``): rekeyed flat and recorded, through the real tar reader and the ingest into download shards."""

from __future__ import annotations

import json
from functools import partial

from byo_fixtures import good_samples, sample, tar_bytes

from tasks.formats.ledger import read_ledger
from tasks.formats.recipe_download import DownloadConfig, SourceConfig
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.sources import ingest_rows, plan_ingest
from tasks.sources.tarsamples import MAX_KEY_CHARS
from tasks.stages.download import download_shard, shard_paths


def ingest_tar(tmp_path, members) -> tuple[list[dict], dict[str, dict]]:
    """One tar ingested as the download phase does: (ledger rows, sample json by origin key)."""
    folder = tmp_path / "shards"
    folder.mkdir(parents=True)
    (folder / "00000.tar").write_bytes(tar_bytes(members))
    source = SourceConfig(name="wds", manifest=str(folder), kind="webdataset")
    storage = Storage(str(tmp_path / "out"))
    (ref,) = plan_ingest(source).chunks
    tar, ledger = shard_paths("ds", ref, "cfg")
    result = download_shard(ref, storage, DownloadConfig(), tar, ledger, None, partial(ingest_rows, source))
    rows = read_ledger(storage, ledger).to_pylist()
    metas = {}
    if result.tar:
        with storage.open(result.tar, "rb") as fh:
            for s in iter_samples(fh):
                meta = json.loads(s.members["json"])
                metas[meta["origin"]["key"]] = meta
    return rows, metas


def test_folder_keys_are_rekeyed_flat_and_the_original_kept(tmp_path):
    deep = "ab/" * 60 + "x"  # 181 characters, 241 once flat: cut and hashed
    members = sample("train/cats/0001", "a cat", meta={"license": "CC0-1.0"})
    members += sample("train/dogs/0001", "a dog")  # same basename, other folder: another sample
    members += sample("x__y", "a flat key")
    members += sample("x/y", "the same key once rekeyed")  # duplicate after rekeying
    members += sample("train/cats/0001", "the same folder key again")  # duplicate
    members += sample(deep, "deep folders")
    members += sample("a//b", "an empty folder")  # unsafe
    members += sample("./c", "as `tar -C dir .` writes it")  # the reader drops a leading ./: c
    members += sample("a/./b", "a '.' folder inside")  # left out when rekeyed: a__b
    members += sample("c", "the same key once rekeyed")  # duplicate
    members += sample("dir/bell\x07", "a control character in a folder key")  # unsafe
    members += sample("dir\\sub", "a backslash")  # unsafe
    members += good_samples("plain", 1)
    rows, metas = ingest_tar(tmp_path, members)
    got = [(r["origin"].split("00000.tar:", 1)[1], r["status"], r["reason"]) for r in rows]
    assert got == [
        ("train/cats/0001", "ok", None),
        ("train/dogs/0001", "ok", None),
        ("x__y", "ok", None),
        ("x/y", "rejected", "duplicate_key"),
        ("train/cats/0001", "rejected", "duplicate_key"),
        (deep, "ok", None),
        ("a//b", "rejected", "unsafe_key"),
        ("c", "ok", None),
        ("a/./b", "ok", None),
        ("c", "rejected", "duplicate_key"),
        ("dir/bell\\x07", "rejected", "unsafe_key"),
        ("dir\\sub", "rejected", "unsafe_key"),
        ("plain0000", "ok", None),
    ]
    details = [r["detail"] or "" for r in rows]
    assert "folder key rekeyed 'train__cats__0001'" in details[0]
    assert "(rekeyed 'x__y') appeared earlier" in details[3]
    assert "empty or '..' folder" in details[6] and "folder key rekeyed 'a__b'" in details[8]
    assert "U+0007" in details[10] and "backslash" in details[11]
    assert "rekeyed" not in details[2] + details[7] + details[12]  # keys without folders are left alone
    # The released json keeps the original key and says the flat one.
    assert metas["train/cats/0001"]["origin"]["flat_key"] == "train__cats__0001"
    assert metas["train/dogs/0001"]["origin"]["flat_key"] == "train__dogs__0001"
    flat = metas[deep]["origin"]["flat_key"]
    assert len(flat) == MAX_KEY_CHARS and flat.startswith("ab__ab__") and "/" not in flat
    assert "flat_key" not in metas["x__y"]["origin"] and "flat_key" not in metas["plain0000"]["origin"]


def test_absolute_and_parent_folder_keys_end_the_shard_as_before(tmp_path):
    for name, reason in (("/abs/k.jpg", "tar_absolute_name"), ("a/../k.jpg", "tar_parent_reference")):
        rows, _ = ingest_tar(tmp_path / reason, good_samples("g", 1) + [(name, b"x")])
        assert [(r["status"], r["reason"]) for r in rows] == [("ok", None), ("error", reason)], name
