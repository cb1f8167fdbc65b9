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

Printed: samples/s of each and the encoder's share of the stage (encoder seconds / stage
seconds; issue 32 asks >= 0.9: decoding and I/O keep the encoder fed). ``--threads`` sets torch's
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


def encoder_only(enc, batches, captions) -> float:
    start = time.perf_counter()
    for keys, pixels in batches:
        enc.images(pixels)
        enc.texts([captions[k] for k in keys])
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (Dask workers run with OMP_NUM_THREADS=1)")
    args = ap.parse_args()

    import torch

    from tasks.curate.embed import LEDGER_COLUMNS, _captions, embed_shard, iter_pixels
    from tasks.curate.encoder import load_encoder
    from tasks.formats.ledger import read_parquet
    from tasks.formats.recipe_curate import CurateConfig
    from tasks.stages.precache import LocalShard, PrecacheInput
    from tasks.stages.runner import records_of_layout

    torch.set_num_threads(args.threads)
    base = REPO / ".bench" / "curate"
    storage = Storage(str(base))
    model = make_model(base / "vit-b32-random")
    tar, ledger = make_shard(storage, args.samples)
    cfg = CurateConfig(model=str(model), decode="cpu", device="cpu", batch_size=args.batch_size)
    enc, _ = load_encoder(str(model), None, None, "cpu")

    rows = sorted(read_parquet(storage, ledger, LEDGER_COLUMNS).to_pylist(), key=lambda r: r["offset"])
    import pyarrow as pa

    layout = pa.Table.from_pylist([{k: r[k] for k in ("key", "offset", "length", "members")} for r in rows])
    local = LocalShard(storage, PrecacheInput(tar, "", tuple(records_of_layout(layout))))
    batches = list(iter_pixels(local.tar, local.idx, len(rows), enc.preprocess, cfg))
    captions = _captions(local.tar, rows)
    local.close()

    stage, encoder, decode = [], [], []
    for r in range(args.repeats):
        out = f"out/{r}.parquet"
        shutil.rmtree(base / "out", ignore_errors=True)
        with clock() as lap:
            res = embed_shard(storage, cfg, tar, ledger, out, f"bench-{r}")
        stage.append(lap.wall)
        decode.append(res.timings["decode_s"])
        encoder.append(encoder_only(enc, batches, captions))
        print(
            f"round {r + 1}: stage {args.samples / stage[-1]:.2f} samples/s ({stage[-1]:.2f} s, waiting for DALI {decode[-1]:.2f} s); encoder alone {args.samples / encoder[-1]:.2f} samples/s"
        )
    s, e = statistics.median(stage), statistics.median(encoder)
    print(
        f"\nViT-B/32-sized CLIP, {args.samples} samples, batch {args.batch_size}, torch threads {args.threads}: "
        f"stage {args.samples / s:.2f} samples/s, encoder alone {args.samples / e:.2f} samples/s; "
        f"encoder share of the stage {e / s:.3f} (median of {args.repeats})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
