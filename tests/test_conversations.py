"""Tests for LLaVA-style conversation checks (each failure by its reason) and whole-file record reading."""

from __future__ import annotations

import gzip
import io
import json

import pytest

from tasks.finetune.conversations import check_conversation, render_turns, resolve_image
from tasks.finetune.records import RecordsError, iter_records, records_format
from tasks.formats.reasons import status_of
from tasks.formats.recipe_finetune import ConversationRules

RULES = ConversationRules(max_chars=200, max_images=2, max_turns=6)


def conv(*turns, image=None, **extra):
    rec = {"id": "r1", "conversations": [{"from": f, "value": v} for f, v in turns], **extra}
    if image is not None:
        rec["image"] = image
    return rec


GOOD = conv(("human", "<image>\nWhat is this?"), ("gpt", "A cat."), image="cat.jpg")


def test_good_record():
    c = check_conversation(GOOD, RULES)
    assert c.ok and c.id == "r1" and c.images == ["cat.jpg"] and c.turn_images == [1, 0] and not c.text_only
    text_only = check_conversation(conv(("user", "Hi"), ("assistant", "Hello.")), RULES)
    assert text_only.ok and text_only.text_only and text_only.turns == [("human", "Hi"), ("gpt", "Hello.")]


@pytest.mark.parametrize(
    "record, reason",
    [
        (["not", "a", "dict"], "conversation_schema"),
        ({"id": 1}, "conversation_schema"),
        (conv(("human", "x"), ("gpt", "y"), image=5), "conversation_schema"),
        (conv(("human", "x"), ("gpt", "y"), image=[""]), "conversation_schema"),
        ({"conversations": [{"from": "human"}]}, "conversation_schema"),
        ({"conversations": []}, "conversation_empty"),
        (conv(("gpt", "hi"), ("human", "x")), "conversation_roles"),
        (conv(("human", "a"), ("human", "b")), "conversation_roles"),
        (conv(("human", "a"), ("gpt", "b"), ("human", "c")), "conversation_roles"),
        (conv(("human", "a"), ("robot", "b")), "conversation_roles"),
        (conv(*[("human", "a"), ("gpt", "b")] * 4), "conversation_roles"),
        (conv(("human", "<image>"), ("gpt", "b"), image="a.jpg"), "conversation_empty_turn"),
        (
            conv(
                ("human", "x"),
                ("gpt", "  "),
            ),
            "conversation_empty_turn",
        ),
        (conv(("human", "<image> x"), ("gpt", "b")), "placeholder_mismatch"),
        (conv(("human", "x"), ("gpt", "b"), image="a.jpg"), "placeholder_mismatch"),
        (conv(("human", "<image><image> x"), ("gpt", "b"), image=["a.jpg"]), "placeholder_mismatch"),
        (conv(("human", "<image><image><image> x"), ("gpt", "b"), image=["a", "b", "c"]), "too_many_images"),
        (conv(("human", "x" * 150), ("gpt", "y" * 100)), "conversation_too_long"),
    ],
)
def test_each_failure_has_its_reason(record, reason):
    c = check_conversation(record, RULES)
    assert c.reason == reason, c.detail
    assert status_of(c.reason) == "rejected"


@pytest.mark.parametrize(("rid", "shown"), [(12, "12"), (["a", "b"], '["a", "b"]'), ({"k": "é"}, '{"k": "é"}')])
def test_an_id_that_is_not_a_string_is_kept_as_json_writes_it(rid, shown):
    assert check_conversation({**GOOD, "id": rid}, RULES).id == shown


def test_the_reserved_tags_are_never_empty_nor_the_placeholder():
    from tasks.finetune.ingest import reserved_tags
    from tasks.formats.recipe_finetune import FinetuneConfig

    plain = reserved_tags(FinetuneConfig())
    assert plain[:2] == ("<img>", "</img>") and "<tile_1>" in plain and "<image>" not in plain
    bare = FinetuneConfig(tiling={"image_start": "", "image_end": ""})
    assert "" not in reserved_tags(bare)
    assert check_conversation(GOOD, RULES, reserved_tags(bare)).ok  # an empty tag is in every text
    same = FinetuneConfig(conversation={"placeholder": "<img>"})
    assert "<img>" not in reserved_tags(same)


def test_a_null_image_beside_an_images_list_reads_the_list():
    rec = {**conv(("human", "<image><image> Which is older?"), ("gpt", "The first.")), "image": None}
    c = check_conversation({**rec, "images": ["a.jpg", "b.jpg"]}, RULES)
    assert c.ok and c.images == ["a.jpg", "b.jpg"]


@pytest.mark.parametrize("text", ["What does the <img> tag do?", "close it with </img>", "<tile_3> is a tag"])
def test_a_tag_the_tiler_writes_is_refused_in_any_turn(text):
    from tasks.finetune.tiling import all_tags
    from tasks.formats.recipe_finetune import TilingConfig

    reserved = tuple(all_tags(TilingConfig()))
    for turns in ((("human", text), ("gpt", "b")), (("human", "a"), ("gpt", text))):
        c = check_conversation(conv(*turns), RULES, reserved)
        assert c.reason == "conversation_reserved_tag" and status_of(c.reason) == "rejected"
        assert c.detail.startswith(f"turn {1 if turns[1][1] == text else 0} holds '<")
    assert check_conversation(conv(("human", text), ("gpt", "b")), RULES).ok  # the tags are the caller's to name
    assert check_conversation(conv(("human", "an <image tag> in prose"), ("gpt", "b")), RULES, reserved).ok


def test_jsonl_rows_blank_lines_and_bad_lines():
    data = b"\n".join(
        [
            json.dumps(GOOD).encode(),
            b"",
            b"{not json",
            b"\xff\xfe",
            json.dumps(GOOD).encode() + b"x" * 5000,
            b'{"id": 2}',
        ]
    )
    rows = list(iter_records(io.BytesIO(data), "a.jsonl", max_record_bytes=2048))
    assert [r.row for r in rows] == [0, 1, 2, 3, 4]
    assert [r.reason for r in rows] == [None, "unparsable_row", "unparsable_row", "unparsable_row", None]
    assert rows[0].record == GOOD and rows[4].record == {"id": 2}


def test_json_array_and_gzip():
    blob = json.dumps([GOOD, GOOD]).encode()
    assert [r.record for r in iter_records(io.BytesIO(blob), "a.json")] == [GOOD, GOOD]
    gz = gzip.compress(b"\n".join(json.dumps(r).encode() for r in [GOOD, GOOD]))
    assert len(list(iter_records(io.BytesIO(gz), "a.jsonl.gz"))) == 2
    with pytest.raises(RecordsError, match="array"):
        list(iter_records(io.BytesIO(b'{"a": 1}'), "a.json"))
    with pytest.raises(RecordsError):
        records_format("a.csv")


def test_resolve_image(tmp_path):
    assert resolve_image("https://x.org/a.jpg", "/data") == "https://x.org/a.jpg"
    assert resolve_image("s3://b/a.jpg", "/data") == "s3://b/a.jpg"
    assert resolve_image("imgs/a b.jpg", "/data") == "file:///data/imgs/a%20b.jpg"
    assert resolve_image("../etc/passwd", "/data") == "file:///etc/passwd"  # left to the file_root guard
    assert resolve_image("/abs/a.jpg", "/data") == "file:///abs/a.jpg"


def test_render_turns_replaces_placeholders_in_order():
    turns = [("human", "<image> and <image>?"), ("gpt", "Both."), ("human", "<image>"), ("gpt", "ok")]
    assert render_turns(turns, ["A", "B", "C"], "<image>") == ["A and B?", "Both.", "C", "ok"]
