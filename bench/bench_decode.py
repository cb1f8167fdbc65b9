"""Decode benchmark: each format's decoders side by side, and process_image's old and new paths, on the download benchmark's pool.

One invocation loads the image pool of bench/bench_download.py (made there once, reused;
photo-like, 200-2000 px, ~80% JPEG, 10% PNG posterised graphics up to 1000 px, 10% WebP) and
runs, alternating, for ``--repeats`` rounds, each method over each format's images on a
``--threads`` pool (2: one Dask worker's threads on the standard 2-core machine):

- ``process_image`` end to end at the benchmark's setting (``border``, 256 px, JPEG q95:
  img2dataset's defaults): ``old`` (every WebP through Pillow's animation decoder, every PNG
  through Pillow, JPEG drafted), ``full`` (today's decoders, every WebP at full size) and
  ``new`` (tasks/policies/decoders.py as it is: lossy WebPs scaled while decoding);
- decoders alone, decode + area resize to 256 px border, nothing else:
  JPEG ``pillow-full``, ``pillow-draft``, ``opencv-reduced`` (``IMREAD_REDUCED_COLOR_2/4/8``);
  WebP ``pillow-anim`` (Pillow 13: ``WebPAnimDecoder``), ``imagecodecs`` (libwebp
  ``WebPDecodeRGBInto``), ``opencv`` (same libwebp call), ``libwebp-scaled`` (libwebp with
  ``use_scaling`` straight to the target: tasks/policies/libwebp.py); PNG ``pillow``,
  ``imagecodecs`` (libpng), ``imagecodecs-spng``, ``opencv``, ``pyspng``;
- the steps of ``process_image``'s accepted path one by one (decode, pixel hash, resize,
  pHash, re-encode) and the resize variants not taken (``reducing_gap``).

Candidates that are not project dependencies (opencv-python-headless, pyspng) run only
when importable and are skipped otherwise. Printed: CPU ms per image (process CPU time, all
threads; the steadier figure on a shared machine), img/s (wall) and ratios against each
table's baseline in the same rounds, medians; then ``process_image``'s per-image cost weighted
80/10/10 as the issue's corpus is.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.photos import ensure_pool
from harness.procs import REPO, clock
from harness.report import table

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIDE = 256
MIX = {"jpeg": 0.8, "png": 0.1, "webp": 0.1}
EXTS = {"jpg": "jpeg", "png": "png", "webp": "webp"}


def _target(w: int, h: int) -> tuple[int, int]:
    """img2dataset's ``border`` size: the long side to SIDE."""
    scale = SIDE / max(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def _scale_for(w: int, h: int) -> int:
    """Largest of 8, 4, 2 that keeps the image at or above the target; else 1."""
    tw, th = _target(w, h)
    return next((k for k in (8, 4, 2) if w // k >= tw and h // k >= th), 1)


def _box(arr):
    from PIL import Image

    img = Image.fromarray(arr)
    return img.resize(_target(*img.size), Image.Resampling.BOX)


def _cv_area(arr, size):
    import cv2

    return cv2.resize(arr, _target(*size), interpolation=cv2.INTER_AREA)


# ------------------------------------------------------------------------- decoders alone


def pillow_full(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        return rgb.resize(_target(*rgb.size), Image.Resampling.BOX)


def pillow_draft(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
        w, h = img.size
        k = _scale_for(w, h)
        drafted = img.draft(None, (w // k, h // k)) if k > 1 else None
        return img.convert("RGB").resize(_target(w, h), Image.Resampling.BOX, box=drafted[1] if drafted else None)


def opencv_reduced(data: bytes):
    import cv2
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:  # the header, as the pixel cap needs
        size = img.size
    flag = {
        1: cv2.IMREAD_COLOR_RGB,
        2: cv2.IMREAD_REDUCED_COLOR_2,
        4: cv2.IMREAD_REDUCED_COLOR_4,
        8: cv2.IMREAD_REDUCED_COLOR_8,
    }[_scale_for(*size)]
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), flag | cv2.IMREAD_IGNORE_ORIENTATION)
    if flag != cv2.IMREAD_COLOR_RGB:
        arr = cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
    return _cv_area(arr, size)


def opencv_full(data: bytes):
    import cv2
    import numpy as np

    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)
    return _cv_area(arr, arr.shape[1::-1])


def imagecodecs_webp(data: bytes):
    from imagecodecs import webp_decode

    return _box(webp_decode(data))


def imagecodecs_png(data: bytes):
    from imagecodecs import png_decode

    return _box(png_decode(data))


def imagecodecs_spng(data: bytes):
    from imagecodecs import spng_decode

    return _box(spng_decode(data))


def pyspng_png(data: bytes):
    import pyspng

    return _box(pyspng.load(data))


def webp_scaled(data: bytes):
    """libwebp decoding with ``use_scaling`` straight to the border target (no resize after it): tasks/policies/libwebp.py."""
    from tasks.policies import decoders, libwebp

    info = decoders.webp_info(data)
    if info is None:
        raise ValueError("not a WebP")
    out = libwebp.decode_scaled(data, (info.width, info.height), _target(info.width, info.height))
    if out is None:
        raise ValueError("not decoded scaled (lossless, alpha, or refused)")
    return out


DECODERS = {
    "jpeg": {"pillow-full": pillow_full, "pillow-draft": pillow_draft, "opencv-reduced": opencv_reduced},
    "webp": {
        "pillow-anim": pillow_full,
        "imagecodecs": imagecodecs_webp,
        "opencv": opencv_full,
        "libwebp-scaled": webp_scaled,
    },
    "png": {
        "pillow": pillow_full,
        "imagecodecs": imagecodecs_png,
        "imagecodecs-spng": imagecodecs_spng,
        "opencv": opencv_full,
        "pyspng": pyspng_png,
    },
}
NEEDS = {"opencv-reduced": "cv2", "opencv": "cv2", "pyspng": "pyspng"}


def available(method: str) -> str | None:
    """None when the method can run here, else why not."""
    module = NEEDS.get(method)
    if module is None:
        return None
    try:
        mod = __import__(module)
    except ImportError:
        return f"not installed ({module})"
    if module == "cv2":
        mod.setNumThreads(1)  # one core per call, as a Dask worker thread has
    return None


# -------------------------------------------------------------------------- process_image


def process_runner(path: str):
    """``old``: every WebP and PNG through Pillow; ``full``: today's decoders, WebPs at full size; ``new``: as it is."""
    from tasks.formats.recipe_download import ImageRules
    from tasks.policies import decoders
    from tasks.policies.images import process_image

    rules = ImageRules(resize_mode="border", image_size=SIDE, min_side=1, max_aspect_ratio=100.0)

    def one(data: bytes):
        outcome = process_image(data, rules)
        if outcome.reason is not None:
            raise RuntimeError(f"{outcome.reason}: {outcome.detail}")
        return outcome

    def run(images: list[bytes], threads: int) -> int:
        decoders.STILL_WEBP = decoders.PLAIN_PNG = path != "old"
        decoders.WEBP_SCALED = path == "new"
        try:
            return run_threaded(one, images, threads)
        finally:
            decoders.STILL_WEBP = decoders.PLAIN_PNG = decoders.WEBP_SCALED = True

    return run


STEPS = ("decode", "pixel sha256", "resize", "pHash", "crop/pad + JPEG q95", "resize gap 2", "resize gap 1")


def step_costs(fmt: str, images: list[bytes]) -> dict[str, float]:
    """CPU ms per image of each step of process_image's accepted path (one thread, no rotation).

    Also times the resize variants not taken: Pillow's ``reducing_gap`` (``reduce()`` by an
    integer factor first, then BOX), and reports how far their pixels are from the exact area
    average.
    """
    import numpy as np
    from PIL import Image

    from tasks.formats.recipe_download import ImageRules
    from tasks.policies import decoders
    from tasks.policies import pixels as im

    rules = ImageRules(resize_mode="border", image_size=SIDE)
    clock = time.thread_time
    total = dict.fromkeys(STEPS, 0.0) | {"gap 2 mean diff": 0.0, "gap 1 mean diff": 0.0}
    for data in images:
        t0 = clock()
        if fmt == "webp":
            src = decoders.StillWebPSource(data, decoders.webp_info(data))
        elif fmt == "png" and (size := decoders.plain_png(data)) is not None:
            src = decoders.PlainPngSource(data, size)
        else:
            src = decoders.PillowSource(decoders.open_pillow(data, fmt))
        target = im.resize_dims(*src.size, rules)
        stored, box, _ = src.load(target)
        rgb = decoders.to_rgb(stored)
        t1 = clock()
        im.pixel_sha256(rgb, src.size, src.pixels if rgb is stored else None)  # as process_image hashes it
        t2 = clock()
        scaled = im.scale(rgb, target, box)
        t3 = clock()
        im.phash(scaled)
        t4 = clock()
        im.encode(im.crop_or_pad(scaled, rules), "jpeg", 95)
        t5 = clock()
        gap2 = rgb.resize(target, Image.Resampling.BOX, box=box, reducing_gap=2.0)
        t6 = clock()
        gap1 = rgb.resize(target, Image.Resampling.BOX, box=box, reducing_gap=1.0)
        t7 = clock()
        for step, dt in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6)):
            total[step] += dt
        exact = np.asarray(scaled, np.int16)
        total["gap 2 mean diff"] += float(np.abs(np.asarray(gap2, np.int16) - exact).mean())
        total["gap 1 mean diff"] += float(np.abs(np.asarray(gap1, np.int16) - exact).mean())
    return {k: (1000 * v if "diff" not in k else v) / len(images) for k, v in total.items()}


def jpeg_sampling() -> str:
    """Chroma subsampling of a q95 re-encode: Pillow's (what process_image writes) and OpenCV's (img2dataset's)."""
    import numpy as np
    from PIL import Image, JpegImagePlugin

    from tasks.policies.pixels import encode

    arr = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    names = {0: "4:4:4", 1: "4:2:2", 2: "4:2:0"}
    with Image.open(io.BytesIO(encode(Image.fromarray(arr), "jpeg", 95))) as img:
        found = f"Pillow q95 {names.get(JpegImagePlugin.get_sampling(img), '?')}"
    if available("opencv") is None:
        import cv2

        ok, buf = cv2.imencode(".jpg", arr, [cv2.IMWRITE_JPEG_QUALITY, 95])
        with Image.open(io.BytesIO(buf.tobytes())) as img:
            found += f", cv2.imencode q95 {names.get(JpegImagePlugin.get_sampling(img), '?')}"
    return found


def run_threaded(fn, images: list[bytes], threads: int) -> int:
    with ThreadPoolExecutor(max_workers=threads) as ex:
        return sum(1 for _ in ex.map(fn, images))


# -------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", type=int, default=400, help="the download benchmark's pool size (default 400, as there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every method once (default 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder, sizes = ensure_pool(args.pool, args.seed)
    pool: dict[str, list[bytes]] = {fmt: [] for fmt in MIX}
    for name in sorted(sizes):
        pool[EXTS[name.rsplit(".", 1)[1]]].append((folder / name).read_bytes())
    print(
        f"pool: {folder.name}: "
        + ", ".join(f"{len(v)} {k}" for k, v in pool.items())
        + f"; {args.threads} threads, {SIDE} px border, {args.repeats} rounds; {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )

    jobs: dict[tuple[str, str, str], object] = {}  # (table, format, method) -> run(images, threads)
    skipped: dict[str, str] = {}
    for fmt in MIX:
        for path in ("old", "full", "new"):
            jobs[("process_image", fmt, path)] = process_runner(path)
    for fmt, methods in DECODERS.items():
        for method, fn in methods.items():
            why = available(method)
            if why:
                skipped[f"{fmt} {method}"] = why
                continue
            jobs[("decoder", fmt, method)] = lambda images, threads, fn=fn: run_threaded(fn, images, threads)

    cpu: dict[tuple, list[float]] = {key: [] for key in jobs}
    rate: dict[tuple, list[float]] = {key: [] for key in jobs}
    steps: dict[str, list[dict[str, float]]] = {fmt: [] for fmt in MIX}
    for rnd in range(args.repeats):
        for fmt in MIX:
            steps[fmt].append(step_costs(fmt, pool[fmt]))
        for key, run in jobs.items():
            images = pool[key[1]]
            with clock() as lap:
                done = run(images, args.threads)
            wall, used = lap.wall, lap.cpu
            if done != len(images):
                raise RuntimeError(f"{key} produced {done} of {len(images)} images")
            cpu[key].append(1000 * used / len(images))
            rate[key].append(len(images) / wall)
        print(f"round {rnd + 1} done, load {os.getloadavg()[0]:.1f}", flush=True)

    med = {key: (statistics.median(cpu[key]), statistics.median(rate[key])) for key in jobs}
    print("\nprocess_image, border 256, JPEG q95 (CPU ms per image, median; img/s wall):\n")
    print("(old: WebP and PNG through Pillow; full: today's decoders with WebPs at full size; new: as it is)\n")
    mixed = {"old": 0.0, "full": 0.0, "new": 0.0}
    rows = []
    for fmt, weight in MIX.items():
        (oc, orate), (fc, _), (nc, nrate) = (med[("process_image", fmt, path)] for path in ("old", "full", "new"))
        mixed["old"] += weight * oc
        mixed["full"] += weight * fc
        mixed["new"] += weight * nc
        rows.append([fmt, len(pool[fmt]), f"{oc:.1f}", f"{fc:.1f}", f"{nc:.1f}", f"{nc / oc:.2f}", f"{nc / fc:.2f}",
                     f"{orate:.0f}", f"{nrate:.0f}"])  # fmt: skip
    rows.append(["mix 80/10/10", "", f"{mixed['old']:.2f}", f"{mixed['full']:.2f}", f"{mixed['new']:.2f}",
                 f"{mixed['new'] / mixed['old']:.2f}", f"{mixed['new'] / mixed['full']:.2f}", "", ""])  # fmt: skip
    head = ["format", "images", "old CPU ms", "full CPU ms", "new CPU ms", "new / old", "new / full", "old img/s", "new img/s"]  # fmt: skip
    print("\n".join(table(head, rows)))

    print("\ndecoders alone: decode + area resize to 256 px border (CPU ms per image, median):\n")
    rows = []
    for fmt, methods in DECODERS.items():
        base = med[("decoder", fmt, next(iter(methods)))][0]
        for method in methods:
            if f"{fmt} {method}" in skipped:
                rows.append([fmt, method, f"skipped: {skipped[f'{fmt} {method}']}", "", ""])
                continue
            c, r = med[("decoder", fmt, method)]
            rows.append([fmt, method, f"{c:.1f}", f"{c / base:.2f}", f"{r:.0f}"])
    print("\n".join(table(["format", "method", "CPU ms", "vs first", "img/s"], rows, align="llrrr")))
    print("\nprocess_image's steps, new path, one thread (CPU ms per image, median), and resize variants not taken:\n")
    keys = [*STEPS, "gap 2 mean diff", "gap 1 mean diff"]
    rows = [[fmt, *(f"{statistics.median(r[k] for r in steps[fmt]):.2f}" for k in keys)] for fmt in MIX]
    print("\n".join(table(["format", *keys], rows)))
    print("(diff: mean absolute difference per sample, 0-255, from the plain BOX resize)")
    print(f"\nre-encode: {jpeg_sampling()}; optimize off in both")
    if args.json:
        results = {" ".join(key): {"cpu_ms": cpu[key], "img_s": rate[key]} for key in jobs}
        args.json.write_text(json.dumps({"results": results, "skipped": skipped, "mix": mixed}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
