"""Streamed records readers: JSONL byte ranges read every record exactly once, JSON arrays stream."""

from __future__ import annotations

import gzip
import io
import json
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.finetune.records import (
    RecordsError,
    byte_ranges,
    iter_records,
    json_array_records,
    jsonl_records,
    range_lines,
)

CAP = 64
GOOD = {"id": "r", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}


def whole(data: bytes, cap: int = CAP) -> list[tuple]:
    return [(r.row, r.offset, r.record, r.reason) for r in iter_records(io.BytesIO(data), "a.jsonl", cap, block=7)]


def by_ranges(data: bytes, range_bytes: int, cap: int = CAP, block: int = 5) -> list[tuple]:
    """Every range read on its own, the way the ingest tasks do, rows numbered by a count first."""
    counts = [
        sum(1 for _ in range_lines(io.BytesIO(data), s, e, cap, block)) for s, e in byte_ranges(len(data), range_bytes)
    ]
    out, first = [], 0
    for (s, e), n in zip(byte_ranges(len(data), range_bytes), counts):
        out += [
            (r.row, r.offset, r.record, r.reason)
            for r in jsonl_records(range_lines(io.BytesIO(data), s, e, cap, block), first, cap)
        ]
        first += n
    return out


def test_a_record_split_across_a_range_boundary_is_read_once_by_the_range_it_starts_in():
    lines = [json.dumps({"n": i, "pad": "x" * 9}).encode() for i in range(4)]
    data = b"\n".join(lines) + b"\n"
    boundary = len(lines[0]) + 1 + 10  # inside the second record
    first = list(range_lines(io.BytesIO(data), 0, boundary, CAP))
    second = list(range_lines(io.BytesIO(data), boundary, len(data), CAP))
    assert [json.loads(x.data)["n"] for x in first] == [0, 1]  # the straddling record, read through
    assert [json.loads(x.data)["n"] for x in second] == [2, 3]  # starts at the next line
    # A boundary exactly at a line start: that line belongs to the range starting there.
    at = len(lines[0]) + 1
    assert [json.loads(x.data)["n"] for x in range_lines(io.BytesIO(data), 0, at, CAP)] == [0]
    assert [json.loads(x.data)["n"] for x in range_lines(io.BytesIO(data), at, len(data), CAP)] == [1, 2, 3]


def test_crlf_blank_lines_no_trailing_newline_and_long_lines_agree_at_every_range_size():
    data = (
        b'{"a": 1}\r\n\r\n   \n{"b": 2}\r\n'
        + b"x" * 200
        + b"\n"  # over the cap: one unparsable row, never held
        + b" " * 300
        + b"\r\n"  # whitespace only: blank, whatever its length
        + b'{"c": \xff}\n{not json\n{"d": 4}'  # no trailing newline
    )
    expected = whole(data)
    assert [(row, rec, reason) for row, _, rec, reason in expected] == [
        (0, {"a": 1}, None),
        (1, {"b": 2}, None),
        (2, None, "unparsable_row"),
        (3, None, "unparsable_row"),
        (4, None, "unparsable_row"),
        (5, {"d": 4}, None),
    ]
    for range_bytes in range(1, len(data) + 2):
        assert by_ranges(data, range_bytes) == expected, range_bytes


def test_unparsable_rows_name_the_byte_offset_and_the_error():
    data = b'{"a": 1}\n{"a": tru}\n' + b"y" * 100 + b"\n\xc3\x28\n"
    rows = list(iter_records(io.BytesIO(data), "a.jsonl", CAP))
    assert [r.detail for r in rows[1:]] == [
        "byte 9: Expecting value: line 1 column 7 (char 6)",
        f"byte 20: line of 101 bytes over max_record_bytes {CAP}",
        "byte 121: not UTF-8: invalid continuation byte at byte 0 of the line",
    ]


@pytest.mark.parametrize("name", ["a.jsonl", "a.json"])
def test_a_lone_surrogate_escape_is_one_unparsable_row_and_a_pair_is_text(name):
    # json reads "\\ud83d" alone into a string no UTF-8 writer takes: refused as it is read, not
    # when its shard is written (where it took the file's task, and the run, down)
    records = [
        b'{"id": "a", "v": "broken \\ud83d emoji"}',
        b'{"id": "b", "v": "paired \\ud83d\\ude00"}',
        b'{"id": "c", "v": {"deep": ["\\uDFFF"]}}',
        b'{"id": "d", "v": "plain"}',
    ]
    data = b"\n".join(records) if name.endswith(".jsonl") else b"[" + b",\n".join(records) + b"]"
    for block in (3, 1 << 20):
        rows = list(iter_records(io.BytesIO(data), name, 1024, block=block))
        assert [r.reason for r in rows] == ["unparsable_row", None, "unparsable_row", None]
        assert rows[0].detail.endswith("\\ud83d escaped without its pair: not Unicode text")
        assert rows[2].detail.endswith("\\udfff escaped without its pair: not Unicode text")
        assert rows[1].record["v"] == "paired \U0001f600"


def test_a_byte_order_mark_before_the_first_line_is_not_part_of_it():
    data = b'\xef\xbb\xbf{"a": 1}\n{"b": 2}\n'
    assert [(row, rec, reason) for row, _, rec, reason in whole(data)] == [(0, {"a": 1}, None), (1, {"b": 2}, None)]
    assert by_ranges(data, 5) == whole(data)


def test_empty_files():
    assert whole(b"") == [] and by_ranges(b"", 4) == []
    assert whole(b"\n \n\r\n") == []
    with pytest.raises(RecordsError, match="the file is empty"):
        list(iter_records(io.BytesIO(b""), "a.json"))
    assert list(iter_records(io.BytesIO(b" [ ] "), "a.json")) == []


_LINE = st.one_of(
    st.builds(lambda n: json.dumps({"n": n}).encode(), st.integers(0, 10**6)),
    st.sampled_from([b"", b"  ", b"\r", b"{bad", b"\xff\xfe", b"x" * 80, b" " * 90, b'{"s": "a\\nb"}']),
)


@settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(_LINE, max_size=12),
    st.sampled_from([b"\n", b"\r\n"]),
    st.booleans(),
    st.integers(1, 60),
    st.integers(1, 9),
)
def test_any_range_split_reads_what_one_pass_reads(lines, eol, trailing, range_bytes, block):
    data = eol.join(lines) + (eol if trailing and lines else b"")
    assert by_ranges(data, range_bytes, block=block) == whole(data)


def test_gzip_is_read_whole_and_a_corrupt_one_raises():
    lines = b"\n".join(json.dumps(GOOD).encode() for _ in range(3))
    assert len(list(iter_records(io.BytesIO(gzip.compress(lines)), "a.jsonl.gz"))) == 3
    with pytest.raises(RecordsError, match="cannot decompress"):
        list(iter_records(io.BytesIO(gzip.compress(lines)[:-12]), "a.jsonl.gz"))


# --- JSON arrays ------------------------------------------------------------------------------


def array(data: bytes, cap: int = CAP, block: int = 3) -> list[tuple]:
    blocks = [data[i : i + block] for i in range(0, len(data), block)]
    return [(r.row, r.record, r.reason, r.detail) for r in json_array_records(blocks, cap, "a.json")]


def test_a_broken_element_with_balanced_brackets_is_one_row_and_reading_resumes():
    data = b'[{"n": 0}, {"n": tru, "x": [1, "]"]}, {"n": 2},\n {"n": 3} 4, {"n": 5}]'
    rows = array(data)
    assert [(row, rec, reason) for row, rec, reason, _ in rows] == [
        (0, {"n": 0}, None),
        (1, None, "unparsable_row"),
        (2, {"n": 2}, None),
        (3, None, "unparsable_row"),
        (4, {"n": 5}, None),
    ]
    assert rows[1][3] == "byte 11: Expecting value at character 6 of the element"
    assert rows[3][3] == "byte 49: '4' after a value where ',' or ']' belongs"


def test_an_element_that_cannot_be_framed_keeps_the_records_before_it_and_makes_the_rest_one_row():
    data = b'[{"n": 0}, {"n": 1}, {"n": "unclosed}, {"n": 3}, {"n": 4}]'
    rows = array(data)
    assert [(row, rec, reason) for row, rec, reason, _ in rows] == [
        (0, {"n": 0}, None),
        (1, {"n": 1}, None),
        (2, None, "unparsable_row"),
    ]
    assert rows[2][3].startswith("byte 21: ") and rows[2][3].endswith(
        f"the rest of the array ({len(data) - 21} bytes) is this one row"
    )
    truncated = array(b'[{"n": 0}, {"n": 1}, {"n"')  # a download cut short
    assert [r[2] for r in truncated] == [None, None, "unparsable_row"]


def test_array_edge_cases():
    assert [r[1] for r in array(b"\xef\xbb\xbf [1 , 2\n,3]\n")] == [1, 2, 3]  # byte order mark, spacing
    assert [r[1] for r in array(b"[1,,2,]")] == [1, 2]  # empty elements hold no record
    assert [r[2:] for r in array(b'["\xc3\xa9", "\xff", 5]')][1] == (
        "unparsable_row",
        "byte 7: not UTF-8: byte 0xff at character 1 of the element",
    )
    assert array(b"[1, 2")[-1][3] == "byte 5: the file ends inside the array: no closing ']'"
    assert array(b"[1] [2]")[-1][2:] == (
        "unparsable_row",
        "byte 4: content after the closing ']' of the array, not read",
    )
    over = array(b'[1, "' + b"z" * 500 + b'", 3]')
    assert [r[2] for r in over] == [None, "unparsable_row", None] and over[1][
        3
    ] == f"byte 4: record of 502 bytes over max_record_bytes {CAP}"
    for bad in (b'{"a": 1}', b"  ", b"nul"):
        with pytest.raises(RecordsError, match="expected a JSON array"):
            array(bad)


def test_the_same_records_at_any_block_size():
    data = json.dumps([GOOD, {"x": "é" * 30}, [1, {"y": None}], "s", 1.5, GOOD], indent=1).encode()
    expected = [(i, rec, None, None) for i, rec in enumerate(json.loads(data))]
    for block in (1, 2, 7, 64, 1 << 20):
        assert array(data, cap=1 << 10, block=block) == expected


def _repeat(prefix: bytes, piece: bytes, times: int, suffix: bytes):
    yield prefix
    for _ in range(times):
        yield piece
    yield suffix


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_an_oversized_record_is_never_held(fmt):
    """A 64 MiB record against a 1 MiB cap: memory stays near the cap, and reading goes on."""
    piece = b"a" * (1 << 20)
    if fmt == "json":
        blocks = _repeat(b'[{"n": 0}, "', piece, 64, b'", {"n": 2}]')
        read = lambda: [(r.row, r.reason) for r in json_array_records(blocks, 1 << 20, "big.json")]  # noqa: E731
    else:
        blocks = _repeat(b'{"n": 0}\n', piece, 64, b'\n{"n": 2}\n')
        from tasks.finetune.records import iter_lines

        read = lambda: [(r.row, r.reason) for r in jsonl_records(iter_lines(blocks, 0, None, 1 << 20), 0, 1 << 20)]  # noqa: E731
    tracemalloc.start()
    try:
        rows = read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rows == [(0, None), (1, "unparsable_row"), (2, None)]
    assert peak < 8 << 20, f"peak {peak} bytes"


_ELEMENT = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=4,
)
_SPACE = st.text(" \t\r\n", max_size=4)


@settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_ELEMENT, _SPACE, _SPACE), max_size=10), _SPACE, st.integers(1, 9))
def test_any_valid_array_reads_as_json_loads_does_with_each_offset(items, lead, block):
    parts = [f"{a}{json.dumps(el, ensure_ascii=bool(len(a) % 2))}{b}" for el, a, b in items]
    data = f"{lead}[{','.join(parts)}]{lead}".encode()
    rows = [r for r in json_array_records([data[i : i + block] for i in range(0, len(data), block)], 64, "a.json")]
    expected = json.loads(data)
    small = [len(json.dumps(el, ensure_ascii=bool(len(a) % 2)).encode()) <= 64 for el, a, _ in items]
    assert [r.record for r in rows] == [el if ok else None for el, ok in zip(expected, small)]
    assert [r.row for r in rows] == list(range(len(items)))
    for r, (el, a, _) in zip(rows, items):
        text = json.dumps(el, ensure_ascii=bool(len(a) % 2)).encode()
        assert data[r.offset : r.offset + len(text)] == text
