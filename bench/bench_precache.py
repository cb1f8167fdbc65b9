"""Precache benchmark: the whole stage beside the encoders alone on the same batches, in one run.

One invocation writes (or reuses) a shard of ``--samples`` demo images (tasks.demo.corpus.render_image:
JPEGs of 200..1000 px with captions) under ``.bench/precache/`` and tiny random-weight encoders
(tasks.demo.models: a 4-block AutoencoderKL and a CLIP text model). Then, per round:

- ``stage``: ``tasks.stages.precache.precache_shard`` into a fresh output prefix with the models
  already loaded: DALI reads the shard through its index, decodes, resizes and crops, the
  encoders run, every array is written to the latent shard and its ledger;
- ``encoders``: the same encoders on the same batches, decoded beforehand and held in memory:
  the part of the stage no pipeline can remove.

Each round runs the stage twice, side by side: the baseline (fp32, captions padded to
``max_length``: precache before issue 41) and ``--compute-dtype`` (default ``auto``: bf16 on a CPU
with AVX512-BF16 or AMX; each batch's captions at their longest). ``--text t5-small`` (default)
uses a random T5 encoder of t5-small's shape (6 layers, width 512), ``--text demo`` the demo's tiny
CLIP text model. Printed: samples/s of each and the ratio encoders / stage (the share of the
stage's time spent in the encoders; the issue aims for >= 0.9), the ratio new / baseline, and
the largest difference of the two runs' latents and caption states. ``--device cuda`` runs the GPU variant (DALI ``mixed``
decode and the encoders on the GPU, fp16) and adds DALI decode images/s and VAE encode images/s at
each ``--resolutions`` size; without a GPU it says so and exits 2.
"""

from __future__ import annotations

import argparse
import hashlib
import io
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


def make_t5_small(path: Path) -> Path:
    """A random T5 encoder of t5-small's shape with the demo's word-level tokenizer."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import T5Config, T5EncoderModel

    from tasks.demo.models import make_tokenizer

    make_tokenizer(path, 77)
    torch.manual_seed(0)
    cfg = T5Config(d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_heads=8, vocab_size=32128)
    T5EncoderModel(cfg).save_pretrained(path)
    return path


def padded_text(enc):
    """The baseline's caption encoder: fp32, every caption padded to ``max_length``."""
    import torch

    def encode_text(captions):
        tok = enc.tokenizer(
            captions, padding="max_length", truncation=True, max_length=enc.cfg.text.max_length, return_tensors="pt"
        )
        with torch.inference_mode():
            out = enc.text(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
        return {"text_emb.npy": out.last_hidden_state, "text_mask.npy": tok["attention_mask"].to(torch.uint8)}

    return encode_text


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
    from tasks.models.batches import LocalShard, iter_batches

    local = LocalShard(storage, shard.tar, shard.records)
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

    from tasks.models.frozen import load_encoders

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
    ap.add_argument("--compute-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    ap.add_argument("--text", default="t5-small", choices=["t5-small", "demo"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (Dask workers run with OMP_NUM_THREADS=1)")
    ap.add_argument(
        "--resolutions", type=int, nargs="+", default=[256, 512], help="GPU figures at these sizes (--device cuda)"
    )
    ap.add_argument("--vae", help="a real VAE folder instead of the tiny one (e.g. an SD/SDXL vae)")
    ap.add_argument("--dir", default=str(REPO / ".bench" / "precache"))
    args = ap.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: run this with --device cuda on a GPU machine", file=sys.stderr)
        return 2
    from tasks.demo.models import make_all
    from tasks.formats.shards import iter_samples
    from tasks.models.frozen import load_encoders
    from tasks.stages.precache import precache_shard

    base = Path(args.dir)
    models = make_all(base / "models")
    if args.vae:
        models["vae"] = Path(args.vae)
    text_model = make_t5_small(base / "models" / "t5-small") if args.text == "t5-small" else models["clip-text"]
    storage = Storage(str(base / "work"))
    shard = make_shard(storage, args.samples)
    decode = "gpu" if args.device == "cuda" else "cpu"

    def config(dtype: str) -> PrecacheConfig:
        return PrecacheConfig(
            image_latents={"model": str(models["vae"]), "resolution": args.resolution},
            text={"model": str(text_model), "max_length": 77},
            batch_size=args.batch,
            decode=decode,
            device=args.device,
            dtype="fp32",
            compute_dtype=dtype,
        )

    cfgs = {"baseline": config("fp32"), "new": config(args.compute_dtype)}
    encs = {}
    for mode, cfg in cfgs.items():
        encs[mode], load_s = load_encoders(cfg)
    encs["baseline"].encode_text = padded_text(encs["baseline"])
    print(
        f"machine: {os.cpu_count()} cores, torch {torch.__version__} threads {torch.get_num_threads()}, device {args.device}"
    )
    print(
        f"shard: {args.samples} demo images ({os.path.getsize(storage.path(shard.tar)) / 1e6:.1f} MB), batch {args.batch}, "
        f"{args.resolution} px, text encoder {args.text}; new: compute dtypes {encs['new'].dtypes}"
    )
    batches = collect_batches(storage, shard, cfgs["new"])
    for enc in encs.values():
        encoders_only(enc, batches[:1])  # warm-up: first-call allocations
    stage_s: dict[str, list[float]] = {m: [] for m in cfgs}
    enc_s: dict[str, list[float]] = {m: [] for m in cfgs}
    parts: dict[str, dict] = {}
    kept: dict[str, str] = {}
    for _ in range(args.rounds):
        for mode, cfg in cfgs.items():
            shutil.rmtree(storage.path(f"out-{mode}"), ignore_errors=True)
            with clock() as stage:
                res = precache_shard(storage, cfg, shard, f"out-{mode}")
            with clock():
                enc_s[mode].append(encoders_only(encs[mode], batches))
            stage_s[mode].append(stage.wall)
            parts[mode] = res.timings
            kept[mode] = res.tar
    n = args.samples
    print(f"{'':26s} {'median s':>9s} {'samples/s':>10s} {'encoders share':>15s}   rounds")
    for mode in cfgs:
        st, en = statistics.median(stage_s[mode]), statistics.median(enc_s[mode])
        label = "baseline (fp32, padded)" if mode == "baseline" else f"new ({args.compute_dtype})"
        print(f"{label:26s} {st:9.2f} {n / st:10.1f} {en / st:15.3f}   " + " ".join(f"{x:.2f}" for x in stage_s[mode]))
        print("   inside the stage (last round): " + ", ".join(f"{k} {v:.2f}" for k, v in parts[mode].items()))
    ratio = statistics.median(stage_s["baseline"]) / statistics.median(stage_s["new"])

    def arrays(rel):
        with storage.open(rel, "rb") as fh:
            return {
                s.key: {m: np.load(io.BytesIO(d)) for m, d in s.members.items()} for s in iter_samples(fh, path=rel)
            }

    a, b = arrays(kept["baseline"]), arrays(kept["new"])
    diff = {m: max(float(np.abs(a[k][m] - b[k][m]).max()) for k in a) for m in ("latent_mean.npy", "text_emb.npy")}
    lat_a = np.stack([a[k]["latent_mean.npy"] for k in a]).astype(np.float64)
    lat_b = np.stack([b[k]["latent_mean.npy"] for k in a]).astype(np.float64)
    rel = float(np.sqrt(((lat_a - lat_b) ** 2).mean() / (lat_a**2).mean()))
    masked = max(
        float(np.abs((a[k]["text_emb.npy"] - b[k]["text_emb.npy"])[a[k]["text_mask.npy"] > 0]).max()) for k in a
    )
    print(
        f"ratio new / baseline (stage samples/s): {ratio:.2f}x; largest difference: latent_mean {diff['latent_mean.npy']:.4f}, "
        f"caption states where the mask is 1 {masked:.4f} (padding: the baseline's pad-token states, zeros now); "
        f"latent_mean relative RMS difference {rel:.4f}"
    )
    if args.device == "cuda":
        gpu_figures(storage, shard, models, args.resolutions, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
