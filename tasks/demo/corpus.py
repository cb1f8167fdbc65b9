"""The demo corpus: real-looking images with captions and licenses, and manifests that point at a loopback server."""

from __future__ import annotations

import csv
import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.demo.images import (
    AUTHORS,
    COLUMNS,
    EXPECTED_NAME,
    LICENSES,
    MANIFEST_FILES,
    MIN_IMAGES,
    SOURCES,
    ImageInfo,
    atomic_write,
    ensure_images,
)
from tasks.demo.webserver import ImageWeb
from tasks.formats.reasons import OK, status_of


@dataclass(frozen=True)
class BadRow:
    """A deliberately bad manifest row and the reason the pipeline should give it.

    Args:
        source: the manifest it is written to (``photos``, ``art``, ``scans``).
        url: URL template: ``{base}`` is the server, ``{name}`` an image of that manifest
            (the row then takes over that image's row instead of adding one); ``None`` with
            ``raw`` set writes a raw line instead of a row.
        reason: the ledger reason, or None when the row should end up ok.
        why: what the row exercises.
        raw: a raw manifest line (jsonl only), for rows that must not parse.
        image_format: the format the taken-over image must have, when it matters.
    """

    source: str
    url: str | None
    reason: str | None
    why: str
    raw: str | None = None
    image_format: str | None = None


BAD_ROWS: tuple[BadRow, ...] = (
    BadRow("photos", "{base}/status/404", "http_404", "the server answers 404 Not Found"),
    BadRow(
        "photos",
        "{base}/html-as-jpeg",
        "not_an_image",
        "an HTML page labelled image/jpeg; formats are sniffed from bytes",
    ),
    BadRow("photos", "", "missing_url", "an empty url field in the CSV"),
    BadRow(
        "art",
        "{base}/truncated/{name}",
        "truncated_image",
        "the first half of a JPEG, with a matching Content-Length",
        image_format="JPEG",
    ),
    BadRow("art", "{base}/optout/{name}", "opted_out", "X-Robots-Tag: noai, noimageai"),
    BadRow(
        "art",
        None,
        "unparsable_row",
        "a jsonl line cut off mid-string",
        raw='{"url": "{base}/img/lost.jpg", "caption": "a torn line of js',
    ),
    BadRow("scans", "ftp://ftp.example.org/pub/scans/lighthouse.jpg", "unsupported_scheme", "ftp:// is not fetched"),
    BadRow("scans", None, "missing_url", "a null url in the parquet"),
)

# Rows that look like trouble but must end up ok under the demo recipe (retries >= 1,
# max_redirects >= 2, max_retry_after_s >= 1): they take over an image's row.
TRICKY_ROWS: tuple[BadRow, ...] = (
    BadRow("photos", "{base}/redirect-chain/2/{name}", None, "two redirect hops, then the image"),
    BadRow("photos", "{base}/ratelimit/1/1/{name}", None, "one 429 with Retry-After: 1, then the image"),
    BadRow("art", "{base}/flaky/1/{name}", None, "one 500, then the image on the retry"),
    BadRow(
        "scans", "{base}/optout-other-bot/{name}", None, "X-Robots-Tag scoped to another user agent is not an opt-out"
    ),
)


# --------------------------------------------------------------------------- manifests


def _source_of(index: int) -> str:
    # About half photos, a third art, a sixth scans, interleaved so each spans the corpus.
    return ("photos", "photos", "photos", "art", "art", "scans")[index % 6]


def _truncates_cleanly(data: bytes) -> bool:
    """True when the first half of a JPEG has no end-of-image marker (so it reads as truncated)."""
    half = data[: len(data) // 2]
    return half.startswith(b"\xff\xd8\xff") and half.rfind(b"\xff\xd9") < 2


def _plan(images: list[ImageInfo], images_dir: Path) -> dict[str, list[tuple[dict[str, Any] | str, BadRow | None]]]:
    """Rows per source: (row dict or raw line, the special row it came from or None)."""
    plan: dict[str, list[tuple[dict[str, Any] | str, BadRow | None]]] = {s: [] for s in SOURCES}
    for info in images:
        plan[_source_of(info.index)].append(({"image": info}, None))

    for source in SOURCES:
        specials = [r for r in (*BAD_ROWS, *TRICKY_ROWS) if r.source == source]
        rows = plan[source]
        base_len = len(rows)
        taken: set[int] = set()
        inserts: list[tuple[int, BadRow]] = []
        for k, special in enumerate(specials):
            # Spread the special rows through the manifest rather than bunching them.
            pos = (k + 1) * base_len // (len(specials) + 1)
            if special.url is not None and "{name}" in special.url:
                for step in range(base_len):
                    j = (pos + step) % base_len
                    if j in taken:
                        continue
                    info = rows[j][0]["image"]  # type: ignore[index]
                    if special.image_format and info.format != special.image_format:
                        continue
                    if special.reason == "truncated_image" and not _truncates_cleanly(
                        (images_dir / info.name).read_bytes()
                    ):
                        continue
                    taken.add(j)
                    rows[j] = ({"image": info, "url": special.url}, special)
                    break
                else:
                    raise ValueError(f"no image in {source} suits the special row {special.url!r}; use a larger corpus")
            else:
                inserts.append((pos, special))
        for offset, (pos, special) in enumerate(inserts):
            rows.insert(pos + offset, (special.raw if special.raw is not None else {"url": special.url}, special))
    return plan


_EXTRA_CAPTIONS = {
    "photos": "lighthouse on a rocky coast under a stormy sky",
    "art": "watercolour of a harbour at sunset",
    "scans": "scanned postcard of a lighthouse, 1952",
}


def _materialize(source: str, item: dict[str, Any] | str, base_url: str, salt: int) -> dict[str, Any] | str:
    if isinstance(item, str):
        return item.replace("{base}", base_url)
    info: ImageInfo | None = item.get("image")
    if info is None:
        url = item["url"]
        return {
            "url": url.replace("{base}", base_url) if url is not None else None,
            "caption": _EXTRA_CAPTIONS[source],
            "license": LICENSES[salt % len(LICENSES)][0],
            "author": AUTHORS[salt % len(AUTHORS)],
            "width": None,
            "height": None,
        }
    template = item.get("url", "{base}/img/{name}")
    return {
        "url": template.replace("{base}", base_url).replace("{name}", info.name),
        "caption": info.caption,
        "license": info.license,
        "author": info.author,
        "width": info.width,
        "height": info.height,
    }


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row[k] is None else row[k] for k in COLUMNS})
    atomic_write(path, buf.getvalue().encode("utf-8"))


def _write_jsonl_gz(path: Path, rows: list[dict[str, Any] | str]) -> None:
    lines = []
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
        else:
            # Real jsonl manifests leave out fields they do not have rather than writing null.
            lines.append(json.dumps({k: v for k, v in row.items() if v is not None}, ensure_ascii=False))
    buf = io.BytesIO()
    # mtime=0 and no file name: the same rows give the same bytes.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:
        gz.write(("\n".join(lines) + "\n").encode("utf-8"))
    atomic_write(path, buf.getvalue())


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    schema = pa.schema(
        [
            ("url", pa.string()),
            ("caption", pa.string()),
            ("license", pa.string()),
            ("author", pa.string()),
            ("width", pa.int32()),
            ("height", pa.int32()),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    atomic_write(path, buf.getvalue().to_pybytes())


def _add_curation_rows(
    out_dir: Path, images: list[ImageInfo], plan: dict[str, list[tuple[dict[str, Any] | str, BadRow | None]]], seed: int
) -> list[dict[str, Any]]:
    """Append the rows curation must remove to the end of their manifests; EXPECTED.json's
    ``curation`` entries for them (source, row, key, kind, the reasons that may remove it, the
    original picture, the augmentation)."""
    from tasks.demo.curation_rows import ALLOWED, curation_rows
    from tasks.policies.licenses import normalize_license

    plain = {
        s: [
            item["image"]
            for item, special in rows
            if special is None
            and isinstance(item, dict)
            and "image" in item
            and normalize_license(item["image"].license) in ALLOWED
        ]
        for s, rows in plan.items()
    }
    out = []
    for row in curation_rows(out_dir, images, plain, seed):
        rows = plan[row.source]
        out.append(
            {
                "source": row.source,
                "row": len(rows),
                "key": f"{row.source}-{len(rows):09d}",
                "kind": row.kind,
                "reasons": list(row.reasons),
                "image": row.image.name,
                "original": row.original,
                "augmentation": row.augmentation,
            }
        )
        rows.append(({"image": row.image}, None))
    return out


def _add_privacy_rows(
    out_dir: Path, plan: dict[str, list[tuple[dict[str, Any] | str, BadRow | None]]], seed: int
) -> list[dict[str, Any]]:
    """Append the rows the privacy checks must find (tasks/demo/privacy_rows.py) to the end of
    their manifests; EXPECTED.json's ``privacy`` entries for them."""
    from tasks.demo.privacy_rows import privacy_rows

    out = []
    for row in privacy_rows(out_dir, list(plan), seed):
        rows = plan[row.source]
        key = f"{row.source}-{len(rows):09d}"
        out.append(
            {
                "source": row.source,
                "row": len(rows),
                "key": key,
                "kind": row.kind,
                "kinds": list(row.kinds),
                "values": list(row.values),
                "faces": row.faces,
                "image": row.image.name,
            }
        )
        rows.append(({"image": row.image}, None))
    return out


def write_manifests(out_dir: Path, images: list[ImageInfo], base_url: str, seed: int = 0) -> dict[str, Path]:
    """Write photos.csv, art.jsonl.gz and scans.parquet under ``out_dir/manifests/``, and EXPECTED.json.

    Every image gets exactly one row; the rows in ``BAD_ROWS`` and ``TRICKY_ROWS`` either take
    over an image's row (their URL has ``{name}``) or are added; the rows curation must remove
    (``tasks.demo.curation_rows``) end each manifest. Returns source -> path.
    """
    out_dir = Path(out_dir)
    if len(images) < MIN_IMAGES:
        raise ValueError(f"the demo manifests need at least {MIN_IMAGES} images, got {len(images)}")
    base_url = base_url.rstrip("/")
    manifests = out_dir / "manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    plan = _plan(images, out_dir / "images")
    curated = _add_curation_rows(out_dir, images, plan, seed)
    private = _add_privacy_rows(out_dir, plan, seed)

    expected: dict[str, Any] = {
        "images": len(images),
        "base_url": base_url,
        "rows": 0,
        "ok": 0,
        "rejected": 0,
        "error": 0,
        "by_reason": {},
        "by_source": {},
        "ok_by_license": {},
    }
    paths: dict[str, Path] = {}
    for source in SOURCES:
        rows = [_materialize(source, item, base_url, salt) for salt, (item, _) in enumerate(plan[source])]
        path = manifests / MANIFEST_FILES[source]
        if source == "photos":
            _write_csv(path, rows)  # type: ignore[arg-type]
        elif source == "art":
            _write_jsonl_gz(path, rows)
        else:
            _write_parquet(path, rows)  # type: ignore[arg-type]
        paths[source] = path

        per: dict[str, Any] = {"rows": len(rows), "ok": 0, "by_reason": {}}
        for row, (_, special) in zip(rows, plan[source]):
            reason = special.reason if special is not None else None
            status = status_of(reason)
            expected[status] += 1
            if status == OK:
                per["ok"] += 1
                lic = row.get("license") if isinstance(row, dict) else None
                key = lic if lic is not None else ""
                expected["ok_by_license"][key] = expected["ok_by_license"].get(key, 0) + 1
            else:
                per["by_reason"][reason] = per["by_reason"].get(reason, 0) + 1
                expected["by_reason"][reason] = expected["by_reason"].get(reason, 0) + 1
        expected["by_source"][source] = per
        expected["rows"] += per["rows"]
    expected["curation"] = curated
    expected["privacy"] = private
    expected["by_reason"] = dict(sorted(expected["by_reason"].items()))
    expected["ok_by_license"] = dict(sorted(expected["ok_by_license"].items()))
    atomic_write(manifests / EXPECTED_NAME, (json.dumps(expected, indent=2, ensure_ascii=False) + "\n").encode())
    return paths


def expected_outcomes(out_dir: Path) -> dict[str, Any]:
    """What the pipeline should make of the demo manifests, from ``manifests/EXPECTED.json``.

    ``rows``, ``ok``, ``rejected``, ``error``; ``by_reason`` over all sources; ``by_source``
    with each source's ``rows``, ``ok`` and ``by_reason``; ``ok_by_license`` counts the ok
    rows by their license string (``""`` when missing), for a license stage to predict its own
    rejections from.
    """
    return json.loads((Path(out_dir) / "manifests" / EXPECTED_NAME).read_text())


def prepare_demo(out_dir: Path, n: int = 300, seed: int = 0, port: int = 18765) -> tuple[ImageWeb, dict[str, Any]]:
    """Make (or reuse) the corpus, serve it on loopback and write manifests that point there.

    The preferred ``port`` keeps the manifests' URLs, and so their hashes, stable across
    reruns; a busy port falls back to an ephemeral one. The caller stops the returned server.
    """
    from tasks.demo.models import make_all

    out_dir = Path(out_dir)
    images = ensure_images(out_dir, n, seed)
    # Tiny random-weight encoders for the precache phase; the dual encoder curation uses was
    # trained on the demo's own scenes (tasks/demo/train_clip.py).
    make_all(out_dir / "models", ("vae", "clip-text", "clip"))
    server = ImageWeb(out_dir / "images", port=port).start()
    try:
        write_manifests(out_dir, images, server.base_url, seed)
        expected = expected_outcomes(out_dir)
    except BaseException:
        server.stop()
        raise
    return server, expected
