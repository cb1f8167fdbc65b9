"""Curation's embedding step beside its encoder alone, with a ViT-B/32-sized CLIP, in one run.

One invocation writes (or reuses) a validated-style shard of ``--samples`` demo images
(tasks.demo.images.render_image, stored as the validate phase stores them: JPEG q95 with caption)
under ``.bench/curate/`` and a random-weight transformers CLIPModel of ViT-B/32's shape (vision:
224 px, patch 32, width 768, 12 layers; text: width 512, 12 layers, 77 tokens; 512-d projection).
Random weights cost what trained ones do. Then, per round:

- ``stage``: ``tasks.curate.embed.embed_shard`` into a fresh side shard with the model already
  loaded: the ledger read, the shard's DALI index built, DALI decoding, resizing and cropping on
  the CPU ahead of the encoder, both towers, the side shard written;
- ``encoder``: the same model on the same batches, decoded beforehand and held in memory: what no
  pipeline can remove.

Each round runs the stage twice, side by side: ``--baseline`` (default ``fp32-77``: fp32 with
every caption padded to the 77-token context, what curation did before compute_dtype) and
``--compute-dtype`` (default ``auto``: bf16 on a CPU with AVX512-BF16 or AMX, captions in batches
formed by length, each padded to its longest). Printed: samples/s of each, the ratio, the
encoder's share of the stage (encoder seconds / stage seconds; issue 41 asks >= 0.9: decoding and
I/O keep the encoder fed), and the cosine of the two runs' embeddings. ``--threads`` sets torch's
threads (a Dask worker runs with one: ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from harness.procs import REPO, clock

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from tasks.formats.storage import Storage  # noqa: E402


def make_model(path: Path) -> Path:
    """A random CLIPModel of ViT-B/32's shape with the demo's word-level tokenizer."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    from tasks.demo.models import make_tokenizer

    make_tokenizer(path, 77)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    cfg = CLIPConfig(
        projection_dim=512,
        text_config=dict(
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=8,
            vocab_size=49408,
            max_position_embeddings=77,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        ),
        vision_config=dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=224,
            patch_size=32,
        ),
    )
    CLIPModel(cfg).save_pretrained(path)
    return path


def make_shard(storage: Storage, n: int) -> tuple[str, str]:
    """A validated-style shard (jpg, json, txt per sample) and its ledger."""
    import io

    from PIL import Image

    from tasks.demo.images import render_image
    from tasks.stages.runner import Verdict, run_shard

    tar, ledger = f"in/{n}/000000-bench.tar", f"in/{n}/000000-bench.ledger.parquet"

    def one(i: int) -> Verdict:
        _, data, meta = render_image(0, i)
        buf = io.BytesIO()
        Image.open(io.BytesIO(data)).convert("RGB").save(buf, "JPEG", quality=95)
        members = {
            "jpg": buf.getvalue(),
            "json": json.dumps({"caption": meta["caption"]}).encode(),
            "txt": meta["caption"].encode(),
        }
        return Verdict(
            {"key": f"bench-{i:09d}", "source": "bench", "row": i, "status": "ok", "reason": None}, members=members
        )

    run_shard(storage, tar, ledger, lambda: range(n), one, source="bench", index=0)
    return tar, ledger


def encoder_only(enc, batches, captions, batch_size) -> float:
    start = time.perf_counter()
    keys = []
    for k, pixels in batches:
        enc.images(pixels)
        keys += k
    enc.texts([captions[k] for k in keys], batch_size)
    return time.perf_counter() - start


class Padded77:
    """The encoder as curation ran it before issue 41: fp32, every caption padded to the context."""

    def __init__(self, enc) -> None:
        self.enc = enc
        self.preprocess = enc.preprocess

    def images(self, pixels):
        return self.enc.images(pixels)

    def texts(self, captions, batch_size=None):
        import numpy as np
        import torch

        from tasks.models.dual_encoder import _normalised

        out = []
        step = batch_size or len(captions)
        for at in range(0, len(captions), step):
            tok = self.enc.tokenizer(
                captions[at : at + step], padding="max_length", truncation=True, max_length=77, return_tensors="pt"
            )
            with torch.inference_mode():
                out.append(_normalised(self.enc.model.get_text_features(**tok)))
        return np.concatenate(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (Dask workers run with OMP_NUM_THREADS=1)")
    ap.add_argument("--compute-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    ap.add_argument("--baseline", default="fp32-77", choices=["fp32-77", "fp32"], help="fp32-77: captions padded to 77")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    import tasks.curate.embed as embed
    from tasks.curate.embed import LEDGER_COLUMNS, _captions, embed_shard
    from tasks.formats.ledger import read_parquet
    from tasks.formats.recipe_curate import CurateConfig
    from tasks.models.batches import LocalShard, iter_pixels
    from tasks.models.dual_encoder import load_encoder
    from tasks.models.placement import compute_dtype
    from tasks.stages.runner import records_of_layout

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: run this with --device cuda on a GPU machine", file=sys.stderr)
        return 2
    base = REPO / ".bench" / "curate"
    storage = Storage(str(base))
    model = make_model(base / "vit-b32-random")
    tar, ledger = make_shard(storage, args.samples)
    decode = "gpu" if args.device == "cuda" else "cpu"
    dtype = compute_dtype(args.compute_dtype, args.device)
    modes = {
        "baseline": CurateConfig(
            model=str(model), decode=decode, device=args.device, batch_size=args.batch_size, compute_dtype="fp32"
        ),
        "new": CurateConfig(
            model=str(model), decode=decode, device=args.device, batch_size=args.batch_size, compute_dtype=dtype
        ),
    }
    encoders = {
        "baseline": load_encoder(str(model), None, None, args.device, "fp32")[0],
        "new": load_encoder(str(model), None, None, args.device, dtype)[0],
    }
    if args.baseline == "fp32-77":
        encoders["baseline"] = Padded77(encoders["baseline"])

    rows = sorted(read_parquet(storage, ledger, LEDGER_COLUMNS).to_pylist(), key=lambda r: r["offset"])
    layout = pa.Table.from_pylist([{k: r[k] for k in ("key", "offset", "length", "members")} for r in rows])
    local = LocalShard(storage, tar, records_of_layout(layout))
    batches = list(iter_pixels(local.tar, local.idx, len(rows), encoders["new"].preprocess, modes["new"]))
    captions = _captions(local.tar, rows)
    tokens = [len(encoders["new"].tokenizer(c)["input_ids"]) for c in captions.values()]
    local.close()

    real_load = embed.load_encoder
    stage: dict[str, list[float]] = {m: [] for m in modes}
    alone: dict[str, list[float]] = {m: [] for m in modes}
    outs: dict[str, str] = {}
    for r in range(args.repeats):
        for mode, cfg in modes.items():
            out = f"out/{mode}-{r}.parquet"
            if mode == "baseline":
                shutil.rmtree(base / "out", ignore_errors=True)
            embed.load_encoder = lambda *a, _m=mode, **k: (encoders[_m], False)
            try:
                with clock() as lap:
                    res = embed_shard(storage, cfg, tar, ledger, out, f"bench-{r}")
            finally:
                embed.load_encoder = real_load
            stage[mode].append(lap.wall)
            alone[mode].append(encoder_only(encoders[mode], batches, captions, args.batch_size))
            outs[mode] = out
            print(
                f"round {r + 1} {mode:8s}: stage {args.samples / stage[mode][-1]:6.2f} samples/s "
                f"(waiting for DALI {res.timings['decode_s']:.2f} s); encoder alone {args.samples / alone[mode][-1]:6.2f} samples/s"
            )
    cos = {}
    for col in ("image", "text"):
        a, b = (
            np.asarray(pq.read_table(base / outs[m], columns=[col]).column(col).to_pylist(), np.float32)
            for m in ("baseline", "new")
        )
        cos[col] = float((a * b).sum(axis=1).min())
    print(
        f"\nViT-B/32-sized CLIP, {args.samples} samples, batch {args.batch_size}, torch threads {args.threads}, "
        f"{args.device}; captions {min(tokens)}-{max(tokens)} tokens (mean {sum(tokens) / len(tokens):.1f}); "
        f"median of {args.repeats}:"
    )
    before = "fp32, captions at 77 (before)" if args.baseline == "fp32-77" else "fp32, captions at their length"
    label = {"baseline": before, "new": f"{dtype}, captions at their length"}
    for mode in modes:
        s, e = statistics.median(stage[mode]), statistics.median(alone[mode])
        print(
            f"  {label[mode]:34s} stage {args.samples / s:7.2f} samples/s, encoder alone {args.samples / e:7.2f} samples/s, "
            f"encoder share {e / s:.3f}"
        )
    ratio = statistics.median(stage["baseline"]) / statistics.median(stage["new"])
    print(
        f"  ratio new / before (stage samples/s): {ratio:.2f}x; lowest cosine to the baseline's embeddings: "
        f"image {cos['image']:.4f}, text {cos['text']:.4f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
