"""Fine-tuning ingest in byte ranges: every record one row with its reason, whatever the split."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.finetune.ingest import ingest_range, ingest_source, plan_ingest
from tasks.finetune.records import RecordsError
from tasks.formats.recipe_download import SourceConfig
from tasks.formats.recipe_finetune import ConversationRules, FinetuneConfig
from tasks.formats.storage import Storage


def record(i: int) -> dict:
    """LLaVA-style: one image, two turns; every 97th has its roles swapped, every 5th is text-only."""
    human, gpt = ("gpt", "human") if i % 97 == 13 else ("human", "gpt")
    rec = {
        "id": f"r{i}",
        "conversations": [
            {"from": human, "value": f"question {i} " + "w" * (i % 50)},
            {"from": gpt, "value": f"answer {i}"},
        ],
    }
    if i % 5:
        rec["image"] = f"imgs/{i}.jpg"
        rec["conversations"][0]["value"] = "<image>\n" + rec["conversations"][0]["value"]
    return rec


def write_records(path: Path, n: int = 2000) -> tuple[list[bytes], int, int]:
    """A JSONL file with a malformed record in the middle; returns its lines, that row and its offset."""
    lines = [json.dumps(record(i)).encode() for i in range(n)]
    bad = n // 2
    lines[bad] = b'{"id": "broken", "conversations": [{"from": "human", "value": "x"}'
    path.write_bytes(b"\n".join(lines) + b"\n")
    return lines, bad, sum(len(x) + 1 for x in lines[:bad])


def cfg(range_bytes: int) -> FinetuneConfig:
    return FinetuneConfig(conversation=ConversationRules(range_bytes=range_bytes, license="CC0-1.0"))


def rows_and_images(storage: Storage, result) -> tuple[list[dict], list[dict]]:
    """Every record's row with its image rows made global, and the image manifest."""
    rows = []
    for chunk, (first, end) in zip(result.chunks, result.chunk_image_rows):
        for r in pq.read_table(storage.path(chunk)).to_pylist():
            r["image_rows"] = [first + x for x in r["image_rows"] or []]
            assert all(first <= x < end for x in r["image_rows"])
            rows.append(r)
    images = (
        [json.loads(x) for x in storage.read_bytes(result.image_manifest).splitlines()] if result.image_manifest else []
    )
    return rows, images


def test_a_malformed_record_in_the_middle_of_a_large_file_is_one_row_whatever_the_ranges(tmp_path):
    lines, bad_row, bad_offset = write_records(tmp_path / "records.jsonl")
    source = SourceConfig(name="chat", manifest=str(tmp_path / "records.jsonl"), rows_per_shard=256)
    outcomes = []
    for range_bytes in (1 << 30, 4096, 65_537):
        storage = Storage(str(tmp_path / f"store-{range_bytes}"))
        result = ingest_source(storage, "ds", source, cfg(range_bytes), {})
        rows, images = rows_and_images(storage, result)
        outcomes.append((result.rows, result.image_rows, rows, images))
        if range_bytes == 4096:
            assert result.ranges == -(-(tmp_path / "records.jsonl").stat().st_size // 4096) > 50
    assert outcomes[0] == outcomes[1] == outcomes[2]
    n, n_images, rows, images = outcomes[0]
    assert n == len(lines) == len(rows)
    assert [r["key"] for r in rows] == [f"chat-{i:09d}" for i in range(n)]
    bad = [r for r in rows if r["reason"] == "unparsable_row"]
    assert [(r["row"], r["status"]) for r in bad] == [(bad_row, "rejected")]
    assert bad[0]["detail"].startswith(f"byte {bad_offset}: Expecting")
    roles = [r["row"] for r in rows if r["reason"] == "conversation_roles"]
    assert roles == [i for i in range(n) if i % 97 == 13 and i != bad_row]
    # Each record's images are its rows of the one image manifest, in order, pointing back at it.
    for r in rows:
        assert [images[x]["record"] for x in r["image_rows"]] == [r["key"]] * len(r["image_rows"])
        assert [images[x]["url"] for x in r["image_rows"]] == [f"file://{tmp_path}/imgs/{r['row']}.jpg"] * len(
            r["image_rows"]
        )
    assert n_images == len(images) == sum(1 for r in rows if r["status"] == "ok" and r["row"] % 5)


def test_empty_files_crlf_and_no_trailing_newline(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    result = ingest_source(storage, "ds", SourceConfig(name="e", manifest=str(tmp_path / "empty.jsonl")), cfg(1024), {})
    assert (result.rows, result.image_manifest, len(result.chunks)) == (0, None, 1)
    assert pq.read_table(storage.path(result.chunks[0])).num_rows == 0
    (tmp_path / "empty.json").write_bytes(b"")
    with pytest.raises(RecordsError, match="the file is empty"):
        ingest_source(storage, "ds", SourceConfig(name="j", manifest=str(tmp_path / "empty.json")), cfg(1024), {})
    body = b"\r\n".join(json.dumps(record(i)).encode() for i in range(1, 40))  # CRLF, no final newline
    (tmp_path / "crlf.jsonl").write_bytes(body)
    result = ingest_source(
        storage, "ds", SourceConfig(name="c", manifest=str(tmp_path / "crlf.jsonl"), rows_per_shard=7), cfg(1024), {}
    )
    rows, _ = rows_and_images(storage, result)
    assert result.ranges > 1 and [r["id"] for r in rows] == [f"r{i}" for i in range(1, 40)]
    assert {r["reason"] for r in rows} == {None, "conversation_roles"}


def test_a_json_array_with_a_broken_element_keeps_the_records_around_it(tmp_path):
    elements = [json.dumps(record(i), indent=1) for i in range(1, 9)]
    elements[3] = '{"id": "r4", "conversations": [{"from": "human", "value": oops}]}'
    (tmp_path / "set.json").write_text("[\n" + ",\n".join(elements) + "\n]\n")
    storage = Storage(str(tmp_path / "store"))
    result = ingest_source(storage, "ds", SourceConfig(name="a", manifest=str(tmp_path / "set.json")), cfg(1024), {})
    rows, images = rows_and_images(storage, result)
    assert result.ranges == 1  # an array is read by one task
    assert [(r["row"], r["reason"]) for r in rows if r["reason"]] == [(3, "unparsable_row")]
    assert [r["id"] for r in rows if r["status"] == "ok"] == ["r1", "r2", "r3", "r5", "r6", "r7", "r8"]
    assert len(images) == 6  # r5 is text-only


def test_a_rerun_finds_the_result_and_a_changed_file_raises(tmp_path):
    path = tmp_path / "records.jsonl"
    write_records(path, n=400)
    storage = Storage(str(tmp_path / "store"))
    source = SourceConfig(name="chat", manifest=str(path), rows_per_shard=100)
    first = ingest_source(storage, "ds", source, cfg(4096), {})
    assert plan_ingest(storage, "ds", source, cfg(4096), {}).done == first
    plan = plan_ingest(storage, "ds", source, cfg(2048), {})  # other ranges: a new output folder
    assert plan.done is None
    path.write_bytes(b'{"id": "new"}\n' + path.read_bytes())  # the file changes under the plan
    with pytest.raises(RecordsError, match="the file changed while it was read"):
        ingest_range(storage, plan, plan.ranges[1], cfg(2048), {})


def test_records_on_s3_are_read_in_byte_ranges(tmp_path, s3_bucket):
    import s3fs

    bucket, options = s3_bucket
    lines, _, bad_offset = write_records(tmp_path / "records.jsonl", n=1600)
    s3fs.S3FileSystem(**options).put(str(tmp_path / "records.jsonl"), f"{bucket}/in/records.jsonl")
    storage = Storage(f"s3://{bucket}/store", options)
    source = SourceConfig(name="chat", manifest=f"s3://{bucket}/in/records.jsonl", rows_per_shard=500)
    result = ingest_source(storage, "ds", source, cfg(64 << 10), options)
    assert result.ranges > 3 and result.rows == len(lines)
    rows = [r for c in result.chunks for r in pq.read_table(storage.open(c)).to_pylist()]
    assert [r["row"] for r in rows] == list(range(len(lines)))
    assert [r["detail"] for r in rows if r["reason"] == "unparsable_row"][0].startswith(f"byte {bad_offset}: ")
