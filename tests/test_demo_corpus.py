"""The demo corpus: deterministic images, manifests whose outcomes are known, and the demo recipe."""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.parquet as pq
import pytest
from PIL import Image

from tasks.demo.corpus import BAD_ROWS, TRICKY_ROWS, expected_outcomes, prepare_demo, write_manifests
from tasks.demo.images import EXPECTED_NAME, MANIFEST_FILES, SOURCES, STAMP_NAME, ImageInfo, ensure_images, make_images
from tasks.formats.reasons import status_of
from tasks.formats.recipe import load_recipe
from tasks.formats.recipe_base import RecipeError

N = 40
SEED = 3
RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo.yaml"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[ImageInfo]]:
    out = tmp_path_factory.mktemp("demo-a")
    return out, make_images(out, n=N, seed=SEED)


def read_manifest(path: Path) -> list[dict | None]:
    """Rows of a demo manifest as dicts; None for a line that does not parse."""
    if path.name.endswith(".csv"):
        with path.open(newline="", encoding="utf-8") as fh:
            return [dict(r) for r in csv.DictReader(fh)]
    if path.name.endswith(".jsonl.gz"):
        rows: list[dict | None] = []
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    rows.append(None)
        return rows
    return pq.read_table(path).to_pylist()


def classify(row: dict | None) -> str | None:
    """The reason a row should get, worked out from the URL alone (independently of demo.py)."""
    if row is None:
        return "unparsable_row"
    url = row.get("url")
    if not url:
        return "missing_url"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return "unsupported_scheme"
    route = parts.path.split("/")[1]
    return {
        "status": "http_404",
        "html-as-jpeg": "not_an_image",
        "truncated": "truncated_image",
        "optout": "opted_out",
    }.get(route)


# --------------------------------------------------------------------------- images


def test_generation_is_deterministic_for_a_seed(corpus, tmp_path):
    out, infos = corpus
    again = make_images(tmp_path / "b", n=N, seed=SEED)
    assert again == infos
    for info in infos:
        assert (tmp_path / "b" / "images" / info.name).read_bytes() == (out / "images" / info.name).read_bytes()


def test_another_seed_gives_other_images(corpus, tmp_path):
    _, infos = corpus
    other = make_images(tmp_path / "c", n=10, seed=SEED + 1)
    assert [i.sha256 for i in other] != [i.sha256 for i in infos[:10]]


def test_a_larger_corpus_extends_a_smaller_one(corpus, tmp_path):
    _, infos = corpus
    assert make_images(tmp_path / "d", n=12, seed=SEED) == infos[:12]


def test_files_match_their_records(corpus):
    out, infos = corpus
    assert [i.index for i in infos] == list(range(N))
    assert len({i.name for i in infos}) == N
    for info in infos:
        data = (out / "images" / info.name).read_bytes()
        assert len(data) == info.size
        assert hashlib.sha256(data).hexdigest() == info.sha256
        with Image.open(out / "images" / info.name) as img:
            img.load()  # decodes the whole image: nothing truncated or corrupt
            assert (img.format, img.mode, img.size) == (info.format, info.mode, (info.width, info.height))


def test_sizes_formats_and_modes_vary(corpus):
    _, infos = corpus
    formats = Counter(i.format for i in infos)
    assert set(formats) == {"JPEG", "PNG", "WEBP", "GIF"}
    assert formats.most_common(1)[0][0] == "JPEG"
    assert {"RGB", "RGBA", "L"} <= {i.mode for i in infos}
    shorts = [min(i.width, i.height) for i in infos]
    assert min(shorts) >= 200 and max(shorts) <= 1200
    assert min(shorts) == 200 and max(shorts) == 1200
    aspects = [i.width / i.height for i in infos]
    assert min(aspects) >= 0.5 - 0.01 and max(aspects) <= 2.5 + 0.01
    assert min(aspects) < 0.9 and max(aspects) > 1.5
    assert len({(i.width, i.height) for i in infos}) > N // 2


def test_captions_licenses_and_authors_look_real(corpus):
    _, infos = corpus
    assert all(i.caption and i.caption.strip() == i.caption for i in infos)
    assert len({i.caption for i in infos}) > N * 0.9
    words = Counter(w.strip(".,").lower() for i in infos for w in i.caption.split())
    assert {"circle", "square", "triangle", "star", "hexagon", "diamond", "rectangle"} & set(words)
    stickers = [i for i in infos if i.mode == "RGBA"]
    assert stickers and all("transparent" in i.caption.lower() or "sticker" in i.caption.lower() for i in stickers)
    licenses = Counter(i.license for i in infos)
    assert None in licenses and len(licenses) >= 5
    assert all(i.author for i in infos)


def test_stamp_reuses_a_finished_corpus(corpus, tmp_path):
    out = tmp_path / "e"
    infos = make_images(out, n=20, seed=SEED)
    mtimes = {i.name: (out / "images" / i.name).stat().st_mtime_ns for i in infos}
    assert ensure_images(out, n=20, seed=SEED) == infos
    assert {i.name: (out / "images" / i.name).stat().st_mtime_ns for i in infos} == mtimes
    # A different n regenerates, and drops files the new corpus does not have.
    smaller = ensure_images(out, n=15, seed=SEED)
    assert smaller == infos[:15]
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted(i.name for i in smaller)
    # A damaged file is noticed.
    (out / "images" / smaller[3].name).write_bytes(b"oops")
    assert ensure_images(out, n=15, seed=SEED) == smaller
    assert (out / "images" / smaller[3].name).stat().st_size == smaller[3].size
    assert (out / STAMP_NAME).exists()


# --------------------------------------------------------------------------- manifests


def test_special_rows_are_well_formed():
    for row in (*BAD_ROWS, *TRICKY_ROWS):
        assert row.source in SOURCES
        assert row.why
    for row in BAD_ROWS:
        assert row.reason is not None
        status_of(row.reason)  # raises for a reason tasks/formats/reasons.py does not know
    assert all(row.reason is None for row in TRICKY_ROWS)
    reasons = {row.reason for row in BAD_ROWS}
    assert {
        "http_404",
        "not_an_image",
        "truncated_image",
        "opted_out",
        "unsupported_scheme",
        "missing_url",
        "unparsable_row",
    } <= reasons


def test_manifests_are_readable_and_match_expected(corpus):
    out, infos = corpus
    paths = write_manifests(out, infos, "http://127.0.0.1:9/")
    assert {s: p.name for s, p in paths.items()} == MANIFEST_FILES
    expected = expected_outcomes(out)
    assert expected == json.loads((out / "manifests" / EXPECTED_NAME).read_text())

    total = Counter()
    seen_images: Counter[str] = Counter()
    for source in SOURCES:
        rows = read_manifest(paths[source])
        reasons = Counter(classify(r) for r in rows)
        ok = reasons.pop(None, 0)
        want = expected["by_source"][source]
        assert want["rows"] == len(rows)
        assert want["ok"] == ok
        assert want["by_reason"] == dict(reasons)
        assert Counter(r.reason for r in BAD_ROWS if r.source == source) == reasons
        total.update(reasons)
        for row in rows:
            if row is None:
                continue
            assert set(row) <= {"url", "caption", "license", "author", "width", "height"}
            assert row.get("caption")
            assert "author" in row
            url = row.get("url") or ""
            if url.startswith("http://127.0.0.1:9/") and not url.endswith(("/status/404", "/html-as-jpeg")):
                seen_images[url.rsplit("/", 1)[1]] += 1
        # The special rows sit inside the manifest, not bunched at an end.
        special = [i for i, r in enumerate(rows) if classify(r) is not None]
        assert special and min(special) > 0
    planted = expected["curation"] + expected["privacy"]
    assert expected["rows"] == N + sum(1 for r in BAD_ROWS if r.url is None or "{name}" not in r.url) + len(planted)
    assert expected["by_reason"] == dict(sorted(total.items()))
    assert expected["ok"] + expected["rejected"] + expected["error"] == expected["rows"]
    assert expected["ok"] == expected["rows"] - sum(total.values())
    assert expected["error"] == total["http_404"]
    assert sum(expected["ok_by_license"].values()) == expected["ok"]
    # Every image has exactly one row, under its own name (the planted ones too).
    assert seen_images == Counter({i.name: 1 for i in infos} | {e["image"]: 1 for e in planted})


def test_rows_planted_for_curation_end_their_manifests_after_their_originals(corpus):
    from tasks.demo.curation_rows import ALLOWED
    from tasks.policies.licenses import normalize_license

    out, infos = corpus
    paths = write_manifests(out, infos, "http://127.0.0.1:9/")
    planted = expected_outcomes(out)["curation"]
    kinds = Counter(e["kind"] for e in planted)
    assert kinds["mismatch"] == 10 and kinds["watermark"] == 4 and kinds["copy"] >= 8
    assert {e["augmentation"] for e in planted if e["kind"] == "copy"} == {"crop", "flip", "resize", "overlay"}
    by_name = {i.name: i for i in infos}
    for source in SOURCES:
        rows = read_manifest(paths[source])
        mine = [e for e in planted if e["source"] == source]
        after = sum(1 for e in expected_outcomes(out)["privacy"] if e["source"] == source)
        # At the end of the manifest, before the privacy rows, in the order EXPECTED lists them.
        assert [e["row"] for e in mine] == list(range(len(rows) - after - len(mine), len(rows) - after))
        for e in mine:
            row = rows[e["row"]]
            assert e["key"] == f"{source}-{e['row']:09d}" and row["url"].endswith("/" + e["image"])
            assert normalize_license(row["license"]) in ALLOWED and (out / "images" / e["image"]).is_file()
            if e["kind"] == "copy":
                # The original is an earlier, ordinary row of the same manifest, with an allowed license.
                first = next(i for i, r in enumerate(rows) if r and (r.get("url") or "").endswith("/" + e["original"]))
                assert first < e["row"] and normalize_license(by_name[e["original"]].license) in ALLOWED
                assert row["caption"] == by_name[e["original"]].caption
            if e["kind"] == "mismatch":
                assert row["caption"] == by_name[e["original"]].caption


def test_manifest_sizes_split_half_third_rest(corpus):
    out, infos = corpus
    write_manifests(out, infos, "http://127.0.0.1:9")
    by_source = expected_outcomes(out)["by_source"]
    assert by_source["photos"]["rows"] > by_source["art"]["rows"] > by_source["scans"]["rows"] > 0


def test_too_small_a_corpus_is_refused(corpus, tmp_path):
    _, infos = corpus
    with pytest.raises(ValueError, match="at least"):
        write_manifests(tmp_path, infos[:5], "http://127.0.0.1:9")


def fetch(url: str, attempts: int = 3) -> tuple[int, dict[str, str], bytes]:
    """GET with urllib (follows redirects), retrying 5xx and 429 the way the demo recipe does."""
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            if attempt + 1 < attempts and (err.code >= 500 or err.code == 429):
                time.sleep(float(err.headers.get("Retry-After", "0")))
                continue
            return err.code, dict(err.headers), err.read()
    raise AssertionError("unreachable")


def test_prepare_demo_serves_what_expected_promises(tmp_path):
    server, expected = prepare_demo(tmp_path, n=24, seed=SEED, port=0)
    try:
        assert expected["base_url"] == server.base_url
        outcomes: Counter[str | None] = Counter()
        for source in SOURCES:
            for row in read_manifest(tmp_path / "manifests" / MANIFEST_FILES[source]):
                reason = classify(row)
                outcomes[reason] += 1
                if reason in ("unparsable_row", "missing_url", "unsupported_scheme"):
                    continue
                status, headers, body = fetch(row["url"])
                if reason == "http_404":
                    assert status == 404
                    continue
                assert status == 200, row["url"]
                if reason == "not_an_image":
                    assert not body.startswith((b"\xff\xd8", b"\x89PNG", b"RIFF", b"GIF8"))
                elif reason == "truncated_image":
                    assert body.startswith(b"\xff\xd8\xff") and b"\xff\xd9" not in body[2:]
                elif reason == "opted_out":
                    assert "noai" in headers.get("X-Robots-Tag", "")
                else:
                    tag = headers.get("X-Robots-Tag", "")
                    assert tag == "" or ":" in tag  # only opt-outs scoped to other bots
                    name = urlsplit(row["url"]).path.rsplit("/", 1)[1]
                    assert body == (tmp_path / "images" / name).read_bytes()
        assert outcomes.pop(None) == expected["ok"]
        assert dict(sorted(outcomes.items())) == expected["by_reason"]
    finally:
        server.stop()

    # A second run reuses the images and rewrites the manifests for the new server.
    stamp_mtime = (tmp_path / STAMP_NAME).stat().st_mtime_ns
    server, again = prepare_demo(tmp_path, n=24, seed=SEED, port=0)
    try:
        assert (tmp_path / STAMP_NAME).stat().st_mtime_ns == stamp_mtime
        assert again["base_url"] == server.base_url
        assert {k: v for k, v in again.items() if k != "base_url"} == {
            k: v for k, v in expected.items() if k != "base_url"
        }
    finally:
        server.stop()


# --------------------------------------------------------------------------- recipe


def test_demo_recipe_loads(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(tmp_path))
    recipe = load_recipe(RECIPE)
    assert recipe.dataset == "demo"
    assert recipe.kind == "pretraining"
    assert recipe.storage == f"{tmp_path}/store"
    assert [s.name for s in recipe.sources] == list(SOURCES)
    for source in recipe.sources:
        assert source.manifest == f"{tmp_path}/manifests/{MANIFEST_FILES[source.name]}"
        assert source.extra_columns == ("author",)
        assert 30 <= source.rows_per_shard <= 80
    dl = recipe.download
    assert (dl.timeout_s, dl.retries, dl.backoff_s) == (10, 2, 0.2)
    assert dl.network.allowed_networks == ("127.0.0.1/32",)
    assert not dl.network.allow_private_networks
    # The tricky rows end ok only if the recipe retries and follows redirects.
    assert dl.retries >= 1 and dl.max_redirects >= 2 and dl.max_retry_after_s >= 1
    assert (recipe.execution.cluster, recipe.execution.workers) == ("local", 2)


def test_demo_recipe_needs_the_demo_dir(monkeypatch):
    monkeypatch.delenv("SHARDSMITH_DEMO_DIR", raising=False)
    with pytest.raises(RecipeError, match="SHARDSMITH_DEMO_DIR"):
        load_recipe(RECIPE)


def test_rows_planted_for_privacy_end_their_manifests_and_carry_what_they_claim(corpus):
    import io

    from PIL import Image

    from tasks.formats.recipe_privacy import FacePrivacy, TextPrivacy
    from tasks.models.faces import FaceDetector
    from tasks.policies.personal import find_personal

    out, infos = corpus
    paths = write_manifests(out, infos, "http://127.0.0.1:9/")
    planted = expected_outcomes(out)["privacy"]
    assert Counter(e["kind"] for e in planted) == {"personal_data": 4, "gps": 2, "faces": 3}
    detector = FaceDetector(FacePrivacy(mode="record"))
    for source in SOURCES:
        rows = read_manifest(paths[source])
        mine = [e for e in planted if e["source"] == source]
        assert [e["row"] for e in mine] == list(range(len(rows) - len(mine), len(rows)))
        for e in mine:
            row, data = rows[e["row"]], (out / "images" / e["image"]).read_bytes()
            assert e["key"] == f"{source}-{e['row']:09d}" and row["url"].endswith("/" + e["image"])
            found = find_personal(row["caption"], TextPrivacy())
            assert sorted({s.kind for s in found}) == sorted(e["kinds"])
            assert all(v in row["caption"] for v in e["values"])
            with Image.open(io.BytesIO(data)) as img:
                assert bool(img.getexif().get_ifd(0x8825)) == (e["kind"] == "gps")
                assert detector.detect(img.convert("RGB"))[1] == e["faces"]
