"""The "Reading a release in training" page's blocks (docs/howto/training.md) run verbatim against tiny releases of each kind."""

from __future__ import annotations

import os
import re
from pathlib import Path

from release_fixtures import finetuning_release, pretraining_release

README = Path(__file__).resolve().parent.parent / "docs" / "howto" / "training.md"
MARKER = "<!-- loaders-example -->"


def readme_blocks() -> list[str]:
    """The fenced python block after every marker, in README order."""
    text = README.read_text()
    return [m.group(1) for m in re.finditer(re.escape(MARKER) + r"\s*```python\n(.*?)```", text, re.S)]


def test_readme_blocks_turn_every_release_kind_into_batches(tmp_path, monkeypatch):
    blocks = readme_blocks()
    assert len(blocks) == 5 and len(blocks) == README.read_text().count(MARKER)
    store = tmp_path / "shardsmith-demo" / "store"
    pretraining_release(str(store), [24, 16], dataset="demo", latents=True)
    finetuning_release(str(store), [8, 6], dataset="chat")
    finetuning_release(str(store), [8, 6], dataset="chat-packed", packed_budget=512)
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "readme"}
    for block in blocks:
        exec(compile(block, f"{README}:{MARKER}", "exec"), scope)
    # What the last statement of each block left behind is a real batch of the right shape.
    assert scope["images"].shape[1:] == (3, 256, 256) and scope["keys"]
    assert scope["x"].shape[1:] == (4, 8, 8) and scope["mask"].dtype.is_floating_point is False
    assert scope["positions"].shape[1] == 512 and int(scope["cu_seqlens"][-1]) == 512 * scope["positions"].shape[0]
    assert len(list(scope["dali_latents"])) == len(scope["dali_latents"])
    assert os.getcwd() == str(tmp_path)
