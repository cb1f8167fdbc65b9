"""NVLM dynamic high-resolution tiling: grid choice, resize, tiles row by row, thumbnail, 1-D tags."""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import lru_cache

from PIL import Image

from tasks.formats.recipe_finetune import TilingConfig


class TilingError(ValueError):
    """An image that cannot be tiled (undecodable, or over the pixel cap); carries a stable reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@lru_cache(maxsize=64)
def candidate_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (rows, cols) with ``min_tiles <= rows * cols <= max_tiles``, fewest tiles first."""
    grids = {
        (r, c)
        for n in range(min_tiles, max_tiles + 1)
        for r in range(1, n + 1)
        for c in range(1, n + 1)
        if min_tiles <= r * c <= max_tiles
    }
    return tuple(sorted(grids, key=lambda g: (g[0] * g[1], g[1], g[0])))


def choose_grid(width: int, height: int, cfg: TilingConfig) -> tuple[int, int]:
    """The (rows, cols) grid whose aspect ratio (cols / rows) is closest to the image's.

    Ties go to the larger grid when the image covers more than half of that grid's pixels
    (InternVL / NVLM's rule), so a small image is not blown up into many tiles.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for rows, cols in candidate_grids(cfg.min_tiles, cfg.max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (rows, cols), diff
        elif diff == best_diff and area > 0.5 * cfg.tile_size * cfg.tile_size * rows * cols:
            best = (rows, cols)
    return best


def has_thumbnail(grid: tuple[int, int], cfg: TilingConfig) -> bool:
    return cfg.thumbnail and grid[0] * grid[1] > 1


def tile_count(grid: tuple[int, int], cfg: TilingConfig) -> int:
    """Tiles the model sees for this grid, the thumbnail included."""
    return grid[0] * grid[1] + int(has_thumbnail(grid, cfg))


def tile_tags(grid: tuple[int, int], cfg: TilingConfig) -> list[str]:
    """The 1-D tags, one per tile in row-major order, then the thumbnail's."""
    tags = [cfg.tile_tag.format(i=i) for i in range(1, grid[0] * grid[1] + 1)]
    if has_thumbnail(grid, cfg):
        tags.append(cfg.thumbnail_tag)
    return tags


def tag_text(grid: tuple[int, int], cfg: TilingConfig) -> str:
    """What replaces one image placeholder: the delimiters around the tile tags.

    The model inserts ``tokens_per_tile`` image embeddings after each tag.
    """
    return cfg.image_start + "".join(tile_tags(grid, cfg)) + cfg.image_end


def all_tags(cfg: TilingConfig) -> list[str]:
    """Every tag a sample can contain: the special tokens a tokenizer needs added."""
    return [
        cfg.image_start,
        cfg.image_end,
        *(cfg.tile_tag.format(i=i) for i in range(1, cfg.max_tiles + 1)),
        cfg.thumbnail_tag,
    ]


@dataclass
class TiledImage:
    """One image cut into tiles.

    Args:
        grid: (rows, cols).
        width, height: of the source image.
        tiles: ``rows * cols`` tiles of ``tile_size`` squared, row by row.
        thumbnail: the whole image at ``tile_size`` squared, when there is more than one tile.
    """

    grid: tuple[int, int]
    width: int
    height: int
    tiles: list[Image.Image]
    thumbnail: Image.Image | None

    @property
    def count(self) -> int:
        return len(self.tiles) + (self.thumbnail is not None)


def tile_image(img: Image.Image, cfg: TilingConfig) -> TiledImage:
    """Resize to ``tile_size * cols`` x ``tile_size * rows`` and cut row by row."""
    rgb = img.convert("RGB") if img.mode != "RGB" else img
    grid = choose_grid(rgb.width, rgb.height, cfg)
    rows, cols = grid
    s = cfg.tile_size
    resized = rgb.resize((s * cols, s * rows), Image.Resampling.BICUBIC)
    tiles = [resized.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(cols)]
    thumb = rgb.resize((s, s), Image.Resampling.BICUBIC) if has_thumbnail(grid, cfg) else None
    return TiledImage(grid=grid, width=rgb.width, height=rgb.height, tiles=tiles, thumbnail=thumb)


def _open_header(data: bytes, max_pixels: int) -> Image.Image:
    """Image bytes opened (header read, pixels not decoded), refused when over ``max_pixels``."""
    try:
        img = Image.open(io.BytesIO(data))
    except (OSError, ValueError, SyntaxError) as err:
        raise TilingError("undecodable_image", str(err)[:160]) from None
    if img.width * img.height > max_pixels:
        raise TilingError("decompression_bomb", f"{img.width}x{img.height} over {max_pixels} pixels")
    return img


def open_capped(data: bytes, max_pixels: int) -> Image.Image:
    """Open image bytes, refusing (before decoding) a header over ``max_pixels``."""
    img = _open_header(data, max_pixels)
    try:
        img.load()
    except (OSError, ValueError, SyntaxError, EOFError) as err:
        raise TilingError("undecodable_image", str(err)[:160]) from None
    return img


def image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) from the header only."""
    img = _open_header(data, max_pixels)
    return img.width, img.height


def encode_jpeg(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def tile_members(index: int, tiled: TiledImage, quality: int) -> dict[str, bytes]:
    """Stored members of one image's tiles: ``i{n}.t00.jpg`` ... then ``i{n}.thumb.jpg``."""
    out = {f"i{index}.t{j:02d}.jpg": encode_jpeg(t, quality) for j, t in enumerate(tiled.tiles)}
    if tiled.thumbnail is not None:
        out[f"i{index}.thumb.jpg"] = encode_jpeg(tiled.thumbnail, quality)
    return out
