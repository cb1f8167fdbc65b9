"""`make gpu-check` (tools/gpu_check.py): skips cleanly without a GPU; on one, runs each step in its
GPU mode within its time and writes every command, its output and exit status to one file."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_check_tool", ROOT / "tools" / "gpu_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_in_one_line_and_succeeds(tmp_path):
    out = tmp_path / "results.md"
    # No GPU for torch on any machine this runs on (a GPU machine too), whatever nvidia-smi lists.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and "no GPU here: skipped" in lines[0], done.stdout
    assert not out.exists()
    # `make gpu-check` runs this very script (dry run: nothing is installed or run).
    # --no-print-directory: under `make test` this make is a sub-make, which prints its directory.
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "gpu-check"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0 and dry.stdout.splitlines()[-1] == ".venv/bin/python tools/gpu_check.py"


def test_the_plan_asks_each_benchmark_for_its_gpu_mode_and_fits_ten_minutes():
    tool = load_tool()
    # Keyed by script and stage: precache and curation are bench_models.py's, clip decode bench_video.py's,
    # face detection bench_privacy.py's.
    steps = {" ".join(s.argv[1:2] + s.argv[4:6] if "--stage" in s.argv else s.argv[1:2]): s for s in tool.plan(sys.executable)}  # fmt: skip
    assert steps["-m"].argv[2:6] == ("pytest", "tests", "-m", "gpu")
    assert steps["bench/bench_models.py --stage precache"].argv[2:4] == ("--device", "cuda")
    assert steps["bench/bench_models.py --stage curate"].argv[2:4] == ("--device", "cuda")
    assert steps["bench/bench_video.py --stage decode"].argv[2:4] == ("--device", "mixed")
    assert "--gpu" in steps["bench/bench_privacy.py --stage faces"].argv
    assert len(steps) == 5 and tool.BUDGET_S < 600 and sum(s.limit_s for s in steps.values()) <= tool.BUDGET_S
    # Each benchmark has its GPU mode's flag.
    for key in (
        "bench/bench_models.py --stage precache",
        "bench/bench_models.py --stage curate",
        "bench/bench_video.py --stage decode",
        "bench/bench_privacy.py --stage faces",
    ):
        assert tool.missing_flags(steps[key]) == [], key


def test_results_hold_every_command_its_output_and_status(tmp_path, monkeypatch):
    tool = load_tool()
    py = sys.executable
    steps = [
        tool.Step("passes", (py, "-c", "print('figure 12.5 samples/s')"), 30),
        tool.Step("fails", (py, "-c", "import sys; print('```'); sys.exit(3)"), 30),
        tool.Step("hangs", (py, "-c", "import time; print('started', flush=True); time.sleep(60)"), 1),
        tool.Step("no gpu mode", (py, "-c", "pass"), 30, ("--no-such-flag",)),
    ]
    out = tmp_path / "gpu-check" / "results.md"
    outcomes = tool.run_all(steps, out, ["# make gpu-check"], time.monotonic() + 60)
    assert [o.code for o in outcomes] == [0, 3, 124, None]
    text = out.read_text()
    assert "figure 12.5 samples/s" in text and "killed after its limit of 1 s" in text and "started" in text
    assert "not run: its --help lists no --no-such-flag (no GPU mode)" in text
    assert "````text\n```\n````" in text  # output with a fence of its own stays inside the block
    assert text.count("\n## ") == 4 and all(f"`{tool.display(s.argv)}`" in text for s in steps)
    # A step with less time left than it needs to start is not started.
    late = tool.run_all(steps[:1], out, ["# make gpu-check"], time.monotonic() + 5)
    assert late[0].code is None and late[0].note.startswith("not run:")
