"""The demo's rows whose privacy truth is known: captions with personal data, photos carrying GPS
EXIF, and scenes with faces pasted in, each with the fate the demo recipe must give it."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tasks.demo.curation_rows import ALLOWED, EXTRA_INDEX, rgb, save_jpeg
from tasks.demo.images import ImageInfo, render_image

# Extra scenes for these rows are rendered from this corpus index on (curation's end below it).
PRIVACY_INDEX = EXTRA_INDEX + 300
# (what the caption gains, the kinds the scanner must find in it). Each value is a documented
# example or test number: example.com, a UK drama number (Ofcom), Visa's test card, the IBAN of
# the ECBS's standard example, an address from GeoIP test data.
PERSONAL: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("; write to jane.doe@example.com for prints", ("email",), ("jane.doe@example.com",)),
    ("; bookings +44 20 7946 0958", ("phone",), ("7946 0958",)),
    ("; pay with card 4111 1111 1111 1111", ("card",), ("4111 1111 1111 1111",)),
    (
        "; transfer to GB82 WEST 1234 5698 7654 32, server 81.2.69.160",
        ("iban", "ip"),
        ("GB82 WEST 1234 5698 7654 32", "81.2.69.160"),
    ),
)
GPS_PHOTOS = 2
FACE_SCENES = 3


@dataclass(frozen=True)
class PrivacyRow:
    """A manifest row added for the privacy checks, and what the release must show of it.

    Args:
        source: the manifest it goes to (its end, after curation's rows).
        image: the picture the row points at.
        kind: ``personal_data`` (the caption holds ``kinds``), ``gps`` (the file carries GPS
            EXIF and a camera serial) or ``faces`` (``faces`` faces pasted into a scene).
        kinds: the personal data kinds the caption holds; values: their text, which the
            release must not hold.
        faces: faces pasted in.
    """

    source: str
    image: ImageInfo
    kind: str
    kinds: tuple[str, ...] = ()
    values: tuple[str, ...] = ()
    faces: int = 0


def _gps_exif() -> bytes:
    exif = Image.Exif()
    exif[0x010F] = "DemoCam"  # Make
    exif[0x0110] = "DC-1"  # Model
    exif[0xA431] = "SN-0042-7731"  # BodySerialNumber
    gps = exif.get_ifd(0x8825)
    gps.update({1: "N", 2: (59.0, 19.0, 44.0), 3: "E", 4: (18.0, 4.0, 6.0)})
    return exif.tobytes()


def _paste_faces(img: Image.Image, rng: np.random.Generator, faces: int) -> Image.Image:
    """``faces`` upright copies of the bundled face side by side along the picture's lower half."""
    from tasks.demo.faces import ASTRONAUT_FACE, astronaut_crop, face_tile

    out = img.copy()
    cell = out.width // faces
    crop = astronaut_crop()
    side = max(40, min(int(cell * 0.8 * ASTRONAUT_FACE[2] / crop.width), out.height // 3))
    for k in range(faces):
        tile, _ = face_tile(rng, crop, ASTRONAUT_FACE, side, jitter=False)
        x = k * cell + max(0, (cell - tile.width) // 2)
        y = max(0, out.height - tile.height - int(rng.integers(0, max(1, out.height // 6))))
        out.paste(tile, (x, y))
    return out


def privacy_rows(out_dir: Path, sources: list[str], seed: int = 0) -> list[PrivacyRow]:
    """Make the pictures of the privacy rows under ``out_dir/images/`` and return the rows: new
    scenes with their own captions (so curation keeps them), each changed in one way only."""
    images_dir = Path(out_dir) / "images"
    rng = np.random.default_rng([seed, 43])
    licenses = iter(ALLOWED * 100)
    rows: list[PrivacyRow] = []
    index = PRIVACY_INDEX

    def scene() -> tuple[Image.Image, dict[str, Any]]:
        nonlocal index
        _, data, meta = render_image(seed, index)
        index += 1
        with Image.open(io.BytesIO(data)) as src:
            return rgb(src), meta

    for n, (extra, kinds, values) in enumerate(PERSONAL):
        img, meta = scene()
        meta = {"caption": meta["caption"] + extra, "license": next(licenses), "author": meta["author"]}
        info = save_jpeg(images_dir, f"priv-text-{n:02d}.jpg", img, meta, index - 1)
        rows.append(PrivacyRow(sources[n % len(sources)], info, "personal_data", kinds, values))
    for n in range(GPS_PHOTOS):
        img, meta = scene()
        meta = {"caption": meta["caption"], "license": next(licenses), "author": meta["author"]}
        info = save_jpeg(images_dir, f"priv-gps-{n:02d}.jpg", img, meta, index - 1, exif=_gps_exif())
        rows.append(PrivacyRow(sources[n % len(sources)], info, "gps"))
    for n in range(FACE_SCENES):
        img, meta = scene()
        faces = 1 + n % 2
        meta = {"caption": meta["caption"], "license": next(licenses), "author": meta["author"]}
        info = save_jpeg(images_dir, f"priv-faces-{n:02d}.jpg", _paste_faces(img, rng, faces), meta, index - 1)
        rows.append(PrivacyRow(sources[n % len(sources)], info, "faces", faces=faces))
    return rows


def privacy_problems(expected: list[dict[str, Any]], rows: dict[str, dict[str, Any]], released: Any) -> list[str]:
    """What differs between the planted rows (EXPECTED.json's ``privacy``) and a run's outcome.

    ``rows``: key -> validation ledger row; ``released(key)`` -> the released sample's members
    (name -> bytes), or None. Under the demo recipe (faces blurred, personal data redacted) every
    planted row is released: its text with placeholders and none of the values, its faces found
    and blurred, its image with no EXIF; and no other row may have personal data or faces.
    """
    problems = []
    planted = {e["key"]: e for e in expected}
    for key, e in planted.items():
        row = rows.get(key)
        members = released(key)
        if row is None or row["status"] != "ok" or members is None:
            problems.append(f"{key} ({e['kind']}) was not released: {row and row['reason']}")
            continue
        meta = json.loads(members["json"])
        image = next(v for k, v in members.items() if k in ("jpg", "png", "webp"))
        if e["kind"] == "personal_data":
            found = sorted({p["kind"] for p in meta.get("personal_data", [])})
            if found != sorted(e["kinds"]) or "redacted" not in (row["privacy"] or ""):
                problems.append(
                    f"{key}: personal data {found or 'none'} ({row['privacy']}), expected {e['kinds']} redacted"
                )
            if any(v in members["txt"].decode() for v in e["values"]):
                problems.append(f"{key}: the released caption still holds the planted value")
        elif e["kind"] == "faces":
            if (row["faces"] or 0) < e["faces"] or "blurred" not in (row["privacy"] or ""):
                problems.append(f"{key}: {row['faces']} faces found ({row['privacy']}), expected {e['faces']} blurred")
        with Image.open(io.BytesIO(image)) as img:
            if img.getexif() or "exif" in img.info:
                problems.append(f"{key}: the released image carries EXIF")
    for key, row in sorted(rows.items()):
        if key not in planted and row["status"] == "ok" and (row.get("faces") or row.get("personal_data")):
            problems.append(
                f"{key}: faces {row.get('faces')} / personal data {row.get('personal_data')!r} found where none was planted"
            )
    return problems
