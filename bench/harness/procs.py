"""Child processes of a benchmark: started, stopped, timed, their CPU seconds and peak memory."""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
BENCH_DIR = REPO / ".bench"
SAMPLE_S = 0.25  # TreeSampler's interval


class Children:
    """Child processes, each in its own session so that one kill ends its tree.

    Every child still running is stopped when the interpreter exits (``atexit``), whatever
    ended the benchmark.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.stop_all)

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, grace: float = 10.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
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


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class Session:
    """One invocation: its child processes and a fresh work folder, both cleaned up at the end.

    SIGTERM ends it as Ctrl-C does; either stops every child and exits with status 130.

    Args:
        name: the work folder is ``.bench/NAME/runs/TIMESTAMP-*``.
        keep: keep the work folder at the end (may be set later, e.g. when a run failed). Default False.
    """

    def __init__(self, name: str, keep: bool = False) -> None:
        self.keep = keep
        self.children = Children()
        self.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        self.started = dt.datetime.now().astimezone()
        root = BENCH_DIR / name / "runs"
        root.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix=self.started.strftime("%Y%m%dT%H%M%S-"), dir=root))

    def __enter__(self) -> Session:
        signal.signal(signal.SIGTERM, _interrupt)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is KeyboardInterrupt:
            print("interrupted; stopping child processes", file=sys.stderr)
        self.children.stop_all()
        if self.keep:
            print(f"run folders kept in {self.work}", flush=True)
        else:
            shutil.rmtree(self.work, ignore_errors=True)
        if kind is KeyboardInterrupt:
            raise SystemExit(130)


# ------------------------------------------------------------------------------ CPU and memory


def tree_cpu(pid: int | None = None, reaped: bool = True) -> float:
    """User+sys seconds of a live process (default: this one) and its descendants.

    ``reaped``: also the children each of them has waited for (``children_user``/``_system``).
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # exited meanwhile
            t = p.cpu_times()
            total += t.user + t.system + ((t.children_user + t.children_system) if reaped else 0.0)
    return total


def children_cpu() -> float:
    """User+sys seconds of this process's children that have been waited for."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def process_cpu() -> float:
    """User+sys seconds of this process (all threads) and of its children waited for (pool
    workers and DataLoader workers are joined at the end of a pass, so their time lands here)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime + children_cpu()


def peak_rss_mb(children: bool = False) -> float:
    """Peak RSS (``ru_maxrss``) of this process, or of the largest child waited for, in MB."""
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss / 1024.0  # KiB on Linux


def busy_cpu() -> float:
    """User+system CPU seconds of every process on the machine since boot (all cores).

    Interrupt and softirq time is left out: loopback traffic of our own runs lands there.
    """
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system


@dataclass
class Lap:
    """Wall and CPU seconds of a ``with clock():`` block."""

    wall: float = 0.0
    cpu: float = 0.0


@contextlib.contextmanager
def clock(cpu: Callable[[], float] = time.process_time) -> Iterator[Lap]:
    """Time the block: wall seconds and ``cpu()`` seconds (default: this process, all threads)."""
    lap = Lap()
    t0, c0 = time.perf_counter(), cpu()
    try:
        yield lap
    finally:
        lap.wall, lap.cpu = time.perf_counter() - t0, cpu() - c0


# ---------------------------------------------------------------------------- a quiet machine


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


def settle(max_wait: float, threshold: float = 0.3) -> float | None:
    """Before a run: :func:`wait_for_quiet` (none when ``max_wait`` is 0), saying so when it gave up."""
    if max_wait <= 0:
        return None
    load = wait_for_quiet(max_wait, threshold)
    if load >= threshold:
        print(f"  (other work still uses {load:.1f} cores after {max_wait:g} s; running anyway)", flush=True)
    return load


def wait_for_load(below: float, timeout: float) -> float:
    """Wait up to ``timeout`` s for the 1-minute load average (runnable and disk-waiting tasks)
    to fall below ``below``; return it."""
    deadline = time.monotonic() + timeout
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


# ------------------------------------------------------------------------------ sampled trees


def default_role(p, root) -> str:
    """``main`` (the root), ``workers`` (multiprocessing children) or ``helpers``."""
    if p.pid == root.pid:
        return "main"
    with contextlib.suppress(Exception):
        cmd = " ".join(p.cmdline())
        if "resource_tracker" in cmd:
            return "helpers"
        if "spawn_main" in cmd or "multiprocessing" in cmd:
            return "workers"
    return "helpers"


class TreeSampler(threading.Thread):
    """Samples a process tree in a thread: CPU per process and along time, and peak RSS.

    ``per_pid`` keeps each process's last seen user+sys (a process's final fraction of a
    sample interval is missed: totals come from rusage, this is for the split).

    Args:
        pid: the tree's root. Default: this process.
        role: ``(psutil.Process, root) -> name`` its CPU is counted under. Default :func:`default_role`.
        interval: seconds between samples. Default ``SAMPLE_S`` (0.25).
    """

    def __init__(self, pid: int | None = None, role: Callable | None = None, interval: float = SAMPLE_S) -> None:
        super().__init__(daemon=True)
        self.pid = os.getpid() if pid is None else pid
        self.role = role or default_role
        self.interval = interval
        self.per_pid: dict[int, tuple[str, float]] = {}
        self.timeline: list[tuple[float, float, float]] = []  # (time.time(), tree CPU, the root's own CPU)
        self.peak_rss = 0  # bytes, summed over the tree
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop_event.is_set():
            with contextlib.suppress(psutil.Error):
                total = main = 0.0
                rss = 0
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        t = p.cpu_times()
                        own = t.user + t.system
                        total += own + t.children_user + t.children_system
                        if p.pid == root.pid:
                            main = own
                        role = self.per_pid.get(p.pid, (None,))[0] or self.role(p, root)
                        self.per_pid[p.pid] = (role, own)
                        rss += p.memory_info().rss
                self.timeline.append((time.time(), total, main))
                self.peak_rss = max(self.peak_rss, rss)
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)

    def __enter__(self) -> TreeSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, cpu in self.per_pid.values():
            out[role] = out.get(role, 0.0) + cpu
        return out

    def cpu_between(self, t0: float, t1: float, column: int = 1) -> float:
        """CPU spent between two wall-clock times (interpolated on the samples): the tree's
        (``column`` 1) or the root process's own (``column`` 2)."""
        series = [(row[0], row[column]) for row in self.timeline]
        return max(0.0, self._interp(series, t1) - self._interp(series, t0))

    def _interp(self, series: list[tuple[float, float]], t: float) -> float:
        if not series:
            return 0.0
        if t <= series[0][0]:
            return 0.0 if t < series[0][0] - self.interval else series[0][1]
        for (ta, ca), (tb, cb) in zip(series, series[1:]):
            if ta <= t <= tb:
                return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else cb
        return series[-1][1]


# -------------------------------------------------------------------------------- timed runs


@dataclass
class Timed:
    """A finished command: wall and tree CPU seconds, the watched processes' CPU meanwhile."""

    wall_s: float
    cpu_s: float
    watched: dict[str, float]  # CPU s of each watched pid, and "other": the machine's other work
    stdout: str
    started: float  # time.time() at launch
    sampler: TreeSampler
    extra: dict = field(default_factory=dict)

    @property
    def other_s(self) -> float:
        return self.watched["other"]


def timed(
    children: Children,
    cmd: list[str],
    env: dict[str, str],
    cwd: Path,
    log: Path,
    watch: dict[str, int] | None = None,
    timeout: float | None = None,
    role: Callable | None = None,
) -> Timed:
    """Run ``cmd`` to completion (stderr to ``log``), sampling its tree meanwhile.

    CPU is user+sys of the command's whole tree (``RUSAGE_CHILDREN`` deltas, which include
    waited-for grandchildren). ``watch``: long-lived processes (servers) whose tree CPU during
    the run is reported apart; ``watched["other"]`` is the machine's busy CPU meanwhile less
    the command's and the watched ones': work by processes outside the benchmark.
    ``timeout``: stop the command's process group after this many seconds and fail the run.
    Raises SystemExit when the command fails.
    """
    watch = watch or {}
    before_watch = {k: tree_cpu(pid) for k, pid in watch.items()}
    busy0 = busy_cpu()
    cpu0 = children_cpu()
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
    cpu = children_cpu() - cpu0
    watched = {k: tree_cpu(pid) - before_watch[k] for k, pid in watch.items()}
    watched["other"] = max(0.0, busy_cpu() - busy0 - cpu - sum(watched.values()))
    if out is None:
        raise SystemExit(f"{cmd[0]} did not finish within {timeout:g} s and was stopped; stderr: {log}")
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{cmd[0]} exited with {proc.returncode}; stderr tail ({log}):\n{tail}")
    return Timed(wall, cpu, watched, out.decode(errors="replace"), started, sampler)


def run_json(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> dict:
    """Run a measuring child to completion and return the JSON object on its last stdout line."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited with {done.returncode}:\n{done.stderr.strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
