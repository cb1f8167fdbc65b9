"""The benchmarks' shared harness (bench/harness): rounds, tables, and child processes it starts, times and stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from harness.procs import Children, Session, TreeSampler, run_child, run_json, timed  # noqa: E402
from harness.report import alternated, in_turn, med, medians, parse, parser, pick_tools, ratio, rounds, summary, table  # noqa: E402
from harness.tools import ToolRun, i2d_outputs, spread, tree_at  # noqa: E402

PY = sys.executable


def test_rounds_flip_the_order_every_round():
    assert list(alternated(["a", "b", "c"], 3)) == [
        (1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a"), (3, "a"), (3, "b"), (3, "c"),
    ]  # fmt: skip
    # Rounds counted from 0 start in the given order too.
    assert in_turn(("cp", "phase"), 0, first=0) == ["cp", "phase"]
    assert in_turn(("cp", "phase"), 1, first=0) == ["phase", "cp"]


def test_rounds_run_every_tool_in_turn_and_keep_what_each_returned(capsys):
    got = rounds(["a", "b"], 2, lambda tool, rnd: {"tool": tool, "round": rnd, "wall": 10.0 * rnd + (tool == "b")})
    assert [(r["tool"], r["round"]) for r in got] == [("a", 1), ("b", 1), ("b", 2), ("a", 2)]
    assert "round 2 b: round 2, wall 21" in capsys.readouterr().out
    assert medians(got, lambda r: r["wall"]) == {"a": 15.0, "b": 16.0}
    assert summary(got, {"wall s": ("wall", ".1f"), "why": (lambda r: None, "")}) == [
        "| tool | wall s | why |", "|---|---:|---:|", "| a | 15.0 | - |", "| b | 16.0 | - |",
    ]  # fmt: skip


def test_every_script_takes_the_shared_flags_and_refuses_unknown_tools(capsys):
    args = parse(parser("doc", repeats=2, quiet_wait=5.0, keep="unit"), ["--tools", "b"], tools=("a", "b"))
    assert (args.repeats, args.quiet_wait, args.keep, args.tools, args.markdown, args.child) == (2, 5.0, False, ["b"], None, None)  # fmt: skip
    with pytest.raises(SystemExit):
        parse(parser("doc"), ["--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_a_child_measurement_reports_its_own_peak_over_its_imports(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import json, sys\nsys.path.insert(0, sys.argv[3])\nfrom harness.procs import measured\n"
        "print(json.dumps(measured(lambda: {'kind': sys.argv[2], 'n': len(b'x' * (int(sys.argv[4]) << 20))})))\n"
    )
    got = run_child(str(script), "big", Path(__file__).resolve().parent.parent / "bench", 100)
    assert got["kind"] == "big" and got["n"] == 100 << 20 and got["seconds"] >= 0 and got["cpu"] >= 0
    # Its own peak (the 100 MB it held) over what it held before (its imports): not the forking
    # parent's RSS, which ru_maxrss would carry over (the pytest worker running this holds a GB).
    assert got["peak_mb"] >= 100 > got["base_mb"]


def test_medians_skip_missing_values_and_ratios_of_nothing_are_nothing():
    assert med([3.0, None, 1.0, 2.0]) == 2.0
    assert med([None]) is None
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(3.0, 0.0) is None


def test_markdown_table_aligns_numbers_right_and_the_first_column_left():
    assert table(["tool", "s"], [["a", 1.5], ["b", "-"]]) == [
        "| tool | s |",
        "|---|---:|",
        "| a | 1.5 |",
        "| b | - |",
    ]
    assert table(["a", "b", "c"], [], align="llr")[1] == "|---|---|---:|"


def test_spread_gives_medians_and_bests_of_a_tools_runs():
    runs = [
        ToolRun("t", 1, wall_s=10.0, cpu_s=20.0, ok=100, rows=100, phase_s=5.0),
        ToolRun("t", 2, wall_s=20.0, cpu_s=10.0, ok=100, rows=100),
        ToolRun("t", 3, wall_s=40.0, cpu_s=40.0, ok=98, rows=100, phase_s=4.0),
    ]
    s = spread(runs)
    assert (s["n"], s["wall"], s["wall_best"]) == (3, 20.0, 10.0)
    assert (s["rate"], s["rate_best"]) == (5.0, 10.0)
    assert (s["phase_rate"], s["phase_rate_best"]) == (22.25, 24.5)  # the run without a phase is left out
    assert (s["cpu_1k"], s["cpu_1k_best"]) == (200.0, 100.0)
    assert (s["ok"], s["rows"]) == ([98, 100], 100)


def test_timed_counts_the_whole_tree_and_fails_loudly(tmp_path):
    children = Children()
    # A child that starts a grandchild: both burn CPU, the grandchild is waited for.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}])\n{burn}print('done')\n"
    t = timed(children, [PY, "-c", code], dict(os.environ), tmp_path, tmp_path / "log")
    assert t.stdout.strip() == "done"
    assert t.cpu_s >= 0.6  # both processes' CPU, the grandchild's included
    assert "other" in t.watched and t.sampler.peak_rss > 0
    run = ToolRun("t", 1)
    run.took(t)
    assert run.cpu_s == t.cpu_s and run.peak_rss_mb == t.sampler.peak_rss / 2**20 > 1  # MB of the tree
    with pytest.raises(SystemExit, match="exited with 3"):
        timed(children, [PY, "-c", "import sys; sys.exit(3)"], dict(os.environ), tmp_path, tmp_path / "log")
    with pytest.raises(SystemExit, match="did not finish within"):
        timed(
            children, [PY, "-c", "import time; time.sleep(30)"], dict(os.environ), tmp_path, tmp_path / "log", timeout=1
        )
    assert children.procs == []


def test_session_stops_every_child_and_removes_its_folder_when_interrupted(monkeypatch, tmp_path):
    monkeypatch.setattr("harness.procs.BENCH_DIR", tmp_path)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as ended:
            with Session("unit") as s:
                # A child with a grandchild that ignores SIGTERM: the tree still goes.
                code = "import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                code += "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\ntime.sleep(60)\n"
                proc = s.children.start([PY, "-c", code])
                deadline = time.monotonic() + 10
                while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
                    time.sleep(0.05)
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                work = s.work
                raise KeyboardInterrupt
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert ended.value.code == 130
    assert not work.exists()
    gone, alive = psutil.wait_procs(tree, timeout=5)
    assert alive == [] and len(gone) == 2


def test_tree_sampler_keeps_the_peak_rss_of_the_tree():
    code = "import time\nblock = bytearray(200 * 2**20)\nblock[::4096] = b'x' * len(block[::4096])\ntime.sleep(1.5)\n"
    proc = subprocess.Popen([PY, "-c", code])
    with TreeSampler(interval=0.05) as sampler:
        proc.wait(30)
    assert sampler.peak_rss > 200 * 2**20  # this process and the child holding 200 MB


def test_run_json_reads_the_last_line_and_says_why_a_child_failed():
    assert run_json([PY, "-c", "print('noise'); print('{\"rows\": 3}')"]) == {"rows": 3}
    with pytest.raises(SystemExit, match="ValueError: broken"):
        run_json([PY, "-c", "raise ValueError('broken')"])


def test_img2dataset_outputs_are_read_across_shards(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, (statuses, start, end) in enumerate(
        [(["success", "failed_to_download"], 10.0, 14.0), (["success"], 11.0, 17.5)]
    ):
        pq.write_table(pa.table({"status": statuses, "url": [f"u{i}"] * len(statuses)}), tmp_path / f"{i:05d}.parquet")
        (tmp_path / f"{i:05d}_stats.json").write_text(json.dumps({"start_time": start, "end_time": end}))
    rows, phase = i2d_outputs(tmp_path, ["status"])
    assert rows == {"status": ["success", "failed_to_download", "success"]}
    assert phase == 7.5
    assert i2d_outputs(tmp_path / "none") == ({}, None)


def test_tools_flag_keeps_the_order_given_and_refuses_unknown_tools(capsys):
    import argparse

    p = argparse.ArgumentParser()
    assert pick_tools(p, "c, a", ("a", "b", "c")) == ["c", "a"]
    with pytest.raises(SystemExit):
        pick_tools(p, "a,z", ("a", "b", "c"))
    assert "unknown ['z']" in capsys.readouterr().err


def test_tree_at_extracts_the_tasks_package_of_a_commit_once(monkeypatch, tmp_path):
    monkeypatch.setattr("harness.tools.BENCH_DIR", tmp_path)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    folder = tree_at(commit.stdout.strip())
    assert (folder / "tasks" / "__init__.py").is_file()
    assert not (folder / "bench").exists()  # only the package
    (folder / "tasks" / "marker").write_text("kept")
    assert tree_at(commit.stdout.strip()) == folder and (folder / "tasks" / "marker").exists()  # not extracted again
