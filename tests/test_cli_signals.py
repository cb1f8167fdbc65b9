"""SIGTERM and SIGINT end `shardsmith run` promptly: workers stopped, lock released, only committed shards left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 30  # what the README promises


def _recipe(tmp_path: Path, web) -> Path:
    # Chunk 0 is five quick rows, chunk 1 five rows whose bodies drip one byte every 0.5 s:
    # the first commits, the second is still fetching when the signal comes.
    rows = ["url,caption,license"]
    rows += [f"{web.url('/img/a.jpg')}?u={i},a red square number {i},CC0-1.0" for i in range(5)]
    rows += [f"{web.url('/slow/a.jpg')}?u={i},a slow square number {i},CC0-1.0" for i in range(5)]
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"""dataset: sig
storage: {tmp_path / "store"}
sources:
  - name: s
    manifest: {tmp_path / "m.csv"}
    rows_per_shard: 5
download:
  timeout_s: 600
  retries: 0
  network:
    allowed_networks: ["127.0.0.1/32"]
    any_port: true
execution:
  cluster: local
  workers: 2
"""
    )
    return recipe


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_within_the_grace_period(tmp_path, web, signum):
    recipe = _recipe(tmp_path, web)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "run", str(recipe), "--phase", "download"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    store = tmp_path / "store" / "sig"
    try:
        deadline = time.monotonic() + 300
        # Wait until the quick chunk has committed (its ledger exists) and the slow one is fetching.
        while not list((store / "download").rglob("000000-*.ledger.parquet")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the quick shard never committed"
            time.sleep(0.5)
        time.sleep(1.0)
        children = _descendants(proc.pid)
        assert children, "the run has no worker processes"
        # SIGINT as a terminal's Ctrl-C sends it: to the whole foreground process group.
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=GRACE_S + 30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert took < GRACE_S, f"took {took:.1f} s to stop"
    assert proc.returncode == 128 + signum, err[-3000:]
    assert f"{signal.Signals(signum).name}: stopping" in err
    assert "Traceback" not in err
    # Every process the run started is gone (the server and the workers).
    time.sleep(1.0)
    alive = [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {alive}"
    # The lock is released; the quick shard is committed, the slow one left nothing that counts.
    assert not (store / "run.lock").exists()
    # (a temp name is a write in progress, never a committed file)
    ledgers = sorted(p.name for p in (store / "download").rglob("*.ledger.parquet") if not p.name.startswith(".tmp-"))
    tars = sorted(p.name for p in (store / "download").rglob("*.tar") if not p.name.startswith(".tmp-"))
    assert [n.split("-")[0] for n in ledgers] == ["000000"]
    assert [n.split("-")[0] for n in tars] == ["000000"]


_STUCK = """
import sys, time
import flows.session as fs
from tasks.formats.locks import RunLock
from tasks.formats.storage import Storage

fs.STOP_GRACE_S = 1.0
with fs.stop_on_signals(fs.Session("local")):
    with RunLock(Storage(sys.argv[1]), "ds", "stuck"):
        try:
            # Said inside the try: the test's SIGINT may come as soon as it reads this line, and
            # one that came before the try would end the run cleanly, not leave it stuck.
            print("held", flush=True)
            time.sleep(600)
        except KeyboardInterrupt:  # a stop that never gets to release the lock
            while True:
                time.sleep(1)
"""


def test_a_run_whose_stop_hangs_is_ended_by_its_watchdog_and_frees_the_dataset(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK, str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "held\n", proc.communicate()[1][-3000:]
        assert (tmp_path / "ds" / "run.lock").exists()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "did not stop within" in err
    # The watchdog released the lock the stuck main thread still held: the next run need not
    # wait for the dead pid to be noticed.
    assert not (tmp_path / "ds" / "run.lock").exists()
