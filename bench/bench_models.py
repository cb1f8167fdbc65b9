"""Model stages, issues 5, 32 and 41: a stage and its encoders alone on the same batches, ``--compute-dtype`` beside fp32.

``--stage curate``: embed_shard with a random CLIP of ViT-B/32's shape; ``--stage precache``: precache_shard with the
demo's VAE and a random T5 of t5-small's shape; the baseline is fp32 with captions padded to 77 (before issue 41).
Printed: samples/s, the encoders' share of the stage (aim >= 0.9), new / baseline, how far the outputs are apart.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from harness.procs import BENCH_DIR, clock
from harness.report import emit, med, parse, parser, table
from tasks.formats.storage import Storage


def make_model(path: Path) -> Path:
    """A random CLIPModel of ViT-B/32's shape with the demo's word-level tokenizer (made once)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    from tasks.demo.models import make_tokenizer

    make_tokenizer(path, 77)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    text = dict(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=8,
        vocab_size=49408,
        max_position_embeddings=77,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=32,
    )
    CLIPModel(CLIPConfig(projection_dim=512, text_config=text, vision_config=vision)).save_pretrained(path)
    return path


def make_t5_small(path: Path) -> Path:
    """A random T5 encoder of t5-small's shape with the demo's word-level tokenizer (made once)."""
    if not (path / "config.json").exists():
        import torch
        from transformers import T5Config, T5EncoderModel

        from tasks.demo.models import make_tokenizer

        make_tokenizer(path, 77)
        torch.manual_seed(0)
        T5EncoderModel(
            T5Config(d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_heads=8, vocab_size=32128)
        ).save_pretrained(path)
    return path


def demo_jpeg(i: int) -> tuple[bytes, str]:
    """Demo picture ``i`` as the validate phase stores it (JPEG q95), and its caption."""
    from PIL import Image

    from tasks.demo.images import render_image

    _, data, meta = render_image(0, i)
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(buf, "JPEG", quality=95)
    return buf.getvalue(), meta["caption"]


class Curate:
    """The curation embedding stage and its CLIP."""

    def __init__(self, args) -> None:
        import pyarrow as pa

        from tasks.curate.embed import LEDGER_COLUMNS, _captions
        from tasks.formats.ledger import read_parquet
        from tasks.formats.recipe_curate import CurateConfig
        from tasks.models.batches import LocalShard, iter_pixels
        from tasks.models.dual_encoder import load_encoder
        from tasks.models.placement import compute_dtype
        from tasks.stages.runner import Verdict, records_of_layout, run_shard

        self.args, self.base = args, BENCH_DIR / "curate"
        self.storage, model = Storage(str(self.base)), make_model(self.base / "vit-b32-random")
        self.tar, self.ledger = f"in/{args.samples}/000000-bench.tar", f"in/{args.samples}/000000-bench.ledger.parquet"

        def one(i: int) -> Verdict:
            jpg, caption = demo_jpeg(i)
            members = {"jpg": jpg, "json": json.dumps({"caption": caption}).encode(), "txt": caption.encode()}
            return Verdict(
                {"key": f"bench-{i:09d}", "source": "bench", "row": i, "status": "ok", "reason": None}, members=members
            )

        run_shard(self.storage, self.tar, self.ledger, lambda: range(args.samples), one, source="bench", index=0)
        dtype = compute_dtype(args.compute_dtype, args.device)
        decode = "gpu" if args.device == "cuda" else "cpu"
        self.cfgs = {
            m: CurateConfig(model=str(model), decode=decode, device=args.device, batch_size=args.batch, compute_dtype=d)
            for m, d in (("baseline", "fp32"), ("new", dtype))
        }
        self.encs = {
            m: load_encoder(str(model), None, None, args.device, c.compute_dtype)[0] for m, c in self.cfgs.items()
        }
        if args.baseline == "fp32-77":
            self.encs["baseline"] = Padded77(self.encs["baseline"])
        rows = sorted(read_parquet(self.storage, self.ledger, LEDGER_COLUMNS).to_pylist(), key=lambda r: r["offset"])
        layout = pa.Table.from_pylist([{k: r[k] for k in ("key", "offset", "length", "members")} for r in rows])
        local = LocalShard(self.storage, self.tar, records_of_layout(layout))
        self.batches = list(iter_pixels(local.tar, local.idx, len(rows), self.encs["new"].preprocess, self.cfgs["new"]))
        self.captions = _captions(local.tar, rows)
        local.close()
        tokens = [len(self.encs["new"].tokenizer(c)["input_ids"]) for c in self.captions.values()]
        self.labels = {
            "baseline": "fp32, captions padded to 77"
            if args.baseline == "fp32-77"
            else "fp32, captions at their length",
            "new": f"{dtype}, captions at their length",
        }
        self.about = f"ViT-B/32-sized CLIP; captions {min(tokens)}-{max(tokens)} tokens (mean {np.mean(tokens):.1f})"

    def stage(self, mode: str, rnd: int) -> str:
        import tasks.curate.embed as embed

        out, real = f"out/{mode}-{rnd}.parquet", embed.load_encoder
        if mode == "baseline":  # the first of each round
            shutil.rmtree(self.base / "out", ignore_errors=True)
        embed.load_encoder = lambda *a, **k: (self.encs[mode], False)  # the model loaded beforehand
        try:
            embed.embed_shard(self.storage, self.cfgs[mode], self.tar, self.ledger, out, f"bench-{rnd}")
        finally:
            embed.load_encoder = real
        return out

    def encoders(self, mode: str) -> None:
        keys = []
        for k, pixels in self.batches:
            self.encs[mode].images(pixels)
            keys += k
        self.encs[mode].texts([self.captions[k] for k in keys], self.args.batch)

    def apart(self, outs: dict[str, str]) -> str:
        import pyarrow.parquet as pq

        cos = {}
        for col in ("image", "text"):
            a, b = (
                np.asarray(pq.read_table(self.base / outs[m], columns=[col]).column(col).to_pylist(), np.float32)
                for m in ("baseline", "new")
            )
            cos[col] = float((a * b).sum(axis=1).min())
        return f"lowest cosine to the baseline's embeddings: image {cos['image']:.4f}, text {cos['text']:.4f}"


class Padded77:
    """The encoder as curation ran it before issue 41: fp32, every caption padded to the context."""

    def __init__(self, enc) -> None:
        self.enc, self.preprocess, self.tokenizer = enc, enc.preprocess, enc.tokenizer

    def images(self, pixels):
        return self.enc.images(pixels)

    def texts(self, captions, batch_size=None):
        import torch

        from tasks.models.dual_encoder import _normalised

        out, step = [], batch_size or len(captions)
        for at in range(0, len(captions), step):
            tok = self.enc.tokenizer(
                captions[at : at + step], padding="max_length", truncation=True, max_length=77, return_tensors="pt"
            )
            with torch.inference_mode():
                out.append(_normalised(self.enc.model.get_text_features(**tok)))
        return np.concatenate(out)


class Precache:
    """The precache stage, the demo's VAE and a T5 text encoder of t5-small's shape."""

    def __init__(self, args) -> None:
        import pickle

        from tasks.demo.models import make_all
        from tasks.formats.recipe_outputs import PrecacheConfig
        from tasks.formats.shards import ShardWriter
        from tasks.models.frozen import load_encoders
        from tasks.stages.precache import PrecacheInput

        self.args, base = args, BENCH_DIR / "precache"
        self.models, text = make_all(base / "models"), make_t5_small(base / "models" / "t5-small")
        self.storage = Storage(str(base / "work"))
        rel, records = f"in/shard-{args.samples}.tar", f"in/shard-{args.samples}.records"
        if not self.storage.exists(records):
            with self.storage.atomic_writer(rel) as fh:
                w = ShardWriter(fh)
                for i in range(args.samples):
                    jpg, caption = demo_jpeg(i)
                    w.write_sample(f"bench-{i:09d}", {"jpg": jpg, "txt": caption.encode()})
                w.close()
            self.storage.write_bytes(records, pickle.dumps(w.records))
        import hashlib

        sha = hashlib.sha256(self.storage.read_bytes(rel)).hexdigest()
        self.shard = PrecacheInput(rel, sha, tuple(pickle.loads(self.storage.read_bytes(records))))
        decode = "gpu" if args.device == "cuda" else "cpu"
        self.cfgs = {
            m: PrecacheConfig(
                image_latents={"model": str(self.models["vae"]), "resolution": args.resolution},
                text={"model": str(text), "max_length": 77},
                batch_size=args.batch,
                decode=decode,
                device=args.device,
                dtype="fp32",
                compute_dtype=d,
            )
            for m, d in (("baseline", "fp32"), ("new", args.compute_dtype))
        }
        self.encs = {m: load_encoders(c)[0] for m, c in self.cfgs.items()}
        self.encs["baseline"].encode_text = padded_text(self.encs["baseline"])
        self.batches = collect_batches(self.storage, self.shard, self.cfgs["new"])
        for enc in self.encs.values():
            run_encoders(enc, self.batches[:1])  # warm-up: first-call allocations
        self.labels = {
            "baseline": "fp32, captions padded to 77",
            "new": f"{args.compute_dtype}, each batch at its longest caption",
        }
        self.about = f"the demo's VAE at {args.resolution} px, text encoder t5-small; new: {self.encs['new'].dtypes}"

    def stage(self, mode: str, rnd: int) -> str:
        from tasks.stages.precache import precache_shard

        shutil.rmtree(self.storage.path(f"out-{mode}"), ignore_errors=True)
        return precache_shard(self.storage, self.cfgs[mode], self.shard, f"out-{mode}").tar

    def encoders(self, mode: str) -> None:
        run_encoders(self.encs[mode], self.batches)

    def apart(self, outs: dict[str, str]) -> str:
        from tasks.formats.shards import iter_samples

        def arrays(rel):
            with self.storage.open(rel, "rb") as fh:
                return {
                    s.key: {m: np.load(io.BytesIO(d)) for m, d in s.members.items()} for s in iter_samples(fh, path=rel)
                }

        a, b = arrays(outs["baseline"]), arrays(outs["new"])
        lat = [np.stack([x[k]["latent_mean.npy"] for k in a]).astype(np.float64) for x in (a, b)]
        rms = float(np.sqrt(((lat[0] - lat[1]) ** 2).mean() / (lat[0] ** 2).mean()))
        masked = max(
            float(np.abs((a[k]["text_emb.npy"] - b[k]["text_emb.npy"])[a[k]["text_mask.npy"] > 0]).max()) for k in a
        )
        return f"latent_mean relative RMS difference {rms:.4f}; caption states where the mask is 1 at most {masked:.4f} apart"


def run_encoders(enc, batches: list) -> None:
    """Precache's encoders alone on batches decoded beforehand."""
    for b in batches:
        if enc.vae is not None:
            enc.encode_images(b.vae_pixels, b.keys)
        if enc.text is not None:
            enc.encode_text(b.captions)
    if enc.device == "cuda":
        import torch

        torch.cuda.synchronize()


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


def collect_batches(storage: Storage, shard, cfg) -> list:
    from tasks.models.batches import LocalShard, iter_batches

    local = LocalShard(storage, shard.tar, shard.records)
    try:
        out = list(iter_batches(local.tar, local.idx, len(shard.records), cfg, None, None))
        for b in out:
            b.vae_pixels = b.vae_pixels.clone()  # DALI reuses its output buffers for the next batch
        return out
    finally:
        local.close()


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: on a GPU, decoding there too (exits 2 without one)",
    )
    p.add_argument("--stage", choices=["curate", "precache"], default="curate")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch", type=int, help="batch size (default: 32 for curate, 16 for precache)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (Dask workers run with OMP_NUM_THREADS=1)")
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument(
        "--baseline", default="fp32-77", choices=["fp32-77", "fp32"], help="curate: fp32-77 pads captions to 77"
    )
    p.add_argument("--resolution", type=int, default=256, help="precache's image size")
    args = parse(p, argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: run this with --device cuda on a GPU machine", file=sys.stderr)
        return 2
    args.batch = args.batch or (32 if args.stage == "curate" else 16)
    bench = Curate(args) if args.stage == "curate" else Precache(args)
    stage: dict[str, list[float]] = {"baseline": [], "new": []}
    alone: dict[str, list[float]] = {"baseline": [], "new": []}
    outs: dict[str, str] = {}
    for rnd in range(1, args.repeats + 1):
        for mode in stage:
            with clock() as lap:
                outs[mode] = bench.stage(mode, rnd)
            stage[mode].append(lap.wall)
            with clock() as enc:
                bench.encoders(mode)
            alone[mode].append(enc.wall)
            print(f"  round {rnd} {mode}: stage {lap.wall:.2f} s, encoders alone {enc.wall:.2f} s", flush=True)
    n, rows = args.samples, []
    for mode in stage:
        s, e = med(stage[mode]), med(alone[mode])
        rows.append((bench.labels[mode], f"{n / s:.2f}", f"{n / e:.2f}", f"{e / s:.3f}"))
    lines = [
        f"{args.stage}: {n} demo images, batch {args.batch}, {args.device}, torch threads {args.threads}; {bench.about}; medians of {args.repeats} rounds",
        "",
        *table(("mode", "stage samples/s", "encoders alone samples/s", "encoders' share of the stage"), rows),
        "",
        f"- new / baseline, stage samples/s: **{med(stage['baseline']) / med(stage['new']):.2f}x**; {bench.apart(outs)}",
    ]
    emit(f"Model stages (`bench_models.py --stage {args.stage}`)", lines, argv, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
