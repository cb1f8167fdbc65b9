"""tasks.policies.metadata: metadata removed from JPEG, PNG and WebP bytes with the pixels untouched, on files built here."""

from __future__ import annotations

import io
import re
import zlib

import imagecodecs
import numpy as np
import pytest
from PIL import Image, ImageCms, PngImagePlugin

from tasks.formats.recipe_download import ImageRules
from tasks.policies.images import process_image
from tasks.policies.metadata import (
    KEEPABLE,
    MAX_SEGMENTS,
    check_keep,
    exif_kept,
    metadata_kinds,
    strip_metadata,
)

# Strings planted in each kind of metadata; none may survive a strip.
GPS_MARK = b"GPS-SECRET-DATUM"
SERIAL_MARK = b"SERIAL-SECRET-4711"
MAKER_MARK = b"MAKER-SECRET"
XMP_MARK = b"XMP-SECRET"
IPTC_MARK = b"IPTC-SECRET"
COMMENT_MARK = b"COMMENT-SECRET"
TEXT_MARK = b"TEXT-SECRET"
TRAILING_MARK = b"TRAILING-SECRET"
ARTIST_MARK = b"ARTIST-SECRET"
SECRETS = (GPS_MARK, SERIAL_MARK, MAKER_MARK, XMP_MARK, IPTC_MARK, COMMENT_MARK, TEXT_MARK, TRAILING_MARK, ARTIST_MARK)
COPYRIGHT = "(c) 2024 Kept Owner"
XMP = b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description exif:GPSLatitude="52,22N">XMP-SECRET</rdf:Description></x:xmpmeta>'
ICC = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
FORMATS = ("jpeg", "png", "webp")
PIL_NAME = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}


def photo(seed: int = 0, size: tuple[int, int] = (96, 64), mode: str = "RGB") -> Image.Image:
    """A gradient with grain: smooth and noisy areas, as photos have."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) * 127 // max(w + h - 2, 1)], -1)
    arr = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr)
    if mode == "RGBA":
        img.putalpha(Image.fromarray(((xx * 3 + yy) % 256).astype(np.uint8)))
    return img if mode in ("RGB", "RGBA") else img.convert(mode)


def camera_exif(orientation: int = 1) -> Image.Exif:
    """EXIF as a phone writes it: descriptive IFD0 fields, orientation, a GPS IFD, a serial number and a maker note."""
    exif = Image.Exif()
    exif[0x8298] = COPYRIGHT  # Copyright
    exif[0x013B] = ARTIST_MARK.decode()  # Artist
    exif[0x010F] = "PhoneMaker"  # Make
    exif[0x0131] = "CameraApp 1.0"  # Software
    exif[0x0112] = orientation
    gps = exif.get_ifd(0x8825)
    gps.update({1: "N", 2: (52.0, 22.0, 3.5), 3: "E", 4: (4.0, 53.0, 1.2), 0x12: GPS_MARK.decode()})
    sub = exif.get_ifd(0x8769)
    sub.update({0xA431: SERIAL_MARK.decode(), 0x927C: MAKER_MARK + b"\x00" * 16, 0x9003: "2024:01:02 03:04:05"})
    return exif


def save(img: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, PIL_NAME[fmt], **kw)
    return out.getvalue()


def jpeg_segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


def iptc_app13() -> bytes:
    record = b"\x1c\x02\x50" + len(IPTC_MARK).to_bytes(2, "big") + IPTC_MARK  # 2:80 By-line
    resource = b"8BIM\x04\x04\x00\x00" + len(record).to_bytes(4, "big") + record
    return jpeg_segment(0xED, b"Photoshop 3.0\x00" + resource)


def after_soi(data: bytes, segment: bytes) -> bytes:
    return data[:2] + segment + data[2:]


def png_chunk(tag: bytes, body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + tag + body + zlib.crc32(tag + body).to_bytes(4, "big")


def riff_chunk(tag: bytes, body: bytes) -> bytes:
    return tag + len(body).to_bytes(4, "little") + body + b"\x00" * (len(body) & 1)


def with_riff_chunk(data: bytes, chunk: bytes) -> bytes:
    """A RIFF file with ``chunk`` appended inside its payload and the RIFF size fixed."""
    body = data[12:] + chunk
    return b"RIFF" + (4 + len(body)).to_bytes(4, "little") + b"WEBP" + body


def vp8x_webp(img: Image.Image | None = None) -> bytes:
    """An extended-format WebP (VP8X) with no EXIF chunk: the XMP makes Pillow write VP8X."""
    return save(img if img is not None else photo(), "webp", xmp=b"<x/>")


def full_jpeg() -> bytes:
    data = save(photo(1), "jpeg", quality=90, exif=camera_exif(), xmp=XMP, comment=COMMENT_MARK, icc_profile=ICC)
    return after_soi(data, iptc_app13()) + b"PK\x03\x04" + TRAILING_MARK


def full_png(img: Image.Image | None = None) -> bytes:
    info = PngImagePlugin.PngInfo()
    info.add_text("Author", TEXT_MARK.decode())
    info.add_text("Comment", COMMENT_MARK.decode(), zip=True)  # zTXt
    info.add_itxt("XML:com.adobe.xmp", XMP.decode())
    info.add(b"tIME", b"\x07\xe8\x01\x02\x03\x04\x05")
    info.add(b"gAMA", (45455).to_bytes(4, "big"))
    info.add(b"prVt", b"PRIVATE " + TEXT_MARK)  # a private ancillary chunk
    img = img if img is not None else photo(2)
    return save(img, "png", pnginfo=info, exif=camera_exif(), icc_profile=ICC, dpi=(300, 300)) + TRAILING_MARK


def full_webp(img: Image.Image | None = None, **kw) -> bytes:
    img = img if img is not None else photo(3)
    data = save(img, "webp", exif=camera_exif(), xmp=XMP, icc_profile=ICC, **kw)
    return with_riff_chunk(data, riff_chunk(b"pRVt", TEXT_MARK)) + TRAILING_MARK


def alph_after_bitstream() -> bytes:
    """An extended WebP (VP8X, no flags) whose VP8 bitstream is followed by an ALPH chunk,
    which no decoder reads: a place to hide data."""
    simple = save(photo(14), "webp", quality=80)  # RIFF, WEBP, then its VP8 chunk
    canvas = (96 - 1).to_bytes(3, "little") + (64 - 1).to_bytes(3, "little")
    body = riff_chunk(b"VP8X", b"\x00" * 4 + canvas) + simple[12:] + riff_chunk(b"ALPH", b"\x00" + TEXT_MARK)
    return b"RIFF" + (4 + len(body)).to_bytes(4, "little") + b"WEBP" + body


def samples() -> dict[str, tuple[str, bytes]]:
    """Name -> (format, bytes): each carrying every kind of metadata its format can hold."""
    jpeg = full_jpeg()
    progressive = save(photo(4, (160, 120)), "jpeg", progressive=True, exif=camera_exif(), comment=COMMENT_MARK)
    second_scan = progressive.index(b"\xff\xda", progressive.index(b"\xff\xda") + 2)
    between_scans = jpeg_segment(0xE1, b"http://ns.adobe.com/xap/1.0/\x00" + XMP) + jpeg_segment(0xFE, COMMENT_MARK)
    progressive = progressive[:second_scan] + between_scans + progressive[second_scan:]
    cmyk = after_soi(save(photo(5).convert("CMYK"), "jpeg", exif=camera_exif()), iptc_app13())
    grey = save(photo(6).convert("L"), "jpeg", exif=camera_exif(), comment=COMMENT_MARK)
    restart = save(photo(7, (128, 96)), "jpeg", restart_marker_blocks=2, exif=camera_exif(), xmp=XMP)
    mpo_frames = [photo(8), photo(9)]
    mpo = io.BytesIO()
    mpo_frames[0].save(mpo, "MPO", save_all=True, append_images=mpo_frames[1:], exif=camera_exif())
    palette = photo(10).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.info["transparency"] = 3
    return {
        "jpeg": ("jpeg", jpeg),
        "jpeg_progressive": ("jpeg", progressive),
        "jpeg_cmyk_adobe": ("jpeg", cmyk),
        "jpeg_grey": ("jpeg", grey),
        "jpeg_restart": ("jpeg", restart),
        "jpeg_mpo": ("jpeg", mpo.getvalue()),
        "png_rgb": ("png", full_png()),
        "png_rgba": ("png", full_png(photo(11, mode="RGBA"))),
        "png_palette_trns": ("png", full_png(palette)),
        "png_grey16": ("png", full_png(Image.fromarray((np.arange(64 * 48).reshape(48, 64) * 21).astype(np.uint16)))),
        # segments no decoder reads, holding data: a DNL before the frame, an ALPH after the bitstream
        "jpeg_dnl_before_frame": (
            "jpeg",
            after_soi(save(photo(13), "jpeg"), jpeg_segment(0xDC, b"\x00\x10" + TEXT_MARK)),
        ),
        "webp_alph_after_bitstream": ("webp", alph_after_bitstream()),
        "webp_lossy": ("webp", full_webp(quality=85)),
        "webp_lossless_alpha": ("webp", full_webp(photo(12, mode="RGBA"), lossless=True)),
    }


SAMPLES = samples()


def pillow_pixels(data: bytes) -> tuple[str, np.ndarray]:
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        return img.mode, np.asarray(img)


def codec_pixels(data: bytes, fmt: str) -> np.ndarray:
    """The decoders tasks.policies.decoders uses besides Pillow (libpng, libwebp), and libjpeg through imagecodecs."""
    decode = {"jpeg": imagecodecs.jpeg8_decode, "png": imagecodecs.png_decode, "webp": imagecodecs.webp_decode}[fmt]
    return decode(data)


def assert_same_pixels(original: bytes, stripped: bytes, fmt: str) -> None:
    mode, before = pillow_pixels(original)
    mode_after, after = pillow_pixels(stripped)
    assert mode_after == mode
    np.testing.assert_array_equal(after, before)
    np.testing.assert_array_equal(codec_pixels(stripped, fmt), codec_pixels(original, fmt))


def assert_no_metadata(data: bytes) -> None:
    with Image.open(io.BytesIO(data)) as img:
        for key in ("exif", "xmp", "comment", "icc_profile", "photoshop", "mp", "mpoffset"):
            assert key not in img.info, key
        assert dict(img.getexif()) == {}
        assert getattr(img, "text", {}) == {}
        assert img.format != "MPO"
    for mark in SECRETS:
        assert mark not in data, mark


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_strip_removes_metadata_and_keeps_pixels(name: str) -> None:
    fmt, data = SAMPLES[name]
    stripped = strip_metadata(data, fmt)
    assert stripped is not None
    assert len(stripped) < len(data)
    assert_same_pixels(data, stripped, fmt)
    assert_no_metadata(stripped)
    assert metadata_kinds(stripped, fmt) == ()
    assert strip_metadata(stripped, fmt) is stripped  # nothing left to remove: the same bytes back


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_stripped_bytes_pass_validation_with_the_same_pixel_key(name: str) -> None:
    fmt, data = SAMPLES[name]
    stripped = strip_metadata(data, fmt)
    assert stripped is not None
    rules = ImageRules(skip_reencode=True, output_format=fmt, min_side=1)
    before, after = process_image(data, rules), process_image(stripped, rules)
    assert before.ok and after.ok, (before.reason, before.detail, after.reason, after.detail)
    assert after.pixel_sha256 == before.pixel_sha256
    if pillow_pixels(data)[0] == "RGB":  # skip_reencode keeps 8-bit RGB input only
        assert after.data == stripped  # kept as is: nothing in it to remove


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("jpeg", ("exif", "gps", "xmp", "iptc", "icc", "comment", "trailing")),
        ("jpeg_progressive", ("exif", "gps", "xmp", "comment")),
        ("jpeg_cmyk_adobe", ("exif", "gps", "iptc")),
        ("jpeg_mpo", ("exif", "gps", "other", "trailing")),
        ("png_rgb", ("exif", "gps", "xmp", "icc", "comment", "text", "other", "trailing")),
        ("webp_lossy", ("exif", "gps", "xmp", "icc", "other", "trailing")),
        ("jpeg_dnl_before_frame", ("other",)),
        ("webp_alph_after_bitstream", ("other",)),
    ],
)
def test_metadata_kinds(name: str, kinds: tuple[str, ...]) -> None:
    fmt, data = SAMPLES[name]
    assert metadata_kinds(data, fmt) == kinds


def test_metadata_kinds_of_clean_files_and_other_formats() -> None:
    assert metadata_kinds(save(photo(), "png"), "png") == ()  # Pillow writes no ancillary chunk
    assert metadata_kinds(save(photo(), "webp"), "webp") == ()
    assert metadata_kinds(save(photo(), "jpeg"), "jpeg") == ()  # JFIF is not metadata
    assert metadata_kinds(b"GIF89a...", "gif") == ()
    assert strip_metadata(b"GIF89a...", "gif") is None
    exif_only = save(photo(), "jpeg", exif=b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x00\x00")
    assert metadata_kinds(exif_only, "jpeg") == ("exif",)  # no GPS pointer, no "gps"


def test_rendering_hints_are_removed_but_not_reported() -> None:
    info = PngImagePlugin.PngInfo()
    for tag, body in ((b"gAMA", b"\x00\x00\xb1\x8f"), (b"sRGB", b"\x00"), (b"sBIT", b"\x08\x08\x08")):
        info.add(tag, body)
    data = save(photo(), "png", pnginfo=info, dpi=(72, 72))
    assert metadata_kinds(data, "png") == ()
    stripped = strip_metadata(data, "png")
    assert stripped is not None and len(stripped) < len(data)
    for tag in (b"gAMA", b"sRGB", b"sBIT", b"pHYs"):
        assert tag not in stripped
    assert_same_pixels(data, stripped, "png")


def test_jfif_thumbnail_is_cut_and_density_kept() -> None:
    plain = save(photo(), "jpeg", dpi=(300, 300))
    assert plain[2:4] == b"\xff\xe0"
    length = int.from_bytes(plain[4:6], "big")
    app0 = plain[6 : 4 + length]
    thumb = b"\x02\x01" + bytes(range(6))  # a 2x1 RGB thumbnail
    data = plain[:2] + jpeg_segment(0xE0, app0[:12] + thumb) + plain[4 + length :]
    stripped = strip_metadata(data, "jpeg")
    assert stripped is not None
    assert stripped[2:6] == b"\xff\xe0\x00\x10" and stripped[18:20] == b"\x00\x00"
    assert_same_pixels(data, stripped, "jpeg")
    with Image.open(io.BytesIO(stripped)) as img:
        assert img.info["jfif_density"] == (300, 300)


def test_fill_bytes_before_markers_are_accepted() -> None:
    data = full_jpeg()
    padded = data[:2] + b"\xff\xff\xff" + data[2:]
    stripped = strip_metadata(padded, "jpeg")
    assert stripped == strip_metadata(data, "jpeg")


@pytest.mark.parametrize("name", ["jpeg", "png_rgb", "png_palette_trns", "webp_lossy", "webp_lossless_alpha"])
def test_keep_copyright_only(name: str) -> None:
    fmt, data = SAMPLES[name]
    kept = strip_metadata(data, fmt, keep=("Copyright",))
    assert kept is not None
    assert_same_pixels(data, kept, fmt)
    with Image.open(io.BytesIO(kept)) as img:
        exif = img.getexif()
        assert dict(exif) == {0x8298: COPYRIGHT}
        assert exif.get_ifd(0x8825) == {} and exif.get_ifd(0x8769) == {}
        assert "xmp" not in img.info and "icc_profile" not in img.info
    for mark in SECRETS:
        assert mark not in kept, mark
    assert metadata_kinds(kept, fmt) == ("exif",)
    rules = ImageRules(skip_reencode=True, output_format=fmt, min_side=1)
    assert process_image(kept, rules).pixel_sha256 == process_image(data, rules).pixel_sha256


def test_keep_places_exif_where_readers_look() -> None:
    jpeg = strip_metadata(SAMPLES["jpeg"][1], "jpeg", keep=("Copyright",))
    assert jpeg is not None and jpeg[2:4] == b"\xff\xe0" and jpeg[20:22] == b"\xff\xe1"  # after SOI + JFIF
    png = strip_metadata(SAMPLES["png_rgb"][1], "png", keep=("Copyright",))
    assert png is not None and png.index(b"eXIf") < png.index(b"IDAT")
    webp = strip_metadata(SAMPLES["webp_lossy"][1], "webp", keep=("Copyright",))
    assert webp is not None and webp[12:16] == b"VP8X" and webp[20] & 0x08 and not webp[20] & 0x24
    assert int.from_bytes(webp[4:8], "little") + 8 == len(webp)


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_keep_in_a_simple_webp_synthesises_vp8x(mode: str) -> None:
    # Simple files (no VP8X) hold no metadata by the spec; a writer may still append an EXIF chunk.
    simple = save(photo(13, mode=mode), "webp", lossless=mode == "RGBA", quality=80)
    assert simple[12:16] in (b"VP8 ", b"VP8L")
    data = with_riff_chunk(simple, riff_chunk(b"EXIF", camera_exif().tobytes()[6:]))
    assert metadata_kinds(data, "webp") == ("exif", "gps")
    assert strip_metadata(data, "webp") == simple
    kept = strip_metadata(data, "webp", keep=("Copyright", "Artist"))
    assert kept is not None and kept[12:16] == b"VP8X"
    assert bool(kept[20] & 0x10) == (mode == "RGBA")
    assert_same_pixels(data, kept, "webp")
    with Image.open(io.BytesIO(kept)) as img:
        assert dict(img.getexif()) == {0x8298: COPYRIGHT, 0x013B: ARTIST_MARK.decode()}


def test_keep_in_a_simple_webp_with_a_zero_size_header_gives_none() -> None:
    simple = save(photo(13), "webp", quality=80)
    assert simple[12:16] == b"VP8 "
    zero = simple[:26] + b"\x00\x00" + simple[28:]  # the VP8 frame's width: 0
    data = with_riff_chunk(zero, riff_chunk(b"EXIF", camera_exif().tobytes()[6:]))
    assert strip_metadata(data, "webp", keep=("Copyright",)) is None


def test_keep_absent_fields_keeps_nothing() -> None:
    fmt, data = SAMPLES["jpeg"]
    assert strip_metadata(data, fmt, keep=("ImageDescription",)) == strip_metadata(data, fmt)
    plain = save(photo(), "png")
    assert strip_metadata(plain, "png", keep=("Copyright",)) is plain


def test_keep_drops_a_field_too_large_for_one_segment() -> None:
    exif = Image.Exif()
    exif[0x8298] = COPYRIGHT
    exif[0x010E] = "x" * 70_000  # ImageDescription
    data = with_riff_chunk(vp8x_webp(), riff_chunk(b"EXIF", exif.tobytes()[6:]))
    kept = strip_metadata(data, "webp", keep=("ImageDescription", "Copyright"))
    assert kept is not None
    with Image.open(io.BytesIO(kept)) as img:
        assert dict(img.getexif()) == {0x8298: COPYRIGHT}


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("Orientation",), "applied to the pixels"),
        (("GPSInfo",), "GPS"),
        (("MakerNote",), "maker notes"),
        (("ExifOffset",), "sub-IFD"),
        (("XMLPacket",), "XMP"),
        (("Copyright", "NoSuchTag"), "not an EXIF tag name"),
        (("DateTimeOriginal",), "base-IFD"),
        (("StripOffsets",), "base-IFD"),
    ],
)
def test_check_keep_refuses_unknown_and_forbidden_tags(names: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_keep(names)
    with pytest.raises(ValueError, match=message):
        strip_metadata(SAMPLES["jpeg"][1], "jpeg", keep=names)
    with pytest.raises(ValueError, match=message):
        exif_kept(Image.Exif(), names)


def test_check_keep_accepts_descriptive_tags() -> None:
    check_keep(("Copyright", "Artist", "ImageDescription", "Software", "DateTime"))
    check_keep(())
    assert "Orientation" not in KEEPABLE and "GPSInfo" not in KEEPABLE and "MakerNote" not in KEEPABLE


def test_exif_kept_for_the_reencode_path() -> None:
    for fmt, name in (("jpeg", "jpeg"), ("png", "png_rgb"), ("webp", "webp_lossy")):
        with Image.open(io.BytesIO(SAMPLES[name][1])) as img:
            source = img.getexif()
        exif = exif_kept(source, ("Copyright", "Artist"))
        assert exif is not None
        reencoded = save(photo(), fmt, exif=exif)
        with Image.open(io.BytesIO(reencoded)) as img:
            assert dict(img.getexif()) == {0x8298: COPYRIGHT, 0x013B: ARTIST_MARK.decode()}
        for mark in (GPS_MARK, SERIAL_MARK, MAKER_MARK):
            assert mark not in reencoded
        assert exif_kept(source, ()) is None
        assert exif_kept(source, ("ImageDescription",)) is None
    assert exif_kept(Image.Exif(), ("Copyright",)) is None


# --- broken and hostile bytes ---------------------------------------------------------------


def small(fmt: str) -> bytes:
    return save(photo(20, (48, 40)), fmt, quality=80) if fmt != "png" else save(photo(20, (48, 40)), fmt)


def png_before_idat(data: bytes, chunk: bytes) -> bytes:
    idat = data.index(b"IDAT") - 4
    return data[:idat] + chunk + data[idat:]


def hostile_samples() -> dict[str, tuple[str, bytes]]:
    """Metadata far larger than the image, in every format."""
    tiny_jpeg = small("jpeg")
    app1 = jpeg_segment(0xE1, b"http://ns.adobe.com/xmp/extension/\x00" + b"X" * 65_490)
    big_jpeg = after_soi(tiny_jpeg, app1 * 160)  # about 10 MB of extended XMP
    big_png = png_before_idat(small("png"), png_chunk(b"tEXt", b"Comment\x00" + b"T" * 10_000_000))
    exif = camera_exif().tobytes()[6:] + b"\x00" * 10_000_000
    big_webp = with_riff_chunk(vp8x_webp(photo(20, (48, 40))), riff_chunk(b"EXIF", exif))
    many_com = after_soi(tiny_jpeg, jpeg_segment(0xFE, b"c") * (MAX_SEGMENTS // 2))
    many_text = png_before_idat(small("png"), png_chunk(b"tEXt", b"k\x00v") * (MAX_SEGMENTS // 2))
    return {
        "jpeg_10mb_app1": ("jpeg", big_jpeg),
        "png_10mb_text": ("png", big_png),
        "webp_10mb_exif": ("webp", big_webp),
        "jpeg_many_comments": ("jpeg", many_com),
        "png_many_text": ("png", many_text),
    }


@pytest.mark.parametrize("name", sorted(hostile_samples()))
def test_hostile_metadata_is_removed_and_the_output_is_small(name: str) -> None:
    fmt, data = hostile_samples()[name]
    stripped = strip_metadata(data, fmt)
    assert stripped is not None
    assert len(stripped) < len(small(fmt)) + 64
    assert_same_pixels(data, stripped, fmt)
    assert metadata_kinds(data, fmt)
    kept = strip_metadata(data, fmt, keep=("Copyright",))
    assert kept is not None and len(kept) < len(data)


def test_too_many_segments_is_left_to_the_reencode() -> None:
    tiny = small("jpeg")
    data = after_soi(tiny, jpeg_segment(0xFE, b"") * (MAX_SEGMENTS + 1))
    assert strip_metadata(data, "jpeg") is None
    png = png_before_idat(small("png"), png_chunk(b"tEXt", b"") * (MAX_SEGMENTS + 1))
    assert strip_metadata(png, "png") is None
    assert "text" in metadata_kinds(png, "png")


def test_broken_structure_gives_none() -> None:
    jpeg, png, webp = small("jpeg"), small("png"), small("webp")
    big = (0x7FFFFFFF).to_bytes(4, "big")
    cases = {
        "jpeg cut in a segment length": ("jpeg", jpeg[:3]),
        "jpeg segment past the end": ("jpeg", jpeg[:2] + b"\xff\xe1\xff\xf0Exif\x00\x00"),
        "jpeg segment length 1": ("jpeg", jpeg[:2] + b"\xff\xfe\x00\x01" + jpeg[2:]),
        "jpeg without EOI": ("jpeg", jpeg[:-2]),
        "jpeg cut in the scan": ("jpeg", jpeg[: len(jpeg) // 2]),
        "jpeg without SOS": ("jpeg", jpeg[:2] + b"\xff\xd9"),
        "jpeg garbage between segments": ("jpeg", jpeg[:2] + b"\x00" + jpeg[2:]),
        "jpeg reserved marker": ("jpeg", jpeg[:2] + b"\xff\x02\x00\x02" + jpeg[2:]),
        "jpeg only fill bytes": ("jpeg", b"\xff\xd8" + b"\xff" * 1_000_000),
        "png chunk length 2^31-1": ("png", png[:33] + big + b"tEXt" + png[41:]),
        "png chunk length 2^32-1": ("png", png[:33] + b"\xff\xff\xff\xff" + b"tEXt" + png[41:]),
        "png without IEND": ("png", png[:-12]),
        "png cut in a chunk": ("png", png[: len(png) // 2]),
        "png first chunk not IHDR": ("png", png[:8] + png_chunk(b"tEXt", b"a\x00b") + png[8:]),
        "png unknown critical chunk": ("png", png_before_idat(png, png_chunk(b"CRIT", b"x"))),
        "png animation": ("png", png_before_idat(png, png_chunk(b"acTL", b"\x00\x00\x00\x01\x00\x00\x00\x00"))),
        "png bad tag": ("png", png_before_idat(png, png_chunk(b"t\x00Xt", b"x"))),
        "webp riff size past the end": ("webp", webp[:4] + (len(webp) + 100).to_bytes(4, "little") + webp[8:]),
        "webp chunk past the riff": ("webp", with_riff_chunk(webp, b"EXIF" + (10**6).to_bytes(4, "little") + b"x")),
        "webp unknown first chunk": ("webp", webp[:12] + b"ABCD" + webp[16:]),
        "webp header only": ("webp", b"RIFF\x04\x00\x00\x00WEBP"),
        "webp vp8x without image": ("webp", b"RIFF\x16\x00\x00\x00WEBPVP8X\x0a\x00\x00\x00" + b"\x00" * 10),
    }
    for name, (fmt, data) in cases.items():
        assert strip_metadata(data, fmt) is None, name
        assert strip_metadata(data, fmt, keep=("Copyright",)) is None, name
        assert isinstance(metadata_kinds(data, fmt), tuple), name


@pytest.mark.filterwarnings("ignore:.*:UserWarning:PIL")  # Pillow's notes on broken EXIF
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_mutated_bytes_never_raise(name: str) -> None:
    fmt, data = SAMPLES[name]
    rng = np.random.default_rng(len(name))
    header = min(len(data), 4096)  # where the segment structure is
    for i in range(150):
        mutated = bytearray(data)
        if i % 3 == 0:
            mutated = mutated[: int(rng.integers(0, len(data)))]
        else:
            for pos in rng.integers(0, header, size=int(rng.integers(1, 8))):
                mutated[pos] = int(rng.integers(0, 256))
        blob = bytes(mutated)
        out = strip_metadata(blob, fmt)
        assert out is None or (isinstance(out, bytes) and len(out) <= len(blob))
        kept = strip_metadata(blob, fmt, keep=("Copyright", "Artist"))
        assert kept is None or isinstance(kept, bytes)
        assert set(metadata_kinds(blob, fmt)) <= {
            "exif",
            "gps",
            "xmp",
            "iptc",
            "icc",
            "comment",
            "text",
            "other",
            "trailing",
        }


def test_hostile_exif_directories_are_bounded() -> None:
    # An IFD0 claiming 65535 entries, the GPS pointer last; and one pointing past its data.
    entries = b"".join(
        (0x0100 + i % 0x100).to_bytes(2, "little") + b"\x03\x00\x01\x00\x00\x00\x01\x00\x00\x00" for i in range(65534)
    )
    gps = (0x8825).to_bytes(2, "little") + b"\x04\x00\x01\x00\x00\x00\x00\x00\x00\x00"
    tiff = b"II*\x00\x08\x00\x00\x00" + (65535).to_bytes(2, "little") + entries + gps + b"\x00" * 4
    data = with_riff_chunk(vp8x_webp(), riff_chunk(b"EXIF", tiff))
    assert metadata_kinds(data, "webp") == ("exif", "gps", "xmp")
    kept = strip_metadata(data, "webp", keep=("Copyright",))
    assert kept is not None and b"EXIF" not in kept
    broken = b"II*\x00\xff\xff\xff\x7f"
    data = with_riff_chunk(vp8x_webp(), riff_chunk(b"EXIF", broken))
    assert metadata_kinds(data, "webp") == ("exif", "xmp")
    assert strip_metadata(data, "webp", keep=("Copyright",)) is not None


def test_keep_reads_only_the_named_entries_of_a_hostile_exif() -> None:
    # 65534 entries each pointing at the same 5 MB value, then the Copyright: only the named
    # entries are handed to Pillow's parser, and the Copyright is still found and kept.
    blob_at = 8 + 2 + 12 * 65535 + 4
    text = COPYRIGHT.encode() + b"\x00"
    text_at = blob_at + 5_000_000
    heavy = (0x010E).to_bytes(2, "little") + (7).to_bytes(2, "little") + (5_000_000).to_bytes(4, "little")
    entries = (heavy + blob_at.to_bytes(4, "little")) * 65534
    copyright_entry = b"\x98\x82\x02\x00" + len(text).to_bytes(4, "little") + text_at.to_bytes(4, "little")
    tiff = b"II*\x00\x08\x00\x00\x00\xff\xff" + entries + copyright_entry + b"\x00" * 4 + b"\x00" * 5_000_000 + text
    data = with_riff_chunk(vp8x_webp(), riff_chunk(b"EXIF", tiff))
    kept = strip_metadata(data, "webp", keep=("Copyright", "Artist"))
    assert kept is not None and len(kept) < 10_000
    with Image.open(io.BytesIO(kept)) as img:
        assert dict(img.getexif()) == {0x8298: COPYRIGHT}


# --- bytes beside what decoders read ----------------------------------------------------------


def jpeg_before(data: bytes, marker: bytes, segment: bytes) -> bytes:
    """``data`` with ``segment`` put in before the first ``marker`` (FF xx)."""
    at = data.index(marker)
    return data[:at] + segment + data[at:]


def test_dnl_keeps_only_its_line_count() -> None:
    # A DNL after the scan of its own size (a line count) is kept; a longer one, or a second, is data.
    data = save(photo(15), "jpeg")
    lines = jpeg_segment(0xDC, (64).to_bytes(2, "big"))
    planted = jpeg_before(data, b"\xff\xd9", lines + jpeg_segment(0xDC, b"\x00\x40" + TEXT_MARK) + lines)
    stripped = strip_metadata(planted, "jpeg")
    assert stripped is not None and TEXT_MARK not in stripped
    assert stripped == jpeg_before(data, b"\xff\xd9", lines)
    assert_same_pixels(planted, stripped, "jpeg")
    assert metadata_kinds(planted, "jpeg") == ("other",)
    assert metadata_kinds(stripped, "jpeg") == ()


def test_parameterless_markers_between_segments_are_removed() -> None:
    # RSTn between header segments: skipped by libjpeg and Pillow, each one 3 bits of data.
    data = save(photo(15), "jpeg")
    planted = jpeg_before(data, b"\xff\xdb", b"\xff\xd0\xff\xd3\xff\xd7")
    stripped = strip_metadata(planted, "jpeg")
    assert stripped == data
    assert_same_pixels(planted, stripped, "jpeg")
    assert metadata_kinds(planted, "jpeg") == ("other",)


def adobe(body: bytes) -> bytes:
    return jpeg_segment(0xEE, b"Adobe" + body)


def test_adobe_keeps_only_the_segment_decoders_read() -> None:
    # libjpeg takes the transform of the last Adobe segment before the scan. Planted before the
    # file's own (CMYK, transform 0): segments with transform 2 (YCCK), whose pixels differ,
    # and a short one; after the scan, one more. Each carries 6 bytes of a message.
    data = save(photo(5).convert("CMYK"), "jpeg")
    own = data.index(b"\xff\xee")
    assert data[own : own + 16] == adobe(b"\x00\x64" + b"\x00" * 5)
    message = TEXT_MARK + b"-" + COMMENT_MARK + b"!"
    pieces = [message[i : i + 6] for i in range(0, len(message), 6)]
    before = b"".join(adobe(piece + b"\x02") for piece in pieces[:-2]) + adobe(pieces[-2][:2])
    planted = jpeg_before(data[:own] + before + data[own:], b"\xff\xd9", adobe(pieces[-1] + b"\x00"))
    assert pillow_pixels(planted)[1].tobytes() == pillow_pixels(data)[1].tobytes()
    stripped = strip_metadata(planted, "jpeg")
    assert stripped == data  # the file's own segment, in its place
    for piece in pieces:
        assert piece not in stripped
    assert_same_pixels(planted, stripped, "jpeg")
    assert metadata_kinds(planted, "jpeg") == ("other",)


def test_adobe_bytes_decoders_skip_are_rewritten() -> None:
    # The version and flags (6 bytes) are read by no decoder's pixels; a transform other than
    # 0 is YCCK for 4 components whatever its value. Both are written as libjpeg writes them.
    data = save(photo(5).convert("CMYK"), "jpeg")
    own = data.index(b"\xff\xee")
    planted = data[:own] + adobe(TEXT_MARK[:6] + b"\x07") + data[own + 16 :]
    stripped = strip_metadata(planted, "jpeg")
    assert stripped is not None and TEXT_MARK[:6] not in stripped
    assert stripped[own : own + 16] == adobe(b"\x00\x64" + b"\x00" * 4 + b"\x02")
    assert_same_pixels(planted, stripped, "jpeg")
    assert strip_metadata(stripped, "jpeg") is stripped


def png_chunk_replaced(data: bytes, tag: bytes, chunk: bytes) -> bytes:
    at = data.index(tag) - 4
    return data[:at] + chunk + data[at + 12 + int.from_bytes(data[at : at + 4], "big") :]


@pytest.mark.parametrize("mode", ["L", "LA", "RGB", "RGBA"])
def test_png_palette_and_transparency_decoders_skip_are_removed(mode: str) -> None:
    # A palette in a grey or truecolour file, transparency beside an alpha channel: read by no
    # decoder's pixels, any bytes.
    img = photo(16, mode="RGBA").convert(mode) if mode.endswith("A") else photo(16).convert(mode)
    data = save(img, "png")
    planted = png_before_idat(data, png_chunk(b"PLTE", TEXT_MARK[:15]))
    if mode.endswith("A"):
        planted = png_before_idat(planted, png_chunk(b"tRNS", COMMENT_MARK))
    stripped = strip_metadata(planted, "png")
    assert stripped == data
    assert_same_pixels(planted, stripped, "png")
    assert metadata_kinds(planted, "png") == ("other",)


def test_png_palette_and_transparency_read_two_ways_give_none() -> None:
    grey, rgb = save(photo(17).convert("L"), "png"), save(photo(17), "png")
    palette = save(photo(10).convert("P", palette=Image.Palette.ADAPTIVE, colors=16), "png", transparency=3)
    plte_at = palette.index(b"PLTE") - 4
    entries = int.from_bytes(palette[plte_at : plte_at + 4], "big") // 3
    two = save(photo(10).convert("P", palette=Image.Palette.ADAPTIVE, colors=2), "png", bits=1)
    assert two[24:26] == b"\x01\x03"  # 1-bit palette: libpng reads 2 entries of a longer PLTE
    two = png_chunk_replaced(two, b"PLTE", png_chunk(b"PLTE", bytes(range(12))))
    cases = {
        "grey tRNS not 2 bytes": png_before_idat(grey, png_chunk(b"tRNS", b"\x00\x10" + TEXT_MARK)),
        "rgb tRNS not 6 bytes": png_before_idat(rgb, png_chunk(b"tRNS", b"\x00" * 6 + TEXT_MARK)),
        "two tRNS": png_before_idat(rgb, png_chunk(b"tRNS", b"\x00" * 6) * 2),
        "tRNS after the pixels": png_chunk_replaced(rgb, b"IEND", png_chunk(b"tRNS", b"\x00" * 6) + rgb[-12:]),
        "tRNS longer than the palette": png_chunk_replaced(
            palette, b"tRNS", png_chunk(b"tRNS", b"\xff" * (entries + 1))
        ),
        "tRNS longer than the entries libpng reads": png_before_idat(two, png_chunk(b"tRNS", b"\x00\x80\xff")),
        "tRNS before the palette": palette[:plte_at] + png_chunk(b"tRNS", b"\x00") + palette[plte_at:],
        "PLTE of part entries": png_chunk_replaced(palette, b"PLTE", png_chunk(b"PLTE", bytes(3 * entries + 1))),
        "PLTE of 257 entries": png_chunk_replaced(palette, b"PLTE", png_chunk(b"PLTE", bytes(3 * 257))),
        "two PLTE": palette[:plte_at]
        + palette[plte_at : palette.index(b"tRNS") - 4] * 2
        + palette[palette.index(b"tRNS") - 4 :],
        "IHDR of 14 bytes": palette[:8] + png_chunk(b"IHDR", palette[16:29] + b"S") + palette[33:],
    }
    for name, data in cases.items():
        assert strip_metadata(data, "png") is None, name
    for data in (png_before_idat(grey, png_chunk(b"tRNS", b"\x00\x10")), palette, two):
        assert strip_metadata(data, "png") is data


def test_webp_alpha_the_header_does_not_announce_gives_none() -> None:
    # VP8X without the alpha flag, then ALPH and VP8: Pillow decodes RGBA, libwebp RGB.
    simple = save(photo(18), "webp", quality=80)
    canvas = (96 - 1).to_bytes(3, "little") + (64 - 1).to_bytes(3, "little")
    body = riff_chunk(b"VP8X", b"\x00" * 4 + canvas) + riff_chunk(b"ALPH", b"\x00" + TEXT_MARK) + simple[12:]
    data = b"RIFF" + (4 + len(body)).to_bytes(4, "little") + b"WEBP" + body
    assert pillow_pixels(data)[0] == "RGBA" and codec_pixels(data, "webp").shape[-1] == 3
    assert strip_metadata(data, "webp") is None
    flagged = data[:20] + b"\x10" + data[21:]
    assert strip_metadata(flagged, "webp") is flagged


def test_webp_vp8x_is_released_as_ten_bytes() -> None:
    # Bytes no decoder reads in VP8X: its reserved bits and bytes, and anything past 10 bytes.
    clean = vp8x_webp(photo(19))
    flags, canvas = clean[20], clean[24:30]
    assert clean[16:20] == (10).to_bytes(4, "little") and clean[21:24] == b"\x00\x00\x00"

    def with_vp8x(body: bytes) -> bytes:
        return with_riff_chunk(b"RIFF\x04\x00\x00\x00WEBP", riff_chunk(b"VP8X", body) + clean[30:])

    expected = strip_metadata(clean, "webp")  # the XMP chunk and its flag removed
    assert expected is not None and expected[12:30] == b"VP8X\x0a\x00\x00\x00\x00\x00\x00\x00" + canvas
    cases = {
        "reserved bytes": with_vp8x(bytes([flags]) + TEXT_MARK[:3] + canvas),
        "longer chunk": with_vp8x(bytes([flags, 0, 0, 0]) + canvas + TEXT_MARK),
        "reserved bits": with_vp8x(bytes([flags | 0xC1, 0, 0, 0]) + canvas),
    }
    for name, data in cases.items():
        stripped = strip_metadata(data, "webp")
        assert stripped == expected, name
        assert TEXT_MARK[:3] not in stripped, name
        assert metadata_kinds(data, "webp") == ("xmp", "other"), name
    assert_same_pixels(cases["reserved bytes"], expected, "webp")  # the others no decoder here opens


def tiff_with(entries: list[tuple[int, int, int, bytes]]) -> bytes:
    """A TIFF block whose IFD0 holds ``entries`` (tag, type, count, value bytes), as a writer may store them."""
    at = 8 + 2 + 12 * len(entries) + 4
    head, values = [b"II*\x00\x08\x00\x00\x00" + len(entries).to_bytes(2, "little")], b""
    for tag, kind, count, value in entries:
        entry = tag.to_bytes(2, "little") + kind.to_bytes(2, "little") + count.to_bytes(4, "little")
        if len(value) <= 4:
            head.append(entry + value.ljust(4, b"\x00"))
        else:
            head.append(entry + (at + len(values)).to_bytes(4, "little"))
            values += value + b"\x00" * (len(value) & 1)
    return b"".join(head) + b"\x00" * 4 + values


def redact_emails(name: str, text: str) -> str | None:
    """A screen as privacy.text's ``redact`` is, for e-mail addresses; refuses a field holding "REFUSE"."""
    return None if "REFUSE" in text else re.sub(r"[\w.+-]+@[\w-]+\.[\w.]+", "<EMAIL>", text)


@pytest.mark.filterwarnings("ignore:.*:UserWarning:PIL")  # Pillow's notes on oddly typed fields
def test_keep_screens_text_stored_as_bytes() -> None:
    # Text fields stored as BYTE (1) or UNDEFINED (7) reach Pillow as bytes; their text is
    # screened as ASCII text is. Fields of another type (numbers, several values) are not kept.
    address = "Jo Bloggs jo.bloggs@example.org"
    fields = [
        (0x013B, 7, address.encode()),  # Artist, UNDEFINED
        (0x8298, 1, address.encode() + b"\x00"),  # Copyright, BYTE
        (0x010E, 7, address.encode("utf-16-le")),  # ImageDescription, UTF-16 as UNDEFINED
        (0x010F, 7, b"PhoneMaker"),  # Make, nothing to redact: kept as it was
        (0x0110, 1, b"REFUSE " + ARTIST_MARK),  # Model, refused by the screen
        (0x0131, 5, bytes(range(8))),  # Software as a RATIONAL
        (0x4746, 3, (TEXT_MARK * 2)[:16]),  # Rating as 8 SHORTs
    ]
    tiff = tiff_with([(tag, kind, len(value) // {5: 8, 3: 2}.get(kind, 1), value) for tag, kind, value in fields])
    names = ("Artist", "Copyright", "ImageDescription", "Make", "Model", "Software", "Rating")
    data = save(photo(21), "jpeg", exif=b"Exif\x00\x00" + tiff)
    kept = strip_metadata(data, "jpeg", keep=names, screen=redact_emails)
    assert kept is not None
    assert_same_pixels(data, kept, "jpeg")
    with Image.open(io.BytesIO(data)) as img:
        reencoded = save(photo(21), "jpeg", exif=exif_kept(img.getexif(), names, redact_emails))
    for out in (kept, reencoded):
        with Image.open(io.BytesIO(out)) as img:
            assert dict(img.getexif()) == {
                0x013B: "Jo Bloggs <EMAIL>",
                0x8298: "Jo Bloggs <EMAIL>",
                0x010E: "Jo Bloggs <EMAIL>",
                0x010F: "PhoneMaker",
            }
        for mark in (b"jo.bloggs", "jo.bloggs".encode("utf-16-le"), ARTIST_MARK, TEXT_MARK[:4]):
            assert mark not in out, mark
    assert metadata_kinds(kept, "jpeg") == ("exif",)
    # Without a screen (privacy.text off) the text is kept as written, but never a mistyped field.
    with Image.open(io.BytesIO(strip_metadata(data, "jpeg", keep=names) or b"")) as img:
        assert set(img.getexif()) == {0x013B, 0x8298, 0x010E, 0x010F, 0x0110}
