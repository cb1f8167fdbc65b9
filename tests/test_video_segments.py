"""Caption time spans read from a row: every malformed value is refused with the entry it trips on."""

from __future__ import annotations

import json

import pytest

from tasks.video.segments import MAX_SEGMENTS, Segment, read_segments


def test_objects_lists_and_their_text_are_read_alike():
    objects = [{"start": 0, "end": 1.5, "caption": "one"}, {"start": 2, "end": 3}]
    lists = [[0, 1.5, "one"], [2, 3]]
    want = [Segment(0.0, 1.5, "one"), Segment(2.0, 3.0, None)]
    for value in (objects, lists, json.dumps(objects), json.dumps(lists).encode()):
        assert read_segments(value).value == want


@pytest.mark.parametrize(
    "value, detail",
    [
        (None, "no segments"),
        ("[{", "not JSON"),
        ('{"start": 0}', "not a list"),
        ([{"start": 2, "end": 1}], "span 0"),
        ([[0, 1], [1, 1]], "span 1"),
        ([[-1, 1]], "span 0"),
        ([["0", 1]], "span 0"),
        ([[True, 3]], "span 0"),
        ([[0, float("inf")]], "span 0"),
        ([[0, 1, 7]], "caption is a int"),
        (["0-1"], "is no span"),
        ([[0, 1]] * (MAX_SEGMENTS + 1), "at most"),
        ("[" * 100_000, "not JSON"),
    ],
)
def test_a_malformed_value_is_bad_segments_naming_what_is_wrong(value, detail):
    got = read_segments(value)
    assert got.value is None and got.reason == "bad_segments"
    assert detail in got.detail
