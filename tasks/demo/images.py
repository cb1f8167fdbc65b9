"""The demo's images: seeded scenes of shapes with captions, authors and licenses, rendered once and stamped."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageChops, ImageDraw

# Bump when the generator's output changes, so a stamp from an older version is not reused.
GENERATOR_VERSION = 1
STAMP_NAME = ".demo-images.json"  # outside images/, so the server never serves it
EXPECTED_NAME = "EXPECTED.json"
MIN_IMAGES = 20  # below this a manifest may lack the images its special rows take over
SOURCES = ("photos", "art", "scans")
MANIFEST_FILES = {"photos": "photos.csv", "art": "art.jsonl.gz", "scans": "scans.parquet"}
COLUMNS = ("url", "caption", "license", "author", "width", "height")

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (205, 40, 40),
    "orange": (240, 140, 30),
    "yellow": (240, 210, 45),
    "green": (55, 160, 70),
    "blue": (40, 90, 205),
    "purple": (130, 60, 170),
    "pink": (240, 130, 175),
    "white": (245, 245, 242),
    "black": (25, 25, 28),
    "brown": (120, 80, 40),
    "grey": (128, 128, 130),
    "teal": (30, 140, 140),
}
SHAPES = ("circle", "square", "rectangle", "triangle", "star", "hexagon", "diamond")

# time of day -> (phrase, sky top, sky bottom)
SKIES: dict[str, tuple[str, tuple[int, int, int], tuple[int, int, int]]] = {
    "dawn": ("at dawn", (70, 90, 160), (250, 180, 140)),
    "morning": ("in the morning", (90, 150, 230), (190, 220, 250)),
    "noon": ("at noon", (40, 110, 220), (150, 200, 250)),
    "dusk": ("at dusk", (40, 40, 100), (240, 120, 60)),
    "night": ("at night", (5, 10, 30), (30, 40, 80)),
    "overcast": ("on an overcast day", (150, 155, 160), (205, 205, 210)),
}
# ground -> (phrase with colour, phrase without colour, near colour, far colour)
GROUNDS: dict[str, tuple[str, str, tuple[int, int, int], tuple[int, int, int]]] = {
    "meadow": ("a green horizon", "the horizon", (35, 85, 35), (70, 135, 60)),
    "field": ("a golden field", "a field", (150, 115, 45), (205, 175, 85)),
    "sea": ("a blue sea", "the sea", (10, 40, 90), (40, 95, 150)),
    "snow": ("a snowy plain", "a snowy plain", (200, 210, 222), (238, 242, 246)),
    "hills": ("brown hills", "hills", (65, 45, 28), (120, 88, 55)),
}

# The mix of license strings real manifests carry, spelled the ways they spell them.
LICENSES: tuple[tuple[str | None, float], ...] = (
    ("CC0-1.0", 0.15),
    ("CC-BY-4.0", 0.20),
    ("CC BY-SA 4.0", 0.12),
    ("cc-by 4.0", 0.08),
    ("https://creativecommons.org/licenses/by/4.0/", 0.10),
    ("https://creativecommons.org/publicdomain/zero/1.0/", 0.05),
    ("CC-BY-NC-4.0", 0.05),
    ("All rights reserved", 0.10),
    (None, 0.15),
)
AUTHORS = (
    "Ana Lima",
    "Kenji Watanabe",
    "Zoë Müller",
    "Søren Ødegaard",
    "Priya Raman",
    "Tomás Herrera",
    "Li Wei",
    "Fatima Zahra",
    "Olu Adeyemi",
    "Marta Kowalska",
    "@skyward_lens",
    "jdoe_photos",
    "Emma O'Brien",
    "Nguyễn Thị Lan",
    "Ivan Petrov",
    "Grace Hopper Camera Club",
    "anonymous",
)

# kind -> (weight, file format, extension, mode)
KINDS: dict[str, tuple[float, str, str, str]] = {
    "jpeg": (0.64, "JPEG", "jpg", "RGB"),
    "jpeg-gray": (0.03, "JPEG", "jpg", "L"),
    "png": (0.13, "PNG", "png", "RGB"),
    "png-rgba": (0.03, "PNG", "png", "RGBA"),
    "webp": (0.12, "WEBP", "webp", "RGB"),
    "gif": (0.05, "GIF", "gif", "P"),
}
# Small corpora still get one of every kind and both size extremes.
_FORCED_KINDS = {1: "png-rgba", 2: "gif", 3: "webp", 4: "jpeg-gray", 5: "png"}
_FORCED_SIZES = {6: (200, 1.0), 7: (1200, 2.5), 8: (300, 0.5)}
_COMMON_ASPECTS = (1.0, 4 / 3, 3 / 2, 3 / 4, 2 / 3, 16 / 9)


@dataclass(frozen=True)
class ImageInfo:
    """One generated image and what its manifest row says about it.

    Args:
        index: position in the corpus; images are generated independently per (seed, index).
        name: file name under ``images/``.
        format: Pillow format name (``JPEG``, ``PNG``, ``WEBP``, ``GIF``).
        mode: Pillow mode of the saved image (``RGB``, ``RGBA``, ``L``, ``P``).
        width, height: pixels.
        caption: what was drawn, in words.
        license: license string as a manifest would write it, or None when missing.
        author: the photographer or uploader.
        size: file size in bytes.
        sha256: hex digest of the file.
    """

    index: int
    name: str
    format: str
    mode: str
    width: int
    height: int
    caption: str
    license: str | None
    author: str
    size: int
    sha256: str


# --------------------------------------------------------------------------- images


def _pick(rng: np.random.Generator, items: list[Any] | tuple[Any, ...], weights: list[float] | None = None) -> Any:
    if weights is None:
        return items[int(rng.integers(len(items)))]
    p = np.asarray(weights, dtype=float)
    return items[int(rng.choice(len(items), p=p / p.sum()))]


def _size(rng: np.random.Generator, index: int) -> tuple[int, int]:
    if index in _FORCED_SIZES:
        short, aspect = _FORCED_SIZES[index]
    else:
        # Skewed towards small images (as crawls are) while spanning 200..1200; keeps the
        # corpus quick to encode.
        short = int(round(200 + 1000 * rng.beta(1.3, 3.5)))
        aspect = _pick(rng, _COMMON_ASPECTS) if rng.random() < 0.4 else float(rng.uniform(0.5, 2.5))
    if aspect >= 1:
        return int(round(short * aspect)), short
    return short, int(round(short / aspect))


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _count_phrase(count: int, colour: str | None, shape: str) -> str:
    noun = shape if count == 1 else shape + "s"
    words = [colour, noun] if colour else [noun]
    head = _article(words[0]) if count == 1 else ("two", "three", "four")[count - 2]
    return " ".join([head, *words])


def _join(parts: list[str]) -> str:
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _polygon(shape: str, cx: float, cy: float, r: float, rot: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        n, radii = 3, [r]
    elif shape == "hexagon":
        n, radii = 6, [r]
    elif shape == "diamond":
        n, radii = 4, [r]
        rot = 0.0
    else:  # star
        n, radii = 10, [r, r * 0.45]
    return [
        (
            cx + radii[k % len(radii)] * math.sin(rot + 2 * math.pi * k / n),
            cy - radii[k % len(radii)] * math.cos(rot + 2 * math.pi * k / n),
        )
        for k in range(n)
    ]


def _draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    colour: tuple[int, ...],
    cx: float,
    cy: float,
    r: float,
    rng: np.random.Generator,
) -> None:
    outline = tuple(max(0, c - 60) for c in colour[:3]) + colour[3:] if rng.random() < 0.5 else None
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour, outline=outline, width=2)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour, outline=outline, width=2)
    elif shape == "rectangle":
        ratio = float(rng.uniform(1.5, 2.6))
        w, h = (r * ratio, r / ratio * 1.3) if rng.random() < 0.5 else (r / ratio * 1.3, r * ratio)
        draw.rectangle([cx - w, cy - h, cx + w, cy + h], fill=colour, outline=outline, width=2)
    else:
        draw.polygon(_polygon(shape, cx, cy, r, float(rng.uniform(0, math.pi))), fill=colour, outline=outline)


def _gradient(a: tuple[int, int, int], b: tuple[int, int, int], n: int) -> np.ndarray:
    t = np.linspace(0.0, 1.0, max(n, 1), dtype=np.float32)[:, None]
    return (np.asarray(a, np.float32) + (np.asarray(b, np.float32) - np.asarray(a, np.float32)) * t).astype(np.uint8)


def _scene(rng: np.random.Generator, w: int, h: int, transparent: bool) -> tuple[Image.Image, dict[str, Any]]:
    """Draw a scene at (w, h); return it and what was drawn, for the caption."""
    sky_key = _pick(rng, list(SKIES))
    ground_key = _pick(rng, list(GROUNDS))
    _, top, bottom = SKIES[sky_key]
    _, _, near, far = GROUNDS[ground_key]
    horizon = int(h * rng.uniform(0.45, 0.8))

    if transparent:
        img = Image.new("RGBA", (w, h), (0, 0, 0, 0))
    else:
        # One column of gradient, stretched sideways: cheap at any width.
        column = np.concatenate([_gradient(top, bottom, horizon), _gradient(far, near, h - horizon)])[:h]
        img = Image.fromarray(column[:, None, :]).resize((w, h), Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(img)

    if not transparent:
        ground_band = img.crop((0, horizon, w, h))
        if sky_key in ("dawn", "dusk"):
            sx, sr = rng.uniform(0.1, 0.9) * w, min(w, h) * rng.uniform(0.05, 0.1)
            draw.ellipse([sx - sr, horizon - sr * 0.9, sx + sr, horizon + sr * 1.1], fill=(255, 205, 130))
        elif sky_key == "night":
            for _ in range(int(rng.integers(20, 60))):
                draw.point((rng.uniform(0, w), rng.uniform(0, horizon * 0.9)), fill=(230, 230, 210))
            mr = min(w, h) * 0.05
            mx, my = rng.uniform(0.1, 0.9) * w, horizon * rng.uniform(0.15, 0.4)
            draw.ellipse([mx - mr, my - mr, mx + mr, my + mr], fill=(235, 235, 215))
        elif sky_key in ("morning", "noon"):
            sr = min(w, h) * 0.04
            sx, sy = rng.uniform(0.1, 0.9) * w, horizon * rng.uniform(0.1, 0.35)
            draw.ellipse([sx - sr, sy - sr, sx + sr, sy + sr], fill=(255, 250, 220))
        # The ground goes back over the lower half of a setting sun; then hills or waves along
        # the horizon, so it is not a ruler-straight line.
        img.paste(ground_band, (0, horizon))
        amp = h * rng.uniform(0.0, 0.08)
        freq = rng.uniform(1.0, 4.0) * 2 * math.pi / w
        phase = rng.uniform(0, 2 * math.pi)
        ridge = [(x, horizon - amp * (0.5 + 0.5 * math.sin(freq * x + phase))) for x in range(0, w + 8, 8)]
        draw.polygon([*ridge, (w, horizon + 2), (0, horizon + 2)], fill=far)

    groups: list[tuple[int, str, str]] = []
    seen: set[tuple[str, str]] = set()
    for _ in range(int(rng.integers(1, 4))):
        colour, shape = _pick(rng, list(COLOURS)), _pick(rng, SHAPES)
        if (colour, shape) in seen:
            continue
        seen.add((colour, shape))
        count = int(_pick(rng, [1, 1, 1, 2, 2, 3, 4]))
        groups.append((count, colour, shape))
        rgb = COLOURS[colour]
        fill = rgb + (255,) if transparent else rgb
        for _ in range(count):
            r = min(w, h) * rng.uniform(0.04, 0.13)
            cx = rng.uniform(r, w - r)
            cy = rng.uniform(r, max(r + 1, horizon - r)) if not transparent else rng.uniform(r, h - r)
            _draw_shape(draw, shape, fill, cx, cy, r, rng)
    return img, {"sky": sky_key, "ground": ground_key, "groups": groups}


def _caption(rng: np.random.Generator, drawn: dict[str, Any], kind: str) -> str:
    gray = kind == "jpeg-gray"
    shapes = _join([_count_phrase(c, None if gray else col, s) for c, col, s in drawn["groups"]])
    if kind == "png-rgba":
        text = _pick(
            rng, ["{s} on a transparent background", "sticker of {s}", "{s}, isolated, transparent png"]
        ).format(s=shapes)
    else:
        when = SKIES[drawn["sky"]][0]
        coloured, plain = GROUNDS[drawn["ground"]][:2]
        ground = plain if gray else coloured
        template = _pick(
            rng,
            ["{s} above {g} {t}", "{s} over {g} {t}", "{T}, {s} above {g}", "{s} floating above {g} {t}"],
        )
        text = template.format(s=shapes, g=ground, t=when, T=when[0].upper() + when[1:])
        if gray:
            text = "black and white photo of " + text
    # Manifests are inconsistent about case and final stops; so are these.
    style = float(rng.random())
    if style < 0.35:
        text = text[0].upper() + text[1:]
    if style > 0.75:
        text += "."
    return text


_GRAIN_SIDE = 3100  # covers the largest image (3000 x 1200 or 1200 x 2400) at any offset that fits
_grain_field: Image.Image | None = None
_grain_lock = threading.Lock()


def _grain(rng: np.random.Generator, w: int, h: int, strength: int) -> Image.Image:
    """Uniform grain in 0..2*strength for a w x h image: a window of one shared random field.

    Drawing fresh noise per pixel was most of the corpus's generation time; a window at a
    random offset of a field made once (from a fixed seed) looks the same and costs a crop.
    """
    global _grain_field
    with _grain_lock:
        if _grain_field is None:
            field = np.random.default_rng(20240601).integers(0, 256, size=(_GRAIN_SIDE, _GRAIN_SIDE), dtype=np.uint8)
            _grain_field = Image.fromarray(field, "L")
    ox = int(rng.integers(0, _GRAIN_SIDE - w + 1))
    oy = int(rng.integers(0, _GRAIN_SIDE - h + 1))
    window = _grain_field.crop((ox, oy, ox + w, oy + h))
    return window.point([v * (2 * strength + 1) // 256 for v in range(256)])


def _add_grain(rng: np.random.Generator, img: Image.Image, strength: int) -> Image.Image:
    grain = _grain(rng, img.width, img.height, strength)
    if img.mode == "RGB":
        grain = Image.merge("RGB", (grain, grain, grain))
    return ImageChops.add(img, grain, offset=-strength)


def render_image(seed: int, index: int) -> tuple[str, bytes, dict[str, Any]]:
    """Make image ``index`` of the corpus for ``seed``: its file name, bytes and metadata."""
    rng = np.random.default_rng([seed, index])
    kind = _FORCED_KINDS.get(index) or _pick(rng, list(KINDS), [k[0] for k in KINDS.values()])
    _, fmt, ext, mode = KINDS[kind]
    w, h = _size(rng, index)
    img, drawn = _scene(rng, w, h, transparent=(mode == "RGBA"))
    if mode == "L":
        img = img.convert("L")
    photo = fmt in ("JPEG", "WEBP")
    if photo:
        # Sensor grain at full size: photos are not flat, and flat JPEGs are unrealistically small.
        img = _add_grain(rng, img, int(rng.integers(3, 9)))
    out = io.BytesIO()
    if fmt == "JPEG":
        img.save(out, "JPEG", quality=int(rng.integers(70, 96)), progressive=bool(rng.random() < 0.15))
    elif fmt == "WEBP":
        img.save(out, "WEBP", quality=int(rng.integers(70, 91)), method=2)
    elif fmt == "GIF":
        img = img.quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        img.save(out, "GIF")
    else:
        img.save(out, "PNG")
    data = out.getvalue()
    meta = {
        "index": index,
        "name": f"img{index:05d}.{ext}",
        "format": fmt,
        "mode": img.mode,
        "width": w,
        "height": h,
        "caption": _caption(rng, drawn, kind),
        "license": _pick(rng, [x[0] for x in LICENSES], [x[1] for x in LICENSES]),
        "author": _pick(rng, AUTHORS),
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    return meta["name"], data, meta


_NAME = re.compile(r"^img\d{5}\.(jpg|png|webp|gif)$")


def make_images(out_dir: Path, n: int = 300, seed: int = 0) -> list[ImageInfo]:
    """Generate ``n`` images into ``out_dir/images/``; the same (n, seed) gives the same bytes.

    Image ``i`` depends only on (seed, i), so a larger corpus extends a smaller one. Files of
    an earlier, larger corpus that this one does not make are removed. The stamp is written
    last, so its presence means the corpus is complete.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    out_dir = Path(out_dir)
    images_dir = out_dir / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / STAMP_NAME
    stamp.unlink(missing_ok=True)

    def one(index: int) -> ImageInfo:
        name, data, meta = render_image(seed, index)
        tmp = images_dir / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, images_dir / name)
        return ImageInfo(**meta)

    # Pillow and numpy release the GIL while encoding, resizing and adding noise, so threads
    # use both cores without the start-up cost of processes.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        infos = list(pool.map(one, range(n)))
    wanted = {i.name for i in infos}
    for path in images_dir.iterdir():
        if _NAME.match(path.name) and path.name not in wanted:
            path.unlink()
    atomic_write(
        stamp,
        json.dumps(
            {"version": GENERATOR_VERSION, "n": n, "seed": seed, "images": [asdict(i) for i in infos]}, indent=1
        ).encode(),
    )
    return infos


def load_images(out_dir: Path, n: int, seed: int) -> list[ImageInfo] | None:
    """The corpus recorded by the stamp when it matches (n, seed, generator version) and every file is there.

    Files are checked by size, not hash: cheap enough to run before every demo.
    """
    out_dir = Path(out_dir)
    try:
        stamp = json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or (stamp.get("version"), stamp.get("n"), stamp.get("seed")) != (
        GENERATOR_VERSION,
        n,
        seed,
    ):
        return None
    try:
        infos = [ImageInfo(**row) for row in stamp["images"]]
    except (KeyError, TypeError):
        return None
    for info in infos:
        try:
            if (out_dir / "images" / info.name).stat().st_size != info.size:
                return None
        except OSError:
            return None
    return infos


def ensure_images(out_dir: Path, n: int = 300, seed: int = 0) -> list[ImageInfo]:
    """The corpus for (n, seed): reused when the stamp matches, generated otherwise."""
    return load_images(out_dir, n, seed) or make_images(out_dir, n, seed)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
