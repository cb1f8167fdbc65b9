"""Crafted WebDataset shards (img2dataset's layout, hostile ones) and parquet files with embedded images, for the tests of tasks/sources/ (no tests here)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import make_image

JPEG = make_image("JPEG", size=(96, 80))
PNG = make_image("PNG", size=(96, 80), color=(20, 160, 20))


def distinct_image(seed: int, fmt: str = "JPEG") -> bytes:
    """An image unlike any other seed's (random blocks), so dedup keeps every one."""
    import numpy as np
    from PIL import Image

    blocks = np.random.default_rng(seed).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(blocks).resize((96, 80), Image.NEAREST).save(buf, format=fmt)
    return buf.getvalue()


def tar_bytes(members: Iterable[tuple[str, bytes] | tarfile.TarInfo]) -> bytes:
    """A plain ustar tar of the members, in order: (name, data) files, or TarInfo as given (links)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tf.addfile(m)
                continue
            name, data = m
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sample(
    key: str, caption: str | None = None, image: bytes = JPEG, meta: dict | None = None, ext: str = "jpg"
) -> list[tuple[str, bytes]]:
    """The members of one webdataset sample: image, caption, json."""
    out = [(f"{key}.{ext}", image)]
    if caption is not None:
        out.append((f"{key}.txt", caption.encode()))
    if meta is not None:
        out.append((f"{key}.json", json.dumps(meta).encode()))
    return out


def good_samples(prefix: str, n: int, license: str = "CC-BY-4.0") -> list[tuple[str, bytes]]:
    members = []
    for i in range(n):
        members += sample(
            f"{prefix}{i:04d}",
            f"a photo number {i} of {prefix}",
            meta={"license": license, "url": f"https://example.org/{prefix}{i}.jpg"},
        )
    return members


def img2dataset_shard(folder: Path, shard: int, rows: list[dict], missing: Iterable[str] = ()) -> None:
    """A shard as img2dataset writes it: ``NNNNN.tar`` of the successful rows ({key}.jpg/.txt/.json),
    ``NNNNN.parquet`` with every row (url, caption, key, status, error_message, width, height,
    original_width, original_height, exif, sha256) and ``NNNNN_stats.json``. Keys in ``missing``
    are listed as successes in the parquet but left out of the tar."""
    name = f"{shard:05d}"
    members = []
    table_rows = []
    for i, r in enumerate(rows):
        key = f"{shard:05d}{i:04d}"
        ok = r.get("status", "success") == "success"
        meta = {
            "url": r["url"], "caption": r.get("caption"), "key": key, "status": "success" if ok else r["status"],
            "error_message": None if ok else r.get("error_message", "boom"), "width": 96 if ok else None, "height": 80 if ok else None,
            "original_width": 96 if ok else None, "original_height": 80 if ok else None, "exif": None, "sha256": None, "license": r.get("license"),
        }  # fmt: skip
        table_rows.append(meta)
        if ok and key not in set(missing):
            members += sample(key, r.get("caption") or "", image=distinct_image(shard * 10_000 + i), meta=meta)
    (folder / f"{name}.tar").write_bytes(tar_bytes(members))
    pq.write_table(pa.Table.from_pylist(table_rows), folder / f"{name}.parquet")
    stats = {
        "count": len(rows),
        "successes": sum(r.get("status", "success") == "success" for r in rows),
        "failed_to_download": 0,
        "failed_to_resize": 0,
    }
    (folder / f"{name}_stats.json").write_text(json.dumps(stats))


def member_offset(data: bytes, name: str) -> int:
    """Header offset of a member of a tar."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return tf.getmember(name).offset


def hostile_shards(folder: Path) -> dict[str, str]:
    """One shard per shard-level fault, each with two good samples before the fault; returns
    {file name: the reason its last ledger row must carry}."""
    good = good_samples("k", 2)
    whole = tar_bytes(good + sample("k0002", "cut short"))
    third = member_offset(whole, "k0002.jpg")  # header of the third sample's first member
    cut = whole[: third + 512 + 300]  # inside the third sample's image
    link = tarfile.TarInfo("k0002.jpg")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    hard = tarfile.TarInfo("k0002.jpg")
    hard.type, hard.linkname = tarfile.LNKTYPE, "k0000.jpg"
    bad_checksum = bytearray(whole)
    bad_checksum[third + 150] ^= 0x11
    shards = {
        "a-truncated.tar": (cut, "tar_truncated"),
        "b-symlink.tar": (tar_bytes(good + [link]), "tar_symlink"),
        "c-hardlink.tar": (tar_bytes(good + [hard]), "tar_hardlink"),
        "d-parent.tar": (tar_bytes(good + [("../k0002.jpg", JPEG)]), "tar_parent_reference"),
        "e-absolute.tar": (tar_bytes(good + [("/k0002.jpg", JPEG)]), "tar_absolute_name"),
        "f-checksum.tar": (bytes(bad_checksum), "tar_bad_checksum"),
        "g-compressed.tar": (gzip.compress(tar_bytes(good)), "tar_compressed"),
        "h-notatar.tar": (b"this is not a tar file at all\n" * 40, "not_a_tar"),
        "i-empty.tar": (b"", "not_a_tar"),
    }
    for name, (data, _) in shards.items():
        (folder / name).write_bytes(data)
    return {name: reason for name, (_, reason) in shards.items()}


def images_parquet(
    path: Path, n: int, *, struct: bool, row_group_size: int = 4, extra_rows: list[dict] | None = None
) -> None:
    """A parquet of ``n`` good rows (id, image, caption, license, author) plus ``extra_rows``:
    ``image`` raw bytes, or Hugging Face's ``{bytes, path}`` struct."""
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())]) if struct else pa.binary()
    rows = []
    for i in range(n):
        data = distinct_image(i, "JPEG" if i % 2 == 0 else "PNG")
        rows.append(
            {
                "id": f"img-{i}",
                "image": {"bytes": data, "path": f"{i}.jpg"} if struct else data,
                "caption": f"picture {i} of a thing",
                "license": "CC0-1.0",
                "author": f"author {i}",
            }
        )
    rows += extra_rows or []
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("image", image_type),
            ("caption", pa.string()),
            ("license", pa.string()),
            ("author", pa.string()),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
