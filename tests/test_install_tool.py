"""tools/install.py: uv gets the options pip is configured with, or setup resolves differently."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_tool():
    spec = importlib.util.spec_from_file_location("install_tool", ROOT / "tools" / "install.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pip_options_become_uv_options(tmp_path, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    tool = load_tool()
    present = tmp_path / "simple"
    present.mkdir()
    options = {
        "find-links": ["/opt/wheels", "/srv/more", "/opt/wheels"],
        "constraint": ["/etc/c.txt"],
        "index-url": ["https://mirror.example/simple"],
        "extra-index-url": [f"file://{present}", f"file://{tmp_path / 'absent'}", "https://x.example/simple"],
        "cert": ["/etc/ssl/ca.crt"],
        "default-timeout": ["180"],
        "no-index": ["false"],
    }
    cmd, env = tool.uv_command(["-e", ".[test]"], options)
    assert cmd[-2:] == ["-e", ".[test]"]
    pairs = list(zip(cmd, cmd[1:]))
    assert [v for k, v in pairs if k == "--find-links"] == ["/opt/wheels", "/srv/more"]
    assert ("--constraint", "/etc/c.txt") in pairs and ("--index-url", "https://mirror.example/simple") in pairs
    # pip ignores a file:// index that is not there; uv would fail on it.
    assert [v for k, v in pairs if k == "--extra-index-url"] == [f"file://{present}", "https://x.example/simple"]
    assert "--no-index" not in cmd and ("--index-strategy", "unsafe-best-match") in pairs
    assert ("--python", sys.executable) in pairs and "--compile-bytecode" in cmd
    assert env["UV_HTTP_TIMEOUT"] == "180"
    assert env["SSL_CERT_FILE"] == "/etc/ssl/ca.crt"


def test_pip_config_is_read_from_pip_itself(tmp_path):
    """The environment's PIP_* settings arrive as pip reports them, lists split."""
    env = dict(os.environ, PIP_FIND_LINKS=f"{tmp_path}/a {tmp_path}/b", PIP_CONSTRAINT=str(tmp_path / "c.txt"))
    code = "import json, sys; sys.path.insert(0, 'tools'); import install; print(json.dumps(install.pip_config()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    options = json.loads(out.stdout)
    assert f"{tmp_path}/a" in options["find-links"] and f"{tmp_path}/b" in options["find-links"]
    assert str(tmp_path / "c.txt") in options["constraint"]


def test_pip_precedence_picks_each_option():
    """PIP_* over the [install] section over [global], as pip itself decides; other sections are
    not for ``pip install``."""
    tool = load_tool()
    listing = "\n".join(
        [
            ":env:.index-url='https://env.example/simple'",
            "global.index-url='https://global.example/simple'",
            "install.index-url='https://install.example/simple'",
            "global.find-links='/a /b'",
            "install.constraint='/etc/c.txt'",
            "download.timeout='5'",
        ]
    )
    assert tool.parse_config(listing) == {
        "index-url": ["https://env.example/simple"],
        "find-links": ["/a", "/b"],
        "constraint": ["/etc/c.txt"],
    }
