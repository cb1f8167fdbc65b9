"""Validate benchmark: manifest -> validated 256 px shards, shardsmith beside img2dataset's default run.

One invocation renders (or reuses) one distinct synthetic photo per URL, serves them on
loopback with ``python -m tasks.demo.webserver``, starts one Prefect server (not timed), and then
runs, alternating, for ``--repeats`` rounds:

- ``shardsmith``: ``shardsmith run RECIPE --phase validate --json`` (download, then validate:
  decode with JPEG draft, EXIF orientation, RGB, resize, re-encode, pixel and perceptual
  hashes, dedup across the dataset, gate and report) with the recipe set to img2dataset's
  defaults: ``resize_mode: border``, ``image_size: 256``, JPEG at quality 95;
- ``i2d-default``: img2dataset with its own resize defaults (``--resize_mode border
  --image_size 256 --encode_quality 95 --encode_format jpg``, stated on the command line so a
  changed default cannot change the baseline): full OpenCV decode, resize, pad, re-encode.

Every URL is a distinct image, so shardsmith's dedup rejects nothing and both tools keep the
same samples. img2dataset lives in its own venv (``.bench/img2dataset-venv``, shared with
bench_download.py). Each run writes into a fresh folder, removed after it is measured.

CPU seconds are user+sys of the tool's whole process tree (``RUSAGE_CHILDREN`` deltas). While
a run goes, the tree is also sampled every 0.25 s, which splits its CPU by process (the CLI's
own process, which also hosts the Dask scheduler, versus the workers) and, for shardsmith, by
phase, at the boundaries Prefect logs (start-up, download, validate, teardown). Last, each
tool's per-image work alone (decode, resize, re-encode) is timed on the same files in one
process, which separates the image code from downloads, tars and orchestration.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_download import (  # noqa: E402  (the download benchmark's corpus and process helpers)
    BENCH_DIR,
    I2D_VENV,
    POOL_VERSION,
    SHARDSMITH,
    Children,
    _interrupt,
    _render,
    _revision,
    busy_cpu,
    child_env,
    ensure_img2dataset,
    start_image_server,
    start_prefect_server,
    tree_cpu,
    wait_for_quiet,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("shardsmith", "i2d-default")
# img2dataset 1.47.0's defaults (img2dataset/main.py, download()): the baseline the issue names.
I2D_RESIZE_MODE = "border"
I2D_IMAGE_SIZE = 256
I2D_ENCODE_QUALITY = 95
TOOL_LABELS = {
    "shardsmith": f"shardsmith download + validate ({I2D_RESIZE_MODE} {I2D_IMAGE_SIZE}, jpeg q{I2D_ENCODE_QUALITY}, dedup)",
    "i2d-default": f"img2dataset default ({I2D_RESIZE_MODE} {I2D_IMAGE_SIZE}, jpg q{I2D_ENCODE_QUALITY})",
}
LICENSE = "CC-BY-4.0"
SAMPLE_S = 0.25
PHASE_PARTS = ("start-up", "download", "between", "validate", "teardown")
# Prefect's console lines: "HH:MM:SS.mmm | INFO    | Flow run 'name' - message"
_LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \| \w+\s*\| (.*)$")


# ------------------------------------------------------------------------------------- corpus


def ensure_unique_pool(rows: int, seed: int) -> tuple[Path, dict[str, int]]:
    """One distinct image per URL: a pool folder holding at least ``rows`` images, and {name: bytes}.

    Images are bench_download.py's (``_render``: same sizes, formats and texture; image ``i``
    depends only on the seed and ``i``), so the pool grows when a later invocation asks for
    more rows, and is otherwise reused.
    """
    folder = BENCH_DIR / "validate" / f"pool-v{POOL_VERSION}-s{seed}"
    stamp = folder / ".complete.json"  # a leading dot: the image server refuses to serve it
    sizes: dict[str, int] = json.loads(stamp.read_text()) if stamp.exists() else {}
    have = {int(name[1:].split(".", 1)[0]) for name in sizes}
    missing = [i for i in range(rows) if i not in have]
    if missing:
        folder.mkdir(parents=True, exist_ok=True)
        print(f"rendering {len(missing)} images into {folder} (once; reused by later runs) ...", flush=True)
        started = time.perf_counter()
        # At the lowest priority: on a shared machine someone else's timed run may be going.
        with ProcessPoolExecutor(
            max_workers=max(1, min(2, os.cpu_count() or 1)), initializer=os.nice, initargs=(19,)
        ) as ex:
            for name, data in ex.map(_render, [seed] * len(missing), missing, chunksize=16):
                (folder / name).write_bytes(data)
                sizes[name] = len(data)
        stamp.write_text(json.dumps(sizes, sort_keys=True))
        print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)
    by_index = {int(name[1:].split(".", 1)[0]): name for name in sizes}
    return folder, {by_index[i]: sizes[by_index[i]] for i in range(rows)}


def write_manifest(path: Path, base_url: str, names: list[str]) -> None:
    """A parquet with one row per image: url, caption, license."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(names)
    table = pa.table(
        {
            "url": [f"{base_url}/img/{name}" for name in names],
            "caption": [f"synthetic photo number {i}" for i in range(n)],
            "license": [LICENSE] * n,
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def write_recipe(path: Path, store: Path, manifest: Path, args) -> None:
    """shardsmith's recipe: img2dataset's resize defaults; every license allowed, reviewed."""
    path.write_text(
        f"""dataset: bench
kind: pretraining
storage: {store}
sources:
  - name: bench
    manifest: {manifest}
    rows_per_shard: {args.rows_per_shard}
download:
  network:
    allowed_networks: ["127.0.0.1/32"]
    any_port: true
validate:
  license:
    allow: [{LICENSE}]
    source_defaults: {{bench: {LICENSE}}}
    unknown: allow
    review:
      reviewed_by: bench/bench_validate.py
      reviewed_on: 2026-01-01
      notes: synthetic images rendered locally by bench/bench_download.py's generator
  image:
    resize_mode: {I2D_RESIZE_MODE}
    image_size: {I2D_IMAGE_SIZE}
    output_format: jpeg
    quality: {I2D_ENCODE_QUALITY}
execution:
  cluster: local
  workers: {args.workers}
"""
    )


# ----------------------------------------------------------------------------------- timing


class TreeSampler(threading.Thread):
    """Samples the CPU of a process tree every ``SAMPLE_S``: per process and along time.

    ``per_pid`` keeps each process's last seen user+sys (a process's final fraction of a
    sample interval is missed; the totals reported come from rusage, this is for the split).
    """

    def __init__(self, pid: int, role=None) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.role = role or _role  # (psutil.Process, root) -> the name its CPU is counted under
        self.per_pid: dict[int, tuple[str, float]] = {}
        self.timeline: list[
            tuple[float, float, float]
        ] = []  # (time.time(), tree CPU so far, the root's own CPU so far)
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop_event.is_set():
            with contextlib.suppress(psutil.Error):
                procs = [root, *root.children(recursive=True)]
                total = main = 0.0
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        t = p.cpu_times()
                        own = t.user + t.system
                        total += own + t.children_user + t.children_system
                        if p.pid == root.pid:
                            main = own
                        role = self.per_pid.get(p.pid, (None,))[0] or self.role(p, root)
                        self.per_pid[p.pid] = (role, own)
                self.timeline.append((time.time(), total, main))
            self._stop_event.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)

    def by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, cpu in self.per_pid.values():
            out[role] = out.get(role, 0.0) + cpu
        return out

    def cpu_between(self, t0: float, t1: float, column: int = 1) -> float:
        """CPU spent between two wall-clock times (interpolated on the samples): the tree's
        (``column`` 1) or the root process's own (``column`` 2)."""
        series = [(row[0], row[column]) for row in self.timeline]
        return max(0.0, _interp(series, t1) - _interp(series, t0))


def _role(p, root) -> str:
    if p.pid == root.pid:
        return "main"
    with contextlib.suppress(Exception):
        cmd = " ".join(p.cmdline())
        if "resource_tracker" in cmd:
            return "helpers"
        if "spawn_main" in cmd or "multiprocessing" in cmd:
            return "workers"
    return "helpers"


def _interp(timeline: list[tuple[float, float]], t: float) -> float:
    if not timeline:
        return 0.0
    if t <= timeline[0][0]:
        return 0.0 if t < timeline[0][0] - SAMPLE_S else timeline[0][1]
    for (ta, ca), (tb, cb) in zip(timeline, timeline[1:]):
        if ta <= t <= tb:
            return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else cb
    return timeline[-1][1]


@dataclass
class Timed:
    wall_s: float
    cpu_s: float
    watched: dict[str, float]
    stdout: str
    started: float  # time.time() at launch
    sampler: TreeSampler


def timed(
    children: Children,
    cmd: list[str],
    env: dict[str, str],
    cwd: Path,
    log: Path,
    watch: dict[str, int],
    timeout: float | None = None,
    role=None,
) -> Timed:
    """Run ``cmd`` to completion, as bench_download.timed does, sampling its tree meanwhile.

    ``timeout``: stop the command's process group after this many seconds and fail the run
    (a hung tool must not hang the benchmark); ``role``: passed to :class:`TreeSampler`.
    """
    before_watch = {k: tree_cpu(pid) for k, pid in watch.items()}
    busy0 = busy_cpu()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    t0 = time.perf_counter()
    with open(log, "wb") as err:
        proc = children.start(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err)
        sampler = TreeSampler(proc.pid, role)
        sampler.start()
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out = None
        finally:
            sampler.stop()
            children.stop(proc)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    watched = {k: tree_cpu(pid) - before_watch[k] for k, pid in watch.items()}
    watched["other"] = max(0.0, busy_cpu() - busy0 - cpu - sum(watched.values()))
    if out is None:
        raise SystemExit(f"{cmd[0]} did not finish within {timeout:g} s and was stopped; stderr: {log}")
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{cmd[0]} exited with {proc.returncode}; stderr tail ({log}):\n{tail}")
    return Timed(wall, cpu, watched, out.decode(errors="replace"), started, sampler)


def flow_marks(log: Path, started: float) -> dict[str, float]:
    """Wall-clock times (time.time()) at which the download and validate subflows began and finished.

    From Prefect's console lines: "Beginning subflow run 'NAME' for flow 'PHASE'", then the
    last line of "Flow run 'NAME'" ("Finished in state ..."). A subflow's span includes its
    gate and report, which the JSON's ``seconds`` leave out.
    """
    day = dt.datetime.fromtimestamp(started).replace(hour=0, minute=0, second=0, microsecond=0)
    names: dict[str, str] = {}
    marks: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = _LOG_LINE.match(line)
        if not m:
            continue
        t = (
            day + dt.timedelta(hours=int(m[1]), minutes=int(m[2]), seconds=int(m[3]), milliseconds=int(m[4]))
        ).timestamp()
        if t < started - 60:  # the run crossed midnight
            t += 86400
        text = m[5]
        begin = re.match(r"Flow run '([^']+)' - Beginning subflow run '[^']+' for flow '(download|validate)'", text)
        if begin:
            names[begin[1]] = begin[2]
            marks[f"{begin[2]}_start"] = t
            continue
        own = re.match(r"Flow run '([^']+)' - ", text)
        if own and own[1] in names:
            marks[f"{names[own[1]]}_end"] = t
    return marks


# ------------------------------------------------------------------------------------ runs


@dataclass
class Run:
    tool: str
    round: int
    wall_s: float
    cpu_s: float
    ok: int
    rows: int
    out_bytes: int
    phase_s: float | None = None
    download_s: float | None = None
    validate_s: float | None = None
    server_cpu_s: float = 0.0
    prefect_cpu_s: float | None = None
    other_cpu_s: float = 0.0
    cpu_by_role: dict[str, float] = field(default_factory=dict)
    cpu_by_phase: dict[str, float] = field(default_factory=dict)
    main_cpu_by_phase: dict[str, float] = field(default_factory=dict)
    wall_by_phase: dict[str, float] = field(default_factory=dict)
    sample_size: tuple[int, int] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.ok / self.wall_s

    @property
    def phase_rate(self) -> float | None:
        return self.ok / self.phase_s if self.phase_s else None

    @property
    def cpu_per_1k(self) -> float:
        return 1000 * self.cpu_s / max(self.ok, 1)


def first_image_size(tars: list[Path]) -> tuple[int, int] | None:
    """Width and height of the first image in the first tar: proof of the resize."""
    from PIL import Image

    for path in sorted(tars):
        with tarfile.open(path) as tf:
            for member in tf:
                if member.name.rsplit(".", 1)[-1] in ("jpg", "jpeg", "png", "webp"):
                    with Image.open(tf.extractfile(member)) as img:
                        return img.size
    return None


def run_shardsmith(
    children: Children, args, rnd: int, manifest: Path, work: Path, api: str, home: Path, watch: dict[str, int]
) -> Run:
    out_dir = work / f"shardsmith-{rnd}"
    out_dir.mkdir(parents=True)
    store = out_dir / "store"
    recipe = out_dir / "recipe.yaml"
    write_recipe(recipe, store, manifest, args)
    env = child_env(PREFECT_API_URL=api, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    cmd = [str(SHARDSMITH), "run", str(recipe), "--phase", "validate", "--json"]
    log = out_dir / "stderr.log"
    t = timed(children, cmd, env, REPO_ROOT, log, watch)
    start = t.stdout.rfind("\n{\n")
    result = json.loads(t.stdout[start + 1 :] if start >= 0 else t.stdout)
    dl, val = result["download"], result["validate"]
    tars = [store / rel for rel in val["tars"]]
    run = Run(
        "shardsmith", rnd, t.wall_s, t.cpu_s, val["counts"]["ok"], dl["counts"]["rows"], sum(p.stat().st_size for p in tars),
        phase_s=dl["seconds"] + val["seconds"], download_s=dl["seconds"], validate_s=val["seconds"],
        server_cpu_s=t.watched.get("server", 0.0), prefect_cpu_s=t.watched.get("prefect"), other_cpu_s=t.watched["other"],
        cpu_by_role=t.sampler.by_role(), sample_size=first_image_size(tars),
        extra={"download_by_reason": dl["counts"]["by_reason"], "validate_by_reason": val["counts"]["by_reason"], "duplicates": val["duplicates"]},
    )  # fmt: skip
    marks = flow_marks(log, t.started)
    if all(f"{p}_{e}" in marks for p in ("download", "validate") for e in ("start", "end")):
        bounds = [
            t.started,
            marks["download_start"],
            marks["download_end"],
            marks["validate_start"],
            marks["validate_end"],
            t.started + t.wall_s,
        ]
        names = ["start-up", "download", "between", "validate", "teardown"]
        for name, a, b in zip(names, bounds, bounds[1:]):
            run.wall_by_phase[name] = b - a
            # The first sample is taken just after launch: CPU before it counts as start-up.
            a, b = a - (SAMPLE_S if name == "start-up" else 0), b + (1.0 if name == "teardown" else 0)
            run.cpu_by_phase[name] = t.sampler.cpu_between(a, b)
            run.main_cpu_by_phase[name] = t.sampler.cpu_between(a, b, column=2)
    if run.ok != run.rows:
        print(
            f"  warning: shardsmith: {run.rows - run.ok} rows not ok: download {dl['counts']['by_reason']}, validate {val['counts']['by_reason']}",
            flush=True,
        )
    return run


def run_img2dataset(children: Children, args, rnd: int, manifest: Path, work: Path, watch: dict[str, int]) -> Run:
    import pyarrow.parquet as pq

    exe = I2D_VENV / "bin" / "img2dataset"
    out_dir = work / f"i2d-default-{rnd}"
    out_dir.mkdir(parents=True)
    cmd = [
        str(exe), "--url_list", str(manifest), "--input_format", "parquet",
        "--url_col", "url", "--caption_col", "caption",
        "--output_format", "webdataset", "--output_folder", str(out_dir / "out"),
        "--processes_count", str(args.workers), "--thread_count", str(args.threads),
        "--number_sample_per_shard", str(args.rows_per_shard),
        "--resize_mode", I2D_RESIZE_MODE, "--image_size", str(I2D_IMAGE_SIZE),
        "--encode_quality", str(I2D_ENCODE_QUALITY), "--encode_format", "jpg",
        "--enable_wandb", "False", "--timeout", "20",
    ]  # fmt: skip
    env = child_env(WANDB_MODE="disabled", WANDB_SILENT="true", NO_ALBUMENTATIONS_UPDATE="1")
    t = timed(children, cmd, env, out_dir, out_dir / "stderr.log", watch)
    ok = n = 0
    starts, ends = [], []
    for stats in sorted((out_dir / "out").glob("*_stats.json")):
        s = json.loads(stats.read_text())
        starts.append(s["start_time"])
        ends.append(s["end_time"])
    for meta in sorted((out_dir / "out").glob("*.parquet")):
        statuses = pq.read_table(meta, columns=["status"]).column("status").to_pylist()
        n += len(statuses)
        ok += sum(s == "success" for s in statuses)
    tars = sorted((out_dir / "out").glob("*.tar"))
    phase = (max(ends) - min(starts)) if starts else None
    return Run(
        "i2d-default", rnd, t.wall_s, t.cpu_s, ok, n, sum(p.stat().st_size for p in tars), phase_s=phase,
        server_cpu_s=t.watched.get("server", 0.0), other_cpu_s=t.watched["other"], cpu_by_role=t.sampler.by_role(),
        sample_size=first_image_size(tars),
    )  # fmt: skip


# ---------------------------------------------------------------------------------- kernel

# Each tool's per-image work (decode, resize to 256 px with a border, JPEG re-encode), timed in
# one process of its own venv with process_time: what the runs above spend per image, without
# downloads, tars, orchestration or contention. Prints {label: {ext: [images, CPU s]}}.
_KERNEL_SHARDSMITH = f"""
import json, sys, time
from pathlib import Path
from tasks.policies.images import process_image
from tasks.formats.recipe_download import ImageRules
rules = ImageRules(resize_mode="{I2D_RESIZE_MODE}", image_size={I2D_IMAGE_SIZE}, output_format="jpeg", quality={I2D_ENCODE_QUALITY})
files = [Path(p) for p in sys.argv[1:]]
for f in files[:10]:
    process_image(f.read_bytes(), rules)
by = {{}}
for f in files:
    data = f.read_bytes()
    t = time.process_time()
    r = process_image(data, rules)
    cpu = time.process_time() - t
    if r.reason is not None:
        raise SystemExit(f"{{f}}: {{r.reason}}")
    n, c = by.get(f.suffix[1:], (0, 0.0))
    by[f.suffix[1:]] = (n + 1, c + cpu)
out = {{"shardsmith process_image (Pillow, JPEG draft; EXIF, RGB, pixel sha256, resize, pHash, encode)": by}}
print(json.dumps(out))
"""
_KERNEL_I2D = f"""
import io, json, sys, time
from pathlib import Path
from img2dataset.resizer import Resizer
r = Resizer(image_size={I2D_IMAGE_SIZE}, resize_mode="{I2D_RESIZE_MODE}", resize_only_if_bigger=False, encode_quality={I2D_ENCODE_QUALITY}, encode_format="jpg")
files = [Path(p) for p in sys.argv[1:]]
for f in files[:10]:
    r(io.BytesIO(f.read_bytes()))
by = {{}}
for f in files:
    data = f.read_bytes()
    t = time.process_time()
    res = r(io.BytesIO(data))
    cpu = time.process_time() - t
    if res[-1] is not None:
        raise SystemExit(f"{{f}}: {{res[-1]}}")
    n, c = by.get(f.suffix[1:], (0, 0.0))
    by[f.suffix[1:]] = (n + 1, c + cpu)
print(json.dumps({{"img2dataset Resizer (OpenCV decode, albumentations resize + pad, imencode)": by}}))
"""


def run_kernels(pool_dir: Path, names: list[str], tools: list[str]) -> dict[str, dict[str, tuple[int, float]]]:
    """CPU per image of each tool's image work on the same files (see _KERNEL_SHARDSMITH)."""
    files = [str(pool_dir / n) for n in names]
    out: dict[str, dict[str, tuple[int, float]]] = {}
    jobs = []
    if "shardsmith" in tools:
        jobs.append(
            (
                [str(REPO_ROOT / ".venv" / "bin" / "python"), "-c", _KERNEL_SHARDSMITH],
                child_env(PYTHONPATH=str(REPO_ROOT)),
            )
        )
    if "i2d-default" in tools:
        jobs.append(([str(I2D_VENV / "bin" / "python"), "-c", _KERNEL_I2D], child_env(NO_ALBUMENTATIONS_UPDATE="1")))
    for cmd, env in jobs:
        proc = subprocess.run([*cmd, *files], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"kernel timing failed ({cmd[0]}):\n{proc.stderr[-3000:]}")
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


# --------------------------------------------------------------------------------- report


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def _per_1k(cpu: float | None, ok: int) -> float | None:
    return None if cpu is None else 1000 * cpu / max(ok, 1)


def summarize(runs: list[Run], tools: list[str]) -> dict[str, dict]:
    out = {}
    for tool in tools:
        rs = [r for r in runs if r.tool == tool]
        if not rs:
            continue
        roles = sorted({k for r in rs for k in r.cpu_by_role})
        phases = [k for k in PHASE_PARTS if any(k in r.cpu_by_phase for r in rs)]
        out[tool] = {
            "n": len(rs),
            "wall_med": _med([r.wall_s for r in rs]),
            "wall_min": min(r.wall_s for r in rs),
            "rate_med": _med([r.rate for r in rs]),
            "rate_max": max(r.rate for r in rs),
            "phase_med": _med([r.phase_s for r in rs]),
            "phase_rate_med": _med([r.phase_rate for r in rs]),
            "download_med": _med([r.download_s for r in rs]),
            "validate_med": _med([r.validate_s for r in rs]),
            "cpu_1k_med": _med([r.cpu_per_1k for r in rs]),
            "cpu_1k_min": min(r.cpu_per_1k for r in rs),
            "out_kb_med": _med([r.out_bytes / max(r.ok, 1) / 1e3 for r in rs]),
            "roles": {k: _med([_per_1k(r.cpu_by_role.get(k), r.ok) for r in rs]) for k in roles},
            "phases": {k: _med([_per_1k(r.cpu_by_phase.get(k), r.ok) for r in rs]) for k in phases},
            "phase_walls": {k: _med([r.wall_by_phase.get(k) for r in rs]) for k in phases},
            "phase_mains": {k: _med([_per_1k(r.main_cpu_by_phase.get(k), r.ok) for r in rs]) for k in phases},
            "ok": sorted({r.ok for r in rs}),
            "rows": rs[0].rows,
            "sizes": sorted({r.sample_size for r in rs if r.sample_size}),
        }
    return out


def report(runs: list[Run], tools: list[str], meta: dict, kernels: dict | None = None) -> str:
    """The per-run lines, the summary table and the ratios, as markdown."""
    s = summarize(runs, tools)
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; load average before: {meta['load_before']}; code: {meta['revision']}",
        f"- corpus: {meta['rows']} URLs, each a distinct synthetic image ({meta['url_mb']:.0f} MB, mean {meta['mean_kb']:.0f} KB, "
        "200..2000 px; ~80% JPEG, 10% PNG, 10% WebP), served on loopback",
        f"- both tools: {meta['workers']} processes, {meta['rows_per_shard']} rows per shard, resize_mode {I2D_RESIZE_MODE}, "
        f"image_size {I2D_IMAGE_SIZE}, JPEG quality {I2D_ENCODE_QUALITY}; img2dataset --thread_count {meta['threads']}; "
        "shardsmith: recipe defaults otherwise (dedup exact + near on, gates, HTML report)",
        "",
        "Per run (wall = whole command; phase = shardsmith's JSON download.seconds + validate.seconds / img2dataset's first shard "
        "start to last shard end; CPU = the tool's process tree; other load = CPU used meanwhile outside the benchmark, in cores):",
        "",
        "| tool | round | wall s | phase s (download + validate) | ok / rows | samples/s (wall) | samples/s (phase) | CPU s / 1k | "
        "Prefect server CPU s / 1k | image server CPU s / 1k | output KB / sample | first image | other load, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        split = f" ({r.download_s:.1f} + {r.validate_s:.1f})" if r.download_s is not None else ""
        size = "x".join(map(str, r.sample_size)) if r.sample_size else "-"
        lines.append(
            f"| {r.tool} | {r.round} | {r.wall_s:.1f} | {_fmt(r.phase_s)}{split} | {r.ok} / {r.rows} | {r.rate:.1f} | "
            f"{_fmt(r.phase_rate)} | {r.cpu_per_1k:.2f} | {_fmt(_per_1k(r.prefect_cpu_s, r.ok), '.2f')} | "
            f"{1000 * r.server_cpu_s / max(r.ok, 1):.2f} | {r.out_bytes / max(r.ok, 1) / 1e3:.1f} | {size} | {r.other_cpu_s / r.wall_s:.2f} |"
        )
    lines += [
        "",
        "Summary (median over rounds; best in brackets):",
        "",
        "| tool | runs | wall s | samples/s (wall) | samples/s (phase) | CPU s / 1k samples | ok |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for tool, v in s.items():
        lines.append(
            f"| {TOOL_LABELS[tool]} | {v['n']} | {v['wall_med']:.1f} ({v['wall_min']:.1f}) | {v['rate_med']:.1f} ({v['rate_max']:.1f}) | "
            f"{_fmt(v['phase_rate_med'])} | {v['cpu_1k_med']:.2f} ({v['cpu_1k_min']:.2f}) | {'/'.join(map(str, v['ok']))} of {v['rows']} |"
        )
    lines += [
        "",
        "Where the CPU goes (CPU s per 1k samples, medians; sampled every 0.25 s, so parts need not add up to the total; "
        "main = the command's own process: for shardsmith the flow, the Dask scheduler, gates and reports, for img2dataset "
        "the reader and the pool; workers = the Dask workers / img2dataset's download processes):",
        "",
    ]
    for tool, v in s.items():
        roles = ", ".join(f"{k} {_fmt(x, '.2f')}" for k, x in v["roles"].items())
        lines.append(f"- {tool}: by process: {roles}")
        if v["phases"]:
            phases = ", ".join(
                f"{k} {_fmt(x, '.2f')} (main {_fmt(v['phase_mains'][k], '.2f')}; {_fmt(v['phase_walls'][k])} s wall)"
                for k, x in v["phases"].items()
            )
            lines.append(
                f"- {tool}: by part of the run (subflow spans from Prefect's log lines, gates and reports included): {phases}"
            )
    if kernels:
        exts = sorted(
            {e for by in kernels.values() for e in by},
            key=lambda e: -max(by.get(e, (0, 0))[0] for by in kernels.values()),
        )
        counts = next(iter(kernels.values()))
        mix = ", ".join(f"{counts[e][0]} {e}" for e in exts if e in counts)
        lines += [
            "",
            f"Per-image work alone (CPU ms per image, one process, no downloads or tars; the corpus's first {meta['kernel_images']} images: {mix}):",
            "",
            "| code | " + " | ".join(exts) + " | all |",
            "|---|" + "---:|" * (len(exts) + 1),
        ]
        for label, by in kernels.items():
            n_all = sum(n for n, _ in by.values())
            cells = [_fmt(1000 * by[e][1] / by[e][0], ".1f") if e in by else "-" for e in exts]
            lines.append(
                f"| {label} | "
                + " | ".join(cells)
                + f" | {1000 * sum(c for _, c in by.values()) / max(n_all, 1):.1f} |"
            )
    if "shardsmith" in s and "i2d-default" in s:
        a, b = s["shardsmith"], s["i2d-default"]
        phase = a["phase_rate_med"] / b["phase_rate_med"] if a["phase_rate_med"] and b["phase_rate_med"] else None
        lines += [
            "",
            "Ratios, shardsmith / img2dataset default (medians; > 1 means shardsmith is faster or, for CPU, cheaper):",
            "",
            f"- samples/s, whole command: {a['rate_med'] / b['rate_med']:.2f}x ({a['rate_med']:.1f} vs {b['rate_med']:.1f}; target 1.5x)",
            f"- samples/s, phases only: {_fmt(phase, '.2f')}x ({_fmt(a['phase_rate_med'])} vs {_fmt(b['phase_rate_med'])})",
            f"- CPU per sample: {b['cpu_1k_med'] / a['cpu_1k_med']:.2f}x ({a['cpu_1k_med']:.2f} vs {b['cpu_1k_med']:.2f} CPU s / 1k)",
        ]
        oks = sorted({ok for v in s.values() for ok in v["ok"]})
        if oks and oks[-1] - oks[0] > 5:
            lines.append(f"- WARNING: the tools kept different numbers of samples: {oks}")
        sizes = {size for v in s.values() for size in v["sizes"]}
        if len(sizes) > 1:
            lines.append(f"- WARNING: the tools' first images differ in size: {sorted(sizes)}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/bench_validate.py",
        description="Time shardsmith's download + validate phases (256 px border resize) beside img2dataset's default run, and print ratios.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--rows", type=int, default=4000, help="URLs in the manifest, each a distinct image (e.g. 300 for a smoke run)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the image pool")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each round runs every tool once, in turn")
    p.add_argument(
        "--rows-per-shard",
        type=int,
        default=500,
        help="shardsmith rows_per_shard = img2dataset number_sample_per_shard",
    )
    p.add_argument("--workers", type=int, default=2, help="shardsmith Dask workers = img2dataset processes_count")
    p.add_argument(
        "--threads", type=int, default=64, help="img2dataset thread_count per process (as bench_download.py)"
    )
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=90.0,
        help="before each run, wait up to this many seconds for other work on the machine to drop under 0.3 cores (0: don't wait)",
    )
    p.add_argument(
        "--kernel-images",
        type=int,
        default=300,
        help="after the runs, time each tool's per-image work alone on this many of the images (0: skip)",
    )
    p.add_argument("--markdown", type=Path, help="also write the report (markdown) to this file")
    p.add_argument("--keep", action="store_true", help="keep each run's output folder under .bench/validate/runs/")
    args = p.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = set(args.tools) - set(TOOLS)
    if unknown or not args.tools:
        p.error(f"--tools: unknown {sorted(unknown)}; choose from {','.join(TOOLS)}")
    if args.rows < 1 or args.repeats < 1:
        p.error("--rows and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    pool_dir, sizes = ensure_unique_pool(args.rows, args.seed)
    if "i2d-default" in args.tools:
        ensure_img2dataset()
    work_root = BENCH_DIR / "validate" / "runs"
    work_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=dt.datetime.now().strftime("%Y%m%dT%H%M%S-"), dir=work_root))
    children = Children()
    runs: list[Run] = []
    try:
        server, base_url = start_image_server(children, pool_dir)
        manifest = work / "manifest.parquet"
        write_manifest(manifest, base_url, list(sizes))
        watch = {"server": server.pid}
        home = work / "prefect-home"
        if "shardsmith" in args.tools:
            home.mkdir()
            print("starting a Prefect server (not timed) ...", flush=True)
            prefect, api = start_prefect_server(children, home, work / "prefect-server.log")
            watch["prefect"] = prefect.pid
        print(
            f"{args.rows} URLs at {base_url}, {sum(sizes.values()) / 1e6:.0f} MB; {args.repeats} round(s) of {', '.join(args.tools)}",
            flush=True,
        )
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
                    run = run_img2dataset(children, args, rnd, manifest, work, {"server": server.pid})
                runs.append(run)
                phase = f", phase {run.phase_s:.1f} s = {run.phase_rate:.1f} samples/s" if run.phase_s else ""
                print(
                    f"  round {rnd} {tool:<12} {run.wall_s:6.1f} s wall = {run.rate:6.1f} samples/s{phase}; "
                    f"{run.cpu_per_1k:.2f} CPU s/1k; {run.ok}/{run.rows} ok; other load {run.other_cpu_s / run.wall_s:.2f} cores",
                    flush=True,
                )
                if not args.keep:
                    shutil.rmtree(work / f"{tool}-{rnd}", ignore_errors=True)
        kernels = None
        if args.kernel_images > 0:
            if args.quiet_wait > 0:
                wait_for_quiet(args.quiet_wait)
            print(f"timing each tool's per-image work on {min(args.kernel_images, args.rows)} images ...", flush=True)
            kernels = run_kernels(pool_dir, list(sizes)[: args.kernel_images], args.tools)
    except KeyboardInterrupt:
        print("interrupted; stopping child processes", file=sys.stderr)
        return 130
    finally:
        children.stop_all()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    meta = {
        "revision": _revision(),
        "command": "python bench/bench_validate.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "load_before": load_before,
        "rows": args.rows,
        "url_mb": sum(sizes.values()) / 1e6,
        "mean_kb": sum(sizes.values()) / len(sizes) / 1e3,
        "workers": args.workers,
        "threads": args.threads,
        "rows_per_shard": args.rows_per_shard,
        "kernel_images": min(args.kernel_images, args.rows),
    }
    text = report(runs, args.tools, meta, kernels)
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
