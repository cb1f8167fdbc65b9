"""Packing benchmark: both packers beside pad-to-longest batches and a fixed 512-token drop rule.

One invocation draws ``--samples`` synthetic instruction samples shaped like LLaVA-style
fine-tuning data (long-tailed): 30% text-only chats, the rest with one image (NVLM tiling of a
random aspect ratio, 1..6 tiles plus a thumbnail, 256 tokens per tile) or, for 10%, two to four
images; text lengths log-normal, with a heavy multi-turn tail. Lengths are cut off at the
recipe's padding percentile (99th) with the truncate policy approximated as a cap; then, at
the recipe budget (8192 tokens, 16 images per pack):

- ``balanced_greedy`` and ``ffd``: fill ratio (useful tokens / packs x budget) and seconds,
  with the ratio to sorting the lengths (``sorted``, the baseline every packer pays);
- ``pad-to-longest``: batches of ``--batch`` consecutive samples padded to their longest;
- ``fixed-512``: samples over 512 tokens dropped, the rest padded to 512 (fill and dropped share).

Then tiling throughput: ``tile_image`` (grid choice, resize, crop, thumbnail) plus JPEG
encoding of the tiles, images/s, beside a single 448 px resize-and-encode per image (the
baseline), on ``--images`` photos from the demo corpus generator.
"""

from __future__ import annotations

import argparse
import io
import platform
import statistics
import sys

import numpy as np

from harness.procs import REPO, clock
from harness.report import table

sys.path.insert(0, str(REPO))

from tasks.finetune.packing import (  # noqa: E402
    fixed_drop_ratio,
    pack_balanced_greedy,
    pack_first_fit_decreasing,
    pack_stats,
    pad_to_longest_ratio,
    padding_cutoff,
)
from tasks.finetune.tiling import choose_grid, encode_jpeg, tile_count, tile_image, tile_members  # noqa: E402
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
            aspect = float(np.exp(rng.normal(0.2, 0.45)))
            w = int(rng.integers(300, 2400))
            grid = choose_grid(w, max(1, int(w / aspect)), tiling)
            tiles[i] += tile_count(grid, tiling)
    tag_tokens = tiles + 2 * n_images  # one tag per tile, two delimiters per image
    tokens = text + tiles * tiling.tokens_per_tile + tag_tokens
    return tokens, n_images, tiles


def bench_packing(args: argparse.Namespace) -> None:
    tiling = TilingConfig()
    cfg = PackingConfig(budget=args.budget, max_images=args.max_images)
    tokens, images, tiles = synthetic(args.samples, args.seed, tiling)
    cutoff = padding_cutoff(
        tokens, PaddingConfig(cutoff="percentile", percentile=args.percentile, max_tokens=args.budget), cfg.budget
    )
    over = int((tokens > cutoff).sum())
    capped = np.minimum(tokens, cutoff)
    pct = np.percentile(tokens, [50, 90, 99, 99.9]).astype(int)
    print(
        f"{args.samples} samples: tokens p50 {pct[0]} p90 {pct[1]} p99 {pct[2]} p99.9 {pct[3]} max {tokens.max()}; "
        f"text-only {float((images == 0).mean()):.2f}; cut-off p{args.percentile:g} = {cutoff} ({over} samples over, truncated)"
    )
    print(f"budget {cfg.budget} tokens, {cfg.max_images} images per pack; {args.repeats} rounds, median seconds\n")
    rows = []
    t_sort = []
    for _ in range(args.repeats):
        with clock() as lap:
            sorted(capped.tolist())
        t_sort.append(lap.wall)
    base = statistics.median(t_sort)
    for name, fn in (("balanced_greedy", pack_balanced_greedy), ("ffd", pack_first_fit_decreasing)):
        secs = []
        for _ in range(args.repeats):
            with clock() as lap:
                packs = fn(capped.tolist(), cfg.budget, images.tolist(), cfg.max_images, tiles.tolist(), cfg.max_tiles)
            secs.append(lap.wall)
        st = pack_stats(packs, capped.tolist(), cfg.budget, images.tolist(), tiles.tolist())
        secs_med = statistics.median(secs)
        rows.append((name, f"{st.fill_ratio:.4f}", f"{st.packs}", f"{secs_med:.3f}", f"{secs_med / base:.0f}x", "0"))
    order = np.random.default_rng(args.seed + 1).permutation(len(capped))
    rows.append(
        (
            "pad-to-longest",
            f"{pad_to_longest_ratio(capped[order], args.batch):.4f}",
            f"{-(-len(capped) // args.batch)} batches of {args.batch}",
            "-",
            "-",
            "0",
        )
    )
    fill, dropped = fixed_drop_ratio(tokens, 512)
    rows.append(
        ("fixed-512 drop", f"{fill:.4f}", f"{int((tokens <= 512).sum())} rows of 512", "-", "-", f"{dropped:.3f}")
    )
    rows.append(("sorted (baseline)", "-", "-", f"{base:.3f}", "1x", "-"))
    head = ("method", "fill ratio", "packs / batches", "seconds", "vs sort", "dropped share")
    print("\n".join(table(head, rows)))


def bench_tiling(args: argparse.Namespace) -> None:
    from PIL import Image

    from tasks.demo.images import render_image

    cfg = TilingConfig()
    photos = []
    for i in range(args.images):
        _, data, _ = render_image(args.seed, i)
        img = Image.open(io.BytesIO(data)).convert("RGB")
        # Demo photos are small; scale them up to typical instruction-data sizes.
        photos.append(img.resize((img.width * 4, img.height * 4)))
    rates = {"tile+encode": [], "resize448+encode (baseline)": []}
    tiles = sum(tile_count(choose_grid(p.width, p.height, cfg), cfg) for p in photos)
    for _ in range(args.repeats):
        with clock() as tile:
            for p in photos:
                tile_members(0, tile_image(p, cfg), cfg.quality)
        with clock() as base:
            for p in photos:
                encode_jpeg(p.resize((cfg.tile_size, cfg.tile_size), Image.Resampling.BICUBIC), cfg.quality)
        rates["tile+encode"].append(len(photos) / tile.wall)
        rates["resize448+encode (baseline)"].append(len(photos) / base.wall)
    med = {k: statistics.median(v) for k, v in rates.items()}
    size = f"{photos[0].width}x{photos[0].height}" if photos else "-"
    print(
        f"\ntiling: {len(photos)} images (first {size}), {tiles / max(len(photos), 1):.1f} tiles per image, one thread"
    )
    for k, v in med.items():
        print(f"  {k}: {v:.1f} images/s")
    print(f"  ratio tile / baseline: {med['tile+encode'] / med['resize448+encode (baseline)']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--max-images", type=int, default=16)
    ap.add_argument("--percentile", type=float, default=99.0)
    ap.add_argument("--batch", type=int, default=8, help="batch size of the pad-to-longest baseline")
    ap.add_argument("--images", type=int, default=40, help="images for the tiling benchmark (0 skips it)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, python {platform.python_version()}")
    bench_packing(args)
    if args.images:
        bench_tiling(args)


if __name__ == "__main__":
    main()
