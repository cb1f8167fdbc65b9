"""The demo's rows whose truth is known to curation: captions of another picture, copies of kept pictures, watermarks."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tasks.demo.copies import COPY_KINDS, make_copy, watermark
from tasks.demo.images import ImageInfo, atomic_write, render_image
from tasks.demo.scenes import COLOURS, SHAPES

ALLOWED = ("CC0-1.0", "CC-BY-4.0", "CC-BY-SA-4.0")  # the demo recipe's allowlist
MISMATCHED, COPIES, WATERMARKED = 10, 12, 4
# Extra scenes are rendered at these corpus indices, far above any corpus size.
EXTRA_INDEX = 900_000


@dataclass(frozen=True)
class CurationRow:
    """A manifest row added for curation to remove, and why it must go.

    Args:
        source: the manifest it goes to (the end of it, after every original).
        image: the picture the row points at.
        kind: ``mismatch`` (its caption describes another picture), ``copy`` (an augmented copy
            of ``original``), ``watermark`` (a stock watermark over the picture).
        reasons: the reason families any of which removes it correctly (a copy pHash catches at
            validation is ``duplicate_of``, the others ``semantic_duplicate_of``).
        original: the name of the picture a copy was made from, or whose caption a mismatch has.
        augmentation: the copy's kind (``crop``, ``flip``, ``resize``, ``overlay``).
    """

    source: str
    image: ImageInfo
    kind: str
    reasons: tuple[str, ...]
    original: str | None = None
    augmentation: str | None = None


def content_words(caption: str) -> set[str]:
    words = {w.strip(".,").lower() for w in caption.split()}
    return {w for w in words if w in COLOURS or w.rstrip("s") in SHAPES}


def rgb(img: Image.Image) -> Image.Image:
    """RGB with any alpha composited on white, as validation stores it."""
    if img.mode in ("RGBA", "LA", "P"):
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, (0, 0), rgba)
        return out
    return img.convert("RGB")


def save_jpeg(
    images_dir: Path, name: str, img: Image.Image, meta: dict[str, Any], index: int, exif: bytes | None = None
) -> ImageInfo:
    buf = io.BytesIO()
    img.convert("RGB").save(buf, "JPEG", quality=90, **({"exif": exif} if exif else {}))
    data = buf.getvalue()
    atomic_write(images_dir / name, data)
    return ImageInfo(
        index=index,
        name=name,
        format="JPEG",
        mode="RGB",
        width=img.width,
        height=img.height,
        caption=meta["caption"],
        license=meta["license"],
        author=meta["author"],
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def curation_rows(
    out_dir: Path, images: list[ImageInfo], plain: dict[str, list[ImageInfo]], seed: int = 0
) -> list[CurationRow]:
    """Make the pictures of the curation rows under ``out_dir/images/`` and return the rows.

    ``plain``: per source, the corpus pictures of ordinary rows whose license the demo allows
    (copies are made of those, so their originals are kept by validation).
    """
    images_dir = Path(out_dir) / "images"
    rng = np.random.default_rng([seed, 32])
    rows: list[CurationRow] = []
    licenses = iter(ALLOWED * 100)
    # Copies: spread over the sources, each at the end of its original's source.
    originals = [(s, info) for s in plain for info in plain[s][: COPIES // len(plain) + 1]][:COPIES]
    for n, (source, info) in enumerate(originals):
        kind = COPY_KINDS[n % len(COPY_KINDS)]
        with Image.open(images_dir / info.name) as src:
            img = make_copy(rgb(src), kind, rng)
        meta = {"caption": info.caption, "license": next(licenses), "author": info.author}
        copy = save_jpeg(images_dir, f"cur-copy-{n:02d}.jpg", img, meta, EXTRA_INDEX + n)
        rows.append(CurationRow(source, copy, "copy", ("duplicate_of", "semantic_duplicate_of"), info.name, kind))
    # Mismatches: new scenes captioned with a corpus picture's caption that names other things.
    sources = list(plain)
    for n in range(MISMATCHED):
        _, data, meta = render_image(seed, EXTRA_INDEX + 100 + n)
        own = content_words(meta["caption"])
        other = next(i for i in images[n * 3 :] + images if not (content_words(i.caption) & own))
        with Image.open(io.BytesIO(data)) as src:
            img = rgb(src)
        meta = {"caption": other.caption, "license": next(licenses), "author": meta["author"]}
        info = save_jpeg(images_dir, f"cur-mismatch-{n:02d}.jpg", img, meta, EXTRA_INDEX + 100 + n)
        rows.append(CurationRow(sources[n % len(sources)], info, "mismatch", ("low_alignment",), other.name))
    # Watermarks over new scenes, with their own captions.
    for n in range(WATERMARKED):
        _, data, meta = render_image(seed, EXTRA_INDEX + 200 + n)
        with Image.open(io.BytesIO(data)) as src:
            img = watermark(rgb(src), rng)
        meta = {"caption": meta["caption"], "license": next(licenses), "author": meta["author"]}
        info = save_jpeg(images_dir, f"cur-watermark-{n:02d}.jpg", img, meta, EXTRA_INDEX + 200 + n)
        rows.append(CurationRow(sources[n % len(sources)], info, "watermark", ("watermark",)))
    return rows


def curation_problems(
    expected: list[dict[str, Any]], fates: dict[str, str | None], curated: dict[str, str | None]
) -> list[str]:
    """What differs between the planted rows (EXPECTED.json's ``curation``) and a run's outcome.

    ``fates``: key -> reason after validation (None: kept); ``curated``: key -> reason given by
    curation (None: kept), for every sample curation judged. Each planted row must end with one
    of its reasons; no other sample may be removed by curation.
    """
    from tasks.formats.reasons import family

    problems = []
    planted = {e["key"]: e for e in expected}
    for key, e in planted.items():
        reason = fates.get(key) or curated.get(key)
        if reason is None or family(reason) not in e["reasons"]:
            problems.append(
                f"{key} ({e['kind']}, {e['image']}) ended {reason or 'kept'}, expected {' or '.join(e['reasons'])}"
            )
    for key, reason in sorted(curated.items()):
        if reason is not None and key not in planted:
            problems.append(f"{key} was removed by curation ({reason}) though nothing was planted there")
    return problems
