"""Synthetic photo-like images for the web benchmarks: rendered once into a pool under .bench/, and URL manifests over them."""

from __future__ import annotations

import io
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from .procs import BENCH_DIR
from .tools import LICENSE

POOL_VERSION = 1  # bump when the generator changes, so a cached pool is made again


def render(seed: int, index: int) -> tuple[str, bytes]:
    """Image ``index`` of the pool: a smooth colour field, texture and grain, so that encoders work as on photos (JPEG
    ~1.5-2.5 bits per pixel). About 80% JPEG, 10% PNG (posterised graphics, <= 1000 px), 10% WebP, 200..2000 px."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([seed, index])
    u = rng.random()
    fmt = "JPEG" if u < 0.8 else ("PNG" if u < 0.9 else "WEBP")
    long_side = int(rng.integers(200, 2001 if fmt != "PNG" else 1001))
    aspect = float(rng.choice([1.0, 1.25, 4 / 3, 3 / 2, 16 / 9]))
    w, h = long_side, max(1, round(long_side / aspect))
    if rng.random() < 0.3:
        w, h = h, w
    base = Image.fromarray(rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)).resize(
        (w, h), Image.Resampling.BICUBIC
    )
    tex = rng.normal(0, 1, size=(max(2, h // 6), max(2, w // 6), 3))
    tex = Image.fromarray(np.clip(128 + 40 * tex, 0, 255).astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.asarray(base, np.int16) + (np.asarray(tex, np.int16) - 128)
    grain = 4 if fmt != "PNG" else 1
    arr += rng.integers(-grain, grain + 1, size=(h, w, 1), dtype=np.int16)
    arr = np.clip(arr, 0, 255).astype(np.uint8)
    if fmt == "PNG":
        arr &= 0xF0
    out = io.BytesIO()
    img = Image.fromarray(arr)
    if fmt == "JPEG":
        img.save(out, "JPEG", quality=int(rng.integers(75, 93)))
        ext = "jpg"
    elif fmt == "WEBP":
        img.save(out, "WEBP", quality=int(rng.integers(70, 90)), method=2)
        ext = "webp"
    else:
        img.save(out, "PNG", compress_level=6)
        ext = "png"
    return f"p{index:04d}.{ext}", out.getvalue()


def ensure_pool(rows: int, seed: int) -> tuple[Path, dict[str, int]]:
    """A pool folder holding at least ``rows`` images, and {name: bytes} of the first ``rows``. Image ``i`` depends only
    on the seed and ``i``: the pool grows when an invocation asks for more, and is otherwise reused."""
    folder = BENCH_DIR / "validate" / f"pool-v{POOL_VERSION}-s{seed}"
    stamp = folder / ".complete.json"  # a leading dot: the image server refuses to serve it
    sizes: dict[str, int] = json.loads(stamp.read_text()) if stamp.exists() else {}
    have = {int(name[1:].split(".", 1)[0]) for name in sizes}
    if missing := [i for i in range(rows) if i not in have]:
        folder.mkdir(parents=True, exist_ok=True)
        print(f"rendering {len(missing)} images into {folder} (once; reused by later runs) ...", flush=True)
        started = time.perf_counter()
        # At the lowest priority: someone's timed run may be going.
        with ProcessPoolExecutor(
            max_workers=max(1, min(2, os.cpu_count() or 1)), initializer=os.nice, initargs=(19,)
        ) as ex:
            for name, data in ex.map(render, [seed] * len(missing), missing, chunksize=16):
                (folder / name).write_bytes(data)
                sizes[name] = len(data)
        print(f"  {sum(sizes.values()) / 1e6:.0f} MB in all, made in {time.perf_counter() - started:.0f} s", flush=True)
        stamp.write_text(json.dumps(sizes, sort_keys=True))
    by_index = {int(name[1:].split(".", 1)[0]): name for name in sizes}
    return folder, {by_index[i]: sizes[by_index[i]] for i in range(rows)}


def write_manifest(path: Path, urls: list[str], **columns: list) -> None:
    """A parquet manifest: ``url``, a caption per row, the license, and ``columns`` (which may replace them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(urls)
    data = {"url": urls, "caption": [f"synthetic photo number {i}" for i in range(n)], "license": [LICENSE] * n}
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(data | columns), path)
