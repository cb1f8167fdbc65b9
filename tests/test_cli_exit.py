"""How the `shardsmith` process ends: exit handlers run, output complete, status kept, no teardown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A fresh interpreter that registers an exit handler, holds an object whose finaliser would run
# only in Python's own shutdown, prints 1 MB without flushing (to a pipe: block-buffered) and
# then ends the way cli.main ends, or with sys.exit for comparison.
SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from cli.main import exit_now

out = Path(sys.argv[1])
how, code = sys.argv[2], eval(sys.argv[3])

class Finalised:
    def __del__(self):
        (out / "torn-down").write_text("yes")

kept = Finalised()
atexit.register(lambda: (out / "exit-handler").write_text("ran"))
if how == "thread":
    def late():
        time.sleep(0.5)
        (out / "thread").write_text("finished")
    threading.Thread(target=late).start()
sys.stdout.write("x" * 1_000_000 + "\\nend\\n")
if how == "sys.exit":
    sys.exit(code)
exit_now(code)
"""


def _end(tmp_path: Path, how: str, code: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), how, repr(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("code", "status", "said"), [(0, 0, ""), (None, 0, ""), (3, 3, ""), ("no recipe", 1, "no recipe")]
)
def test_the_cli_exits_with_its_status_and_output_but_without_python_s_teardown(tmp_path, code, status, said):
    ended = _end(tmp_path, "exit_now", code)
    assert ended.returncode == status
    assert ended.stdout.endswith("x\nend\n") and len(ended.stdout) == 1_000_005  # all of it, flushed
    assert ended.stderr.strip() == said  # as sys.exit("message") says it
    assert (tmp_path / "exit-handler").read_text() == "ran"  # logging's flush, Prefect's drains
    assert not (tmp_path / "torn-down").exists()  # the interpreter was not torn down


def test_the_probe_sees_a_teardown_when_there_is_one(tmp_path):
    """The same script ending with sys.exit: the finaliser runs, so the check above can fail."""
    ended = _end(tmp_path, "sys.exit", 0)
    assert ended.returncode == 0
    assert (tmp_path / "torn-down").read_text() == "yes"


def test_a_thread_still_working_is_waited_for(tmp_path):
    ended = _end(tmp_path, "thread", 4)
    assert ended.returncode == 4
    assert (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "exit-handler").read_text() == "ran"
