"""Tests for constrained padding and the two packers (budget, image and tile caps, fill ratio)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.finetune.packing import (
    PackingError,
    cu_seqlens,
    fixed_drop_ratio,
    pack,
    pack_balanced_greedy,
    pack_first_fit_decreasing,
    pack_stats,
    pad_to_longest_ratio,
    padding_cutoff,
    truncate_at_turns,
)
from tasks.formats.recipe_finetune import PackingConfig, PaddingConfig

PACKERS = [pack_balanced_greedy, pack_first_fit_decreasing]


def _check(packs, tokens, images, tiles, budget, max_images, max_tiles):
    seen = sorted(i for p in packs for i in p)
    assert seen == list(range(len(tokens)))  # every item in exactly one pack
    for p in packs:
        assert p, "no empty packs"
        assert sum(tokens[i] for i in p) <= budget
        assert sum(images[i] for i in p) <= max_images
        if max_tiles is not None:
            assert sum(tiles[i] for i in p) <= max_tiles


@pytest.mark.parametrize("packer", PACKERS)
@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(0, 100), st.integers(0, 3), st.integers(0, 7)), max_size=80),
    max_images=st.integers(3, 6),
    max_tiles=st.one_of(st.none(), st.integers(7, 20)),
)
def test_packs_respect_every_limit(packer, items, max_images, max_tiles):
    tokens = [t for t, _, _ in items]
    images = [m for _, m, _ in items]
    tiles = [k for _, _, k in items]
    packs = packer(tokens, 100, images, max_images, tiles, max_tiles)
    _check(packs, tokens, images, tiles, 100, max_images, max_tiles)


@pytest.mark.parametrize("packer", PACKERS)
def test_image_cap_binds_before_tokens(packer):
    tokens = [10] * 8
    images = [1] * 8
    packs = packer(tokens, 1000, images, 2)
    assert len(packs) == 4 and all(len(p) == 2 for p in packs)


@pytest.mark.parametrize("packer", PACKERS)
def test_oversize_item_is_refused(packer):
    with pytest.raises(PackingError, match="cannot fit"):
        packer([50, 101], 100)
    with pytest.raises(PackingError):
        packer([5], 100, [3], 2)


def test_ffd_is_first_fit():
    # Sorted: 60, 50, 40, 30, 20 into 100: [60, 40], [50, 30, 20].
    packs = pack_first_fit_decreasing([20, 60, 30, 50, 40], 100)
    assert [sorted(p) for p in packs] == [[1, 4], [0, 2, 3]]


def test_balanced_spreads_load():
    tokens = [40] * 6
    packs = pack_balanced_greedy(tokens, 100)
    assert len(packs) == 3 and all(len(p) == 2 for p in packs)  # 80/80/80, not 80/80/40+40


def test_long_tailed_fill_ratio_beats_naive_padding():
    rng = random.Random(0)
    tokens = [min(4096, int(rng.lognormvariate(5.5, 0.9))) + 1 for _ in range(3000)]
    # The lower bound is ceil(total / budget) packs; FFD leaves its last packs part-full.
    for algo, least in (("balanced_greedy", 0.98), ("ffd", 0.95)):
        cfg = PackingConfig(algorithm=algo, budget=8192, max_images=64)
        packs = pack(tokens, [1] * len(tokens), [1] * len(tokens), cfg)
        stats = pack_stats(packs, tokens, cfg.budget, [1] * len(tokens))
        assert stats.samples == len(tokens) and stats.max_tokens <= 8192 and stats.max_images <= 64
        assert stats.fill_ratio >= least, (algo, stats)
    assert pad_to_longest_ratio(tokens, 8) < 0.8


def test_padding_cutoff_fixed_and_percentile():
    lengths = list(range(1, 101))
    assert padding_cutoff(lengths, PaddingConfig(cutoff="fixed", max_tokens=70)) == 70
    assert padding_cutoff(lengths, PaddingConfig(cutoff="percentile", percentile=90, max_tokens=1000)) == 91
    assert padding_cutoff(lengths, PaddingConfig(cutoff="percentile", percentile=90, max_tokens=50)) == 50
    assert padding_cutoff(lengths, PaddingConfig(cutoff="fixed", max_tokens=500), budget=64) == 64
    assert padding_cutoff([], PaddingConfig(max_tokens=10)) == 10


def test_truncate_at_turn_boundary():
    turns = [10, 20, 5, 5, 30, 30]
    assert truncate_at_turns(turns, 1000) == 6
    assert truncate_at_turns(turns, 40) == 4  # 30 + 10; the third exchange (60) does not fit
    assert truncate_at_turns(turns, 30) == 2
    assert truncate_at_turns(turns, 29) == 0  # not even the first exchange: dropped


def test_baselines_and_cu_seqlens():
    assert cu_seqlens([3, 4, 5]) == [0, 3, 7, 12]
    assert pad_to_longest_ratio([10, 10, 10, 10], 2) == 1.0
    assert pad_to_longest_ratio([10, 30, 10], 2) == pytest.approx(50 / 70)
    assert fixed_drop_ratio([256, 512, 1024, 128], 512) == (pytest.approx((256 + 512 + 128) / (3 * 512)), 0.25)


def _plan_rows(image_records: list[tuple[str, int, int]], text_only: int) -> list:
    """Accepted sample rows as the plan reads them: (key, tokens, images) per image record, then
    ``text_only`` text-only records of 10 tokens."""
    import pyarrow as pa

    from tasks.finetune.packs import PLAN_COLUMNS
    from tasks.formats.ledger import SAMPLE_SCHEMA

    def row(key: str, tokens: int, images: int) -> dict:
        return {
            "key": key,
            "source": "chat",
            "row": 0,
            "status": "ok",
            "reason": None,
            "detail": None,
            "shard": "s.tar",
            "offset": 0,
            "length": 1,
            "text_only": images == 0,
            "images": images,
            "tiles": images,
            "tokens_total": tokens,
            "turn_tokens": [tokens],
            "turn_images": [images],
            "turn_tiles": [images],
        }

    rows = [row(k, t, n) for k, t, n in image_records] + [row(f"txt-{i}", 10, 0) for i in range(text_only)]
    schema = pa.schema([SAMPLE_SCHEMA.field(c) for c in PLAN_COLUMNS])
    return [pa.Table.from_pylist(rows, schema=schema)]


@pytest.mark.parametrize(
    ("padding", "packing", "dropped"),
    [
        # two records over the pack's image cap
        (PaddingConfig(cutoff="fixed", max_tokens=500), PackingConfig(budget=1000, max_images=2), "too_many_images"),
        # two records over a fixed cut-off that no exchange fits
        (PaddingConfig(cutoff="fixed", max_tokens=100, policy="drop"), PackingConfig(budget=1000), "sample_too_long"),
    ],
)
def test_the_text_only_share_holds_on_what_is_released(padding, packing, dropped):
    """The text-only allowance is counted on the image records released, not on those accepted
    before the cut-off and the pack caps dropped some: 0.3 of what is released, at most."""
    from collections import Counter

    from tasks.finetune.packs import plan_packs
    from tasks.formats.recipe_finetune import FinetuneConfig

    images = [(f"img-{i}", 50, 1) for i in range(12)] + [("big-0", 400, 3), ("big-1", 400, 3)]
    cfg = FinetuneConfig(padding=padding, packing=packing, text_only_ratio=0.3)
    plan = plan_packs(_plan_rows(images, text_only=10), cfg, per_shard=4, seed=None)
    verdicts = plan.verdicts.to_pylist()
    ok = [v["key"] for v in verdicts if v["status"] == "ok"]
    text = [k for k in ok if k.startswith("txt-")]
    reasons = Counter(v["reason"] for v in verdicts if v["reason"])
    assert reasons[dropped] == 2 and len(ok) - len(text) == 12
    assert len(text) == 5 and len(text) / len(ok) <= 0.3  # 0.3 / 0.7 x 12 = 5.14: 5 text-only records
    assert reasons["text_only_over_ratio"] == 5
    assert plan.stats["samples"] == len(ok) == sum(len(p) for o in plan.outputs for p in o.packs)
    # the records kept are chosen by a hash of the key: the same on every run
    again = plan_packs(_plan_rows(images, text_only=10), cfg, per_shard=4, seed=None)
    assert again.verdicts.to_pylist() == verdicts


def test_without_a_text_only_ratio_every_text_only_record_stays():
    from tasks.finetune.packs import plan_packs
    from tasks.formats.recipe_finetune import FinetuneConfig

    cfg = FinetuneConfig(packing=PackingConfig(budget=1000, max_images=2))
    plan = plan_packs(_plan_rows([("img-0", 50, 1), ("big", 50, 3)], text_only=4), cfg, per_shard=4, seed=None)
    fates = {v["key"]: v["reason"] for v in plan.verdicts.to_pylist()}
    assert fates == {"img-0": None, "big": "too_many_images", **{f"txt-{i}": None for i in range(4)}}
