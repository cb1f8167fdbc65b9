"""``make gpu-check``: every GPU figure of the project in one run, on the first machine with a GPU.

Runs every ``gpu``-marked test (tests/conftest.py skips them where torch sees no CUDA GPU) and the
GPU modes of the precache, curation and clip-decode benchmarks, each under a time limit so that
the whole run stays under ten minutes, and writes every command with its output, exit status and
seconds to one markdown file (``.bench/gpu-check/results.md``; ``--out`` for another), rewritten
after each step so that an interrupted run keeps what it measured.

Without a GPU (``nvidia-smi -L`` lists none, or torch in this interpreter sees no CUDA device,
``CUDA_VISIBLE_DEVICES=`` included) it prints one line, writes nothing and exits 0. Otherwise it
exits 0 when every step ran and passed, 1 when one failed, ran out of time or could not run (a
benchmark whose ``--help`` lacks the flag of its GPU mode: the file says which).

Only the standard library and the benchmarks' harness (``bench/harness``, which imports nothing
else at the top): it decides whether there is a GPU before anything imports torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness.report import revision  # noqa: E402

DEFAULT_OUT = REPO / ".bench" / "gpu-check" / "results.md"
# The whole run, in seconds from its start (the GPU probe, each step's --help probe, the steps
# and the file): under ten minutes. Each step also has a limit of its own (Step.limit_s).
BUDGET_S = 570.0
MIN_STEP_S = 15.0  # a step with less time left than this is not started
KEEP_LINES = 2000  # of a step's output, the last lines kept in the file


@dataclass(frozen=True)
class Step:
    """One command of the check.

    Args:
        name: its heading in the results.
        argv: the command, run in the repository's root.
        limit_s: its own time limit (the run's budget may leave it less).
        needs: flags its ``--help`` must list (the benchmark's GPU mode); none for the tests.
    """

    name: str
    argv: tuple[str, ...]
    limit_s: float
    needs: tuple[str, ...] = ()


@dataclass
class Outcome:
    step: Step
    code: int | None  # None: not run
    seconds: float
    output: str
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0


def plan(python: str) -> list[Step]:
    """The check's steps: the gpu-marked tests, then each benchmark in its GPU mode at a size
    that takes about a minute on one GPU."""
    return [
        Step(
            "gpu-marked tests",
            (python, "-m", "pytest", "tests", "-m", "gpu", "-q", "-n", "0", "-p", "no:cacheprovider", "-rA"),
            210,
        ),
        Step(
            "face detection (bench/bench_privacy.py --stage faces, --gpu)",
            (python, "bench/bench_privacy.py", "--images", "40", "--stage", "faces", "--gpu", "--repeats", "2"),
            60,
            ("--gpu",),
        ),
        Step(
            "precache (bench/bench_models.py --stage precache, --device cuda)",
            (
                python,
                "bench/bench_models.py",
                "--device",
                "cuda",
                "--stage",
                "precache",
                "--samples",
                "256",
                "--repeats",
                "3",
            ),
            100,
            ("--device",),
        ),
        Step(
            "curation embedding (bench/bench_models.py --stage curate, --device cuda)",
            (
                python,
                "bench/bench_models.py",
                "--device",
                "cuda",
                "--stage",
                "curate",
                "--samples",
                "256",
                "--repeats",
                "3",
            ),
            100,
            ("--device",),
        ),
        Step(
            "clip decode (bench/bench_video.py --stage decode, --device mixed)",
            (
                python,
                "bench/bench_video.py",
                "--device",
                "mixed",
                "--stage",
                "decode",
                "--codec",
                "h264",
                "--repeats",
                "3",
            ),
            100,
            ("--device",),
        ),
    ]


def gpu_here(python: str) -> tuple[bool, str]:
    """Whether this machine has a GPU the project can use, and what says so (or why not)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False, "nvidia-smi not found"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"nvidia-smi -L: {err}"
    gpus = [line for line in listed.stdout.splitlines() if line.startswith("GPU ")]
    if listed.returncode != 0 or not gpus:
        return False, "nvidia-smi -L lists no GPU"
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__)"
    try:
        seen = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"torch could not be asked: {err}"
    words = seen.stdout.split()
    if seen.returncode != 0 or not words or words[0] == "0":
        return False, f"nvidia-smi lists {len(gpus)} GPU(s), torch sees no CUDA device (CUDA_VISIBLE_DEVICES?)"
    return True, "\n".join([*gpus, f"torch {words[-1]} sees {words[0]} CUDA device(s)"])


def missing_flags(step: Step) -> list[str]:
    """The flags of ``step.needs`` that its script's ``--help`` does not list (all of them when
    the help does not answer)."""
    if not step.needs:
        return []
    try:
        helped = subprocess.run(
            [*step.argv[:2], "--help"], capture_output=True, text=True, timeout=30, cwd=REPO, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return list(step.needs)
    return [flag for flag in step.needs if flag not in helped.stdout]


def run_step(step: Step, limit_s: float) -> Outcome:
    """Run one step in its own process group (killed whole at its limit), output and errors
    together."""
    started = time.monotonic()
    proc = subprocess.Popen(
        step.argv,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    note = ""
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        note = f"killed after its limit of {limit_s:.0f} s"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    code = proc.returncode if not note else 124
    return Outcome(step, code, time.monotonic() - started, out or "", note)


def run_all(steps: list[Step], out: Path, header: list[str], deadline: float) -> list[Outcome]:
    """Each step in turn until ``deadline`` (a ``time.monotonic()``), the results file rewritten
    after each."""
    done: list[Outcome] = []
    for step in steps:
        missing = missing_flags(step)
        left = deadline - time.monotonic()
        if missing:
            outcome = Outcome(step, None, 0.0, "", f"not run: its --help lists no {', '.join(missing)} (no GPU mode)")
        elif left < MIN_STEP_S:
            outcome = Outcome(step, None, 0.0, "", f"not run: {max(left, 0):.0f} s of the run's {BUDGET_S:.0f} s left")
        else:
            print(f"gpu-check: {step.name} ...", flush=True)
            outcome = run_step(step, min(step.limit_s, left))
        done.append(outcome)
        print(f"gpu-check: {step.name}: {status(outcome)}", flush=True)
        write_results(out, header, done)
    return done


def status(o: Outcome) -> str:
    if o.code is None:
        return o.note
    word = "ok" if o.ok else "FAILED"
    return f"{word}, exit {o.code}, {o.seconds:.0f} s" + (f" ({o.note})" if o.note else "")


def write_results(out: Path, header: list[str], outcomes: list[Outcome]) -> None:
    lines = [*header, "", "| step | result | command |", "|---|---|---|"]
    lines += [f"| {o.step.name} | {status(o)} | `{display(o.step.argv)}` |" for o in outcomes]
    for o in outcomes:
        lines += ["", f"## {o.step.name}", "", f"`{display(o.step.argv)}`", "", f"Result: {status(o)}"]
        if o.code is not None:
            kept = o.output.splitlines()
            if len(kept) > KEEP_LINES:
                kept = [f"[{len(kept) - KEEP_LINES} earlier lines left out]", *kept[-KEEP_LINES:]]
            fence = "`" * max(3, longest_backticks(o.output) + 1)
            lines += ["", fence + "text", *kept, fence]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out)


def longest_backticks(text: str) -> int:
    longest = run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return longest


def display(argv: tuple[str, ...]) -> str:
    """A command as someone would type it in the repository's root: the interpreter as
    .venv/bin/python where it is that one."""
    first = argv[0]
    with_venv = Path(first).parent.parent == REPO / ".venv"
    return shlex.join([".venv/bin/python" if with_venv else first, *argv[1:]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the results file (default %(default)s)")
    args = ap.parse_args(argv)
    began = time.monotonic()
    python = sys.executable
    found, what = gpu_here(python)
    if not found:
        print(f"gpu-check: no GPU here: skipped ({what})")
        return 0
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        "# make gpu-check",
        "",
        f"{started}, commit {revision()}; {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}",
        "",
        "```text",
        *what.splitlines(),
        "```",
    ]
    outcomes = run_all(plan(python), args.out, header, began + BUDGET_S)
    failed = [o.step.name for o in outcomes if not o.ok]
    took = time.monotonic() - began
    print(f"gpu-check: {len(outcomes) - len(failed)} of {len(outcomes)} steps passed in {took:.0f} s; see {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
