"""How an image encoder wants its pixels (size, crop, normalisation), read from its folder, and Pillow's way there."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.models.placement import CurateError

# CLIP's normalisation, for folders that do not say theirs.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Preprocess:
    """How the encoder wants its pixels: resized (and cropped) to ``size``, then normalised.

    Args:
        size: the square side the vision tower takes.
        center_crop: resize the shorter side to ``size`` and crop the centre (CLIP's); else the
            whole image is resized to ``size`` x ``size`` (SigLIP's "squash").
        mean, std: per channel, of pixels in [0, 1].
    """

    size: int
    center_crop: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def read_json(path: Path, error: type[Exception] = CurateError) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise error(f"{path}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data


def _side(value: Any, default: int) -> int:
    """A transformers image-processor size: an int, or a dict with shortest_edge / height."""
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        for k in ("shortest_edge", "height", "width"):
            if isinstance(value.get(k), int):
                return int(value[k])
    return default


def transformers_preprocess(path: Path, image_size: int) -> Preprocess:
    """From ``preprocessor_config.json`` (transformers' image-processor keys), CLIP's otherwise."""
    pre = path / "preprocessor_config.json"
    data = read_json(pre) if pre.exists() else {}
    crop = bool(data.get("do_center_crop", not pre.exists()))
    size = _side(data.get("crop_size"), image_size) if crop else _side(data.get("size"), image_size)
    mean = tuple(float(x) for x in data.get("image_mean", CLIP_MEAN))
    std = tuple(float(x) for x in data.get("image_std", CLIP_STD))
    if len(mean) != 3 or len(std) != 3:
        raise CurateError(f"{pre}: image_mean and image_std need three values each")
    return Preprocess(size, crop, (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]))


def normalisation(path: Path) -> tuple[list[float], list[float]]:
    """A vision encoder's pixel mean and std, from its preprocessor config (CLIP's otherwise)."""
    pre = path / "preprocessor_config.json"
    if pre.exists():
        data = json.loads(pre.read_text())
        if "image_mean" in data and "image_std" in data:
            return [float(x) for x in data["image_mean"]], [float(x) for x in data["image_std"]]
    return list(CLIP_MEAN), list(CLIP_STD)


def pillow_pixels(data: bytes, pre: Preprocess) -> np.ndarray:
    """(3, S, S) float32 in [0, 1], resized (and cropped) as the encoder wants."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as src:
        img = src.convert("RGB")
    s = pre.size
    if pre.center_crop:
        scale = s / min(img.size)
        w, h = max(s, round(img.width * scale)), max(s, round(img.height * scale))
        img = img.resize((w, h), Image.Resampling.BILINEAR, reducing_gap=None)
        left, top = (w - s) // 2, (h - s) // 2
        img = img.crop((left, top, left + s, top + s))
    else:
        img = img.resize((s, s), Image.Resampling.BILINEAR)
    return np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0
