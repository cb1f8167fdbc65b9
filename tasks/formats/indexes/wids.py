"""webdataset's wids shard index (wids-shard-index-v1 JSON) for a release."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tasks.formats.indexes.walk import ShardIndexInput, ShardWalk

# webdataset's wids shard index, as `widsindex create` (wids/wids_index.py main_create) writes
# it: `json.dump(dict(__kind__="wids-shard-index-v1", wids_version=1, shardlist=[{url,
# nsamples, filesize}, ...], name=...), indent=2)`. ShardListDataset resolves relative urls
# against the folder the index was loaded from (wids_specs.resolve_dsdesc rebase_shardlist).
# md5sum, which `create` adds, is left out: it needs the bytes again and no reader checks it.
WIDS_KIND = "wids-shard-index-v1"
WIDS_VERSION = 1
WIDS_INDEX_NAME = "wids-index.json"


def wids_json(
    walked: Sequence[ShardWalk], shards: Sequence[ShardIndexInput], base_url: str, name: str
) -> dict[str, bytes]:
    prefix = base_url.rstrip("/") + "/" if base_url else ""
    index: dict = {
        "__kind__": WIDS_KIND,
        "wids_version": WIDS_VERSION,
        "shardlist": [
            {"url": prefix + w.name, "nsamples": w.count, "filesize": shard.size} for w, shard in zip(walked, shards)
        ],
    }
    if name:
        index["name"] = name
    return {WIDS_INDEX_NAME: json.dumps(index, indent=2).encode("utf-8")}
