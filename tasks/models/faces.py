"""Faces in decoded images: MTCNN finds them, ``blur_faces`` hides them.

The detector is MTCNN (Zhang et al., "Joint Face Detection and Alignment using Multi-task
Cascaded Convolutional Networks", 2016): three small CNNs, run here in torch. P-Net slides over
a pyramid of the image and proposes boxes; R-Net (24 px crops) and O-Net (48 px crops) check and
refine them, batched. The weights are the ones the ``mtcnn`` wheel (1.0.0, MIT) ships under
``mtcnn/assets/weights``: nothing is downloaded, nothing is read from a hub, and the package
itself (which would import TensorFlow) is never imported; each file's sha256 is checked before
it is unpickled. The networks are written here from the paper's layout. It was chosen by
measured recall, precision and speed over OpenCV's Haar cascades (bench/bench_privacy.py --stage
faces runs the cascade beside it): it finds frontal faces, three-quarter profiles and tilted
faces the cascades miss, in about a third of their time.

Work per image is bounded: detection runs on an RGB copy whose long side is at most
``work_side`` px (the recipe's; ``WORK_SIDE`` by default; boxes are mapped back to the given
image's pixels), and never at a finer scale than makes a ``min_size`` face ``WINDOW`` px across
(``work_scale``). A face (its size: the longer side of its box, which is about the height from
brows to chin) is therefore found when it is at least ``min_size`` px and at least ``WINDOW /
scale`` px (``smallest_face``, which the sample's json records as ``faces_min_size``): 20 px up
to a 640 px long side, 32 px in a 1024 px image, 126 px in a 4032 px one. The boxes each network passes on are capped
(``MAX_PROPOSALS``, ``MAX_CHECKED``), so a picture of 10,000 tiny faces costs a bounded time.

Score: O-Net's face probability (0-1); ``min_score`` is O-Net's threshold (MTCNN's own is 0.7,
the recipe's default 0.8: see FacePrivacy).

Device (``privacy.faces.device``): on the CPU, OpenCV makes the pyramid and the crops (the
path the figures were measured on); with the networks on a GPU, torch makes them there
(``_DevicePixels``), so that only boxes and scores cross back.

Threads: the networks are shared by every thread of the process (inference keeps no state);
torch releases the GIL in its kernels. Torch's own thread count is the process's (Dask's workers
run with one: flows/runtime.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

from tasks.formats.recipe_privacy import FACE_WORK_SIDE, FacePrivacy

WINDOW = 20  # px: the smallest face found at the scale detection works at (P-Net's 12 px cell, scaled)
CELL = 12  # P-Net's window, px
# Long side of the copy detection works on, px, by default (``privacy.faces.work_side``): 640
# keeps recall on 256-1024 px images.
WORK_SIDE = FACE_WORK_SIDE
PYRAMID_STEP = 0.709  # each pyramid level is this much smaller (MTCNN's: half the area)
PNET_THRESHOLD, RNET_THRESHOLD = 0.6, 0.7  # MTCNN's; O-Net's is the recipe's min_score
MAX_PROPOSALS = 2048  # P-Net boxes per level, and over all levels, passed on (best first)
MAX_CHECKED = 1024  # R-Net boxes passed to O-Net (best first): the most faces one image can have
BLUR_MARGIN = 0.15  # each side of a box is pushed out by this share of the box before blurring
BLUR_CELLS = 6  # a blurred box is pixelated to about this many cells across, then blurred
# The weights as the mtcnn 1.0.0 wheel ships them (joblib pickles): unpickled only if they match.
WEIGHTS = {
    "pnet": "ea6b0c3e685ebee3165326ad6484acc95f2ef78f1c94fbf40a55704fa989f7b5",
    "rnet": "cb00e6460f3c98b0bfafaba3c0a0ded4bdf6e62cee7174d969e8670d7e757fee",
    "onet": "94f6ea2f4cf985275ee958cdd762d17b6009348a4fb9d8c6be39ba73ffd22ca3",
}


@dataclass(frozen=True)
class Face:
    """One face: its box in the given image's pixels, and the detector's score (O-Net's probability)."""

    x: int
    y: int
    w: int
    h: int
    score: float


def weights_dir() -> Path:
    """Where the ``mtcnn`` wheel keeps its weights (found without importing the package)."""
    spec = importlib.util.find_spec("mtcnn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the face detector's weights come with the mtcnn package: pip install mtcnn==1.0.0")
    return Path(next(iter(spec.submodule_search_locations))) / "assets" / "weights"


def _load(name: str) -> list[np.ndarray]:
    import joblib

    path = weights_dir() / f"{name}.lz4"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WEIGHTS[name]:
        raise RuntimeError(f"{path}: sha256 {digest}, not the {name} weights shardsmith was measured with")
    return [np.asarray(w, dtype=np.float32) for w in joblib.load(path)]


@functools.cache
def networks(device: str = "cpu") -> tuple[Any, Any, Any]:
    """The process's P-Net, R-Net and O-Net on ``device``, loaded once per device: torch modules
    holding the wheel's weights (TensorFlow's layout turned into torch's), in fp32."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    def conv(w: np.ndarray, b: np.ndarray) -> nn.Conv2d:
        layer = nn.Conv2d(w.shape[2], w.shape[3], w.shape[:2])
        layer.weight.data = torch.from_numpy(np.ascontiguousarray(w.transpose(3, 2, 0, 1)))
        layer.bias.data = torch.from_numpy(b)
        return layer

    def prelu(a: np.ndarray) -> nn.PReLU:
        layer = nn.PReLU(a.size)
        layer.weight.data = torch.from_numpy(a.reshape(-1).copy())
        return layer

    def dense(w: np.ndarray, b: np.ndarray) -> nn.Linear:
        layer = nn.Linear(*w.shape)
        layer.weight.data = torch.from_numpy(np.ascontiguousarray(w.T))
        layer.bias.data = torch.from_numpy(b)
        return layer

    def trunk(w: list[np.ndarray], convs: int) -> nn.ModuleList:
        """Each conv layer and its PReLU: (kernel, bias, slope) triples."""
        return nn.ModuleList(nn.Sequential(conv(w[3 * i], w[3 * i + 1]), prelu(w[3 * i + 2])) for i in range(convs))

    def flat(x: Any) -> Any:
        # TensorFlow flattened (width, height, channels): the dense layers' weights expect that order
        return x.permute(0, 3, 2, 1).flatten(1)

    class PNet(nn.Module):
        def __init__(self, w: list[np.ndarray]) -> None:
            super().__init__()
            self.body, self.reg, self.cls = trunk(w, 3), conv(w[9], w[10]), conv(w[11], w[12])

        def forward(self, x: Any) -> tuple[Any, Any]:
            x = F.max_pool2d(self.body[0](x), 2, 2, ceil_mode=True)
            x = self.body[2](self.body[1](x))
            return self.reg(x), F.softmax(self.cls(x), 1)[:, 1]

    class RNet(nn.Module):
        def __init__(self, w: list[np.ndarray]) -> None:
            super().__init__()
            self.body, self.fc, self.act = trunk(w, 3), dense(w[9], w[10]), prelu(w[11])
            self.reg, self.cls = dense(w[12], w[13]), dense(w[14], w[15])

        def forward(self, x: Any) -> tuple[Any, Any]:
            x = F.max_pool2d(self.body[0](x), 3, 2, ceil_mode=True)
            x = F.max_pool2d(self.body[1](x), 3, 2)
            x = self.act(self.fc(flat(self.body[2](x))))
            return self.reg(x), F.softmax(self.cls(x), 1)[:, 1]

    class ONet(nn.Module):
        def __init__(self, w: list[np.ndarray]) -> None:
            super().__init__()
            self.body, self.fc, self.act = trunk(w, 4), dense(w[12], w[13]), prelu(w[14])
            self.reg, self.cls = dense(w[15], w[16]), dense(w[19], w[20])  # w[17:19]: landmarks, unused

        def forward(self, x: Any) -> tuple[Any, Any]:
            x = F.max_pool2d(self.body[0](x), 3, 2, ceil_mode=True)
            x = F.max_pool2d(self.body[1](x), 3, 2)
            x = F.max_pool2d(self.body[2](x), 2, 2, ceil_mode=True)
            x = self.act(self.fc(flat(self.body[3](x))))
            return self.reg(x), F.softmax(self.cls(x), 1)[:, 1]

    # channels-last: the small convolutions run about 1.7x faster on the CPU in this layout
    return tuple(
        net(_load(name)).eval().requires_grad_(False).to(device, memory_format=torch.channels_last)
        for net, name in ((PNet, "pnet"), (RNet, "rnet"), (ONet, "onet"))
    )


def work_scale(width: int, height: int, min_size: int, work_side: int = WORK_SIDE) -> float:
    """The scale of the copy detection works on: at most ``work_side`` on the long side, and
    no finer than makes a ``min_size`` face ``WINDOW`` px wide."""
    return min(1.0, work_side / max(width, height, 1), WINDOW / min_size)


def nms(boxes: np.ndarray, scores: np.ndarray, overlap: float, by_min: bool = False) -> np.ndarray:
    """Indices of the boxes kept, best first, dropping any that overlaps a better one by more than
    ``overlap`` (intersection over union, or over the smaller box with ``by_min``)."""
    if not by_min:  # OpenCV's (the same rule, in C++): 2-5x faster on P-Net's hundreds of boxes
        import cv2

        rects = np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1).tolist()
        return np.asarray(cv2.dnn.NMSBoxes(rects, scores.tolist(), 0.0, overlap), np.int64).reshape(-1)
    x1, y1, x2, y2 = boxes.T
    area = (x2 - x1) * (y2 - y1)
    order, keep = np.argsort(-scores, kind="stable"), []
    while order.size:
        best, rest = order[0], order[1:]
        keep.append(best)
        inter = np.clip(np.minimum(x2[best], x2[rest]) - np.maximum(x1[best], x1[rest]), 0, None) * np.clip(
            np.minimum(y2[best], y2[rest]) - np.maximum(y1[best], y1[rest]), 0, None
        )
        order = rest[inter <= overlap * np.maximum(np.minimum(area[best], area[rest]), 1e-9)]
    return np.asarray(keep, dtype=np.int64)


def _squared(boxes: np.ndarray) -> np.ndarray:
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    side = np.maximum(w, h)
    x, y = boxes[:, 0] + (w - side) / 2, boxes[:, 1] + (h - side) / 2
    return np.stack([x, y, x + side, y + side], 1)


def _moved(boxes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``boxes`` moved by a network's regression (offsets in shares of the box's size)."""
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    return boxes + offsets * np.stack([w, h, w, h], 1)


def _crops(img: np.ndarray, boxes: np.ndarray, side: int) -> Any:
    """Each box of ``img`` (zero beyond its edges) at ``side`` x ``side``: uint8 NHWC."""
    import cv2

    height, width = img.shape[:2]
    out = np.zeros((len(boxes), side, side, 3), np.uint8)
    for k, (x1, y1, x2, y2) in enumerate(np.round(boxes).astype(np.int64)):
        if x2 - x1 < 1 or y2 - y1 < 1:
            continue
        patch = np.zeros((y2 - y1, x2 - x1, 3), np.uint8)
        sx1, sy1, sx2, sy2 = max(0, x1), max(0, y1), min(width, x2), min(height, y2)
        if sx2 > sx1 and sy2 > sy1:
            patch[sy1 - y1 : sy2 - y1, sx1 - x1 : sx2 - x1] = img[sy1:sy2, sx1:sx2]
        out[k] = cv2.resize(patch, (side, side), interpolation=cv2.INTER_AREA)
    return out


def _upload(pixels: np.ndarray, device: str) -> Any:
    """uint8 pixels as a tensor on ``device``: they cross to a GPU as uint8, a quarter of their float size."""
    import torch

    return torch.from_numpy(np.require(pixels, requirements=["C", "W"])).to(device)


def _tensor(pixels: np.ndarray, device: str) -> Any:
    """uint8 NHWC pixels as the networks' input on ``device`` (``_normalised``)."""
    return _normalised(_upload(pixels, device).permute(0, 3, 1, 2).float())


def _normalised(pixels: Any) -> Any:
    """0-255 float NCHW as the networks' input: (x - 127.5) / 128, channels-last in memory."""
    import torch

    return ((pixels - 127.5) / 128).contiguous(memory_format=torch.channels_last)


def _level_crops(levels: list[Any], boxes: np.ndarray, side: int) -> Any:
    """Each box (x1, y1, x2, y2 in the work copy's pixels) at ``side`` x ``side``, sampled
    bilinearly (zero beyond the image's edges) from the level where the box is the smallest that
    is still at least ``side`` px across (the work copy itself for smaller boxes), so no crop
    shrinks by more than one pyramid step: float NCHW, 0-255, on the levels' device.

    ``levels``: the work copy and its pyramid, float (1, 3, H, W), each smaller than the last."""
    import torch
    from torch.nn import functional as F

    device = levels[0].device
    height, width = levels[0].shape[-2:]
    sides = np.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    shares = np.array([level.shape[-1] / width for level in levels])
    at = np.maximum(np.sum(sides[:, None] * shares[None, :] >= side, axis=1) - 1, 0)
    out = torch.empty((len(boxes), 3, side, side), device=device)
    steps = (torch.arange(side, dtype=torch.float32) + 0.5) / side
    for k in np.unique(at):
        rows = np.nonzero(at == k)[0]
        lh, lw = levels[k].shape[-2:]
        b = torch.from_numpy(boxes[rows].astype(np.float32)) * torch.tensor([lw / width, lh / height] * 2)
        # each output pixel's centre in grid_sample's coordinates (-1 and 1: the level's outer edges)
        xs = (b[:, :1] + steps * (b[:, 2:3] - b[:, :1])) * (2 / lw) - 1
        ys = (b[:, 1:2] + steps * (b[:, 3:4] - b[:, 1:2])) * (2 / lh) - 1
        grid = torch.stack(torch.broadcast_tensors(xs[:, None, :], ys[:, :, None]), -1).reshape(1, -1, side, 2)
        # one call per level, the boxes' grids stacked into one tall grid: the level is never copied per box
        crops = F.grid_sample(levels[k], grid.to(device), align_corners=False)
        out[torch.from_numpy(rows).to(device)] = crops.reshape(3, len(rows), side, side).transpose(0, 1)
    return out


class _Pixels:
    """The work copy's pyramid and crops made by OpenCV on the CPU (area resizing), the networks'
    inputs then moved to their device: the path the CPU's figures are measured on."""

    def __init__(self, img: np.ndarray, device: str) -> None:
        self.img, self.level, self.device = img, img, device

    def next_level(self, width: int, height: int) -> Any:
        """The next pyramid level, made from the last (cheaper), as P-Net's input."""
        import cv2

        self.level = cv2.resize(self.level, (width, height), interpolation=cv2.INTER_AREA)
        return _tensor(self.level[None], self.device)

    def crops(self, boxes: np.ndarray, side: int) -> Any:
        return _tensor(_crops(self.img, boxes, side), self.device)


class _DevicePixels:
    """The same made by torch on the networks' device (area resizing; crops by ``_level_crops``),
    so that with the networks on a GPU only boxes and scores cross back to the CPU. On the CPU
    it takes 1.34x the time of OpenCV's (44 against 33 ms per image: ``bench_privacy.py
    --stage faces``) and finds the same faces on the labelled set (its boxes at IoU 0.94 with
    OpenCV's on average; tests/test_faces.py checks both)."""

    def __init__(self, img: np.ndarray, device: str) -> None:
        self.levels = [_upload(img, device).permute(2, 0, 1)[None].float()]

    def next_level(self, width: int, height: int) -> Any:
        from torch.nn import functional as F

        self.levels.append(F.interpolate(self.levels[-1], size=(height, width), mode="area"))
        return _normalised(self.levels[-1])

    def crops(self, boxes: np.ndarray, side: int) -> Any:
        return _normalised(_level_crops(self.levels, boxes, side))


def _host(maps: list[Any], joined: bool) -> list[np.ndarray]:
    """P-Net's maps of every pyramid level as numpy arrays; ``joined`` (from a GPU): in one
    transfer, one wait for the whole pyramid rather than one per level, split again here."""
    import torch

    if not joined:
        return [m.cpu().numpy() for m in maps]
    flat = torch.cat([m.reshape(len(m), -1) for m in maps], 1).cpu().numpy()
    ends = np.cumsum([m.shape[1] * m.shape[2] for m in maps])[:-1]
    return [part.reshape(m.shape) for m, part in zip(maps, np.split(flat, ends, 1))]


def _top(scores: np.ndarray, most: int) -> np.ndarray:
    """Indices of the ``most`` best scores, best first (all of them when there are fewer)."""
    return np.argsort(-scores, kind="stable")[:most]


class FaceDetector:
    """Faces in an image by the recipe's rules; safe to call from several threads.

    Args:
        rules: ``privacy.faces``: faces narrower or lower than ``min_size`` px (in the given
            image's pixels) or scoring under ``min_score`` are not counted; at most
            ``max_faces`` are returned, largest first; ``device`` is where the networks run
            (``auto``: this worker's GPU where it has one).

    Raises:
        ModelError: ``device`` is ``cuda`` and this worker sees no CUDA GPU.
    """

    def __init__(self, rules: FacePrivacy) -> None:
        from tasks.models.placement import ModelError, resolve_device

        self.rules = rules
        self.device = resolve_device(rules.device, "privacy.faces.device", ModelError)
        # where the pyramid and the crops are made: by torch on the networks' GPU (whose P-Net
        # maps then come back in one transfer), by OpenCV on the CPU
        self.pixels_on_device = self.device != "cpu"

    def smallest_face(self, width: int, height: int) -> int:
        """The smallest face, in pixels of a ``width`` x ``height`` image, detection looks for
        there: ``min_size``, or more where the image is larger than ``work_side``."""
        scale = work_scale(width, height, self.rules.min_size, self.rules.work_side)
        return max(self.rules.min_size, math.ceil(WINDOW / scale - 1e-9))

    def detect(self, rgb: Image.Image) -> tuple[list[Face], int]:
        """The faces kept (largest first, at most ``max_faces``) and how many were counted before that cap."""
        import torch

        width, height = rgb.size
        scale = work_scale(width, height, self.rules.min_size, self.rules.work_side)
        work_w, work_h = round(width * scale), round(height * scale)
        if min(work_w, work_h) < WINDOW:
            return [], 0
        with torch.inference_mode():
            boxes, scores = self._faces(self._work_copy(rgb, work_w, work_h))
        faces = []
        for (x1, y1, x2, y2), score in zip(boxes / scale, scores):
            x0, y0 = max(0, round(float(x1))), max(0, round(float(y1)))
            face = Face(x0, y0, min(width, round(float(x2))) - x0, min(height, round(float(y2))) - y0, float(score))
            if max(face.w, face.h) >= self.rules.min_size:  # a face's size: its box's longer side
                faces.append(face)
        faces.sort(key=lambda f: (-f.w * f.h, f.y, f.x))
        return faces[: self.rules.max_faces], len(faces)

    def detect_batch(self, images: Iterable[Image.Image]) -> list[tuple[list[Face], int]]:
        """``detect`` on each image (each image's own pyramid; R-Net and O-Net batch its boxes)."""
        return [self.detect(img) for img in images]

    @staticmethod
    def _work_copy(rgb: Image.Image, work_w: int, work_h: int) -> np.ndarray:
        import cv2

        img = rgb if rgb.mode == "RGB" else rgb.convert("RGB")
        pixels = np.asarray(img)
        if (work_w, work_h) != img.size:
            pixels = cv2.resize(pixels, (work_w, work_h), interpolation=cv2.INTER_AREA)
        return pixels

    def _faces(self, img: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Boxes (x1, y1, x2, y2 in ``img``'s pixels) and scores of the faces in the work copy ``img``."""
        import torch

        pnet, rnet, onet = networks(self.device)
        pixels = (_DevicePixels if self.pixels_on_device else _Pixels)(img, self.device)
        height, width = img.shape[:2]
        scales, maps = [], []
        scale = CELL / WINDOW  # the first level makes a WINDOW px face P-Net's 12 px cell
        while min(height, width) * scale >= CELL:
            offsets, prob = pnet(pixels.next_level(max(CELL, round(width * scale)), max(CELL, round(height * scale))))
            scales.append(scale)
            maps.append(torch.cat([prob, offsets[0]]))  # (5, h, w): the face probability, then the offsets
            scale *= PYRAMID_STEP
        found, found_scores = [], []
        for scale, level in zip(scales, _host(maps, joined=self.pixels_on_device)):
            prob = level[0]
            ys, xs = np.nonzero(prob > PNET_THRESHOLD)
            if len(ys):
                top = _top(prob[ys, xs], MAX_PROPOSALS)
                ys, xs = ys[top], xs[top]
                cells = np.stack([xs, ys, xs, ys], 1).astype(np.float32) * 2 + np.array([0, 0, CELL, CELL])
                boxes, scores, moves = cells / scale, prob[ys, xs], level[1:, ys, xs].T
                keep = nms(boxes, scores, 0.5)
                found.append(_moved(boxes[keep], moves[keep]))
                found_scores.append(scores[keep])
        if not found:
            return np.zeros((0, 4)), np.zeros(0)
        boxes, scores = np.concatenate(found), np.concatenate(found_scores)
        top = _top(scores, MAX_PROPOSALS)
        boxes, scores = boxes[top], scores[top]
        boxes = _squared(boxes[nms(boxes, scores, 0.7)])
        boxes, scores = _refine(rnet, pixels, boxes, 24, RNET_THRESHOLD)
        top = _top(scores, MAX_CHECKED)
        boxes, scores = boxes[top], scores[top]
        boxes = _squared(boxes[nms(boxes, scores, 0.7)])
        boxes, scores = _refine(onet, pixels, boxes, 48, self.rules.min_score)
        keep = nms(boxes, scores, 0.7, by_min=True)
        return boxes[keep], scores[keep]


def _refine(
    net: Any, pixels: _Pixels | _DevicePixels, boxes: np.ndarray, side: int, threshold: float
) -> tuple[np.ndarray, np.ndarray]:
    """The boxes ``net`` scores at least ``threshold`` on their ``side`` px crops, moved by its regression."""
    if not len(boxes):
        return boxes, np.zeros(0)
    offsets, prob = net(pixels.crops(boxes, side))
    prob = prob.cpu().numpy()
    keep = prob >= threshold
    return _moved(boxes[keep], offsets.cpu().numpy()[keep]), prob[keep]


@functools.lru_cache(maxsize=16)
def face_detector(rules: FacePrivacy) -> FaceDetector:
    """The process's detector for ``rules`` (the networks are loaded once per process and device)."""
    detector = FaceDetector(rules)
    networks(detector.device)
    return detector


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
