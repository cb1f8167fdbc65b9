"""Decoding per format, issues 3 and 13: CPU per image of process_image on today's decoders beside its old all-Pillow path.

On the first 400 images of the photo pool (~80% JPEG, 10% PNG, 10% WebP), border 256 px, JPEG q95, ``--threads`` threads:
``old`` (every WebP and PNG through Pillow), ``full`` (today's decoders, WebPs at full size) and ``new`` (as it is).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from harness.photos import ensure_pool
from harness.procs import clock
from harness.report import emit, medians, parse, parser, rounds, table

SIDE, PATHS = 256, ("old", "full", "new")
MIX = {"jpeg": 0.8, "png": 0.1, "webp": 0.1}
EXTS = {"jpg": "jpeg", "png": "png", "webp": "webp"}


def process(path: str, images: list[bytes], threads: int) -> int:
    """``process_image`` over ``images`` in ``threads`` threads with the decoders ``path`` names; images done."""
    from tasks.formats.recipe_download import ImageRules
    from tasks.policies import decoders
    from tasks.policies.images import process_image

    rules = ImageRules(resize_mode="border", image_size=SIDE, min_side=1, max_aspect_ratio=100.0)

    def one(data: bytes):
        if (outcome := process_image(data, rules)).reason is not None:
            raise RuntimeError(f"{outcome.reason}: {outcome.detail}")

    decoders.STILL_WEBP = decoders.PLAIN_PNG = path != "old"
    decoders.WEBP_SCALED = path == "new"
    try:
        with ThreadPoolExecutor(max_workers=threads) as ex:
            return sum(1 for _ in ex.map(one, images))
    finally:
        decoders.STILL_WEBP = decoders.PLAIN_PNG = decoders.WEBP_SCALED = True


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--pool", type=int, default=400, help="images of the photo pool (default 400)")
    p.add_argument("--seed", type=int, default=0, help="the pool's seed (default 0)")
    p.add_argument("--threads", type=int, default=2, help="threads, as a Dask worker's (default 2)")
    args = parse(p, argv)
    folder, sizes = ensure_pool(args.pool, args.seed)
    pool: dict[str, list[bytes]] = {fmt: [] for fmt in MIX}
    for name in sorted(sizes):
        pool[EXTS[name.rsplit(".", 1)[1]]].append((folder / name).read_bytes())

    def run(key: str, _rnd: int) -> dict:
        fmt, path = key.split()
        with clock() as lap:
            if (done := process(path, pool[fmt], args.threads)) != len(pool[fmt]):
                raise RuntimeError(f"{key} produced {done} of {len(pool[fmt])} images")
        return {"tool": key, "CPU ms": 1000 * lap.cpu / len(pool[fmt]), "img/s": len(pool[fmt]) / lap.wall}

    cpu = medians(rounds([f"{fmt} {path}" for fmt in MIX for path in PATHS], args.repeats, run), lambda r: r["CPU ms"])
    rows, mixed = [], dict.fromkeys(PATHS, 0.0)
    for fmt, weight in MIX.items():
        c = {path: cpu[f"{fmt} {path}"] for path in PATHS}
        mixed = {k: v + weight * c[k] for k, v in mixed.items()}
        rows.append(
            [
                fmt,
                len(pool[fmt]),
                *(f"{c[k]:.1f}" for k in PATHS),
                f"{c['new'] / c['old']:.2f}",
                f"{c['new'] / c['full']:.2f}",
            ]
        )
    rows.append(
        [
            "**mix 80/10/10**",
            "",
            *(f"{v:.2f}" for v in mixed.values()),
            f"**{mixed['new'] / mixed['old']:.2f}**",
            f"**{mixed['new'] / mixed['full']:.2f}**",
        ]
    )
    lines = [
        f"`process_image`, border {SIDE} px, JPEG q95, CPU ms per image (medians of {args.repeats} rounds, {args.threads} threads)",
        "",
        *table(["format", "images", "old", "full", "new", "new / old", "new / full"], rows),
    ]
    emit("Decoding per format (`bench_decode.py`)", lines, argv, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
