"""The `shardsmith` command as a user runs it: a subprocess, its exit code and what it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

SHARDSMITH = [sys.executable, "-m", "cli"]
ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    full_env.update(env or {})
    return subprocess.run([*SHARDSMITH, *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands():
    out = cli("--help")
    assert out.returncode == 0
    assert "run" in out.stdout and "demo" in out.stdout


def test_flags_in_help_take_no_value():
    out = cli("run", "--help", env={"COLUMNS": "200"})
    assert out.returncode == 0
    assert "--force" in out.stdout and "--json" in out.stdout and "curate" in out.stdout
    assert "<bool>" not in out.stdout
    # Options that take a value still say which.
    assert re.search(r"--workers\s+<int>", out.stdout)


def test_bad_recipe_exits_2_naming_file_and_key(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(
        "dataset: x\nstorage: s\nsources:\n  - name: a\n    manifest: m.csv\ndownload:\n  retries: many\n"
    )
    out = cli("run", str(recipe))
    assert out.returncode == 2
    assert f"{recipe}: download.retries: Input should be a valid integer" in out.stderr
    assert "Traceback" not in out.stderr


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("dataset: x\nstorage: s\nsources:\n  - name: a\n    manifest: m.csv\n")
    out = cli("run", str(recipe), "--cluster", "cuda")
    assert out.returncode == 2
    assert "needs a CUDA GPU" in out.stderr and "--cluster local" in out.stderr


def test_demo_end_to_end(tmp_path):
    """`shardsmith demo` with its own temporary Prefect server and a local Dask cluster."""
    out = cli("demo", "--dir", str(tmp_path / "demo"), "--images", "30", "--workers", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    # Nothing but the run's own lines: no model-loading progress bars from the workers, and no
    # resource-tracker warning about the locks those bars' tqdm leaves in a worker the close ends.
    assert "it/s]" not in out.stderr + out.stdout, out.stderr[-3000:]  # tqdm's rate, in any bar
    assert "leaked semaphore" not in out.stderr, out.stderr[-3000:]
    store = tmp_path / "demo" / "store" / "demo"
    # The progress lines count output shards and their samples, also where one task writes
    # several shards (reshard's build tasks).
    line = re.search(r"^reshard: (\d+)/(\d+) shards, ([\d,]+) rows", out.stderr, re.M)
    summary = re.search(r"^reshard: ([\d,]+) rows", out.stdout, re.M)
    assert line and summary, out.stderr[-3000:]
    assert int(line[1]) == int(line[2]) == len(list((store / "reshard").rglob("shard-*.tar")))
    assert int(line[3].replace(",", "")) == int(summary[1].replace(",", "")) > 0
    ledgers = sorted((store / "download").rglob("*.ledger.parquet"))
    tars = sorted((store / "download").rglob("*.tar"))
    assert ledgers and len(tars) == len(ledgers)
    import json

    expected = json.loads((tmp_path / "demo" / "manifests" / "EXPECTED.json").read_text())
    rows = (
        pq.read_table([str(p) for p in ledgers]).to_pylist()
        if len(ledgers) == 1
        else [r for p in ledgers for r in pq.read_table(p).to_pylist()]
    )
    assert len(rows) == expected["rows"]
    assert sum(r["status"] == "ok" for r in rows) == expected["ok"]
    # The user is told where things are.
    assert "shards and ledgers:" in out.stdout and str(store / "download") in out.stdout
    assert "report:" in out.stdout
    report = next(store.glob("reports/*/download.md"))
    assert f"| {expected['rows']} | {expected['ok']} |" in report.read_text()
    # Validation ran too, and `shardsmith report` prints the run's summary from its files.
    assert "validate:" in out.stdout
    run_dir = report.parent
    assert (run_dir / "report.html").is_file()
    printed = cli("report", str(run_dir))
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert "download" in printed.stdout and "validate" in printed.stdout
    assert "PASS" in printed.stdout and str(expected["rows"]) in printed.stdout
    latest = cli("report", "demo/latest", "--storage", str(tmp_path / "demo" / "store"))
    assert latest.returncode == 0 and latest.stdout.splitlines()[0] == printed.stdout.splitlines()[0]
    missing = cli("report", "demo/nope", "--storage", str(tmp_path / "demo" / "store"))
    assert missing.returncode == 2 and "no run.json" in missing.stderr


def test_a_setting_that_needs_a_gpu_stops_the_run_before_it_fetches_anything(tmp_path):
    """``cuda`` asked of a stage, on a local cluster with no GPU visible (CUDA_VISIBLE_DEVICES
    is empty, so on a GPU machine too): exit 2 naming every such setting, and nothing stored."""
    manifest = tmp_path / "m.csv"
    manifest.write_text("url,caption,license\nhttp://127.0.0.1:9/a.jpg,a,CC0-1.0\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"dataset: x\nstorage: {tmp_path / 's'}\nsources:\n  - name: a\n    manifest: {manifest}\n")
    sets = ["--set", "privacy.faces.mode=blur", "--set", "privacy.faces.device=cuda"]
    out = cli("run", str(recipe), *sets, env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{recipe}: privacy.faces.device: cuda: needs a CUDA GPU" in out.stderr
    assert "set it to auto" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "s").exists()


def test_the_settings_that_need_a_gpu_are_those_of_the_stages_the_phases_run(tmp_path):
    from flows.preflight import gpu_problem, gpu_settings
    from tasks.formats.recipe import parse_recipe

    def recipe(**blocks) -> object:
        base = {"dataset": "x", "storage": str(tmp_path), "sources": [{"name": "a", "manifest": "m.csv"}]}
        return parse_recipe({**base, **blocks})

    gpu = recipe(
        privacy={"faces": {"mode": "record", "device": "cuda"}},
        curate={"model": str(tmp_path), "device": "cuda", "decode": "gpu"},
        precache={"text": {"model": str(tmp_path)}, "decode": "gpu"},
    )
    everything = ["precache.decode: gpu", "privacy.faces.device: cuda", "curate.device: cuda", "curate.decode: gpu"]
    assert sorted(gpu_settings(gpu, ["release"])) == sorted(everything)
    assert gpu_settings(gpu, ["download"]) == []
    assert gpu_settings(gpu, ["validate"]) == ["privacy.faces.device: cuda"]
    assert len(gpu_settings(gpu, ["curate"])) == 3
    # A stage that is off asks nothing of the workers, whatever its device says.
    off = recipe(privacy={"faces": {"mode": "off", "device": "cuda"}}, precache={"device": "cuda"})
    assert gpu_settings(off, ["release"]) == []
    # An existing cluster's workers are not this machine's: they are not judged from here.
    remote = recipe(privacy={"faces": {"mode": "blur", "device": "cuda"}}, execution={"cluster": "tcp://10.0.0.9:8786"})
    assert gpu_problem(remote, ["release"]) is None


def test_an_error_quoting_hostile_text_cannot_drive_the_terminal(tmp_path):
    """A manifest's column names are third parties' text, quoted by the error that names them:
    an escape sequence there (clear the screen, set the title) reaches the terminal as text."""
    manifest = tmp_path / "m.csv"
    manifest.write_bytes(b"link\x1b[2J\x1b]0;pwned\x07,caption\nhttp://example.org/a.jpg,a\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"dataset: x\nstorage: {tmp_path / 's'}\nsources:\n  - name: a\n    manifest: {manifest}\n")
    out = cli("run", str(recipe))
    assert out.returncode == 1, out.stderr[-2000:]
    assert "ManifestError" in out.stderr and "link?[2J?]0;pwned?" in out.stderr
    assert "\x1b[2J" not in out.stderr and "\x07" not in out.stderr


def test_an_allowlist_entry_that_names_no_license_is_a_recipe_error(tmp_path):
    manifest = tmp_path / "m.csv"
    manifest.write_text("url,caption,license\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"dataset: x\nstorage: {tmp_path / 's'}\nsources:\n  - name: a\n    manifest: {manifest}\n"
        "validate:\n  license:\n    allow: [CC0-1.0, not-a-license]\n"
    )
    out = cli("run", str(recipe), "--phase", "download")
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{recipe}: validate.license:" in out.stderr and "not-a-license" in out.stderr
