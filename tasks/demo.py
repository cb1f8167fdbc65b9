"""The demo corpus: real-looking images with captions and licenses, and manifests that point at a loopback server."""

from __future__ import annotations

import csv
import gzip
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
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageChops, ImageDraw

from tasks.reasons import OK, status_of
from tasks.webserver import ImageWeb

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
    "Ana Lima", "Kenji Watanabe", "Zoë Müller", "Søren Ødegaard", "Priya Raman", "Tomás Herrera",
    "Li Wei", "Fatima Zahra", "Olu Adeyemi", "Marta Kowalska", "@skyward_lens", "jdoe_photos",
    "Emma O'Brien", "Nguyễn Thị Lan", "Ivan Petrov", "Grace Hopper Camera Club", "anonymous",
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


@dataclass(frozen=True)
class BadRow:
    """A deliberately bad manifest row and the reason the pipeline should give it.

    Args:
        source: the manifest it is written to (``photos``, ``art``, ``scans``).
        url: URL template: ``{base}`` is the server, ``{name}`` an image of that manifest
            (the row then takes over that image's row instead of adding one); ``None`` with
            ``raw`` set writes a raw line instead of a row.
        reason: the ledger reason, or None when the row should end up ok.
        why: what the row exercises.
        raw: a raw manifest line (jsonl only), for rows that must not parse.
        image_format: the format the taken-over image must have, when it matters.
    """

    source: str
    url: str | None
    reason: str | None
    why: str
    raw: str | None = None
    image_format: str | None = None


BAD_ROWS: tuple[BadRow, ...] = (
    BadRow("photos", "{base}/status/404", "http_404", "the server answers 404 Not Found"),
    BadRow("photos", "{base}/html-as-jpeg", "not_an_image", "an HTML page labelled image/jpeg; formats are sniffed from bytes"),
    BadRow("photos", "", "missing_url", "an empty url field in the CSV"),
    BadRow("art", "{base}/truncated/{name}", "truncated_image", "the first half of a JPEG, with a matching Content-Length", image_format="JPEG"),
    BadRow("art", "{base}/optout/{name}", "opted_out", "X-Robots-Tag: noai, noimageai"),
    BadRow("art", None, "unparsable_row", "a jsonl line cut off mid-string", raw='{"url": "{base}/img/lost.jpg", "caption": "a torn line of js'),
    BadRow("scans", "ftp://ftp.example.org/pub/scans/lighthouse.jpg", "unsupported_scheme", "ftp:// is not fetched"),
    BadRow("scans", None, "missing_url", "a null url in the parquet"),
)

# Rows that look like trouble but must end up ok under the demo recipe (retries >= 1,
# max_redirects >= 2, max_retry_after_s >= 1): they take over an image's row.
TRICKY_ROWS: tuple[BadRow, ...] = (
    BadRow("photos", "{base}/redirect-chain/2/{name}", None, "two redirect hops, then the image"),
    BadRow("photos", "{base}/ratelimit/1/1/{name}", None, "one 429 with Retry-After: 1, then the image"),
    BadRow("art", "{base}/flaky/1/{name}", None, "one 500, then the image on the retry"),
    BadRow("scans", "{base}/optout-other-bot/{name}", None, "X-Robots-Tag scoped to another user agent is not an opt-out"),
)


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
        (cx + radii[k % len(radii)] * math.sin(rot + 2 * math.pi * k / n), cy - radii[k % len(radii)] * math.cos(rot + 2 * math.pi * k / n))
        for k in range(n)
    ]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, colour: tuple[int, ...], cx: float, cy: float, r: float, rng: np.random.Generator) -> None:
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
        text = _pick(rng, ["{s} on a transparent background", "sticker of {s}", "{s}, isolated, transparent png"]).format(s=shapes)
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
    _atomic_write(stamp, json.dumps({"version": GENERATOR_VERSION, "n": n, "seed": seed, "images": [asdict(i) for i in infos]}, indent=1).encode())
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
    if not isinstance(stamp, dict) or (stamp.get("version"), stamp.get("n"), stamp.get("seed")) != (GENERATOR_VERSION, n, seed):
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


# --------------------------------------------------------------------------- manifests


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _source_of(index: int) -> str:
    # About half photos, a third art, a sixth scans, interleaved so each spans the corpus.
    return ("photos", "photos", "photos", "art", "art", "scans")[index % 6]


def _truncates_cleanly(data: bytes) -> bool:
    """True when the first half of a JPEG has no end-of-image marker (so it reads as truncated)."""
    half = data[: len(data) // 2]
    return half.startswith(b"\xff\xd8\xff") and half.rfind(b"\xff\xd9") < 2


def _plan(images: list[ImageInfo], images_dir: Path) -> dict[str, list[tuple[dict[str, Any] | str, BadRow | None]]]:
    """Rows per source: (row dict or raw line, the special row it came from or None)."""
    plan: dict[str, list[tuple[dict[str, Any] | str, BadRow | None]]] = {s: [] for s in SOURCES}
    for info in images:
        plan[_source_of(info.index)].append(({"image": info}, None))

    for source in SOURCES:
        specials = [r for r in (*BAD_ROWS, *TRICKY_ROWS) if r.source == source]
        rows = plan[source]
        base_len = len(rows)
        taken: set[int] = set()
        inserts: list[tuple[int, BadRow]] = []
        for k, special in enumerate(specials):
            # Spread the special rows through the manifest rather than bunching them.
            pos = (k + 1) * base_len // (len(specials) + 1)
            if special.url is not None and "{name}" in special.url:
                for step in range(base_len):
                    j = (pos + step) % base_len
                    if j in taken:
                        continue
                    info = rows[j][0]["image"]  # type: ignore[index]
                    if special.image_format and info.format != special.image_format:
                        continue
                    if special.reason == "truncated_image" and not _truncates_cleanly((images_dir / info.name).read_bytes()):
                        continue
                    taken.add(j)
                    rows[j] = ({"image": info, "url": special.url}, special)
                    break
                else:
                    raise ValueError(f"no image in {source} suits the special row {special.url!r}; use a larger corpus")
            else:
                inserts.append((pos, special))
        for offset, (pos, special) in enumerate(inserts):
            rows.insert(pos + offset, (special.raw if special.raw is not None else {"url": special.url}, special))
    return plan


_EXTRA_CAPTIONS = {
    "photos": "lighthouse on a rocky coast under a stormy sky",
    "art": "watercolour of a harbour at sunset",
    "scans": "scanned postcard of a lighthouse, 1952",
}


def _materialize(source: str, item: dict[str, Any] | str, base_url: str, salt: int) -> dict[str, Any] | str:
    if isinstance(item, str):
        return item.replace("{base}", base_url)
    info: ImageInfo | None = item.get("image")
    if info is None:
        url = item["url"]
        return {
            "url": url.replace("{base}", base_url) if url is not None else None,
            "caption": _EXTRA_CAPTIONS[source],
            "license": LICENSES[salt % len(LICENSES)][0],
            "author": AUTHORS[salt % len(AUTHORS)],
            "width": None,
            "height": None,
        }
    template = item.get("url", "{base}/img/{name}")
    return {
        "url": template.replace("{base}", base_url).replace("{name}", info.name),
        "caption": info.caption,
        "license": info.license,
        "author": info.author,
        "width": info.width,
        "height": info.height,
    }


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row[k] is None else row[k] for k in COLUMNS})
    _atomic_write(path, buf.getvalue().encode("utf-8"))


def _write_jsonl_gz(path: Path, rows: list[dict[str, Any] | str]) -> None:
    lines = []
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
        else:
            # Real jsonl manifests leave out fields they do not have rather than writing null.
            lines.append(json.dumps({k: v for k, v in row.items() if v is not None}, ensure_ascii=False))
    buf = io.BytesIO()
    # mtime=0 and no file name: the same rows give the same bytes.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:
        gz.write(("\n".join(lines) + "\n").encode("utf-8"))
    _atomic_write(path, buf.getvalue())


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    schema = pa.schema(
        [
            ("url", pa.string()),
            ("caption", pa.string()),
            ("license", pa.string()),
            ("author", pa.string()),
            ("width", pa.int32()),
            ("height", pa.int32()),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    _atomic_write(path, buf.getvalue().to_pybytes())


def write_manifests(out_dir: Path, images: list[ImageInfo], base_url: str) -> dict[str, Path]:
    """Write photos.csv, art.jsonl.gz and scans.parquet under ``out_dir/manifests/``, and EXPECTED.json.

    Every image gets exactly one row; the rows in ``BAD_ROWS`` and ``TRICKY_ROWS`` either take
    over an image's row (their URL has ``{name}``) or are added. Returns source -> path.
    """
    out_dir = Path(out_dir)
    if len(images) < MIN_IMAGES:
        raise ValueError(f"the demo manifests need at least {MIN_IMAGES} images, got {len(images)}")
    base_url = base_url.rstrip("/")
    manifests = out_dir / "manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    plan = _plan(images, out_dir / "images")

    expected: dict[str, Any] = {
        "images": len(images),
        "base_url": base_url,
        "rows": 0,
        "ok": 0,
        "rejected": 0,
        "error": 0,
        "by_reason": {},
        "by_source": {},
        "ok_by_license": {},
    }
    paths: dict[str, Path] = {}
    for source in SOURCES:
        rows = [_materialize(source, item, base_url, salt) for salt, (item, _) in enumerate(plan[source])]
        path = manifests / MANIFEST_FILES[source]
        if source == "photos":
            _write_csv(path, rows)  # type: ignore[arg-type]
        elif source == "art":
            _write_jsonl_gz(path, rows)
        else:
            _write_parquet(path, rows)  # type: ignore[arg-type]
        paths[source] = path

        per: dict[str, Any] = {"rows": len(rows), "ok": 0, "by_reason": {}}
        for row, (_, special) in zip(rows, plan[source]):
            reason = special.reason if special is not None else None
            status = status_of(reason)
            expected[status] += 1
            if status == OK:
                per["ok"] += 1
                lic = row.get("license") if isinstance(row, dict) else None
                key = lic if lic is not None else ""
                expected["ok_by_license"][key] = expected["ok_by_license"].get(key, 0) + 1
            else:
                per["by_reason"][reason] = per["by_reason"].get(reason, 0) + 1
                expected["by_reason"][reason] = expected["by_reason"].get(reason, 0) + 1
        expected["by_source"][source] = per
        expected["rows"] += per["rows"]
    expected["by_reason"] = dict(sorted(expected["by_reason"].items()))
    expected["ok_by_license"] = dict(sorted(expected["ok_by_license"].items()))
    _atomic_write(manifests / EXPECTED_NAME, (json.dumps(expected, indent=2, ensure_ascii=False) + "\n").encode())
    return paths


def expected_outcomes(out_dir: Path) -> dict[str, Any]:
    """What the pipeline should make of the demo manifests, from ``manifests/EXPECTED.json``.

    ``rows``, ``ok``, ``rejected``, ``error``; ``by_reason`` over all sources; ``by_source``
    with each source's ``rows``, ``ok`` and ``by_reason``; ``ok_by_license`` counts the ok
    rows by their license string (``""`` when missing), for a license stage to predict its own
    rejections from.
    """
    return json.loads((Path(out_dir) / "manifests" / EXPECTED_NAME).read_text())


def prepare_demo(out_dir: Path, n: int = 300, seed: int = 0, port: int = 18765) -> tuple[ImageWeb, dict[str, Any]]:
    """Make (or reuse) the corpus, serve it on loopback and write manifests that point there.

    The preferred ``port`` keeps the manifests' URLs, and so their hashes, stable across
    reruns; a busy port falls back to an ephemeral one. The caller stops the returned server.
    """
    from tasks.tiny_models import make_all

    out_dir = Path(out_dir)
    images = ensure_images(out_dir, n, seed)
    make_all(out_dir / "models", ("vae", "clip-text"))  # tiny random-weight encoders for the precache phase
    server = ImageWeb(out_dir / "images", port=port).start()
    try:
        write_manifests(out_dir, images, server.base_url)
        expected = expected_outcomes(out_dir)
    except BaseException:
        server.stop()
        raise
    return server, expected
