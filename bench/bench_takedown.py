"""Takedown benchmark: a 100,000-entry takedown list applied to a 1,000,000-row release, beside reading its ledgers alone and a plain key lookup.

The corpus (made once under ``.bench/takedown/``, nothing downloaded): ``--rows`` validated rows
in ledgers of ``--per-ledger`` rows, as the validation phase writes them (every column of
``LEDGER_SCHEMA``: keys, URLs over 200,000 hosts on 20,000 sites, the stored image's sha256,
the pixels' sha256, a 64-bit perceptual hash, byte ranges and three members per sample), and
the download ledgers beside them (the sha256 of the bytes as fetched). The list mixes the
kinds, a fifth each: URLs, domains, sample keys, sha256 digests (of the fetched bytes, the
stored image and the pixels) and perceptual hashes (matching at ``phash_distance`` 4); about
half of each kind names something in the release (a tenth of the domains), the rest nothing;
about 5% of the rows match.

Each measurement is a fresh child process (its peak RSS is ``ru_maxrss``; CPU is the
process's, every thread), ``--repeats`` rounds, tools in turn:

- ``apply, first``: ``tasks.stages.upkeep.apply_upkeep`` as the reshard runs it, the list read
  and parsed from its file, with no overlay stored yet: every touched ledger rewritten;
- ``apply, again``: the same with the overlays stored (a night with an unchanged list);
- ``read ledgers``: the columns that apply reads, read alone (the floor of any way to do it);
- ``is_in keys``: the key column of every ledger read and looked up in the list's 100,000
  values with one ``pyarrow.compute.is_in`` (what a key-only takedown would cost).

    .venv/bin/python bench/bench_takedown.py [--rows 1000000] [--entries 100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from harness.procs import REPO, peak_rss_mb, process_cpu, run_json
from harness.report import alternated, command, emit, fmt, machine, med, now, revision, table

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BENCH_DIR = REPO / ".bench" / "takedown"
DATASET = "bench"
TOOLS = ("apply, first", "apply, again", "read ledgers", "is_in keys")
TARGET_S, TARGET_MB = 60.0, 1024.0


def _hex(rng, n: int) -> list[str]:
    """``n`` random sha256-like hex digests."""
    blob = rng.bytes(32 * n).hex()
    return [blob[64 * i : 64 * i + 64] for i in range(n)]


def make_corpus(folder: Path, rows: int, per_ledger: int, entries: int) -> None:
    """The ledgers and the list (once per size; a marker file says it is complete)."""
    import numpy as np
    import pyarrow as pa

    from tasks.formats.ledger import LEDGER_SCHEMA, MEMBER_TYPE, write_parquet
    from tasks.formats.storage import Storage

    done = folder / "complete"
    if done.exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    storage = Storage(str(folder / "store"))
    rng = np.random.default_rng(2026)
    picked: dict[str, list[str]] = {k: [] for k in ("url", "domain", "key", "sha256", "phash")}
    share = entries // 5
    real = share // 2  # of each kind, entries naming something in the release
    take = max(5, rows // real)
    for j, start in enumerate(range(0, rows, per_ledger)):
        n = min(per_ledger, rows - start)
        idx = np.arange(start, start + n)
        hosts = rng.integers(0, 200_000, n)
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
        members = pa.ListArray.from_arrays(
            pa.array(np.arange(0, 3 * n + 1, 3, dtype=np.int32)),
            pa.StructArray.from_arrays(
                [names, pa.array(member_offsets, pa.int64()), pa.array(member_sizes, pa.int64())],
                fields=list(MEMBER_TYPE),
            ),
        )
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
        # Kind c names rows start + c, start + c + take, ...: each kind its own rows.
        for c, kind in enumerate(picked):
            for k in range(c, n, take):
                i = int(idx[k])
                if kind == "url" and len(picked["url"]) < real:
                    picked["url"].append(urls[k])
                elif kind == "domain" and len(picked["domain"]) < real // 10:
                    # a site holds rows / 20,000 rows: fewer domains, each removing several rows
                    picked["domain"].append(f"domain:site{int(hosts[k]) % 20_000}.com")
                elif kind == "key" and len(picked["key"]) < real:
                    picked["key"].append(f"key:{keys[k]}")
                elif kind == "sha256" and len(picked["sha256"]) < real:
                    picked["sha256"].append(f"sha256:{(fetched, stored, pixels)[i % 3][k]}")
                elif kind == "phash" and len(picked["phash"]) < real:
                    flip = rng.choice(64, size=int(rng.integers(0, 5)), replace=False)
                    near = int(phash[k]) ^ int(sum(1 << int(b) for b in flip))
                    picked["phash"].append(f"phash:{near:016x}")
    # The other half of each kind names nothing in the release.
    noise = {
        "url": [f"https://elsewhere{i}.example.net/p/{i}.jpg" for i in range(share)],
        "domain": [f"domain:gone{i}.example.org" for i in range(share)],
        "key": [f"key:s-9{i:09d}" for i in range(share)],
        "sha256": [f"sha256:{h}" for h in _hex(rng, share)],
        "phash": [f"phash:{int(h):016x}" for h in rng.integers(0, 2**63, share, dtype=np.int64)],
    }
    lines = ["# synthetic takedown list (bench/bench_takedown.py)"]
    for kind, real_entries in picked.items():
        lines += real_entries + noise[kind][: share - len(real_entries)]
    (folder / "lists").mkdir(parents=True, exist_ok=True)
    (folder / "lists" / "legal.txt").write_text("\n".join(lines) + "\n")
    done.write_text(json.dumps({"rows": rows, "entries": len(lines) - 1}))


def _ledgers(folder: Path) -> tuple[list[str], list[str]]:
    store = folder / "store"
    validated = sorted(str(p.relative_to(store)) for p in (store / DATASET / "validate").rglob("*.ledger.parquet"))
    downloads = sorted(str(p.relative_to(store)) for p in (store / DATASET / "download").rglob("*.ledger.parquet"))
    return validated, downloads


def child(tool: str, folder: Path) -> dict:
    """One measurement, in this (fresh) process; its figures as a dict."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tasks.formats.ledger import read_ledger_with
    from tasks.formats.recipe_upkeep import TakedownList
    from tasks.formats.storage import Storage
    from tasks.formats.takedown import read_lists
    from tasks.stages.upkeep import apply_upkeep

    storage = Storage(str(folder / "store"))
    validated, downloads = _ledgers(folder)
    if tool == "apply, first":
        shutil.rmtree(folder / "store" / DATASET / "upkeep", ignore_errors=True)
    base_mb = peak_rss_mb()
    cpu0, t0 = process_cpu(), time.perf_counter()
    out: dict = {}
    if tool.startswith("apply"):
        lists = read_lists([TakedownList(path=str(folder / "lists" / "legal.txt"), name="legal")])
        done = apply_upkeep(
            storage,
            DATASET,
            [v.replace(".ledger.parquet", ".tar") for v in validated],
            validated,
            lists=lists,
            downloads=downloads,
        )
        out = {"removed": done.removed.num_rows, "overlays": done.overlays, "entries": len(lists[0].entries)}
    elif tool == "read ledgers":
        rows = 0
        for led in validated:
            rows += read_ledger_with(
                storage, led, ["key", "source", "row", "status"], ["url", "sha256", "pixel_sha256", "phash"]
            ).num_rows
            read_ledger_with(storage, led, ["key", "source", "row", "status"], ["video"])
        for led in downloads:
            read_ledger_with(storage, led, ["key", "source", "row", "status"], ["sha256"])
        out = {"rows": rows}
    else:  # is_in keys
        text = (folder / "lists" / "legal.txt").read_text().splitlines()[1:]
        values = pa.array([line if line.startswith("http") else line.partition(":")[2] for line in text])
        hits = 0
        for led in validated:
            keys = read_ledger_with(storage, led, ["key"], []).column("key")
            hits += pc.sum(pc.is_in(keys, value_set=values)).as_py() or 0
        out = {"removed": hits}
    out |= {
        "seconds": time.perf_counter() - t0,
        "cpu_s": process_cpu() - cpu0,
        "peak_mb": peak_rss_mb(),
        "base_mb": base_mb,
    }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the release")
    ap.add_argument("--per-ledger", type=int, default=10_000, help="rows per validated shard's ledger")
    ap.add_argument("--entries", type=int, default=100_000, help="entries of the takedown list")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each runs every measurement once, in turn")
    ap.add_argument("--markdown", type=Path, help="also write the report (markdown) to this file")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return

    folder = BENCH_DIR / f"{args.rows}-{args.per_ledger}-{args.entries}"
    t = time.perf_counter()
    make_corpus(folder, args.rows, args.per_ledger, args.entries)
    print(f"corpus: {folder} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
    figures: dict[str, list[dict]] = {tool: [] for tool in TOOLS}
    # Round 1 runs TOOLS in order, so "again" finds the overlays of a "first" from then on.
    for rnd, tool in alternated(TOOLS, args.repeats):
        got = run_json([sys.executable, __file__, "--child", tool, str(folder)])
        figures[tool].append(got)
        print(f"round {rnd}: {tool}: {got['seconds']:.2f} s, {got['peak_mb']:.0f} MB", file=sys.stderr)

    floor = med(f["seconds"] for f in figures["read ledgers"])
    rows = []
    for tool in TOOLS:
        got = figures[tool]
        wall = med(f["seconds"] for f in got)
        rows.append(
            [
                tool,
                fmt(wall, ".2f"),
                fmt(med(f["cpu_s"] for f in got), ".2f"),
                fmt(max(f["peak_mb"] for f in got), ".0f"),
                fmt(med(f["base_mb"] for f in got), ".0f"),
                got[0].get("removed", "-"),
                got[0].get("overlays", "-"),
                fmt(wall / floor if wall and floor else None, ".2f"),
            ]
        )
    first = figures["apply, first"]
    worst_s, worst_mb = max(f["seconds"] for f in first), max(f["peak_mb"] for f in first)
    verdict = "meets" if worst_s < TARGET_S and worst_mb < TARGET_MB else "MISSES"
    lines = [
        f"# takedown benchmark ({now()}, {revision()})",
        "",
        f"- Machine: {machine(memory=True)}. Command: `{command('bench_takedown.py', argv)}`.",
        f"- Release: {args.rows:,} rows in ledgers of {args.per_ledger:,}; list: {first[0]['entries']:,} entries.",
        "",
        *table(
            [
                "measurement",
                "wall s",
                "CPU s",
                "peak RSS MB",
                "RSS after imports MB",
                "rows removed",
                "overlays written",
                "/ read ledgers",
            ],
            rows,
        ),
        "",
        f"Slowest first apply {worst_s:.1f} s, peak {worst_mb:.0f} MB: {verdict} the target "
        f"(under {TARGET_S:.0f} s and {TARGET_MB:.0f} MB on {os.cpu_count()} cores).",
    ]
    emit("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()
