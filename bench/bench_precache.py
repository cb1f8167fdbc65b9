"""Precache benchmark: the whole stage beside the encoders alone on the same batches, in one run.

One invocation writes (or reuses) a shard of ``--samples`` demo images (tasks.demo.corpus.render_image:
JPEGs of 200..1000 px with captions) under ``.bench/precache/`` and tiny random-weight encoders
(tasks.demo.models: a 4-block AutoencoderKL and a CLIP text model). Then, per round:

- ``stage``: ``tasks.stages.precache.precache_shard`` into a fresh output prefix with the models
  already loaded: DALI reads the shard through its index, decodes, resizes and crops, the
  encoders run, every array is written to the latent shard and its ledger;
- ``encoders``: the same encoders on the same batches, decoded beforehand and held in memory:
  the part of the stage no pipeline can remove.

Printed: samples/s of each and the ratio encoders / stage (the share of the stage's time spent in
the encoders; the issue aims for >= 0.9). ``--device cuda`` runs the GPU variant (DALI ``mixed``
decode and the encoders on the GPU, fp16) and adds DALI decode images/s and VAE encode images/s at
each ``--resolutions`` size; without a GPU it says so and exits 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from harness.procs import REPO, clock

sys.path.insert(0, str(REPO))

from tasks.formats.recipe_outputs import PrecacheConfig  # noqa: E402
from tasks.formats.storage import Storage  # noqa: E402


def make_shard(storage: Storage, n: int):
    import io

    from PIL import Image

    from tasks.demo.images import render_image
    from tasks.formats.shards import ShardWriter
    from tasks.stages.precache import PrecacheInput

    rel = f"in/shard-{n}.tar"
    records_rel = f"in/shard-{n}.records"
    if not storage.exists(records_rel):
        with storage.atomic_writer(rel) as fh:
            w = ShardWriter(fh)
            for i in range(n):
                _, data, meta = render_image(0, i)
                # As the validate phase stores them (validate.image.output_format: jpeg).
                buf = io.BytesIO()
                Image.open(io.BytesIO(data)).convert("RGB").save(buf, "JPEG", quality=95)
                w.write_sample(f"bench-{i:09d}", {"jpg": buf.getvalue(), "txt": meta["caption"].encode()})
            w.close()
        import pickle

        storage.write_bytes(records_rel, pickle.dumps(w.records))
    import pickle

    records = pickle.loads(storage.read_bytes(records_rel))
    sha = hashlib.sha256(storage.read_bytes(rel)).hexdigest()
    return PrecacheInput(rel, sha, tuple(records))


def encoders_only(enc, batches) -> float:
    import torch

    start = time.perf_counter()
    for b in batches:
        if enc.vae is not None:
            enc.encode_images(b.vae_pixels, b.keys)
        if enc.text is not None:
            enc.encode_text(b.captions)
    if enc.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def collect_batches(storage: Storage, shard, cfg: PrecacheConfig) -> list:
    from tasks.stages.precache import LocalShard
    from tasks.stages.precache_batches import iter_batches

    local = LocalShard(storage, shard)
    try:
        # Clone: DALI reuses its output buffers for the next batch.
        out = []
        for b in iter_batches(local.tar, local.idx, len(shard.records), cfg, None, None):
            b.vae_pixels = b.vae_pixels.clone()
            out.append(b)
        return out
    finally:
        local.close()


def gpu_figures(storage: Storage, shard, models: dict, resolutions: list[int], batch: int) -> None:
    """DALI mixed decode images/s and VAE encode images/s at each resolution (GPU only)."""
    import torch

    from tasks.stages.precache_models import load_encoders

    for res in resolutions:
        cfg = PrecacheConfig(
            image_latents={"model": str(models["vae"]), "resolution": res},
            batch_size=batch,
            decode="gpu",
            device="cuda",
        )
        start = time.perf_counter()
        batches = collect_batches(storage, shard, cfg)
        torch.cuda.synchronize()
        decode_s = time.perf_counter() - start
        enc, _ = load_encoders(cfg)
        encode_s = encoders_only(enc, batches)
        n = len(shard.records)
        print(
            f"gpu {res}px: DALI mixed decode+resize {n / decode_s:8.1f} images/s   VAE encode {n / encode_s:8.1f} images/s"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (Dask workers run with OMP_NUM_THREADS=1)")
    ap.add_argument(
        "--resolutions", type=int, nargs="+", default=[256, 512], help="GPU figures at these sizes (--device cuda)"
    )
    ap.add_argument("--vae", help="a real VAE folder instead of the tiny one (e.g. an SD/SDXL vae)")
    ap.add_argument("--dir", default=str(REPO / ".bench" / "precache"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: run this with --device cuda on a GPU machine", file=sys.stderr)
        return 2
    from tasks.demo.models import make_all
    from tasks.stages.precache import precache_shard
    from tasks.stages.precache_models import load_encoders

    base = Path(args.dir)
    models = make_all(base / "models")
    if args.vae:
        models["vae"] = Path(args.vae)
    storage = Storage(str(base / "work"))
    shard = make_shard(storage, args.samples)
    decode = "gpu" if args.device == "cuda" else "cpu"
    cfg = PrecacheConfig(
        image_latents={"model": str(models["vae"]), "resolution": args.resolution},
        text={"model": str(models["clip-text"]), "max_length": 32},
        batch_size=args.batch,
        decode=decode,
        device=args.device,
    )
    enc, load_s = load_encoders(cfg)
    print(
        f"machine: {os.cpu_count()} cores, torch {torch.__version__} threads {torch.get_num_threads()}, device {args.device}"
    )
    print(
        f"shard: {args.samples} demo images ({os.path.getsize(storage.path(shard.tar)) / 1e6:.1f} MB), batch {args.batch}, {args.resolution} px; models loaded in {load_s:.1f} s (not timed below)"
    )
    batches = collect_batches(storage, shard, cfg)
    encoders_only(enc, batches[:1])  # warm-up: first-call allocations
    # CPU seconds of this process (all its threads: DALI's and torch's) beside wall seconds:
    # on a shared machine other work stretches wall time, hardly the CPU time a run needs.
    stage_s, enc_s, stage_cpu, enc_cpu, parts = [], [], [], [], []
    for r in range(args.rounds):
        shutil.rmtree(storage.path(f"out{r}"), ignore_errors=True)
        with clock() as stage:
            res = precache_shard(storage, cfg, shard, f"out{r}")
        with clock() as encoders:
            enc_s.append(encoders_only(enc, batches))
        stage_s.append(stage.wall)
        stage_cpu.append(stage.cpu)
        enc_cpu.append(encoders.cpu)
        parts.append(res.timings)
        shutil.rmtree(storage.path(f"out{r}"), ignore_errors=True)
    n = args.samples
    st, en = statistics.median(stage_s), statistics.median(enc_s)
    print(f"{'':10s} {'median s':>9s} {'samples/s':>10s}   rounds")
    print(f"{'stage':10s} {st:9.2f} {n / st:10.1f}   " + " ".join(f"{x:.2f}" for x in stage_s))
    print(f"{'encoders':10s} {en:9.2f} {n / en:10.1f}   " + " ".join(f"{x:.2f}" for x in enc_s))
    print(
        f"ratio encoders / stage, wall: {en / st:.3f}  (per round: "
        + " ".join(f"{e / s:.3f}" for e, s in zip(enc_s, stage_s))
        + ")"
    )
    sc, ec = statistics.median(stage_cpu), statistics.median(enc_cpu)
    print(
        f"ratio encoders / stage, CPU s: {ec / sc:.3f}  (stage {sc:.1f} CPU s, encoders {ec:.1f} CPU s; per round: "
        + " ".join(f"{e / s:.3f}" for e, s in zip(enc_cpu, stage_cpu))
        + ")"
    )
    mid = parts[len(parts) // 2]
    print("inside the stage (middle round): " + ", ".join(f"{k} {v:.2f}" for k, v in mid.items()))
    if args.device == "cuda":
        gpu_figures(storage, shard, models, args.resolutions, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
