"""The fast manifest paths (pyarrow's csv parser, jsonl by blocks, vectorised URL checks) give exactly what the careful line reader gives, on any bytes."""

from __future__ import annotations

import contextlib
import gzip
import os
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tasks.formats.manifests import ManifestError, careful, jsonl, list_manifest_files, text
from tasks.formats.manifests.chunks import file_chunks
from tasks.formats.manifests.reading import FileTally
from tasks.formats.manifests.values import _ASCII_SPACE, _PLAIN_URL, url_problem
from tasks.formats.recipe_download import SourceConfig


def read(path: str, careful_only: bool, **kw) -> tuple[list[dict] | None, str | None]:
    """(rows, None) or (None, the ManifestError's message)."""
    src = SourceConfig(name="web", manifest=path, rows_per_shard=kw.pop("per", 3), **kw)
    try:
        [file] = list_manifest_files(src)
        rows = [r for t in file_chunks(src, file, None, FileTally(), careful_only) for r in t.to_pylist()]
    except ManifestError as err:
        return None, str(err)
    return rows, None


def both(path: str, **kw) -> tuple:
    fast = read(path, False, **kw)
    slow = read(path, True, **kw)
    assert fast == slow
    return fast


# Pieces that stress every rule of the line classification: quotes in every position, CR
# alone and before LF, blank and whitespace-only lines, unicode spaces, NUL, invalid UTF-8,
# a byte order mark, delimiters of both formats, long fields.
_PIECES = [
    b"http://a/b.jpg",
    b"https://x.org/p?q=1",
    b"not a url",
    b"ftp://h/x",
    b"",
    b" ",
    b"\t",
    b",",
    b'"',
    b'""',
    b'"a,b"',
    b'"x\ny"',
    b'a"b',
    b"\r",
    b"\r\n",
    b"\n",
    b"\n\n",
    b"\x00",
    b"\xff",
    b"\xc2\xa0",
    b"\xe3\x80\x80",
    b"\x1c",
    b"\xef\xbb\xbf",
    b"caf\xc3\xa9",
    b"x" * 40,
    b"\\",
    b"{",
    b"}",
]


@contextlib.contextmanager
def limits(block: int, cap: int) -> Iterator[None]:
    """Small blocks put block boundaries (and multi-line records across them) all over small
    test files; a small row cap makes rows over it cheap to write."""
    saved = text.BLOCK_BYTES, jsonl.BLOCK_BYTES, careful.MAX_ROW_BYTES
    text.BLOCK_BYTES, jsonl.BLOCK_BYTES, careful.MAX_ROW_BYTES = block, block, cap
    try:
        yield
    finally:
        text.BLOCK_BYTES, jsonl.BLOCK_BYTES, careful.MAX_ROW_BYTES = saved


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=st.sampled_from(
        [b"url,caption\n", b"url\n", b"url,caption,license,w\n", b"caption,url\r\n", b"\xef\xbb\xbfurl,caption\n"]
    ),
    body=st.lists(st.sampled_from(_PIECES), max_size=60).map(b"".join),
    fmt=st.sampled_from(["csv", "tsv"]),
    gz=st.booleans(),
    extras=st.sampled_from([(), ("*",), ("w", "gone")]),
    block=st.sampled_from([48, 1 << 16]),
)
@example(
    header=b"url,caption\n",
    body=b'http://a/1.jpg,"two\nlines"\n\nhttp://a/2.jpg,x\n',
    fmt="csv",
    gz=False,
    extras=(),
    block=48,
)
@example(
    header=b"url,caption\n",
    body=b'http://a/1.jpg,"unclosed\n' + b"y" * 70 + b"\nhttp://a/2.jpg,x\n",
    fmt="csv",
    gz=False,
    extras=(),
    block=48,
)
@example(header=b"url\n", body=b'  \n""\n\xc2\xa0\nhttp://a/1.jpg\n', fmt="csv", gz=False, extras=(), block=48)
@example(
    header=b"url,caption\n", body=b"\xef\xbb\xbf\t", fmt="tsv", gz=False, extras=(), block=1 << 16
)  # pyarrow drops a BOM
@example(
    header=b"url,caption\n",
    body=b"http://a/1.jpg,x\ry\nhttp://a/2.jpg,z\r\r\n",
    fmt="csv",
    gz=False,
    extras=(),
    block=1 << 16,
)
@example(header=b"url,caption\n", body=b'http://a/1.jpg,a"b,"c\nd"\n', fmt="csv", gz=True, extras=("*",), block=1 << 16)
def test_fast_csv_equals_careful_csv(header, body, fmt, gz, extras, block):
    data = header.replace(b",", b"\t") if fmt == "tsv" else header
    data += body
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"m.{fmt}" + (".gz" if gz else ""))
        with open(path, "wb") as fh:
            fh.write(gzip.compress(data) if gz else data)
        with limits(block, 64):
            both(path, extra_columns=extras)


_JSON_PIECES = [
    b'{"url": "http://a/b.jpg"}',
    b'{"url": "http://a/b.jpg", "caption": "c", "license": "mit"}',
    b'{"url": ["x"]}',
    b'{"url": 12, "caption": {"a": 1}}',
    b'{"url": "\\ud800"}',
    b'{"caption": "\\u0000\\n"}',
    b'{"n": NaN, "url": "x://y"}',
    b'{"big": 123456789012345678901234567890}',
    b"[1, 2]",
    b'"str"',
    b"{broken",
    b"{",
    b"}",
    b" ",
    b"\t",
    b"\r",
    b"\n",
    b"\r\n",
    b"\xff",
    b"\xef\xbb\xbf",
    b"\xc3\xa9",
    b"x" * 40,
    b'{"url": "http://a/' + b"y" * 70 + b'"}',
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.lists(st.sampled_from(_JSON_PIECES), max_size=40).map(b"".join),
    gz=st.booleans(),
    extras=st.sampled_from([(), ("*",), ("n", "gone")]),
    block=st.sampled_from([48, 1 << 16]),
)
@example(body=b'\xef\xbb\xbf{"url": "http://a/1.jpg"}\n{"url": "\\ud800"}\n\n[1]\n', gz=False, extras=(), block=1 << 16)
@example(
    body=b'{"url": "http://a/1.jpg"}\n' + b"z" * 100 + b'\n{"url": "http://a/2.jpg"}', gz=False, extras=("*",), block=48
)
@example(
    # A byte order mark's three bytes count toward the first line's size in both readers.
    body=b'\xef\xbb\xbf{"url": ["x"]}{"url": "\\ud800"}{"caption": "\\u0000\\n"}"str""str"',
    gz=False,
    extras=(),
    block=1 << 16,
)
def test_jsonl_blocks_equal_the_careful_lines(body, gz, extras, block):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.jsonl" + (".gz" if gz else ""))
        with open(path, "wb") as fh:
            fh.write(gzip.compress(body) if gz else body)
        with limits(block, 64):
            both(path, extra_columns=extras)


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(['"', '""', ",", "a", " ", "x,y", '"q"']), max_size=8).map("".join),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from(["\n", "\r\n"]),
    st.booleans(),
)
def test_the_quote_positions_judge_like_the_pattern(lines, newline, last_newline):
    data = (newline.join(lines) + (newline if last_newline else "")).encode()
    a = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(a == 10) + 1
    if ends.size == 0 or ends[-1] != len(data):
        ends = np.append(ends, len(data))
    starts = np.concatenate(([0], ends[:-1]))
    offsets = pa.py_buffer(np.concatenate(([0], ends)).astype(np.int32))
    arr = pa.BinaryArray.from_buffers(pa.binary(), len(ends), [None, offsets, pa.py_buffer(data)])
    pattern = ~pc.match_substring_regex(arr, text._WELL_QUOTED).to_numpy(zero_copy_only=False)
    assert text.CsvFile._badly_quoted(a, starts, ends, arr).tolist() == pattern.tolist()


def test_fast_path_takes_the_plain_rows_and_careful_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "BLOCK_BYTES", 256)
    lines = ["url,caption"] + [f"http://a/{i}.jpg,plain {i}" for i in range(40)]
    lines[20] = 'http://a/20.jpg,"two'  # line 21: a quoted field that runs on...
    lines[21] = 'lines"'  # ...to line 22: one record of two lines
    path = tmp_path / "m.csv"
    path.write_text("\n".join(lines) + "\n")
    expected, err = both(str(path), per=100)
    assert err is None
    assert [r["line"] for r in expected][18:21] == [20, 21, 23]
    assert expected[19]["caption"] == "two\nlines"

    calls = []
    original = text.CsvFile._one_careful
    monkeypatch.setattr(text.CsvFile, "_one_careful", lambda self: calls.append(self.lines.count + 1) or original(self))
    assert read(str(path), False, per=100) == (expected, None)
    assert calls == [21]  # the one record the careful reader read; pyarrow parsed the rest


def test_a_long_csv_line_is_skipped_without_holding_it(tmp_path):
    huge = b"http://a/" + b"x" * (16 << 20) + b".jpg,big\n"
    path = tmp_path / "long.csv"
    path.write_bytes(b"url,caption\nhttp://a/1.jpg,one\n" + huge + b"http://a/2.jpg,two\n")
    (tmp_path / "warm.csv").write_bytes(b"url\nhttp://a/0.jpg\n")
    read(str(tmp_path / "warm.csv"), False)  # lazy imports are not the row's cost
    tracemalloc.start()
    try:
        rows, err = read(str(path), False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err is None
    assert [(r["line"], r["reason"]) for r in rows] == [(2, None), (3, "unparsable_row"), (4, None)]
    assert rows[1]["detail"] == "line 3: longer than 1048576 bytes"
    # A block (4 MiB) and the row cap, never the 16 MiB line.
    assert peak < 4 * text.BLOCK_BYTES, f"peak {peak} bytes for a 16 MiB line"


def test_invalid_utf8_names_its_line_in_both_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "BLOCK_BYTES", 256)
    body = "".join(f"http://a/{i}.jpg,c{i}\n" for i in range(30)).encode()
    path = tmp_path / "m.csv"
    path.write_bytes(b"url,caption\n" + body + b"http://a/\xff.jpg,bad\n" + body)
    rows, err = both(str(path))
    assert err == f"{path}:32: not UTF-8 text"


# -- the URL pattern ------------------------------------------------------------------------

_URL_PIECES = [
    "http://",
    "https://",
    "HTTP://",
    "hTtPs://",
    "ftp://",
    "s3://",
    "file://",
    "a",
    "B",
    "0",
    "9",
    ".",
    "-",
    "_",
    "~",
    "example.com",
    ":",
    ":80",
    ":8080",
    ":99999",
    ":0",
    "/",
    "?",
    "#",
    "@",
    "[",
    "]",
    " ",
    "\t",
    "\n",
    "\r",
    "\x00",
    "\x7f",
    "\x85",
    "\xa0",
    "\u2028",
    "\u3000",
    "\x1c",
    "é",
    "%20",
    "\\",
    "user:pw@",
    "[::1]",
]


@settings(max_examples=1000, deadline=None)
@given(st.one_of(st.text(max_size=40), st.lists(st.sampled_from(_URL_PIECES), max_size=10).map("".join)))
@example("http://example.com/a b.jpg")
@example(" http://a/x.jpg\xa0")
def test_a_url_the_pattern_passes_is_one_url_problem_passes(url):
    trimmed = pc.utf8_trim(pa.array([url]), _ASCII_SPACE)
    if pc.match_substring_regex(trimmed, _PLAIN_URL)[0].as_py():
        assert trimmed[0].as_py() == url.strip()
        assert url_problem(url.strip()) is None


def test_the_pattern_passes_the_common_urls():
    urls = [
        "http://example.com/a.jpg",
        "https://cdn.example.org:8443/p/q.png?w=1&h=2#x",
        "http://127.0.0.1:8765/img/p0001.jpg?u=7",
    ]
    assert pc.match_substring_regex(pa.array(urls), _PLAIN_URL).to_pylist() == [True, True, True]


@pytest.mark.parametrize("name", ["m.csv", "m.tsv"])
def test_header_only_gives_no_rows_in_both_paths(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"url\tcaption\n\n\n" if name.endswith(".tsv") else b"url,caption\n\n  \n")
    assert both(str(path)) == ([], None)


def test_pyarrow_refusals_fall_back_row_by_row(tmp_path):
    # One block: pyarrow refuses it, the halves, their halves... down to the careful reader.
    # Field counts pyarrow refuses, spread over a block: each bad row gets its own detail.
    lines = ["url,caption"] + [f"http://a/{i}.jpg,c{i}" if i % 7 else f"http://a/{i}.jpg,c,{i}" for i in range(100)]
    path = tmp_path / "m.csv"
    path.write_text("\n".join(lines) + "\n")
    rows, err = both(str(path), per=1000)
    bad = [(r["line"], r["detail"]) for r in rows if r["reason"]]
    assert bad == [(i + 2, f"line {i + 2}: 3 fields, header has 2") for i in range(0, 100, 7)]
    assert len(rows) == 100


def test_bench_style_file_reads_fast_and_equal(tmp_path):
    path = Path(tmp_path / "m.csv")
    with open(path, "w") as fh:
        fh.write("url,caption,license\n")
        for i in range(20_000):
            fh.write(f'http://127.0.0.1:8765/img/p{i % 400:04d}.jpg?u={i},"a photo, number {i}",CC-BY-4.0\n')
    rows, err = both(str(path), per=5000)
    assert err is None and len(rows) == 20_000
    assert rows[-1]["origin"] == f"{path}:20001"
