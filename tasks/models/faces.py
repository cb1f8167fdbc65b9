"""Faces in decoded images: OpenCV's bundled Haar cascade finds them, ``blur_faces`` hides them.

The detector is ``haarcascade_frontalface_alt2.xml`` (Rainer Lienhart's tree-based 20 x 20
gentle-AdaBoost frontal face cascade, Intel's BSD-style license), which the
opencv-python-headless 4.x wheel carries under ``cv2.data.haarcascades`` (OpenCV 5's main wheel
no longer has the cascades): nothing is downloaded, nothing is read from a hub. It was chosen by
measured recall and precision over the wheel's other frontal cascades, scikit-image's LBP
cascade and dlib's HOG detector (bench/bench_privacy.py --stage faces). It finds frontal faces, upright
or tilted up to about 25 degrees in the picture's plane (tried on the bundled face); profiles
are mostly missed.

Work per image is bounded: detection runs on a grey copy whose long side is at most
``WORK_SIDE`` px (boxes are mapped back to the given image's pixels), and never at a finer
scale than makes a ``min_size`` face as wide as the cascade's 20 px window (``work_scale``). A
face is therefore found when it is at least ``min_size`` px wide and at least ``20 / scale`` px
wide: 20 px up to a 640 px long side, 32 px in a 1024 px image. Smaller faces are not counted,
however many there are; at most about (640 / 20)^2 faces fit the copy.

Score: OpenCV's ``levelWeights`` (``detectMultiScale3`` with ``outputRejectLevels``) minus the
threshold of the cascade's last stage: by how much the best window of the face's group clears
the last stage. Every face found scores >= 0. On the labelled set (bench/bench_privacy.py --stage faces)
the faces found scored 1.2-5.0 (95 % above 1.8, median 2.6) and the false detections 0.4-1.5
(median 1.0): ``min_score: 1.5`` removed 15 of the 16 false detections there and 4 of the 315
faces.

Threads: a CascadeClassifier is not safe to share between threads (detection keeps the scaled
image in the object), so each thread loads its own (about 5 ms, once per thread); OpenCV's own
pool is set to one thread, so that the callers' threads give the parallelism, and
``detectMultiScale3`` releases the GIL. A cascade gains nothing from batching.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

from tasks.formats.recipe_privacy import FacePrivacy

CASCADE = "haarcascade_frontalface_alt2.xml"
WINDOW = 20  # the cascade's window side, px: the smallest face it finds at the scale it works at
# Long side of the grey copy detection works on, px. Detection costs about in proportion to
# this squared: 640 keeps recall within a few points of full resolution on 256-1024 px images.
WORK_SIDE = 640
SCALE_STEP = 1.1  # scale factor between pyramid levels (OpenCV's default)
MIN_NEIGHBOURS = 3  # overlapping windows a face needs (OpenCV's default)
BLUR_MARGIN = 0.15  # each side of a box is pushed out by this share of the box before blurring
BLUR_CELLS = 6  # a blurred box is pixelated to about this many cells across, then blurred


@dataclass(frozen=True)
class Face:
    """One face: its box in the given image's pixels, and the detector's score (see the module docstring)."""

    x: int
    y: int
    w: int
    h: int
    score: float


class _Cascades(threading.local):
    """The cascade, loaded once in each thread that detects."""

    classifier: Any = None


_LOCAL = _Cascades()


@functools.cache
def _cascade_setup() -> tuple[str, float]:
    """The cascade's path and the threshold of its last stage; sets OpenCV to one thread (see the module docstring)."""
    import cv2
    import cv2.data

    cv2.setNumThreads(1)
    path = Path(cv2.data.haarcascades) / CASCADE
    storage = cv2.FileStorage(str(path), cv2.FILE_STORAGE_READ)
    try:
        cascade = storage.getFirstTopLevelNode()
        stages = cascade.getNode("stages")
        last = float(stages.at(stages.size() - 1).getNode("stageThreshold").real())
    finally:
        storage.release()
    return str(path), last


def _classifier() -> Any:
    if _LOCAL.classifier is None:
        import cv2

        path, _ = _cascade_setup()
        classifier = cv2.CascadeClassifier(path)
        if classifier.empty():
            raise RuntimeError(f"OpenCV could not load its bundled face cascade {path}")
        _LOCAL.classifier = classifier
    return _LOCAL.classifier


def work_scale(width: int, height: int, min_size: int) -> float:
    """The scale of the grey copy detection works on: at most ``WORK_SIDE`` on the long side, and
    no finer than makes a ``min_size`` face ``WINDOW`` px wide."""
    return min(1.0, WORK_SIDE / max(width, height, 1), WINDOW / min_size)


class FaceDetector:
    """Faces in an image by the recipe's rules; safe to call from several threads.

    Args:
        rules: ``privacy.faces``: faces narrower or lower than ``min_size`` px (in the given
            image's pixels) or scoring under ``min_score`` are not counted; at most
            ``max_faces`` are returned, largest first.
    """

    def __init__(self, rules: FacePrivacy) -> None:
        self.rules = rules

    def detect(self, rgb: Image.Image) -> tuple[list[Face], int]:
        """The faces kept (largest first, at most ``max_faces``) and how many were counted before that cap."""
        width, height = rgb.size
        scale = work_scale(width, height, self.rules.min_size)
        work_w, work_h = round(width * scale), round(height * scale)
        if min(work_w, work_h) < WINDOW:
            return [], 0
        # scaled before the grey conversion: no full-size copy of a large image is made
        img = rgb if rgb.mode in ("RGB", "RGBA", "L") else rgb.convert("RGB")
        if scale < 1.0:
            img = img.resize((work_w, work_h), Image.Resampling.BOX)
        grey = img.convert("L")
        smallest = max(WINDOW, round(self.rules.min_size * scale))
        boxes, _, weights = _classifier().detectMultiScale3(
            np.asarray(grey),
            scaleFactor=SCALE_STEP,
            minNeighbors=MIN_NEIGHBOURS,
            minSize=(smallest, smallest),
            outputRejectLevels=True,
        )
        _, last = _cascade_setup()
        faces = []
        for (x, y, w, h), weight in zip(np.asarray(boxes).reshape(-1, 4), np.asarray(weights).reshape(-1)):
            x0, y0 = max(0, round(x / scale)), max(0, round(y / scale))
            x1, y1 = min(width, round((x + w) / scale)), min(height, round((y + h) / scale))
            face = Face(x0, y0, x1 - x0, y1 - y0, round(float(weight) - last, 4))
            if min(face.w, face.h) >= self.rules.min_size and face.score >= self.rules.min_score:
                faces.append(face)
        faces.sort(key=lambda f: (-f.w * f.h, f.y, f.x))
        return faces[: self.rules.max_faces], len(faces)

    def detect_batch(self, images: Iterable[Image.Image]) -> list[tuple[list[Face], int]]:
        """``detect`` on each image: a cascade gains nothing from batching, this is for callers that batch."""
        return [self.detect(img) for img in images]


@functools.lru_cache(maxsize=16)
def face_detector(rules: FacePrivacy) -> FaceDetector:
    """The process's detector for ``rules`` (the cascade itself is loaded once per thread)."""
    _cascade_setup()
    return FaceDetector(rules)


def blur_faces(rgb: Image.Image, faces: Iterable[Face]) -> Image.Image:
    """A copy of ``rgb`` with each face's box, pushed out by ``BLUR_MARGIN`` on each side,
    pixelated to about ``BLUR_CELLS`` cells across and then blurred; pixels outside the boxes are unchanged.
    An image in a mode Pillow cannot blur (palette, 1-bit, 16-bit) comes back as RGB."""
    out = rgb.copy() if rgb.mode in ("RGB", "RGBA", "L") else rgb.convert("RGB")
    width, height = out.size
    for face in faces:
        dx, dy = round(face.w * BLUR_MARGIN), round(face.h * BLUR_MARGIN)
        x0, y0 = max(0, face.x - dx), max(0, face.y - dy)
        x1, y1 = min(width, face.x + face.w + dx), min(height, face.y + face.h + dy)
        if x1 <= x0 or y1 <= y0:
            continue
        region = out.crop((x0, y0, x1, y1))
        cell = max(1, max(x1 - x0, y1 - y0) // BLUR_CELLS)
        small = region.resize((max(1, (x1 - x0) // cell), max(1, (y1 - y0) // cell)), Image.Resampling.BOX)
        blocky = small.resize(region.size, Image.Resampling.NEAREST)
        # blurred within the region only: the filter sees the region's own edge pixels, not the surroundings
        out.paste(blocky.filter(ImageFilter.GaussianBlur(radius=cell / 2)), (x0, y0))
    return out
