"""Bring-your-own-data benchmark: img2dataset's own output ingested and released, beside `cp` of the same bytes and beside downloading the same images.

One invocation renders (or reuses) bench_validate.py's pool of distinct images, serves it on
loopback, and has the real img2dataset (``.bench/img2dataset-venv``) download it once with its
defaults (256 px, ``border``, JPEG q95) into ``--shards`` shards of ``--per-shard`` samples,
kept under ``.bench/byo/`` for later invocations. Then, with one Prefect server (not timed), for
``--repeats`` rounds, the tools of each part alternating (their order flips every round):

- part a, "release as is": ``cp`` is ``cp -r`` of img2dataset's output folder (tars, parquets,
  stats) and ``sync``; ``keep`` is ``shardsmith run`` to a release over those shards
  (``kind: webdataset``, ``validate.image.skip_reencode: true``, no resize): ingest, validate
  (every image decoded, checked and hashed, its bytes kept), dedup, reshard, release. The
  released samples whose bytes are the input's (json ``sha256 == src_sha256``) are counted.
- part b, "resize": ``ingest`` is the same run with ``resize_mode: border`` at
  ``--image-size`` (re-encoded); ``download`` is ``shardsmith run`` over a URL manifest of the
  same pool images on the loopback server, same validate settings, to a release.

Printed per run: wall seconds, released samples, samples/s, MB/s of the input, CPU seconds of
the tool's process tree; then medians and the ratios keep/cp and ingest/download (samples/s).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import bench_validate
from harness.photos import ensure_unique_pool, write_manifest
from harness.procs import BENCH_DIR, Children, Session, settle, timed
from harness.report import add_round_flags, command, emit, in_turn, machine, med, now, revision, table
from harness.servers import child_env, prefect_env, serve
from harness.tools import I2D_REQUIREMENT, REPO, add_tool_flags, ensure_img2dataset, run_command, write_recipe

PARTS = {"a": ("cp", "keep"), "b": ("ingest", "download")}
LABELS = {
    "cp": "cp -r + sync of img2dataset's output",
    "keep": "shardsmith ingest -> release, skip_reencode",
    "ingest": "shardsmith ingest -> validate with resize -> release",
    "download": "shardsmith download -> validate with resize -> release",
}


@dataclass
class Result:
    part: str
    tool: str
    round: int
    wall_s: float
    cpu_s: float
    samples: int
    in_bytes: int
    kept: int | None = None  # released samples whose image bytes are the input's
    other_cpu_s: float = 0.0  # CPU used meanwhile on the machine outside the benchmark

    @property
    def rate(self) -> float:
        return self.samples / self.wall_s


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ensure_i2d_output(children: Children, args, manifest: Path, server_pid: int) -> Path:
    """img2dataset's own output of the manifest (its defaults), made once per size and seed."""
    folder = BENCH_DIR / "byo" / f"i2d-{args.shards}x{args.per_shard}-s{args.seed}"
    stamp = folder / ".complete"
    if stamp.exists():
        return folder
    ensure_img2dataset()
    shutil.rmtree(folder, ignore_errors=True)
    tmp = folder.parent / (folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"img2dataset downloads {args.shards * args.per_shard} images into {folder} (once) ...", flush=True)
    i2d_args = argparse.Namespace(workers=args.workers, threads=args.threads, rows_per_shard=args.per_shard)
    run = bench_validate.run_img2dataset(children, tmp, i2d_args, 0, manifest, {"server": server_pid})
    if run.ok != run.rows:
        raise SystemExit(f"img2dataset wrote {run.ok} of {run.rows} samples; see {tmp}")
    (tmp / "i2d-default-0" / "out").rename(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    stamp.write_text(json.dumps({"samples": run.ok, "size": list(run.sample_size or ())}))
    return folder


def write_byo_recipe(path: Path, store: Path, source: dict, image: dict, workers: int) -> None:
    """The validate benchmark's recipe (every license allowed and reviewed, loopback allowed)
    with this benchmark's source and image settings."""
    import yaml

    write_recipe(path, store, Path("unused"), 1, workers)
    recipe = yaml.safe_load(path.read_text())
    recipe["dataset"] = "byo"
    recipe["sources"] = [{"name": "bench", **source}]
    recipe["validate"]["image"] = image
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def released(store: Path) -> tuple[int, int]:
    """(samples in the latest release, those whose image bytes are the ingested input's)."""
    base = store / "byo" / "releases"
    version = (base / "LATEST").read_text().strip()
    index = json.loads((base / version / "index.json").read_text())
    samples = kept = 0
    for shard in index["shards"]:
        path = base / version / shard["name"]
        data = path.read_bytes() if path.exists() else (store / shard["path"]).read_bytes()
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        for name, blob in members.items():
            if name.endswith(".json"):
                meta = json.loads(blob)
                image = members.get(name[: -len("json")] + meta["format"])
                samples += 1
                kept += image is not None and hashlib.sha256(image).hexdigest() == meta.get("src_sha256")
    return samples, kept


def run_shardsmith(ctx: dict, part: str, tool: str, rnd: int, source: dict, image: dict, in_bytes: int) -> Result:
    s: Session = ctx["session"]
    out = s.work / f"{tool}-{rnd}"
    out.mkdir()
    recipe = out / "recipe.yaml"
    write_byo_recipe(recipe, out / "store", source, image, ctx["args"].workers)
    env = prefect_env(s.work / "prefect-home", ctx["api"])
    t = timed(s.children, run_command(recipe), env, REPO, out / "stderr.log", ctx["watch"])
    samples, kept = released(out / "store")
    return Result(part, tool, rnd, t.wall_s, t.cpu_s, samples, in_bytes, kept, t.other_s)


def run_cp(ctx: dict, rnd: int, src: Path, samples: int, in_bytes: int) -> Result:
    s: Session = ctx["session"]
    dst = s.work / f"cp-{rnd}"
    cmd = ["bash", "-c", 'cp -r "$0" "$1" && sync', str(src), str(dst)]
    t = timed(s.children, cmd, child_env(), s.work, s.work / f"cp-{rnd}.log", ctx["watch"])
    if folder_bytes(dst) != in_bytes:
        raise SystemExit(f"cp copied {folder_bytes(dst)} of {in_bytes} bytes")
    return Result("a", "cp", rnd, t.wall_s, t.cpu_s, samples, in_bytes, None, t.other_s)


def sources(ctx: dict) -> dict[str, tuple[dict, dict]]:
    """(source, validate.image) of each shardsmith tool's recipe."""
    args = ctx["args"]
    ingest = {"kind": "webdataset", "manifest": f"{ctx['shards']}/", "url_column": "url"}
    download = {"manifest": str(ctx["manifest"]), "rows_per_shard": args.per_shard}
    keep = {"skip_reencode": True, "output_format": "jpeg"}
    resize = {"resize_mode": "border", "image_size": args.image_size, "output_format": "jpeg", "quality": 95}
    return {"keep": (ingest, keep), "ingest": (ingest, resize), "download": (download, resize)}


def run_round(ctx: dict, part: str, rnd: int) -> list[Result]:
    out = []
    for tool in in_turn(PARTS[part], rnd):
        if tool not in ctx["args"].tools:
            continue
        settle(ctx["args"].quiet_wait)
        if tool == "cp":
            r = run_cp(ctx, rnd, ctx["shards"], ctx["samples"], ctx["shard_bytes"])
        else:
            source, image = sources(ctx)[tool]
            r = run_shardsmith(
                ctx, part, tool, rnd, source, image, ctx["pool_bytes"] if tool == "download" else ctx["shard_bytes"]
            )
        kept = f"; {r.kept} with the input's bytes" if r.kept is not None else ""
        print(
            f"  part {part} round {rnd} {tool:<8} {r.wall_s:7.1f} s = {r.rate:7.1f} samples/s; {r.samples} samples; {r.cpu_s:.1f} CPU s{kept}",
            flush=True,
        )
        out.append(r)
        if not ctx["args"].keep:
            shutil.rmtree(ctx["session"].work / f"{tool}-{rnd}", ignore_errors=True)
    return out


def _ratio(results: list[Result], tool: str, base: str) -> str:
    a, b = med(r.rate for r in results if r.tool == tool), med(r.rate for r in results if r.tool == base)
    return f"{a / b:.3f}x" if a and b else "-"


def report(results: list[Result], meta: dict) -> str:
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']} (shared: other load is what other work used meanwhile); load average before: {meta['load_before']}; code: {meta['revision']}",
        f"- input: img2dataset {meta['i2d']}'s own output, {meta['shards']} shards x {meta['per_shard']} samples, "
        f"{meta['shard_mb']:.1f} MB (tars, parquets, stats); the download path fetches the same {meta['samples']} pool images "
        f"({meta['pool_mb']:.1f} MB) from a loopback server; {meta['workers']} workers; resize in part b: border {meta['image_size']} px",
        "",
    ]
    lines += table(
        ["part", "tool", "round", "wall s", "samples", "samples/s", "input MB/s", "CPU s", "samples with the input's bytes", "other load, cores"],
        [[r.part, r.tool, r.round, f"{r.wall_s:.2f}", r.samples, f"{r.rate:.1f}", f"{r.in_bytes / 1e6 / r.wall_s:.1f}",
          f"{r.cpu_s:.1f}", "-" if r.kept is None else r.kept, f"{r.other_cpu_s / r.wall_s:.2f}"] for r in results],
        align="llrrrrrrrr",
    )  # fmt: skip
    lines += ["", "Median over rounds:", ""]
    by_tool = {tool: [r for r in results if r.tool == tool] for tool in LABELS}
    lines += table(
        ["tool", "runs", "wall s", "samples/s"],
        [[LABELS[tool], len(rs), f"{med(r.wall_s for r in rs):.2f}", f"{med(r.rate for r in rs):.1f}"]
         for tool, rs in by_tool.items() if rs],
    )  # fmt: skip
    lines += [
        "",
        f"- part a: shardsmith ingest -> release without re-encoding at {_ratio(results, 'keep', 'cp')} the samples/s of `cp -r` + `sync` of the same bytes",
        f"- part b: ingest -> validate with resize -> release at {_ratio(results, 'ingest', 'download')} the samples/s of download -> validate -> release of the same images",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/bench_byo.py",
        description=__doc__.split("\n", 1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--shards", type=int, default=10, help="img2dataset shards to ingest")
    p.add_argument(
        "--per-shard",
        type=int,
        default=1000,
        help="samples per shard (img2dataset number_sample_per_shard; the download path's rows_per_shard)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of bench_validate.py's image pool")
    p.add_argument("--image-size", type=int, default=224, help="part b's resize target (border mode)")
    add_round_flags(p, "byo", repeats=2, quiet_wait=60.0)
    add_tool_flags(p, rows_per_shard=None)  # img2dataset's threads: when it makes the shards
    p.add_argument(
        "--tools", default="cp,keep,ingest,download", help="comma-separated subset of cp,keep,ingest,download"
    )
    args = p.parse_args(argv)
    args.tools = {t.strip() for t in args.tools.split(",") if t.strip()}
    if not args.tools or args.tools - set(LABELS):
        p.error(f"--tools: choose from {','.join(LABELS)}")
    if min(args.shards, args.per_shard, args.repeats) < 1:
        p.error("--shards, --per-shard and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pool_dir, sizes = ensure_unique_pool(args.shards * args.per_shard, args.seed)
    results: list[Result] = []
    with Session("byo", args.keep) as s:
        loop = serve(s, pool_dir, prefect=True)
        manifest = s.work / "manifest.parquet"
        write_manifest(manifest, [f"{loop.base_url}/img/{name}" for name in sizes])
        shards = ensure_i2d_output(s.children, args, manifest, loop.watch["server"])
        samples = json.loads((shards / ".complete").read_text())["samples"]
        ctx = {
            "args": args, "session": s, "api": loop.api, "manifest": manifest, "watch": loop.watch,
            "shards": shards, "samples": samples, "shard_bytes": folder_bytes(shards), "pool_bytes": sum(sizes.values()),
        }  # fmt: skip
        for rnd in range(1, args.repeats + 1):
            for part in PARTS:
                results += run_round(ctx, part, rnd)
    meta = {
        "command": command("bench_byo.py", argv),
        "date": now(),
        "machine": machine(),
        "load_before": s.load_before,
        "revision": revision(),
        "i2d": I2D_REQUIREMENT.split("==")[-1],
        "shards": args.shards,
        "per_shard": args.per_shard,
        "samples": samples,
        "shard_mb": ctx["shard_bytes"] / 1e6,
        "pool_mb": ctx["pool_bytes"] / 1e6,
        "workers": args.workers,
        "image_size": args.image_size,
    }
    emit(report(results, meta), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
