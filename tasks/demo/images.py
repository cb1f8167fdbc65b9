"""The demo's images: seeded scenes of shapes with captions, authors and licenses, rendered once and stamped."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tasks.demo.scenes import add_grain, draw_scene, pick, scene_combos, write_caption

# Bump when the generator's output changes, so a stamp from an older version is not reused.
GENERATOR_VERSION = 1
STAMP_NAME = ".demo-images.json"  # outside images/, so the server never serves it
EXPECTED_NAME = "EXPECTED.json"
MIN_IMAGES = 20  # below this a manifest may lack the images its special rows take over
SOURCES = ("photos", "art", "scans")
MANIFEST_FILES = {"photos": "photos.csv", "art": "art.jsonl.gz", "scans": "scans.parquet"}
COLUMNS = ("url", "caption", "license", "author", "width", "height")

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


def _size(rng: np.random.Generator, index: int) -> tuple[int, int]:
    if index in _FORCED_SIZES:
        short, aspect = _FORCED_SIZES[index]
    else:
        # Skewed towards small images (as crawls are) while spanning 200..1200; keeps the
        # corpus quick to encode.
        short = int(round(200 + 1000 * rng.beta(1.3, 3.5)))
        aspect = pick(rng, _COMMON_ASPECTS) if rng.random() < 0.4 else float(rng.uniform(0.5, 2.5))
    if aspect >= 1:
        return int(round(short * aspect)), short
    return short, int(round(short / aspect))


def scene_combo(seed: int, index: int) -> tuple[str, str, str]:
    """Picture ``index``'s sky, ground and first colour: a shuffle of every combination per
    ``seed``, so the first ``len(scene_combos())`` (360) pictures each have their own."""
    combos = scene_combos()
    order = np.random.default_rng([seed, 0x5CE7E]).permutation(len(combos))
    return combos[int(order[index % len(combos)])]


def render_image(seed: int, index: int) -> tuple[str, bytes, dict[str, Any]]:
    """Make image ``index`` of the corpus for ``seed``: its file name, bytes and metadata."""
    rng = np.random.default_rng([seed, index])
    kind = _FORCED_KINDS.get(index) or pick(rng, list(KINDS), [k[0] for k in KINDS.values()])
    _, fmt, ext, mode = KINDS[kind]
    w, h = _size(rng, index)
    img, drawn = draw_scene(rng, w, h, transparent=(mode == "RGBA"), combo=scene_combo(seed, index))
    if mode == "L":
        img = img.convert("L")
    photo = fmt in ("JPEG", "WEBP")
    if photo:
        # Sensor grain at full size: photos are not flat, and flat JPEGs are unrealistically small.
        img = add_grain(rng, img, int(rng.integers(3, 9)))
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
        "caption": write_caption(rng, drawn, kind),
        "license": pick(rng, [x[0] for x in LICENSES], [x[1] for x in LICENSES]),
        "author": pick(rng, AUTHORS),
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
