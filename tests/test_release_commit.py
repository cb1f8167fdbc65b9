"""index.json commits a release exclusively: of two writers racing for one version exactly one wins, on S3 and locally."""

from __future__ import annotations

import json
import threading

import pytest

from tasks.release import ReleaseError, commit_index
from tasks.storage import Storage

ROUNDS = 12


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path) -> Storage:
    if request.param == "local":
        return Storage(str(tmp_path / "store"))
    bucket, options = request.getfixturevalue("s3_bucket")
    return Storage(f"s3://{bucket}/root", options)


def _race(storage: Storage, rel: str, writers: int = 2) -> tuple[list[int], list[BaseException]]:
    """``writers`` threads commit different index.json bodies to ``rel`` at the same moment;
    returns which writers committed and what the others raised."""
    barrier = threading.Barrier(writers)
    won: list[int] = []
    lost: list[BaseException] = []
    lock = threading.Lock()

    def commit(i: int) -> None:
        # A Storage per writer, as two runs on two machines would have.
        mine = Storage(storage.root, storage.options)
        barrier.wait()
        try:
            commit_index(mine, rel, {"version": "v0001", "writer": i})
        except BaseException as err:  # noqa: BLE001 - collected for the assertions
            with lock:
                lost.append(err)
        else:
            with lock:
                won.append(i)

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return won, lost


def test_two_racing_commits_one_wins_the_other_gets_a_clear_error(storage):
    # Many rounds: a check-then-PUT commit lets both writers through in most of them.
    for n in range(ROUNDS):
        rel = f"ds/releases/v{n + 1:04d}/index.json"
        won, lost = _race(storage, rel)
        assert len(won) == 1, f"round {n}: {len(won)} writers committed {rel}"
        assert len(lost) == 1 and isinstance(lost[0], ReleaseError), lost
        assert "exists; releases are immutable" in str(lost[0]) and storage.url(rel) in str(lost[0])
        assert json.loads(storage.read_bytes(rel))["writer"] == won[0]


def test_a_commit_never_overwrites_and_a_repeat_of_the_same_bytes_is_not_a_conflict(storage):
    rel = "ds/releases/v0001/index.json"
    commit_index(storage, rel, {"version": "v0001", "writer": 0})
    # The same bytes again: this writer's own PUT, retried after its reply was lost.
    commit_index(storage, rel, {"version": "v0001", "writer": 0})
    with pytest.raises(ReleaseError, match="exists; releases are immutable"):
        commit_index(storage, rel, {"version": "v0001", "writer": 1})
    assert json.loads(storage.read_bytes(rel))["writer"] == 0
    if storage.is_local:
        # Nothing left beside it: the temp file the link was made from is gone.
        assert storage.listdir("ds/releases/v0001") == ["index.json"]
