"""Where the release reader tests find megatron-energon and wids: their own venv, or this one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# megatron-energon 7.4.1 would downgrade tzdata in the project venv (multi-storage-client pins
# tzdata<2026), so it lives in its own venv, with wids, layered over the project's packages.
ENERGON_VENV_PYTHON = REPO / ".bench" / "energon-venv" / "bin" / "python"
NOT_INSTALLED = (
    "megatron-energon is not installed; create .bench/energon-venv (`make energon-venv`: python3.11 -m venv, "
    "a .pth file naming the project venv's site-packages, pip install megatron-energon==7.4.1 wids)"
)


def missing(why: str) -> None:
    """Skip for a developer without the reader; fail in CI, where `make test` builds it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why} (CI=true: the real readers must run here; see the Makefile's energon-venv)")
    pytest.skip(why)


def readers_python() -> str | None:
    """The python that imports megatron.energon: SHARDSMITH_ENERGON_PYTHON, this one, or the venv's."""
    override = os.environ.get("SHARDSMITH_ENERGON_PYTHON")
    if override:
        return override
    if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.energon"):
        return sys.executable
    if ENERGON_VENV_PYTHON.exists():
        return str(ENERGON_VENV_PYTHON)
    return None


def energon_command(python: str) -> list[str]:
    """The ``energon`` command line beside that python (its console script, or its main)."""
    script = Path(python).parent / "energon"
    return [str(script)] if script.exists() else [python, "-c", "from megatron.energon.cli.main import main; main()"]


def run_reader(python: str, script: Path, args: list[str], cwd: Path) -> list[str]:
    """Run a reader script under the readers' python; its stdout's lines (a failure fails the test)."""
    proc = subprocess.run([python, str(script), *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    if proc.returncode != 0:
        pytest.fail(f"reader script {script.name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()
