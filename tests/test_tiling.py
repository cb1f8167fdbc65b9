"""Tests for NVLM dynamic tiling: grid choice, tiles row by row, thumbnail and tag text."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tasks.finetune.tiling import (
    TilingError,
    all_tags,
    candidate_grids,
    choose_grid,
    image_size,
    open_capped,
    tag_text,
    tile_count,
    tile_image,
    tile_members,
)
from tasks.formats.recipe_finetune import TilingConfig

CFG = TilingConfig()


def test_candidate_grids_respect_max_tiles():
    grids = candidate_grids(1, 6)
    assert all(r * c <= 6 for r, c in grids)
    assert (2, 3) in grids and (3, 2) in grids and (1, 6) in grids and (6, 1) in grids
    assert (3, 3) not in grids


@pytest.mark.parametrize(
    "size, grid",
    [
        ((1344, 896), (2, 3)),  # 3:2 landscape -> 2 rows x 3 cols
        ((896, 1344), (3, 2)),
        ((2688, 448), (1, 6)),  # 6:1 panorama
        ((448, 448), (1, 1)),  # small square: the 1x1 tie wins (not large enough for 2x2)
        ((1000, 1000), (2, 2)),  # large square: the tie goes to the larger grid
        ((900, 448), (1, 2)),
    ],
)
def test_grid_closest_aspect_ratio(size, grid):
    assert choose_grid(*size, CFG) == grid


def test_grid_honours_recipe_max_tiles():
    assert choose_grid(4000, 400, TilingConfig(max_tiles=4)) == (1, 4)
    assert choose_grid(4000, 400, TilingConfig(max_tiles=1)) == (1, 1)


def test_tags_and_thumbnail_policy():
    assert tag_text((1, 1), CFG) == "<img><tile_1></img>"
    assert (
        tag_text((2, 3), CFG) == "<img>" + "".join(f"<tile_{i}>" for i in range(1, 7)) + "<tile_global_thumbnail></img>"
    )
    assert tile_count((2, 3), CFG) == 7
    assert tile_count((1, 1), CFG) == 1
    no_thumb = TilingConfig(thumbnail=False)
    assert tile_count((2, 3), no_thumb) == 6 and "thumbnail" not in tag_text((2, 3), no_thumb)
    assert "<tile_6>" in all_tags(CFG) and "<tile_global_thumbnail>" in all_tags(CFG)


def _gradient(w: int, h: int) -> Image.Image:
    img = Image.new("RGB", (w, h))
    img.putdata([(x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), 0) for y in range(h) for x in range(w)])
    return img


def test_tiles_cut_row_by_row():
    cfg = TilingConfig(tile_size=32)
    tiled = tile_image(_gradient(96, 64), cfg)  # 3:2 -> 2 rows x 3 cols
    assert tiled.grid == (2, 3)
    assert len(tiled.tiles) == 6 and tiled.thumbnail is not None and tiled.count == 7
    assert all(t.size == (32, 32) for t in tiled.tiles) and tiled.thumbnail.size == (32, 32)
    # Red grows with x, green with y: tile 1 is right of tile 0, tile 3 is below tile 0.
    red = [t.getpixel((16, 16))[0] for t in tiled.tiles]
    green = [t.getpixel((16, 16))[1] for t in tiled.tiles]
    assert red[0] < red[1] < red[2] and red[3] < red[4] < red[5]
    assert green[0] < green[3] and green[2] < green[5]
    members = tile_members(0, tiled, 80)
    assert list(members) == [f"i0.t{j:02d}.jpg" for j in range(6)] + ["i0.thumb.jpg"]
    assert all(Image.open(io.BytesIO(b)).size == (32, 32) for b in members.values())


def test_pixel_cap_before_decode():
    buf = io.BytesIO()
    _gradient(64, 64).save(buf, format="PNG")
    assert image_size(buf.getvalue(), 10_000) == (64, 64)
    with pytest.raises(TilingError) as err:
        open_capped(buf.getvalue(), 1000)
    assert err.value.reason == "decompression_bomb"
    with pytest.raises(TilingError) as err:
        open_capped(b"not an image", 1000)
    assert err.value.reason == "undecodable_image"
