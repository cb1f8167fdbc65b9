"""Download benchmark: shardsmith's download phase beside img2dataset on the same loopback URLs.

One invocation generates (or reuses) a pool of synthetic photos, serves them on loopback with
``python -m tasks.demo.webserver``, starts one Prefect server, and then runs, alternating, for
``--repeats`` rounds:

- ``shardsmith``: ``shardsmith run RECIPE --phase download --json`` (Dask LocalCluster);
- ``i2d-reencode``: img2dataset with ``--resize_mode no`` (it still decodes and re-encodes
  every image: more work than shardsmith does);
- ``i2d-raw``: img2dataset with ``--resize_mode no --disable_all_reencoding True`` (bytes
  stored as fetched: the same work as shardsmith's download phase).

img2dataset lives in its own venv (``.bench/img2dataset-venv``, made on first use), never in
the project's dependencies. Each run writes into a fresh folder, removed after it is measured.

CPU seconds are user+sys of the tool's whole process tree (``RUSAGE_CHILDREN`` deltas around
the run, which include waited-for grandchildren). The image server and the Prefect server are
long-lived and not counted there; their CPU during each run is read from /proc and shown
separately, since both take cores from the tool on a small machine. So is the CPU that other
work on the machine used meanwhile; before each run the script waits (``--quiet-wait``) for
that to settle, since a shared 2-core machine is the usual place this runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_PY = REPO / ".venv" / "bin" / "python"
SHARDSMITH = REPO / ".venv" / "bin" / "shardsmith"
PREFECT = REPO / ".venv" / "bin" / "prefect"
BENCH_DIR = REPO / ".bench"
I2D_VENV = BENCH_DIR / "img2dataset-venv"
# The version the figures in bench/RESULTS.md were taken with; it installs on Python 3.11 with
# no further pins. Pinned so that a new venv measures the same code.
I2D_REQUIREMENT = "img2dataset==1.47.0"
POOL_VERSION = 1  # bump when the generator changes, so a cached pool is made again
TOOLS = ("shardsmith", "i2d-reencode", "i2d-raw")
TOOL_LABELS = {
    "shardsmith": "shardsmith download phase",
    "i2d-reencode": "img2dataset resize_mode=no (decode + re-encode)",
    "i2d-raw": "img2dataset resize_mode=no, disable_all_reencoding (bytes as fetched)",
}
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


# ------------------------------------------------------------------------------------- corpus


def _render(seed: int, index: int) -> tuple[str, bytes]:
    """Image ``index`` of the pool: a smooth colour field, mid-frequency texture and grain.

    Texture and grain make the encoders work as they do on photos, so file sizes are
    realistic (JPEG ~1.5-2.5 bits per pixel); PNGs are posterised graphics, capped at 1000 px.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([seed, index])
    u = rng.random()
    fmt = "JPEG" if u < 0.8 else ("PNG" if u < 0.9 else "WEBP")
    long_side = int(rng.integers(200, 2001 if fmt != "PNG" else 1001))
    aspect = float(rng.choice([1.0, 1.25, 4 / 3, 3 / 2, 16 / 9]))
    w, h = long_side, max(1, round(long_side / aspect))
    if rng.random() < 0.3:
        w, h = h, w
    base = Image.fromarray(rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)).resize(
        (w, h), Image.Resampling.BICUBIC
    )
    tex = rng.normal(0, 1, size=(max(2, h // 6), max(2, w // 6), 3))
    tex = Image.fromarray(np.clip(128 + 40 * tex, 0, 255).astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.asarray(base, np.int16) + (np.asarray(tex, np.int16) - 128)
    grain = 4 if fmt != "PNG" else 1
    arr += rng.integers(-grain, grain + 1, size=(h, w, 1), dtype=np.int16)
    arr = np.clip(arr, 0, 255).astype(np.uint8)
    if fmt == "PNG":
        arr &= 0xF0
    out = io.BytesIO()
    img = Image.fromarray(arr)
    if fmt == "JPEG":
        img.save(out, "JPEG", quality=int(rng.integers(75, 93)))
        ext = "jpg"
    elif fmt == "WEBP":
        img.save(out, "WEBP", quality=int(rng.integers(70, 90)), method=2)
        ext = "webp"
    else:
        img.save(out, "PNG", compress_level=6)
        ext = "png"
    return f"p{index:04d}.{ext}", out.getvalue()


def ensure_pool(pool: int, seed: int) -> tuple[Path, dict[str, int]]:
    """The image pool folder and {name: bytes}; made once, reused while its stamp exists."""
    folder = BENCH_DIR / "download" / f"pool-v{POOL_VERSION}-s{seed}-n{pool}"
    stamp = folder / ".complete.json"  # a leading dot: the image server refuses to serve it
    if stamp.exists():
        return folder, json.loads(stamp.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    print(f"generating {pool} images into {folder} (once; reused by later runs) ...", flush=True)
    started = time.perf_counter()
    sizes: dict[str, int] = {}
    with ProcessPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as ex:
        for name, data in ex.map(_render, [seed] * pool, range(pool), chunksize=8):
            (folder / name).write_bytes(data)
            sizes[name] = len(data)
    stamp.write_text(json.dumps(sizes, sort_keys=True))
    total = sum(sizes.values())
    print(
        f"  {total / 1e6:.0f} MB, mean {total / pool / 1e3:.0f} KB, in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    return folder, sizes


def write_manifest(path: Path, base_url: str, sizes: dict[str, int], rows: int, seed: int) -> int:
    """A parquet of ``rows`` distinct URLs over the pool (``?u=ROW``); returns their total bytes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = sorted(sizes)
    picks = np.random.default_rng([seed, 1]).integers(0, len(names), size=rows)
    urls = [f"{base_url}/img/{names[k]}?u={i}" for i, k in enumerate(picks)]
    captions = [f"synthetic photo number {i}" for i in range(rows)]
    table = pa.table({"url": urls, "caption": captions, "license": ["cc-by-4.0"] * rows})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return int(sum(sizes[names[k]] for k in picks))


# ------------------------------------------------------------------------------- processes


class Children:
    """Long-lived and timed child processes, each in its own session so one kill ends its tree."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, grace: float = 10.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the tree (a worker that ignored SIGTERM) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)


def tree_cpu(pid: int) -> float:
    """User+sys seconds of a live process and its descendants, reaped children included."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def busy_cpu() -> float:
    """User+system CPU seconds of every process on the machine since boot (all cores).

    Interrupt and softirq time is left out: loopback traffic of our own runs lands there.
    """
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system


def wait_for_quiet(max_wait: float, threshold: float = 0.3, window: float = 3.0) -> float:
    """Wait until the machine's other work uses under ``threshold`` cores over ``window`` s.

    Between runs our own servers idle, so what is busy then is someone else's work. Gives up
    after ``max_wait`` s and returns the last load seen (in cores), which the report shows.
    """
    deadline = time.monotonic() + max_wait
    while True:
        b0 = busy_cpu()
        time.sleep(window)
        load = (busy_cpu() - b0) / window
        if load < threshold or time.monotonic() >= deadline:
            return load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    # Both tools only ever talk to loopback; urllib (img2dataset) would honour a proxy variable.
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


def start_image_server(children: Children, root: Path) -> tuple[subprocess.Popen, str]:
    proc = children.start(
        [str(VENV_PY), "-m", "tasks.demo.webserver", "--root", str(root), "--port", "0"],
        cwd=REPO,
        env=child_env(PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()
    if not line.startswith("serving "):
        raise SystemExit(f"image server did not start (said {line!r})")
    return proc, line.split(" ", 1)[1]


def start_prefect_server(children: Children, home: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = child_env(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_UI_ENABLED="false")
    with open(log, "wb") as fh:
        proc = children.start(
            [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            cwd=home,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    api = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"prefect server exited with {proc.returncode}; see {log}")
        with contextlib.suppress(OSError):
            with opener.open(api + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, api
        time.sleep(0.5)
    raise SystemExit(f"prefect server did not answer {api}/health within 180 s; see {log}")


def ensure_img2dataset() -> Path:
    """The img2dataset entry point in its own venv, made (and pip-installed) when missing."""
    exe = I2D_VENV / "bin" / "img2dataset"
    if exe.exists():
        return exe
    print(f"installing {I2D_REQUIREMENT} into {I2D_VENV} (once) ...", flush=True)
    subprocess.run(
        [sys.executable if sys.version_info[:2] == (3, 11) else "python3.11", "-m", "venv", str(I2D_VENV)], check=True
    )
    pip = [str(I2D_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, I2D_REQUIREMENT], check=True)
    return exe


# ------------------------------------------------------------------------------------ runs


@dataclass
class Run:
    tool: str
    round: int
    wall_s: float
    cpu_s: float
    ok: int
    rows: int
    bytes: int
    phase_s: float | None = None
    server_cpu_s: float = 0.0  # the image server, during the run
    prefect_cpu_s: float | None = None  # the Prefect server, during the run (shardsmith only)
    other_cpu_s: float = 0.0  # everything else on the machine during the run (other users' work)
    extra: dict = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.ok / self.wall_s

    @property
    def phase_rate(self) -> float | None:
        return self.ok / self.phase_s if self.phase_s else None

    @property
    def mb_s(self) -> float:
        return self.bytes / 1e6 / self.wall_s

    @property
    def cpu_per_1k(self) -> float:
        return 1000 * self.cpu_s / max(self.ok, 1)


def timed(
    children: Children, cmd: list[str], env: dict[str, str], cwd: Path, log: Path, watch: dict[str, int]
) -> tuple[float, float, dict[str, float], str]:
    """Run ``cmd`` to completion: (wall s, tree CPU s, CPU s of each watched pid, stdout).

    ``watched["other"]`` is the machine's busy CPU during the run less the tool's and the
    watched servers': work by processes that are not part of the benchmark.
    """
    before_watch = {k: tree_cpu(pid) for k, pid in watch.items()}
    busy0 = busy_cpu()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "wb") as err:
        proc = children.start(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err)
        try:
            out, _ = proc.communicate()
        finally:
            children.stop(proc)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    watched = {k: tree_cpu(pid) - before_watch[k] for k, pid in watch.items()}
    watched["other"] = max(0.0, busy_cpu() - busy0 - cpu - sum(watched.values()))
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{cmd[0]} exited with {proc.returncode}; stderr tail ({log}):\n{tail}")
    return wall, cpu, watched, out.decode(errors="replace")


def run_shardsmith(
    children: Children, args, rnd: int, manifest: Path, work: Path, api: str, home: Path, watch: dict[str, int]
) -> Run:
    out_dir = work / f"shardsmith-{rnd}"
    out_dir.mkdir(parents=True)
    recipe = out_dir / "recipe.yaml"
    recipe.write_text(
        "dataset: bench\n"
        "kind: pretraining\n"
        f"storage: {out_dir / 'store'}\n"
        "sources:\n"
        "  - name: bench\n"
        f"    manifest: {manifest}\n"
        f"    rows_per_shard: {args.rows_per_shard}\n"
        "download:\n"
        "  network:\n"
        '    allowed_networks: ["127.0.0.1/32"]\n'
        "    any_port: true\n"
        "execution:\n"
        "  cluster: local\n"
        f"  workers: {args.workers}\n"
    )
    env = child_env(PREFECT_API_URL=api, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    cmd = [str(SHARDSMITH), "run", str(recipe), "--phase", "download", "--json"]
    wall, cpu, watched, out = timed(children, cmd, env, REPO, out_dir / "stderr.log", watch)
    start = out.rfind("\n{\n")
    summary = json.loads(out[start + 1 :] if start >= 0 else out)["download"]
    c = summary["counts"]
    run = Run(
        "shardsmith",
        rnd,
        wall,
        cpu,
        c["ok"],
        c["rows"],
        c["bytes"],
        phase_s=summary["seconds"],
        server_cpu_s=watched.get("server", 0.0),
        prefect_cpu_s=watched.get("prefect"),
        other_cpu_s=watched["other"],
        extra={
            "by_reason": c["by_reason"],
            "shards": summary["shards"],
            "json_samples_per_s": summary["samples_per_s"],
        },
    )
    if c["ok"] != c["rows"]:
        print(f"  warning: shardsmith: {c['rows'] - c['ok']} rows not ok: {c['by_reason']}", flush=True)
    return run


def run_img2dataset(
    children: Children, args, tool: str, rnd: int, manifest: Path, sizes_by_url, work: Path, watch: dict[str, int]
) -> Run:
    import pyarrow.parquet as pq

    exe = I2D_VENV / "bin" / "img2dataset"
    out_dir = work / f"{tool}-{rnd}"
    out_dir.mkdir(parents=True)
    cmd = [
        str(exe), "--url_list", str(manifest), "--input_format", "parquet",
        "--url_col", "url", "--caption_col", "caption",
        "--output_format", "webdataset", "--output_folder", str(out_dir / "out"),
        "--processes_count", str(args.workers), "--thread_count", str(args.threads),
        "--number_sample_per_shard", str(args.rows_per_shard),
        "--resize_mode", "no", "--disable_all_reencoding", str(tool == "i2d-raw"),
        "--enable_wandb", "False", "--timeout", "20",
    ]  # fmt: skip
    env = child_env(WANDB_MODE="disabled", WANDB_SILENT="true", NO_ALBUMENTATIONS_UPDATE="1")
    wall, cpu, watched, _ = timed(children, cmd, env, out_dir, out_dir / "stderr.log", watch)
    ok = nbytes = n = 0
    starts, ends = [], []
    for stats in sorted((out_dir / "out").glob("*_stats.json")):
        s = json.loads(stats.read_text())
        starts.append(s["start_time"])
        ends.append(s["end_time"])
    for meta in sorted((out_dir / "out").glob("*.parquet")):
        t = pq.read_table(meta, columns=["url", "status"]).to_pydict()
        for url, status in zip(t["url"], t["status"]):
            n += 1
            if status == "success":
                ok += 1
                nbytes += sizes_by_url(url)
    phase = (max(ends) - min(starts)) if starts else None
    return Run(
        tool,
        rnd,
        wall,
        cpu,
        ok,
        n,
        nbytes,
        phase_s=phase,
        server_cpu_s=watched.get("server", 0.0),
        other_cpu_s=watched["other"],
    )


# --------------------------------------------------------------------------------- report


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def summarize(runs: list[Run], tools: list[str]) -> dict[str, dict]:
    out = {}
    for tool in tools:
        rs = [r for r in runs if r.tool == tool]
        if not rs:
            continue
        out[tool] = {
            "n": len(rs),
            "wall_min": min(r.wall_s for r in rs),
            "wall_med": _med([r.wall_s for r in rs]),
            "rate_max": max(r.rate for r in rs),
            "rate_med": _med([r.rate for r in rs]),
            "phase_med": _med([r.phase_s for r in rs]),
            "phase_rate_max": max((r.phase_rate for r in rs if r.phase_rate), default=None),
            "phase_rate_med": _med([r.phase_rate for r in rs]),
            "mb_s_med": _med([r.mb_s for r in rs]),
            "cpu_1k_min": min(r.cpu_per_1k for r in rs),
            "cpu_1k_med": _med([r.cpu_per_1k for r in rs]),
            "server_cpu_1k_med": _med([1000 * r.server_cpu_s / max(r.ok, 1) for r in rs]),
            "prefect_cpu_1k_med": _med(
                [1000 * r.prefect_cpu_s / max(r.ok, 1) if r.prefect_cpu_s is not None else None for r in rs]
            ),
            "ok": sorted({r.ok for r in rs}),
            "rows": rs[0].rows,
        }
    return out


def report(runs: list[Run], tools: list[str], meta: dict) -> str:
    """The per-run lines, the summary table and the ratios, as markdown."""
    s = summarize(runs, tools)
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; load average before: {meta['load_before']}; code: {meta['revision']}",
        f"- corpus: {meta['rows']} URLs over a pool of {meta['pool']} images ({meta['pool_mb']:.0f} MB, mean "
        f"{meta['pool_mean_kb']:.0f} KB, 200..2000 px; 80% JPEG, 10% PNG, 10% WebP); {meta['url_mb']:.0f} MB behind the URLs",
        f"- both tools: {meta['workers']} processes, {meta['rows_per_shard']} rows per shard; img2dataset --thread_count {meta['threads']}; "
        "shardsmith's recipe defaults (max_inflight 64, per_host 16)",
        "",
        "Per run (wall = whole command; phase = shardsmith's JSON `seconds` / img2dataset's first shard start to last shard end;",
        "CPU = the tool's process tree; other load = CPU used meanwhile by processes outside the benchmark, in cores):",
        "",
        "| tool | round | wall s | phase s | ok / rows | samples/s (wall) | samples/s (phase) | MB/s (wall) | CPU s / 1k | image server CPU s / 1k | Prefect server CPU s / 1k | other load, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        pre = _fmt(1000 * r.prefect_cpu_s / max(r.ok, 1), ".2f") if r.prefect_cpu_s is not None else "-"
        lines.append(
            f"| {r.tool} | {r.round} | {r.wall_s:.1f} | {_fmt(r.phase_s)} | {r.ok} / {r.rows} | {r.rate:.1f} | {_fmt(r.phase_rate)} | "
            f"{r.mb_s:.1f} | {r.cpu_per_1k:.2f} | {1000 * r.server_cpu_s / max(r.ok, 1):.2f} | {pre} | {r.other_cpu_s / r.wall_s:.2f} |"
        )
    lines += [
        "",
        "Summary (median over rounds; best in brackets):",
        "",
        "| tool | runs | wall s | samples/s (wall) | samples/s (phase) | MB/s (wall) | CPU s / 1k samples | ok |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tool, v in s.items():
        lines.append(
            f"| {TOOL_LABELS[tool]} | {v['n']} | {v['wall_med']:.1f} ({v['wall_min']:.1f}) | {v['rate_med']:.1f} ({v['rate_max']:.1f}) | "
            f"{_fmt(v['phase_rate_med'])} ({_fmt(v['phase_rate_max'])}) | {v['mb_s_med']:.1f} | {v['cpu_1k_med']:.2f} ({v['cpu_1k_min']:.2f}) | "
            f"{'/'.join(map(str, v['ok']))} of {v['rows']} |"
        )
    if "shardsmith" in s:
        a = s["shardsmith"]
        lines += [
            "",
            "Ratios, shardsmith / baseline (medians; > 1 means shardsmith is faster or, for CPU, cheaper):",
            "",
        ]
        for base in ("i2d-reencode", "i2d-raw"):
            if base not in s:
                continue
            b = s[base]
            phase = a["phase_rate_med"] / b["phase_rate_med"] if a["phase_rate_med"] and b["phase_rate_med"] else None
            lines.append(
                f"- vs {TOOL_LABELS[base]}: samples/s {a['rate_med'] / b['rate_med']:.2f}x whole command, "
                f"{_fmt(phase, '.2f')}x phase; CPU per sample {b['cpu_1k_med'] / a['cpu_1k_med']:.2f}x "
                f"({a['cpu_1k_med']:.2f} vs {b['cpu_1k_med']:.2f} CPU s / 1k)"
            )
        oks = sorted({ok for v in s.values() for ok in v["ok"]})
        if oks and oks[-1] - oks[0] > 5:
            lines.append(f"- WARNING: the tools kept different numbers of samples: {oks}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/bench_download.py",
        description="Time shardsmith's download phase beside img2dataset on the same loopback URLs, and print ratios.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rows", type=int, default=10_000, help="URLs in the manifest (e.g. 500 for a smoke run)")
    p.add_argument("--pool", type=int, default=400, help="distinct image files behind the URLs")
    p.add_argument("--seed", type=int, default=0, help="seed of the image pool and of the URL-to-image mapping")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each round runs every tool once, in turn")
    p.add_argument(
        "--rows-per-shard",
        type=int,
        default=500,
        help="shardsmith rows_per_shard = img2dataset number_sample_per_shard",
    )
    p.add_argument("--workers", type=int, default=2, help="shardsmith Dask workers = img2dataset processes_count")
    p.add_argument("--threads", type=int, default=64, help="img2dataset thread_count per process")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=90.0,
        help="before each run, wait up to this many seconds for other work on the machine to drop under 0.3 cores (0: don't wait)",
    )
    p.add_argument("--markdown", type=Path, help="also write the report (markdown) to this file")
    p.add_argument("--keep", action="store_true", help="keep each run's output folder under .bench/download/runs/")
    args = p.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = set(args.tools) - set(TOOLS)
    if unknown or not args.tools:
        p.error(f"--tools: unknown {sorted(unknown)}; choose from {','.join(TOOLS)}")
    if args.rows < 1 or args.pool < 1 or args.repeats < 1:
        p.error("--rows, --pool and --repeats must be at least 1")
    return args


def _revision() -> str:
    """The commit measured, with ``-dirty`` when the working tree has uncommitted changes."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM ends the run like Ctrl-C does: through the finally below, which stops every child.
    signal.signal(signal.SIGTERM, _interrupt)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    pool_dir, sizes = ensure_pool(args.pool, args.seed)
    if any(t.startswith("i2d") for t in args.tools):
        ensure_img2dataset()
    work_root = BENCH_DIR / "download" / "runs"
    work_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=dt.datetime.now().strftime("%Y%m%dT%H%M%S-"), dir=work_root))
    children = Children()
    runs: list[Run] = []
    try:
        server, base_url = start_image_server(children, pool_dir)
        manifest = work / "manifest.parquet"
        url_bytes = write_manifest(manifest, base_url, sizes, args.rows, args.seed)
        watch = {"server": server.pid}
        home = work / "prefect-home"
        if "shardsmith" in args.tools:
            home.mkdir()
            print("starting a Prefect server (not timed) ...", flush=True)
            prefect, api = start_prefect_server(children, home, work / "prefect-server.log")
            watch["prefect"] = prefect.pid
        print(
            f"{args.rows} URLs at {base_url}, {url_bytes / 1e6:.0f} MB; {args.repeats} round(s) of {', '.join(args.tools)}",
            flush=True,
        )

        def size_of(url: str) -> int:
            return sizes[url.rsplit("/", 1)[1].split("?", 1)[0]]

        for rnd in range(1, args.repeats + 1):
            for tool in args.tools:
                if args.quiet_wait > 0:
                    load = wait_for_quiet(args.quiet_wait)
                    if load >= 0.3:
                        print(
                            f"  (other work still uses {load:.1f} cores after {args.quiet_wait:g} s; running anyway)",
                            flush=True,
                        )
                if tool == "shardsmith":
                    run = run_shardsmith(children, args, rnd, manifest, work, api, home, watch)
                else:
                    run = run_img2dataset(children, args, tool, rnd, manifest, size_of, work, {"server": server.pid})
                runs.append(run)
                phase = f", phase {run.phase_s:.1f} s = {run.phase_rate:.1f} samples/s" if run.phase_s else ""
                print(
                    f"  round {rnd} {tool:<12} {run.wall_s:6.1f} s wall = {run.rate:6.1f} samples/s{phase}; "
                    f"{run.mb_s:.1f} MB/s; {run.cpu_per_1k:.2f} CPU s/1k; {run.ok}/{run.rows} ok; other load {run.other_cpu_s / run.wall_s:.2f} cores",
                    flush=True,
                )
                if not args.keep:
                    shutil.rmtree(work / f"{tool}-{rnd}", ignore_errors=True)
    except KeyboardInterrupt:
        print("interrupted; stopping child processes", file=sys.stderr)
        return 130
    finally:
        children.stop_all()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    meta = {
        "revision": _revision(),
        "command": "python bench/bench_download.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "load_before": load_before,
        "rows": args.rows,
        "pool": args.pool,
        "pool_mb": sum(sizes.values()) / 1e6,
        "pool_mean_kb": sum(sizes.values()) / len(sizes) / 1e3,
        "url_mb": url_bytes / 1e6,
        "workers": args.workers,
        "threads": args.threads,
        "rows_per_shard": args.rows_per_shard,
    }
    text = report(runs, args.tools, meta)
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
