"""Training-side loaders read releases back: counts, equal shares per rank, resumption, latents, S3."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from release_fixtures import LATENT_SHAPE, TEXT_SHAPE, color_of, pretraining_release

COUNTS = [13, 9, 17, 5]  # uneven shards on purpose: 44 samples
TOTAL = sum(COUNTS)


@pytest.fixture(scope="module")
def pre(tmp_path_factory) -> str:
    return pretraining_release(str(tmp_path_factory.mktemp("pre")), COUNTS, latents=True)


@pytest.fixture(scope="module")
def release(pre):
    from loaders.release import open_release

    return open_release(pre)


def _index(i: int) -> int:
    return int(i.split("-")[1]) if isinstance(i, str) else i


# ---------------------------------------------------------------------------------------------
# open_release
# ---------------------------------------------------------------------------------------------


def test_open_release_resolves_latest_from_any_folder_and_lists_counts(pre):
    from loaders.release import open_release

    version_dir = os.path.join(pre, "releases", "v0001")
    index = json.load(open(os.path.join(version_dir, "index.json")))
    for where, version in (
        (pre, "latest"),
        (os.path.join(pre, "releases"), "latest"),
        (version_dir, "latest"),
        (pre, "v0001"),
        (version_dir, "v0001"),
    ):
        rel = open_release(where, version=version)
        assert rel.url == version_dir
        assert [(s.name, s.samples, s.sha256) for s in rel.shards] == [
            (s["name"], s["samples"], s["sha256"]) for s in index["shards"]
        ]
    assert rel.samples == TOTAL and rel.kind == "pretraining" and rel.version == "v0001"
    assert rel.schema["members"] == ["jpg", "json", "txt"]
    assert set(rel.encodings) == {"image_latents", "text"}
    assert [s.image_shard for s in rel.precache_shards] == [s.name for s in rel.shards]
    assert [e.key for e in rel.read_index(rel.shards[1])] == [f"s-{i:06d}" for i in range(13, 22)]


def test_open_release_refuses_missing_versions_and_bad_checksums(pre, tmp_path):
    from loaders.release import ReleaseError, open_release

    with pytest.raises(ReleaseError, match="no release v0002"):
        open_release(pre, version="v0002")
    with pytest.raises(ReleaseError, match="no index.json, no LATEST"):
        open_release(str(tmp_path))
    copy = tmp_path / "copy"
    shutil.copytree(pre, copy)
    open_release(str(copy), verify=True)  # intact: passes
    tar = copy / "releases" / "v0001" / "latents" / "shard-000002.tar"
    data = bytearray(tar.read_bytes())
    data[600] ^= 0xFF
    tar.write_bytes(bytes(data))
    open_release(str(copy))  # not verified: opens
    with pytest.raises(ReleaseError, match=r"latents/shard-000002.tar: sha256"):
        open_release(str(copy), verify=True)


# ---------------------------------------------------------------------------------------------
# ReleaseDataset: counts, order, equal shares, resumption
# ---------------------------------------------------------------------------------------------


def test_images_mode_decodes_every_sample_with_its_caption(release):
    import torch

    from loaders.dataset import ReleaseDataset

    ds = ReleaseDataset(release, image_size=32, rank=0, world_size=1, shuffle=False, batch_size=8)
    batches = list(ds)
    keys = [k for b in batches for k in b["key"]]
    assert keys == [f"s-{i:06d}" for i in range(TOTAL)]
    assert len(ds) == len(batches) == 6
    for b in batches:
        assert b["image"].shape == (len(b["key"]), 3, 32, 32) and b["image"].dtype == torch.uint8
        for key, caption, meta, image in zip(b["key"], b["caption"], b["meta"], b["image"]):
            i = _index(key)
            assert caption == f"caption {i}" and meta["key"] == key
            mean = image.float().mean(dim=(1, 2))
            assert torch.allclose(mean, torch.tensor(color_of(i), dtype=torch.float32), atol=6)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_and_worker_gets_the_same_count(release, world_size):
    from loaders.dataset import ReleaseDataset

    workers = 2
    per_rank = []
    seen: list[str] = []
    for rank in range(world_size):
        ds = ReleaseDataset(release, mode="raw", rank=rank, world_size=world_size, seed=3, shuffle_buffer=4)
        ds.set_epoch(1)
        counts = []
        for w in range(workers):
            keys = [s["key"] for s in ds.iter_worker(w, workers)]
            counts.append(len(keys))
            seen += keys
        assert len(set(counts)) == 1  # workers equal
        assert ds.samples_per_rank(workers) == sum(counts)
        per_rank.append(sum(counts))
    assert len(set(per_rank)) == 1
    slots = world_size * workers
    assert per_rank[0] == TOTAL // slots * workers
    assert len(seen) == len(set(seen))  # nothing read twice
    assert len(seen) == TOTAL - TOTAL % slots  # drop: only the remainder is left out


def test_pad_mode_reads_every_sample_and_repeats_only_the_remainder(release):
    from loaders.dataset import ReleaseDataset

    seen = []
    for rank in range(3):
        ds = ReleaseDataset(release, mode="raw", rank=rank, world_size=3, even="pad")
        seen += [s["key"] for w in range(2) for s in ds.iter_worker(w, 2)]
    per_slot = -(-TOTAL // 6)
    assert len(seen) == 6 * per_slot
    assert set(seen) == {f"s-{i:06d}" for i in range(TOTAL)}
    assert len(seen) - len(set(seen)) == 6 * per_slot - TOTAL


@pytest.mark.parametrize(("counts", "world_size", "workers"), [([1], 2, 2), ([4, 2], 13, 1), ([3, 0, 2], 4, 3)])
def test_pad_mode_fills_more_slots_than_samples(counts, world_size, workers):
    """``even="pad"`` wraps the epoch's samples as often as the slots need: a release of one
    sample still gives every rank x worker slot one; each sample is read as evenly as can be."""
    from loaders.epochs import plan_epoch

    plan = plan_epoch(counts, world_size=world_size, num_workers=workers, even="pad")
    read = [(shard, i) for slot in plan.slots for shard, start, stop in slot for i in range(start, stop)]
    assert [sum(stop - start for _, start, stop in slot) for slot in plan.slots] == [plan.per_slot] * (
        world_size * workers
    )
    times = [read.count((shard, i)) for shard, n in enumerate(counts) for i in range(n)]
    assert len(read) == sum(times) and max(times) - min(times) <= 1
    assert plan.repeated == len(read) - sum(counts) and plan.dropped == 0


def test_shuffle_is_seeded_and_changes_with_the_epoch(release):
    from loaders.dataset import ReleaseDataset

    def order(seed, epoch):
        ds = ReleaseDataset(release, mode="raw", rank=0, world_size=1, seed=seed, shuffle_buffer=8)
        ds.set_epoch(epoch)
        return [s["key"] for s in ds]

    a = order(1, 0)
    assert a == order(1, 0)
    assert a != order(1, 1) and a != order(2, 0)
    assert a != sorted(a)
    # One slot of 44: every sample every epoch, whatever the order.
    assert sorted(a) == sorted(order(1, 1)) == [f"s-{i:06d}" for i in range(TOTAL)]


def _rank_stream(ds, workers):
    """The rank's batches in the order DataLoader hands them out: one per worker in turn."""
    streams = [list(ds.iter_worker(w, workers)) for w in range(workers)]
    out = []
    for step in range(max(len(s) for s in streams)):
        out += [s[step] for s in streams if step < len(s)]
    return out


@pytest.mark.parametrize("consumed_batches", [0, 1, 4, 5, 7])
def test_resume_from_an_offset_yields_the_rest_exactly_once(release, consumed_batches):
    from loaders.dataset import ReleaseDataset

    def ds():
        return ReleaseDataset(release, mode="raw", rank=1, world_size=2, seed=5, shuffle_buffer=3, batch_size=2)

    full = ds()
    full.set_epoch(2)
    batches = _rank_stream(full, 2)
    keys = [[s["key"] for s in b] for b in batches]
    assert len(keys) == 12  # 44 // 4 slots = 11 samples per worker: 5 batches of 2 and 1 of 1
    resumed = ds()
    resumed.set_epoch(2, start=consumed_batches * 2)
    rest = [[s["key"] for s in b] for b in _rank_stream(resumed, 2)]
    assert rest == keys[consumed_batches:]


def test_dataloader_workers_split_the_rank_and_resume(release):
    from torch.utils.data import DataLoader

    from loaders.dataset import ReleaseDataset

    ranks = []
    for rank in range(2):
        ds = ReleaseDataset(release, image_size=16, rank=rank, world_size=2, seed=9, batch_size=4)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        ranks.append([k for b in loader for k in b["key"]])
    assert len(ranks[0]) == len(ranks[1]) == TOTAL // 4 * 2
    assert not set(ranks[0]) & set(ranks[1])
    ds = ReleaseDataset(release, image_size=16, rank=0, world_size=2, seed=9, batch_size=4)
    ds.set_epoch(0, start=8)
    rest = [k for b in DataLoader(ds, batch_size=None, num_workers=2) for k in b["key"]]
    assert rest == ranks[0][8:]


# ---------------------------------------------------------------------------------------------
# Latents
# ---------------------------------------------------------------------------------------------


def test_latents_mode_reads_the_latent_shards_in_step_with_the_keys(release):
    import torch

    from loaders.dataset import ReleaseDataset

    ds = ReleaseDataset(release, mode="latents", rank=0, world_size=1, batch_size=5, with_captions=True, seed=4)
    keys = []
    for b in ds:
        n = len(b["key"])
        assert b["latent"].shape == (n, *LATENT_SHAPE) and b["latent"].dtype == torch.float32
        assert b["text_emb"].shape == (n, *TEXT_SHAPE) and b["text_emb"].dtype == torch.float16
        assert b["text_mask"].dtype == torch.bool
        for j, key in enumerate(b["key"]):
            i = _index(key)
            # mean i, logvar -30: a draw is the mean; scaled by the release's 0.5.
            assert torch.allclose(b["latent"][j], torch.full(LATENT_SHAPE, i * 0.5), atol=1e-3)
            assert torch.all(b["text_emb"][j] == i)
            assert int(b["text_mask"][j].sum()) == i % 7 + 1
            assert b["caption"][j] == f"caption {i}"
        keys += b["key"]
    assert sorted(keys) == [f"s-{i:06d}" for i in range(TOTAL)]
    raw = ReleaseDataset(
        release, mode="latents", rank=0, world_size=1, shuffle=False, scale_latents=False, latent_sample=False
    )
    first = next(iter(raw))
    assert first["key"] == "s-000000" and torch.all(next(iter(raw))["latent"] == 0)
    assert torch.all(list(raw)[3]["latent"] == 3)


def test_latents_mode_needs_precached_encodings(tmp_path):
    from loaders.dataset import ReleaseDataset
    from loaders.release import ReleaseError, open_release

    plain = open_release(pretraining_release(str(tmp_path), [3]))
    assert plain.encodings == {} and plain.precache_shards == ()
    with pytest.raises(ReleaseError, match="no precached encodings"):
        ReleaseDataset(plain, mode="latents", rank=0, world_size=1)


# ---------------------------------------------------------------------------------------------
# S3
# ---------------------------------------------------------------------------------------------


def test_release_on_s3_opens_verifies_and_streams(pre, s3_bucket):
    import s3fs

    from loaders.dataset import ReleaseDataset
    from loaders.release import open_release

    bucket, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    fs.put(pre, f"{bucket}/store/tiny", recursive=True)
    rel = open_release(f"s3://{bucket}/store/tiny", verify=True, storage_options=options)
    assert rel.samples == TOTAL and rel.url == f"s3://{bucket}/store/tiny/releases/v0001"
    seen = []
    for rank in range(2):
        ds = ReleaseDataset(rel, mode="raw", rank=rank, world_size=2, seed=1, shuffle_buffer=16)
        seen += [(s["key"], s["txt"].decode()) for w in range(2) for s in ds.iter_worker(w, 2)]
    assert len(seen) == len(set(seen)) == TOTAL // 4 * 4
    assert all(c == f"caption {_index(k)}" for k, c in seen)
    latent = next(
        iter(ReleaseDataset(rel, mode="latents", rank=0, world_size=1, with_captions=True, latent_sample=False))
    )
    assert latent["caption"] == f"caption {_index(latent['key'])}"  # a byte-range read over S3


def test_loaders_import_neither_prefect_nor_dask():
    import subprocess
    import sys

    code = (
        "import sys, loaders.release, loaders.dataset, loaders.packing, loaders.dali\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'dask', 'distributed'))\n"
        "print(bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert out.stdout.strip() == "[]"
