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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
BENCH_DIR = REPO / ".bench"
SAMPLE_S = 0.25  # TreeSampler's interval
if str(REPO) not in sys.path:  # the scripts import the project's packages from this checkout
    sys.path.insert(1, str(REPO))


class Children:
    """Child processes, each in its own session (one kill ends its tree), all stopped at exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.stop_all)

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:
        self.procs.append(proc := subprocess.Popen(cmd, start_new_session=True, **kw))
        return proc

    def stop(self, proc: subprocess.Popen, grace: float = 10.0) -> None:
        """SIGTERM to its tree, then SIGKILL to whatever is left of it (a worker that ignored SIGTERM)."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
            if sig == signal.SIGKILL or proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(wait)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class Session:
    """One invocation: its children and a work folder ``.bench/NAME/runs/TIMESTAMP-*``, both gone at the end (the
    folder kept when ``keep``, e.g. set when a run failed); SIGTERM acts as Ctrl-C."""

    def __init__(self, name: str, keep: bool = False) -> None:
        self.keep, self.children = keep, Children()
        (root := BENCH_DIR / name / "runs").mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix=dt.datetime.now().strftime("%Y%m%dT%H%M%S-"), dir=root))

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


def tree_cpu(pid: int | None = None, reaped: bool = True) -> float:
    """User+sys seconds of a live process (default: this one) and its descendants (``reaped``: and theirs waited for)."""
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
    """User+sys seconds of this process (all threads) and of its children waited for (pool workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime + children_cpu()


def peak_rss_mb(children: bool = False) -> float:
    """Peak RSS of this process (``VmHWM``: of its own address space, which ``ru_maxrss`` is not, as it
    keeps the forking parent's RSS across exec), or of the largest child waited for (``ru_maxrss``), in MB."""
    if not children:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024.0
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0


def busy_cpu() -> float:
    """CPU seconds of every process on the machine since boot (not irq time: our loopback traffic lands there)."""
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
    lap, t0, c0 = Lap(), time.perf_counter(), cpu()
    try:
        yield lap
    finally:
        lap.wall, lap.cpu = time.perf_counter() - t0, cpu() - c0


def measured(work: Callable[[], dict]) -> dict:
    """``work()``'s figures with its ``seconds``, ``cpu`` (with children waited for), ``base_mb`` (peak RSS before it:
    the imports) and ``peak_mb``; in a fresh process (:func:`run_child`), its own."""
    base = peak_rss_mb()
    with clock(process_cpu) as lap:
        out = work()
    return out | {
        "seconds": lap.wall,
        "cpu": lap.cpu,
        "base_mb": base,
        "peak_mb": max(peak_rss_mb(), peak_rss_mb(True)),
    }


def settle(max_wait: float, threshold: float = 0.3, window: float = 3.0) -> float | None:
    """Wait up to ``max_wait`` s (0: not at all) for other work to use under ``threshold`` cores; the last load seen."""
    deadline, load = time.monotonic() + max_wait, None
    while max_wait > 0:
        b0 = busy_cpu()
        time.sleep(window)
        load = (busy_cpu() - b0) / window
        if load < threshold or time.monotonic() >= deadline:
            if load >= threshold:
                print(f"  (other work still uses {load:.1f} cores after {max_wait:g} s; running anyway)", flush=True)
            break
    return load


class TreeSampler(threading.Thread):
    """Samples a process tree (default: this process's) every ``interval`` s: its peak RSS, each process's start time
    and CPU, the latter under its ``role(process, root)`` (for a split; totals come from rusage)."""

    def __init__(self, pid: int | None = None, role: Callable | None = None, interval: float = SAMPLE_S) -> None:
        super().__init__(daemon=True)
        self.pid, self.role, self.interval = os.getpid() if pid is None else pid, role, interval
        self.per_pid: dict[int, tuple[str, float]] = {}
        self.started: dict[int, float] = {}
        self.peak_rss, self._stop_event = 0, threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop_event.is_set():
            with contextlib.suppress(psutil.Error):
                rss = 0
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        role = self.per_pid.get(p.pid, (None,))[0] or (self.role(p, root) if self.role else "all")
                        self.per_pid[p.pid], rss = (role, sum(p.cpu_times()[:2])), rss + p.memory_info().rss
                        self.started.setdefault(p.pid, p.create_time())
                self.peak_rss = max(self.peak_rss, rss)
            self._stop_event.wait(self.interval)

    def stop_leftovers(self) -> list[str]:
        """Kill the processes seen in the tree that still run: found by pid and start time, never by name."""
        import psutil

        left = []
        for pid, created in self.started.items():
            with contextlib.suppress(psutil.Error):
                if (p := psutil.Process(pid)).create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:80]}")
                    p.kill()
        return left

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


@dataclass
class Timed:
    """A finished command: wall and tree CPU s, watched processes' CPU (``other``: other work's)."""

    wall_s: float
    cpu_s: float
    watched: dict[str, float]
    stdout: str
    sampler: TreeSampler

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
    leftovers: bool = False,
) -> Timed:
    """Run ``cmd`` (stderr to ``log``), sampling its tree; CPU is its whole tree's (``RUSAGE_CHILDREN``). ``watch``:
    servers whose CPU meanwhile is kept apart, with other work's (``other``); ``leftovers``: kill what the command
    left running. SystemExit when it fails or runs past ``timeout`` s."""
    watch = watch or {}
    before_watch = {k: tree_cpu(pid) for k, pid in watch.items()}
    busy0, cpu0, t0 = busy_cpu(), children_cpu(), time.perf_counter()
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
            if leftovers and (left := sampler.stop_leftovers()):
                print(f"  warning: {cmd[0]} left processes behind, killed: {left}", flush=True)
    wall, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    watched = {k: tree_cpu(pid) - before_watch[k] for k, pid in watch.items()}
    watched["other"] = max(0.0, busy_cpu() - busy0 - cpu - sum(watched.values()))
    if out is None:
        raise SystemExit(f"{cmd[0]} did not finish within {timeout:g} s and was stopped; stderr: {log}")
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{cmd[0]} exited with {proc.returncode}; stderr tail ({log}):\n{tail}")
    return Timed(wall, cpu, watched, out.decode(errors="replace"), sampler)


def run_json(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> dict:
    """Run a measuring child to completion and return the JSON object on its last stdout line."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited with {done.returncode}:\n{done.stderr.strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child(script: str, *args: object, env: dict[str, str] | None = None, timeout: float | None = None) -> dict:
    """``python SCRIPT --child ARGS`` in a fresh interpreter: the JSON line it prints last (its figures)."""
    return run_json([sys.executable, script, "--child", *map(str, args)], env, timeout)
