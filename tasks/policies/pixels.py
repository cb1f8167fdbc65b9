"""What is done to decoded pixels: resized, cropped or padded, re-encoded, thumbnailed, and hashed (exact and perceptual).

Decisions (pinned by tests/test_images.py):

- Resize, with img2dataset's semantics (``resize_only_if_bigger=False``, which it defaults to:
  small images are scaled up too): ``keep_ratio`` scales the SHORT side to ``image_size``;
  ``center_crop`` does the same then crops the centre square; ``border`` scales the LONG side
  to ``image_size`` and pads to a square with white; ``no`` keeps the size. New sizes are
  ``round(side * scale)``; downscaling averages areas (Pillow BOX, img2dataset's ``area``),
  upscaling uses Lanczos (img2dataset's ``lanczos``).
- ``pixel_sha256`` is the exact-duplicate key: sha256 over a small header (original width and
  height after orientation, decoded width and height) and the normalised RGB pixels as
  decoded. For everything but drafted JPEGs the decoded pixels are the original resolution,
  so the same picture stored as PNG, BMP or lossless WebP has one key. A drafted JPEG is
  hashed at its DCT-scaled resolution: the scale depends only on the header and the recipe's
  resize settings, and the DCT-scaled pixels are a function of the JPEG's coefficients, so
  byte-different copies of one JPEG (metadata stripped or changed, payload appended,
  lossless ``jpegtran`` re-packing) still share a key within one recipe; keys from recipes
  with different resize settings are not comparable (configs are hashed into output names
  anyway). A lossy WebP decoded scaled is hashed at the resize target the same way: its
  pixels are a function of its VP8 frame and the target, so the same frame in another
  container (metadata added, payload appended) keeps its key. A JPEG and a PNG of the same
  decoded pixels then differ; the perceptual hash catches those.
- ``phash``: DCT pHash. The normalised picture is area-averaged to 32x32, converted to grey
  (ITU-R 601 luma) and transformed with an orthonormal 2-D DCT-II; bit i (row-major over the
  top-left 8x8 block, coefficient (0, 0) in the most significant bit of the 64) is set when
  the coefficient is above the median of the 63 AC coefficients (the DC term is left out of
  the median). When the image is resized, the scaled picture (before crop or pad, still the
  whole picture) stands in for the decoded one as long as its short side is 64 px or more:
  the same bits within a few, for a fraction of the work. It is unsigned: store it as uint64
  or reinterpret it as int64.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np
from PIL import Image

from tasks.formats.recipe_download import ImageRules
from tasks.policies.decoders import WHITE

THUMBNAIL_SIDE = 96
PHASH_MIN_SIDE = 64  # the scaled image stands in for the decoded one in the pHash from this size
THUMBNAIL_QUALITY = 80


def _dct_rows(n: int = 32, keep: int = 8) -> np.ndarray:
    k = np.arange(keep)[:, None]
    x = np.arange(n)[None, :]
    rows = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * x + 1) * k / (2 * n))
    rows[0] /= np.sqrt(2.0)
    return rows


_DCT8 = _dct_rows()


def hamming(a: int, b: int) -> int:
    """Number of differing bits between two perceptual hashes."""
    return (a ^ b).bit_count()


def resize_dims(width: int, height: int, rules: ImageRules) -> tuple[int, int] | None:
    """(w, h) the oriented image is scaled to before any crop or pad; None when no resize."""
    if rules.resize_mode == "no":
        return None
    side = max(width, height) if rules.resize_mode == "border" else min(width, height)
    scale = rules.image_size / side
    return max(1, round(width * scale)), max(1, round(height * scale))


def thumb_dims(width: int, height: int) -> tuple[int, int]:
    scale = min(1.0, THUMBNAIL_SIDE / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def pixel_sha256(rgb: Image.Image, orig: tuple[int, int], raw: np.ndarray | None = None) -> str:
    """``raw``: the decoder's own RGB array when it holds exactly ``rgb``'s bytes (hashed without a copy)."""
    digest = hashlib.sha256(b"rgb8 %dx%d %dx%d\n" % (orig[0], orig[1], rgb.width, rgb.height))
    # numpy's stubs do not declare the buffer protocol that hashlib reads the array through.
    digest.update(rgb.tobytes() if raw is None else np.ascontiguousarray(raw))  # type: ignore[arg-type]
    return digest.hexdigest()


def phash(rgb: Image.Image) -> int:
    """64-bit DCT perceptual hash of an RGB image (see the module docstring)."""
    small = rgb.resize((32, 32), Image.Resampling.BOX).convert("L")
    pixels = np.asarray(small, dtype=np.float64)
    low = (_DCT8 @ pixels @ _DCT8.T).ravel()
    bits = low > np.median(low[1:])
    return int.from_bytes(np.packbits(bits).tobytes(), "big")  # bits[0] is the top bit


def encode(img: Image.Image, fmt: str, quality: int, exif: bytes | None = None) -> bytes:
    """``img`` in ``fmt``, with no metadata but the ``exif`` given (fields a recipe keeps)."""
    img.info = {}  # no ICC, EXIF, text or dpi carried over from the source
    out = io.BytesIO()
    extra = {"exif": exif} if exif else {}
    if fmt == "jpeg":
        img.save(out, "JPEG", quality=quality, **extra)
    elif fmt == "webp":
        img.save(out, "WEBP", quality=quality, **extra)
    else:
        img.save(out, "PNG", compress_level=6, **extra)
    return out.getvalue()


def thumbnail(rgb: Image.Image) -> bytes:
    small = rgb.resize(thumb_dims(rgb.width, rgb.height), Image.Resampling.BICUBIC, reducing_gap=2.0)
    return encode(small, "jpeg", THUMBNAIL_QUALITY)


def scale(rgb: Image.Image, dims: tuple[int, int], box: tuple[float, float, float, float] | None) -> Image.Image:
    """Scale to ``dims``, from ``box`` when the image was drafted: area average down, Lanczos up."""
    if dims == rgb.size and box is None:
        return rgb
    src_w = box[2] - box[0] if box else rgb.width
    resample = Image.Resampling.BOX if dims[0] <= src_w else Image.Resampling.LANCZOS
    return rgb.resize(dims, resample, box=box)


def crop_or_pad(scaled: Image.Image, rules: ImageRules) -> Image.Image:
    """The centre square (``center_crop``) or the picture on a white square (``border``)."""
    size = rules.image_size
    w, h = scaled.size
    if (w, h) == (size, size) or rules.resize_mode not in ("center_crop", "border"):
        return scaled
    if rules.resize_mode == "center_crop":
        left, top = (w - size) // 2, (h - size) // 2
        return scaled.crop((left, top, left + size, top + size))
    canvas = Image.new("RGB", (size, size), WHITE)
    canvas.paste(scaled, ((size - w) // 2, (size - h) // 2))
    return canvas
