"""The tools the benchmarks compare: shardsmith's recipe and summary, img2dataset's venv, command and outputs, and this project's code at an earlier commit."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.procs import BENCH_DIR, REPO, Timed
from harness.servers import child_env

SHARDSMITH = REPO / ".venv" / "bin" / "shardsmith"
I2D_VENV = BENCH_DIR / "img2dataset-venv"
# The version the figures in bench/RESULTS.md were taken with; it installs on Python 3.11 with
# no further pins. Pinned so that a new venv measures the same code.
I2D_REQUIREMENT = "img2dataset==1.47.0"
# img2dataset 1.47.0's defaults (img2dataset/main.py, download()): the baseline the issues name.
I2D_RESIZE_MODE = "border"
I2D_IMAGE_SIZE = 256
I2D_ENCODE_QUALITY = 95
I2D_TIMEOUT_S = 10  # --timeout, and the web benchmark's faulty scenario's equal setting
LICENSE = "CC-BY-4.0"


@dataclass
class ToolRun:
    """One timed command of a tool: what it kept and what it cost.

    Args:
        tool: the tool's key in the tables.
        round: the round (0: a warm-up).
        wall_s, cpu_s: wall seconds of the whole command, CPU seconds of its process tree.
        ok, rows: samples kept, rows it was given.
        phase_s: the tool's own account of its working time (None: not known).
        server_cpu_s: the image server's CPU during the run.
        prefect_cpu_s: a Prefect server's CPU during the run (None: none counted).
        other_cpu_s: CPU that other work on the machine used meanwhile.
        peak_rss_mb: the largest RSS of the command's process tree, summed over its processes
            (sampled every 0.25 s).
        extra: whatever else a benchmark keeps.
    """

    tool: str
    round: int
    wall_s: float = 0.0
    cpu_s: float = 0.0
    ok: int = 0
    rows: int = 0
    phase_s: float | None = None
    server_cpu_s: float = 0.0
    prefect_cpu_s: float | None = None
    other_cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    extra: dict = field(default_factory=dict)

    def took(self, t: Timed, prefect: bool = True) -> None:
        """Take the times of a finished command (a watched Prefect server's CPU when ``prefect``)."""
        self.wall_s, self.cpu_s, self.other_cpu_s = t.wall_s, t.cpu_s, t.other_s
        self.peak_rss_mb = t.sampler.peak_rss / 2**20
        self.server_cpu_s = t.watched.get("server", 0.0)
        if prefect:
            self.prefect_cpu_s = t.watched.get("prefect")

    @property
    def rate(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0

    @property
    def phase_rate(self) -> float | None:
        return self.ok / self.phase_s if self.phase_s else None

    @property
    def cpu_per_1k(self) -> float:
        return 1000 * self.cpu_s / max(self.ok, 1)

    @property
    def other_load(self) -> float:
        """Cores that other work used, on average, during the run."""
        return self.other_cpu_s / self.wall_s if self.wall_s else 0.0


def spread(runs: list[ToolRun]) -> dict:
    """Medians over runs of one tool (best in ``*_best``): wall, samples/s, phase samples/s, CPU
    per 1k samples; the numbers kept (``ok``, sorted) and the rows given."""
    from harness.report import med

    return {
        "n": len(runs),
        "wall": med(r.wall_s for r in runs),
        "wall_best": min(r.wall_s for r in runs),
        "rate": med(r.rate for r in runs),
        "rate_best": max(r.rate for r in runs),
        "phase_rate": med(r.phase_rate for r in runs),
        "phase_rate_best": max((r.phase_rate for r in runs if r.phase_rate), default=None),
        "cpu_1k": med(r.cpu_per_1k for r in runs),
        "cpu_1k_best": min(r.cpu_per_1k for r in runs),
        "ok": sorted({r.ok for r in runs}),
        "rows": runs[0].rows,
    }


def add_tool_flags(
    p: argparse.ArgumentParser, rows_per_shard: int | None, baseline: str = "img2dataset", threads: int = 64
) -> None:
    """--workers and --threads, and --rows-per-shard unless None: the settings both tools get
    alike (``baseline``: img2dataset, or video2dataset, which shares its options' names)."""
    if rows_per_shard is not None:
        p.add_argument(
            "--rows-per-shard",
            type=int,
            default=rows_per_shard,
            help=f"shardsmith rows_per_shard = {baseline} number_sample_per_shard",
        )
    p.add_argument("--workers", type=int, default=2, help=f"shardsmith Dask workers = {baseline} processes_count")
    p.add_argument("--threads", type=int, default=threads, help=f"{baseline} thread_count per process")


def ensure_img2dataset() -> Path:
    """The img2dataset entry point in its own venv, made (and pip-installed) when missing; never
    a project dependency."""
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


def tree_at(commit: str) -> Path:
    """The ``tasks`` package as it was at ``commit``, extracted once under ``.bench/trees/COMMIT/``.

    With that folder first on ``sys.path`` (in a child process of its own, before anything
    imports ``tasks``), ``import tasks`` is the old code: a baseline to measure beside today's.
    """
    folder = BENCH_DIR / "trees" / commit
    if not (folder / ".complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "tasks"], capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tf:
            tf.extractall(folder, filter="data")
        (folder / ".complete").write_text(commit)
    return folder


def i2d_command(manifest: Path, out: Path, workers: int, threads: int, per_shard: int, *extra: str) -> list[str]:
    """img2dataset over a parquet manifest (url, caption) into webdataset shards, then ``extra``."""
    return [
        str(I2D_VENV / "bin" / "img2dataset"), "--url_list", str(manifest), "--input_format", "parquet",
        "--url_col", "url", "--caption_col", "caption",
        "--output_format", "webdataset", "--output_folder", str(out),
        "--processes_count", str(workers), "--thread_count", str(threads),
        "--number_sample_per_shard", str(per_shard), "--enable_wandb", "False", *extra,
    ]  # fmt: skip


def i2d_env() -> dict[str, str]:
    return child_env(WANDB_MODE="disabled", WANDB_SILENT="true", NO_ALBUMENTATIONS_UPDATE="1")


def i2d_outputs(out: Path, columns: list[str] | None = None) -> tuple[dict[str, list], float | None]:
    """img2dataset's per-row metadata (its parquet files' ``columns``, concatenated) and its
    phase seconds: the first shard's start to the last shard's end (None when it wrote none)."""
    import pyarrow.parquet as pq

    starts, ends = [], []
    for stats in sorted(out.glob("*_stats.json")):
        s = json.loads(stats.read_text())
        starts.append(s["start_time"])
        ends.append(s["end_time"])
    rows: dict[str, list] = {}
    for meta in sorted(out.glob("*.parquet")):
        for k, v in pq.read_table(meta, columns=columns).to_pydict().items():
            rows.setdefault(k, []).extend(v)
    return rows, (max(ends) - min(starts)) if starts else None


def write_recipe(path: Path, store: Path, manifest: Path, rows_per_shard: int, workers: int) -> None:
    """shardsmith's recipe at img2dataset's resize defaults, every license allowed and reviewed,
    loopback allowed."""
    path.write_text(
        f"""dataset: bench
kind: pretraining
storage: {store}
sources:
  - name: bench
    manifest: {manifest}
    rows_per_shard: {rows_per_shard}
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
  workers: {workers}
"""
    )


def run_command(recipe: Path, phase: str | None = None, *sets: str) -> list[str]:
    """``shardsmith run RECIPE [--phase P --json] [--set KEY=VALUE ...]``."""
    cmd = [str(SHARDSMITH), "run", str(recipe)]
    if phase:
        cmd += ["--phase", phase, "--json"]
    for item in sets:
        cmd += ["--set", item]
    return cmd


def summary(stdout: str) -> dict:
    """The JSON summary ``shardsmith run --json`` prints last (a library may print before it)."""
    start = stdout.rfind("\n{\n")
    return json.loads(stdout[start + 1 :] if start >= 0 else stdout)


def first_image_size(tars: list[Path]) -> tuple[int, int] | None:
    """Width and height of the first image in the first tar: proof of the resize."""
    from PIL import Image

    for path in sorted(tars):
        with tarfile.open(path) as tf:
            for member in tf:
                if member.name.rsplit(".", 1)[-1] in ("jpg", "jpeg", "png", "webp"):
                    f = tf.extractfile(member)
                    if f is None:
                        continue
                    with Image.open(f) as img:
                        return img.size
    return None
