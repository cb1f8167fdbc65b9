"""Loaders: samples/s a training job gets from a local release, shardsmith's loaders beside webdataset's own pipeline.

Through a torch DataLoader: ``wds-images`` (``.decode("pil")`` + resize and crop to 256: the baseline) beside
``shardsmith-images`` (``ReleaseDataset``); ``wds-latents`` (``numpy.load`` of each member: the baseline) beside
``shardsmith-latents`` and ``dali-cpu-latents`` (``DaliLoader``). Printed: samples/s and per CPU second, with ratios.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from harness.procs import BENCH_DIR, REPO, clock, process_cpu
from harness.report import emit, medians, parse, parser, rounds, table

SIZE = 256
METHODS = ("wds-images", "shardsmith-images", "wds-latents", "shardsmith-latents", "dali-cpu-latents")


def build_release(root: Path, samples: int, per_shard: int) -> str:
    """A local release with latents, reused when it exists (its dataset URL)."""
    sys.path.insert(0, str(REPO / "tests"))
    import numpy as np
    import release_fixtures as fx
    from PIL import Image

    from tasks.demo.images import render_image

    fx.LATENT_SHAPE, fx.TEXT_SHAPE = (4, 32, 32), (77, 64)
    name = f"n{samples}-s{per_shard}"
    if (root / name / "bench" / "releases" / "LATEST").exists():
        return str(root / name / "bench")
    pool = []
    for k in range(64):
        buf = io.BytesIO()
        Image.open(io.BytesIO(render_image(11, k)[1])).convert("RGB").save(buf, format="JPEG", quality=90)
        pool.append(buf.getvalue())
    counts = [per_shard] * (samples // per_shard) + ([samples % per_shard] if samples % per_shard else [])
    print(f"building {samples} samples in {len(counts)} shards under {root / name} ...", flush=True)
    np.random.seed(0)
    return fx.pretraining_release(str(root / name), counts, dataset="bench", latents=True, image=lambda i: pool[i % 64])


def _wds_pil(sample):
    import numpy as np
    import torch
    from PIL import Image

    im = sample["jpg"].convert("RGB")
    s = SIZE / min(im.size)
    nw, nh = max(SIZE, round(im.width * s)), max(SIZE, round(im.height * s))
    left, top = (nw - SIZE) // 2, (nh - SIZE) // 2
    im = im.resize((nw, nh), Image.BILINEAR).crop((left, top, left + SIZE, top + SIZE))
    return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1), sample["txt"]


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


def run_method(method: str, release, args) -> dict:
    """One pass over the release: samples, samples/s and samples per CPU second (imports and a
    DALI pipeline's build are set-up, outside the clock)."""
    from torch.utils.data import DataLoader

    from loaders.dataset import ReleaseDataset

    latents = method.endswith("latents")
    if method.startswith("dali-"):
        from loaders.dali import DaliLoader

        dl = DaliLoader(
            release,
            args.batch,
            latents=True,
            image_size=SIZE,
            device_id=None,
            num_threads=max(1, args.workers),
            initial_fill=256,
        )
        with clock(process_cpu) as lap:
            n = sum(b["valid"] for b in dl)
        return {"tool": method, "samples": n, "samples/s": n / lap.wall, "per CPU s": n / lap.cpu}
    with clock(process_cpu) as lap:
        if method.startswith("wds-"):
            import webdataset as wds

            shards = [release.local_path(s.name) for s in (release.precache_shards if latents else release.shards)]
            ds = wds.WebDataset(
                shards, shardshuffle=False, workersplitter=wds.split_by_worker, empty_check=False
            ).shuffle(256)
            if latents:
                ds, collate = ds.map(_wds_latent), _collate_dicts
            else:
                ds, collate = ds.decode("pil").map(_wds_pil), _collate_tuples
            loader = DataLoader(ds.batched(args.batch, collation_fn=collate), batch_size=None, num_workers=args.workers)
            field = "latent_mean.npy"
        else:
            mode = "latents" if latents else "images"
            ds = ReleaseDataset(release, mode=mode, image_size=SIZE, batch_size=args.batch, rank=0, world_size=1)
            loader, field = DataLoader(ds, batch_size=None, num_workers=args.workers), "key"
        n = sum(len(b[field]) if isinstance(b, dict) else len(b[0]) for b in loader)
    return {"tool": method, "samples": n, "samples/s": n / lap.wall, "per CPU s": n / lap.cpu}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--per-shard", type=int, default=250)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--root", type=Path, default=BENCH_DIR / "loaders")
    args = parse(p, argv, tools=METHODS)

    from loaders.release import open_release

    release = open_release(build_release(args.root, args.samples, args.per_shard))
    runs = rounds(args.tools, args.repeats, lambda m, _: run_method(m, release, args))
    rate, per_cpu = medians(runs, lambda r: r["samples/s"]), medians(runs, lambda r: r["per CPU s"])
    rows = []
    for m in args.tools:
        base = "wds-latents" if m.endswith("latents") else "wds-images"
        ratios = [f"{d[m] / d[base]:.2f}x" if base in d else "-" for d in (rate, per_cpu)]
        rows.append((m, f"{rate[m]:.1f}", ratios[0], f"{per_cpu[m]:.1f}", ratios[1], base))
    lines = [
        f"{release.samples} samples in {len(release.shards)} shards, batch {args.batch}, {args.workers} DataLoader workers; medians of {args.repeats} rounds",
        "",
        *table(("method", "samples/s", "ratio", "samples per CPU s", "ratio", "baseline"), rows),
    ]
    emit("Loaders (`bench_loaders.py`)", lines, argv, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
