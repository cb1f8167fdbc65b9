"""tasks.policies.images: every verdict and normalisation, on images built here."""

from __future__ import annotations

import dataclasses
import io
import struct
import zipfile
import zlib

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFile

from tasks.formats.recipe_download import ImageRules
from tasks.policies import decoders, images
from tasks.policies.images import ImageOutcome, process_image
from tasks.policies.pixels import hamming

LOOSE = ImageRules(min_side=1, max_aspect_ratio=1000.0)
EXACT = ImageRules(min_side=1, max_aspect_ratio=1000.0, output_format="png")  # lossless output to read pixels


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def pixels(outcome: ImageOutcome) -> np.ndarray:
    assert outcome.reason is None, (outcome.reason, outcome.detail)
    with Image.open(io.BytesIO(outcome.data)) as img:
        assert img.mode == "RGB"
        return np.asarray(img).astype(int)


def scene(seed: int, size=(640, 480)) -> Image.Image:
    """A photo-like picture: sky gradient, a few shapes, fine grain."""
    rng = np.random.default_rng(seed)
    w, h = size
    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0, 1, h)[:, None, None]
    arr = (top * (1 - t) + bottom * t) * np.ones((1, w, 1))
    img = Image.fromarray(arr.astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x, y = rng.integers(0, w), rng.integers(0, h)
        r = int(rng.integers(h // 10, h // 3))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
        else:
            draw.rectangle((x - r, y - r // 2, x + r, y + r // 2), fill=colour)
    grain = rng.integers(-6, 7, size=(h, w, 1))
    return Image.fromarray(np.clip(np.asarray(img, int) + grain, 0, 255).astype(np.uint8))


def png_with_header(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR claims another size (with a correct CRC)."""
    data = bytearray(encode(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG"))
    ihdr = 8 + 8  # signature, then IHDR's length and type
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13]))
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


# ----------------------------------------------------------------------------- byte-level checks


def test_file_size_bounds():
    data = encode(scene(1, (128, 96)), "JPEG")
    assert process_image(data, ImageRules(min_bytes=len(data) + 1)).reason == "file_too_small"
    assert process_image(data, ImageRules(max_bytes=len(data) - 1)).reason == "file_too_large"
    assert process_image(data, ImageRules(min_bytes=len(data), max_bytes=len(data))).reason is None


def test_html_is_not_an_image():
    outcome = process_image(b"<!DOCTYPE html><html><body>404</body></html>", ImageRules())
    assert outcome.reason == "not_an_image"
    assert outcome.src_format is None


def test_format_not_allowed():
    data = encode(scene(1, (128, 96)), "JPEG")
    outcome = process_image(data, ImageRules(allowed_formats=("png",)))
    assert (outcome.reason, outcome.src_format) == ("format_not_allowed", "jpeg")


def test_signature_with_garbage_is_undecodable():
    outcome = process_image(b"\xff\xd8\xff\xe0" + bytes(300) + b"\xff\xd9", ImageRules())
    assert outcome.reason == "undecodable_image"
    assert "0x" not in outcome.detail  # no object addresses in details


# ----------------------------------------------------------------------------- bombs


def test_bomb_header_rejected_by_pillows_guard_without_decoding(monkeypatch):
    def no_decode(self):
        raise AssertionError("decoded a bomb")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    data = png_with_header(100_000, 100_000)
    assert len(data) < 100
    for rules in (ImageRules(), ImageRules(max_pixels=10**11)):  # over Pillow's guard either way
        outcome = process_image(data, rules)
        assert outcome.reason == "decompression_bomb"


def test_bomb_header_under_pillows_guard_rejected_by_max_pixels_without_decoding(monkeypatch):
    def no_decode(self):
        raise AssertionError("decoded a bomb")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    # 60 Mpx: above the default max_pixels (50 M), below Pillow's own warning (89 M).
    outcome = process_image(png_with_header(10_000, 6_000), ImageRules())
    assert outcome.reason == "decompression_bomb"
    assert "max_pixels" in outcome.detail


def test_upscale_target_over_pixel_cap_is_not_allocated(monkeypatch):
    data = encode(Image.new("RGB", (1000, 4), (5, 5, 5)), "PNG")
    rules = ImageRules(
        min_side=1, max_aspect_ratio=1000.0, resize_mode="keep_ratio", image_size=256, max_pixels=10_000_000
    )
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded"))
    outcome = process_image(data, rules)  # 64000 x 256 = 16.4 Mpx
    assert outcome.reason == "decompression_bomb"
    assert "64000x256" in outcome.detail


def test_real_png_over_small_pixel_cap():
    data = encode(Image.new("L", (2000, 1000), 90), "PNG")
    assert len(data) < 20_000  # cheap to ship, 2 Mpx to decode
    assert process_image(data, ImageRules(max_pixels=1_999_999)).reason == "decompression_bomb"
    assert process_image(data, ImageRules(max_pixels=2_000_000)).reason is None


# ----------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated(fmt):
    data = encode(scene(2, (320, 240)), fmt)
    outcome = process_image(data[: len(data) // 2], ImageRules())
    assert outcome.reason == "truncated_image"
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_png_without_iend_is_truncated():
    # Pillow would decode it (the pixels are all there); the download stage calls it truncated.
    data = encode(scene(2, (320, 240)), "PNG")
    assert process_image(data[:-12], ImageRules()).reason == "truncated_image"


def test_truncated_png_with_end_marker_fails_in_the_decoder():
    data = encode(scene(2, (320, 240)), "PNG")
    outcome = process_image(data[: len(data) // 2] + data[-12:], ImageRules())  # IEND glued on
    assert outcome.reason == "truncated_image"
    assert "truncated" in outcome.detail


def test_truncated_jpeg_with_an_early_end_marker_fails_in_the_decoder():
    # An embedded thumbnail (here in a COM segment; in practice in EXIF) ends with FFD9, so the
    # end-marker check passes on the cut file; the decode must still fail.
    img = scene(3, (640, 480))
    thumb = encode(img.resize((160, 120)), "JPEG")
    data = encode(img, "JPEG")
    spliced = data[:2] + b"\xff\xfe" + struct.pack(">H", len(thumb) + 2) + thumb + data[2:]
    assert process_image(spliced, LOOSE).reason is None
    cut = spliced[: len(spliced) - 4000]
    assert cut.rfind(b"\xff\xd9") > 2
    assert process_image(cut, LOOSE).reason == "truncated_image"


# ----------------------------------------------------------------------------- colour modes


def test_cmyk_jpeg_becomes_rgb_with_the_right_colour():
    img = Image.new("CMYK", (64, 64), (0, 255, 255, 0))  # red in CMYK
    data = encode(img, "JPEG", quality=95)
    with Image.open(io.BytesIO(data)) as check:
        assert check.mode == "CMYK"
    arr = pixels(process_image(data, EXACT))
    assert np.abs(arr.mean(axis=(0, 1)) - (255, 0, 0)).max() < 12


def test_16_bit_grey_is_scaled_not_clipped():
    row = np.arange(256, dtype=np.uint32) * 257  # 0 .. 65535
    row[128] = 32768
    grey16 = np.repeat(row[None, :], 64, axis=0).astype(np.uint16)
    img = Image.fromarray(grey16)
    assert img.mode == "I;16"
    data = encode(img, "PNG")
    arr = pixels(process_image(data, EXACT))
    assert arr.shape == (64, 256, 3)
    assert (arr[:, :, 0] == arr[:, :, 2]).all()
    assert arr[0, 255, 0] == 255
    assert arr[0, 0, 0] == 0
    assert arr[0, 128, 0] == 128
    assert arr[0, 100, 0] == 100  # 25700 / 257; a clip at 255 would give 255


def test_palette_png_with_transparency_composited_on_white():
    img = Image.new("P", (64, 64), 0)
    img.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    ImageDraw.Draw(img).rectangle((32, 0, 63, 63), fill=1)
    data = encode(img, "PNG", transparency=0)  # index 0 (black) is fully transparent
    arr = pixels(process_image(data, EXACT))
    assert (arr[:, :32] == 255).all()  # not black
    assert (arr[:, 32:] == (255, 0, 0)).all()


def test_rgb_png_with_transparent_colour_composited_on_white():
    img = Image.new("RGB", (64, 64), (0, 0, 0))
    ImageDraw.Draw(img).rectangle((32, 0, 63, 63), fill=(0, 128, 0))
    arr = pixels(process_image(encode(img, "PNG", transparency=(0, 0, 0)), EXACT))
    assert (arr[:, :32] == 255).all()
    assert (arr[:, 32:] == (0, 128, 0)).all()


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_alpha_composited_on_white(mode):
    arr = np.zeros((64, 64, 4), np.uint8)
    arr[:, :16] = (12, 200, 7, 0)  # garbage colour, fully transparent
    arr[:, 16:32] = (0, 0, 0, 0)
    arr[:, 32:48] = (255, 0, 0, 255)
    arr[:, 48:] = (0, 0, 0, 128)  # half-transparent black
    img = Image.fromarray(arr)
    if mode == "LA":
        img = img.convert("LA")
    out = pixels(process_image(encode(img, "PNG"), EXACT))
    assert (out[:, :32] == 255).all()
    assert (np.abs(out[:, 48:] - 127) <= 1).all()
    if mode == "RGBA":
        assert (out[:, 32:48] == (255, 0, 0)).all()


def test_float_samples_are_unsupported():
    img = Image.fromarray(np.linspace(0, 1, 64 * 64, dtype=np.float32).reshape(64, 64))
    outcome = process_image(encode(img, "TIFF"), ImageRules())
    assert outcome.reason == "unsupported_image_mode"
    assert (outcome.orig_width, outcome.orig_height) == (64, 64)


# ----------------------------------------------------------------------------- orientation


def rotated_jpeg(size, orientation: int, marker=(0, 0, 6, 6)) -> bytes:
    img = Image.new("RGB", size, (0, 0, 0))
    ImageDraw.Draw(img).rectangle(marker, fill=(255, 255, 255))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", quality=95, exif=exif.tobytes())


def test_exif_orientation_6():
    outcome = process_image(rotated_jpeg((40, 20), 6), EXACT)
    arr = pixels(outcome)
    assert (outcome.width, outcome.height) == (20, 40)
    assert (outcome.orig_width, outcome.orig_height) == (20, 40)
    # Stored top-left is displayed top-right after a quarter turn clockwise.
    assert arr[2, 17].min() > 200
    assert arr[2, 2].max() < 60 and arr[37, 17].max() < 60


def test_exif_orientation_with_draft_and_resize():
    # Large enough to be drafted at 1/4 for a 64 px short side; sizes not multiples of 8.
    data = rotated_jpeg((803, 401), 6, marker=(0, 0, 80, 80))
    outcome = process_image(data, ImageRules(resize_mode="keep_ratio", image_size=64, output_format="png"))
    arr = pixels(outcome)
    assert (outcome.orig_width, outcome.orig_height) == (401, 803)
    assert (outcome.width, outcome.height) == (64, 128)
    assert arr[3, 60].min() > 200 and arr[3, 3].max() < 60


@pytest.mark.parametrize("fmt", ["TIFF", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_each_orientation_is_applied_once_in_each_lossless_format(fmt, orientation):
    """Pillow 13 turns a TIFF itself as it opens and loads it (and reports the turned size):
    the picture is released as displayed, not turned twice."""
    stored = np.zeros((24, 40, 3), np.uint8)
    stored[:8, :12] = (255, 0, 0)
    stored[16:, 30:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = orientation
    extra = {"tiffinfo": {0x0112: orientation}} if fmt == "TIFF" else {"exif": exif.tobytes()}
    if fmt == "WEBP":
        extra["lossless"] = True
    data = encode(Image.fromarray(stored), fmt, **extra)
    method = decoders.TRANSPOSE.get(orientation)
    shown = np.asarray(Image.fromarray(stored).transpose(method)) if method is not None else stored
    for skip in (False, True):
        outcome = process_image(data, EXACT.model_copy(update={"skip_reencode": skip}))
        assert (outcome.orig_width, outcome.orig_height) == (shown.shape[1], shown.shape[0])
        assert np.array_equal(pixels(outcome), shown), (fmt, orientation, skip)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_draft_box_follows_the_transpose(orientation):
    # A 10x6 image whose first 7x4 pixels are the "picture"; the rest is DCT padding.
    arr = np.zeros((6, 10), np.uint8)
    arr[:4, :7] = 255
    img = Image.fromarray(arr)
    method = decoders.TRANSPOSE.get(orientation)
    moved = img.transpose(method) if method is not None else img
    x0, y0, x1, y1 = (int(v) for v in decoders.box_after((0, 0, 7, 4), img.size, orientation))
    out = np.asarray(moved)
    assert (out[y0:y1, x0:x1] == 255).all()
    assert out.sum() == 255 * 28


def test_large_jpeg_is_drafted_only_when_scaled_down(monkeypatch):
    from PIL import JpegImagePlugin

    scales = []
    real = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        result = real(self, mode, size)
        scales.append(self.decoderconfig[0] if result else 1)
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    data = encode(scene(4, (1203, 901)), "JPEG")
    assert process_image(data, ImageRules(resize_mode="center_crop", image_size=256)).reason is None
    assert scales == [2]  # 901 // 4 < 256 <= 901 // 2
    assert process_image(data, ImageRules(resize_mode="border", image_size=150)).reason is None
    assert scales[-1] == 8  # the long side decides in border mode: 1203 // 8 = 150
    scales.clear()
    for rules in (ImageRules(), ImageRules(resize_mode="keep_ratio", image_size=600)):
        assert process_image(data, rules).reason is None
    assert scales == []


def test_draft_matches_full_decode():
    data = encode(scene(4, (1203, 901)), "JPEG", quality=90)
    rules = ImageRules(resize_mode="center_crop", image_size=128, output_format="png")
    drafted = pixels(process_image(data, rules))
    try:
        decoders.JPEG_DRAFT = False
        full = pixels(process_image(data, rules))
    finally:
        decoders.JPEG_DRAFT = True
    assert drafted.shape == full.shape == (128, 128, 3)
    assert np.abs(drafted - full).mean() < 3


# ----------------------------------------------------------------------------- frames


def two_frames(fmt: str) -> bytes:
    frames = [Image.new("RGB", (64, 64), c) for c in ((255, 0, 0), (0, 0, 255))]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_animated_first_frame_or_reject(fmt):
    data = two_frames(fmt)
    kept = process_image(data, ImageRules(animated="first_frame", output_format="png"))
    assert np.abs(pixels(kept).mean(axis=(0, 1)) - (255, 0, 0)).max() < 8
    assert process_image(data, ImageRules(animated="reject")).reason == "animated_image"


def test_mpo_is_not_animation():
    frames = [scene(5, (128, 96)), scene(6, (128, 96))]
    data = encode(frames[0], "MPO", save_all=True, append_images=frames[1:])
    with Image.open(io.BytesIO(data)) as check:
        assert check.format == "MPO" and check.n_frames == 2
    assert process_image(data, ImageRules(animated="reject")).reason is None


# ----------------------------------------------------------------------------- rules


def test_one_pixel_is_too_small():
    outcome = process_image(encode(Image.new("RGB", (1, 1)), "PNG"), ImageRules())
    assert (outcome.reason, outcome.orig_width, outcome.orig_height) == ("image_too_small", 1, 1)


def test_extreme_aspect_ratio():
    data = encode(Image.new("RGB", (1000, 10), (1, 2, 3)), "PNG")
    assert process_image(data, ImageRules(min_side=10)).reason == "aspect_ratio"
    assert process_image(data, ImageRules(min_side=10, max_aspect_ratio=100.0)).reason is None


def test_rejected_decodable_image_still_gets_a_thumbnail():
    data = encode(Image.new("RGB", (1000, 10), (1, 2, 3)), "PNG")
    outcome = process_image(data, ImageRules(min_side=10), thumbnail=True)
    assert outcome.reason == "aspect_ratio"
    with Image.open(io.BytesIO(outcome.thumbnail)) as thumb:
        assert thumb.format == "JPEG" and thumb.size == (96, 1)


# ----------------------------------------------------------------------------- output


def test_polyglot_payload_is_dropped():
    payload = io.BytesIO()
    with zipfile.ZipFile(payload, "w") as zf:
        zf.writestr("evil.sh", "echo pwned\n" * 20)
    data = encode(scene(7, (200, 150)), "JPEG") + payload.getvalue()
    assert b"PK\x03\x04" in data
    outcome = process_image(data, ImageRules())
    assert outcome.reason is None and outcome.ext == "jpg"
    assert b"PK\x03\x04" not in outcome.data and b"pwned" not in outcome.data


def test_metadata_is_stripped():
    exif = Image.Exif()
    exif[0x010E] = "secret description"
    data = encode(scene(8, (200, 150)), "JPEG", exif=exif.tobytes(), icc_profile=b"fake-icc" * 10)
    for fmt in ("jpeg", "png", "webp"):
        outcome = process_image(data, ImageRules(output_format=fmt))
        assert b"secret" not in outcome.data and b"fake-icc" not in outcome.data
        with Image.open(io.BytesIO(outcome.data)) as out:
            assert out.format.lower() == fmt and "exif" not in out.info and "icc_profile" not in out.info


@pytest.mark.parametrize(
    ("mode", "size", "expected"),
    [
        ("no", (300, 200), (300, 200)),
        ("keep_ratio", (300, 200), (150, 100)),  # the SHORT side becomes image_size
        ("keep_ratio", (200, 300), (100, 150)),
        ("center_crop", (300, 200), (100, 100)),
        ("border", (300, 200), (100, 100)),
        ("keep_ratio", (50, 40), (125, 100)),  # small images are scaled up, as img2dataset does
        ("border", (1203, 901), (100, 100)),  # drafted
    ],
)
def test_resize_modes(mode, size, expected):
    data = encode(scene(9, size), "JPEG")
    outcome = process_image(data, ImageRules(min_side=8, resize_mode=mode, image_size=100))
    assert outcome.reason is None
    assert (outcome.width, outcome.height) == expected
    assert (outcome.orig_width, outcome.orig_height) == size
    with Image.open(io.BytesIO(outcome.data)) as out:
        assert out.size == expected


def test_border_pads_with_white_and_centre_crop_keeps_the_centre():
    img = Image.new("RGB", (300, 200), (0, 0, 0))
    ImageDraw.Draw(img).rectangle((140, 90, 159, 109), fill=(255, 0, 0))
    data = encode(img, "PNG")
    border = pixels(process_image(data, ImageRules(resize_mode="border", image_size=90, output_format="png")))
    assert (border[:15] == 255).all() and (border[-15:] == 255).all()  # 300x200 -> 90x60, 15 px bands
    assert border[45, 45, 0] > 200 and border[45, 45, 1] < 60
    crop = pixels(process_image(data, ImageRules(resize_mode="center_crop", image_size=100, output_format="png")))
    assert crop.shape == (100, 100, 3)
    assert crop[50, 50, 0] > 200 and crop[50, 50, 1] < 60 and crop[5, 5].max() < 10


# ----------------------------------------------------------------------------- hashes


def test_phash_survives_resize_and_reencode_but_tells_pictures_apart():
    scores = []
    for seed in range(3):
        original = scene(10 + seed)
        half = original.resize((320, 240), Image.Resampling.LANCZOS)
        a = process_image(encode(original, "PNG"), ImageRules()).phash
        b = process_image(encode(half, "JPEG", quality=75), ImageRules()).phash
        assert hamming(a, b) <= 4, seed
        scores.append(a)
    assert min(hamming(x, y) for i, x in enumerate(scores) for y in scores[i + 1 :]) > 16


@pytest.mark.parametrize("mode", ["keep_ratio", "center_crop", "border"])
def test_phash_barely_depends_on_the_resize_mode(mode):
    data = encode(scene(30, (1203, 901)), "JPEG", quality=90)
    plain = process_image(data, ImageRules()).phash
    resized = process_image(data, ImageRules(resize_mode=mode, image_size=96)).phash
    tiny = process_image(data, ImageRules(resize_mode=mode, image_size=16)).phash  # too small: decoded image used
    assert hamming(plain, resized) <= 4
    assert hamming(plain, tiny) <= 4


def test_phash_is_64_bits_and_hamming_counts_bits():
    value = process_image(encode(scene(20), "PNG"), ImageRules()).phash
    assert 0 <= value < 2**64
    for seed in range(20, 25):  # the DC coefficient (far above the AC median) is the top bit
        assert process_image(encode(scene(seed), "PNG"), ImageRules()).phash >> 63 == 1
    assert hamming(value, value) == 0
    assert hamming(0, 2**64 - 1) == 64
    assert hamming(0b1011, 0b0001) == 2


def test_pixel_sha256_is_the_pixels_not_the_file():
    img = scene(21, (160, 120))
    png = process_image(encode(img, "PNG"), ImageRules())
    bmp = process_image(encode(img, "BMP"), ImageRules())
    assert png.src_format == "png" and bmp.src_format == "bmp"
    assert png.pixel_sha256 == bmp.pixel_sha256
    changed = img.copy()
    changed.putpixel((0, 0), tuple(255 - v for v in img.getpixel((0, 0))))
    assert process_image(encode(changed, "PNG"), ImageRules()).pixel_sha256 != png.pixel_sha256


def test_pixel_sha256_includes_the_shape():
    flat = np.random.default_rng(0).integers(0, 256, size=100 * 50 * 3, dtype=np.uint8)
    wide = encode(Image.fromarray(flat.reshape(50, 100, 3)), "PNG")
    tall = encode(Image.fromarray(flat.reshape(100, 50, 3)), "PNG")
    assert process_image(wide, LOOSE).pixel_sha256 != process_image(tall, LOOSE).pixel_sha256


def test_pixel_sha256_ignores_exif_rotation_and_appended_bytes():
    img = scene(22, (200, 120))
    upright = encode(img.transpose(Image.Transpose.ROTATE_270), "PNG")
    exif = Image.Exif()
    exif[0x0112] = 6
    tagged = encode(img, "PNG", exif=exif.tobytes())
    assert process_image(upright, ImageRules()).pixel_sha256 == process_image(tagged, ImageRules()).pixel_sha256
    jpeg = encode(img, "JPEG")
    assert process_image(jpeg, ImageRules()).pixel_sha256 == process_image(jpeg + b"tail", ImageRules()).pixel_sha256


def test_accepted_outcome_fields():
    outcome = process_image(
        encode(scene(23, (200, 150)), "WEBP"), ImageRules(resize_mode="center_crop", image_size=64), thumbnail=True
    )
    assert outcome.ok and outcome.reason is None and outcome.detail is None
    assert (outcome.ext, outcome.src_format, outcome.width, outcome.height) == ("jpg", "webp", 64, 64)
    assert len(outcome.pixel_sha256) == 64
    with Image.open(io.BytesIO(outcome.thumbnail)) as thumb:
        # From the pixels as decoded: libwebp decoded this lossy WebP straight to 85 x 64.
        assert thumb.size == (85, 64)
    # The thumbnail changes nothing else, the pixel key included.
    alone = process_image(encode(scene(23, (200, 150)), "WEBP"), ImageRules(resize_mode="center_crop", image_size=64))
    assert dataclasses.replace(outcome, thumbnail=None) == alone
    png = process_image(
        encode(scene(23, (200, 150)), "PNG"), ImageRules(resize_mode="center_crop", image_size=64), thumbnail=True
    )
    with Image.open(io.BytesIO(png.thumbnail)) as thumb:
        assert thumb.size == (96, 72)  # decoded at full size


# ----------------------------------------------------------------------------- hostile bytes


def _png_chunk(tag: bytes, body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + tag + body + zlib.crc32(tag + body).to_bytes(4, "big")


def tiny_segments(fmt: str, count: int) -> bytes:
    """A small picture with ``count`` empty segments before its pixels, as its format allows."""
    data = encode(scene(40, (48, 40)), fmt.split()[0].upper())
    if fmt == "jpeg":
        return data[:2] + b"\xff\xfe\x00\x02" * count + data[2:]  # comments
    if fmt == "jpeg fill":
        return data[:2] + b"\xff" * count + data[2:]  # fill bytes before the first marker
    if fmt == "png":
        at = data.index(b"IDAT") - 4
        return data[:at] + _png_chunk(b"prIv", b"") * count + data[at:]
    if fmt == "webp":  # an extended file: VP8X, then the empty chunks, then the bitstream
        size = (47).to_bytes(3, "little") + (39).to_bytes(3, "little")
        body = b"WEBP" + b"VP8X" + (10).to_bytes(4, "little") + b"\0" * 4 + size + b"ZZZZ\0\0\0\0" * count + data[12:]
        return b"RIFF" + len(body).to_bytes(4, "little") + body
    table = 3 << ((data[10] & 7) + 1) if data[10] & 0x80 else 0  # gif: a comment of 1-byte sub-blocks
    return data[: 13 + table] + b"\x21\xfe" + b"\x01c" * count + b"\x00" + data[13 + table :]


@pytest.mark.parametrize("fmt", ["jpeg", "jpeg fill", "png", "webp", "gif"])
def test_a_file_of_too_many_tiny_segments_is_refused_before_any_parser_walks_it(fmt):
    """Pillow's parsers walk segments in Python: millions of empty ones would take seconds each
    file. One more than MAX_SEGMENTS is refused; a file with fewer is decoded."""
    rules = ImageRules(min_side=1, allowed_formats=("jpeg", "png", "webp", "gif"))
    refused = process_image(tiny_segments(fmt, decoders.MAX_SEGMENTS + 1), rules)
    assert refused.reason == "undecodable_image"
    assert refused.detail.startswith(f"more than {decoders.MAX_SEGMENTS} segments")
    decoded = process_image(tiny_segments(fmt, 1000), rules)
    assert decoded.reason is None and (decoded.width, decoded.height) == (48, 40)


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning", "ignore:Tag data larger:UserWarning")
def test_mutated_files_only_ever_return_verdicts():
    """Bytes flipped, cut and inserted in every format: a verdict each time, never an exception."""
    base = scene(40, (72, 64))
    exif = Image.Exif()
    exif[0x0112] = 6
    seeds = [
        encode(base, "JPEG", exif=exif.tobytes()),
        encode(base, "JPEG", progressive=True),
        encode(base, "PNG"),
        encode(base.convert("P"), "PNG", transparency=3),
        two_frames("GIF"),
        two_frames("WEBP"),
        encode(base, "BMP"),
        encode(base, "TIFF", compression="tiff_deflate"),
        encode(base.convert("CMYK"), "JPEG"),
    ]
    rules = (
        ImageRules(min_side=1),
        ImageRules(min_side=1, resize_mode="center_crop", image_size=48, animated="reject"),
    )
    rng = np.random.default_rng(0)
    seen = set()
    for case in range(400):
        data = bytearray(seeds[case % len(seeds)])
        for _ in range(int(rng.choice([1, 3, 12]))):
            at = int(rng.integers(0, len(data)))
            if rng.random() < 0.7:
                data[at] = int(rng.integers(0, 256))
            else:
                del data[at : at + int(rng.integers(1, 48))]
        outcome = process_image(bytes(data), rules[case % 2], thumbnail=case % 5 == 0)
        assert outcome.reason is None or outcome.reason in images.REASONS, outcome
        seen.add(outcome.reason)
    assert {None, "undecodable_image", "truncated_image"} <= seen


def test_reasons_are_registered():
    from tasks.formats.reasons import REASONS, REJECTED

    missing = [r for r in images.REASONS if r not in REASONS]
    if missing:
        pytest.skip(f"tasks/formats/reasons.py does not list {missing} yet")
    assert all(REASONS[r][0] == REJECTED for r in images.REASONS)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_an_image_over_pillows_warning_size_is_noted_in_its_row_not_warned(monkeypatch, fmt):
    # Pillow warns for an image over Image.MAX_IMAGE_PIXELS (and under twice it); the caps decide,
    # and the accepted image's detail says it was that large: no warning reaches a terminal.
    import warnings

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    buf = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 30, 30)).save(buf, fmt)
    with warnings.catch_warnings(record=True) as seen:
        got = process_image(buf.getvalue(), ImageRules(min_side=8))
    assert got.reason is None and got.width == 40
    assert got.detail == (
        "40x40 = 1600 px: over Pillow's decompression-bomb warning (1000 px, Image.MAX_IMAGE_PIXELS), "
        "within validate.image.max_pixels 50000000"
    )
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]
    # Within the warning size: no note.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
    assert process_image(buf.getvalue(), ImageRules(min_side=8)).detail is None
