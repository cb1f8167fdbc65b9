"""Inputs of the example recipes, made from the demo's pictures: img2dataset's output layout and a Hugging Face parquet export."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from tasks.demo.images import ImageInfo
from tasks.formats.shards import ShardWriter

# The example recipes' allowlist; the demo's other licenses stay in the data, to be rejected.
SHARDS, PER_SHARD, PARQUET_ROWS = 2, 24, 24


def _jpeg(path: Path, side: int = 256) -> tuple[bytes, int, int]:
    """The picture as img2dataset's defaults store it: shorter side ``side``, JPEG."""
    with Image.open(path) as src:
        img = src.convert("RGB")
    scale = side / min(img.size)
    img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95)
    return buf.getvalue(), img.width, img.height


def img2dataset_shards(folder: Path, images: list[ImageInfo], images_dir: Path, base_url: str) -> list[Path]:
    """``NNNNN.tar`` ({key}.jpg, .txt, .json of each downloaded row), ``NNNNN.parquet`` (every
    row: url, caption, key, status, error_message, sizes) and ``NNNNN_stats.json``, as img2dataset
    writes them with ``--output_format webdataset --save_additional_columns '["license"]'``; the
    last row of each shard failed upstream (``failed_to_download``)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for shard in range(SHARDS):
        rows = images[shard * PER_SHARD : (shard + 1) * PER_SHARD]
        table, name = [], f"{shard:05d}"
        with open(folder / f"{name}.tar", "wb") as fh:
            writer = ShardWriter(fh)
            for i, info in enumerate(rows):
                key = f"{shard:05d}{i:04d}"
                failed = i == len(rows) - 1
                meta: dict[str, Any] = {
                    "url": f"{base_url}/img/{info.name}",
                    "caption": info.caption,
                    "key": key,
                    "status": "failed_to_download" if failed else "success",
                    "error_message": "HTTP Error 404: Not Found" if failed else None,
                    "width": None,
                    "height": None,
                    "original_width": None if failed else info.width,
                    "original_height": None if failed else info.height,
                    "exif": None,
                    "sha256": None,
                    "license": info.license,
                }
                if not failed:
                    data, w, h = _jpeg(images_dir / info.name)
                    meta.update(width=w, height=h)
                    writer.write_sample(
                        key, {"jpg": data, "txt": info.caption.encode(), "json": json.dumps(meta).encode()}
                    )
                table.append(meta)
            writer.close()
        pq.write_table(pa.Table.from_pylist(table), folder / f"{name}.parquet")
        ok = sum(r["status"] == "success" for r in table)
        stats = {"count": len(table), "successes": ok, "failed_to_download": len(table) - ok, "failed_to_resize": 0}
        (folder / f"{name}_stats.json").write_text(json.dumps(stats))
        out.append(folder / f"{name}.tar")
    return out


def images_parquet(path: Path, images: list[ImageInfo], images_dir: Path) -> Path:
    """A parquet as a Hugging Face dataset's export holds an ``Image`` column: a struct of the
    picture's bytes and its file name, beside id, caption, license and author."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "id": f"demo-{info.index}",
            "image": {"bytes": (images_dir / info.name).read_bytes(), "path": info.name},
            "caption": info.caption,
            "license": info.license,
            "author": info.author,
        }
        for info in images
    ]
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ("caption", pa.string()),
            ("license", pa.string()),
            ("author", pa.string()),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=8)
    return path


def make_example_inputs(example_dir: Path, images: list[ImageInfo], images_dir: Path) -> dict[str, Path]:
    """Everything the example recipes read, under ``example_dir`` (their ``SHARDSMITH_EXAMPLE_DIR``):
    ``webdataset/`` and ``parquet/``. Made again each time (a few seconds)."""
    example_dir = Path(example_dir)
    usable = [i for i in images if i.format in ("JPEG", "PNG", "WEBP")]
    shards = img2dataset_shards(example_dir / "webdataset", usable, images_dir, "http://example.invalid")
    parquet = images_parquet(example_dir / "parquet" / "part-00000.parquet", usable[-PARQUET_ROWS:], images_dir)
    return {"webdataset": shards[0].parent, "parquet": parquet}
