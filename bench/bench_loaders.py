"""Loader benchmark: samples/s from a local release, shardsmith's loaders beside webdataset's own pipeline.

One invocation builds (or reuses) a pretraining release with precached latents under
``.bench/loaders/`` (``--samples`` photo-like JPEGs from the demo corpus generator, 4 latent
channels at 32x32 in float16, text embeddings 77x64), then runs, alternating, for
``--repeats`` rounds, each through a torch DataLoader with ``--workers`` workers and batches
of ``--batch``:

- ``wds-images``: ``webdataset.WebDataset(shards).shuffle(256).decode("pil")`` + a PIL resize
  of the short side to 256 and a center crop (the baseline: webdataset's documented pipeline);
- ``wds-images-same-decode``: the same reader, decoding with shardsmith's ``decode_image``
  (so the two differ only in how tars are read and shuffled);
- ``shardsmith-images``: ``ReleaseDataset(release, image_size=256)``;
- ``dali-cpu-images``: ``DaliLoader`` on the CPU (``device_id=None``), ``--workers`` threads;
- ``wds-latents``: ``webdataset.WebDataset(latent shards)`` + ``numpy.load`` of each member
  (baseline for latents);
- ``shardsmith-latents``: ``ReleaseDataset(release, mode="latents")`` (mean/logvar draw and
  scaling included);
- ``dali-cpu-latents``: ``DaliLoader(latents=True)`` on the CPU.

Printed: median samples/s per method over the rounds, and the ratio of each to its baseline
in the same rounds (images: ``wds-images``; latents: ``wds-latents``); beside them, samples per
CPU second (this process and its DataLoader workers), which a shared machine disturbs less.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import sys
from pathlib import Path

from harness.procs import REPO, clock, process_cpu
from harness.report import alternated

for extra in (REPO, REPO / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

SIZE = 256


def _photo(i: int, pool: list[bytes]) -> bytes:
    return pool[i % len(pool)]


def build_release(root: Path, samples: int, per_shard: int) -> str:
    """A local release with latents; reused when it exists (its dataset URL is returned)."""
    import numpy as np
    import release_fixtures as fx
    from PIL import Image

    from tasks.demo.images import render_image

    fx.LATENT_SHAPE = (4, 32, 32)
    fx.TEXT_SHAPE = (77, 64)
    name = f"n{samples}-s{per_shard}"
    url = str(root / name / "bench")
    if (root / name / "bench" / "releases" / "LATEST").exists():
        return url
    pool = []
    for k in range(64):
        _, data, _ = render_image(11, k)
        im = Image.open(io.BytesIO(data)).convert("RGB")
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=90)
        pool.append(buf.getvalue())
    counts = [per_shard] * (samples // per_shard) + ([samples % per_shard] if samples % per_shard else [])
    print(f"building {samples} samples in {len(counts)} shards under {root / name} ...", flush=True)
    np.random.seed(0)
    return fx.pretraining_release(
        str(root / name), counts, dataset="bench", latents=True, image=lambda i: _photo(i, pool)
    )


def _resize_crop_pil(im):
    import numpy as np
    import torch
    from PIL import Image

    w, h = im.size
    s = SIZE / min(w, h)
    nw, nh = max(SIZE, round(w * s)), max(SIZE, round(h * s))
    im = im.convert("RGB").resize((nw, nh), Image.BILINEAR)
    left, top = (nw - SIZE) // 2, (nh - SIZE) // 2
    im = im.crop((left, top, left + SIZE, top + SIZE))
    return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)


def _wds_pil(sample):
    return _resize_crop_pil(sample["jpg"]), sample["txt"]


def _wds_same_decode(sample):
    from loaders.dataset import decode_image

    return decode_image(sample["jpg"], SIZE), sample["txt"].decode()


def _wds_latent(sample):
    import numpy as np
    import torch

    # What a webdataset user writes: numpy.load of each member (float16 here, no bf16 view).
    return {
        k: torch.from_numpy(np.load(io.BytesIO(v), allow_pickle=False)) for k, v in sample.items() if k.endswith(".npy")
    }


def _collate_tuples(batch):
    import torch

    return torch.stack([b[0] for b in batch]), [b[1] for b in batch]


def _collate_dicts(batch):
    import torch

    return {k: torch.stack([b[k] for b in batch]) for k in batch[0] if not k.startswith("__")}


def count_loader(loader, field) -> int:
    n = 0
    for batch in loader:
        n += len(batch[field]) if isinstance(batch, dict) else len(batch[0])
    return n


def run_method(method: str, release, args) -> tuple[int, float, float]:
    """(samples read, wall seconds, CPU seconds of this process and its DataLoader workers) for one
    pass over the release; imports and a DALI pipeline's build are set-up, outside the clock."""
    from torch.utils.data import DataLoader

    from loaders.dataset import ReleaseDataset

    if method.startswith("dali-"):
        from loaders.dali import DaliLoader

        dl = DaliLoader(
            release,
            args.batch,
            latents=method.endswith("latents"),
            image_size=SIZE,
            device_id=None,
            num_threads=max(1, args.workers),
            initial_fill=256,
        )
        with clock(process_cpu) as lap:
            n = sum(b["valid"] for b in dl)
        return n, lap.wall, lap.cpu
    with clock(process_cpu) as lap:
        if method.startswith("wds-"):
            import webdataset as wds

            latents = method == "wds-latents"
            shards = [release.local_path(s.name) for s in (release.precache_shards if latents else release.shards)]
            ds = wds.WebDataset(shards, shardshuffle=False, workersplitter=wds.split_by_worker, empty_check=False)
            ds = ds.shuffle(256)
            if latents:
                ds, collate = ds.map(_wds_latent), _collate_dicts
            elif method == "wds-images":
                ds, collate = ds.decode("pil").map(_wds_pil), _collate_tuples
            else:
                ds, collate = ds.map(_wds_same_decode), _collate_tuples
            loader = DataLoader(ds.batched(args.batch, collation_fn=collate), batch_size=None, num_workers=args.workers)
            n = count_loader(loader, "latent_mean.npy")
        else:
            mode = "latents" if method.endswith("latents") else "images"
            ds = ReleaseDataset(release, mode=mode, image_size=SIZE, batch_size=args.batch, rank=0, world_size=1)
            n = count_loader(DataLoader(ds, batch_size=None, num_workers=args.workers), "key")
    return n, lap.wall, lap.cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--per-shard", type=int, default=250)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--methods",
        default="wds-images,wds-images-same-decode,shardsmith-images,dali-cpu-images,wds-latents,shardsmith-latents,dali-cpu-latents",
    )
    parser.add_argument("--root", default=str(REPO / ".bench" / "loaders"))
    args = parser.parse_args()

    from loaders.release import open_release

    release = open_release(build_release(Path(args.root), args.samples, args.per_shard))
    methods = args.methods.split(",")
    rates: dict[str, list[float]] = {m: [] for m in methods}
    per_cpu: dict[str, list[float]] = {m: [] for m in methods}
    for rnd, m in alternated(methods, args.repeats):
        n, secs, cpu = run_method(m, release, args)
        rates[m].append(n / secs)
        per_cpu[m].append(n / cpu)
        print(
            f"round {rnd} {m:26s} {n:6d} samples {secs:7.2f} s {n / secs:9.1f} samples/s {cpu:7.2f} CPU s {n / cpu:9.1f} samples/CPU s",
            flush=True,
        )
    print(
        f"\n{release.samples} samples, {len(release.shards)} shards, batch {args.batch}, {args.workers} workers, "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, python {platform.python_version()}"
    )
    print(f"{'method':26s} {'samples/s':>10s} {'ratio':>8s} {'per CPU s':>10s} {'ratio':>8s}")
    for m in methods:
        base = "wds-latents" if m.endswith("latents") else "wds-images"
        med, cmed = statistics.median(rates[m]), statistics.median(per_cpu[m])
        ratio = med / statistics.median(rates[base]) if base in rates else float("nan")
        cratio = cmed / statistics.median(per_cpu[base]) if base in per_cpu else float("nan")
        print(f"{m:26s} {med:10.1f} {ratio:7.2f}x {cmed:10.1f} {cratio:7.2f}x  (vs {base})")


if __name__ == "__main__":
    main()
