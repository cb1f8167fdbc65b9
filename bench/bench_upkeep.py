"""Upkeep, issue 40 (``--stage``): each upkeep step of a release beside the plain work it must stay close to.

``takedown``: a 100,000-entry list applied to a 1,000,000-row release beside reading its ledgers alone (under 60 s, 1 GB).
``recheck``: released rows checked with conditional requests beside downloading them again (>= 2x rows/s).
``retry``: the night after an outage fetching again what failed, beside fetching those rows alone (within 1.5x).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from harness.photos import ensure_pool, write_manifest
from harness.procs import BENCH_DIR, REPO, Session, measured, run_child, timed, tree_cpu
from harness.report import emit, med, parse, parser, per_1k, rounds, summary
from harness.servers import child_env, prefect_env, start_image_server, start_prefect_server
from harness.tools import SHARDSMITH, write_recipe
from harness.tools import summary as run_summary

DATASET = "bench"
TAKEDOWN = ("apply, first", "apply, again", "read ledgers", "is_in keys")
RECHECK = ("recheck, 304", "recheck, no validators", "download")
RETRY = ("retry", "alone", "noop")
NIGHT1 = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
ROWS = {"takedown": 1_000_000, "recheck": 10_000, "retry": 100_000}


def ledgers(store: Path, phase: str) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in (store / DATASET / phase).rglob("*.ledger.parquet"))


# ------------------------------------------------------------------------------ takedown


def _hex(rng, n: int) -> list[str]:
    blob = rng.bytes(32 * n).hex()
    return [blob[64 * i : 64 * i + 64] for i in range(n)]


def make_corpus(folder: Path, rows: int, per_ledger: int, entries: int) -> None:
    """The release's validate and download ledgers and the list, half of whose entries name a released row (made once)."""
    import numpy as np
    import pyarrow as pa

    from tasks.formats.ledger import LEDGER_SCHEMA, MEMBER_TYPE, write_parquet
    from tasks.formats.storage import Storage

    if (folder / "complete").exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    storage, rng = Storage(str(folder / "store")), np.random.default_rng(2026)
    picked: dict[str, list[str]] = {k: [] for k in ("url", "domain", "key", "sha256", "phash")}
    share = entries // 5
    real = share // 2  # of each kind, entries naming something in the release
    take = max(5, rows // real)
    for j, start in enumerate(range(0, rows, per_ledger)):
        n = min(per_ledger, rows - start)
        idx, hosts = np.arange(start, start + n), rng.integers(0, 200_000, n)
        keys = [f"s-{i:09d}" for i in idx]
        urls = [f"https://img{h}.site{h % 20_000}.com/photos/{i}.jpg" for h, i in zip(hosts.tolist(), idx.tolist())]
        stored, pixels, fetched = _hex(rng, n), _hex(rng, n), _hex(rng, n)
        phash = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) * np.uint64(2) + rng.integers(
            0, 2, n
        ).astype(np.uint64)
        sizes = rng.integers(20_000, 200_000, n)
        offsets = np.cumsum(np.concatenate([[0], sizes[:-1] + 2048]))
        member_offsets = np.stack([offsets + 512, offsets + 1024 + sizes, offsets + 1536 + sizes]).T.ravel()
        member_sizes = np.stack([sizes, np.full(n, 300), np.full(n, 40)]).T.ravel()
        names = pa.array([f"{k}.{ext}" for k in keys for ext in ("jpg", "json", "txt")], pa.string())
        struct = pa.StructArray.from_arrays(
            [names, pa.array(member_offsets, pa.int64()), pa.array(member_sizes, pa.int64())], fields=list(MEMBER_TYPE)
        )
        members = pa.ListArray.from_arrays(pa.array(np.arange(0, 3 * n + 1, 3, dtype=np.int32)), struct)
        columns = {
            "key": pa.array(keys),
            "source": pa.array(["s"] * n),
            "row": pa.array(idx, pa.int64()),
            "status": pa.array(["ok"] * n),
            "bytes": pa.array(sizes, pa.int64()),
            "sha256": pa.array(stored),
            "offset": pa.array(offsets, pa.int64()),
            "length": pa.array(sizes + 2048, pa.int64()),
            "members": members,
            "url": pa.array(urls),
            "format": pa.array(["jpeg"] * n),
            "license": pa.array(["CC-BY-4.0"] * n),
            "width": pa.array(rng.integers(256, 1024, n), pa.int32()),
            "height": pa.array(rng.integers(256, 1024, n), pa.int32()),
            "caption_chars": pa.array(rng.integers(10, 200, n), pa.int32()),
            "pixel_sha256": pa.array(pixels),
            "phash": pa.array(phash, pa.uint64()),
            "origin": pa.array([f"manifest.parquet:{i}" for i in idx]),
        }
        table = pa.table(
            {f.name: columns.get(f.name, pa.nulls(n, f.type)) for f in LEDGER_SCHEMA}, schema=LEDGER_SCHEMA
        )
        write_parquet(storage, f"{DATASET}/validate/s/{j:06d}-v.ledger.parquet", table)
        download = table.set_column(table.column_names.index("sha256"), "sha256", pa.array(fetched))
        write_parquet(storage, f"{DATASET}/download/s/{j:06d}-d.ledger.parquet", download)
        for c, kind in enumerate(picked):  # kind c names rows start + c, start + c + take, ...: each kind its own rows
            for k in range(c, n, take):
                if kind == "domain" and len(picked[kind]) < real // 10:  # fewer domains, each removing several rows
                    picked[kind].append(f"domain:site{int(hosts[k]) % 20_000}.com")
                elif kind == "phash" and len(picked[kind]) < real:
                    flip = rng.choice(64, size=int(rng.integers(0, 5)), replace=False)
                    picked[kind].append(f"phash:{int(phash[k]) ^ int(sum(1 << int(b) for b in flip)):016x}")
                elif kind in ("url", "key", "sha256") and len(picked[kind]) < real:
                    sha = (fetched, stored, pixels)[int(idx[k]) % 3][k]
                    picked[kind].append({"url": urls[k], "key": f"key:{keys[k]}", "sha256": f"sha256:{sha}"}[kind])
    noise = {  # the other half of each kind names nothing in the release
        "url": [f"https://elsewhere{i}.example.net/p/{i}.jpg" for i in range(share)],
        "domain": [f"domain:gone{i}.example.org" for i in range(share)],
        "key": [f"key:s-9{i:09d}" for i in range(share)],
        "sha256": [f"sha256:{h}" for h in _hex(rng, share)],
        "phash": [f"phash:{int(h):016x}" for h in rng.integers(0, 2**63, share, dtype=np.int64)],
    }
    lines = ["# synthetic takedown list (bench/bench_upkeep.py)"]
    for kind, named in picked.items():
        lines += named + noise[kind][: share - len(named)]
    (folder / "lists").mkdir(parents=True, exist_ok=True)
    (folder / "lists" / "legal.txt").write_text("\n".join(lines) + "\n")
    (folder / "complete").write_text(json.dumps({"rows": rows, "entries": len(lines) - 1}))


def takedown_child(tool: str, folder: Path) -> dict:
    import pyarrow as pa
    import pyarrow.compute as pc

    from tasks.formats.ledger import read_ledger_with
    from tasks.formats.recipe_upkeep import TakedownList
    from tasks.formats.storage import Storage
    from tasks.formats.takedown import read_lists
    from tasks.stages.upkeep import apply_upkeep

    storage, store = Storage(str(folder / "store")), folder / "store"
    validated, downloads = ledgers(store, "validate"), ledgers(store, "download")
    if tool == "apply, first":
        shutil.rmtree(store / DATASET / "upkeep", ignore_errors=True)

    def work() -> dict:
        if tool.startswith("apply"):
            lists = read_lists([TakedownList(path=str(folder / "lists" / "legal.txt"), name="legal")])
            tars = [v.replace(".ledger.parquet", ".tar") for v in validated]
            done = apply_upkeep(storage, DATASET, tars, validated, lists=lists, downloads=downloads)
            return {"removed": done.removed.num_rows, "overlays": done.overlays, "entries": len(lists[0].entries)}
        if tool == "read ledgers":  # the columns apply reads: the floor
            cols = ["key", "source", "row", "status"]
            for led in validated:
                read_ledger_with(storage, led, cols, ["url", "sha256", "pixel_sha256", "phash"])
                read_ledger_with(storage, led, cols, ["video"])
            for led in downloads:
                read_ledger_with(storage, led, cols, ["sha256"])
            return {}
        text = (folder / "lists" / "legal.txt").read_text().splitlines()[1:]  # a key-only takedown
        values = pa.array([line if line.startswith("http") else line.partition(":")[2] for line in text])
        hits = sum(
            pc.sum(pc.is_in(read_ledger_with(storage, led, ["key"], []).column("key"), value_set=values)).as_py() or 0
            for led in validated
        )
        return {"removed": hits}

    return measured(work)


def takedown(args) -> list[str]:
    folder = BENCH_DIR / "takedown" / f"{args.rows}-{args.per_ledger}-{args.entries}"
    make_corpus(folder, args.rows, args.per_ledger, args.entries)
    # Round 1 runs the tools in order, so "again" finds the overlays of a "first" from then on.
    runs = rounds(
        TAKEDOWN, args.repeats, lambda tool, _: {"tool": tool} | run_child(__file__, tool, folder), args.quiet_wait
    )
    floor, first = (
        med(r["seconds"] for r in runs if r["tool"] == "read ledgers"),
        [r for r in runs if r["tool"] == "apply, first"],
    )
    columns = {
        "wall s": ("seconds", ".2f"),
        "CPU s": ("cpu", ".2f"),
        "peak RSS MB": ("peak_mb", ".0f"),
        "RSS after imports MB": ("base_mb", ".0f"),
        "rows removed": ("removed", ".0f"),
        "overlays written": ("overlays", ".0f"),
        "/ read ledgers": (lambda r: r["seconds"] / floor, ".2f"),
    }
    worst_s, worst_mb = max(r["seconds"] for r in first), max(r["peak_mb"] for r in first)
    return [
        f"Release: {args.rows:,} rows in ledgers of {args.per_ledger:,}; list: {first[0]['entries']:,} entries; medians of {args.repeats} rounds, a fresh process each",
        "",
        *summary(runs, columns),
        "",
        f"- slowest first apply {worst_s:.1f} s, peak {worst_mb:.0f} MB: {'meets' if worst_s < 60 and worst_mb < 1024 else 'MISSES'} "
        "the target (under 60 s and 1024 MB)",
    ]


# ------------------------------------------------------------------------------- recheck


def download(recipe_path: Path, store: Path) -> int:
    """Every chunk of the manifest downloaded into ``store`` (fresh), chunk after chunk; ok rows."""
    from tasks.formats.ledger import read_ledger
    from tasks.formats.manifests import plan_source
    from tasks.formats.recipe import load_recipe
    from tasks.formats.storage import Storage
    from tasks.stages.download import download_config_hash, download_shard, shard_paths

    r = load_recipe(recipe_path, {"storage": str(store)})
    shutil.rmtree(store, ignore_errors=True)
    storage, ok = Storage(str(store)), 0
    for ref in plan_source(r.sources[0], storage, DATASET).chunks:
        tar, ledger = shard_paths(DATASET, ref, download_config_hash(r))
        download_shard(ref, storage, r.download, tar, ledger)
        ok += read_ledger(storage, ledger, ["status"]).column("status").to_pylist().count("ok")
    return ok


def release(store: Path, nv: Path) -> int:
    """Release every ok row (the files a recheck reads), and a copy of the store whose ledgers hold no ETag or Last-Modified."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tasks.formats.ledger import read_ledger, write_parquet
    from tasks.formats.storage import Storage
    from tasks.stages.release import commit_index, set_latest

    storage = Storage(str(store))
    ok = pa.concat_tables(
        [read_ledger(storage, rel, ["key", "source", "row", "status"]) for rel in ledgers(store, "download")]
    )
    ok = ok.filter(pc.equal(ok.column("status"), "ok")).drop_columns(["status"])
    n, base = ok.num_rows, f"{DATASET}/releases/v0001"
    for name, value, kind in (
        ("offset", 0, pa.int64()),
        ("length", 0, pa.int64()),
        ("shard", "shard-000000.tar", pa.string()),
    ):
        ok = ok.append_column(name, pa.array([value] * n, kind))
    write_parquet(storage, f"{base}/samples.parquet", ok)
    commit_index(storage, f"{base}/index.json", {"version": "v0001", "kind": "pretraining"})
    set_latest(storage, DATASET, "v0001")
    shutil.copytree(store, nv, ignore=shutil.ignore_patterns("*.tar"))
    for rel in ledgers(nv, "download"):
        t = read_ledger(Storage(str(nv)), rel)
        for name in ("etag", "last_modified"):
            t = t.set_column(t.column_names.index(name), name, pa.nulls(t.num_rows, pa.string()))
        write_parquet(Storage(str(nv)), rel, t)
    return n


def recheck_child(tool: str, work: Path) -> dict:
    from tasks.formats.recipe import load_recipe
    from tasks.formats.storage import Storage
    from tasks.stages.recheck import recheck

    if tool == "download":
        return measured(lambda: {"rows": (n := download(work / "recipe.yaml", work / "again")), "outcomes": f"{n} ok"})
    store = work / ("store" if tool == "recheck, 304" else "store-nv")
    shutil.rmtree(store / DATASET / "recheck", ignore_errors=True)  # every row due, as on the first night
    r, when = load_recipe(work / "recipe.yaml", {"storage": str(store)}), datetime.now(UTC) + timedelta(days=400)

    def check() -> dict:
        s = recheck(Storage(str(store)), r, ledgers(store, "download"), when)
        return {
            "rows": s.checked,
            "bytes_read": s.bytes_read,
            "outcomes": ", ".join(f"{n} {k}" for k, n in s.counts.items()),
        }

    return measured(check)


def recheck(args, s: Session) -> list[str]:
    import numpy as np

    pool, sizes = ensure_pool(args.pool, args.seed)
    server, base_url = start_image_server(s.children, pool)
    names = sorted(sizes)
    picks = np.random.default_rng([args.seed, 1]).integers(0, len(names), size=args.rows)
    write_manifest(s.work / "manifest.parquet", [f"{base_url}/img/{names[k]}?u={i}" for i, k in enumerate(picks)])
    write_recipe(
        s.work / "recipe.yaml",
        s.work / "store",
        s.work / "manifest.parquet",
        args.rows_per_shard,
        2,
        download={"recheck": {"every_days": 30, "fraction": 1}},
    )
    env = child_env(PYTHONPATH=str(REPO))
    run_child(__file__, "download", s.work, env=env)
    shutil.move(s.work / "again", s.work / "store")
    released = release(s.work / "store", s.work / "store-nv")

    def run(tool: str, _rnd: int) -> dict:
        cpu0 = tree_cpu(server.pid)
        got = run_child(__file__, tool, s.work, env=env)
        return got | {"tool": tool, "rows/s": got["rows"] / got["seconds"], "server_cpu": tree_cpu(server.pid) - cpu0}

    runs = rounds(RECHECK, args.repeats, run, args.quiet_wait)
    rate = {t: med(r["rows/s"] for r in runs if r["tool"] == t) for t in RECHECK}
    columns = {
        "wall s": ("seconds", ".1f"),
        "rows/s": ("rows/s", ".0f"),
        "CPU s / 1k rows": (lambda r: per_1k(r["cpu"], r["rows"]), ".2f"),
        "server CPU s / 1k rows": (lambda r: per_1k(r["server_cpu"], r["rows"]), ".2f"),
        "body bytes read": ("bytes_read", ".0f"),
        "outcomes": ("outcomes", ""),
    }
    speedup, read_304 = (
        rate["recheck, 304"] / rate["download"],
        max(r["bytes_read"] for r in runs if r["tool"] == "recheck, 304"),
    )
    return [
        f"{args.rows:,} distinct URLs over {args.pool} images ({sum(sizes[names[k]] for k in picks) / 1e6:.0f} MB behind them), {released:,} released; "
        f"{args.rows_per_shard} rows per chunk; the recipe's download defaults for every measurement; medians of {args.repeats} rounds",
        "",
        *summary(runs, columns),
        "",
        f"- recheck with conditional requests / download: **{speedup:.2f}x** rows/s; {read_304} body bytes read on 304 answers; "
        f"target (>= 2x, no body read on 304): {'meets' if speedup >= 2 and read_304 == 0 else 'MISSES'}",
        f"- recheck without validators (ranged GET, body hashed) / download: {rate['recheck, no validators'] / rate['download']:.2f}x rows/s",
    ]


# --------------------------------------------------------------------------------- retry


def small_jpeg(i: int) -> bytes:
    """Picture ``i`` of the retry pool: a smooth colour field with grain, 128..320 px, as a JPEG (~10 KB)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([40, i])
    w, h = int(rng.integers(128, 321)), int(rng.integers(128, 321))
    base = Image.fromarray(rng.integers(0, 256, size=(3, 4, 3), dtype=np.uint8)).resize(
        (w, h), Image.Resampling.BICUBIC
    )
    arr = np.asarray(base, np.int16) + rng.integers(-6, 7, size=(h, w, 1), dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=85)
    return out.getvalue()


def retry(args, s: Session) -> list[str]:
    from tasks.demo.webserver import ImageWeb

    every = max(1, round(1 / args.transient))
    flaky = [i for i in range(args.rows) if i % every == every // 2]
    # Validation deduplicates: a picture per row there; the download phase reuses a small pool.
    names = [f"r{i:06d}.jpg" for i in range(args.rows if args.phase == "validate" else max(len(flaky), 200))]
    pool = BENCH_DIR / "retry" / "pool-v2"  # made once, grown when a later invocation wants more
    pool.mkdir(parents=True, exist_ok=True)
    if missing := [i for i, name in enumerate(names) if not (pool / name).exists()]:
        print(f"rendering {len(missing)} pictures into {pool} (once; reused by later runs) ...", flush=True)
    for i in missing:
        (pool / names[i]).write_bytes(small_jpeg(i))
    per_shard, web = -(-args.rows // args.shards), ImageWeb(root=pool).start()
    print("starting a Prefect server (not timed) ...", flush=True)
    (s.work / "prefect-home").mkdir()
    proc, api = start_prefect_server(s.children, s.work / "prefect-home", s.work / "prefect-server.log")
    flaky_set, urls, k = set(flaky), [], 0
    for i in range(args.rows):
        if i in flaky_set:  # its own path: its own first 500
            urls.append(web.url(f"/flaky/1/{names[i] if len(names) >= args.rows else names[k]}"))
            k += 1
        else:
            urls.append(web.url(f"/img/{names[i % len(names)]}?u={i}"))
    write_manifest(s.work / "manifest.parquet", urls)
    write_manifest(s.work / "alone.parquet", [urls[i] for i in flaky])

    def shardsmith(work: Path, manifest: str, when: datetime, *more: str):
        r = write_recipe(
            work / "r.yaml",
            work / "store",
            s.work / manifest,
            per_shard,
            args.workers,
            download={"retries": 0},
            validate={"image": {"min_side": 32}},
            gates={"download": {"min_success_rate": 0.5}},
        )
        cmd = [str(SHARDSMITH), "run", str(r), "--phase", args.phase, "--json", *more]
        env = prefect_env(s.work / "prefect-home", api, SHARDSMITH_NOW=when.isoformat())
        return timed(s.children, cmd, env, REPO, work / "stderr.log", {"prefect": proc.pid})

    print(
        f"night 1 (untimed): {args.rows} rows in {args.shards} chunks, {len(flaky)} failing once; --phase {args.phase}",
        flush=True,
    )
    night1 = shardsmith(s.work / "night1", "manifest.parquet", NIGHT1)
    c = run_summary(night1.stdout)["download"]["counts"]
    if c["by_reason"].get("http_500") != len(flaky) or c["ok"] != args.rows - len(flaky):
        raise SystemExit(f"night 1 did not end with exactly the flaky rows failed (http_500): {c['by_reason']}")

    def run(tool: str, rnd: int) -> dict:
        work = s.work / f"{tool}-{rnd}"
        if tool != "alone":  # night 1's store as it was: committed files are never written again, so links do
            shutil.copytree(s.work / "night1" / "store", work / "store", copy_function=os.link)
        before = web.stats()
        when = NIGHT1 + (timedelta(hours=2) if tool == "noop" else timedelta(days=1))
        t = shardsmith(
            work,
            "alone.parquet" if tool == "alone" else "manifest.parquet",
            when,
            *(["--force"] if tool == "noop" else []),
        )
        asked = web.stats()["hits"] - before["hits"]  # each picture counted by path and by path with query
        fetched = sum(n for q, n in asked.items() if "?" not in q and q.startswith(("/img/", "/flaky/")))
        dl = run_summary(t.stdout)["download"]
        ok = {"retry": dl["rows_recovered"], "alone": dl["counts"]["ok"], "noop": dl["rows_retried"]}[tool]
        if ok != (0 if tool == "noop" else len(flaky)) or (tool != "alone" and fetched != ok):
            raise SystemExit(f"{tool}: {ok} rows ok or retried, {fetched} pictures asked for; {len(flaky)} flaky")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return {
            "tool": tool,
            "wall": t.wall_s,
            "phase": dl["seconds"],
            "cpu": t.cpu_s,
            "asked": fetched,
            "ok": ok,
            "rows": dl["counts"]["rows"],
        }

    runs = rounds(RETRY, args.repeats, run, args.quiet_wait)
    web.stop()
    wall, phase = ({t: med(r[k] for r in runs if r["tool"] == t) for t in RETRY} for k in ("wall", "phase"))
    columns = {
        "wall s": ("wall", ".1f"),
        "phase s": ("phase", ".1f"),
        "CPU s": ("cpu", ".1f"),
        "pictures asked for": ("asked", ".0f"),
        "rows recovered / ok": ("ok", ".0f"),
        "ledger rows": ("rows", ".0f"),
    }
    ratio = wall["retry"] / wall["alone"]
    return [
        f"{args.rows:,} rows in {args.shards} chunks, {len(flaky):,} of them failing once on night 1 (`http_500`, download.retries 0); "
        f"`--phase {args.phase}`, {args.workers} workers; night 1 took {night1.wall_s:.0f} s (untimed); medians of {args.repeats} rounds",
        "",
        *summary(runs, columns),
        "",
        f"- night 2 / the failed rows alone: **{ratio:.2f}x** wall, {phase['retry'] / phase['alone']:.2f}x the phase's own seconds; "
        f"{'within' if ratio <= 1.5 else 'over'} issue 40's 1.5x",
        f"- nothing due (`--force`): {wall['noop']:.1f} s wall; what retrying adds to it: {wall['retry'] - wall['noop']:.1f} s",
    ]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, repeats=3, quiet_wait=60.0, keep="STAGE")
    p.add_argument("--stage", choices=tuple(ROWS), default="takedown", help="what is measured (default takedown)")
    p.add_argument(
        "--rows", type=int, help="rows of the release (default: takedown 1000000, recheck 10000, retry 100000)"
    )
    p.add_argument(
        "--per-ledger", type=int, default=10_000, help="takedown: rows per validated shard's ledger (default 10000)"
    )
    p.add_argument("--entries", type=int, default=100_000, help="takedown: entries of the list (default 100000)")
    p.add_argument("--pool", type=int, default=400, help="recheck: distinct image files behind the URLs (default 400)")
    p.add_argument("--seed", type=int, default=0, help="recheck: seed of the image pool and the URL-to-image mapping")
    p.add_argument(
        "--rows-per-shard", type=int, default=1000, help="recheck: rows per chunk, one recheck task each (default 1000)"
    )
    p.add_argument("--shards", type=int, default=100, help="retry: chunks the rows are in (default 100)")
    p.add_argument(
        "--transient", type=float, default=0.02, help="retry: share of the rows failing once on night 1 (default 0.02)"
    )
    p.add_argument(
        "--phase", choices=("download", "validate"), default="download", help="retry: the phase every run runs to"
    )
    p.add_argument("--workers", type=int, default=2, help="retry: Dask workers of each run (default 2)")
    args = parse(p, argv)
    if args.child:  # a takedown or recheck measurement in this fresh process
        tool, folder = args.child[0], Path(args.child[1])
        print(json.dumps(takedown_child(tool, folder) if tool in TAKEDOWN else recheck_child(tool, folder)))
        return 0
    args.rows = args.rows or ROWS[args.stage]
    if args.rows < 1 or args.shards < 1 or not 0 < args.transient < 1:
        p.error("--rows and --shards must be at least 1, --transient between 0 and 1")
    if args.stage == "takedown":
        lines = takedown(args)
    else:
        with Session(args.stage, args.keep) as s:
            lines = recheck(args, s) if args.stage == "recheck" else retry(args, s)
    emit(f"Upkeep: {args.stage} (`bench_upkeep.py --stage {args.stage}`)", lines, argv, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
