"""Every reader's index of a release, written in one pass over the shard records.

The parts: ``walk`` (the shard records checked, DALI lines and energon offsets built in one
pass), ``energon`` (the ``.nv-meta/`` folder) and ``wids`` (the shard-index JSON); here, the
entry points the release steps call, and the names their arguments take.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tasks.formats.indexes.energon import (
    DEFAULT_SAMPLE_TYPE,
    DEFAULT_VIDEO_SAMPLE_TYPE,
    ENERGON_CRUDE_TYPE,
    energon_meta,
)
from tasks.formats.indexes.walk import ShardIndexInput, ShardWalk, dali_index_name, walk_all
from tasks.formats.indexes.wids import wids_json

__all__ = [
    "DEFAULT_SAMPLE_TYPE",
    "DEFAULT_VIDEO_SAMPLE_TYPE",
    "ENERGON_CRUDE_TYPE",
    "ShardIndexInput",
    "all_indexes",
    "dali_index_name",
    "dali_indexes",
    "energon_indexes",
    "wids_index",
]


def _dali(walked: Sequence[ShardWalk]) -> dict[str, bytes]:
    return {dali_index_name(w.name): w.dali for w in walked}


def dali_indexes(shards: Iterable[ShardIndexInput]) -> dict[str, bytes]:
    """One ``.idx`` per shard, for ``fn.readers.webdataset(paths=..., index_paths=...)``.

    The bytes are what DALI's ``wds2idx`` writes for the same tar.
    """
    return _dali(walk_all(shards))


def energon_indexes(
    shards: Iterable[ShardIndexInput],
    *,
    sample_type: str | None = None,
    field_map: Mapping[str, str] | None = None,
    split_parts: Mapping[str, str | Sequence[str]] | None = None,
) -> dict[str, bytes]:
    """The ``.nv-meta/`` folder and ``.tar.idx`` files that ``energon prepare`` writes.

    Args:
        shards: the release's shards, in release order.
        sample_type: an energon sample class, or ``"CrudeWebdataset"`` for plain dicts that a
            Cooker turns into samples, configured in ``crude.yaml`` (every sample then needs a
            ``json`` member, dataset.yaml's view). Default None: ``"VidQASample"`` where every
            sample is a video clip (has a ``mp4`` member; ``crude.yaml`` is then written too,
            for a cooker), else ``"CaptioningSample"``.
        field_map: sample field -> member extension (default ``{"image": "jpg", "caption":
            "txt"}`` for CaptioningSample, ``{"video": "mp4", "context": "txt"}`` for
            VidQASample; required for other classes, refused for CrudeWebdataset). Every sample
            must have a member for every field.
        split_parts: part name -> regex (or regexes) matched at the start of shard names, as
            ``energon prepare --split-parts train:pattern`` takes them (default: every shard
            in ``train``, ``val`` and ``test`` empty). A pattern that matches nothing, or a
            shard in two parts, raises.
    """
    shards = list(shards)
    return energon_meta(shards, walk_all(shards), sample_type, field_map, split_parts)


def wids_index(shards: Iterable[ShardIndexInput], *, base_url: str = "", name: str = "") -> dict[str, bytes]:
    """The ``wids-shard-index-v1`` JSON for ``wids.ShardListDataset``.

    Args:
        shards: the release's shards, in release order (the order of global sample indexes).
        base_url: prefix for shard urls, e.g. ``"s3://bucket/ds/releases/v0001"`` (default
            ``""``: urls relative to the index, which wids resolves against its folder).
        name: the dataset name wids caches under (default ``""``: left out, wids hashes the
            index url instead).
    """
    shards = list(shards)
    return wids_json(walk_all(shards), shards, base_url, name)


def all_indexes(
    shards: Iterable[ShardIndexInput],
    *,
    sample_type: str | None = None,
    field_map: Mapping[str, str] | None = None,
    split_parts: Mapping[str, str | Sequence[str]] | None = None,
    base_url: str = "",
    name: str = "",
) -> dict[str, bytes]:
    """DALI, energon and wids indexes together, from one walk over the records.

    Arguments as for ``energon_indexes`` and ``wids_index``. Returns relative path -> bytes,
    for ``Storage.write_bytes`` under the release folder.
    """
    shards = list(shards)
    walked = walk_all(shards)
    out = _dali(walked)
    out.update(energon_meta(shards, walked, sample_type, field_map, split_parts))
    out.update(wids_json(walked, shards, base_url, name))
    return out
