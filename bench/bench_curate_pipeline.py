"""The curated set two ways, issue 41: img2dataset + clip-retrieval's clip_inference + a filter, beside shardsmith run --phase curate.

img2dataset 1.47 at its defaults, clip-retrieval 2.45 (its own venv) and a filter at cosine >= ``--min``; both read one
random ViT-B/32-shaped CLIP with CLIP's BPE tokenizer. Printed: wall, CPU, samples/s, the ratio, decisions compared by URL.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import harness.tools as ht
from bench_models import make_model
from harness.photos import ensure_pool, write_manifest
from harness.procs import BENCH_DIR, REPO, Session, timed
from harness.report import emit, medians, parse, parser, rounds, table
from harness.servers import child_env, prefect_env, serve

CR_VENV = BENCH_DIR / "clip-retrieval-venv"
CR_PY = CR_VENV / "bin" / "python"
# torch pinned to the CPU wheel on local disk (unpinned, pip takes a multi-GB CUDA build);
# torchvision 0.28 is the release paired with it; clip-anytorch imports pkg_resources (setuptools < 81).
CR_REQUIREMENTS = ("clip-retrieval==2.45.0", "torch==2.13.0", "torchvision==0.28.0", "setuptools<81")
CR_EXE = CR_VENV / "bin" / "clip-retrieval"
# The PyPI torchvision wheel links CUDA libraries the CPU torch lacks, so its C++ ops do not load,
# and its import then fails registering fakes for two of them: a module that the venv's .pth
# runs in every process (clip_inference spawns some) defines those two first. hf_clip never
# calls a torchvision op (transformers' CLIPImageProcessor preprocesses with PIL).
SHIM = """import importlib.abc, sys
class TorchvisionOps(importlib.abc.MetaPathFinder):
    done = False
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" and not self.done:
            self.done = True
            import torch
            for op in ("nms", "qnms"):
                torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
sys.meta_path.insert(0, TorchvisionOps())
"""
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
FILTER = '''"""Keep samples whose image-caption cosine is >= MIN; copy them out of img2dataset's shards."""
import glob, os, sys, tarfile
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
emb, shards, out, lo = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
def load(kind):
    a = np.concatenate([np.load(f) for f in sorted(glob.glob(f"{emb}/{kind}_emb/*.npy"))]).astype(np.float32)
    return a / np.linalg.norm(a, axis=1, keepdims=True)
keys = pa.concat_tables([pq.read_table(f) for f in sorted(glob.glob(f"{emb}/metadata/*.parquet"))])["image_path"]
score = (load("img") * load("text")).sum(axis=1)
keep = {k for k, s in zip(keys.to_pylist(), score) if s >= lo}
os.makedirs(out, exist_ok=True)
pq.write_table(pa.table({"key": keys, "alignment": score, "kept": [k in keep for k in keys.to_pylist()]}), f"{out}/decisions.parquet")
for path in sorted(glob.glob(f"{shards}/*.tar")):
    with tarfile.open(path) as src, tarfile.open(f"{out}/{os.path.basename(path)}", "w") as dst:
        for m in src:
            if m.isfile() and m.name.split(".", 1)[0] in keep:
                dst.addfile(m, src.extractfile(m))
'''


def _shim(site: Path) -> None:
    (site / "torchvision_cpu_shim.py").write_text(SHIM)
    (site / "torchvision_cpu_shim.pth").write_text("import torchvision_cpu_shim\n")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table, as clip/simple_tokenizer.py has it."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def shared_model() -> Path:
    """make_model's weights with CLIP's BPE tokenizer, CLIP token ids and CLIP's preprocessing."""
    src = make_model(BENCH_DIR / "curate" / "vit-b32-random")
    dst = BENCH_DIR / "curate" / "vit-b32-random-bpe"
    if (dst / "preprocessor_config.json").exists():
        return dst
    from transformers import CLIPTokenizer

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    os.link(src / "model.safetensors", dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"].update(bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    bpe = next((CR_VENV / "lib").glob("python*/site-packages/clip/bpe_simple_vocab_16e6.txt.gz"))
    merges = gzip.open(bpe).read().decode().split("\n")[1 : 49152 - 256 - 2 + 1]
    units = list(bytes_to_unicode().values())
    vocab = [*units, *(u + "</w>" for u in units), *("".join(m.split()) for m in merges)]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    (dst / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (dst / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    CLIPTokenizer(str(dst / "vocab.json"), str(dst / "merges.txt"), model_max_length=77).save_pretrained(dst)
    pre = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "CLIPProcessor",
        "do_resize": True,
        "size": {"shortest_edge": 224},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (dst / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return dst


def run_baseline(s: Session, args, rnd: int, manifest: Path, model: Path, watch: dict) -> tuple[ht.ToolRun, dict]:
    (d := s.work / f"baseline-{rnd}").mkdir(parents=True)
    run, a = ht.ToolRun("baseline", rnd), args
    cmd = ht.i2d_command(manifest, d / "i2d", a.workers, a.threads, a.rows_per_shard, *ht.I2D_RESIZE, *ht.I2D_NET)
    env = child_env(NO_ALBUMENTATIONS_UPDATE="1", **OFFLINE)
    run.add(timed(s.children, cmd, env, d, d / "i2d.log", watch), "img2dataset")
    meta, _ = ht.i2d_outputs(d / "i2d", ["key", "url", "status"])
    names = sorted(p.stem for p in (d / "i2d").glob("*.tar"))
    if len(names) != int(names[-1]) - int(names[0]) + 1:
        raise SystemExit(f"img2dataset's shards are not numbered in a row: {names}")
    shards = f"{d / 'i2d'}/{{{names[0]}..{names[-1]}}}.tar" if len(names) > 1 else str(d / "i2d" / f"{names[0]}.tar")
    cmd = [
        str(CR_EXE),
        "inference",
        "--input_dataset",
        shards,
        "--input_format",
        "webdataset",
        "--output_folder",
        str(d / "emb"),
        "--clip_model",
        f"hf_clip:{model}",
        "--batch_size",
        str(a.cr_batch),
        "--num_prepro_workers",
        str(min(a.cr_workers, len(names))),
        "--enable_wandb",
        "False",
    ]
    run.add(timed(s.children, cmd, env, d, d / "clip.log", watch), "clip_inference")
    (d / "filter.py").write_text(FILTER)
    cmd = [str(CR_PY), str(d / "filter.py"), str(d / "emb"), str(d / "i2d"), str(d / "curated"), repr(a.min)]
    run.add(timed(s.children, cmd, env, d, d / "filter.log", watch), "filter")
    import pyarrow.parquet as pq

    dec = pq.read_table(d / "curated" / "decisions.parquet").to_pydict()
    url = dict(zip(meta["key"], meta["url"]))
    run.rows, run.ok = len(meta["key"]), len(dec["key"])
    run.extra["kept"] = sum(dec["kept"])
    return run, {url[k]: (s_, kept) for k, s_, kept in zip(dec["key"], dec["alignment"], dec["kept"])}


def run_shardsmith(s: Session, args, rnd: int, manifest: Path, model: Path, watch: dict) -> tuple[ht.ToolRun, dict]:
    (d := s.work / f"shardsmith-{rnd}").mkdir(parents=True)
    curate = {"model": str(model), "alignment": {"min": args.min}} | (
        {"compute_dtype": args.compute_dtype} if args.compute_dtype else {}
    )
    recipe = ht.write_recipe(
        d / "recipe.yaml",
        store := d / "store",
        manifest,
        args.rows_per_shard,
        args.workers,
        curate=curate,
        gates={"curate": {"max_removed_rate": 1.0}},
    )
    env = prefect_env(s.work / "prefect-home", None, **OFFLINE)
    t = timed(s.children, ht.run_command(recipe, "curate"), env, REPO, d / "stderr.log", watch)
    run, res = ht.ToolRun("shardsmith", rnd), ht.summary(t.stdout)
    run.add(t, "shardsmith run --phase curate")
    cur = res["curate"]
    import pyarrow.parquet as pq

    ledgers = [pq.read_table(store / rel, columns=["key", "url"]).to_pydict() for rel in res["download"]["ledgers"]]
    url = {k: u for t in ledgers for k, u in zip(t["key"], t["url"])}
    cols = ["key", "status", "reason", "alignment"]
    rows = [r for rel in cur["ledgers"] for r in pq.read_table(store / rel, columns=cols).to_pylist()]
    run.rows, run.ok = res["download"]["counts"]["rows"], cur["counts"]["rows"]
    run.extra["kept"] = cur["counts"]["ok"]
    other = [r["reason"] for r in rows if r["status"] != "ok" and r["reason"] != "low_alignment"]
    if other:
        print(f"  note: shardsmith removed {len(other)} samples for other reasons: {sorted(set(other))}", flush=True)
    return run, {url[r["key"]]: (r["alignment"], r["status"] == "ok") for r in rows if r["alignment"] is not None}


def agreement(base: dict, ss: dict, lo: float) -> dict:
    """Decisions compared by URL: how many agree, the score differences, and where the others lie (two scores on
    either side of the threshold are within their difference of it; ``band``: the samples within ``max_diff`` of it)."""
    common = sorted(base.keys() & ss.keys())
    diffs = sorted(abs(base[u][0] - ss[u][0]) for u in common)
    worst = diffs[-1] if diffs else 0.0
    differ = [u for u in common if base[u][1] != ss[u][1]]
    return {
        "common": len(common),
        "only_baseline": len(base.keys() - ss.keys()),
        "only_shardsmith": len(ss.keys() - base.keys()),
        "agree": len(common) - len(differ),
        "differ": len(differ),
        "max_diff": worst,
        "p99_diff": diffs[int(0.99 * (len(diffs) - 1))] if diffs else 0.0,
        "band": sum(abs(ss[u][0] - lo) <= worst for u in common),
        "furthest": max((max(abs(base[u][0] - lo), abs(ss[u][0] - lo)) for u in differ), default=0.0),
        "examples": [(u.rsplit("/", 1)[-1], round(base[u][0], 4), round(ss[u][0], 4)) for u in differ[:4]],
    }


def report(runs: list[ht.ToolRun], agree: list[dict], args) -> list[str]:
    rate, cpu = medians(runs, lambda r: r.rate), medians(runs, lambda r: r.cpu_per_1k)
    rows = [
        (
            r.tool,
            r.round,
            f"{r.wall_s:.1f}",
            f"{r.cpu_s:.1f}",
            f"{r.rate:.2f}",
            f"{r.cpu_per_1k:.1f}",
            r.extra["kept"],
            "; ".join(f"{k} {w:.1f}" for k, (w, _) in r.extra["stages"].items()),
        )
        for r in runs
    ]
    lines = [
        f"{args.urls} URLs, one distinct image each; {args.workers} processes, {args.rows_per_shard} rows per shard, 256 px border, jpg q95; "
        f"clip_inference --batch_size {args.cr_batch} --num_prepro_workers {args.cr_workers}; alignment min {args.min}; "
        f"compute_dtype {args.compute_dtype or 'not set'}",
        "",
        *table(("pipeline", "round", "wall s", "CPU s", "samples/s", "CPU s / 1k", "kept", "stages (wall s)"), rows),
        "",
        f"- shardsmith / baseline: **{rate['shardsmith'] / rate['baseline']:.2f}x** samples/s (target >= 1.5x), "
        f"**{cpu['baseline'] / cpu['shardsmith']:.2f}x** less CPU per sample (medians)",
    ]
    for rnd, g in enumerate(agree, 1):
        lines.append(
            f"- decisions, round {rnd}: **{g['agree']} of {g['common']}** matched by URL agree; only in one set: "
            f"{g['only_baseline']} / {g['only_shardsmith']}; |score difference| max {g['max_diff']:.4f}, 99th percentile "
            f"{g['p99_diff']:.4f}; the {g['differ']} that differ lie within {g['furthest']:.4f} of the threshold "
            f"({g['band']} samples within the max difference of it); e.g. {g['examples']}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, repeats=2, quiet_wait=60.0, keep="curate-pipeline")
    p.add_argument(
        "--urls", type=int, default=10_000, help="URLs in the manifest, each a distinct image (500: a smoke run)"
    )
    p.add_argument(
        "--min",
        type=float,
        default=-0.021,
        help="curate.alignment.min and the filter's threshold (about the median score here)",
    )
    p.add_argument(
        "--compute-dtype",
        choices=("auto", "fp32", "bf16", "fp16"),
        help="curate.compute_dtype (unset: not in the recipe)",
    )
    p.add_argument("--cr-batch", type=int, default=256, help="clip_inference --batch_size (its default)")
    p.add_argument(
        "--cr-workers", type=int, default=2, help="clip_inference --num_prepro_workers (at most one per shard)"
    )
    p.add_argument("--warmup", type=int, default=64, help="URLs of an untimed run of each pipeline first (0: none)")
    ht.add_tool_flags(p, rows_per_shard=1000)
    args = parse(p, argv)
    ht.ensure_img2dataset()
    ht.ensure_venv(CR_VENV, [CR_REQUIREMENTS], _shim)
    model = shared_model()
    pool, sizes = ensure_pool(max(args.urls, args.warmup), 0)
    names, agree, decided = list(sizes), [], {}
    steps = {"baseline": run_baseline, "shardsmith": run_shardsmith}
    with Session("curate-pipeline", args.keep) as s:
        loop = serve(s, pool, prefect=False)
        manifest, small = s.work / "manifest.parquet", s.work / "small.parquet"
        write_manifest(manifest, [f"{loop.base_url}/img/{n}" for n in names[: args.urls]])
        if args.warmup:
            write_manifest(small, [f"{loop.base_url}/img/{n}" for n in names[: args.warmup]])
            print(f"warm-up (not timed): each pipeline on {args.warmup} URLs ...", flush=True)
            for tool, step in steps.items():
                step(s, args, 0, small, model, loop.watch)
                shutil.rmtree(s.work / f"{tool}-0", ignore_errors=True)

        def run(tool: str, rnd: int) -> ht.ToolRun:
            r, decided.setdefault(rnd, {})[tool] = steps[tool](s, args, rnd, manifest, model, loop.watch)
            if len(decided[rnd]) == 2:
                agree.append(agreement(decided[rnd]["baseline"], decided[rnd]["shardsmith"], args.min))
            if not args.keep:
                shutil.rmtree(s.work / f"{tool}-{rnd}", ignore_errors=True)
            return r

        runs = rounds(list(steps), args.repeats, run, args.quiet_wait)
    emit("The curated set two ways (`bench_curate_pipeline.py`)", report(runs, agree, args), argv, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
