"""A release is readable by another uid: files 0644 and folders 0755 whatever the umask, or stricter on request."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from release_fixtures import finetuning_release, pretraining_release

from tasks.formats.storage import Storage, file_modes
from tasks.stages.release import place_file

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534  # uid and gid of nobody / nogroup on Debian

# Run as root, with the project's interpreter (which may live where nobody cannot read, such as
# a pyenv under /root): import what the reading needs and warm it up on a private copy, then drop
# to nobody and read the release: every later open() is judged against nobody's rights.
_AS_NOBODY = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from loaders.release import open_release

dataset, private_copy = sys.argv[2], sys.argv[3]
open_release(private_copy, verify=True)  # imports whatever opening and verifying need

os.setgroups([])
os.setgid(65534)
os.setuid(65534)

out = {"uid": os.getuid(), "read": [], "denied": []}
for folder, dirs, files in os.walk(dataset, onerror=lambda err: out["denied"].append(err.filename)):
    dirs.sort()
    for name in sorted(files):
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as fh:
                fh.read()
            out["read"].append(os.path.relpath(path, dataset))
        except PermissionError:
            out["denied"].append(os.path.relpath(path, dataset))
try:
    release = open_release(dataset, verify=True)
    out["opened"] = {"version": release.version, "samples": release.samples,
                     "entries": sum(len(release.read_index(s)) for s in release.shards)}
except Exception as err:
    out["opened"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


def _need_root() -> None:
    if os.geteuid() == 0:
        return
    why = "reading a release as another uid needs root (to become nobody)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; CI runs as root, so this must not be skipped there")
    pytest.skip(why)


@pytest.fixture
def shared_dir():
    """A folder anyone may enter, as a storage folder shared with a training job is; the storage
    root inside it is made by the code under test."""
    path = Path(tempfile.mkdtemp(prefix="shardsmith-access-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def strict_umask():
    """A umask that leaves new files private; the release must not inherit it."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def _assert_modes(root: Path, file_mode: int, dir_mode: int) -> None:
    """Every file under ``root`` has ``file_mode`` and every folder (``root`` too) ``dir_mode``."""
    for path in [root, *root.rglob("*")]:
        want = dir_mode if path.is_dir() else file_mode
        assert stat.S_IMODE(path.stat().st_mode) == want, (
            f"{path}: {stat.S_IMODE(path.stat().st_mode):o}, want {want:o}"
        )


def _read_as_nobody(dataset: Path, private_copy: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, str(REPO), str(dataset), str(private_copy)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_release_made_under_umask_077_is_read_whole_by_nobody(shared_dir, strict_umask, tmp_path):
    _need_root()
    dataset = Path(pretraining_release(str(shared_dir / "store"), [3, 2], latents=True))
    _assert_modes(shared_dir / "store", 0o644, 0o755)
    private = tmp_path / "copy"
    shutil.copytree(dataset, private)

    got = _read_as_nobody(dataset, private)

    assert got["uid"] == NOBODY
    assert got["denied"] == []
    release = "releases/v0001/"
    expected = {
        "releases/LATEST",
        release + "index.json",
        release + ".nv-meta/dataset.yaml",
        release + ".nv-meta/split.yaml",
        release + ".nv-meta/.info.json",
        release + "wids-index.json",
    }
    for j in range(2):
        for name in (
            f"shard-{j:06d}.tar",
            f"shard-{j:06d}.idx",
            f"shard-{j:06d}.tar.idx",
            f"latents/shard-{j:06d}.tar",
            f"latents/shard-{j:06d}.idx",
        ):
            expected.add(release + name)
    assert set(got["read"]) == expected
    assert got["opened"] == {"version": "v0001", "samples": 5, "entries": 5}


def test_a_finetuning_release_is_read_by_nobody_too(shared_dir, strict_umask, tmp_path):
    _need_root()
    url, records = finetuning_release(str(shared_dir / "store"), [3, 2], packed_budget=400)
    dataset = Path(url)
    _assert_modes(shared_dir / "store", 0o644, 0o755)
    private = tmp_path / "copy"
    shutil.copytree(dataset, private)
    got = _read_as_nobody(dataset, private)
    assert got["denied"] == [] and "releases/v0001/.nv-meta/crude.yaml" in got["read"]
    assert isinstance(got["opened"], dict) and got["opened"]["version"] == "v0001"


def test_a_stricter_file_mode_keeps_others_out(shared_dir, tmp_path):
    _need_root()
    options = {"file_mode": "0640"}
    dataset = Path(pretraining_release(str(shared_dir / "store"), [2], storage_options=options))
    _assert_modes(shared_dir / "store", 0o640, 0o750)
    private = tmp_path / "copy"
    shutil.copytree(dataset, private)

    got = _read_as_nobody(dataset, private)

    # nobody is neither owner nor group: the dataset folder itself is closed to it.
    assert got["read"] == [] and got["denied"] == [str(dataset)]
    assert got["opened"].startswith("ReleaseError") or got["opened"].startswith("PermissionError")


def test_placing_an_old_private_work_file_gives_it_the_release_mode(tmp_path, strict_umask):
    storage = Storage(str(tmp_path / "store"))
    work = tmp_path / "store" / "ds" / "reshard" / "abc"
    work.mkdir(parents=True)
    (work / "shard-000000.tar").write_bytes(b"x" * 1024)
    (work / "shard-000000.tar").chmod(0o600)  # as the atomic writer left files before modes were set
    place_file(storage, "ds/reshard/abc/shard-000000.tar", "ds/releases/v0001/shard-000000.tar")
    placed = tmp_path / "store" / "ds" / "releases" / "v0001"
    assert stat.S_IMODE((placed / "shard-000000.tar").stat().st_mode) == 0o644
    assert stat.S_IMODE(placed.stat().st_mode) == 0o755 and stat.S_IMODE(placed.parent.stat().st_mode) == 0o755
    # A hard link: the work file is the same inode, and its mode changes with it.
    assert (placed / "shard-000000.tar").stat().st_ino == (work / "shard-000000.tar").stat().st_ino


@pytest.mark.parametrize(
    ("value", "modes"),
    [
        (None, (0o644, 0o755)),
        ("0640", (0o640, 0o750)),
        ("600", (0o600, 0o700)),
        (0o604, (0o604, 0o705)),
        ("0o644", (0o644, 0o755)),
    ],
)
def test_file_modes(value, modes):
    assert file_modes(value) == modes


@pytest.mark.parametrize("value", ["0664", "0755", "0400", "0444", 640, "rw-r--r--", True, 6.4])
def test_file_modes_refuse_looser_unwritable_or_unreadable_values(value):
    with pytest.raises(ValueError, match="file_mode"):
        file_modes(value)


def test_a_recipe_refuses_a_bad_file_mode_at_load(tmp_path):
    from tasks.formats.recipe import parse_recipe
    from tasks.formats.recipe_base import RecipeError

    base = {"dataset": "x", "storage": str(tmp_path), "sources": [{"name": "a", "manifest": str(tmp_path / "m.csv")}]}
    assert parse_recipe({**base, "storage_options": {"file_mode": 0o640}}).storage_options == {"file_mode": 0o640}
    with pytest.raises(RecipeError, match="storage_options: .*file_mode: '0664'"):
        parse_recipe({**base, "storage_options": {"file_mode": "0664"}})


def test_the_file_mode_never_reaches_fsspec_and_survives_pickling(tmp_path):
    import pickle

    storage = Storage(str(tmp_path / "s"), {"file_mode": "0600"})
    assert "file_mode" not in storage.fs.storage_options
    again = pickle.loads(pickle.dumps(storage))
    assert (again.file_mode, again.dir_mode) == (0o600, 0o700)
    again.write_bytes("a/b.bin", b"1")
    assert stat.S_IMODE((tmp_path / "s" / "a" / "b.bin").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "s" / "a").stat().st_mode) == 0o700


def test_release_shard_names_differ_between_contents_and_repeat_for_the_same():
    from tasks.stages.release import release_shard_names

    a = release_shard_names(["1" * 64, "2" * 64])
    assert a == release_shard_names(["1" * 64, "2" * 64])
    b = release_shard_names(["1" * 64, "3" * 64])
    assert len(set(a)) == 2 and not set(a) & set(b)
    assert all(n.startswith("shard-") and n.endswith(("-000000.tar", "-000001.tar")) for n in a + b)
