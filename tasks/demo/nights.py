"""The four-night story of keeping a dataset current: a web that fails, heals, changes and opts out, and what each release must say of every row."""

from __future__ import annotations

import csv
import hashlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from PIL import Image

from tasks.demo.images import render_image
from tasks.demo.nightweb import NightWeb

# The nights, days apart as the recipe's retry and recheck periods need (recipes/demo-nights.yaml:
# retry_failed.after_hours 20, recheck.every_days 1.5): night 2 retries night 1's failures and
# rechecks what night 1 released, night 3 rechecks again, night 4 (a day later) has nothing due.
NIGHTS = ("2026-12-01T02:00:00Z", "2026-12-03T02:00:00Z", "2026-12-05T02:00:00Z", "2026-12-06T02:00:00Z")
SOURCE = "web"
LICENSE = "CC0-1.0"
# The files' mtime (Last-Modified) before anything is replaced: fixed, so URLs' validators are too.
FILES_MTIME = datetime.fromisoformat("2026-11-01T00:00:00+00:00").timestamp()
TDM_POLICY = "https://e.example/tdm-policy.json"
DOMAIN_HOST = "localhost"  # origin f's URLs name a host of their own, for a domain takedown
_PHASH_MARGIN = 10  # bits between any two pictures of the web: a near copy matches one only

# What happens to each row; (origin, role) per row, in the order of the origins' files.
# a: a steady host; b: down on night 1 (503); c: hangs on night 1; d: adds a robots.txt
# disallow on night 2; e: adds a TDM-Rep header on night 2; f: a domain taken down on night 3.
LAYOUT: tuple[tuple[str, str], ...] = (
    ("a", "steady"),
    ("a", "dead"),
    ("a", "dead"),
    ("a", "replaced"),
    ("a", "takedown_url"),
    ("a", "takedown_sha256"),
    ("a", "takedown_phash"),
    ("a", "steady"),
    ("b", "outage_503"),
    ("b", "outage_503"),
    ("b", "outage_503"),
    ("c", "outage_hang"),
    ("c", "outage_hang"),
    ("c", "outage_hang"),
    ("d", "robots"),
    ("d", "steady"),
    ("d", "dead"),
    ("e", "tdmrep"),
    ("e", "tdmrep"),
    ("f", "takedown_domain"),
    ("f", "takedown_domain"),
)
ORIGINS = ("a", "b", "c", "d", "e", "f")
TAKEDOWN_ROLES = ("takedown_url", "takedown_domain", "takedown_sha256", "takedown_phash")


@dataclass(frozen=True)
class Planted:
    """One manifest row of the story.

    Args:
        row: its row in the manifest.
        key: its sample key (``web-{row:09d}``).
        origin: the origin that serves it.
        name: its file name there.
        role: what happens to it (see ``LAYOUT`` and ``fate``).
        url: its URL.
        sha256, size: of the file as first served.
    """

    row: int
    key: str
    origin: str
    name: str
    role: str
    url: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Fate:
    """What a release's ledger must say of a row: status, reason, phase, and the ``upkeep``
    outcome of a row that stays released though a recheck flagged it."""

    status: str
    reason: str | None
    phase: str
    upkeep: str | None = None


@dataclass
class Story:
    """A prepared story: the web (started), the rows, and where its manifest and takedown list are.

    Args:
        root: the story's folder (``SHARDSMITH_DEMO_DIR`` of recipes/demo-nights.yaml).
        web: the origins, serving ``root/web/{origin}/``.
        rows: every manifest row.
        replacement: the bytes that replace the ``replaced`` row's file on night 2.
        near_copy: a resized, re-encoded copy of the ``takedown_phash`` row's picture.
        near_copy_phash: its perceptual hash, as validation computes it.
    """

    root: Path
    web: NightWeb
    rows: list[Planted]
    replacement: bytes
    near_copy: bytes
    near_copy_phash: int

    @property
    def manifest(self) -> Path:
        return self.root / "manifests" / "web.csv"

    @property
    def takedown_list(self) -> Path:
        return self.root / "takedown" / "requests.txt"

    @property
    def store(self) -> Path:
        return self.root / "store"

    def with_role(self, role: str) -> list[Planted]:
        return [p for p in self.rows if p.role == role]

    def one(self, role: str) -> Planted:
        (found,) = self.with_role(role)
        return found


def fate(role: str, night: int) -> Fate:
    """What release ``night`` (1-4) must say of a row of ``role``."""
    if night == 1 and role == "outage_503":
        return Fate("error", "http_503", "download")
    if night == 1 and role == "outage_hang":
        return Fate("error", "timeout", "download")
    if night >= 2 and role in ("robots", "tdmrep"):
        return Fate("rejected", "opted_out", "upkeep")
    if night >= 2 and role == "dead":
        return Fate("ok", None, "release", "link_dead")
    if night >= 2 and role == "replaced":
        return Fate("ok", None, "release", "content_changed")
    if night >= 3 and role in TAKEDOWN_ROLES:
        return Fate("rejected", "taken_down", "upkeep")
    return Fate("ok", None, "release")


def expected(story: Story, night: int) -> dict[str, Fate]:
    """key -> fate, for every row of the manifest."""
    return {p.key: fate(p.role, night) for p in story.rows}


def _pictures(seed: int) -> Iterator[tuple[bytes, str, int]]:
    """(bytes, caption, phash) of pictures validation accepts, each far from all before it in pHash."""
    from tasks.formats.recipe_download import ImageRules
    from tasks.policies.images import process_image
    from tasks.policies.pixels import hamming

    taken: list[int] = []
    index = 0
    while True:
        _, data, meta = render_image(seed, index)
        index += 1
        outcome = process_image(data, ImageRules())
        if outcome.phash is None or not outcome.ok:
            continue
        if all(hamming(outcome.phash, other) > _PHASH_MARGIN for other in taken):
            taken.append(outcome.phash)
            yield data, meta["caption"], outcome.phash


def near_copy(data: bytes) -> bytes:
    """The picture at three quarters of its size, re-encoded as a JPEG: other bytes, nearly the same pHash."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    out = io.BytesIO()
    img.resize((img.width * 3 // 4, img.height * 3 // 4), Image.Resampling.LANCZOS).save(out, "JPEG", quality=80)
    return out.getvalue()


def prepare_story(root: Path, seed: int = 0) -> Story:
    """Write the story's pictures, manifest and (empty) takedown list under ``root`` and start
    its web; the caller stops ``story.web``. Rows are interleaved across the origins, so every
    download chunk mixes rows that fail, heal and change with rows that do not."""
    from tasks.formats.recipe_download import ImageRules
    from tasks.policies.images import process_image
    from tasks.policies.pixels import hamming

    root = Path(root)
    web = NightWeb(root / "web", ORIGINS, url_hosts={"f": DOMAIN_HOST})
    pictures = _pictures(seed)
    drawn: list[tuple[str, str, str, bytes, str, int]] = []
    counts = dict.fromkeys(ORIGINS, 0)
    for origin, role in LAYOUT:
        data, caption, phash = next(pictures)
        ext = {"\xff\xd8": "jpg", "\x89P": "png", "RI": "webp", "GI": "gif"}[data[:2].decode("latin-1")]
        name = f"{origin}{counts[origin]}.{ext}"
        counts[origin] += 1
        web[origin].replace(name, data, mtime=FILES_MTIME)
        drawn.append((origin, role, name, data, caption, phash))
    replacement, _, _ = next(pictures)
    target = next(d for d in drawn if d[1] == "takedown_phash")
    copy = near_copy(target[3])
    copy_phash = process_image(copy, ImageRules()).phash
    if copy_phash is None or hamming(copy_phash, target[5]) > 4:
        raise RuntimeError("the near copy's pHash is not within 4 bits of its picture's")
    web.start()
    try:
        # Robots.txt of origin d allows everything until night 2; the others have none (404).
        web["d"].robots_txt = "User-agent: *\nDisallow: /private/\n"
        rows = [
            Planted(
                row=i,
                key=f"{SOURCE}-{i:09d}",
                origin=origin,
                name=name,
                role=role,
                url=web[origin].file_url(name),
                sha256=hashlib.sha256(data).hexdigest(),
                size=len(data),
            )
            for i, (origin, role, name, data, _, _) in enumerate(_interleaved(drawn))
        ]
        captions = {(d[0], d[2]): d[4] for d in drawn}
        story = Story(root, web, rows, replacement, copy, copy_phash)
        story.manifest.parent.mkdir(parents=True, exist_ok=True)
        with story.manifest.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["url", "caption", "license"])
            for p in rows:
                writer.writerow([p.url, captions[(p.origin, p.name)], LICENSE])
        story.takedown_list.parent.mkdir(parents=True, exist_ok=True)
        story.takedown_list.touch()
    except BaseException:
        web.stop()
        raise
    return story


def _interleaved(drawn: list[tuple[str, str, str, bytes, str, int]]) -> list[tuple[str, str, str, bytes, str, int]]:
    """The rows round-robin over the origins: a, b, c, d, e, f, a, b, ..."""
    queues = {o: [d for d in drawn if d[0] == o] for o in ORIGINS}
    out: list[tuple[str, str, str, bytes, str, int]] = []
    while any(queues.values()):
        for o in ORIGINS:
            if queues[o]:
                out.append(queues[o].pop(0))
    return out


def set_night(story: Story, night: int) -> list[str]:
    """Switch the web to what night ``night`` (1-4) serves; returns what changed, in words."""
    web = story.web
    said: list[str] = []
    if night == 1:
        web["b"].mode = "down"
        web["c"].mode = "hang"
        said += [f"{web['b'].base_url} answers 503", f"{web['c'].base_url} accepts connections and never answers"]
    elif night == 2:
        web["b"].mode = "up"
        web["c"].mode = "up"
        said.append("both answer again")
        for p in story.with_role("dead"):
            web[p.origin].gone[p.name] = 404
            said.append(f"{p.url} is 404")
        changed = story.one("replaced")
        when = datetime.fromisoformat(NIGHTS[1]).timestamp() - 3600
        web[changed.origin].replace(changed.name, story.replacement, mtime=when)
        said.append(f"{changed.url} is another picture")
        gone = story.one("robots")
        web["d"].robots_txt = f"User-agent: *\nDisallow: /private/\nDisallow: /img/{gone.name}\n"
        said.append(f"{web['d'].base_url}/robots.txt disallows /img/{gone.name}")
        web["e"].tdm_reservation = 1
        web["e"].tdm_policy = TDM_POLICY
        said.append(f"{web['e'].base_url} sends tdm-reservation: 1 (tdm-policy {TDM_POLICY})")
    elif night == 3:
        said.append("the web is as on night 2; a takedown list arrives")
    else:
        said.append("nothing changes")
    return said


def takedown_entries(story: Story) -> list[str]:
    """The night-3 takedown requests: a URL, a domain, a file's sha256, a near copy's pHash."""
    return [
        story.one("takedown_url").url,
        f"domain:{DOMAIN_HOST}",  # a host without a dot needs its kind said (a bare word is a sample key)
        story.one("takedown_sha256").sha256,
        f"{story.near_copy_phash:016x}",
    ]


def tree_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by path relative to it."""
    if not folder.is_dir():
        return {}
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def environment(story: Story, night: int) -> dict[str, str]:
    """The environment of night ``night``'s run: the story's folder and the night's time."""
    return {**os.environ, "SHARDSMITH_DEMO_DIR": str(story.root), "SHARDSMITH_NOW": NIGHTS[night - 1]}
