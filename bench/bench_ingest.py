"""Ingest (``--stage``), each beside what it replaced or competes with.

``finetune`` (issue 17): records/s and peak RSS of the streamed fine-tuning ingest beside the whole-file read of 54abba3.
``byo`` (issue 15): img2dataset's output released as is beside ``cp`` + ``sync`` of its bytes, and ingested with a
resize beside downloading the same images from loopback; samples/s.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import sys
import tarfile
from pathlib import Path

import harness.tools as ht
from harness.photos import ensure_pool, write_manifest
from harness.procs import BENCH_DIR, REPO, Session, measured, run_child, timed
from harness.report import emit, in_turn, medians, parse, parser, rounds, summary, table
from harness.servers import child_env, prefect_env, serve

OLD_REV = "54abba3"  # the last commit with the whole-file fine-tuning ingest
WORDS = "the a cat dog image shows what is on of in person table red blue car street sky tree building people standing sitting".split()
LABELS = {
    "cp": "cp -r + sync of img2dataset's output",
    "keep": "shardsmith ingest -> release, skip_reencode",
    "ingest": "shardsmith ingest -> validate with resize -> release",
    "download": "shardsmith download -> validate with resize -> release",
}


def record(rng: random.Random, i: int) -> dict:
    turns = []
    for t in range(rng.choice((2, 2, 4, 6, 8))):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60) if t % 2 == 0 else rng.randint(10, 120)))
        turns.append({"from": "human" if (t % 2 == 0) != (i % 50 == 7) else "gpt", "value": text})
    rec: dict = {"id": f"{i:012d}", "conversations": turns}
    if i % 10:
        rec["image"] = f"coco/train2017/{i:012d}.jpg"
        turns[0]["value"] = "<image>\n" + turns[0]["value"]
    return rec


def generate(path: Path, gigabytes: float) -> int:
    """Records until the file reaches the size, from a pool of 997 conversations (unique ids and image paths); the
    record count (kept in a sidecar). One record in ten text-only, one in 50 roles swapped, 1 JSONL line in 1,000 broken."""
    meta = path.with_suffix(path.suffix + ".records")
    if path.exists() and meta.exists():
        return int(meta.read_text())
    rng = random.Random(0)
    pool = [json.dumps(record(rng, i)).replace(f"{i:012d}", "@ID@").encode() for i in range(997)]
    target = int(gigabytes * 1e9)
    tmp = path.with_suffix(".tmp")
    n = size = 0
    array = path.suffix == ".json"
    with open(tmp, "wb") as fh:
        fh.write(b"[\n" if array else b"")
        while size < target:
            # Not JSON, in JSONL only: the old reader fails a whole array on one broken element.
            line = (
                b'{"id": "broken", "conversations": ['
                if n % 1000 == 500 and not array
                else pool[n % 997].replace(b"@ID@", b"%012d" % n)
            )
            sep = (b",\n" if n else b"") if array else b""
            fh.write(sep + line + (b"" if array else b"\n"))
            size += len(sep) + len(line) + 1
            n += 1
        fh.write(b"\n]\n" if array else b"")
    tmp.rename(path)
    meta.write_text(str(n))
    return n


def _range_job(job):
    from tasks.finetune.ingest import ingest_range

    storage, plan, part, cfg = job
    return ingest_range(storage, plan, part, cfg, {})


def run_new(path: Path, out: Path, workers: int, rows_per_shard: int) -> int:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from tasks.finetune.ingest import finish_ingest, plan_ingest
    from tasks.formats.recipe_download import SourceConfig
    from tasks.formats.recipe_finetune import FinetuneConfig
    from tasks.formats.storage import Storage

    storage = Storage(str(out))
    source = SourceConfig(name="llava", manifest=str(path), rows_per_shard=rows_per_shard)
    cfg = FinetuneConfig()
    plan = plan_ingest(storage, "bench", source, cfg, {})
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
        parts = list(pool.map(_range_job, [(storage, plan, r, cfg) for r in plan.ranges]))
    return finish_ingest(storage, plan, parts).rows


def run_old(path: Path, out: Path, rows_per_shard: int) -> int:
    """The whole-file ingest, ``tasks`` being the package at ``OLD_REV`` in this process (see child)."""
    from tasks.finetune import ingest_source
    from tasks.recipe import FinetuneConfig, SourceConfig
    from tasks.storage import Storage

    source = SourceConfig(name="llava", manifest=str(path), rows_per_shard=rows_per_shard)
    return ingest_source(Storage(str(out)), "bench", source, FinetuneConfig(), {}).rows


def finetune_child(method: str, path: Path, workers: int, rows_per_shard: int) -> dict:
    out = BENCH_DIR / "ingest" / f"out-{method}"
    if method == "old":  # the old code whole: its modules have moved or gone since
        sys.path.insert(0, str(ht.tree_at(OLD_REV)))
        import tasks.finetune  # noqa: F401 - imports are set-up, not ingest
    else:
        import tasks.finetune.ingest  # noqa: F401
    shutil.rmtree(out, ignore_errors=True)
    try:
        if method == "new":
            return measured(lambda: {"rows": run_new(path, out, workers, rows_per_shard)})
        return measured(lambda: {"rows": run_old(path, out, rows_per_shard)})
    finally:
        shutil.rmtree(out, ignore_errors=True)


def finetune(args) -> list[str]:
    folder = BENCH_DIR / "ingest"
    folder.mkdir(parents=True, exist_ok=True)
    files = [
        (folder / f"llava-{gb}gb.{ext}", float(gb))
        for ext, sizes in (("jsonl", args.jsonl_gb), ("json", args.json_gb))
        for gb in sizes.split(",")
        if gb
    ]
    counts, runs = {path: generate(path, gb) for path, gb in files}, []
    for path, gb in files:
        smallest = gb == min(g for q, g in files if q.suffix == path.suffix)
        methods = ["new"] + (["old"] if gb <= args.old_max_gb else [])
        for r in range(args.repeats if smallest else args.large_repeats):
            for m in in_turn(methods, r, first=0):
                res = run_child(
                    __file__,
                    m,
                    path,
                    "--workers",
                    args.workers,
                    "--rows-per-shard",
                    args.rows_per_shard,
                    env={**os.environ, "PYTHONPATH": str(REPO)},
                )
                if res["rows"] != counts[path]:
                    raise SystemExit(f"{m} on {path.name}: {res['rows']} rows, the file has {counts[path]} records")
                runs.append(res | {"tool": f"{path.name} {m}"})
                print(
                    f"  round {r + 1} {path.name} {m}: {res['rows'] / res['seconds']:.0f} records/s, {res['peak_mb']:.0f} MB",
                    flush=True,
                )
    rate, per_cpu = medians(runs, lambda r: r["rows"] / r["seconds"]), medians(runs, lambda r: r["rows"] / r["cpu"])
    peak = medians(runs, lambda r: r["peak_mb"])
    rows = [
        (
            k.split()[0],
            k.split()[1],
            f"{v:,.0f}",
            f"{rate[k] / rate[k.replace('new', 'old')]:.2f}x"
            if k.endswith("new") and k.replace("new", "old") in rate
            else "",
            f"{per_cpu[k]:,.0f}",
            f"{peak[k]:.0f}",
        )
        for k, v in rate.items()
    ]
    lines = [
        f"{args.workers} workers, rows_per_shard {args.rows_per_shard}; medians",
        "",
        *table(("file", "method", "records/s", "new / old", "records per CPU s", "peak RSS MB"), rows, "llrrrr"),
        "",
    ]
    for suffix in (".jsonl", ".json"):
        sized = sorted((gb, q) for q, gb in files if q.suffix == suffix)
        for m in ("new", "old"):
            ends = [peak.get(f"{q.name} {m}") for _, q in (sized[0], sized[-1])] if len(sized) > 1 else []
            if ends and all(ends):
                lines.append(
                    f"- peak RSS {suffix} {m}: {ends[1]:.0f} MB at {sized[-1][0]} GB / {ends[0]:.0f} MB at {sized[0][0]} GB = {ends[1] / ends[0]:.2f}x"
                )
    return lines


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ensure_i2d_output(s: Session, args, manifest: Path, server_pid: int) -> Path:
    """img2dataset's own output of the manifest at its defaults, made once per size and seed."""
    folder = BENCH_DIR / "byo" / f"i2d-{args.shards}x{args.per_shard}-s{args.seed}"
    if (folder / ".complete").exists():
        return folder
    ht.ensure_img2dataset()
    tmp = folder.parent / (folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"img2dataset downloads {args.shards * args.per_shard} images into {folder} (once) ...", flush=True)
    cmd = ht.i2d_command(
        manifest, tmp / "out", args.workers, args.threads, args.per_shard, *ht.I2D_RESIZE, "--timeout", "20"
    )
    timed(s.children, cmd, ht.i2d_env(), tmp, tmp / "stderr.log", {"server": server_pid})
    statuses = ht.i2d_outputs(tmp / "out", ["status"])[0].get("status", [])
    if (ok := sum(x == "success" for x in statuses)) != len(statuses):
        raise SystemExit(f"img2dataset wrote {ok} of {len(statuses)} samples; see {tmp}")
    shutil.rmtree(folder, ignore_errors=True)
    (tmp / "out").rename(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    (folder / ".complete").write_text(json.dumps({"samples": ok}))
    return folder


def released(store: Path) -> tuple[int, int]:
    """(samples in the latest release, those whose image bytes are the ingested input's)."""
    base = store / "byo" / "releases"
    version = (base / "LATEST").read_text().strip()
    samples = kept = 0
    for shard in json.loads((base / version / "index.json").read_text())["shards"]:
        path = base / version / shard["name"]
        with tarfile.open(
            fileobj=io.BytesIO(path.read_bytes() if path.exists() else (store / shard["path"]).read_bytes())
        ) as tf:
            members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        for name, blob in members.items():
            if name.endswith(".json"):
                meta = json.loads(blob)
                image = members.get(name[: -len("json")] + meta["format"])
                samples += 1
                kept += image is not None and hashlib.sha256(image).hexdigest() == meta.get("src_sha256")
    return samples, kept


def byo(args) -> list[str]:
    pool_dir, sizes = ensure_pool(args.shards * args.per_shard, args.seed)
    with Session("byo", args.keep) as s:
        loop = serve(s, pool_dir, prefect=True)
        manifest = s.work / "manifest.parquet"
        write_manifest(manifest, [f"{loop.base_url}/img/{name}" for name in sizes])
        shards = ensure_i2d_output(s, args, manifest, loop.watch["server"])
        samples, shard_bytes = json.loads((shards / ".complete").read_text())["samples"], folder_bytes(shards)
        ingest = {"kind": "webdataset", "manifest": f"{shards}/", "url_column": "url"}
        resize = {"resize_mode": "border", "image_size": args.image_size, "output_format": "jpeg", "quality": 95}
        recipes = {
            "keep": (ingest, {"skip_reencode": True, "output_format": "jpeg"}),
            "ingest": (ingest, resize),
            "download": ({"manifest": str(manifest), "rows_per_shard": args.per_shard}, resize),
        }

        def run(tool: str, rnd: int) -> dict:
            (out := s.work / f"{tool}-{rnd}").mkdir()
            if tool == "cp":
                t = timed(
                    s.children,
                    ["bash", "-c", 'cp -r "$0" "$1" && sync', str(shards), str(out / "copy")],
                    child_env(),
                    s.work,
                    out / "log",
                    loop.watch,
                )
                if folder_bytes(out / "copy") != shard_bytes:
                    raise SystemExit(f"cp copied {folder_bytes(out / 'copy')} of {shard_bytes} bytes")
                n, kept = samples, None
            else:  # the web benchmark's recipe with this part's source and image settings
                source, image = recipes[tool]
                recipe = ht.write_recipe(
                    out / "recipe.yaml",
                    out / "store",
                    Path("unused"),
                    1,
                    args.workers,
                    dataset="byo",
                    sources=[{"name": "bench", **source}],
                    validate={"image": image},
                )
                env = prefect_env(s.work / "prefect-home", loop.api)
                t = timed(s.children, ht.run_command(recipe), env, REPO, out / "stderr.log", loop.watch)
                n, kept = released(out / "store")
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
            return {"tool": tool, "wall": t.wall_s, "samples/s": n / t.wall_s, "CPU s": t.cpu_s, "kept": kept}

        runs = []
        for part in (("cp", "keep"), ("ingest", "download")):
            runs += rounds([t for t in part if t in args.tools], args.repeats, run, args.quiet_wait)
    rate = medians(runs, lambda r: r["samples/s"])
    columns = {
        "wall s": ("wall", ".2f"),
        "samples/s": ("samples/s", ".1f"),
        "CPU s": ("CPU s", ".1f"),
        "released samples with the input's bytes": ("kept", ".0f"),
    }
    lines = [
        f"Input: img2dataset's output, {args.shards} shards x {args.per_shard} samples, {shard_bytes / 1e6:.1f} MB; the download path fetches "
        f"the same {len(sizes)} pool images ({sum(sizes.values()) / 1e6:.1f} MB); {args.workers} workers; part b resizes to {args.image_size} px; medians of {args.repeats} rounds",
        "",
        *summary([r | {"tool": LABELS[r["tool"]]} for r in runs], columns),
        "",
    ]
    for tool, base, what in (
        ("keep", "cp", "part a, release as is"),
        ("ingest", "download", "part b, ingest with resize"),
    ):
        if tool in rate and base in rate:
            lines.append(f"- {what}: {tool} / {base} **{rate[tool] / rate[base]:.3f}x** samples/s")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, repeats=3, quiet_wait=60.0, keep="byo")
    p.add_argument(
        "--stage", choices=("finetune", "byo"), default="finetune", help="what is measured (default finetune)"
    )
    p.add_argument("--jsonl-gb", default="0.2,2", help="finetune: JSONL sizes in GB, comma-separated (default 0.2,2)")
    p.add_argument("--json-gb", default="0.1,1", help="finetune: JSON array sizes in GB (default 0.1,1)")
    p.add_argument(
        "--old-max-gb", type=float, default=0.5, help="finetune: the old path only up to this size (default 0.5)"
    )
    p.add_argument(
        "--large-repeats", type=int, default=1, help="finetune: rounds at the larger sizes (--repeats: at the smallest)"
    )
    p.add_argument("--rows-per-shard", type=int, default=5000, help="finetune: rows per shard (default 5000)")
    p.add_argument("--shards", type=int, default=10, help="byo: img2dataset shards to ingest (default 10)")
    p.add_argument(
        "--per-shard",
        type=int,
        default=1000,
        help="byo: samples per shard; the download path's rows_per_shard (default 1000)",
    )
    p.add_argument("--seed", type=int, default=0, help="byo: seed of the image pool")
    p.add_argument("--image-size", type=int, default=224, help="byo: part b's resize target, border mode (default 224)")
    ht.add_tool_flags(p, rows_per_shard=None)  # byo: img2dataset's threads when it makes the shards
    args = parse(p, argv, tools=tuple(LABELS))
    if args.child:
        print(json.dumps(finetune_child(args.child[0], Path(args.child[1]), args.workers, args.rows_per_shard)))
        return 0
    title = "Fine-tuning ingest" if args.stage == "finetune" else "Bring your own data"
    emit(
        f"{title} (`bench_ingest.py --stage {args.stage}`)",
        finetune(args) if args.stage == "finetune" else byo(args),
        argv,
        args.markdown,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
