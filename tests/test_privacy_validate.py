"""The privacy checks through validation's real path (ingest a tar, download and validate in one
pass): personal data recorded, redacted or refused; image metadata removed from bytes kept as
fetched; faces recorded, blurred or refused; the gate and the report's section; fine-tuning turns."""

from __future__ import annotations

import io
import json
from functools import partial

import pyarrow as pa
import pytest
from byo_fixtures import distinct_image, sample, tar_bytes
from PIL import Image

from tasks.formats.ledger import PRIVACY_FACTS, read_ledger
from tasks.formats.recipe import parse_recipe
from tasks.formats.recipe_download import SourceConfig
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.sources import ingest_rows, plan_ingest
from tasks.stages.download import shard_paths
from tasks.stages.onepass import download_and_validate
from tasks.stages.validate import candidate_paths

EMAIL_CAPTION = "a red kite over the dunes, prints from jane.doe@example.com"
CARD_CAPTION = "pay with 4111 1111 1111 1111 or call +44 20 7946 0958"


def gps_jpeg(seed: int) -> bytes:
    """A JPEG carrying GPS EXIF, a camera serial and a copyright notice."""
    img = Image.open(io.BytesIO(distinct_image(seed))).convert("RGB")
    exif = Image.Exif()
    exif[0x8298] = "(c) Jane Doe"  # Copyright
    exif[0xA431] = "SN-0042"  # BodySerialNumber
    exif.get_ifd(0x8825).update({1: "N", 2: (59.0, 19.0, 44.0)})
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=92, exif=exif, comment=b"shot at home")
    return buf.getvalue()


def face_jpeg(seed: int, faces: int) -> bytes:
    from tasks.demo.faces import face_picture

    return face_picture(seed, 320, faces)[0]


def validate(
    tmp_path,
    inputs: dict[str, tuple[bytes, str]],
    privacy: dict,
    image: dict | None = None,
    caption_rules=None,
    metas: dict[str, dict] | None = None,
):
    """Ingest one tar of ``inputs`` (key -> (image, caption)) and validate it in one pass under the
    recipe's ``privacy`` block; (ledger rows by key, written members by key). ``metas``: more
    fields of a sample's own json, by key."""
    folder = tmp_path / "shards"
    folder.mkdir(parents=True)
    members = []
    exts = {key: (ext or ["jpg"])[0] for key, (_, _, *ext) in inputs.items()}  # the member's, jpg unless given
    media = "video" if "mp4" in exts.values() else "image"
    for key, (data, caption, *_) in inputs.items():
        meta = {"license": "CC0-1.0", **(metas or {}).get(key, {})}
        members += sample(key, caption, image=data, meta=meta, ext=exts[key])
    (folder / "00000.tar").write_bytes(tar_bytes(members))
    recipe = parse_recipe(
        {
            "dataset": "ds",
            "storage": str(tmp_path / "out"),
            "sources": [{"name": "wds", "manifest": str(folder), "kind": "webdataset", "media": media}],
            "validate": {
                "license": {"allow": ["CC0-1.0"]},
                "image": {"min_side": 32, **(image or {})},
                "caption": caption_rules or {},
            },
            "privacy": privacy,
        }
    )
    source = SourceConfig(name="wds", manifest=str(folder), kind="webdataset", media=media)
    storage = Storage(str(tmp_path / "out"))
    ref = plan_ingest(source).chunks[0]
    down = shard_paths("ds", ref, "cfg")
    cand = candidate_paths("ds", ref.source, ref.index, down[0], "v")
    vcfg = recipe.validate_
    dcfg = recipe.download_for("wds")  # a video source keeps its containers
    download_and_validate(ref, storage, dcfg, vcfg, down, cand, None, partial(ingest_rows, source))
    ledger = read_ledger(storage, cand[1])
    rows = {r["origin"].rsplit(":", 1)[1]: r for r in ledger.to_pylist()}
    written = {}
    with storage.open(cand[0], "rb") as fh:
        for s in iter_samples(fh):
            written[json.loads(s.members["json"])["origin"]["key"]] = s.members
    return ledger, rows, written


TEXTS = {
    "plain": (distinct_image(1), "a red kite over the dunes"),
    "email": (distinct_image(2), EMAIL_CAPTION),
    "card": (distinct_image(3), CARD_CAPTION),
}


def test_personal_data_is_redacted_with_kinds_and_offsets_and_never_the_value(tmp_path):
    ledger, rows, written = validate(tmp_path, TEXTS, {"text": {"mode": "redact"}})
    assert set(PRIVACY_FACTS) <= set(ledger.column_names)
    assert {k: r["status"] for k, r in rows.items()} == {"plain": "ok", "email": "ok", "card": "ok"}
    assert written["email"]["txt"].decode() == "a red kite over the dunes, prints from <EMAIL>"
    assert written["card"]["txt"].decode() == "pay with <CARD> or call <PHONE>"
    meta = json.loads(written["email"]["json"])
    start = EMAIL_CAPTION.index("jane")
    assert meta["caption"].endswith("<EMAIL>")
    assert meta["personal_data"] == [{"kind": "email", "start": start, "end": len(EMAIL_CAPTION), "field": "caption"}]
    assert (rows["email"]["personal_data"], rows["email"]["privacy"]) == ("email", "redacted")
    assert rows["card"]["personal_data"] == "card,phone"
    assert (rows["plain"]["personal_data"], rows["plain"]["privacy"]) == ("", None)
    assert f"email {start}-{len(EMAIL_CAPTION)}" in rows["email"]["detail"]
    for key in ("email", "card"):  # the values are nowhere: not in the ledger, the json or the text
        blob = json.dumps(rows[key]) + written[key]["json"].decode() + written[key]["txt"].decode()
        assert "jane.doe" not in blob and "4111" not in blob and "7946" not in blob


def test_personal_data_refused_under_reject_and_kept_under_record(tmp_path):
    _, rows, written = validate(tmp_path / "reject", TEXTS, {"text": {"mode": "reject"}})
    assert {k: r["reason"] for k, r in rows.items()} == {
        "plain": None,
        "email": "personal_data",
        "card": "personal_data",
    }
    assert rows["card"]["detail"].startswith("card ") and "4111" not in rows["card"]["detail"]
    assert sorted(written) == ["plain"]

    _, rows, written = validate(tmp_path / "record", TEXTS, {})  # the default: record
    assert all(r["status"] == "ok" for r in rows.values())
    assert written["email"]["txt"].decode() == EMAIL_CAPTION
    assert (rows["email"]["personal_data"], rows["email"]["privacy"]) == ("email", None)
    assert json.loads(written["email"]["json"])["personal_data"][0]["kind"] == "email"


def test_text_off_looks_at_nothing(tmp_path):
    _, rows, written = validate(tmp_path, TEXTS, {"text": {"mode": "off"}})
    assert all(r["personal_data"] is None for r in rows.values())
    assert written["email"]["txt"].decode() == EMAIL_CAPTION
    assert "personal_data" not in json.loads(written["email"]["json"])


def test_skip_reencode_releases_the_pixels_without_their_metadata(tmp_path):
    data = gps_jpeg(4)
    _, rows, written = validate(tmp_path, {"gps": (data, "a kite")}, {}, {"skip_reencode": True})
    out = written["gps"]["jpg"]
    assert out != data and b"SN-0042" not in out and b"shot at home" not in out
    with Image.open(io.BytesIO(out)) as img, Image.open(io.BytesIO(data)) as src:
        assert not img.getexif() and "comment" not in img.info
        assert img.tobytes() == src.convert("RGB").tobytes()  # the same pixels: nothing re-encoded
    assert rows["gps"]["privacy"] == "metadata"
    removed = json.loads(written["gps"]["json"])["metadata_removed"]
    assert {"exif", "gps", "comment"} <= set(removed)


def test_reencoded_images_keep_only_the_exif_fields_the_recipe_names(tmp_path):
    data = gps_jpeg(5)
    _, _, written = validate(tmp_path / "keep", {"gps": (data, "a kite")}, {"metadata": {"keep": ["Copyright"]}})
    with Image.open(io.BytesIO(written["gps"]["jpg"])) as img:
        exif = img.getexif()
        assert dict(exif) == {0x8298: "(c) Jane Doe"} and not exif.get_ifd(0x8825)
    _, _, written = validate(tmp_path / "none", {"gps": (data, "a kite")}, {})
    with Image.open(io.BytesIO(written["gps"]["jpg"])) as img:
        assert not img.getexif()


def test_kept_exif_fields_go_through_the_text_rules(tmp_path):
    """A kept field is third parties' text like a caption: an address in Artist is redacted in
    the released EXIF (re-encoded or kept as fetched) and recorded as "exif:Artist", or refuses
    the sample under reject."""
    img = Image.open(io.BytesIO(distinct_image(7))).convert("RGB")
    exif = Image.Exif()
    exif[0x013B] = "Jo Bloggs, jo.bloggs@example.org"  # Artist
    exif[0x8298] = "(c) Jo Bloggs"  # Copyright
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=92, exif=exif)
    inputs = {"art": (buf.getvalue(), "a kite")}
    keep = {"metadata": {"keep": ["Artist", "Copyright"]}}
    for skip in (False, True):
        out = tmp_path / f"redact-{skip}"
        _, rows, written = validate(out, inputs, {**keep, "text": {"mode": "redact"}}, {"skip_reencode": skip})
        with Image.open(io.BytesIO(written["art"]["jpg"])) as released:
            assert dict(released.getexif()) == {0x013B: "Jo Bloggs, <EMAIL>", 0x8298: "(c) Jo Bloggs"}
        meta = json.loads(written["art"]["json"])
        assert {(f["field"], f["kind"]) for f in meta["personal_data"]} == {("exif:Artist", "email")}
        assert rows["art"]["personal_data"] == "email" and "redacted" in rows["art"]["privacy"]
        assert b"jo.bloggs" not in written["art"]["jpg"]
    _, rows, _ = validate(tmp_path / "reject", inputs, {**keep, "text": {"mode": "reject"}})
    assert (rows["art"]["reason"], rows["art"]["detail"]) == ("personal_data", "exif:Artist: email 11-32")
    assert rows["art"]["personal_data"] == "email"


def test_a_recipe_cannot_keep_gps_or_orientation():
    from tasks.formats.recipe_base import RecipeError

    base = {"dataset": "ds", "storage": "/tmp/x", "sources": [{"name": "a", "manifest": "m.csv"}]}
    for tag in ("GPSInfo", "Orientation", "NoSuchTag"):
        with pytest.raises(RecipeError, match=tag):
            parse_recipe({**base, "privacy": {"metadata": {"keep": [tag]}}})


def test_the_gate_bounds_samples_released_with_personal_data(tmp_path):
    from tasks.audit.gates import validate_gate
    from tasks.audit.validate_samples import gate_samples
    from tasks.formats.recipe_download import ImageRules
    from tasks.formats.recipe_outputs import ValidateGate

    ledger, _, _ = validate(tmp_path, TEXTS, {})  # record: two of three released with personal data
    accepted = ledger.filter(pa.compute.equal(ledger.column("status"), "ok"))
    samples = gate_samples(accepted)
    assert samples.column("personal_data_shown").to_pylist().count(True) == 2

    def outcome(rate: float):
        gate = validate_gate(
            ledger, samples, ValidateGate(max_personal_data_rate=rate), ["CC0-1.0"], ImageRules(min_side=32), True
        )
        return gate, next(o for o in gate.outcomes if o.name.startswith("personal data shown"))

    gate, check = outcome(0.5)
    assert not gate.success and not check.success and check.observed == pytest.approx(2 / 3, abs=1e-4)
    gate, check = outcome(0.7)
    assert gate.success and check.success

    redacted, _, _ = validate(tmp_path / "redact", TEXTS, {"text": {"mode": "redact"}})
    ok = redacted.filter(pa.compute.equal(redacted.column("status"), "ok"))
    assert not any(gate_samples(ok).column("personal_data_shown").to_pylist())


def test_fine_tuning_turns_are_checked_one_by_one():
    from tasks.finetune.conversations import check_conversation, private_turns
    from tasks.formats.recipe_finetune import ConversationRules
    from tasks.formats.recipe_privacy import TextPrivacy

    record = {
        "id": "r1",
        "image": "a.jpg",
        "conversations": [
            {"from": "human", "value": "<image>\nwho took this?"},
            {"from": "gpt", "value": "mail jane.doe@example.com or call +44 20 7946 0958"},
        ],
    }
    conv = check_conversation(record, ConversationRules())
    redacted = private_turns(conv, TextPrivacy(mode="redact"))
    assert redacted.ok and redacted.turns[1] == ("gpt", "mail <EMAIL> or call <PHONE>")
    assert redacted.turns[0] == conv.turns[0] and redacted.detail.startswith("redacted: turn 1: email 5-25")
    refused = private_turns(conv, TextPrivacy(mode="reject"))
    assert refused.reason == "personal_data" and refused.detail.startswith("turn 1: ")
    assert private_turns(conv, TextPrivacy(mode="off")) is conv
    # a record refused for its roles quotes the role, its personal data masked
    odd = {"conversations": [{"from": "jane.doe@example.com", "value": "hi"}, {"from": "gpt", "value": "yes"}]}
    bad = check_conversation(odd, ConversationRules())
    assert bad.reason == "conversation_roles" and bad.detail == "turn 0 is '<EMAIL>', expected human"


def test_a_turn_the_scanner_cannot_finish_is_refused_under_redact():
    from tasks.finetune.conversations import check_conversation, private_turns
    from tasks.formats.recipe_finetune import ConversationRules
    from tasks.formats.recipe_privacy import TextPrivacy

    hostile = "1-2 3.4 " * 24_000  # 192,000 characters of digits and separators
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": hostile}]}
    conv = private_turns(check_conversation(record, ConversationRules()), TextPrivacy(mode="redact"))
    assert conv.reason == "personal_data" and "truncated" in conv.detail


FACES = {
    "none": (distinct_image(6), "a red kite over the dunes"),
    "one": (None, "a portrait on the beach"),
    "two": (None, "two people on the beach"),
}


def face_inputs() -> dict[str, tuple[bytes, str]]:
    return {**FACES, "one": (face_jpeg(1, 1), FACES["one"][1]), "two": (face_jpeg(2, 2), FACES["two"][1])}


def test_faces_are_blurred_in_the_released_image_and_recorded(tmp_path):
    from tasks.formats.recipe_privacy import FacePrivacy
    from tasks.models.faces import FaceDetector

    _, rows, written = validate(tmp_path, face_inputs(), {"faces": {"mode": "blur"}})
    assert {k: (r["status"], r["faces"], r["privacy"]) for k, r in rows.items()} == {
        "none": ("ok", 0, None),
        "one": ("ok", 1, "blurred"),
        "two": ("ok", 2, "blurred"),
    }
    detector = FaceDetector(FacePrivacy(mode="record"))
    for key, n in (("one", 1), ("two", 2)):
        meta = json.loads(written[key]["json"])
        assert meta["faces_found"] == n and len(meta["faces"]) == n and meta["faces_blurred"] is True
        assert all(len(f["box"]) == 4 and f["score"] >= 0 for f in meta["faces"])
        with Image.open(io.BytesIO(written[key]["jpg"])) as img:
            assert detector.detect(img.convert("RGB"))[1] == 0  # what is released shows no face
    # Bytes kept as fetched (skip_reencode) cannot carry blurred pixels: a blurred image is encoded.
    inputs = face_inputs()
    _, kept, kept_out = validate(tmp_path / "kept", inputs, {"faces": {"mode": "blur"}}, {"skip_reencode": True})
    assert kept_out["none"]["jpg"] == inputs["none"][0] and kept_out["one"]["jpg"] != inputs["one"][0]
    with Image.open(io.BytesIO(kept_out["one"]["jpg"])) as img:
        assert detector.detect(img.convert("RGB"))[1] == 0 and kept["one"]["privacy"] == "blurred"
    # The pixel keys are the decoded input's: a blurred copy is still a duplicate of its original.
    _, plain, _ = validate(tmp_path / "off", face_inputs(), {"faces": {"mode": "off"}})
    assert plain["one"]["pixel_sha256"] == rows["one"]["pixel_sha256"] and plain["one"]["faces"] is None


def test_faces_recorded_or_refused(tmp_path):
    _, rows, written = validate(tmp_path / "record", face_inputs(), {"faces": {"mode": "record"}})
    assert {k: (r["faces"], r["privacy"]) for k, r in rows.items()} == {
        "none": (0, None),
        "one": (1, None),
        "two": (2, None),
    }
    assert json.loads(written["two"]["json"])["faces_blurred"] is False
    with Image.open(io.BytesIO(written["one"]["jpg"])) as img:
        from tasks.formats.recipe_privacy import FacePrivacy
        from tasks.models.faces import FaceDetector

        assert FaceDetector(FacePrivacy(mode="record")).detect(img.convert("RGB"))[1] == 1

    _, rows, written = validate(tmp_path / "reject", face_inputs(), {"faces": {"mode": "reject"}})
    assert {k: r["reason"] for k, r in rows.items()} == {"none": None, "one": "face_present", "two": "face_present"}
    assert rows["two"]["detail"].startswith("2 faces found, the largest ") and sorted(written) == ["none"]

    # Under blur, more faces than max_faces cannot all be blurred: refused.
    _, rows, _ = validate(tmp_path / "cap", face_inputs(), {"faces": {"mode": "blur", "max_faces": 1}})
    assert (rows["one"]["status"], rows["two"]["reason"]) == ("ok", "face_present")
    assert "max_faces 1" in rows["two"]["detail"]


def _faces_in_thumbnails(tmp_path, rows: dict[str, dict]) -> dict[str, int]:
    """Faces the detector finds in each thumbnail the run kept for the report (enlarged 4x)."""
    import pyarrow.parquet as pq

    from tasks.formats.recipe_privacy import FacePrivacy
    from tasks.models.faces import FaceDetector

    detector = FaceDetector(FacePrivacy(mode="record"))
    (path,) = (tmp_path / "out").rglob("*.thumbs.parquet")
    found = {}
    names = {r["key"]: name for name, r in rows.items()}
    for row in pq.read_table(path).to_pylist():
        with Image.open(io.BytesIO(row["thumbnail"])) as img:
            big = img.convert("RGB").resize((img.width * 4, img.height * 4), Image.Resampling.BICUBIC)
        found[names[row["key"]]] = detector.detect(big)[1]
    return found


@pytest.mark.parametrize("mode", ["blur", "reject"])
def test_thumbnails_of_samples_refused_before_their_face_check_show_no_face(tmp_path, mode):
    """The report shows a few refused samples; where faces are blurred or refused, a sample
    refused for its license or by a header rule (its aspect ratio) is shown blurred too."""
    wide = Image.new("RGB", (960, 320), (200, 180, 160))
    with Image.open(io.BytesIO(face_jpeg(3, 1))) as img:
        wide.paste(img, (320, 0))
    buf = io.BytesIO()
    wide.save(buf, "JPEG", quality=90)
    inputs = {"licensed": (face_jpeg(1, 1), "a portrait"), "wide": (buf.getvalue(), "a wide portrait")}
    metas = {"licensed": {"license": "all rights reserved"}}
    image = {"max_aspect_ratio": 2.0}
    _, rows, _ = validate(tmp_path / mode, inputs, {"faces": {"mode": mode}}, image, metas=metas)
    assert rows["wide"]["reason"] == "aspect_ratio" and rows["licensed"]["status"] == "rejected"
    assert _faces_in_thumbnails(tmp_path / mode, rows) == {"licensed": 0, "wide": 0}
    # Under record, faces are released as found, and so are the thumbnails (the check finds them).
    _, rows, _ = validate(tmp_path / "record", inputs, {"faces": {"mode": "record"}}, image, metas=metas)
    assert _faces_in_thumbnails(tmp_path / "record", rows) == {"licensed": 1, "wide": 1}


def test_hostile_pixels_metadata_and_captions_each_end_as_one_row(tmp_path):
    """10,000 tiny faces, an EXIF segment far larger than its image, captions made to slow the
    scanner: each is judged, bounded, to exactly one row through the real reader and validation."""
    from tasks.demo.faces import astronaut_crop

    tiny = astronaut_crop().resize((24, 28))
    sheet = Image.new("RGB", (100 * 24, 100 * 28))
    for i in range(10_000):
        sheet.paste(tiny, ((i % 100) * 24, (i // 100) * 28))
    buf = io.BytesIO()
    sheet.save(buf, "JPEG", quality=80)
    small = io.BytesIO()
    Image.open(io.BytesIO(distinct_image(7))).convert("RGB").save(small, "JPEG")
    # An APP1 segment of 64 KiB (the most one segment holds) repeated 100 times before the image.
    bomb = small.getvalue()[:2] + (b"\xff\xe1\xff\xff" + b"Exif\x00\x00" + b"\x00" * 65527) * 100 + small.getvalue()[2:]
    inputs = {
        "faces": (buf.getvalue(), "a crowd"),
        "metadata": (bomb, "a kite"),
        "digits": (distinct_image(8), "1-2 3.4 " * 120_000),
        "ats": (distinct_image(9), "@" * 100_000),
        "mails": (distinct_image(10), "a@b." * 200_000),
    }
    privacy = {"faces": {"mode": "blur"}, "text": {"mode": "redact"}}
    image = {"skip_reencode": True, "max_pixels": 10_000_000}
    caption = {"max_chars": 2_000_000, "min_words": 0}  # so that the scanner reads them
    ledger, rows, _ = validate(tmp_path, inputs, privacy, image, caption)
    assert ledger.num_rows == len(inputs) and sorted(rows) == sorted(inputs)
    assert rows["faces"]["status"] == "ok" and rows["faces"]["faces"] >= 0
    assert rows["metadata"]["status"] == "ok" and rows["metadata"]["privacy"] == "metadata"
    # The scanner stops at its caps; what it could not read to the end is not released under redact.
    assert rows["digits"]["reason"] == "personal_data" and "truncated" in rows["digits"]["detail"]
    for key in ("ats", "mails"):
        assert rows[key]["status"] in ("ok", "rejected") and rows[key]["personal_data"] is not None, key


def test_a_video_whose_caption_is_redacted_says_so_on_every_clip_row(tmp_path):
    """The gate counts what is released: a redacted caption is ``redacted`` on a video's rows too."""
    from video_fixtures import make_video

    from tasks.audit.validate_samples import gate_samples

    inputs = {"clip": (make_video(seconds=2, fps=10, size=(128, 72)), EMAIL_CAPTION, "mp4")}
    ledger, _, written = validate(tmp_path, inputs, {"text": {"mode": "redact"}})
    rows = [r for r in ledger.to_pylist() if r["status"] == "ok"]
    assert rows and all((r["personal_data"], r["privacy"]) == ("email", "redacted") for r in rows)
    assert all(m["txt"].decode().endswith("<EMAIL>") for m in written.values())
    ok = ledger.filter(pa.compute.equal(ledger.column("status"), "ok"))
    assert not any(gate_samples(ok).column("personal_data_shown").to_pylist())


def face_video(leaving: bool = False, speed: int = 22, start: int = 60) -> bytes:
    """Two seconds (20 frames) of the bundled face drifting right (a clip must move to be kept);
    ``leaving``: it moves out of the picture on the right, ``speed`` px a frame from ``start``
    (by default whole at a quarter of the way, frame 5, and gone well before the middle frame)."""
    import numpy as np
    from video_fixtures import make_video

    from tasks.demo.faces import ASTRONAUT_FACE, astronaut_crop, face_tile

    frame = np.asarray(Image.open(io.BytesIO(face_jpeg(0, 1))).convert("RGB").resize((256, 256)))
    tile = np.asarray(face_tile(np.random.default_rng(0), astronaut_crop(), ASTRONAUT_FACE, 70, jitter=False)[0])

    def draw(i: int, t: float):
        if not leaving:
            return np.roll(frame, 3 * i, axis=1)
        img = np.full((256, 256, 3), (40, 90, 160), np.uint8)
        x = start + speed * i
        if x < 256:
            img[40 : 40 + tile.shape[0], x : x + tile.shape[1]] = tile[:, : 256 - x]
        return img

    return make_video(seconds=2, fps=10, size=(256, 256), draw=draw)


@pytest.mark.parametrize("mode", ["record", "reject", "blur"])
def test_a_video_clip_is_looked_at_for_faces_in_three_of_its_frames(tmp_path, mode):
    """A clip's frames a quarter, half and three quarters through are checked as an image is (a
    face gone by the middle frame too); its frames cannot be blurred, so ``blur`` refuses a clip
    that shows a face, as ``reject`` does; a clip without one is kept."""
    from video_fixtures import make_video

    inputs = {
        "face": (face_video(), "a portrait", "mp4"),
        "early": (face_video(leaving=True), "a face leaving", "mp4"),  # not in the middle frame
        "plain": (make_video(seconds=2, fps=10, size=(128, 72)), "a red square", "mp4"),
    }
    ledger, _, written = validate(tmp_path, inputs, {"faces": {"mode": mode}, "text": {"mode": "off"}})
    by_video: dict[str, list[dict]] = {}
    for r in ledger.to_pylist():
        by_video.setdefault(r["origin"].rsplit(":", 1)[1], []).append(r)
    faces, early, plain = by_video["face"], by_video["early"], by_video["plain"]
    assert all(r["faces"] >= 1 for r in faces + early) and all(r["faces"] == 0 for r in plain)
    assert all(r["status"] == "ok" for r in plain)
    metas = {m["origin"]["key"]: m for m in (json.loads(w["json"]) for w in written.values())}
    assert all(set(m["faces_frames"]) == {"0.25", "0.5", "0.75"} for m in metas.values())
    if mode == "record":
        assert all(r["status"] == "ok" for r in faces + early)
        assert metas["face"]["faces_found"] >= 1 and len(metas["face"]["faces"][0]["box"]) == 4
        # the face is in the first quarter's frame only: counted, though the keyframe has none
        assert (metas["early"]["faces_frames"]["0.25"], metas["early"]["faces_frames"]["0.5"]) == (1, 0)
        assert metas["early"]["faces"] == []
    else:
        assert {(r["status"], r["reason"]) for r in faces + early} == {("rejected", "face_present")}
        assert all(r["detail"].startswith("frame 0.25 of the way through: ") for r in faces + early)
        assert all(r["sha256"] is None for r in faces + early)
        if mode == "blur":
            assert all("not blurred" in r["detail"] for r in faces + early)
        assert set(metas) == {"plain"}  # the refused clips are not written; the plain video's are


@pytest.mark.parametrize("mode", ["blur", "record"])
def test_a_clip_refused_before_its_face_check_shows_its_keyframe_blurred(tmp_path, mode):
    """A still clip of a face is refused as static before it is looked at; its keyframe, the
    report's thumbnail, goes through the face check where faces are blurred or refused."""
    import numpy as np
    from video_fixtures import make_video

    frame = np.asarray(Image.open(io.BytesIO(face_jpeg(0, 1))).convert("RGB").resize((256, 256)))
    still = make_video(seconds=2, fps=10, size=(256, 256), draw=lambda i, t: frame)
    inputs = {"still": (still, "a portrait", "mp4")}
    ledger, _, _ = validate(tmp_path, inputs, {"faces": {"mode": mode}, "text": {"mode": "off"}})
    rows = {r["key"]: r for r in ledger.to_pylist()}
    assert {r["reason"] for r in rows.values()} == {"clip_static"}
    named = {key: "still" for key in rows}
    found = _faces_in_thumbnails(tmp_path, {name: {"key": key} for key, name in named.items()})
    assert found == {"still": 0 if mode == "blur" else 1}


def test_more_frames_of_a_clip_are_looked_at_where_the_recipe_asks(tmp_path):
    """``clip_frames: 5`` looks a sixth of the way through too: a face gone by the quarter frame
    (whole in frames 0-3 of 20, 11 px of it left by frame 5) is missed by the default 3 frames
    and found in the frame at 0.17 by 5."""
    brief = {"brief": (face_video(leaving=True, speed=45, start=20), "a face passing", "mp4")}
    seen = {}
    for frames in (3, 5):
        privacy = {"faces": {"mode": "reject", "clip_frames": frames}, "text": {"mode": "off"}}
        ledger, _, written = validate(tmp_path / str(frames), brief, privacy)
        seen[frames] = ledger.to_pylist()
        metas = [json.loads(w["json"]) for w in written.values()]
        if frames == 3:
            assert metas and all(m["faces_frames"] == {"0.25": 0, "0.5": 0, "0.75": 0} for m in metas)
    assert seen[3] and {(r["status"], r["faces"]) for r in seen[3]} == {("ok", 0)}
    assert {(r["status"], r["reason"]) for r in seen[5]} == {("rejected", "face_present")}
    assert all(r["detail"].startswith("frame 0.17 of the way through: ") for r in seen[5])


def test_clip_frames_is_odd_and_spread_evenly():
    from tasks.formats.recipe_privacy import FacePrivacy
    from tasks.video.clips import look_points

    assert look_points(1) == [] and look_points(3) == [(1, "0.25"), (3, "0.75")]
    assert [at for _, at in look_points(5)] == ["0.17", "0.33", "0.67", "0.83"]
    assert len(look_points(15)) == 14 and len({at for _, at in look_points(15)}) == 14
    with pytest.raises(ValueError, match="4 is even: an odd count keeps the keyframe"):
        FacePrivacy(mode="reject", clip_frames=4)


FIELDS = {
    "copy": {
        "caption": EMAIL_CAPTION,
        "notes": "call +44 20 7946 0958",
        "nested": {"who": ["jane.doe@example.com"]},
        "contacts": {"jo.bloggs@example.org": "a friend", "jo@example.org": "another"},  # keys are text too
    },
    "exif": {"exif": '{"GPSInfo": {"1": "N", "2": [59.0, 19.0, 44.0]}}', "Xmp": None},
    "plain": {"notes": "a kite", "exif": None},
}


def test_the_json_fields_besides_the_caption_are_checked_and_metadata_copies_removed(tmp_path):
    """An ingested shard's own json is released under ``upstream``: a copy of the caption there,
    or a note with a phone number, is redacted as the caption is; img2dataset's ``exif`` is removed."""
    inputs = {k: (distinct_image(i), "a kite over the dunes") for i, k in enumerate(FIELDS)}
    _, rows, written = validate(tmp_path, inputs, {"text": {"mode": "redact"}}, metas=FIELDS)
    assert {k: r["status"] for k, r in rows.items()} == {"copy": "ok", "exif": "ok", "plain": "ok"}
    copy = json.loads(written["copy"]["json"])
    assert copy["upstream"]["caption"].endswith("<EMAIL>") and copy["upstream"]["notes"] == "call <PHONE>"
    assert copy["upstream"]["nested"] == {"who": ["<EMAIL>"]}
    assert copy["upstream"]["contacts"] == {"<EMAIL>": "a friend", "<EMAIL>#2": "another"}
    assert {(f["field"], f["kind"]) for f in copy["personal_data"]} == {
        ("upstream.caption", "email"),
        ("upstream.notes", "phone"),
        ("upstream.nested.who[0]", "email"),
        ("upstream.contacts.<key>", "email"),
    }
    assert (rows["copy"]["personal_data"], rows["copy"]["privacy"]) == ("email,phone", "redacted")
    assert "upstream.notes: phone 5-21" in rows["copy"]["detail"]
    assert not [v for v in ("jane.doe", "7946", "bloggs") if v in written["copy"]["json"].decode()]
    assert "bloggs" not in rows["copy"]["detail"]
    gps = json.loads(written["exif"]["json"])
    assert (
        "exif" not in gps["upstream"]
        and "Xmp" not in gps["upstream"]
        and "GPSInfo" not in written["exif"]["json"].decode()
    )
    assert gps["metadata_removed"][-1] == "json:upstream.exif" and "metadata" in rows["exif"]["privacy"]
    plain = json.loads(written["plain"]["json"])  # an empty exif field goes, and is not a change
    assert "exif" not in plain["upstream"] and rows["plain"]["privacy"] in (None, "metadata")
    assert "json:upstream.exif" not in plain.get("metadata_removed", [])


def test_numbers_in_the_json_are_read_as_their_digits_and_a_refusal_records_its_kinds(tmp_path):
    """A card or phone number stored as a json number is personal data too; a field named as a
    phone makes bare digits a phone number; a refused sample's row says what was found."""
    numbers = {"n": {"card_number": 4111111111111111, "phone": 4155552671, "views": 123456789}}
    inputs = {"n": (distinct_image(20), "a kite over the dunes")}
    _, rows, written = validate(tmp_path / "redact", inputs, {"text": {"mode": "redact"}}, metas=numbers)
    upstream = json.loads(written["n"]["json"])["upstream"]
    assert {k: upstream[k] for k in numbers["n"]} == {"card_number": "<CARD>", "phone": "<PHONE>", "views": 123456789}
    assert (rows["n"]["status"], rows["n"]["personal_data"]) == ("ok", "card,phone")
    _, rows, _ = validate(tmp_path / "reject", inputs, {"text": {"mode": "reject"}}, metas=numbers)
    assert (rows["n"]["reason"], rows["n"]["detail"]) == ("personal_data", "upstream.card_number: card 0-16")
    assert rows["n"]["personal_data"] == "card"


def test_third_parties_text_in_provenance_fields_is_scanned_and_never_quoted(tmp_path):
    """The license as the source wrote it (released as license_raw), an id, an origin or a
    column that takes one of their names are third parties' text: checked like any field. Only
    what shardsmith sets itself (key, source, row, url, caption, format, bytes, sha256) is not.
    A license refused for what it says is quoted in the detail with its personal data masked."""
    from tasks.formats.recipe_download import LicensePolicy
    from tasks.formats.recipe_privacy import TextPrivacy
    from tasks.policies.licenses import license_verdict
    from tasks.policies.privacy import check_fields

    meta = {"key": "k", "url": "https://ex.org/a.jpg", "origin": "contact jane.doe@example.com", "id": "jo@example.org"}
    fields = check_fields(meta, TextPrivacy(mode="redact"))
    assert fields.meta == {**meta, "origin": "contact <EMAIL>", "id": "<EMAIL>"}
    assert {path for path, _ in fields.spans} == {"origin", "id"}
    raw = "https://creativecommons.org/publicdomain/zero/1.0/?by=jane.doe@example.com"
    inputs = {"lic": (distinct_image(21), "a kite")}
    _, rows, written = validate(
        tmp_path / "redact", inputs, {"text": {"mode": "redact"}}, metas={"lic": {"license": raw}}
    )
    released = json.loads(written["lic"]["json"])
    assert released["license"] == "CC0-1.0" and "jane.doe" not in written["lic"]["json"].decode()
    assert rows["lic"]["personal_data"] == "url_secret"
    _, rows, _ = validate(tmp_path / "reject", inputs, {"text": {"mode": "reject"}}, metas={"lic": {"license": raw}})
    assert rows["lic"]["reason"] == "personal_data" and "jane.doe" not in rows["lic"]["detail"]
    refused = license_verdict("Photo by jane.doe@example.com", "s", LicensePolicy(allow=["CC0-1.0"]))
    assert refused.detail == "unrecognised license: 'Photo by <EMAIL>'"


def test_json_fields_refused_under_reject_kept_under_record_and_bounded(tmp_path):
    inputs = {k: (distinct_image(i), "a kite over the dunes") for i, k in enumerate(FIELDS)}
    _, rows, _ = validate(tmp_path / "reject", inputs, {"text": {"mode": "reject"}}, metas=FIELDS)
    assert (rows["copy"]["reason"], rows["plain"]["reason"]) == ("personal_data", None)
    assert rows["copy"]["detail"].startswith("upstream.caption: email")
    _, rows, written = validate(tmp_path / "record", inputs, {"text": {"mode": "record"}}, metas=FIELDS)
    copy = json.loads(written["copy"]["json"])
    assert copy["upstream"]["notes"] == "call +44 20 7946 0958" and rows["copy"]["personal_data"] == "email,phone"
    assert rows["copy"]["privacy"] is None and rows["copy"]["detail"].startswith("personal data kept: ")
    assert "jo.bloggs@example.org" in copy["upstream"]["contacts"] and "bloggs" not in rows["copy"]["detail"]
    only_key = {"contacts": {"jo.bloggs@example.org": "a friend"}}  # refused for its key alone, which no detail names
    _, rows, _ = validate(tmp_path / "key", {"k": inputs["plain"]}, {"text": {"mode": "reject"}}, metas={"k": only_key})
    assert rows["k"]["reason"] == "personal_data" and rows["k"]["detail"] == "upstream.contacts.<key>: email 0-21"
    # hostile: a json of 5,000 strings and one nested 50 deep ends as one row each, refused under redact
    deep: dict = {"x": "jane.doe@example.com"}
    for _ in range(50):
        deep = {"d": deep}
    many = {"many": {f"f{i}": "a" for i in range(5000)}, "deep": {"deep": deep}}
    hostile = {k: (distinct_image(10 + i), "a kite") for i, k in enumerate(many)}
    metas = {"many": many["many"], "deep": many["deep"]}
    ledger, rows, _ = validate(tmp_path / "hostile", hostile, {"text": {"mode": "redact"}}, metas=metas)
    assert ledger.num_rows == 2
    assert all(r["reason"] == "personal_data" and "scan truncated" in r["detail"] for r in rows.values())
