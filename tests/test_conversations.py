"""Tests for LLaVA-style conversation checks (each failure by its reason) and whole-file record reading."""

from __future__ import annotations

import gzip
import io
import json
import re

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


@pytest.mark.parametrize(
    "blank",
    ["\u200b\u200b", "\u2060\ufeff", " \u00ad\n", "\u202e\u202c", "\u2066 \u2069", "\u200b<image>\u200b"],
)
def test_a_turn_with_nothing_visible_is_empty(blank):
    """Zero-width spaces, word joiners, BOMs, soft hyphens and bidi controls show nothing: a turn
    of only them (and placeholders) is as empty as a blank one, in either role; the characters
    are the ones captions drop (tasks/policies/captions.py)."""
    image = ["a.jpg"] if "<image>" in blank else None
    for turns, at in (((("human", blank), ("gpt", "b")), 0), ((("human", "a"), ("gpt", blank)), 1)):
        c = check_conversation(conv(*turns, image=image if at == 0 else None), RULES)
        assert (c.reason, c.detail) == ("conversation_empty_turn", f"turn {at} is empty")
    # beside a visible character they are text; ZWJ and ZWNJ are spelling, not blanks
    assert check_conversation(conv(("human", "\u200bhi\u200b"), ("gpt", "ok")), RULES).ok
    assert check_conversation(conv(("human", "\U0001f468\u200d\U0001f469"), ("gpt", "a family")), RULES).ok


TILE_TAG_ERRORS = [
    ("<tile_{j}>", "finetune.tiling.tile_tag: Value error, may hold only the field {i}, not {j}"),
    ("<tile_{i>", "finetune.tiling.tile_tag: Value error, not a format string with the field {i}"),
    ("<tile_{}>", "finetune.tiling.tile_tag: Value error, may hold only the field {i}, not {}"),
    ("<tile_{i.real}>", "finetune.tiling.tile_tag: Value error, may hold only the field {i}, not {i.real}"),
    ("<tile_{i:s}>", "finetune.tiling.tile_tag: Value error, does not format with i=1"),
    ("<t>", "finetune.tiling.tile_tag: Value error, must hold the field {i}"),
    ("<tile_{{i}}>", "finetune.tiling.tile_tag: Value error, must hold the field {i}"),
    ("<img>", "finetune.tiling.tile_tag: Value error, must hold the field {i}"),
]


@pytest.mark.parametrize(("tag", "error"), TILE_TAG_ERRORS)
def test_a_tile_tag_that_does_not_format_with_i_alone_is_refused_naming_the_key(tag, error):
    from tasks.formats.recipe import parse_recipe
    from tasks.formats.recipe_base import RecipeError

    with pytest.raises(RecipeError) as err:
        parse_recipe(_FT_RECIPE, "r.yaml", {"finetune.tiling.tile_tag": tag})
    assert str(err.value).startswith(f"r.yaml: {error}") and "Traceback" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (
            {"finetune.tiling.image_start": "<t1>", "finetune.tiling.tile_tag": "<t{i}>"},
            "tile_tag '<t{i}>' gives '<t1>'",
        ),
        ({"finetune.tiling.thumbnail_tag": "<tile_6>"}, "tile_tag '<tile_{i}>' gives '<tile_6>' for tile 6"),
        ({"finetune.tiling.image_end": "<img>"}, "image_end '<img>' is also image_start"),
        ({"finetune.tiling.thumbnail_tag": "</img>"}, "thumbnail_tag '</img>' is also image_end"),
    ],
)
def test_every_tag_of_the_tiler_must_differ_from_the_others(overrides, error):
    from tasks.formats.recipe import parse_recipe
    from tasks.formats.recipe_base import RecipeError

    with pytest.raises(RecipeError, match="^r.yaml: finetune.tiling: Value error, " + re.escape(error)):
        parse_recipe(_FT_RECIPE, "r.yaml", overrides)


def test_tile_tags_that_format_with_i_and_differ_are_accepted():
    from tasks.finetune.tiling import all_tags
    from tasks.formats.recipe import parse_recipe

    for overrides in (
        {},
        {"finetune.tiling.tile_tag": "<t{i:02d}>"},
        {"finetune.tiling.tile_tag": "{{<{i}>}}"},
        {"finetune.tiling.thumbnail_tag": "<tile_7>"},  # past max_tiles: no tile has it
        {"finetune.tiling.image_start": "", "finetune.tiling.image_end": ""},  # no delimiters
    ):
        tiling = parse_recipe(_FT_RECIPE, "r.yaml", overrides).finetune.tiling
        tags = [t for t in all_tags(tiling) if t]
        assert len(tags) == len(set(tags)), overrides
    assert (
        all_tags(parse_recipe(_FT_RECIPE, "r.yaml", {"finetune.tiling.tile_tag": "{{<{i}>}}"}).finetune.tiling)[2]
        == "{<1>}"
    )


_FT_RECIPE = {
    "dataset": "d",
    "kind": "finetuning",
    "storage": "/tmp/never-written",
    "sources": [{"name": "chat", "manifest": "/tmp/never-read.jsonl"}],
}
