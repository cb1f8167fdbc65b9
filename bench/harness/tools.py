"""The tools the web benchmarks compare: shardsmith's recipe and summary, img2dataset's venv, command and outputs."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from harness.procs import BENCH_DIR, REPO
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
LICENSE = "CC-BY-4.0"


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
