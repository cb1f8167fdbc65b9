"""Megatron-Energon's dataset folder (.nv-meta/) for a release: split, dataset and crude configs, shard counts."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

import yaml

from tasks.formats.indexes.walk import ShardIndexInput, ShardWalk, energon_index_name

# Megatron-Energon 7.4.1 (`energon prepare`, flavors/webdataset/prepare.py; the .tar.idx files: indexes/walk.py):
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
# Image members a release may hold (``validate.image.output_format``; ``skip_reencode`` keeps a
# source's own format): CaptioningSample's default ``image`` field names those its samples have,
# as energon's alternatives ("png", "jpg,png": the first a sample has is read).
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
# For video clips (key.mp4, key.jpg its keyframe, key.txt) CaptioningSample would read the
# keyframe. Energon 7.4.1 has one sample type with a video field, VidQASample (video: the
# SampleDecoder's `av_decode` result, an AVDecoder by default; context: str; answers and
# answer_weights optional), and its docs map files 1:1 to a sample type's fields with a field
# map; so a clip's caption is its `context`. Its docs' own video+text example is a crude
# dataset whose cooker makes the trainer's sample of sample["mp4"] and sample["txt"]: a video
# release also gets crude.yaml for that (get_train_dataset(..., dataset_config="crude.yaml")).
DEFAULT_VIDEO_SAMPLE_TYPE = "VidQASample"
DEFAULT_VIDEO_FIELD_MAP: Mapping[str, str] = {"video": "mp4", "context": "txt"}
VIDEO_MEMBER = "mp4"
_SAMPLE_TYPE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def collapse_ranges(names: Sequence[str]) -> list[str]:
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


def _dataset_yaml(
    sample_type: str, field_map: Mapping[str, str] | None, images: Sequence[str] = ("jpg",), captions: str = "txt"
) -> dict:
    if not isinstance(sample_type, str) or not _SAMPLE_TYPE_RE.fullmatch(sample_type):
        raise ValueError(f"sample_type {sample_type!r} is not a class name")
    if sample_type == ENERGON_CRUDE_TYPE:
        if field_map is not None:
            raise ValueError("CrudeWebdataset takes no field_map: a Cooker in the TaskEncoder reads samples")
        return {"__module__": ENERGON_MODULE, "__class__": ENERGON_CRUDE_TYPE}
    if field_map is None:
        image_map = {"image": ",".join(images or ("jpg",)), "caption": captions}
        defaults = {DEFAULT_SAMPLE_TYPE: image_map, DEFAULT_VIDEO_SAMPLE_TYPE: DEFAULT_VIDEO_FIELD_MAP}
        if sample_type not in defaults:
            raise ValueError(f"sample type {sample_type!r} needs a field_map (defaults fit {', '.join(defaults)})")
        field_map = defaults[sample_type]
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


def _image_members(shards: Sequence[ShardIndexInput]) -> list[str]:
    """The image extensions the samples have, in ``IMAGE_MEMBERS``' order (a video clip's
    keyframe is its ``jpg``)."""
    seen = {m.name[len(sample.key) + 1 :] for shard in shards for sample in shard.samples for m in sample.members}
    return [ext for ext in IMAGE_MEMBERS if ext in seen]


def _captions(shards: Sequence[ShardIndexInput]) -> str:
    """CaptioningSample's ``caption`` field: the ``txt`` member, or where a sample has none (a
    recipe with ``validate.caption.required: false`` releases an empty caption without one) the
    json's ``caption`` after it, as energon's alternatives read them."""
    every = all(
        any(m.name == f"{sample.key}.txt" for m in sample.members) for shard in shards for sample in shard.samples
    )
    return DEFAULT_FIELD_MAP["caption"] if every else f"{DEFAULT_FIELD_MAP['caption']},json[caption]"


def _all_clips(shards: Sequence[ShardIndexInput]) -> bool:
    """Every sample has a video member (``key.mp4``): a release of video clips."""
    samples = [sample for shard in shards for sample in shard.samples]
    return bool(samples) and all(
        any(m.name == f"{sample.key}.{VIDEO_MEMBER}" for m in sample.members) for sample in samples
    )


def energon_meta(
    shards: Sequence[ShardIndexInput],
    walked: Sequence[ShardWalk],
    sample_type: str | None,
    field_map: Mapping[str, str] | None,
    split_parts: Mapping[str, str | Sequence[str]] | None,
) -> dict[str, bytes]:
    # A release that mixes clips and images keeps CaptioningSample: every sample has a jpg (a
    # clip's keyframe), while only the clips have a video for VidQASample's field map.
    clips = _all_clips(shards)
    if sample_type is None:
        sample_type = DEFAULT_VIDEO_SAMPLE_TYPE if clips else DEFAULT_SAMPLE_TYPE
    dataset = _dataset_yaml(sample_type, field_map, _image_members(shards), _captions(shards))
    crude = "field_map" not in dataset
    crude_config = None
    if crude:
        dataset, crude_config = _dataset_yaml(*_CRUDE_DEFAULT_VIEW), dataset
    elif clips:  # the crude view beside it, for a cooker of the trainer's own video sample
        crude_config = _dataset_yaml(ENERGON_CRUDE_TYPE, None)
    _check_field_map(shards, dataset)
    names = [w.name for w in walked]
    parts = _split_parts(names, split_parts)
    split = {
        "split_parts": {part: collapse_ranges(chosen) for part, chosen in parts.items()},
        "exclude": [],
    }
    info = {"shard_counts": {w.name: w.count for w in walked}}
    out = {
        f"{ENERGON_META_FOLDER}/dataset.yaml": yaml.dump(dataset, sort_keys=False).encode("utf-8"),
        f"{ENERGON_META_FOLDER}/split.yaml": yaml.dump(split, sort_keys=False).encode("utf-8"),
        f"{ENERGON_META_FOLDER}/.info.json": json.dumps(info, indent=2).encode("utf-8"),
    }
    if crude_config is not None:
        out[f"{ENERGON_META_FOLDER}/{ENERGON_CRUDE_CONFIG}"] = yaml.dump(crude_config, sort_keys=False).encode("utf-8")
    out.update({energon_index_name(w.name): w.energon_offsets for w in walked})
    return out
