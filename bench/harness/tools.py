"""The tools the benchmarks compare: one timed command's figures, shardsmith's recipe, command and summary,
img2dataset's venv, command and outputs, other venvs, and this project's code at an earlier commit."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .procs import BENCH_DIR, REPO, Timed
from .report import fmt, med
from .servers import child_env

SHARDSMITH = REPO / ".venv" / "bin" / "shardsmith"
I2D_VENV = BENCH_DIR / "img2dataset-venv"
I2D_REQUIREMENT = "img2dataset==1.47.0"  # pinned: a new venv measures the code the figures came from
# img2dataset 1.47.0's defaults (img2dataset/main.py, download()), stated so that a changed default cannot move the baseline.
I2D_RESIZE_MODE, I2D_IMAGE_SIZE, I2D_ENCODE_QUALITY, I2D_TIMEOUT_S = "border", 256, 95, 10
I2D_RESIZE = (
    "--resize_mode",
    I2D_RESIZE_MODE,
    "--image_size",
    str(I2D_IMAGE_SIZE),
    "--encode_quality",
    str(I2D_ENCODE_QUALITY),
    "--encode_format",
    "jpg",
)
I2D_NET = ("--timeout", str(I2D_TIMEOUT_S), "--retries", "0")
LICENSE = "CC-BY-4.0"


@dataclass
class ToolRun:
    """One timed command: wall and process-tree CPU s, ``ok`` samples of ``rows``, the tool's own working seconds
    (``phase_s``), a Prefect server's and other work's CPU meanwhile, the tree's peak RSS."""

    tool: str
    round: int
    wall_s: float = 0.0
    cpu_s: float = 0.0
    ok: int = 0
    rows: int = 0
    phase_s: float | None = None
    prefect_cpu_s: float | None = None
    other_cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    extra: dict = field(default_factory=dict)

    def took(self, t: Timed, prefect: bool = True) -> ToolRun:
        """Take the times of a finished command (a watched Prefect server's CPU when ``prefect``)."""
        self.wall_s, self.cpu_s, self.other_cpu_s, self.peak_rss_mb = (
            t.wall_s,
            t.cpu_s,
            t.other_s,
            t.sampler.peak_rss / 2**20,
        )
        self.prefect_cpu_s = t.watched.get("prefect") if prefect else self.prefect_cpu_s
        return self

    def add(self, t: Timed, stage: str) -> None:
        """Add one command of a pipeline (its stages' wall and CPU kept in ``extra["stages"]``)."""
        self.wall_s, self.cpu_s, self.other_cpu_s = (
            self.wall_s + t.wall_s,
            self.cpu_s + t.cpu_s,
            self.other_cpu_s + t.other_s,
        )
        self.peak_rss_mb = max(self.peak_rss_mb, t.sampler.peak_rss / 2**20)
        self.extra.setdefault("stages", {})[stage] = (t.wall_s, t.cpu_s)

    @property
    def rate(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0

    @property
    def phase_rate(self) -> float | None:
        return self.ok / self.phase_s if self.phase_s else None

    @property
    def cpu_per_1k(self) -> float:
        return 1000 * self.cpu_s / max(self.ok, 1)

    def line(self) -> str:
        other = self.other_cpu_s / self.wall_s if self.wall_s else 0.0  # cores other work used, on average
        return (
            f"{self.wall_s:.1f} s wall = {self.rate:.2f}/s (phase {fmt(self.phase_s)} s); {self.cpu_per_1k:.2f} CPU s/1k; "
            f"{self.ok}/{self.rows} ok; peak {self.peak_rss_mb:.0f} MB; other load {other:.2f} cores"
        )


def spread(runs: list[ToolRun]) -> dict:
    """Medians over one tool's runs (best in ``*_best``): wall, samples/s (wall, phase), CPU per 1k; ``ok`` kept."""
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
    """--workers, --threads and (unless None) --rows-per-shard: the settings both tools get alike."""
    if rows_per_shard is not None:
        p.add_argument(
            "--rows-per-shard",
            type=int,
            default=rows_per_shard,
            help=f"shardsmith rows_per_shard = {baseline} number_sample_per_shard (default {rows_per_shard})",
        )
    p.add_argument(
        "--workers", type=int, default=2, help=f"shardsmith Dask workers = {baseline} processes_count (default 2)"
    )
    p.add_argument(
        "--threads", type=int, default=threads, help=f"{baseline} thread_count per process (default {threads})"
    )


def ensure_venv(
    venv: Path, installs: Sequence[Sequence[str]], then: Callable[[Path], None] | None = None, done: Path | None = None
) -> Path:
    """A venv of its own (never a project dependency): Python 3.11, ``pip install`` of each of ``installs``,
    then ``then(site_packages)``; ready when ``done`` exists, else when its stamp holds the same requirements."""
    want = "\n".join(r for i in installs for r in i) + "\n"
    stamp = done or venv / ".complete"
    if stamp.exists() and (done is not None or stamp.read_text() == want):
        return venv
    print(f"installing {' '.join(want.split())} into {venv} (once) ...", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    python = sys.executable if sys.version_info[:2] == (3, 11) else "python3.11"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    for reqs in installs:
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *reqs],
            check=True,
        )
    if then:
        then(next((venv / "lib").glob("python3*/site-packages")))
    if not stamp.exists():
        stamp.write_text(want)
    return venv


def ensure_img2dataset() -> Path:
    """img2dataset's entry point in ``.bench/img2dataset-venv``, made when missing."""
    return ensure_venv(I2D_VENV, [[I2D_REQUIREMENT]], done=I2D_VENV / "bin" / "img2dataset") / "bin" / "img2dataset"


def tree_at(commit: str) -> Path:
    """The ``tasks`` package at ``commit``, extracted once under ``.bench/trees/COMMIT/``: first on ``sys.path``
    in a fresh process (before anything imports ``tasks``), ``import tasks`` is the old code, a baseline."""
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
        str(I2D_VENV / "bin" / "img2dataset"),
        "--url_list",
        str(manifest),
        "--input_format",
        "parquet",
        "--url_col",
        "url",
        "--caption_col",
        "caption",
        "--output_format",
        "webdataset",
        "--output_folder",
        str(out),
        "--processes_count",
        str(workers),
        "--thread_count",
        str(threads),
        "--number_sample_per_shard",
        str(per_shard),
        "--enable_wandb",
        "False",
        *extra,
    ]


def i2d_env(**extra: str) -> dict[str, str]:
    return child_env(WANDB_MODE="disabled", WANDB_SILENT="true", NO_ALBUMENTATIONS_UPDATE="1", **extra)


def i2d_outputs(out: Path, columns: list[str] | None = None) -> tuple[dict[str, list], float | None]:
    """img2dataset's per-row metadata (its parquets' ``columns``) and phase seconds (first shard's start to last's end)."""
    import pyarrow.parquet as pq

    spans = [json.loads(p.read_text()) for p in sorted(out.glob("*_stats.json"))]
    rows: dict[str, list] = {}
    for meta in sorted(out.glob("*.parquet")):
        for k, v in pq.read_table(meta, columns=columns).to_pydict().items():
            rows.setdefault(k, []).extend(v)
    phase = max(s["end_time"] for s in spans) - min(s["start_time"] for s in spans) if spans else None
    return rows, phase


def write_recipe(path: Path, store: Path, manifest: Path, rows_per_shard: int, workers: int, **more: Any) -> Path:
    """shardsmith's recipe at img2dataset's resize defaults, every license allowed and reviewed, loopback allowed;
    ``more``: sections replacing the recipe's (a dict replaces those keys of a section)."""
    review = {
        "reviewed_by": "bench/harness/tools.py",
        "reviewed_on": "2026-01-01",
        "notes": "synthetic images rendered locally",
    }
    recipe = {
        "dataset": "bench",
        "kind": "pretraining",
        "storage": str(store),
        "sources": [{"name": "bench", "manifest": str(manifest), "rows_per_shard": rows_per_shard}],
        "download": {"network": {"allowed_networks": ["127.0.0.1/32"], "any_port": True}},
        "validate": {
            "license": {
                "allow": [LICENSE],
                "source_defaults": {"bench": LICENSE},
                "unknown": "allow",
                "review": review,
            },
            "image": {
                "resize_mode": I2D_RESIZE_MODE,
                "image_size": I2D_IMAGE_SIZE,
                "output_format": "jpeg",
                "quality": I2D_ENCODE_QUALITY,
            },
        },
        "execution": {"cluster": "local", "workers": workers},
    }
    for key, value in more.items():
        recipe[key] = recipe[key] | value if isinstance(value, dict) and isinstance(recipe.get(key), dict) else value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipe, indent=1) + "\n")  # JSON is YAML
    return path


def run_command(recipe: Path, phase: str | None = None, *sets: str) -> list[str]:
    """``shardsmith run RECIPE [--phase P --json] [--set KEY=VALUE ...]``."""
    cmd = [str(SHARDSMITH), "run", str(recipe)] + (["--phase", phase, "--json"] if phase else [])
    return cmd + [x for item in sets for x in ("--set", item)]


def summary(stdout: str) -> dict:
    """The JSON summary ``shardsmith run --json`` prints last (a library may print before it)."""
    start = stdout.rfind("\n{\n")
    return json.loads(stdout[start + 1 :] if start >= 0 else stdout)
