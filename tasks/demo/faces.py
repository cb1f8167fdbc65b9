"""Pictures with faces at known boxes: the demo's face-like content, and the labelled set the face detector is measured on."""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageOps

Box = tuple[int, int, int, int]  # x, y, w, h in pixels

FACES_DIR = Path(__file__).parent / "data" / "faces"
# The bundled crop (see data/faces/README.txt) and its face's box inside it, boxed by hand from
# the eyebrows' top to the chin and from cheek to cheek, as frontal detectors box a face.
ASTRONAUT_CROP = "astronaut.jpg"
ASTRONAUT_FACE: Box = (32, 36, 94, 104)

# scikit-image's photographs (skimage/data, inside its wheel), faces boxed by hand once.
# astronaut.png: Eileen Collins, NASA, public domain; camera.png: CC0 (a three-quarter profile
# behind a camera, which frontal detectors are not expected to find).
PHOTO_FACES: dict[str, tuple[Box, ...]] = {
    "astronaut.png": ((178, 76, 94, 104),),
    "camera.png": ((190, 122, 66, 74),),
}
PHOTO_NO_FACE = (
    "brick.png",
    "cell.png",
    "chelsea.png",
    "clock_motion.png",
    "coffee.png",
    "coins.png",
    "color.png",
    "grass.png",
    "gravel.png",
    "horse.png",
    "hubble_deep_field.jpg",
    "ihc.png",
    "logo.png",
    "moon.png",
    "motorcycle_left.png",
    "page.png",
    "retina.jpg",
    "rocket.jpg",
    "text.png",
)
BACKGROUNDS = ("noise", "gradient", "shapes", "photo", "collage")


@dataclass(frozen=True)
class Labelled:
    """One picture of the labelled set.

    Args:
        name: where it comes from (a photo's file name, or the generator and its index).
        group: ``photos`` (scikit-image's photographs), ``lfw`` (scikit-image's LFW subset:
            100 real faces of different people, 25 px crops, pasted) or ``generated`` (the
            astronaut's face scaled, mirrored and brightness-jittered, pasted).
        rgb: the picture.
        boxes: its faces.
    """

    name: str
    group: str
    rgb: Image.Image
    boxes: tuple[Box, ...]


def iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes."""
    ix = max(0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = a[2] * a[3] + b[2] * b[3] - inter
    return inter / union if union else 0.0


def match(found: list[Box], truth: tuple[Box, ...] | list[Box], at: float = 0.4) -> int:
    """How many of ``truth`` are matched one to one by ``found`` at IoU >= ``at`` (greedy, best first)."""
    pairs = sorted(((iou(f, t), i, j) for i, f in enumerate(found) for j, t in enumerate(truth)), reverse=True)
    used_f: set[int] = set()
    used_t: set[int] = set()
    for score, i, j in pairs:
        if score < at:
            break
        if i not in used_f and j not in used_t:
            used_f.add(i)
            used_t.add(j)
    return len(used_t)


@functools.cache
def astronaut_crop() -> Image.Image:
    """The bundled face crop (RGB), loaded once."""
    with Image.open(FACES_DIR / ASTRONAUT_CROP) as img:
        return img.convert("RGB")


def skimage_data() -> Path | None:
    """scikit-image's data folder, or None where it is not installed (only the bench and tests use it)."""
    try:
        import skimage
    except ImportError:
        return None
    path = Path(skimage.__file__).parent / "data"
    return path if path.is_dir() else None


def _photo(name: str) -> Image.Image:
    folder = skimage_data()
    if folder is None:
        raise FileNotFoundError("scikit-image is not installed")
    with Image.open(folder / name) as img:
        if img.mode in ("RGBA", "LA", "P"):
            rgba = img.convert("RGBA")
            flat = Image.new("RGB", rgba.size, (255, 255, 255))
            flat.paste(rgba, mask=rgba.getchannel("A"))
            return flat
        return img.convert("RGB")


@functools.cache
def _lfw() -> tuple[tuple[Image.Image, ...], tuple[Image.Image, ...]]:
    """scikit-image's LFW subset: 100 face crops and 100 face-free patches, 25 x 25 grey."""
    folder = skimage_data()
    if folder is None or not (folder / "lfw_subset.npy").is_file():
        return (), ()
    arr = np.load(folder / "lfw_subset.npy")
    tiles = tuple(Image.fromarray(np.round(a * 255).astype(np.uint8)).convert("RGB") for a in arr)
    return tiles[:100], tiles[100:]


def background(rng: np.random.Generator, width: int, height: int, kind: str) -> Image.Image:
    """A face-free background: coarse noise, a gradient, drawn shapes, a face-free photo or a collage of these."""
    if kind == "photo" and skimage_data() is not None:
        src = _photo(PHOTO_NO_FACE[int(rng.integers(len(PHOTO_NO_FACE)))])
        scale = max(width / src.width, height / src.height) * float(rng.uniform(1.0, 1.6))
        src = src.resize((max(width, round(src.width * scale)), max(height, round(src.height * scale))))
        x0 = int(rng.integers(src.width - width + 1))
        y0 = int(rng.integers(src.height - height + 1))
        return src.crop((x0, y0, x0 + width, y0 + height))
    if kind == "collage":
        out = Image.new("RGB", (width, height))
        cols, rows = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        for r in range(rows):
            for c in range(cols):
                x0, x1 = c * width // cols, (c + 1) * width // cols
                y0, y1 = r * height // rows, (r + 1) * height // rows
                part = str(rng.choice(["noise", "gradient", "shapes", "photo"]))
                out.paste(background(rng, max(1, x1 - x0), max(1, y1 - y0), part), (x0, y0))
        return out
    if kind == "gradient" or kind == "photo":
        a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        angle = float(rng.uniform(0, math.pi))
        yy, xx = np.mgrid[0:height, 0:width]
        t = (xx * math.cos(angle) + yy * math.sin(angle)).astype(np.float32)
        t = (t - t.min()) / max(1.0, float(t.max() - t.min()))
        pix = a[None, None, :] * (1 - t[..., None]) + b[None, None, :] * t[..., None]
        pix += rng.normal(0, 4, pix.shape)
        return Image.fromarray(np.clip(pix, 0, 255).astype(np.uint8))
    if kind == "shapes":
        img = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(0, 256, 3)))
        draw = ImageDraw.Draw(img)
        for _ in range(int(rng.integers(3, 25))):
            x0, y0 = int(rng.integers(-width // 4, width)), int(rng.integers(-height // 4, height))
            x1 = x0 + int(rng.integers(8, max(9, width // 2)))
            y1 = y0 + int(rng.integers(8, max(9, height // 2)))
            fill = tuple(int(v) for v in rng.integers(0, 256, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=fill)
        return img
    # coarse noise: a few random octaves, upsampled
    pix = np.zeros((height, width, 3), np.float32)
    for cells in (4, 16, 64):
        small = rng.uniform(-1, 1, (max(1, height * cells // 512), max(1, width * cells // 512), 3))
        up = Image.fromarray(((small + 1) * 127.5).astype(np.uint8)).resize((width, height), Image.Resampling.BICUBIC)
        pix += (np.asarray(up, np.float32) - 127.5) * (64 / cells) ** 0.5
    pix = pix / 3 + rng.uniform(60, 190, 3)
    return Image.fromarray(np.clip(pix, 0, 255).astype(np.uint8))


def face_tile(
    rng: np.random.Generator, crop: Image.Image, face: Box, side: int, jitter: bool
) -> tuple[Image.Image, Box]:
    """``crop`` scaled so that its face is ``side`` px wide, maybe mirrored and brightness-jittered; the face's box in the tile."""
    scale = side / face[2]
    tile = crop.resize(
        (max(1, round(crop.width * scale)), max(1, round(crop.height * scale))), Image.Resampling.LANCZOS
    )
    box = (round(face[0] * scale), round(face[1] * scale), round(face[2] * scale), round(face[3] * scale))
    if jitter and rng.random() < 0.5:
        tile = ImageOps.mirror(tile)
        box = (tile.width - box[0] - box[2], box[1], box[2], box[3])
    if jitter:
        tile = ImageEnhance.Brightness(tile).enhance(float(rng.uniform(0.6, 1.4)))
    return tile, box


def _place(
    rng: np.random.Generator, size: tuple[int, int], taken: list[Box], w: int, h: int, tries: int = 40
) -> tuple[int, int] | None:
    """A free spot for a ``w`` x ``h`` tile that overlaps no tile already placed, or None."""
    if w > size[0] or h > size[1]:
        return None
    for _ in range(tries):
        x, y = int(rng.integers(size[0] - w + 1)), int(rng.integers(size[1] - h + 1))
        if all(x + w <= t[0] or t[0] + t[2] <= x or y + h <= t[1] or t[1] + t[3] <= y for t in taken):
            return x, y
    return None


def _composite(
    rng: np.random.Generator,
    name: str,
    group: str,
    sources: list[tuple[Image.Image, Box]],
    faces: int,
    side_range: tuple[int, int],
    distractors: tuple[Image.Image, ...] = (),
) -> Labelled:
    width, height = (int(v) for v in rng.integers(256, 1025, 2))
    img = background(rng, width, height, str(rng.choice(BACKGROUNDS)))
    taken: list[Box] = []
    boxes: list[Box] = []
    for _ in range(faces):
        crop, face = sources[int(rng.integers(len(sources)))]
        hi = min(side_range[1], int(min(width, height) * face[2] / max(crop.width, crop.height) * 0.9))
        if hi < side_range[0]:
            continue
        side = int(math.exp(rng.uniform(math.log(side_range[0]), math.log(hi))))
        tile, box = face_tile(rng, crop, face, side, jitter=True)
        spot = _place(rng, (width, height), taken, tile.width, tile.height)
        if spot is None:
            continue
        img.paste(tile, spot)
        taken.append((spot[0], spot[1], tile.width, tile.height))
        boxes.append((spot[0] + box[0], spot[1] + box[1], box[2], box[3]))
    for patch in distractors:
        side = int(rng.integers(24, 160))
        spot = _place(rng, (width, height), taken, side, side)
        if spot is not None:
            img.paste(patch.resize((side, side), Image.Resampling.BICUBIC), spot)
            taken.append((spot[0], spot[1], side, side))
    return Labelled(name, group, img, tuple(boxes))


def labelled_set(generated: int = 120, lfw: int = 60, seed: int = 0) -> list[Labelled]:
    """The labelled set: scikit-image's photographs, LFW faces pasted, and generated composites.

    The photographs and the LFW group need scikit-image (absent without it); ``generated``
    pictures are always made, from the bundled crop: 256-1024 px, 0-4 faces of 24-300 px each
    (a fifth have none), on noise, gradients, shapes, face-free photos or collages of these.
    """
    rng = np.random.default_rng(seed)
    out: list[Labelled] = []
    if skimage_data() is not None:
        out += [Labelled(n, "photos", _photo(n), b) for n, b in PHOTO_FACES.items()]
        out += [Labelled(n, "photos", _photo(n), ()) for n in PHOTO_NO_FACE]
        faces, patches = _lfw()
        # the LFW crops span about the face itself: the whole tile is the box
        lfw_sources = [(f, (0, 0, f.width, f.height)) for f in faces]
        for i in range(lfw if faces else 0):
            count = 0 if i % 5 == 4 else int(rng.integers(1, 4))
            picks = tuple(patches[int(k)] for k in rng.integers(0, len(patches), int(rng.integers(0, 4))))
            out.append(_composite(rng, f"lfw-{i}", "lfw", lfw_sources, count, (40, 100), picks))
    source = [(astronaut_crop(), ASTRONAUT_FACE)]
    for i in range(generated):
        count = 0 if i % 5 == 4 else int(rng.integers(1, 5))
        out.append(_composite(rng, f"generated-{i}", "generated", source, count, (24, 300)))
    return out


def face_picture(seed: int, size: int, faces: int) -> tuple[bytes, list[Box]]:
    """A ``size`` x ``size`` JPEG with ``faces`` copies of the bundled face at known boxes.

    Made to be found: upright, unmirrored faces of at least 48 px, one to a cell of a grid, on a
    gradient or drawn shapes; tests/test_faces.py checks that the detector finds every face for
    seeds 0-15 at 256 and 512 px with 1-4 faces.
    """
    rng = np.random.default_rng(seed)
    img = background(rng, size, size, "gradient" if seed % 2 else "shapes")
    boxes: list[Box] = []
    if faces > 0:
        per_side = math.ceil(math.sqrt(faces))
        cell = size // per_side
        crop = astronaut_crop()
        # the tile must fit its cell: the crop is a little taller than wide
        most = int(cell * 0.9 * ASTRONAUT_FACE[2] / max(crop.width, crop.height))
        for k in range(faces):
            side = int(rng.integers(min(48, most), most + 1)) if most > 48 else most
            tile, box = face_tile(rng, crop, ASTRONAUT_FACE, max(8, side), jitter=False)
            cx, cy = (k % per_side) * cell, (k // per_side) * cell
            x = cx + int(rng.integers(0, max(1, cell - tile.width + 1)))
            y = cy + int(rng.integers(0, max(1, cell - tile.height + 1)))
            img.paste(tile, (x, y))
            boxes.append((x + box[0], y + box[1], box[2], box[3]))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue(), boxes
