"""validate.image.skip_reencode: ingested images released with their own bytes when nothing would change them, through the real ingest + validate path."""

from __future__ import annotations

import io
import json
from functools import partial

from byo_fixtures import PNG, distinct_image, sample, tar_bytes
from PIL import Image

from tasks.formats.ledger import read_ledger
from tasks.formats.recipe_download import DownloadConfig, SourceConfig, ValidateConfig
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.sources import ingest_rows, plan_ingest
from tasks.stages.download import shard_paths
from tasks.stages.onepass import download_and_validate
from tasks.stages.validate import candidate_paths


def _jpeg(img: Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **save)
    return buf.getvalue()


def _rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 on display
    return _jpeg(Image.open(io.BytesIO(distinct_image(3))).convert("RGB"), exif=exif)


CLEAN = distinct_image(1)
WITH_PAYLOAD = distinct_image(2) + b"PK\x03\x04 appended after the end of the image"
ROTATED = _rotated_jpeg()
GREY = _jpeg(Image.open(io.BytesIO(distinct_image(4))).convert("L"))
INPUTS = {
    "clean": CLEAN,  # kept
    "payload": WITH_PAYLOAD,  # kept, without the bytes after the image (tasks/policies/metadata.py)
    "copy": CLEAN + b"\x00trailing",  # kept too (without its tail), and still the same pixels as "clean"
    "png": PNG,  # not the output format: re-encoded to JPEG
    "rotated": ROTATED,  # EXIF orientation applied: re-encoded
    "grey": GREY,  # converted to RGB: re-encoded
    "bomb": _jpeg(Image.new("RGB", (200, 200), (9, 9, 9))),  # over max_pixels: still refused, never decoded
    "small": _jpeg(Image.new("RGB", (20, 20), (9, 9, 9))),  # still refused
}


def validate(tmp_path, image: dict) -> tuple[list[dict], dict[str, dict[str, bytes]]]:
    """Ingest one tar of INPUTS and validate it in one pass; (candidate ledger rows, written samples by origin key)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    members = []
    for key, data in INPUTS.items():
        members += sample(key, f"the {key} one", image=data, meta={"license": "CC0-1.0"})
    (folder / "00000.tar").write_bytes(tar_bytes(members))
    source = SourceConfig(name="wds", manifest=str(folder), kind="webdataset")
    storage = Storage(str(tmp_path / "out"))
    ref = plan_ingest(source).chunks[0]
    down = shard_paths("ds", ref, "cfg")
    cand = candidate_paths("ds", ref.source, ref.index, down[0], "v")
    vcfg = ValidateConfig.model_validate(
        {"license": {"allow": ["CC0-1.0"]}, "image": {"min_side": 32, "max_pixels": 10_000, **image}}
    )
    download_and_validate(ref, storage, DownloadConfig(), vcfg, down, cand, None, partial(ingest_rows, source))
    rows = read_ledger(storage, cand[1]).to_pylist()
    with storage.open(cand[0], "rb") as fh:
        written = {}
        for s in iter_samples(fh):
            written[json.loads(s.members["json"])["origin"]["key"]] = s.members
    return rows, written


def test_skip_reencode_releases_the_input_bytes_when_nothing_would_change_them(tmp_path):
    """The input's bytes, less metadata and appended bytes, where re-encoding would change nothing."""
    rows, written = validate(tmp_path, {"skip_reencode": True})
    by_key = {r["origin"].rsplit(":", 1)[1]: r for r in rows}
    assert {k: (r["status"], r["reason"]) for k, r in by_key.items() if r["status"] != "ok"} == {
        "bomb": ("rejected", "decompression_bomb"),
        "small": ("rejected", "image_too_small"),
    }
    assert sorted(written) == ["clean", "copy", "grey", "payload", "png", "rotated"]
    # Kept as fetched, less what follows the image: the compressed pixels are the input's.
    assert written["clean"]["jpg"] == CLEAN and written["copy"]["jpg"] == CLEAN
    assert written["payload"]["jpg"] == WITH_PAYLOAD[: WITH_PAYLOAD.index(b"PK\x03\x04")]
    for key in ("png", "rotated", "grey"):
        assert written[key]["jpg"] != INPUTS[key] and written[key]["jpg"][:2] == b"\xff\xd8", key
        assert Image.open(io.BytesIO(written[key]["jpg"])).mode == "RGB", key
    assert Image.open(io.BytesIO(written["rotated"]["jpg"])).size == (80, 96)  # turned, not kept
    # Dedup still works: the hashes come from the decoded pixels, not the bytes.
    assert by_key["copy"]["pixel_sha256"] == by_key["clean"]["pixel_sha256"] != by_key["payload"]["pixel_sha256"]


def test_the_default_still_reencodes_every_image(tmp_path):
    rows, written = validate(tmp_path, {})
    assert sorted(written) == ["clean", "copy", "grey", "payload", "png", "rotated"]
    assert all(members["jpg"] != INPUTS[key] for key, members in written.items())
    assert not any(b"appended" in members["jpg"] for members in written.values())
    assert {r["reason"] for r in rows if r["status"] != "ok"} == {"decompression_bomb", "image_too_small"}
