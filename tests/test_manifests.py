"""Manifests: every format read the same way, bad rows counted at the right row, chunks content addressed."""

from __future__ import annotations

import csv
import functools
import gzip
import hashlib
import http.server
import io
import json
import os
import pickle
import tempfile
import threading
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.formats import manifests
from tasks.formats.manifests import (
    CHUNK_SCHEMA,
    ChunkRef,
    ManifestError,
    iter_chunks,
    plan_source,
    read_chunk,
    sample_key,
    url_reason,
)
from tasks.formats.reasons import REASONS
from tasks.formats.recipe_download import SourceConfig
from tasks.formats.storage import Storage

ROWS = [
    {"url": "http://example.com/1.jpg", "caption": "a cat", "license": "cc-by", "width": "640"},
    {"url": "  https://example.com/2.png ", "caption": 'café, "quoted"', "license": None, "width": "800"},
    {"url": "", "caption": "no url here", "license": "cc0", "width": "1"},
    {"url": "s3://bucket/key/3.webp", "caption": None, "license": "cc-by-sa", "width": ""},
    {"url": "ftp://example.com/4.gif", "caption": "ftp", "license": "mit", "width": "2"},
]
EXPECTED = [
    (0, "http://example.com/1.jpg", "a cat", "cc-by", '{"width":"640"}', None),
    (1, "https://example.com/2.png", 'café, "quoted"', None, '{"width":"800"}', None),
    (2, None, "no url here", "cc0", '{"width":"1"}', "missing_url"),
    (3, "s3://bucket/key/3.webp", None, "cc-by-sa", '{"width":""}', None),
    (4, "ftp://example.com/4.gif", "ftp", "mit", '{"width":"2"}', "unsupported_scheme"),
]
COLUMNS = ["url", "caption", "license", "width"]


def encode(rows: list[dict], fmt: str) -> bytes:
    """The rows as a manifest file's bytes; None is an empty field in csv and tsv."""
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows([["" if r[c] is None else r[c] for c in COLUMNS] for r in rows])
        return buf.getvalue().encode()
    if fmt == "tsv":
        lines = ["\t".join(COLUMNS)] + ["\t".join("" if r[c] is None else r[c] for c in COLUMNS) for r in rows]
        return ("\n".join(lines) + "\n").encode()
    if fmt == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in rows).encode()
    if fmt == "parquet":
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf)
        return buf.getvalue()
    raise ValueError(fmt)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
    return path


def source(path: Path | str, **kw) -> SourceConfig:
    return SourceConfig(name="web", manifest=str(path), **kw)


def read_all(src: SourceConfig, options: dict | None = None) -> list[dict]:
    return [row for table in iter_chunks(src, options) for row in table.to_pylist()]


def as_tuples(rows: list[dict]) -> list[tuple]:
    return [(r["row"], r["url"], r["caption"], r["license"], r["extra"], r["reason"]) for r in rows]


def fatal(src: SourceConfig) -> str:
    with pytest.raises(ManifestError) as info:
        read_all(src)
    return str(info.value)


# -- formats --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "parquet"])
@pytest.mark.parametrize("gz", [False, True])
def test_every_format_reads_the_same_rows(tmp_path, fmt, gz):
    path = write(tmp_path / f"photos.{fmt}{'.gz' if gz else ''}", encode(ROWS, fmt))
    rows = read_all(source(path, extra_columns=("width",)))
    assert as_tuples(rows) == EXPECTED


def test_lines_point_at_the_row_start(tmp_path):
    text = 'url,caption\r\nhttp://a/1.jpg,"two\r\nlines"\r\n\r\nhttp://a/2.jpg,after a blank\r\n'
    path = write(tmp_path / "m.csv", text.encode())
    rows = read_all(source(path))
    assert [(r["row"], r["line"], r["caption"]) for r in rows] == [(0, 2, "two\r\nlines"), (1, 5, "after a blank")]


def test_explicit_format_overrides_the_name(tmp_path):
    path = write(tmp_path / "export.txt", encode(ROWS, "jsonl"))
    assert "cannot tell the format" in fatal(source(path))
    rows = read_all(source(path, format="jsonl", extra_columns=("width",)))
    assert as_tuples(rows) == EXPECTED


def test_byte_order_mark_is_not_part_of_the_header(tmp_path):
    path = write(tmp_path / "excel.csv", b"\xef\xbb\xbfurl,caption\nhttp://a/1.jpg,x\n")
    assert [r["url"] for r in read_all(source(path))] == ["http://a/1.jpg"]


def test_tsv_reads_quotes_as_written(tmp_path):
    path = write(tmp_path / "m.tsv", b'url\tcaption\nhttp://a/1.jpg\t"Best" pizza\nhttp://a/2.jpg\t"open\n')
    rows = read_all(source(path))
    assert [r["caption"] for r in rows] == ['"Best" pizza', '"open']


# -- column mapping -------------------------------------------------------------------------


def test_column_mapping_and_named_extras(tmp_path):
    path = write(tmp_path / "m.csv", b"link,text,lic,w,h\nhttp://a/1.jpg,hello,cc0,3,4\n")
    src = source(path, url_column="link", caption_column="text", license_column=None, extra_columns=("h", "gone"))
    [row] = read_all(src)
    assert (row["url"], row["caption"], row["license"]) == ("http://a/1.jpg", "hello", None)
    assert row["extra"] == '{"h":"4","gone":null}'


def test_star_carries_every_unmapped_column_in_file_order(tmp_path):
    path = write(tmp_path / "m.csv", b"w,url,caption,lic,h\n3,http://a/1.jpg,hello,cc0,4\n")
    [row] = read_all(source(path, license_column="absent", extra_columns=("*",)))
    assert json.loads(row["extra"]) == {"w": "3", "lic": "cc0", "h": "4"}
    assert list(json.loads(row["extra"])) == ["w", "lic", "h"]
    assert row["license"] is None


def test_jsonl_keeps_extra_types_and_stringifies_numbers(tmp_path):
    line = {"url": "http://a/1.jpg", "caption": 42, "license": 1.5, "n": 3, "tags": ["a"], "nan": float("nan")}
    path = write(tmp_path / "m.jsonl", (json.dumps(line) + "\n").encode())
    [row] = read_all(source(path, extra_columns=("*",)))
    assert (row["caption"], row["license"]) == ("42", "1.5")
    assert json.loads(row["extra"]) == {"n": 3, "tags": ["a"], "nan": None}  # NaN is not JSON


def test_parquet_star_extras_and_non_string_values(tmp_path):
    table = pa.table({"url": ["http://a/1.jpg"], "caption": [7], "score": [0.25], "flag": [True]})
    path = tmp_path / "m.parquet"
    pq.write_table(table, path)
    [row] = read_all(source(path, extra_columns=("*",)))
    assert row["caption"] == "7"
    assert json.loads(row["extra"]) == {"score": 0.25, "flag": True}


# -- bad rows -------------------------------------------------------------------------------


def test_bad_csv_rows_have_the_exact_reason_row_and_line(tmp_path):
    text = (
        "url,caption\n"  # 1
        "http://ok/1.jpg,one\n"  # 2: row 0
        "http://ok/2.jpg,two,EXTRA\n"  # 3: row 1, too many fields
        "\n"  # 4: blank, not a row
        ",empty url\n"  # 5: row 2
        "ftp://x/y.jpg,ftp\n"  # 6: row 3
        "http://,no host\n"  # 7: row 4
        "not a url,words\n"  # 8: row 5
        '"  http://ok/3.jpg  ",spaced\n'  # 9: row 6
        "http://ok/4.jpg\n"  # 10: row 7, too few fields
        "javascript:alert(1),js\n"  # 11: row 8
    )
    rows = read_all(source(write(tmp_path / "bad.csv", text.encode())))
    assert [(r["row"], r["line"], r["reason"]) for r in rows] == [
        (0, 2, None),
        (1, 3, "unparsable_row"),
        (2, 5, "missing_url"),
        (3, 6, "unsupported_scheme"),
        (4, 7, "invalid_url"),
        (5, 8, "invalid_url"),
        (6, 9, None),
        (7, 10, "unparsable_row"),
        (8, 11, "unsupported_scheme"),
    ]
    assert rows[6]["url"] == "http://ok/3.jpg"
    assert rows[1]["url"] is None and rows[1]["extra"] is None
    path = tmp_path / "bad.csv"
    assert [r["origin"] for r in rows] == [f"{path}:{r['line']}" for r in rows]
    assert [(r["line"], r["detail"]) for r in rows if r["reason"]] == [
        (3, "line 3: 3 fields, header has 2"),
        (5, "line 5: no URL in column 'url'"),
        (6, "line 6: scheme 'ftp' (allowed: http, https, file, s3)"),
        (7, "line 7: no valid host in 'http://'"),
        (8, "line 8: no scheme in 'not a url'"),
        (10, "line 10: 1 fields, header has 2"),
        (11, "line 11: scheme 'javascript' (allowed: http, https, file, s3)"),
    ]
    assert all(r["detail"] is None for r in rows if not r["reason"])


def test_bad_jsonl_rows_have_the_exact_reason_row_and_line(tmp_path):
    lines = [
        '{"url": "http://ok/1.jpg"}',  # 1: row 0
        "[1, 2]",  # 2: row 1, JSON but not an object
        "   ",  # 3: blank
        '{"url": ""}',  # 4: row 2
        "{broken",  # 5: row 3
        '{"caption": "no url key"}',  # 6: row 4
        '{"url": "ftp://x/y.jpg"}',  # 7: row 5
        '{"url": "http://"}',  # 8: row 6
        '{"url": 12}',  # 9: row 7
        '{"url": "http://ok/\\ud800.jpg"}',  # 10: row 8, a lone surrogate no UTF-8 column holds
        "[" * 100_000,  # 11: row 9, nested past the recursion limit
        '{"url": "http://ok/2.jpg"}',  # 12: row 10
    ]
    rows = read_all(source(write(tmp_path / "bad.jsonl", "\n".join(lines).encode())))
    assert [(r["row"], r["line"], r["reason"]) for r in rows] == [
        (0, 1, None),
        (1, 2, "unparsable_row"),
        (2, 4, "missing_url"),
        (3, 5, "unparsable_row"),
        (4, 6, "missing_url"),
        (5, 7, "unsupported_scheme"),
        (6, 8, "invalid_url"),
        (7, 9, "invalid_url"),
        (8, 10, "unparsable_row"),
        (9, 11, "unparsable_row"),
        (10, 12, None),
    ]
    assert all(r["reason"] is None or r["reason"] in REASONS for r in rows)
    details = {r["line"]: r["detail"] for r in rows if r["reason"] == "unparsable_row"}
    assert details == {
        2: "line 2: a JSON array, not an object",
        5: "line 5: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        10: "line 10: a lone surrogate in column 'url' (a JSON \\ud800-\\udfff escape), which UTF-8 cannot hold",
        11: "line 11: nested too deeply to parse",
    }


def test_overlong_jsonl_line_is_skipped_without_holding_it(tmp_path):
    huge = b'{"url": "http://a/' + b"x" * (16 << 20) + b'.jpg"}\n'
    path = write(tmp_path / "long.jsonl", b'{"url": "http://a/1.jpg"}\n' + huge + b'{"url": "http://a/2.jpg"}\n')
    read_all(source(write(tmp_path / "warm.jsonl", b"{}\n")))  # lazy imports are not the row's cost
    tracemalloc.start()
    try:
        rows = read_all(source(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(r["line"], r["reason"]) for r in rows] == [(1, None), (2, "unparsable_row"), (3, None)]
    assert rows[1]["detail"] == "line 2: longer than 1048576 bytes"
    # The row cap and a read block (the line's first MiB), never the 16 MiB line.
    assert peak < 3 * manifests.careful.MAX_ROW_BYTES + 2 * manifests.jsonl.BLOCK_BYTES, (
        f"peak {peak} bytes for a 16 MiB line"
    )


def test_a_quoted_field_over_the_cap_is_one_row_to_its_closing_quote(tmp_path, monkeypatch):
    # Read in pieces, never held; the lines after the cap are the same field, not rows of their
    # own (each was one, and the closing quote's line opened a quote that ate the next good row)
    monkeypatch.setattr(manifests.careful, "MAX_ROW_BYTES", 64)
    text = (
        "url,caption\n"  # 1
        "http://a/0.jpg,first\n"  # 2
        'http://a/1.jpg,"a long caption\n'  # 3: over 64 bytes by line 5
        + ("x" * 30 + "\n") * 6  # 4-9
        + '""quoted"" and done",more\n'  # 10: "" is a quote inside; the next one closes it
        + "http://a/2.jpg,fine\n"  # 11
        + 'http://a/3.jpg,"'
        + "y" * 100
        + '"\n'  # 12: one line over the cap, its quotes closed
        + "http://a/4.jpg,fine too\n"  # 13
    )
    rows = read_all(source(write(tmp_path / "q.csv", text.encode())))
    assert [(r["row"], r["line"], r["url"], r["reason"], r["detail"]) for r in rows] == [
        (0, 2, "http://a/0.jpg", None, None),
        (1, 3, None, "unparsable_row", "lines 3-10: longer than 64 bytes"),
        (2, 11, "http://a/2.jpg", None, None),
        (3, 12, None, "unparsable_row", "line 12: longer than 64 bytes"),
        (4, 13, "http://a/4.jpg", None, None),
    ]


def test_a_quote_inside_an_unquoted_field_of_a_long_line_is_text(tmp_path, monkeypatch):
    # As the csv module reads it: only a field's first character opens quotes, so a stray quote
    # in a long caption neither makes the lines after it part of the row nor ends one early
    monkeypatch.setattr(manifests.careful, "MAX_ROW_BYTES", 64)
    text = (
        "url,caption\n"
        'http://a/1.jpg,he said "hi' + "y" * 80 + "\n"  # 2: over the cap, one stray quote
        "http://a/2.jpg,fine\n"  # 3
        'http://a/3.jpg,"quoted, with ""quotes"" and a comma' + "z" * 40 + '",x\n'  # 4: closed on its line
        "http://a/4.jpg,fine too\n"  # 5
    )
    rows = read_all(source(write(tmp_path / "q.csv", text.encode())))
    assert [(r["line"], r["url"], r["detail"]) for r in rows] == [
        (2, None, "line 2: longer than 64 bytes"),
        (3, "http://a/2.jpg", None),
        (4, None, "line 4: longer than 64 bytes"),
        (5, "http://a/4.jpg", None),
    ]


@pytest.mark.parametrize(
    ("data", "quoted"),
    [
        (b'a,"b\n', True),
        (b'a,b"c\n', False),
        (b'"a""b\n', True),
        (b'"a"",b\n', True),
        (b'"a"b,"c\n', True),
        (b'"a"b"c\n', False),
        (b'a,,"\n', True),
        (b'"x\ny",z\n', True),
    ],
)
def test_csv_state_reads_quotes_as_the_csv_module_does(data, quoted):
    import csv
    import io

    from tasks.formats.manifests.careful import _QUOTED, _START, csv_state

    # the csv module's own verdict: does the first record run past the data's first newline?
    first = data.split(b"\n")[0] + b"\n"
    runs_on = next(csv.reader(io.StringIO((first + b"END\n").decode())))[-1].endswith("END\n")
    assert runs_on == quoted
    assert (csv_state(_START, first) == _QUOTED) == quoted


def test_a_long_quoted_record_that_closes_on_the_files_last_line_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(manifests.careful, "MAX_ROW_BYTES", 64)
    text = 'url,caption\nhttp://a/1.jpg,"' + "y" * 70 + '\nmore\nend"'  # no newline at the end
    rows = read_all(source(write(tmp_path / "q.csv", text.encode())))
    assert [(r["line"], r["detail"]) for r in rows] == [(2, "lines 2-4: longer than 64 bytes")]


def test_an_unclosed_csv_quote_is_one_row_to_the_end_of_the_file(tmp_path, monkeypatch):
    # As CSV reads it: the lines after an unclosed quote are that field's, and the row says so
    monkeypatch.setattr(manifests.careful, "MAX_ROW_BYTES", 64)
    text = 'url,caption\nhttp://a/1.jpg,"unclosed\n' + ("x" * 30 + "\n") * 3 + "http://a/2.jpg,inside\n"
    rows = read_all(source(write(tmp_path / "q.csv", text.encode())))
    assert [(r["row"], r["line"], r["reason"], r["detail"]) for r in rows] == [
        (0, 2, "unparsable_row", "lines 2-6: longer than 64 bytes; the quote opened there never closes"),
    ]


def test_lists_and_objects_are_rejected_as_wrong_type_never_coerced(tmp_path):
    lines = [
        {"url": "http://a/1.jpg", "caption": "fine", "license": ["CC-BY-4.0"]},  # line 1
        {"url": "http://a/2.jpg", "caption": {"en": "a cat"}},  # line 2
        {"url": ["http://a/3.jpg"]},  # line 3
        {"url": "http://a/4.jpg", "caption": 2012, "license": True},  # line 4: scalars are text
        {"url": ["x"], "caption": "c", "license": {"id": "MIT"}},  # line 5: the url column is named first
    ]
    path = write(tmp_path / "m.jsonl", "".join(json.dumps(r) + "\n" for r in lines).encode())
    rows = read_all(source(path))
    assert [(r["line"], r["reason"], r["detail"]) for r in rows] == [
        (1, "wrong_type", "line 1: column 'license' holds a JSON array, not a string"),
        (2, "wrong_type", "line 2: column 'caption' holds a JSON object, not a string"),
        (3, "wrong_type", "line 3: column 'url' holds a JSON array, not a string"),
        (4, None, None),
        (5, "wrong_type", "line 5: column 'url' holds a JSON array, not a string"),
    ]
    # The wrong value is not carried as text; the rest of the row is.
    assert (rows[0]["url"], rows[0]["caption"], rows[0]["license"]) == ("http://a/1.jpg", "fine", None)
    assert (rows[3]["caption"], rows[3]["license"]) == ("2012", "true")
    assert REASONS["wrong_type"][0] == "rejected"


def test_parquet_lists_structs_and_maps_are_wrong_type(tmp_path):
    table = pa.table(
        {
            "url": ["http://a/1.jpg", "http://a/2.jpg", "http://a/3.jpg"],
            "caption": pa.array([{"en": "x"}, None, {"en": "z"}], pa.struct([("en", pa.string())])),
            "license": pa.array([["MIT"], ["MIT"], None], pa.list_(pa.string())),
        }
    )
    path = tmp_path / "m.parquet"
    pq.write_table(table, path)
    rows = read_all(source(path))
    assert [(r["line"], r["reason"], r["detail"]) for r in rows] == [
        (1, "wrong_type", "row 1: column 'caption' holds a struct (struct<en: string>), not a string"),
        (2, "wrong_type", "row 2: column 'license' holds a list (list<element: string>), not a string"),
        (3, "wrong_type", "row 3: column 'caption' holds a struct (struct<en: string>), not a string"),
    ]
    assert [r["origin"] for r in rows] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    url_map = pa.table({"url": pa.array([[("k", "v")]], pa.map_(pa.string(), pa.string()))})
    pq.write_table(url_map, tmp_path / "map.parquet")
    [row] = read_all(source(tmp_path / "map.parquet"))
    assert (row["reason"], row["url"]) == ("wrong_type", None)


def test_parquet_row_over_the_cap_says_how_big(tmp_path, monkeypatch):
    monkeypatch.setattr(manifests.careful, "MAX_ROW_BYTES", 100)
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"url": ["http://a/1.jpg", "http://a/2.jpg"], "caption": ["short", "x" * 200]}), path)
    rows = read_all(source(path))
    assert [(r["reason"], r["url"], r["caption"]) for r in rows] == [
        (None, "http://a/1.jpg", "short"),
        ("unparsable_row", None, None),
    ]
    assert rows[1]["detail"] == "row 2: the row's values take 216 bytes, over the cap of 100"


def test_dictionary_and_large_string_columns_read_as_strings(tmp_path):
    table = pa.table(
        {
            "url": pa.array(["http://a/1.jpg", "http://a/2.jpg"]).dictionary_encode(),
            "caption": pa.array(["one", ""], pa.large_string()),
            "license": pa.array([b"cc0", b"\xff"], pa.binary()),
        }
    )
    path = tmp_path / "m.parquet"
    pq.write_table(table, path)
    rows = read_all(source(path))
    assert [(r["url"], r["caption"], r["license"], r["reason"]) for r in rows] == [
        ("http://a/1.jpg", "one", "cc0", None),
        ("http://a/2.jpg", None, "\ufffd", None),
    ]


# -- no rows -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, data, note",
    [
        ("h.csv", b"url,caption\n", "a header and no data rows"),
        ("h.tsv.gz", b"url\tcaption\n\n\n", "a header and no data rows"),
        ("b.jsonl", b"\n   \n\n", "no data rows"),
        ("e.parquet", None, "no rows"),
    ],
)
def test_a_manifest_without_rows_plans_zero_rows_and_says_so(tmp_path, name, data, note):
    path = tmp_path / name
    if data is None:
        pq.write_table(pa.table({"url": pa.array([], pa.string())}), path)
    else:
        write(path, data)
    storage = CountingStorage(str(tmp_path / "store"))
    plan = plan_source(source(path), storage, "demo")
    assert (plan.rows, plan.chunks, plan.files) == (0, (), 1)
    assert plan.note == f"{path}: {note}"
    assert plan.manifest_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert storage.writes == []
    assert list(iter_chunks(source(path))) == []


@pytest.mark.parametrize(
    "url, reason",
    [
        ("http://example.com/a.jpg", None),
        ("HTTPS://Example.com:8443/a b.jpg", None),
        ("file:///data/a.jpg", None),
        ("s3://bucket/a.jpg", None),
        (None, "missing_url"),
        ("", "missing_url"),
        ("not a url", "invalid_url"),
        ("images/a.jpg", "invalid_url"),
        ("http://", "invalid_url"),
        ("http://exa mple.com/a.jpg", "invalid_url"),
        ("http://example.com:99999/a.jpg", "invalid_url"),
        ("http://[::1/a.jpg", "invalid_url"),
        ("http://example.com/a\r\nX-Injected: 1", "invalid_url"),
        ("s3://bucket", "invalid_url"),
        ("file://", "invalid_url"),
        ("ftp://example.com/a.jpg", "unsupported_scheme"),
        ("data:image/png;base64,AAAA", "unsupported_scheme"),
    ],
)
def test_url_reason(url, reason):
    assert url_reason(url) == reason


# -- fatal errors ---------------------------------------------------------------------------


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "x.jsonl.gz"
    assert fatal(source(path)) == f"{path}: cannot open: No such file or directory"


def test_missing_url_column_names_line_one(tmp_path):
    path = write(tmp_path / "photos.csv", b"a,b\n1,2\n")
    assert fatal(source(path)) == f"{path}:1: no column 'url' in the header (columns: a, b)"


@pytest.mark.parametrize("name", ["data.csv", "data.csv.gz", "data.jsonl", "data.tsv.gz"])
def test_non_utf8_names_the_line(tmp_path, name):
    sep = b"\t" if ".tsv" in name else b","
    if ".jsonl" in name:
        data = b'{"url": "http://a/1.jpg"}\n\n{"url": "http://a/\xff.jpg"}\n'
    else:
        data = b"url" + sep + b"caption\nhttp://a/1.jpg" + sep + b"x\nhttp://a/\xff.jpg" + sep + b"y\n"
    path = write(tmp_path / name, data)
    assert fatal(source(path)) == f"{path}:3: not UTF-8 text"


def test_corrupt_and_truncated_parquet(tmp_path):
    path = write(tmp_path / "bad.parquet", b"PAR1 this is not parquet at all")
    assert fatal(source(path)).startswith(f"{path}: not a parquet file")
    good = encode(ROWS, "parquet")
    cut = write(tmp_path / "cut.parquet", good[: len(good) // 2])
    assert fatal(source(cut)).startswith(f"{cut}: not a parquet file")


def test_parquet_without_url_column(tmp_path):
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"link": ["http://a/1.jpg"]}), path)
    assert fatal(source(path)) == f"{path}: no column 'url' in the schema (columns: link)"


def test_unknown_extension_and_unsupported_compression(tmp_path):
    assert "cannot tell the format" in fatal(source(write(tmp_path / "m.xlsx", b"url\n")))
    assert "bz2 compression is not supported" in fatal(source(write(tmp_path / "m.csv.bz2", b"url\n")))


def test_broken_gzip(tmp_path):
    not_gzip = tmp_path / "plain.csv.gz"
    not_gzip.write_bytes(b"url\nhttp://a/1.jpg\n")
    assert "not valid gzip data" in fatal(source(not_gzip))
    whole = gzip.compress(b"url\n" + b"http://a/1.jpg\n" * 1000)
    truncated = tmp_path / "truncated.csv.gz"
    truncated.write_bytes(whole[: len(whole) - 20])
    assert fatal(source(truncated)).startswith(f"{truncated}:")


def test_empty_csv_has_no_header_but_empty_jsonl_has_no_rows(tmp_path):
    assert "no header row" in fatal(source(write(tmp_path / "e.csv", b"")))
    assert read_all(source(write(tmp_path / "e.jsonl", b"\n\n"))) == []


def test_duplicate_url_column_is_ambiguous(tmp_path):
    path = write(tmp_path / "d.csv", b"url,url\nhttp://a/1.jpg,http://a/2.jpg\n")
    assert fatal(source(path)) == f"{path}:1: column 'url' appears 2 times in the header"


def test_manifest_error_survives_pickling():
    err = pickle.loads(pickle.dumps(ManifestError("m.csv", "not UTF-8 text", 7)))
    assert (str(err), err.line, err.manifest) == ("m.csv:7: not UTF-8 text", 7, "m.csv")


# -- chunks and plans -----------------------------------------------------------------------


def numbered_csv(path: Path, n: int, start: int = 0) -> bytes:
    body = "".join(f"http://example.com/{i}.jpg,caption {i}\n" for i in range(start, start + n))
    return ("url,caption\n" + body).encode() if start == 0 else body.encode()


def chunk_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*.parquet")}


class CountingStorage(Storage):
    def __init__(self, root: str):
        super().__init__(root)
        self.writes: list[str] = []

    def write_bytes(self, rel: str, data: bytes, **kw) -> None:
        self.writes.append(rel)
        super().write_bytes(rel, data, **kw)


def test_iter_chunks_cuts_rows_per_shard(tmp_path):
    path = write(tmp_path / "m.csv", numbered_csv(tmp_path, 2500))
    tables = list(iter_chunks(source(path, rows_per_shard=1000)))
    assert [t.num_rows for t in tables] == [1000, 1000, 500]
    assert all(t.schema.equals(CHUNK_SCHEMA) for t in tables)
    assert [t.column("row")[0].as_py() for t in tables] == [0, 1000, 2000]


def test_plan_source_writes_chunks_once_and_hashes_the_stored_bytes(tmp_path):
    manifest = write(tmp_path / "m.csv.gz", numbered_csv(tmp_path, 2500))
    store = tmp_path / "store"
    storage = CountingStorage(str(store))
    src = source(manifest, rows_per_shard=1000)

    plan = plan_source(src, storage, "demo")
    assert (plan.source, plan.manifest, plan.rows) == ("web", str(manifest), 2500)
    assert plan.manifest_sha256 == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert plan.manifest_bytes == manifest.stat().st_size
    assert [(c.index, c.first_row, c.rows) for c in plan.chunks] == [(0, 0, 1000), (1, 1000, 1000), (2, 2000, 500)]
    for ref in plan.chunks:
        assert ref.path == f"demo/manifests/web/{ref.index:06d}-{ref.content_hash[:16]}.parquet"
        table = read_chunk(storage, ref)
        assert table.column("row").to_pylist() == list(range(ref.first_row, ref.first_row + ref.rows))
    assert len(storage.writes) == 3
    before = chunk_files(store)

    storage.writes.clear()
    again = plan_source(src, storage, "demo")
    assert again == plan
    assert storage.writes == []
    assert chunk_files(store) == before


def test_appending_rows_keeps_full_chunks(tmp_path):
    manifest = write(tmp_path / "m.csv", numbered_csv(tmp_path, 2500))
    storage = CountingStorage(str(tmp_path / "store"))
    src = source(manifest, rows_per_shard=1000)
    first = plan_source(src, storage, "demo")

    with open(manifest, "ab") as fh:
        fh.write(numbered_csv(tmp_path, 600, start=2500))
    storage.writes.clear()
    second = plan_source(src, storage, "demo")

    assert second.rows == 3100
    assert [c.path for c in second.chunks[:2]] == [c.path for c in first.chunks[:2]]
    assert second.chunks[2].path != first.chunks[2].path
    assert [(c.first_row, c.rows) for c in second.chunks[2:]] == [(2000, 1000), (3000, 100)]
    assert storage.writes == [second.chunks[2].path, second.chunks[3].path]
    assert second.manifest_sha256 != first.manifest_sha256


def test_changed_column_mapping_makes_new_chunks(tmp_path):
    manifest = write(tmp_path / "m.csv", numbered_csv(tmp_path, 10))
    storage = Storage(str(tmp_path / "store"))
    plain = plan_source(source(manifest), storage, "demo")
    no_caption = plan_source(source(manifest, caption_column=None), storage, "demo")
    starred = plan_source(source(manifest, extra_columns=("*",)), storage, "demo")
    hashes = {p.chunks[0].content_hash for p in (plain, no_caption, starred)}
    assert len(hashes) == 3


def test_read_chunk_rejects_a_chunk_that_disagrees_with_its_ref(tmp_path):
    manifest = write(tmp_path / "m.csv", numbered_csv(tmp_path, 10))
    storage = Storage(str(tmp_path / "store"))
    [ref] = plan_source(source(manifest), storage, "demo").chunks
    wrong = ChunkRef(ref.source, ref.index, ref.first_row, ref.rows + 1, ref.content_hash, ref.path)
    with pytest.raises(ManifestError, match="the plan says 11"):
        read_chunk(storage, wrong)


def test_sample_key():
    assert sample_key("web", 12) == "web-000000012"
    with pytest.raises(ValueError):
        sample_key("w.b", 1)
    with pytest.raises(ValueError):
        sample_key("web", -1)


# -- remote manifests -----------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    """A loopback HTTP server (no Range support, like many) over a temp folder: (folder, base URL)."""
    root = tmp_path_factory.mktemp("http-manifests")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_manifest_over_http(http_root, tmp_path):
    root, base = http_root
    local = write(root / "photos.csv.gz", encode(ROWS, "csv"))
    storage = Storage(str(tmp_path / "store"))
    # The flow passes the storage root's S3 options for every manifest; http must ignore them.
    s3_like = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}, "key": "k", "secret": "s"}
    plan = plan_source(source(f"{base}/photos.csv.gz?sig=secret", extra_columns=("width",)), storage, "demo", s3_like)
    assert plan.manifest_sha256 == hashlib.sha256(local.read_bytes()).hexdigest()
    rows = read_chunk(storage, plan.chunks[0]).to_pylist()
    assert as_tuples(rows) == EXPECTED
    # Where a row came from, for people: never the query string (presigned URLs carry secrets).
    assert [r["origin"] for r in rows] == [f"{base}/photos.csv.gz:{line}" for line in range(2, 7)]


def test_missing_manifest_over_http_hides_the_query(http_root):
    _, base = http_root
    message = fatal(source(f"{base}/nope.jsonl?sig=secret"))
    assert message.startswith(f"{base}/nope.jsonl: cannot open")
    assert "secret" not in message


def test_manifests_on_s3(s3_bucket, tmp_path):
    import s3fs

    bucket, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    payloads = {"m.jsonl.gz": gzip.compress(encode(ROWS, "jsonl")), "m.parquet": encode(ROWS, "parquet")}
    for name, data in payloads.items():
        fs.pipe(f"{bucket}/in/{name}", data)

    for name in payloads:
        assert as_tuples(read_all(source(f"s3://{bucket}/in/{name}", extra_columns=("width",)), options)) == EXPECTED

    storage = Storage(f"s3://{bucket}/store", options)
    src = source(f"s3://{bucket}/in/m.jsonl.gz", rows_per_shard=2)
    plan = plan_source(src, storage, "demo", options)
    assert plan.manifest_sha256 == hashlib.sha256(payloads["m.jsonl.gz"]).hexdigest()
    assert [c.rows for c in plan.chunks] == [2, 2, 1]
    written = {p: fs.info(p)["LastModified"] for p in fs.find(f"{bucket}/store")}
    assert len(written) == 3
    assert plan_source(src, storage, "demo", options) == plan
    fs.invalidate_cache()
    assert {p: fs.info(p)["LastModified"] for p in fs.find(f"{bucket}/store")} == written
    assert read_chunk(storage, plan.chunks[2]).column("url").to_pylist() == ["ftp://example.com/4.gif"]

    with pytest.raises(ManifestError, match="cannot open"):
        read_all(source(f"s3://{bucket}/in/absent.csv"), options)


# -- any bytes --------------------------------------------------------------------------------

_PIECES = [
    b"url,caption\n",
    b"url\tcaption\n",
    b'{"url": "http://a/b.jpg"}',
    b'{"url": "\\ud800"}',
    b'"',
    b",",
    b"\t",
    b"\n",
    b"\r",
    b"\r\n",
    b" ",
    b"{",
    b"}",
    b"[",
    b"http://x/y.jpg",
    b"\xff",
    b"\xef\xbb\xbf",
    b"\x00",
]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(st.binary(max_size=200), st.lists(st.sampled_from(_PIECES), max_size=40).map(b"".join)),
    name=st.sampled_from(["m.csv", "m.tsv", "m.jsonl", "m.csv.gz", "m.jsonl.gz", "m.parquet"]),
    per=st.integers(min_value=1, max_value=4),
)
def test_any_bytes_give_rows_or_a_manifest_error(data, name, per):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "wb") as fh:
            fh.write(gzip.compress(data) if name.endswith(".gz") else data)
        try:
            tables = list(iter_chunks(source(path, rows_per_shard=per)))
        except ManifestError as err:
            assert str(err).startswith(path)
            return
    rows = [r for t in tables for r in t.to_pylist()]
    assert [r["row"] for r in rows] == list(range(len(rows)))
    assert all(t.num_rows <= per for t in tables)
    assert all(r["reason"] is None or r["reason"] in REASONS for r in rows)
    lines = [r["line"] for r in rows]
    assert lines == sorted(set(lines)) and all(line >= 1 for line in lines)


def test_a_csv_whose_lines_end_in_cr_alone_fails_saying_so(tmp_path):
    # Classic Mac OS line ends: the whole file is one line to a reader of LF, and the header
    # holds a CR; the file fails with what to do, naming the file and the line
    path = write(tmp_path / "mac.csv", b"url,caption\rhttp://a/1.jpg,a cat\rhttp://a/2.jpg,a dog\r")
    message = fatal(source(path))
    assert "mac.csv" in message and "cannot parse the header row" in message
    assert "lines may end in CR alone (classic Mac OS): convert them to LF or CRLF" in message


def test_a_source_is_named_without_secrets_and_an_object_key_whole():
    """Messages and ``origin`` name a source: a web URL without its query and credentials (a
    presigned URL's signature), an object store's key whole, ``?`` and ``#`` included (two
    keys must not read as one)."""
    from tasks.formats.manifests.files import display

    assert display("https://u:p@h.example/m.csv?X-Amz-Signature=abc#f") == "https://h.example/m.csv"
    assert display("s3://src/wds/q?x=1.tar") == "s3://src/wds/q?x=1.tar"
    assert display("s3://src/wds/hash#frag.tar") == "s3://src/wds/hash#frag.tar"
    assert display("/data/m?.csv") == "/data/m?.csv"
