"""Decode benchmark: JPEG decoders side by side, 2 threads, outputs with a 256 px short side.

One invocation generates (or reuses) a corpus of photo-like JPEGs, 200..2000 px, under
``.bench/decode-corpus/``, loads it into memory, and then runs, alternating, for
``--repeats`` rounds:

- ``pillow-full``: Pillow full decode, then an area resize to a 256 px short side (baseline);
- ``pillow-draft``: the same with ``draft()`` first (libjpeg DCT scaling to 1/2, 1/4, 1/8,
  never below the target);
- ``opencv-reduced``: the header read by Pillow (as the pixel cap needs), then
  ``cv2.imdecode`` with ``IMREAD_REDUCED_COLOR_2/4/8`` chosen by size, BGR->RGB, INTER_AREA
  resize (skipped when opencv-python-headless is not installed);
- ``dali-cpu``: ``fn.decoders.image(device="cpu")`` + ``fn.resize(resize_shorter=256)`` in a
  pipeline with ``device_id=None``, batch 32, 2 threads (skipped without nvidia-dali);
- ``shardsmith``: ``tasks.images.process_image`` end to end with ``center_crop`` 256 (decode,
  checks, pixel sha256, pHash, resize, JPEG re-encode): what the pipeline runs;
- ``shardsmith-nodraft``: the same with the JPEG draft turned off.

Threaded methods map over a 2-thread pool (Pillow, OpenCV and hashlib release the GIL while
they work); OpenCV's own thread pool is set to 1 so each call uses one core. Printed per
method: median images/s over the rounds and its ratio to ``pillow-full`` in the same rounds,
then CPU ms per image (process CPU time, all threads) and the baseline's CPU per image over
it. On a shared machine the CPU figures are the steadier ones; rounds alternate methods.
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
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BENCH_DIR = REPO / ".bench" / "decode-corpus"
CORPUS_VERSION = 1  # bump when the generator changes, so a cached corpus is made again
SHORT_SIDE = 256
METHODS = ("pillow-full", "pillow-draft", "opencv-reduced", "dali-cpu", "shardsmith", "shardsmith-nodraft")


# ------------------------------------------------------------------------------------- corpus


def _render(seed: int, index: int) -> bytes:
    """JPEG ``index``: a smooth colour field, mid-frequency texture and grain (photo-like sizes)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([seed, index])
    long_side = int(rng.integers(200, 2001))
    aspect = float(rng.choice([1.0, 1.25, 4 / 3, 3 / 2, 16 / 9]))
    w, h = long_side, max(1, round(long_side / aspect))
    if rng.random() < 0.3:
        w, h = h, w
    base = Image.fromarray(rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    tex = rng.normal(0, 1, size=(max(2, h // 6), max(2, w // 6), 3))
    tex = Image.fromarray(np.clip(128 + 40 * tex, 0, 255).astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.asarray(base, np.int16) + (np.asarray(tex, np.int16) - 128)
    arr += rng.integers(-4, 5, size=(h, w, 1), dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=int(rng.integers(75, 93)))
    return out.getvalue()


def ensure_corpus(count: int, seed: int) -> list[bytes]:
    """The corpus as bytes; generated once into ``.bench/decode-corpus/`` and reused."""
    folder = BENCH_DIR / f"v{CORPUS_VERSION}-s{seed}-n{count}"
    stamp = folder / ".complete.json"
    names = [f"d{i:04d}.jpg" for i in range(count)]
    if not stamp.exists():
        folder.mkdir(parents=True, exist_ok=True)
        print(f"generating {count} JPEGs into {folder} (once; reused by later runs) ...", flush=True)
        started = time.perf_counter()
        with ProcessPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as ex:
            for name, data in zip(names, ex.map(_render, [seed] * count, range(count), chunksize=8)):
                (folder / name).write_bytes(data)
        stamp.write_text(json.dumps({"count": count, "seed": seed}))
        print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)
    return [(folder / name).read_bytes() for name in names]


# ------------------------------------------------------------------------------------ methods


def _target(w: int, h: int) -> tuple[int, int]:
    scale = SHORT_SIDE / min(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def _scale_for(w: int, h: int) -> int:
    """Largest of 8, 4, 2 that keeps the short side at or above the target; else 1."""
    for k in (8, 4, 2):
        if min(w, h) // k >= SHORT_SIDE:
            return k
    return 1


def pillow_full(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
        img = img.convert("RGB")
        return img.resize(_target(*img.size), Image.Resampling.BOX)


def pillow_draft(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
        w, h = img.size
        k = _scale_for(w, h)
        box = None
        if k > 1:
            drafted = img.draft(None, (w // k, h // k))
            box = drafted[1] if drafted else None
        img = img.convert("RGB")
        return img.resize(_target(w, h), Image.Resampling.BOX, box=box)


def opencv_reduced(data: bytes):
    import cv2
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:  # header only: the pixel cap
        w, h = img.size
    flag = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}[_scale_for(w, h)]
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
    arr = cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
    return cv2.resize(arr, _target(w, h), interpolation=cv2.INTER_AREA)


def shardsmith(data: bytes, rules):
    from tasks.images import process_image

    outcome = process_image(data, rules)
    if outcome.reason is not None:
        raise RuntimeError(f"{outcome.reason}: {outcome.detail}")
    return outcome


def available(method: str) -> str | None:
    """None when the method can run here, else why not."""
    try:
        if method == "opencv-reduced":
            import cv2

            cv2.setNumThreads(1)
        elif method == "dali-cpu":
            import nvidia.dali  # noqa: F401
    except ImportError as err:
        return f"not installed ({err.name})"
    return None


def run_threaded(fn, corpus: list[bytes], threads: int) -> int:
    with ThreadPoolExecutor(max_workers=threads) as ex:
        return sum(1 for _ in ex.map(fn, corpus))


def make_dali(threads: int, batch: int):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, prefetch_queue_depth=1, exec_dynamic=True)
    def decode_resize():
        encoded = fn.external_source(name="jpegs", dtype=types.UINT8, no_copy=False)
        images = fn.decoders.image(encoded, device="cpu", output_type=types.RGB)
        return fn.resize(images, resize_shorter=SHORT_SIDE, antialias=True)

    pipe = decode_resize()
    pipe.build()
    return pipe


def run_dali(pipe, corpus: list[bytes], batch: int) -> int:
    import numpy as np

    done = 0
    for start in range(0, len(corpus), batch):
        chunk = [np.frombuffer(d, np.uint8) for d in corpus[start : start + batch]]
        pipe.feed_input("jpegs", chunk)
        (out,) = pipe.run()
        done += len(out)
    return done


# -------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=300, help="corpus size (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="rounds; each runs every method once (default 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="DALI batch size (default 32)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        print(f"unknown methods: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if "pillow-full" not in methods:
        methods.insert(0, "pillow-full")  # the baseline every ratio is against

    corpus = ensure_corpus(args.images, args.seed)
    megapixels = 0.0
    from PIL import Image

    for data in corpus:
        with Image.open(io.BytesIO(data)) as img:
            megapixels += img.width * img.height / 1e6
    print(
        f"corpus: {len(corpus)} JPEGs, {sum(map(len, corpus)) / 1e6:.0f} MB, {megapixels / len(corpus):.2f} Mpx mean; "
        f"{args.threads} threads, {SHORT_SIDE} px short side; {args.repeats} rounds; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )

    from tasks import images
    from tasks.recipe import ImageRules

    rules = ImageRules(resize_mode="center_crop", image_size=SHORT_SIDE, min_side=1, max_aspect_ratio=100.0)
    skipped: dict[str, str] = {}
    runners = {}
    for method in methods:
        why = available(method)
        if why:
            skipped[method] = why
            continue
        if method == "pillow-full":
            runners[method] = lambda: run_threaded(pillow_full, corpus, args.threads)
        elif method == "pillow-draft":
            runners[method] = lambda: run_threaded(pillow_draft, corpus, args.threads)
        elif method == "opencv-reduced":
            runners[method] = lambda: run_threaded(opencv_reduced, corpus, args.threads)
        elif method == "dali-cpu":
            pipe = make_dali(args.threads, args.batch)
            run_dali(pipe, corpus[: args.batch], args.batch)  # warm-up: allocations, thread start
            runners[method] = lambda pipe=pipe: run_dali(pipe, corpus, args.batch)
        elif method == "shardsmith":
            runners[method] = lambda: run_threaded(lambda d: shardsmith(d, rules), corpus, args.threads)
        elif method == "shardsmith-nodraft":

            def nodraft():
                images._JPEG_DRAFT = False
                try:
                    return run_threaded(lambda d: shardsmith(d, rules), corpus, args.threads)
                finally:
                    images._JPEG_DRAFT = True

            runners[method] = nodraft

    rates: dict[str, list[float]] = {m: [] for m in runners}
    cpu: dict[str, list[float]] = {m: [] for m in runners}
    ratios: dict[str, list[float]] = {m: [] for m in runners}
    for rnd in range(args.repeats):
        row = {}
        for method, runner in runners.items():
            wall0, cpu0 = time.perf_counter(), time.process_time()
            done = runner()
            wall, used = time.perf_counter() - wall0, time.process_time() - cpu0
            if done != len(corpus):
                raise RuntimeError(f"{method} produced {done} of {len(corpus)} images")
            row[method] = len(corpus) / wall
            rates[method].append(row[method])
            cpu[method].append(1000 * used / len(corpus))
        for method in runners:
            ratios[method].append(row[method] / row["pillow-full"])
        print(f"round {rnd + 1}: " + ", ".join(f"{m} {r:.0f}/s" for m, r in row.items()), flush=True)

    print()
    print("| method | img/s (median) | vs pillow-full | CPU ms/img | CPU vs pillow-full |")
    print("|---|---:|---:|---:|---:|")
    results = {}
    for method in METHODS:
        if method in skipped:
            print(f"| {method} | skipped: {skipped[method]} | | | |")
            continue
        if method not in runners:
            continue
        med, cms, ratio = statistics.median(rates[method]), statistics.median(cpu[method]), statistics.median(ratios[method])
        cpu_ratio = statistics.median(cpu["pillow-full"]) / cms
        results[method] = {"img_s": med, "ratio": ratio, "cpu_ms_per_img": cms, "cpu_ratio": cpu_ratio, "rounds": rates[method]}
        print(f"| {method} | {med:.0f} | {ratio:.2f}x | {cms:.1f} | {cpu_ratio:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "skipped": skipped, "images": len(corpus)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
