"""Untrusted image bytes decoded under limits, normalised to RGB, re-encoded from pixels, and hashed for dedup.

Decisions (the tests in tests/test_images.py and tests/test_decoders.py pin each one):

- Order: file size bounds, format sniffed from the bytes, end-marker truncation check, header
  (Pillow's ``Image.open`` is lazy, restricted to the sniffed format's plugin; a WebP's size,
  animation flag and metadata chunks, and a PNG's IHDR and chunk list, are read from the
  bytes), pixel cap, then the header-level rules (animated, ``min_side``,
  ``max_aspect_ratio``), and only then the decode. Short side and aspect ratio do not change
  under EXIF rotation, so checking them on the header gives the same verdict as checking the
  decoded image, without paying for a decode; a broken file that is also too small is
  reported as ``image_too_small``. With ``thumbnail=True`` an image rejected by those rules is
  still decoded (drafted) for the thumbnail the audit report shows.
- Pixel cap: ``width * height > rules.max_pixels`` from the header is ``decompression_bomb``,
  never decoded; so is a resize target over the cap (only reachable by configuring upscaling
  of extreme aspect ratios). Pillow's own guard (``Image.MAX_IMAGE_PIXELS``, a process-wide
  setting that this module leaves alone) raises ``DecompressionBombError`` at twice its value
  (about 179 Mpx by default); that is ``decompression_bomb`` too, so the effective cap is the
  smaller of the two, also where libwebp or libpng decodes. A WebP's canvas is checked before
  Pillow's WebP plugin runs at all (it builds the animation decoder, which allocates the
  canvas, before it reports the size).
- Truncation: ``ImageFile.LOAD_TRUNCATED_IMAGES`` stays False (never changed here), so a
  decoder that runs out of data raises and the image is ``truncated_image``; the end-marker
  check from tasks.policies.sniff runs first and also catches a PNG cut only before ``IEND``. A JPEG
  whose scan data is cut but which still ends in an EOI marker is concealed by libjpeg (grey
  rows) and accepted; neither Pillow nor OpenCV reports it. A WebP shorter than its RIFF
  header declares is ``truncated_image``; one whose RIFF size was edited to fit the cut is
  ``undecodable_image`` (libwebp does not say truncated, with either decoder).
- Animated: GIF / APNG / WebP with more than one frame, and multi-page TIFF. MPO (the JPEG
  extension phones use for depth maps and previews) is not animation: its first image is used.
- Normalisation to 8-bit RGB: EXIF orientation applied; alpha (RGBA, LA, PA, premultiplied,
  palette or grey/RGB with a ``tRNS`` colour) composited on white, as img2dataset does;
  CMYK (including Adobe's inverted CMYK JPEGs), YCbCr, LAB, HSV and 1-bit through Pillow's
  converters; 16-bit grey (``I;16*``, and ``I`` holding 0..65535) scaled by 1/257 and rounded,
  never clipped. Float, signed and wider integer samples are ``unsupported_image_mode``.
  ICC profiles are not applied: samples are taken as sRGB, as img2dataset does.
- Decoders (tasks/policies/decoders.py; each chosen by bench/bench_decode.py, figures in
  bench/RESULTS.md): Pillow for every format but these two. A still WebP (no animation flag
  in VP8X) goes to libwebp's simple decoder through imagecodecs, not Pillow's animation
  decoder: the same pixels bit for bit, EXIF orientation read from its EXIF chunk (and XMP)
  as Pillow reads it. An animated WebP stays with Pillow (first frame or reject). A plain PNG
  (8-bit grey, RGB, grey + alpha or RGBA; no palette, ``tRNS``, ``eXIf``, ICC, compressed or
  orientation-bearing text, or APNG chunks; every chunk but IDAT with a right CRC) goes to
  libpng through imagecodecs; whatever libpng refuses is decoded by Pillow, so its verdict and
  detail are Pillow's. PNG has no reduced-scale decode.
- WebP scaled decode: a lossy, opaque, still WebP that is to be scaled down is decoded by
  libwebp straight to the resize target (its ``use_scaling``, area-averaging the decoded
  planes; tasks/policies/libwebp.py), never producing the full-resolution pixels, as the JPEG
  draft below. Its pixels are within a few levels of decoding at full size and resizing
  (mean 2.7 levels on the benchmark's WebPs, where the JPEG draft is 4.9), and its pixel key
  is hashed at that size. Lossless and alpha WebPs, and those not scaled down, are decoded at
  full size; anything libwebp refuses while scaling is decoded again at full size, so its
  verdict and detail are the full-size decoder's.
- JPEG draft: when a JPEG is to be scaled down by at least 2x, libjpeg decodes it at 1/2, 1/4
  or 1/8 scale (Pillow's ``draft``), never below the resize target, so the full-resolution
  pixels are never produced (benchmarked in bench/bench_decode.py). The limits still hold:
  the pixel cap is checked on the header first, truncation still fails the decode, and the
  orientation is applied after it.
- Resize, ``pixel_sha256`` and ``phash``: tasks/policies/pixels.py says how each is done.
- Output: re-encoded from pixels in ``rules.output_format``, with no EXIF, ICC, text chunks
  or anything after the image, so appended payloads (polyglots) are gone. JPEG and WebP use
  ``rules.quality``; PNG ignores it (zlib level 6). ``rules.skip_reencode`` (img2dataset's
  option of that name) keeps the input bytes instead when nothing would change them: no
  resize, already in ``output_format``, one frame, decoded as 8-bit RGB, not EXIF-rotated;
  the image is still decoded and hashed. Its metadata segments (EXIF, XMP, IPTC, comments,
  text chunks, ICC) and any bytes after the image are removed without touching the pixels
  (tasks/policies/metadata.py; the pixel hash is the same); bytes that cannot be rewritten so
  are re-encoded. EXIF fields the recipe keeps (``privacy.metadata.keep``) are written again
  into either output.
- Pixels seen (``look``): the validation stage may look at the released pixels before they are
  encoded (the face check, tasks/models/faces.py): it may refuse the image or hand back other
  pixels (faces blurred), which are then encoded whatever ``skip_reencode`` says.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from tasks.formats.recipe_download import ImageRules
from tasks.policies import decoders, metadata, pixels
from tasks.policies.decoders import (
    DECODE_ERRORS,
    PIL_FORMATS,
    TRANSPOSE,
    PillowSource,
    PlainPngSource,
    StillWebPSource,
    Unsupported,
    box_after,
    open_pillow,
    plain_png,
    segments_problem,
    to_rgb,
    webp_info,
)
from tasks.policies.sniff import is_truncated, sniff_format

# Pillow warns (DecompressionBombWarning) for an image over Image.MAX_IMAGE_PIXELS and under
# twice it. The caps below decide about such an image, and its row says it was that large
# (``_large_note``): a warning from a worker would only reach the terminal, in the middle of the
# progress lines, naming no row. Installed where images are judged (``_quiet_bomb_warning``), as
# a test's or a tool's reset of the warning filters would drop one installed at import.
_BOMB_FILTER = ("ignore", None, Image.DecompressionBombWarning, None, 0)


def _quiet_bomb_warning() -> None:
    if _BOMB_FILTER not in warnings.filters:
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


__all__ = ["REASONS", "ImageOutcome", "PixelVerdict", "process_image"]

# Every reason process_image can return; each is registered in tasks/formats/reasons.py.
REASONS = (
    "file_too_small",
    "file_too_large",
    "not_an_image",
    "format_not_allowed",
    "truncated_image",
    "decompression_bomb",
    "undecodable_image",
    "animated_image",
    "image_too_small",
    "aspect_ratio",
    "unsupported_image_mode",
)

OUTPUT_EXT = {"jpeg": "jpg", "png": "png", "webp": "webp"}
DETAIL_CHARS = 160  # decoder messages are cut so details stay short


@dataclass(frozen=True)
class PixelVerdict:
    """What a look at the released pixels decided (see ``process_image``'s ``look``).

    Args:
        reason, detail: a refusal (a stable reason), or None.
        image: other pixels to release in place of the ones looked at (same size), or None.
        facts: what was found, for the sample's json and ledger row.
    """

    reason: str | None = None
    detail: str | None = None
    image: Image.Image | None = None
    facts: dict[str, Any] = field(default_factory=dict)


Look = Callable[[Image.Image], PixelVerdict]


@dataclass(frozen=True)
class ImageOutcome:
    """The verdict on one image, and what it became when accepted.

    Args:
        reason: ``None`` when accepted, else a stable reason from tasks/formats/reasons.py.
        detail: a short human-readable explanation of a rejection; of an accepted image, a note
            where there is one (its size over Pillow's decompression-bomb warning).
        data: the re-encoded image (accepted only).
        ext: its extension: ``jpg``, ``png`` or ``webp``.
        width, height: size of ``data``.
        orig_width, orig_height: size after EXIF orientation, before resizing (set once the
            header was read).
        src_format: the sniffed input format (``jpeg``, ``png``, ...).
        pixel_sha256: exact-duplicate key (see the module docstring).
        phash: 64-bit DCT perceptual hash, compared with ``hamming``.
        thumbnail: a JPEG with a long side of at most 96 px, only when asked for; also made for
            decodable images rejected by a header rule, for the audit report.
        facts: what ``look`` found (face boxes), where it looked.
        changed: the pixels were changed by ``look`` (faces blurred).
        metadata_removed: the kinds of metadata removed from bytes kept as fetched.
    """

    reason: str | None
    detail: str | None = None
    data: bytes | None = None
    ext: str | None = None
    width: int | None = None
    height: int | None = None
    orig_width: int | None = None
    orig_height: int | None = None
    src_format: str | None = None
    pixel_sha256: str | None = None
    phash: int | None = None
    thumbnail: bytes | None = None
    facts: dict[str, Any] | None = None
    changed: bool = False
    metadata_removed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.reason is None


def _short(err: BaseException) -> str:
    if isinstance(err, Image.UnidentifiedImageError):
        return "UnidentifiedImageError: the decoder does not recognise the data"  # its text holds an address
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


def _decode_failure(err: BaseException) -> tuple[str, str]:
    # Pillow says "image file is truncated" / "Truncated File Read" when the data ends early.
    reason = "truncated_image" if "truncated" in str(err).lower() else "undecodable_image"
    return reason, _short(err)


def _over_cap(width: int, height: int, rules: ImageRules) -> str | None:
    """Why a header size is a decompression bomb (``max_pixels``, or Pillow's own guard), or None."""
    count = width * height
    if count > rules.max_pixels:
        return f"{width}x{height} = {count} px > max_pixels {rules.max_pixels}"
    guard = Image.MAX_IMAGE_PIXELS
    if guard and count > 2 * guard:  # where Image.open raises DecompressionBombError
        return f"{width}x{height} = {count} px > Pillow's limit {2 * guard} (2 x Image.MAX_IMAGE_PIXELS)"
    return None


def _large_note(width: int, height: int, rules: ImageRules) -> str | None:
    """The note of an accepted image over Pillow's decompression-bomb warning size, or None."""
    guard = Image.MAX_IMAGE_PIXELS
    if not guard or width * height <= guard:
        return None
    return (
        f"{width}x{height} = {width * height} px: over Pillow's decompression-bomb warning ({guard} px, "
        f"Image.MAX_IMAGE_PIXELS), within validate.image.max_pixels {rules.max_pixels}"
    )


def process_image(
    data: bytes,
    rules: ImageRules,
    *,
    thumbnail: bool = False,
    look: Look | None = None,
    keep_exif: tuple[str, ...] = (),
    exif_screen: metadata.Screen | None = None,
) -> ImageOutcome:
    """Decide on one image's bytes and, when accepted, re-encode and hash it (see the module docstring).

    ``look`` sees the pixels to be released (after resizing) and may refuse them or replace
    them; ``keep_exif`` names the EXIF fields written into the output
    (``privacy.metadata.keep``; tasks/policies/metadata.py says which may be kept), whose text
    ``exif_screen`` sees first (the text privacy rules: tasks/stages/validate.py).
    """
    _quiet_bomb_warning()
    size = len(data)
    if size < rules.min_bytes:
        return ImageOutcome("file_too_small", f"{size} bytes < min_bytes {rules.min_bytes}")
    if size > rules.max_bytes:
        return ImageOutcome("file_too_large", f"{size} bytes > max_bytes {rules.max_bytes}")
    fmt = sniff_format(data)
    if fmt is None:
        return ImageOutcome("not_an_image", "no known image signature")
    if fmt not in rules.allowed_formats:
        return ImageOutcome("format_not_allowed", f"{fmt} not in allowed_formats", src_format=fmt)
    if fmt not in PIL_FORMATS:
        return ImageOutcome("undecodable_image", f"no decoder for {fmt}", src_format=fmt)
    if is_truncated(fmt, data):
        return ImageOutcome("truncated_image", f"{fmt} ends before its end marker", src_format=fmt)
    hostile = segments_problem(fmt, data)
    if hostile is not None:
        return ImageOutcome("undecodable_image", hostile, src_format=fmt)

    if fmt == "webp":
        # Read from the bytes: Pillow's WebP plugin builds the animation decoder, which
        # allocates the whole canvas, before it returns the size.
        info = webp_info(data)
        if info is None:
            return ImageOutcome("undecodable_image", "webp without a VP8X, VP8 or VP8L header chunk", src_format=fmt)
        bomb = _over_cap(info.width, info.height, rules)
        if bomb is not None:
            return ImageOutcome("decompression_bomb", bomb, src_format=fmt)
        if not info.animated and decoders.STILL_WEBP:
            return _decide(StillWebPSource(data, info), fmt, rules, thumbnail, data, look, keep_exif, exif_screen)
    if fmt == "png" and decoders.PLAIN_PNG and (png_size := plain_png(data)) is not None:
        return _decide(PlainPngSource(data, png_size), fmt, rules, thumbnail, data, look, keep_exif, exif_screen)
    try:
        img = open_pillow(data, fmt)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        return ImageOutcome("decompression_bomb", _short(err), src_format=fmt)
    except DECODE_ERRORS as err:
        reason, detail = _decode_failure(err)
        return ImageOutcome(reason, detail, src_format=fmt)
    with img:
        return _decide(PillowSource(img), fmt, rules, thumbnail, data, look, keep_exif, exif_screen)


def _decide(
    src: PillowSource | StillWebPSource | PlainPngSource,
    fmt: str,
    rules: ImageRules,
    thumbnail: bool,
    data: bytes,
    look: Look | None = None,
    keep_exif: tuple[str, ...] = (),
    exif_screen: metadata.Screen | None = None,
) -> ImageOutcome:
    width, height = src.size
    if width < 1 or height < 1:
        return ImageOutcome("undecodable_image", f"header size {width}x{height}", src_format=fmt)
    bomb = _over_cap(width, height, rules)
    if bomb is not None:
        return ImageOutcome("decompression_bomb", bomb, src_format=fmt)
    try:
        animated = src.animated()
        orientation = src.orientation()
    except DECODE_ERRORS as err:
        reason, detail = _decode_failure(err)
        return ImageOutcome(reason, detail, src_format=fmt)

    def oriented(o: int | None) -> tuple[int, int]:
        return (height, width) if o is not None and o >= 5 else (width, height)

    # Short side, aspect ratio and pixel counts do not change under rotation: judged on the header.
    short, long = min(width, height), max(width, height)
    ow, oh = oriented(orientation)
    target = pixels.resize_dims(width, height, rules)
    verdict: tuple[str, str] | None = None
    if animated and rules.animated == "reject":
        verdict = ("animated_image", "more than one frame")
    elif short < rules.min_side:
        verdict = ("image_too_small", f"short side {short} < min_side {rules.min_side}")
    elif long / short > rules.max_aspect_ratio:
        verdict = ("aspect_ratio", f"{ow}x{oh}: {long / short:.2f} > max_aspect_ratio {rules.max_aspect_ratio:g}")
    elif target is not None and target[0] * target[1] > rules.max_pixels:
        # Only reachable by configuration (upscaling an extreme aspect ratio); never allocated.
        detail = f"resize to {target[0]}x{target[1]} > max_pixels {rules.max_pixels}"
        return ImageOutcome("decompression_bomb", detail, orig_width=ow, orig_height=oh, src_format=fmt)
    if verdict is not None and not thumbnail:
        return ImageOutcome(*verdict, orig_width=ow, orig_height=oh, src_format=fmt)

    # The draft (or WebP scale) request is in the file's stored orientation. It does not depend
    # on ``thumbnail``, so neither does the pixel key: a thumbnail beside the output is made
    # from the decoded pixels, and is smaller than THUMBNAIL_SIDE when they are.
    # A thumbnail that goes through ``look`` (faces blurred) is decoded at the released size, where
    # faces are looked for.
    want = pixels.thumb_dims(width, height) if verdict is not None and look is None else target
    try:
        stored, box, late = src.load(want)
        orientation = late if orientation is None else orientation
        stored_rgb = to_rgb(stored)
    except Unsupported as err:
        verdict = verdict or ("unsupported_image_mode", str(err))
        return ImageOutcome(*verdict, orig_width=ow, orig_height=oh, src_format=fmt)
    except DECODE_ERRORS as err:
        verdict = verdict or _decode_failure(err)
        return ImageOutcome(*verdict, orig_width=ow, orig_height=oh, src_format=fmt)

    ow, oh = oriented(orientation)
    method = TRANSPOSE.get(orientation)
    rgb = stored_rgb.transpose(method) if method is not None else stored_rgb
    if box is not None and method is not None:
        box = box_after(box, stored_rgb.size, orientation)
    common = {"orig_width": ow, "orig_height": oh, "src_format": fmt}
    if verdict is not None:
        seen = look(rgb) if look is not None else None  # the faces a thumbnail must not show
        shown = seen.image if seen is not None and seen.image is not None else rgb
        return ImageOutcome(*verdict, thumbnail=pixels.thumbnail(shown), **common)

    unchanged = stored_rgb is stored and method is None  # RGB as decoded, not rotated
    pixel_key = pixels.pixel_sha256(rgb, (ow, oh), src.pixels if unchanged else None)
    target = pixels.resize_dims(ow, oh, rules)
    scaled = pixels.scale(rgb, target, box) if target is not None else rgb
    # The scaled picture is still the whole picture and far cheaper to average down to 32x32.
    perceptual = pixels.phash(scaled if min(scaled.size) >= pixels.PHASH_MIN_SIDE else rgb)
    out = pixels.crop_or_pad(scaled, rules)
    seen = look(out) if look is not None else None
    if seen is not None and seen.reason is not None:
        # A refused face is shown blurred where the look blurred it.
        shown = pixels.thumbnail(seen.image if seen.image is not None else rgb) if thumbnail else None
        return ImageOutcome(seen.reason, seen.detail, thumbnail=shown, facts=seen.facts, **common)
    changed = seen is not None and seen.image is not None
    released = seen.image if seen is not None and seen.image is not None else out
    # The input bytes decode to exactly ``out`` only when nothing was resized, converted or rotated.
    keep = rules.skip_reencode and out is rgb and unchanged and not animated and fmt == rules.output_format
    stripped = metadata.strip_metadata(data, fmt, keep_exif, exif_screen) if keep and not changed else None
    if stripped is not None:
        encoded, removed = stripped, metadata.metadata_kinds(data, fmt)
    else:
        exif = _kept_exif(data, fmt, keep_exif, exif_screen) if keep_exif else None
        encoded, removed = pixels.encode(released, rules.output_format, rules.quality, exif=exif), ()
    return ImageOutcome(
        None,
        _large_note(width, height, rules),
        data=encoded,
        ext=OUTPUT_EXT[rules.output_format],
        width=out.width,
        height=out.height,
        pixel_sha256=pixel_key,
        phash=perceptual,
        thumbnail=pixels.thumbnail(released if changed else rgb) if thumbnail or changed else None,
        facts=seen.facts if seen is not None else None,
        changed=changed,
        metadata_removed=removed,
        **common,
    )


def _kept_exif(data: bytes, fmt: str, keep: tuple[str, ...], screen: metadata.Screen | None) -> bytes | None:
    """The EXIF fields ``keep`` names, read from the input's EXIF (their text through ``screen``), for the re-encoded output."""
    try:
        with Image.open(io.BytesIO(data), formats=[PIL_FORMATS[fmt]]) as img:
            return metadata.exif_kept(img.getexif(), keep, screen)
    except DECODE_ERRORS:
        return None
