"""Packing: both fine-tuning packers beside pad-to-longest batches and a fixed 512-token drop rule, then tiling beside one resize.

Synthetic LLaVA-style samples (30% text-only, NVLM-tiled images, a multi-turn tail) cut off at a percentile and packed at
8192 tokens and 16 images; ``tile_image`` + JPEG of every tile beside one 448 px resize + JPEG, on demo photos scaled 4x.
"""

from __future__ import annotations

import io
import sys

import numpy as np

import tasks.finetune.packing as pk
from harness.procs import clock
from harness.report import emit, med, parse, parser, table
from tasks.finetune.tiling import choose_grid, encode_jpeg, tile_count, tile_image, tile_members
from tasks.formats.recipe_finetune import PackingConfig, PaddingConfig, TilingConfig


def synthetic(n: int, seed: int, tiling: TilingConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, images, tiles) per sample."""
    rng = np.random.default_rng(seed)
    text = np.exp(rng.normal(5.0, 0.9, n)).astype(np.int64) + 8
    long_tail = rng.random(n) < 0.05  # multi-turn conversations: a heavy tail of long texts
    text[long_tail] += np.exp(rng.normal(7.3, 0.7, long_tail.sum())).astype(np.int64)
    kind = rng.random(n)
    n_images = np.where(kind < 0.3, 0, np.where(kind < 0.9, 1, rng.integers(2, 5, n)))
    tiles = np.zeros(n, np.int64)
    for i in np.nonzero(n_images)[0]:
        for _ in range(n_images[i]):
            aspect, w = float(np.exp(rng.normal(0.2, 0.45))), int(rng.integers(300, 2400))
            tiles[i] += tile_count(choose_grid(w, max(1, int(w / aspect)), tiling), tiling)
    # One tag per tile, two delimiters per image.
    return text + tiles * tiling.tokens_per_tile + tiles + 2 * n_images, n_images, tiles


def packing(args) -> list[str]:
    cfg = PackingConfig(budget=args.budget, max_images=args.max_images)
    tokens, images, tiles = synthetic(args.samples, args.seed, TilingConfig())
    padding = PaddingConfig(cutoff="percentile", percentile=args.percentile, max_tokens=args.budget)
    cutoff = pk.padding_cutoff(tokens, padding, cfg.budget)
    capped = np.minimum(tokens, cutoff).tolist()
    secs: dict[str, list[float]] = {}
    packs: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, fn in (
            ("sorted (baseline)", None),
            ("balanced_greedy", pk.pack_balanced_greedy),
            ("ffd", pk.pack_first_fit_decreasing),
        ):
            with clock() as lap:
                got = (
                    sorted(capped)
                    if fn is None
                    else fn(list(capped), cfg.budget, images.tolist(), cfg.max_images, tiles.tolist(), cfg.max_tiles)
                )
            secs.setdefault(name, []).append(lap.wall)
            packs[name] = got
    base = med(secs["sorted (baseline)"])
    rows = []
    for name in ("balanced_greedy", "ffd"):
        st, s = pk.pack_stats(packs[name], capped, cfg.budget, images.tolist(), tiles.tolist()), med(secs[name])
        rows.append((name, f"{st.fill_ratio:.4f}", st.packs, f"{s:.3f}", f"{s / base:.0f}x", "0"))
    order = np.random.default_rng(args.seed + 1).permutation(len(capped))
    pad = pk.pad_to_longest_ratio(np.asarray(capped)[order], args.batch)
    fill, dropped = pk.fixed_drop_ratio(tokens, 512)
    rows += [
        ("pad-to-longest", f"{pad:.4f}", f"{-(-len(capped) // args.batch)} batches of {args.batch}", "-", "-", "0"),
        ("fixed-512 drop", f"{fill:.4f}", f"{int((tokens <= 512).sum())} rows of 512", "-", "-", f"{dropped:.3f}"),
        ("sorted (baseline)", "-", "-", f"{base:.3f}", "1x", "-"),
    ]
    p = np.percentile(tokens, [50, 90, 99]).astype(int)
    return [
        f"{args.samples} samples: tokens p50 {p[0]}, p90 {p[1]}, p99 {p[2]}, max {tokens.max()}; text-only {float((images == 0).mean()):.2f}; "
        f"cut-off p{args.percentile:g} = {cutoff} ({int((tokens > cutoff).sum())} samples over it); budget {cfg.budget} tokens, "
        f"{cfg.max_images} images a pack; medians of {args.repeats} rounds",
        "",
        *table(("method", "fill ratio", "packs / batches", "seconds", "vs sort", "dropped share"), rows),
    ]


def tiling(args) -> list[str]:
    from PIL import Image

    from tasks.demo.images import render_image

    cfg, photos = TilingConfig(), []
    for i in range(args.images):
        img = Image.open(io.BytesIO(render_image(args.seed, i)[1])).convert("RGB")
        photos.append(img.resize((img.width * 4, img.height * 4)))  # demo photos are small: instruction-data sizes
    rates: dict[str, list[float]] = {"tile + encode": [], "resize 448 + encode (baseline)": []}
    for _ in range(args.repeats):
        with clock() as tile:
            for p in photos:
                tile_members(0, tile_image(p, cfg), cfg.quality)
        with clock() as base:
            for p in photos:
                encode_jpeg(p.resize((cfg.tile_size, cfg.tile_size), Image.Resampling.BICUBIC), cfg.quality)
        rates["tile + encode"].append(len(photos) / tile.wall)
        rates["resize 448 + encode (baseline)"].append(len(photos) / base.wall)
    m = {k: med(v) for k, v in rates.items()}
    tiles = sum(tile_count(choose_grid(p.width, p.height, cfg), cfg) for p in photos) / len(photos)
    rows = [(k, f"{v:.1f}", f"{v / m['resize 448 + encode (baseline)']:.2f}x") for k, v in m.items()]
    head = f"Tiling, one thread: {len(photos)} images of {photos[0].width}x{photos[0].height} or so, {tiles:.1f} tiles each"
    return ["", head, "", *table(("method", "images/s", "vs baseline"), rows)]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=100_000, help="synthetic samples (default 100000)")
    p.add_argument("--budget", type=int, default=8192, help="tokens a pack (default 8192)")
    p.add_argument("--max-images", type=int, default=16, help="images a pack (default 16)")
    p.add_argument("--percentile", type=float, default=99.0, help="the cut-off's percentile of tokens (default 99)")
    p.add_argument("--batch", type=int, default=8, help="batch size of the pad-to-longest baseline")
    p.add_argument("--images", type=int, default=40, help="images for the tiling part (0 skips it)")
    p.add_argument("--seed", type=int, default=0)
    args = parse(p, argv)
    emit("Packing (`bench_packing.py`)", packing(args) + (tiling(args) if args.images else []), argv, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
