"""Every reader's index of a release, written in one pass over the shard records."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import yaml

from tasks.formats.shards import SampleRecord, split_key
from tasks.formats.tar_format import BLOCK

# Formats, as their own tools write them (checked byte for byte in tests/test_indexes.py):
#
# DALI `fn.readers.webdataset` index, as tools/wds2idx.py (shipped in the DALI wheel as the
# `wds2idx` module) writes it: a line "v1.2 <samples>", then one line per sample of
# "<ext> <data offset> <size> <member name>" groups joined by single spaces, "\n" after every
# line. The offset is the member's DATA offset (wds2idx: `offset = (offset + 1) * 512` from the
# header block number; DALI's own tar scan uses `TellArchive() + HeaderSize()`), and the reader
# refuses one that is not a multiple of 512. DALI 2.4 accepts "v1.1" (no names) and "v1.2"
# (names required): dali/operators/reader/loader/webdataset_loader.h,
# `kSupportedIndexVersions = {"v1.1", kCurrentIndexVersion}` with `kCurrentIndexVersion =
# "v1.2"`, parsed by ParseSampleDesc in webdataset_loader.cc.
DALI_INDEX_VERSION = "v1.2"

# Megatron-Energon 7.4.1 (`energon prepare`, flavors/webdataset/prepare.py and itar.py):
# - "<shard>.tar.idx" (itar.py ITAR_SUFFIX, TarIndexWriter.append: `struct.pack("Q", offset)`):
#   one unsigned 64-bit offset per sample, the tar HEADER offset of the sample's first member
#   (tarfile's `member.offset`), then one more: the offset where the end-of-archive blocks
#   start (`iw.append(tar.offset)` after the last member), so sample i spans idx[i]..idx[i+1].
#   Energon packs in native byte order; we write little-endian, which is native on the x86-64
#   and aarch64 machines energon runs on.
# - ".nv-meta/.info.json": `json.dump(..., indent=2)` of WebdatasetInfo(energon_version,
#   shard_counts). energon_version is optional (only `energon info` prints it) and we are not
#   energon, so it is left out.
# - ".nv-meta/split.yaml": `yaml.dump({"split_parts": {part: names}, "exclude": []},
#   sort_keys=False)`, the names collapsed into brace ranges in order (bracecollapse.py,
#   keep_order=True); readers brace-expand them again. From a ratio (`--split-ratio 1,0,0`)
#   it writes train, val and test, empty ones as `[]`; `energon lint` checks all three.
# - ".nv-meta/dataset.yaml": tools/prepare.py with --sample-type and --field-map:
#   `yaml.dump({"sample_type": {"__module__": "megatron.energon", "__class__": cls},
#   "field_map": {...}}, sort_keys=False)`; for CrudeWebdataset the class at top level. No
#   energon tool reads a crude dataset without cookers (lint: "No cookers registered"), so, as
#   energon's docs on crude datasets suggest, its config goes to ".nv-meta/crude.yaml" and
#   dataset.yaml reads each sample as a TextSample of its decoded `json` member.
# `energon prepare` also writes .nv-meta/index.sqlite and index.uuid, needed only for lookups
# by sample key, joined datasets and media metadata; training and validation loaders
# (ShardInfosITarReader) read the .tar.idx files. Run `energon prepare --tar-index-only` on a
# release when those features are wanted.
ENERGON_META_FOLDER = ".nv-meta"
ENERGON_MODULE = "megatron.energon"
ENERGON_CRUDE_TYPE = "CrudeWebdataset"
ENERGON_CRUDE_CONFIG = "crude.yaml"
_CRUDE_DEFAULT_VIEW = ("TextSample", {"text": "json"})
ENERGON_DEFAULT_PARTS = ("train", "val", "test")
# For image-caption pairs energon offers CaptioningSample (image: tensor, caption: str); this
# field map is what `energon prepare --sample-type CaptioningSample --field-map` takes for
# shards whose members are key.jpg and key.txt.
DEFAULT_SAMPLE_TYPE = "CaptioningSample"
DEFAULT_FIELD_MAP: Mapping[str, str] = {"image": "jpg", "caption": "txt"}
# Energon skips members that match this (flavors/webdataset/config.py skip_meta_re).
_ENERGON_SKIPPED = re.compile(r"__[^/]*__($|/)")

# webdataset's wids shard index, as `widsindex create` (wids/wids_index.py main_create) writes
# it: `json.dump(dict(__kind__="wids-shard-index-v1", wids_version=1, shardlist=[{url,
# nsamples, filesize}, ...], name=...), indent=2)`. ShardListDataset resolves relative urls
# against the folder the index was loaded from (wids_specs.resolve_dsdesc rebase_shardlist).
# md5sum, which `create` adds, is left out: it needs the bytes again and no reader checks it.
WIDS_KIND = "wids-shard-index-v1"
WIDS_VERSION = 1
WIDS_INDEX_NAME = "wids-index.json"

# Shard names go into space-separated index lines, brace-expanded split lists and URLs.
_SHARD_NAME_RE = re.compile(r"[A-Za-z0-9_-]+(?:[./][A-Za-z0-9_-]+)*\.tar")
_SAMPLE_TYPE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_END_OF_ARCHIVE = 2 * BLOCK


@dataclass(frozen=True)
class ShardIndexInput:
    """What the release step knows about one shard, enough to index it without reading it.

    Args:
        name: the tar's path relative to the release folder, e.g. ``"shard-000000.tar"``.
        size: bytes of the tar.
        samples: the writer's records, in order, offsets relative to the tar's start.
    """

    name: str
    size: int
    samples: Sequence[SampleRecord]


@dataclass(frozen=True)
class _ShardWalk:
    """One shard as the indexes need it, gathered in one pass over its records."""

    name: str
    count: int
    dali: bytes
    energon_offsets: bytes


def dali_index_name(shard_name: str) -> str:
    """``"a/shard-000000.tar"`` -> ``"a/shard-000000.idx"``: wds2idx's default, beside the tar."""
    return shard_name.removesuffix(".tar") + ".idx"


def energon_index_name(shard_name: str) -> str:
    """``"a/shard-000000.tar"`` -> ``"a/shard-000000.tar.idx"`` (energon's ITAR_SUFFIX)."""
    return shard_name.removesuffix(".tar") + ".tar.idx"


def _walk(shard: ShardIndexInput) -> _ShardWalk:
    """Check one shard's records and build its DALI lines and energon offsets together.

    Raises ``ValueError`` for records no reader could use: a bad shard name, an empty shard,
    samples that overlap, leave gaps or run past the tar, members that do not belong to their
    sample, and data offsets off the 512-byte grid.
    """
    name = shard.name
    if not isinstance(name, str) or not _SHARD_NAME_RE.fullmatch(name):
        raise ValueError(
            f"shard name {name!r}: use a relative path of [A-Za-z0-9_-] parts ending in '.tar' "
            "(names go into space-separated DALI indexes and brace-expanded energon splits)"
        )
    if not shard.samples:
        raise ValueError(f"shard {name!r} has no samples; DALI and energon cannot index an empty tar")
    lines = [b""]  # the version line, once the count is known
    offsets = bytearray()
    expected = 0
    for sample in shard.samples:
        if sample.offset != expected:
            raise ValueError(
                f"shard {name!r}: sample {sample.key!r} starts at byte {sample.offset}, expected "
                f"{expected} (records must be the shard's samples, in order, without gaps)"
            )
        if not sample.members:
            raise ValueError(f"shard {name!r}: sample {sample.key!r} has no members")
        end = sample.offset + sample.length
        groups = []
        for member in sample.members:
            parts = split_key(member.name)
            if parts is None or parts[0] != sample.key:
                raise ValueError(f"shard {name!r}: member {member.name!r} is not part of sample {sample.key!r}")
            if _ENERGON_SKIPPED.match(member.name):
                raise ValueError(f"shard {name!r}: energon skips member {member.name!r} (a __name__ key)")
            if member.offset % BLOCK or not sample.offset < member.offset <= end - member.size:
                raise ValueError(
                    f"shard {name!r}: member {member.name!r} data at byte {member.offset} "
                    f"({member.size} bytes) is not block-aligned inside its sample"
                )
            groups.append(f"{parts[1]} {member.offset} {member.size} {member.name}")
        lines.append(" ".join(groups).encode("utf-8"))
        offsets += struct.pack("<Q", sample.offset)
        expected = end
    if expected + _END_OF_ARCHIVE > shard.size:
        raise ValueError(
            f"shard {name!r}: samples end at byte {expected}, but the tar is {shard.size} bytes "
            "(no room for the end-of-archive blocks)"
        )
    offsets += struct.pack("<Q", expected)  # where the end-of-archive blocks start
    lines[0] = f"{DALI_INDEX_VERSION} {len(shard.samples)}".encode("ascii")
    lines.append(b"")
    return _ShardWalk(name=name, count=len(shard.samples), dali=b"\n".join(lines), energon_offsets=bytes(offsets))


def _walk_all(shards: Iterable[ShardIndexInput]) -> list[_ShardWalk]:
    walked = [_walk(shard) for shard in shards]
    if not walked:
        raise ValueError("no shards to index")
    names = [w.name for w in walked]
    if len(set(names)) != len(names):
        raise ValueError("shard names repeat")
    return walked


# ---------------------------------------------------------------------------------------------
# DALI
# ---------------------------------------------------------------------------------------------


def _dali(walked: list[_ShardWalk]) -> dict[str, bytes]:
    return {dali_index_name(w.name): w.dali for w in walked}


def dali_indexes(shards: Iterable[ShardIndexInput]) -> dict[str, bytes]:
    """One ``.idx`` per shard, for ``fn.readers.webdataset(paths=..., index_paths=...)``.

    The bytes are what DALI's ``wds2idx`` writes for the same tar.
    """
    return _dali(_walk_all(shards))


# ---------------------------------------------------------------------------------------------
# Megatron-Energon
# ---------------------------------------------------------------------------------------------


def _collapse_ranges(names: Sequence[str]) -> list[str]:
    """Names in order, runs that differ only by +1 in one same-width number as ``{a..b}``.

    The same result as energon's ordered brace collapse, so split.yaml matches what
    ``energon prepare`` writes; braceexpand turns it back into the names, in order.
    """
    numbers = re.compile(r"\d+")

    def tokens(name: str) -> tuple[list[str], list[str]]:
        return numbers.split(name), numbers.findall(name)

    out: list[str] = []
    i = 0
    while i < len(names):
        lits, nums = tokens(names[i])
        slot = None
        last = nums
        j = i + 1
        while nums and j < len(names):
            lits_j, nums_j = tokens(names[j])
            if lits_j != lits or len(nums_j) != len(nums):
                break
            diff = [k for k, (a, b) in enumerate(zip(last, nums_j)) if int(a) != int(b)]
            if len(diff) != 1 or (slot is not None and diff[0] != slot):
                break
            k = diff[0]
            if len(nums_j[k]) != len(last[k]) or int(nums_j[k]) != int(last[k]) + 1:
                break
            slot, last = k, nums_j
            j += 1
        if slot is None:
            out.append(names[i])
            i += 1
            continue
        parts = []
        for k, num in enumerate(nums):
            parts.append(lits[k])
            parts.append(f"{{{num}..{last[k]}}}" if k == slot else num)
        parts.append(lits[-1])
        out.append("".join(parts))
        i = j
    return out


def _split_parts(names: list[str], split_parts: Mapping[str, str | Sequence[str]] | None) -> dict[str, list[str]]:
    if split_parts is None:  # as `energon prepare --split-ratio 1,0,0` writes it
        return {part: list(names) if part == "train" else [] for part in ENERGON_DEFAULT_PARTS}
    if not split_parts:
        raise ValueError("split_parts is empty; leave it None to put every shard in 'train'")
    owner: dict[str, str] = {}
    result: dict[str, list[str]] = {}
    for part, patterns in split_parts.items():
        if not isinstance(part, str) or not _SAMPLE_TYPE_RE.fullmatch(part):
            raise ValueError(f"split part name {part!r} is not an identifier (train, val, test, ...)")
        compiled = [re.compile(p) for p in ([patterns] if isinstance(patterns, str) else patterns)]
        chosen = [n for n in names if any(p.match(n) for p in compiled)]
        if not chosen:
            raise ValueError(f"split part {part!r}: patterns {patterns!r} match no shard")
        for n in chosen:
            if n in owner:
                # A shard in two parts puts the same samples in training and evaluation.
                raise ValueError(f"shard {n!r} is in split parts {owner[n]!r} and {part!r}")
            owner[n] = part
        result[part] = chosen
    return result


def _dataset_yaml(sample_type: str, field_map: Mapping[str, str] | None) -> dict:
    if not isinstance(sample_type, str) or not _SAMPLE_TYPE_RE.fullmatch(sample_type):
        raise ValueError(f"sample_type {sample_type!r} is not a class name")
    if sample_type == ENERGON_CRUDE_TYPE:
        if field_map is not None:
            raise ValueError("CrudeWebdataset takes no field_map: a Cooker in the TaskEncoder reads samples")
        return {"__module__": ENERGON_MODULE, "__class__": ENERGON_CRUDE_TYPE}
    if field_map is None:
        if sample_type != DEFAULT_SAMPLE_TYPE:
            raise ValueError(f"sample type {sample_type!r} needs a field_map (the default fits {DEFAULT_SAMPLE_TYPE})")
        field_map = DEFAULT_FIELD_MAP
    if not field_map:
        raise ValueError("field_map is empty")
    return {
        "sample_type": {"__module__": ENERGON_MODULE, "__class__": sample_type},
        "field_map": {str(k): str(v) for k, v in field_map.items()},
    }


def _check_field_map(shards: Sequence[ShardIndexInput], dataset: dict) -> None:
    """Every sample must have a member for every mapped field, or energon fails mid-epoch."""
    field_map = dataset.get("field_map")
    if not field_map:
        return
    # "jpg,png" offers alternatives; "json[caption]" reads a field of the json member.
    wanted = {field: [alt.split("[", 1)[0] for alt in spec.split(",")] for field, spec in field_map.items()}
    for shard in shards:
        for sample in shard.samples:
            exts = {m.name[len(sample.key) + 1 :] for m in sample.members}
            for field, alts in wanted.items():
                if not any(alt in exts for alt in alts):
                    raise ValueError(
                        f"shard {shard.name!r}: sample {sample.key!r} has no member for field "
                        f"{field!r} ({field_map[field]!r}); it has {sorted(exts)}"
                    )


def _energon(
    shards: Sequence[ShardIndexInput],
    walked: list[_ShardWalk],
    sample_type: str,
    field_map: Mapping[str, str] | None,
    split_parts: Mapping[str, str | Sequence[str]] | None,
) -> dict[str, bytes]:
    dataset = _dataset_yaml(sample_type, field_map)
    crude = "field_map" not in dataset
    if crude:
        dataset, crude_config = _dataset_yaml(*_CRUDE_DEFAULT_VIEW), dataset
    _check_field_map(shards, dataset)
    names = [w.name for w in walked]
    parts = _split_parts(names, split_parts)
    split = {
        "split_parts": {part: _collapse_ranges(chosen) for part, chosen in parts.items()},
        "exclude": [],
    }
    info = {"shard_counts": {w.name: w.count for w in walked}}
    out = {
        f"{ENERGON_META_FOLDER}/dataset.yaml": yaml.dump(dataset, sort_keys=False).encode("utf-8"),
        f"{ENERGON_META_FOLDER}/split.yaml": yaml.dump(split, sort_keys=False).encode("utf-8"),
        f"{ENERGON_META_FOLDER}/.info.json": json.dumps(info, indent=2).encode("utf-8"),
    }
    if crude:
        out[f"{ENERGON_META_FOLDER}/{ENERGON_CRUDE_CONFIG}"] = yaml.dump(crude_config, sort_keys=False).encode("utf-8")
    out.update({energon_index_name(w.name): w.energon_offsets for w in walked})
    return out


def energon_indexes(
    shards: Iterable[ShardIndexInput],
    *,
    sample_type: str = DEFAULT_SAMPLE_TYPE,
    field_map: Mapping[str, str] | None = None,
    split_parts: Mapping[str, str | Sequence[str]] | None = None,
) -> dict[str, bytes]:
    """The ``.nv-meta/`` folder and ``.tar.idx`` files that ``energon prepare`` writes.

    Args:
        shards: the release's shards, in release order.
        sample_type: an energon sample class, or ``"CrudeWebdataset"`` for plain dicts that a
            Cooker turns into samples, configured in ``crude.yaml`` (every sample then needs a
            ``json`` member, dataset.yaml's view). Default ``"CaptioningSample"``.
        field_map: sample field -> member extension (default ``{"image": "jpg", "caption":
            "txt"}`` for CaptioningSample; required for other classes, refused for
            CrudeWebdataset). Every sample must have a member for every field.
        split_parts: part name -> regex (or regexes) matched at the start of shard names, as
            ``energon prepare --split-parts train:pattern`` takes them (default: every shard
            in ``train``, ``val`` and ``test`` empty). A pattern that matches nothing, or a
            shard in two parts, raises.
    """
    shards = list(shards)
    return _energon(shards, _walk_all(shards), sample_type, field_map, split_parts)


# ---------------------------------------------------------------------------------------------
# wids
# ---------------------------------------------------------------------------------------------


def _wids(walked: list[_ShardWalk], shards: Sequence[ShardIndexInput], base_url: str, name: str) -> dict[str, bytes]:
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
    return _wids(_walk_all(shards), shards, base_url, name)


def all_indexes(
    shards: Iterable[ShardIndexInput],
    *,
    sample_type: str = DEFAULT_SAMPLE_TYPE,
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
    walked = _walk_all(shards)
    out = _dali(walked)
    out.update(_energon(shards, walked, sample_type, field_map, split_parts))
    out.update(_wids(walked, shards, base_url, name))
    return out
