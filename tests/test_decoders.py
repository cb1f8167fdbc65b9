"""tasks.policies.decoders through process_image: still WebP and plain PNG through libwebp and libpng, with the same verdicts and pixels as Pillow's path; lossy WebPs scaled while decoding."""

from __future__ import annotations

import ctypes
import dataclasses
import io
import struct
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image, ImageDraw, PngImagePlugin, WebPImagePlugin
from test_images import EXACT, encode, pixels, scene, two_frames

from tasks.formats.recipe_download import ImageRules
from tasks.policies import decoders, libwebp
from tasks.policies.images import process_image

RULES = (
    ImageRules(resize_mode="border", image_size=256),  # the benchmark's setting (img2dataset's defaults)
    ImageRules(min_side=1, max_aspect_ratio=1000.0, output_format="png"),  # no resize, lossless output
    ImageRules(min_side=1, resize_mode="center_crop", image_size=48, animated="reject"),
)


def old_path(data: bytes, rules: ImageRules, **kw):
    """process_image with every WebP and PNG decoded by Pillow, as before."""
    decoders.STILL_WEBP = decoders.PLAIN_PNG = False
    try:
        return process_image(data, rules, **kw)
    finally:
        decoders.STILL_WEBP = decoders.PLAIN_PNG = True


def exif_bytes(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def rgba_picture() -> Image.Image:
    arr = np.zeros((64, 64, 4), np.uint8)
    arr[:, :16] = (12, 200, 7, 0)  # garbage colour, fully transparent
    arr[:, 16:32] = (0, 0, 0, 0)
    arr[:, 32:48] = (255, 0, 0, 255)
    arr[:, 48:] = (0, 0, 0, 128)  # half-transparent black
    return Image.fromarray(arr)


def still_webps() -> dict[str, bytes]:
    photo = scene(50, (320, 240))
    return {
        "lossy": encode(photo, "WEBP", quality=80),
        "lossless": encode(photo, "WEBP", lossless=True),
        "lossy-alpha": encode(rgba_picture(), "WEBP", quality=90),
        "lossless-alpha": encode(rgba_picture(), "WEBP", lossless=True),
        "exif-6": encode(photo, "WEBP", lossless=True, exif=exif_bytes(6)),
        "grey": encode(photo.convert("L"), "WEBP", quality=80),
        "large": encode(scene(51, (1203, 901)), "WEBP", quality=75),
        "tiny": encode(scene(52, (40, 3)), "WEBP", lossless=True),  # rejected by the header rules
    }


def png_chunk(tag: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))


def with_chunk(png: bytes, chunk: bytes) -> bytes:
    """``chunk`` inserted right after IHDR."""
    return png[:33] + chunk + png[33:]


def plain_pngs() -> dict[str, bytes]:
    photo = scene(54, (320, 240))
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", "a painter")
    info.add(b"gAMA", (45455).to_bytes(4, "big"))
    info.add(b"sRGB", b"\0")
    return {
        "rgb": encode(photo, "PNG"),
        "rgba": encode(rgba_picture(), "PNG"),
        "grey": encode(photo.convert("L"), "PNG"),
        "grey-alpha": encode(rgba_picture().convert("LA"), "PNG"),
        "ancillary": encode(photo, "PNG", pnginfo=info, dpi=(96, 96)),
        "unknown-ancillary": with_chunk(encode(photo, "PNG"), png_chunk(b"iDOT", bytes(28))),
        "large": encode(scene(55, (1000, 750)), "PNG", compress_level=1),
        "tiny": encode(scene(56, (40, 3)), "PNG"),  # rejected by the header rules
    }


def pillow_pngs() -> dict[str, bytes]:
    """PNGs whose chunks Pillow reads beyond the header: they stay with Pillow."""
    photo = scene(57, (120, 90))
    xmp = PngImagePlugin.PngInfo()
    xmp.add_text("XML:com.adobe.xmp", '<x tiff:Orientation="6"/>')
    return {
        "palette": encode(photo.convert("P"), "PNG"),
        "trns": encode(photo, "PNG", transparency=(0, 0, 0)),
        "16-bit": encode(Image.fromarray(np.full((30, 40), 40000, np.uint16)), "PNG"),
        "exif": encode(photo, "PNG", exif=exif_bytes(6)),
        "icc": encode(photo, "PNG", icc_profile=b"not really a profile"),
        "xmp-text": encode(photo, "PNG", pnginfo=xmp),
        "apng": two_frames("PNG"),
    }


@pytest.fixture
def unscaled(monkeypatch):
    """Every still WebP decoded at full size, so the new path must match Pillow's bit for bit."""
    monkeypatch.setattr(decoders, "WEBP_SCALED", False)


@pytest.fixture
def spies(monkeypatch):
    """Counts calls to libwebp's simple decoder and scaled decodes; Pillow's animation decoder fails the test unless allowed."""
    calls = {"simple": 0, "scaled": 0, "anim": 0, "libpng": 0}
    real_simple, real_anim, real_png = decoders.webp_decode, WebPImagePlugin._webp.WebPAnimDecoder, decoders.png_decode
    real_scaled = libwebp.decode_scaled

    def simple(data, *a, **kw):
        calls["simple"] += 1
        return real_simple(data, *a, **kw)

    def scaled(data, canvas, size):
        out = real_scaled(data, canvas, size)
        calls["scaled"] += out is not None
        return out

    def anim(data):
        calls["anim"] += 1
        if not calls.get("anim_allowed"):
            pytest.fail("Pillow's animation decoder was built")
        return real_anim(data)

    def libpng(data, *a, **kw):
        calls["libpng"] += 1
        return real_png(data, *a, **kw)

    monkeypatch.setattr(decoders, "webp_decode", simple)
    monkeypatch.setattr(libwebp, "decode_scaled", scaled)
    monkeypatch.setattr(decoders, "png_decode", libpng)
    monkeypatch.setattr(WebPImagePlugin._webp, "WebPAnimDecoder", anim)
    return calls


def vp8x_file(width: int, height: int, flags: int = 0) -> bytes:
    """A VP8X header claiming a ``width`` x ``height`` canvas, around a real 1x1 VP8 frame."""
    small = encode(Image.new("RGB", (1, 1), (9, 9, 9)), "WEBP")
    frame = small[12:]  # the VP8 chunk
    vp8x = (
        b"VP8X"
        + struct.pack("<I", 10)
        + bytes([flags, 0, 0, 0])
        + (width - 1).to_bytes(3, "little")
        + (height - 1).to_bytes(3, "little")
    )
    body = b"WEBP" + vp8x + frame
    return b"RIFF" + struct.pack("<I", len(body)) + body


# ----------------------------------------------------------------------------- which decoder


def test_still_webp_never_builds_the_animation_decoder(spies):
    for name, data in still_webps().items():
        outcome = process_image(data, RULES[0])
        assert outcome.src_format == "webp", name
        assert outcome.reason == ("image_too_small" if name == "tiny" else None), (name, outcome.detail)
    assert spies["anim"] == 0
    # The tiny one is judged on its header; lossy, grey and large are lossy, opaque and over
    # 256 px, so libwebp decodes them straight to 256 px; the rest at full size.
    assert (spies["scaled"], spies["simple"]) == (3, len(still_webps()) - 4)


def test_animated_webp_goes_through_pillow(spies):
    spies["anim_allowed"] = True
    data = two_frames("WEBP")
    assert data[12:16] == b"VP8X" and data[20] & 0x02  # the animation flag the sniffer reads
    kept = process_image(data, ImageRules(animated="first_frame", output_format="png"))
    assert np.abs(pixels(kept).mean(axis=(0, 1)) - (255, 0, 0)).max() < 8
    assert process_image(data, ImageRules(animated="reject")).reason == "animated_image"
    assert spies["simple"] == 0 and spies["anim"] >= 2


def test_plain_png_decoded_by_libpng_the_rest_by_pillow(spies):
    for name, data in plain_pngs().items():
        assert decoders.plain_png(data) is not None, name
        assert process_image(data, RULES[1]).reason is None, name
    assert spies["libpng"] == len(plain_pngs())
    for name, data in pillow_pngs().items():
        assert decoders.plain_png(data) is None, name
        assert process_image(data, RULES[1]).reason is None, name
    assert spies["libpng"] == len(plain_pngs())


# ----------------------------------------------------------------------------- same results as before


@pytest.mark.parametrize("rules", RULES, ids=["border-256", "no-resize-png", "crop-48-reject"])
def test_plain_png_outcomes_equal_pillows(rules):
    for name, data in {**plain_pngs(), **pillow_pngs()}.items():
        new = process_image(data, rules, thumbnail=True)
        old = old_path(data, rules, thumbnail=True)
        assert dataclasses.asdict(new) == dataclasses.asdict(old), name


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(
            lambda png: png[:-16] + bytes(4) + png[-12:], id="idat-crc"
        ),  # libpng refuses, Pillow never checks it
        pytest.param(lambda png: with_chunk(png, png_chunk(b"ABCD", b"x")), id="unknown-critical-chunk"),
        pytest.param(lambda png: with_chunk(png, png_chunk(b"gAMA", b"\0\1")), id="short-gAMA"),
        pytest.param(lambda png: with_chunk(png, png_chunk(b"pHYs", bytes(9))[:-1] + b"\0"), id="bad-ancillary-crc"),
        pytest.param(lambda png: png[: len(png) // 2] + png[-12:], id="cut-idat"),
    ],
)
def test_broken_png_verdicts_are_pillows(damage):
    """Whatever libpng refuses, or a check only Pillow makes, ends with Pillow's verdict and detail."""
    data = damage(encode(scene(58, (160, 120)), "PNG"))
    new, old = process_image(data, ImageRules()), old_path(data, ImageRules())
    assert dataclasses.asdict(new) == dataclasses.asdict(old)


def test_png_xmp_text_chunk_is_a_verdict_not_a_crash():
    # Pillow 13's getexif() searches a PNG's "xmp" text (a str) with a bytes pattern: TypeError.
    info = PngImagePlugin.PngInfo()
    info.add_text("xmp", '<x tiff:Orientation="6"/>')
    outcome = process_image(encode(scene(59, (120, 90)), "PNG", pnginfo=info), EXACT)
    assert outcome.reason is None and (outcome.width, outcome.height) == (120, 90)


@pytest.mark.usefixtures("unscaled")
@pytest.mark.parametrize("rules", RULES, ids=["border-256", "no-resize-png", "crop-48-reject"])
def test_still_webp_outcomes_equal_the_animation_decoders(rules):
    """Bit for bit: verdict, detail, pixel key, pHash, output bytes and thumbnail."""
    for name, data in still_webps().items():
        new = process_image(data, rules, thumbnail=True)
        old = old_path(data, rules, thumbnail=True)
        assert dataclasses.asdict(new) == dataclasses.asdict(old), name


def mutated(seeds: list[bytes], cases: int, seed: int) -> Iterator[tuple[int, bytes]]:
    """``cases`` damaged copies of the seed files (bytes overwritten and cut out), the same for the same ``seed``."""
    rng = np.random.default_rng(seed)
    for case in range(cases):
        data = bytearray(seeds[case % len(seeds)])
        for _ in range(int(rng.choice([1, 3, 12]))):
            at = int(rng.integers(0, len(data)))
            if rng.random() < 0.7:
                data[at] = int(rng.integers(0, 256))
            elif len(data) > 64:
                del data[at : at + int(rng.integers(1, 48))]
        yield case, bytes(data)


@pytest.mark.usefixtures("unscaled")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fmt", ["webp", "png"])
def test_verdicts_on_mutated_files_equal_pillows(fmt):
    """Bytes flipped and cut in still WebPs and plain PNGs: the same verdict and output as Pillow's path.

    One verdict may differ by design: a header whose canvas breaks a header rule (aspect ratio,
    min side) is rejected by that rule before any decode, where Pillow's animation decoder
    failed to build first.
    """
    seeds = list(still_webps().values() if fmt == "webp" else plain_pngs().values())[:6]
    seen = set()
    for case, data in mutated(seeds, 300, seed=1):
        rules = RULES[1 + case % 2]
        new, old = process_image(data, rules), old_path(data, rules)
        if new.reason in ("aspect_ratio", "image_too_small") and old.reason == "undecodable_image":
            continue
        assert (new.reason, new.pixel_sha256, new.data) == (old.reason, old.pixel_sha256, old.data), case
        seen.add(new.reason)
    assert {None, "undecodable_image"} <= seen


# ----------------------------------------------------------------------------- lossy WebPs scaled while decoding


def full_size(data: bytes, rules: ImageRules, **kw):
    """process_image with every still WebP decoded at full size, then resized."""
    decoders.WEBP_SCALED = False
    try:
        return process_image(data, rules, **kw)
    finally:
        decoders.WEBP_SCALED = True


def lossy_webps(size=(1203, 901)) -> dict[str, bytes]:
    photo = scene(60, size)
    return {
        "plain": encode(photo, "WEBP", quality=80),
        "exif-6": encode(photo, "WEBP", quality=80, exif=exif_bytes(6)),
        "grey": encode(photo.convert("L"), "WEBP", quality=80),
        "tall": encode(scene(61, (size[1] // 2, size[0])), "WEBP", quality=70),
    }


@pytest.mark.parametrize("rules", [RULES[0], RULES[2]], ids=["border-256", "crop-48-reject"])
def test_scaled_webp_matches_the_full_size_decode_within_a_few_levels(spies, rules):
    same = ("reason", "detail", "ext", "width", "height", "orig_width", "orig_height", "src_format")
    for name, data in lossy_webps().items():
        new, old = process_image(data, rules, thumbnail=True), full_size(data, rules, thumbnail=True)
        assert [getattr(new, f) for f in same] == [getattr(old, f) for f in same], name
        diff = np.abs(pixels(new) - pixels(old))
        assert diff.mean() < 3 and np.percentile(diff, 99) < 24, (name, diff.mean())
        assert bin(new.phash ^ old.phash).count("1") <= 8, name
        # Hashed at the size libwebp decoded to, as a drafted JPEG is.
        assert new.pixel_sha256 != old.pixel_sha256, name
    assert spies["scaled"] == len(lossy_webps())


def test_scaled_webp_keeps_its_pixel_key_across_containers():
    photo = scene(62, (900, 700))
    plain = encode(photo, "WEBP", quality=80)
    boxed = encode(photo, "WEBP", quality=80, exif=exif_bytes(1), xmp=b"<x:xmpmeta/>") + b"appended"
    assert plain[12:16] == b"VP8 " and boxed[12:16] == b"VP8X"
    a, b = process_image(plain, RULES[0]), process_image(boxed, RULES[0])
    assert a.reason is None and (a.pixel_sha256, a.data) == (b.pixel_sha256, b.data)


def test_lossless_alpha_upscaled_and_unresized_webps_are_decoded_at_full_size(spies):
    big = scene(63, (700, 500))
    translucent = big.convert("RGBA")
    translucent.putalpha(200)
    cases = {
        "lossless": (encode(big, "WEBP", lossless=True), RULES[0]),
        "alpha": (encode(translucent, "WEBP", quality=80), RULES[0]),
        "upscaled": (encode(scene(64, (200, 150)), "WEBP", quality=80), RULES[0]),
        "no-resize": (encode(big, "WEBP", quality=80), RULES[1]),
    }
    for name, (data, rules) in cases.items():
        assert process_image(data, rules).reason is None, name
    assert (spies["scaled"], spies["simple"]) == (0, len(cases))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mutated_lossy_webps_get_the_full_size_decoders_verdicts():
    """A file libwebp refuses while scaling is decoded again at full size: its verdict and detail are that decode's."""
    seen = set()
    for case, data in mutated(list(lossy_webps((400, 300)).values()), 160, seed=2):
        rules = (RULES[0], RULES[2])[case % 2]
        new, old = process_image(data, rules), full_size(data, rules)
        assert (new.reason, new.detail, new.width) == (old.reason, old.detail, old.width), case
        seen.add(new.reason)
    assert {None, "undecodable_image"} <= seen


def test_without_a_usable_libwebp_webps_are_decoded_at_full_size(monkeypatch, spies):
    monkeypatch.setattr(libwebp, "_library", lambda: None)
    data = lossy_webps((500, 400))["plain"]
    assert dataclasses.asdict(process_image(data, RULES[0])) == dataclasses.asdict(full_size(data, RULES[0]))
    assert spies["scaled"] == 0


def test_libwebp_refuses_a_config_laid_out_for_another_major_abi():
    lib = libwebp._library()
    assert lib is not None  # the wheels ship one, so scaled decoding is what the tests run
    assert lib.WebPInitDecoderConfigInternal(ctypes.byref(libwebp._Config()), libwebp._ABI) == 1
    assert lib.WebPInitDecoderConfigInternal(ctypes.byref(libwebp._Config()), libwebp._ABI + 0x100) == 0


# ----------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize("lossless", [True, False])
def test_webp_alpha_composited_on_white(lossless):
    data = encode(rgba_picture(), "WEBP", lossless=lossless, quality=100)
    with Image.open(io.BytesIO(data)) as check:
        assert check.mode == "RGBA"
    out = pixels(process_image(data, EXACT))
    tolerance = 0 if lossless else 6
    assert (out[:, 2:30] >= 255 - tolerance).all()  # transparent, whatever colour it held
    assert (np.abs(out[:, 50:62] - 127) <= 1 + tolerance).all()
    assert (np.abs(out[:, 34:46] - (255, 0, 0)) <= tolerance).all()


def test_webp_exif_orientation_applied():
    img = Image.new("RGB", (40, 20), (0, 0, 0))
    ImageDraw.Draw(img).rectangle((0, 0, 6, 6), fill=(255, 255, 255))
    data = encode(img, "WEBP", lossless=True, exif=exif_bytes(6))
    assert b"EXIF" in data
    outcome = process_image(data, EXACT)
    arr = pixels(outcome)
    assert (outcome.width, outcome.height, outcome.orig_width, outcome.orig_height) == (20, 40, 20, 40)
    assert arr[2, 17].min() > 200  # stored top-left is displayed top-right after a quarter turn
    assert arr[2, 2].max() < 60 and arr[37, 17].max() < 60
    # The same picture stored upright as a PNG has the same exact-duplicate key.
    upright = encode(img.transpose(Image.Transpose.ROTATE_270), "PNG")
    assert outcome.pixel_sha256 == process_image(upright, EXACT).pixel_sha256


# ----------------------------------------------------------------------------- hostile WebPs


def test_truncated_webp():
    data = encode(scene(53, (320, 240)), "WEBP")
    cut = data[: len(data) // 2]
    assert process_image(cut, ImageRules()).reason == "truncated_image"  # RIFF declares more
    # The RIFF size patched to fit: the decoder itself finds the frame short.
    patched = cut[:4] + struct.pack("<I", len(cut) - 8) + cut[8:]
    outcome = process_image(patched, ImageRules())
    assert outcome.reason == "undecodable_image" and "Webp" in outcome.detail
    assert old_path(patched, ImageRules()).reason == "undecodable_image"


def test_webp_without_an_image_chunk_is_undecodable(spies):
    body = b"WEBP" + b"JUNK" + struct.pack("<I", 8) + bytes(8)
    outcome = process_image(b"RIFF" + struct.pack("<I", len(body)) + body, ImageRules(min_bytes=0))
    assert outcome.reason == "undecodable_image" and "VP8X" in outcome.detail
    assert (spies["simple"], spies["anim"]) == (0, 0)


@pytest.mark.parametrize("flags", [0x00, 0x02, 0x10], ids=["still", "animated", "alpha"])
def test_webp_bomb_never_decoded(spies, flags):
    # 16384 x 16384 = 268 Mpx: over Pillow's own guard, so over any cap a recipe can set.
    data = vp8x_file(16384, 16384, flags)
    assert len(data) < 100
    for rules in (ImageRules(), ImageRules(max_pixels=10**11)):
        outcome = process_image(data, rules)
        assert outcome.reason == "decompression_bomb", outcome
    # 60 Mpx: above the default max_pixels (50 M), below Pillow's guard.
    outcome = process_image(vp8x_file(10_000, 6_000, flags), ImageRules())
    assert outcome.reason == "decompression_bomb" and "max_pixels" in outcome.detail
    assert (spies["simple"], spies["anim"]) == (0, 0)  # neither decoder was ever built


def test_webp_header_size_disagreeing_with_the_frame_is_undecodable():
    # A still VP8X whose canvas (300 x 200) is not its 1 x 1 frame: libwebp refuses it.
    outcome = process_image(vp8x_file(300, 200), ImageRules())
    assert outcome.reason == "undecodable_image"
    # Nor is the 1 x 1 frame scaled up to the canvas's resize target by the scaled decode.
    assert process_image(vp8x_file(300, 200), RULES[0]).reason == "undecodable_image"
    assert old_path(vp8x_file(300, 200), ImageRules()).reason == "undecodable_image"
