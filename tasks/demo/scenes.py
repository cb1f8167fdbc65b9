"""The demo's scenes: skies, grounds and shapes drawn with a seeded generator, the caption of what was drawn, sensor grain."""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
from PIL import Image, ImageChops, ImageDraw

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


def pick(rng: np.random.Generator, items: list[Any] | tuple[Any, ...], weights: list[float] | None = None) -> Any:
    """One of ``items``, uniformly or by ``weights``."""
    if weights is None:
        return items[int(rng.integers(len(items)))]
    p = np.asarray(weights, dtype=float)
    return items[int(rng.choice(len(items), p=p / p.sum()))]


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


def draw_shape(
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


def scene_combos() -> list[tuple[str, str, str]]:
    """Every (sky, ground, colour of the first shapes) a scene can have."""
    return [(s, g, c) for s in SKIES for g in GROUNDS for c in COLOURS]


def draw_scene(
    rng: np.random.Generator, w: int, h: int, transparent: bool, combo: tuple[str, str, str] | None = None
) -> tuple[Image.Image, dict[str, Any]]:
    """Draw a scene at (w, h); return it and what was drawn, for the caption.

    ``combo``: the sky, ground and colour of the first shapes (``scene_combos``), else drawn at
    random; the demo corpus gives each picture its own, so no two of its pictures are the same
    scene told twice (a semantic duplicate nobody planted)."""
    sky_key = combo[0] if combo else pick(rng, list(SKIES))
    ground_key = combo[1] if combo else pick(rng, list(GROUNDS))
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
    for n in range(int(rng.integers(1, 4))):
        colour, shape = pick(rng, list(COLOURS)), pick(rng, SHAPES)
        if combo and n == 0:
            colour = combo[2]
        elif combo and colour == combo[2]:
            continue  # the first colour is this picture's own
        if (colour, shape) in seen:
            continue
        seen.add((colour, shape))
        count = int(pick(rng, [1, 1, 1, 2, 2, 3, 4]))
        groups.append((count, colour, shape))
        rgb = COLOURS[colour]
        fill = rgb + (255,) if transparent else rgb
        for _ in range(count):
            r = min(w, h) * rng.uniform(0.04, 0.13)
            cx = rng.uniform(r, w - r)
            cy = rng.uniform(r, max(r + 1, horizon - r)) if not transparent else rng.uniform(r, h - r)
            draw_shape(draw, shape, fill, cx, cy, r, rng)
    return img, {"sky": sky_key, "ground": ground_key, "groups": groups}


def write_caption(rng: np.random.Generator, drawn: dict[str, Any], kind: str) -> str:
    """What ``draw_scene`` drew, in the words and the inconsistent style of real captions."""
    gray = kind == "jpeg-gray"
    shapes = _join([_count_phrase(c, None if gray else col, s) for c, col, s in drawn["groups"]])
    if kind == "png-rgba":
        text = pick(
            rng, ["{s} on a transparent background", "sticker of {s}", "{s}, isolated, transparent png"]
        ).format(s=shapes)
    else:
        when = SKIES[drawn["sky"]][0]
        coloured, plain = GROUNDS[drawn["ground"]][:2]
        ground = plain if gray else coloured
        template = pick(
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


def add_grain(rng: np.random.Generator, img: Image.Image, strength: int) -> Image.Image:
    """``img`` with sensor grain of ``strength`` added."""
    grain = _grain(rng, img.width, img.height, strength)
    if img.mode == "RGB":
        grain = Image.merge("RGB", (grain, grain, grain))
    return ImageChops.add(img, grain, offset=-strength)
