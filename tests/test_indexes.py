"""Tests for tasks/formats/indexes/: a tiny release read back through DALI, webdataset, energon and wids."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import struct
import subprocess
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from energon_venv import NOT_INSTALLED, energon_command, missing, readers_python, run_reader
from release_fixtures import finetuning_release, pretraining_release

from tasks.formats.indexes import (
    ShardIndexInput,
    all_indexes,
    dali_indexes,
    energon_indexes,
    wids_index,
)
from tasks.formats.indexes.energon import collapse_ranges
from tasks.formats.shards import MemberRecord, ShardWriter
from tasks.formats.storage import Storage

# Three shards with different sample counts; captions cross block boundaries and hold UTF-8.
COUNTS = (4, 7, 1)
EXTS = ["jpg", "txt", "json"]


def _jpeg(i: int, fmt: str = "JPEG") -> bytes:
    from PIL import Image

    img = Image.new("RGB", (16 + i, 8 + (i % 5)), ((37 * i) % 256, 90, 200))
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt != "PNG" else {}))
    return buf.getvalue()


def _formats_shard(path: Path, exts: list[str]) -> ShardIndexInput:
    """One sample per extension, its image in that format (a release of png or webp images, or
    of several: ``skip_reencode`` keeps each source's format)."""
    with open(path, "wb") as fh:
        writer = ShardWriter(fh)
        for i, ext in enumerate(exts):
            fmt = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[ext]
            caption = f"a {ext} picture" if ext != "jpg" or len(exts) == 1 else ""
            members = {ext: _jpeg(i, fmt), "json": json.dumps({"caption": caption}).encode()}
            if caption:  # an empty caption (validate.caption.required: false) has no txt member
                members["txt"] = caption.encode()
            writer.write_sample(f"fmt-{i:06d}", members)
        writer.close()
    return ShardIndexInput(name=path.name, size=path.stat().st_size, samples=writer.records)


def test_energon_image_field_names_the_formats_released(tmp_path):
    cases = (
        (["png", "png"], "png", "txt"),
        (["webp", "jpg", "png"], "jpg,png,webp", "txt,json[caption]"),  # the jpg's caption is empty
        (["jpg"], "jpg", "txt"),
    )
    for exts, images, captions in cases:
        shard = _formats_shard(tmp_path / "shard-000000.tar", exts)
        dataset = yaml.safe_load(energon_indexes([shard])[".nv-meta/dataset.yaml"])
        assert dataset["field_map"] == {"image": images, "caption": captions}


def _caption(shard: int, i: int) -> bytes:
    text = f"shard {shard} sample {i}: a cat on a mat, café 猫"
    if i == 2:
        text += " and a very long tail" * 40  # longer than one tar block
    return text.encode("utf-8")


def _write_shard(path: Path, shard: int, count: int) -> ShardIndexInput:
    with open(path, "wb") as fh:
        writer = ShardWriter(fh)
        for i in range(count):
            writer.write_sample(
                f"src{shard}-{i:06d}",
                {"jpg": _jpeg(shard * 10 + i), "txt": _caption(shard, i), "json": json.dumps({"i": i}).encode()},
            )
        writer.close()
    return ShardIndexInput(name=path.name, size=path.stat().st_size, samples=writer.records)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A release folder: shards written by ShardWriter, every index written through Storage."""
    root = tmp_path_factory.mktemp("release")
    shards = [_write_shard(root / f"shard-{s:06d}.tar", s, n) for s, n in enumerate(COUNTS)]
    files = all_indexes(shards, name="tiny")
    storage = Storage(str(root))
    for rel, data in files.items():
        storage.write_bytes(rel, data)
    expected = [(f"src{s}-{i:06d}", _caption(s, i)) for s, n in enumerate(COUNTS) for i in range(n)]
    return {"root": root, "shards": shards, "files": files, "expected": expected}


def _tar_paths(release) -> list[str]:
    return [str(release["root"] / s.name) for s in release["shards"]]


# ---------------------------------------------------------------------------------------------
# The set of files, and plain webdataset
# ---------------------------------------------------------------------------------------------


def test_all_indexes_is_every_format_and_deterministic(release):
    shards = release["shards"]
    files = release["files"]
    assert sorted(files) == sorted(
        [f"shard-{s:06d}.idx" for s in range(3)]
        + [f"shard-{s:06d}.tar.idx" for s in range(3)]
        + [".nv-meta/dataset.yaml", ".nv-meta/split.yaml", ".nv-meta/.info.json", "wids-index.json"]
    )
    separate = {**dali_indexes(shards), **energon_indexes(shards), **wids_index(shards, name="tiny")}
    assert separate == files
    assert all_indexes(list(shards), name="tiny") == files
    assert all(isinstance(v, bytes) for v in files.values())


def test_webdataset_reads_the_release(release):
    import webdataset as wds

    ds = wds.WebDataset(_tar_paths(release), shardshuffle=False)
    got = [(s["__key__"], s["txt"]) for s in ds]
    assert got == release["expected"]


# ---------------------------------------------------------------------------------------------
# DALI
# ---------------------------------------------------------------------------------------------


def test_dali_index_bytes(release):
    shard = release["shards"][2]  # one sample
    text = release["files"]["shard-000002.idx"].decode()
    rec = shard.samples[0]
    jpg, js, txt = rec.members  # the writer sorts members by extension
    assert text == (
        "v1.2 1\n"
        f"jpg 512 {jpg.size} src2-000000.jpg "
        f"json {js.offset} {js.size} src2-000000.json "
        f"txt {txt.offset} {txt.size} src2-000000.txt\n"
    )
    for line in release["files"]["shard-000001.idx"].decode().splitlines()[1:]:
        fields = line.split()
        assert len(fields) == 12
        assert all(int(off) % 512 == 0 for off in fields[1::4])


def test_dali_index_matches_wds2idx(release, tmp_path):
    if importlib.util.find_spec("wds2idx") is None or shutil.which("tar") is None:
        missing("DALI's wds2idx (or GNU tar, which it runs) is not installed")
    from wds2idx import IndexCreator

    for shard in release["shards"]:
        theirs = tmp_path / shard.name.replace(".tar", ".idx")
        with IndexCreator(str(release["root"] / shard.name), str(theirs), verbose=False) as creator:
            creator.create_index()
        assert release["files"][shard.name.replace(".tar", ".idx")] == theirs.read_bytes()


def _dali_read(paths, index_paths):
    """(caption bytes, image shape, source info) per sample, one epoch, on the CPU."""
    import numpy as np
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def pipe():
        jpg, txt, js = fn.readers.webdataset(
            paths=paths,
            index_paths=index_paths,
            ext=EXTS,
            missing_component_behavior="error",
            random_shuffle=False,
            name="reader",
        )
        return fn.decoders.image(jpg, device="cpu"), txt, js, jpg

    p = pipe()
    p.build()
    total = p.epoch_size("reader")
    got = []
    while len(got) < total:
        images, txts, jsons, jpgs = p.run()
        for i in range(len(txts)):
            if len(got) < total:
                got.append(
                    (
                        bytes(np.asarray(txts[i])),
                        np.asarray(images[i]).shape,
                        jpgs[i].source_info(),
                        json.loads(bytes(np.asarray(jsons[i]))),
                    )
                )
    return total, got


def test_dali_reads_the_release_with_our_indexes(release):
    root = release["root"]
    paths = _tar_paths(release)
    total, got = _dali_read(paths, [str(root / s.name.replace(".tar", ".idx")) for s in release["shards"]])
    expected = release["expected"]
    assert total == len(expected) == sum(COUNTS)
    assert [g[0] for g in got] == [caption for _, caption in expected]
    keys = [key for key, _ in expected]
    for (_caption, shape, source, meta), key, index in zip(got, keys, [i for n in COUNTS for i in range(n)]):
        assert source.endswith(f":{key}.jpg")  # the member name from the v1.2 index line
        assert meta == {"i": index}
        assert len(shape) == 3 and shape[2] == 3 and shape[0] > 0


def test_dali_follows_the_index_lines(release, tmp_path):
    # A DALI that ignored index_paths and scanned the tar would not reorder samples.
    shard = release["shards"][0]
    lines = release["files"][shard.name.replace(".tar", ".idx")].decode().splitlines(keepends=True)
    swapped = tmp_path / "swapped.idx"
    swapped.write_text(lines[0] + lines[2] + lines[1] + "".join(lines[3:]))
    _, got = _dali_read([str(release["root"] / shard.name)], [str(swapped)])
    captions = [caption for _, caption in release["expected"][: COUNTS[0]]]
    assert [g[0] for g in got] == [captions[1], captions[0], *captions[2:]]


# ---------------------------------------------------------------------------------------------
# Megatron-Energon, at the byte level
# ---------------------------------------------------------------------------------------------


def _tarfile_sample_offsets(path: Path) -> list[int]:
    """What `energon prepare` records: tarfile's header offset of each key's first member, then
    the offset where reading stopped (the end-of-archive blocks)."""
    offsets, last = [], None
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            key = member.name.split(".", 1)[0]
            if key != last:
                offsets.append(member.offset)
                last = key
        offsets.append(tar.offset)
    return offsets


def test_energon_tar_idx_decodes_to_sample_offsets(release):
    for shard in release["shards"]:
        raw = release["files"][shard.name + ".idx"]
        assert len(raw) == 8 * (len(shard.samples) + 1)
        offsets = list(struct.unpack(f"<{len(raw) // 8}Q", raw))
        assert offsets == _tarfile_sample_offsets(release["root"] / shard.name)
        assert offsets[:-1] == [s.offset for s in shard.samples]
        assert offsets[-1] + 1024 == shard.size


def test_energon_meta_files(release):
    files = release["files"]
    assert files[".nv-meta/dataset.yaml"] == (
        b"sample_type:\n"
        b"  __module__: megatron.energon\n"
        b"  __class__: CaptioningSample\n"
        b"field_map:\n"
        b"  image: jpg\n"
        b"  caption: txt\n"
    )
    # val and test present and empty, as `energon prepare --split-ratio 1,0,0` writes them:
    # `energon lint` checks all three by default and refuses a missing one.
    assert files[".nv-meta/split.yaml"] == (
        b"split_parts:\n  train:\n  - shard-{000000..000002}.tar\n  val: []\n  test: []\nexclude: []\n"
    )
    assert json.loads(files[".nv-meta/.info.json"]) == {
        "shard_counts": {"shard-000000.tar": 4, "shard-000001.tar": 7, "shard-000002.tar": 1}
    }
    assert ".nv-meta/crude.yaml" not in files


def test_energon_crude_config_beside_a_dataset_yaml_every_reader_loads(release):
    crude = energon_indexes(release["shards"], sample_type="CrudeWebdataset")
    assert crude[".nv-meta/crude.yaml"] == b"__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    assert crude[".nv-meta/dataset.yaml"] == (
        b"sample_type:\n  __module__: megatron.energon\n  __class__: TextSample\nfield_map:\n  text: json\n"
    )
    # The default view needs a json member in every sample.
    no_json = replace(
        release["shards"][2],
        samples=[replace(release["shards"][2].samples[0], members=release["shards"][2].samples[0].members[:1])],
    )
    with pytest.raises(ValueError, match="no member for field 'text'"):
        energon_indexes([no_json], sample_type="CrudeWebdataset")


def test_energon_split_parts(release):
    shards = release["shards"]
    files = energon_indexes(shards, split_parts={"train": r"shard-00000[01]\.tar", "val": [r"shard-000002"]})
    assert yaml.safe_load(files[".nv-meta/split.yaml"]) == {
        "split_parts": {"train": ["shard-{000000..000001}.tar"], "val": ["shard-000002.tar"]},
        "exclude": [],
    }
    with pytest.raises(ValueError, match="match no shard"):
        energon_indexes(shards, split_parts={"train": ".*", "test": "nothing"})
    with pytest.raises(ValueError, match="is in split parts"):
        energon_indexes(shards, split_parts={"train": ".*", "val": "shard-000002"})


def testcollapse_ranges_round_trips_through_braceexpand():
    import braceexpand

    cases = [
        ["shard-000000.tar", "shard-000001.tar", "shard-000003.tar"],
        ["a/shard-09.tar", "a/shard-10.tar", "a/shard-11.tar", "b/shard-12.tar"],
        ["p00/s000.tar", "p00/s001.tar", "p01/s000.tar", "p01/s001.tar"],
        ["x9.tar", "x10.tar", "plain.tar", "y5.tar", "y4.tar"],
    ]
    assert collapse_ranges(cases[0]) == ["shard-{000000..000001}.tar", "shard-000003.tar"]
    assert collapse_ranges(cases[2]) == ["p00/s{000..001}.tar", "p01/s{000..001}.tar"]
    assert collapse_ranges(cases[3]) == cases[3]  # width change, no number, descending
    for names in cases:
        expanded = [n for pattern in collapse_ranges(names) for n in braceexpand.braceexpand(pattern)]
        assert expanded == names


# ---------------------------------------------------------------------------------------------
# wids, at the byte level
# ---------------------------------------------------------------------------------------------


def test_wids_index_json(release):
    shards = release["shards"]
    doc = json.loads(release["files"]["wids-index.json"])
    assert doc == {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [{"url": s.name, "nsamples": n, "filesize": s.size} for s, n in zip(shards, COUNTS)],
        "name": "tiny",
    }
    based = json.loads(wids_index(shards, base_url="s3://bucket/ds/releases/v0001/")["wids-index.json"])
    assert "name" not in based
    assert [e["url"] for e in based["shardlist"]] == [f"s3://bucket/ds/releases/v0001/{s.name}" for s in shards]


# ---------------------------------------------------------------------------------------------
# Records no reader could use
# ---------------------------------------------------------------------------------------------


def test_bad_records_raise(release):
    good = release["shards"][1]
    first, second = good.samples[0], good.samples[1]
    moved = replace(second, offset=second.offset + 512)
    nudged = replace(first.members[0], offset=first.members[0].offset + 1)
    misaligned = replace(first, members=(nudged,) + first.members[1:])
    stranger = replace(first, members=(MemberRecord("other.jpg", first.members[0].offset, 3),) + first.members[1:])
    cases = {
        "relative path": replace(good, name="/abs/shard.tar"),
        "relative path ": replace(good, name="shard 1.tar"),
        "ending in '.tar'": replace(good, name="shard-000001.tgz"),
        "no samples": replace(good, samples=[]),
        "expected": replace(good, samples=[first, moved, *good.samples[2:]]),
        "not block-aligned": replace(good, samples=[misaligned, *good.samples[1:]]),
        "not part of sample": replace(good, samples=[stranger, *good.samples[1:]]),
        "end-of-archive": replace(good, size=good.size - 1024),
    }
    for message, shard in cases.items():
        with pytest.raises(ValueError, match=message.strip()):
            all_indexes([shard])
    with pytest.raises(ValueError, match="repeat"):
        dali_indexes([good, good])
    with pytest.raises(ValueError, match="no shards"):
        wids_index([])
    with pytest.raises(ValueError, match="no member for field 'caption'"):
        energon_indexes([good], field_map={"image": "jpg", "caption": "cap"})
    with pytest.raises(ValueError, match="no field_map"):
        energon_indexes([good], sample_type="CrudeWebdataset", field_map={"image": "jpg"})
    with pytest.raises(ValueError, match="needs a field_map"):
        energon_indexes([good], sample_type="VQASample")
    # Alternatives and json fields, as energon's field maps allow them.
    energon_indexes([good], sample_type="VQASample", field_map={"image": "png,jpg", "context": "json[i]"})


# ---------------------------------------------------------------------------------------------
# The real readers: energon (get_val_dataset, and `energon prepare` for byte comparison) and
# wids, in their own venv
# ---------------------------------------------------------------------------------------------

_READERS_SCRIPT = r"""
import contextlib, json, os, sys
release, reference, cache, reference_default, chat, formats = sys.argv[1:7]
out = {}
with contextlib.redirect_stdout(sys.stderr):
    try:
        import wids
    except ImportError:
        out["wids"] = None
    else:
        ds = wids.ShardListDataset(os.path.join(release, "wids-index.json"), cache_dir=cache,
                                   transformations=[lambda s: s])
        rows = []
        for i in range(len(ds)):
            s = ds[i]
            rows.append([s["__key__"], s[".txt"].read().decode("utf-8"), os.path.basename(s["__shard__"])])
        out["wids"] = {"len": int(len(ds)), "name": ds.spec.get("name"), "rows": rows}

    from megatron.energon import WorkerConfig, get_loader, get_val_dataset
    from megatron.energon.tools.prepare import command

    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_val_dataset(release, split_part="train", worker_config=worker_config, batch_size=1)
    out["energon"] = [
        [b.__key__[0], b.__class__.__name__, b.caption[0], list(b.image[0].shape)] for b in get_loader(ds)
    ]
    ds = get_val_dataset(formats, split_part="train", worker_config=worker_config, batch_size=1)
    out["formats"] = [[b.__key__[0], b.caption[0], list(b.image[0].shape)] for b in get_loader(ds)]
    command.main(
        [reference, "--non-interactive", "--no-progress", "--num-workers", "1",
         "--split-parts", r"train:shard-00000[01]\.tar", "--split-parts", "val:shard-000002",
         "--sample-type", "CaptioningSample", "--field-map", json.dumps({"image": "jpg", "caption": "txt"})],
        standalone_mode=False,
    )
    # What a release without split_parts should match: every shard in train, by ratio.
    command.main(
        [reference_default, "--non-interactive", "--no-progress", "--num-workers", "1", "--split-ratio", "1,0,0",
         "--sample-type", "CaptioningSample", "--field-map", json.dumps({"image": "jpg", "caption": "txt"})],
        standalone_mode=False,
    )

    # A fine-tuning release through its crude.yaml and a TaskEncoder with a cooker, as training
    # reads it; and through dataset.yaml with energon's defaults, as its own tools do.
    from megatron.energon import Cooker, DefaultTaskEncoder, TextSample, basic_sample_keys, stateless

    @stateless
    def cook(sample):
        return TextSample(**basic_sample_keys(sample), text=sample["json"]["key"])

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

    ds = get_val_dataset(chat, split_part="train", worker_config=worker_config, batch_size=1,
                         dataset_config="crude.yaml", task_encoder=Encoder())
    out["cooked"] = [b.text[0] for b in get_loader(ds)]
    ds = get_val_dataset(chat, split_part="train", worker_config=worker_config, batch_size=1)
    out["default_view"] = [[b.__class__.__name__, b.text["key"][0]] for b in get_loader(ds)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def readers(release, tmp_path_factory):
    python = readers_python()
    if python is None:
        missing(NOT_INSTALLED)
    work = tmp_path_factory.mktemp("readers")
    reference, reference_default = work / "reference", work / "reference-default"
    for folder in (reference, reference_default):
        folder.mkdir()
        for shard in release["shards"]:
            shutil.copyfile(release["root"] / shard.name, folder / shard.name)
    formats = work / "formats"
    formats.mkdir()
    shard = _formats_shard(formats / "shard-000000.tar", ["png", "webp", "jpg"])
    for rel, data in all_indexes([shard]).items():
        Storage(str(formats)).write_bytes(rel, data)
    chat_url, chat_records = finetuning_release(str(work / "store"), [3, 2])
    chat = Path(chat_url) / "releases" / "v0001"
    script = work / "readers.py"
    script.write_text(_READERS_SCRIPT)
    lines = run_reader(
        python,
        script,
        [
            str(release["root"]),
            str(reference),
            str(work / "wids-cache"),
            str(reference_default),
            str(chat),
            str(formats),
        ],
        work,
    )
    return {
        "reference": reference,
        "reference_default": reference_default,
        "chat_keys": [r["key"] for r in chat_records],
        **json.loads(lines[-1]),
    }


def test_energon_reads_the_release(release, readers):
    expected = release["expected"]
    got = readers["energon"]
    assert [row[0] for row in got] == [key for key, _ in expected]
    assert {row[1] for row in got} == {"CaptioningSample"}
    assert [row[2].encode("utf-8") for row in got] == [caption for _, caption in expected]
    assert all(len(row[3]) == 3 and row[3][0] == 3 for row in got)  # decoded CHW tensors


def test_energon_reads_png_webp_and_mixed_releases(readers):
    """A release of png or webp images (``output_format``), or of several, reads as
    CaptioningSample: the image field names every format its samples have; an empty caption
    (no txt member) is read from the json."""
    got = readers["formats"]
    assert [row[:2] for row in got] == [
        ["fmt-000000", "a png picture"],
        ["fmt-000001", "a webp picture"],
        ["fmt-000002", ""],
    ]
    assert [row[2] for row in got] == [[3, 8, 16], [3, 9, 17], [3, 10, 18]]


def test_energon_prepare_writes_the_same_bytes(release, readers):
    reference = readers["reference"]
    ours = energon_indexes(
        release["shards"],
        split_parts={"train": r"shard-00000[01]\.tar", "val": "shard-000002"},
    )
    for rel in [".nv-meta/dataset.yaml", ".nv-meta/split.yaml"] + [s.name + ".idx" for s in release["shards"]]:
        assert ours[rel] == (reference / rel).read_bytes(), rel
    # .info.json differs only by the energon_version that energon stamps into its own.
    theirs = json.loads((reference / ".nv-meta/.info.json").read_text())
    assert theirs.pop("energon_version")
    assert ours[".nv-meta/.info.json"] == json.dumps(theirs, indent=2).encode()
    # Without split parts: what `energon prepare --split-ratio 1,0,0` writes, val and test empty.
    default = readers["reference_default"] / ".nv-meta"
    for rel in ("split.yaml", "dataset.yaml"):
        assert release["files"][f".nv-meta/{rel}"] == (default / rel).read_bytes(), rel


def test_energon_reads_a_crude_release_with_cookers_and_with_its_defaults(readers):
    assert readers["cooked"] == readers["chat_keys"]
    assert readers["default_view"] == [["TextSample", key] for key in readers["chat_keys"]]


def test_wids_reads_the_release(release, readers):
    if readers["wids"] is None:
        missing("wids is not installed beside megatron-energon")
    result = readers["wids"]
    expected = release["expected"]
    assert result["len"] == len(expected)
    assert result["name"] == "tiny"
    shard_of = [s.name for s, n in zip(release["shards"], COUNTS) for _ in range(n)]
    want = [[key, caption.decode("utf-8"), shard] for (key, caption), shard in zip(expected, shard_of)]
    assert result["rows"] == want


# ---------------------------------------------------------------------------------------------
# energon's own checks, with their defaults, on each kind of release
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lint_releases(tmp_path_factory) -> dict[str, Path]:
    """A pretraining release (with latents), and fine-tuning releases unpacked and packed."""
    root = tmp_path_factory.mktemp("lint")
    pre = pretraining_release(str(root), [3, 2], latents=True)
    chat, _ = finetuning_release(str(root), [3, 2])
    packed, _ = finetuning_release(str(root), [6, 5], packed_budget=400, dataset="chat-packed")
    return {
        name: Path(url) / "releases" / "v0001"
        for name, url in (("pretraining", pre), ("finetuning", chat), ("finetuning-packed", packed))
    }


@pytest.mark.parametrize("kind", ["pretraining", "finetuning", "finetuning-packed"])
def test_energon_lint_and_info_pass_with_their_defaults(kind, lint_releases, tmp_path):
    python = readers_python()
    if python is None:
        missing(NOT_INSTALLED)
    energon = energon_command(python)
    release = lint_releases[kind]
    lint = subprocess.run([*energon, "lint", str(release)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert lint.returncode == 0, lint.stdout[-2000:] + lint.stderr[-4000:]
    assert "Skipping empty split part val" in lint.stdout and "Skipping empty split part test" in lint.stdout
    info = subprocess.run([*energon, "info", str(release)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert info.returncode == 0, info.stdout[-2000:] + info.stderr[-4000:]
    samples = sum(json.loads((release / ".nv-meta" / ".info.json").read_text())["shard_counts"].values())
    assert f"`train`: 100%, {samples} samples" in info.stdout
