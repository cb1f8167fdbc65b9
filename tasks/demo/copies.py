"""Copies of pictures as the web makes them (crops, flips, re-encodes, overlays) and stock watermarks, for the demo."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw, ImageFont

COPY_KINDS = ("crop", "flip", "resize", "overlay")


def overlay(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A small logo in a corner (a few per cent of the picture), as reposts carry."""
    out = img.copy()
    d = ImageDraw.Draw(out)
    s = max(4, int(min(img.size) * rng.uniform(0.12, 0.2)))
    x = int(rng.choice([2, img.width - s - 2]))
    y = int(rng.choice([2, img.height - s - 2]))
    colour = tuple(int(c) for c in rng.integers(0, 255, 3))
    if rng.random() < 0.5:
        d.rectangle([x, y, x + s, y + s // 2], fill=colour)
    else:
        d.ellipse([x, y, x + s, y + s], fill=colour, outline=(255, 255, 255))
    return out


def watermark(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A stock-photo watermark: rows of semi-transparent text across the whole picture, sized to it."""
    base = img.convert("RGBA")
    layer = Image.new("RGBA", base.size, (0, 0, 0, 0))
    d = ImageDraw.Draw(layer)
    text = str(rng.choice(["SAMPLE", "PREVIEW", "(c) STOCK", "WATERMARK"]))
    size = max(8, int(base.height / rng.uniform(5, 8)))
    font = ImageFont.load_default(size=size)
    alpha = int(rng.integers(120, 190))
    width = int(d.textlength(text, font=font)) + size
    for n, y in enumerate(range(int(rng.integers(0, size)), base.height, int(size * 1.8))):
        for x in range(-width + (n % 2) * width // 2, base.width, width):
            d.text((x, y), text, font=font, fill=(255, 255, 255, alpha))
    return Image.alpha_composite(base, layer).convert("RGB")


def augment(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A copy of the kind reposts make: crop, flip, re-encode at another size, a small overlay."""
    out = img
    if rng.random() < 0.7:  # crop 75..97% of each side
        fw, fh = rng.uniform(0.75, 0.97, 2)
        cw, ch = max(8, int(out.width * fw)), max(8, int(out.height * fh))
        x, y = int(rng.integers(0, out.width - cw + 1)), int(rng.integers(0, out.height - ch + 1))
        out = out.crop((x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if rng.random() < 0.5:  # another size and quality
        scale = rng.uniform(0.5, 0.9)
        out = out.resize((max(8, int(out.width * scale)), max(8, int(out.height * scale))), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        out.save(buf, "JPEG", quality=int(rng.integers(40, 90)))
        out = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    if rng.random() < 0.3:
        out = overlay(out, rng)
    return out


def make_copy(img: Image.Image, kind: str, rng: np.random.Generator) -> Image.Image:
    """One augmented copy of ``kind`` (``COPY_KINDS``): what the demo's duplicate rows hold."""
    img = img.convert("RGB")
    if kind == "crop":  # 88..94% of each side, off centre
        f = rng.uniform(0.88, 0.94)
        cw, ch = int(img.width * f), int(img.height * f)
        x, y = int(rng.integers(0, img.width - cw + 1)), int(rng.integers(0, img.height - ch + 1))
        return img.crop((x, y, x + cw, y + ch))
    if kind == "flip":
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if kind == "resize":  # another size and quality
        scale = rng.uniform(0.55, 0.75)
        small = img.resize((int(img.width * scale), int(img.height * scale)), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        small.save(buf, "JPEG", quality=int(rng.integers(55, 75)))
        return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    if kind == "overlay":
        return overlay(img, rng)
    raise ValueError(f"unknown copy kind {kind!r}; one of {', '.join(COPY_KINDS)}")
