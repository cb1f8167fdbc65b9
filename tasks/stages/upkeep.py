"""Upkeep before a reshard: takedown lists and recheck outcomes applied to the kept shards' ledgers, as content-named overlays, without a fetch."""

from __future__ import annotations

import hashlib
import posixpath
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats import clock
from tasks.formats.ledger import read_ledger_with, read_parquet, write_parquet
from tasks.formats.reasons import OK, RECHECK_REASONS, REJECTED
from tasks.formats.recipe_upkeep import RecheckActions
from tasks.formats.storage import Storage
from tasks.formats.takedown import URL_HOST, URL_PARTS, LoadedList, ascii_host, normalise_url

TAKEN_DOWN = "taken_down"
# Rows upkeep rejected (one per input ledger row: each clip of a video) and rows a recheck
# flagged that the recipe keeps (one per manifest row), as the release ledger takes them.
REMOVED_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("source", pa.string()),
        ("row", pa.int64()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("video", pa.string()),
    ]
)
FLAGGED_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("source", pa.string()),
        ("row", pa.int64()),
        ("upkeep", pa.string()),
        ("detail", pa.string()),
    ]
)
# A key entry's sample as the first run that applied the entry found it: keys are positions in a
# manifest (``{source}-{row:09d}``), so a row removed above it would hand the key to the next
# sample. Once pinned, the entry matches that sample's URL and digests, not its key. Kept in
# immutable versions ``{dataset}/upkeep/pins/{gen:06d}.parquet``, each holding every pin.
PINS_SCHEMA = pa.schema(
    [
        ("list", pa.string()),
        ("entry", pa.string()),
        ("url", pa.string()),
        ("sha256", pa.string()),
        ("pixel_sha256", pa.string()),
        ("pinned_at", pa.string()),
    ]
)
_PIN_VERSION = re.compile(r"^(\d{6})\.parquet$")
Pins = dict[tuple[str, str], dict[str, str | None]]  # (list, entry text) -> url, sha256, pixel_sha256
PINNED = ("url", "sha256", "pixel_sha256")  # a pinned sample's facts: validation ledger columns
# Candidate (row, entry) pairs one step of the perceptual-hash search holds at most: bounds its
# memory (16 bytes a pair) whatever the lists and the hashes hold.
MAX_PAIRS = 1 << 22
_NONE = np.iinfo(np.int64).max  # "no match" while taking minima; -1 once returned


@dataclass
class UpkeepResult:
    """What upkeep made of a reshard's inputs.

    Args:
        tars: the inputs' tars, as given.
        ledgers: per input, its ledger, or its overlay where upkeep rejected some of its ok rows
            (the same rows, those rejected), ``{dataset}/upkeep/{digest}/{ledger name}``.
        removed: the rows rejected (``REMOVED_SCHEMA``): ``taken_down`` naming the list and
            the entry, or the recheck outcome the recipe drops, with what the recheck saw.
        flagged: rows a recheck flagged that the recipe keeps (``FLAGGED_SCHEMA``), one per
            manifest row, ``upkeep`` naming the outcome.
        digest: of what was applied (the overlays and the flags); empty when nothing was.
        overlays: overlays written by this call (the others were there already).
        seconds: wall time of the call.
    """

    tars: list[str]
    ledgers: list[str]
    removed: pa.Table = field(default_factory=REMOVED_SCHEMA.empty_table)
    flagged: pa.Table = field(default_factory=FLAGGED_SCHEMA.empty_table)
    digest: str = ""
    overlays: int = 0
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        """Manifest rows removed, by reason, and kept but flagged, by outcome (``kept_<outcome>``)."""
        out: dict[str, int] = {}
        removed = _unique_rows(self.removed)
        for reason, n in _value_counts(removed.column("reason")):
            out[reason] = n
        for outcome, n in _value_counts(self.flagged.column("upkeep")):
            out[f"kept_{outcome}"] = n
        return out


def _value_counts(column: pa.ChunkedArray) -> list[tuple[str, int]]:
    counts = pc.value_counts(column.combine_chunks()) if len(column) else []
    return sorted((c["values"].as_py(), c["counts"].as_py()) for c in counts)


def _unique_rows(table: pa.Table) -> pa.Table:
    """The first row of each (source, row) of ``table``."""
    if table.num_rows < 2:
        return table
    codes = pc.dictionary_encode(table.column("source").combine_chunks()).indices.to_numpy(zero_copy_only=False)
    rows = table.column("row").to_numpy(zero_copy_only=False)
    order = np.lexsort((np.arange(len(rows)), rows, codes))
    first = np.ones(len(order), bool)
    first[1:] = (codes[order][1:] != codes[order][:-1]) | (rows[order][1:] != rows[order][:-1])
    return table.take(pa.array(np.sort(order[first])))


# ---------------------------------------------------------------------------------------------
# (source, row) lookups
# ---------------------------------------------------------------------------------------------


class RowIndex:
    """(source, row) -> a non-negative int, looked up a column at a time: sorted rows per
    source and a binary search, no Python per row. Where a row is given several values, the
    smallest wins (takedown entries: the first list, then the first line)."""

    def __init__(self) -> None:
        self._parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._index: dict[str, tuple[np.ndarray, np.ndarray]] | None = None

    def add(self, sources: pa.Array | pa.ChunkedArray, rows: np.ndarray, values: np.ndarray) -> None:
        """Give the rows (``sources``/``rows`` aligned with ``values``) those values."""
        if not len(values):
            return
        for name, mask in _by_source(sources):
            self._parts.setdefault(name, []).append((rows[mask], values[mask]))
        self._index = None

    def __len__(self) -> int:
        return sum(len(r) for parts in self._parts.values() for r, _ in parts)

    def _built(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if self._index is None:
            index = {}
            for name, parts in self._parts.items():
                rows = np.concatenate([r for r, _ in parts]).astype(np.int64, copy=False)
                values = np.concatenate([v for _, v in parts]).astype(np.int64, copy=False)
                order = np.lexsort((values, rows))
                rows, values = rows[order], values[order]
                first = np.ones(len(rows), bool)
                first[1:] = rows[1:] != rows[:-1]
                index[name] = (rows[first], values[first])
            self._index = index
        return self._index

    def lookup(self, sources: pa.Array | pa.ChunkedArray, rows: np.ndarray) -> np.ndarray:
        """The value of each (source, row), -1 where it has none."""
        out = np.full(len(rows), -1, np.int64)
        index = self._built()
        if not index:
            return out
        for name, mask in _by_source(sources):
            found = index.get(name)
            if found is None:
                continue
            keys, values = found
            want = rows[mask]
            at = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
            hit = keys[at] == want
            out[np.flatnonzero(mask)[hit]] = values[at[hit]]
        return out


def _by_source(sources: pa.Array | pa.ChunkedArray) -> list[tuple[str, np.ndarray]]:
    """(source, row mask) for each source in the column (a ledger holds one source, or a few)."""
    if isinstance(sources, pa.ChunkedArray):
        sources = sources.combine_chunks()
    encoded = pc.dictionary_encode(sources)
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    names = encoded.dictionary.to_pylist()
    if len(names) == 1:
        return [(names[0], np.ones(len(codes), bool))]
    return [(name, codes == i) for i, name in enumerate(names)]


def _rows(table: pa.Table) -> np.ndarray:
    return table.column("row").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


# ---------------------------------------------------------------------------------------------
# Matching rows against the lists
# ---------------------------------------------------------------------------------------------


def normalise_urls(urls: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """URLs with their scheme and authority in lower case (``tasks.formats.takedown.normalise_url``)."""
    parts = pc.extract_regex(urls, URL_PARTS)
    joined = pc.binary_join_element_wise(
        pc.utf8_lower(pc.struct_field(parts, "head")), pc.struct_field(parts, "tail"), ""
    )
    return pc.coalesce(joined, urls)


def url_hosts(urls: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Each URL's host in lower case without a trailing dot, an international one as IDNA ASCII
    (``tasks.formats.takedown.url_host``)."""
    host = pc.utf8_rtrim(pc.utf8_lower(pc.struct_field(pc.extract_regex(urls, URL_HOST), "host")), characters=".")
    host = pc.if_else(pc.equal(host, ""), pa.scalar(None, pa.string()), host)
    if pc.all(pc.string_is_ascii(host)).as_py() is False:  # rare: each distinct host converted once
        encoded = pc.dictionary_encode(host.combine_chunks() if isinstance(host, pa.ChunkedArray) else host)
        names = pa.array([ascii_host(h) for h in encoded.dictionary.to_pylist()], pa.string())
        host = pc.take(names, encoded.indices)
    return host


def _take_min(best: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Element-wise the smaller entry id of two (-1: none)."""
    a = np.where(best < 0, _NONE, best)
    b = np.where(ids < 0, _NONE, ids)
    out = np.minimum(a, b)
    return np.where(out == _NONE, -1, out)


class _ValueSet:
    """Exact matches of a string column against entries of one kind: value -> first entry id."""

    def __init__(self, pairs: dict[str, int]):
        self.values = pa.array(list(pairs), pa.string())
        self.ids = np.fromiter(pairs.values(), np.int64, count=len(pairs))

    def match(self, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
        if not len(self.ids) or not len(column):
            return np.full(len(column), -1, np.int64)
        at = pc.fill_null(pc.index_in(column, value_set=self.values), -1).to_numpy(zero_copy_only=False)
        return np.where(at >= 0, self.ids[np.maximum(at, 0)], -1)


class _PhashIndex:
    """Perceptual hashes within ``distance`` bits of one list's entries, by multi-index hashing:
    the 64 bits cut into ``distance + 1`` blocks, so a hash that differs in at most ``distance``
    bits equals an entry on at least one block (pigeonhole); exact block matches are the
    candidates (a binary search in each block's sorted values), their full distance a popcount."""

    def __init__(self, hashes: np.ndarray, ids: np.ndarray, distance: int):
        hashes, first = np.unique(hashes, return_index=True)  # ids ascend, so the first is the smallest
        self.hashes, self.ids, self.distance = hashes, ids[first], distance
        blocks = distance + 1
        self.blocks = []
        shift = 0
        for b in range(blocks):
            width = 64 // blocks + (1 if b < 64 % blocks else 0)
            mask = np.uint64(0xFFFFFFFFFFFFFFFF if width == 64 else (1 << width) - 1)
            values = (hashes >> np.uint64(shift)) & mask
            order = np.argsort(values, kind="stable")
            self.blocks.append((np.uint64(shift), mask, values[order], order))
            shift += width

    def match(self, query: np.ndarray) -> np.ndarray:
        """The smallest entry id within the distance of each hash, -1 where none is."""
        best = np.full(len(query), _NONE, np.int64)
        for shift, mask, values, order in self.blocks:
            part = (query >> shift) & mask
            lo = np.searchsorted(values, part, "left")
            counts = np.searchsorted(values, part, "right") - lo
            ends = np.cumsum(counts)
            start = 0
            while start < len(query):
                # queries [start, stop) expand to at most MAX_PAIRS pairs (one query at least)
                base = ends[start - 1] if start else 0
                stop = max(start + 1, int(np.searchsorted(ends, base + MAX_PAIRS, "right")))
                n = counts[start:stop]
                total = int(n.sum())
                if total:
                    qi = np.repeat(np.arange(start, stop), n)
                    offsets = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
                    ei = order[np.repeat(lo[start:stop], n) + offsets]
                    near = np.bitwise_count(query[qi] ^ self.hashes[ei]) <= self.distance
                    if near.any():
                        np.minimum.at(best, qi[near], self.ids[ei[near]])
                start = stop
        return np.where(best == _NONE, -1, best)


class Matcher:
    """Every entry of the takedown lists, compiled for matching whole ledger columns.

    Entry ids number the entries over the lists in recipe order, then line order; a row that
    matches several entries is named after the first. ``details[id]`` is what its ledger row
    says: ``list NAME: entry KIND:VALUE``.
    """

    def __init__(self, lists: Sequence[LoadedList], pins: Pins | None = None):
        self.details: list[str] = []
        by_kind: dict[str, dict[str, int]] = {k: {} for k in ("url", "domain", "key", "sha256")}
        hashes: list[tuple[list[int], list[int], int]] = []
        pins = pins or {}
        # key entries not pinned yet: entry id -> (list, entry text); what they match is pinned
        self.unpinned: dict[int, tuple[str, str]] = {}
        self.new_pins: Pins = {}
        for loaded in lists:
            mine: tuple[list[int], list[int], int] = ([], [], loaded.phash_distance)
            for entry in loaded.entries:
                eid = len(self.details)
                self.details.append(f"list {loaded.name}: entry {entry.text}")
                pin = pins.get((loaded.name, entry.text)) if entry.kind == "key" else None
                if entry.kind == "phash":
                    mine[0].append(int(entry.value, 16))
                    mine[1].append(eid)
                elif pin is not None:  # the sample the key named when the entry was first applied
                    if pin["url"]:
                        by_kind["url"].setdefault(normalise_url(pin["url"]), eid)
                    for digest in (pin["sha256"], pin["pixel_sha256"]):  # matched as sha256 entries are
                        if digest:
                            by_kind["sha256"].setdefault(digest, eid)
                else:
                    by_kind[entry.kind].setdefault(entry.value, eid)
                    if entry.kind == "key":
                        self.unpinned[eid] = (loaded.name, entry.text)
            if mine[0]:
                hashes.append(mine)
        self.urls = _ValueSet(by_kind["url"])
        self.keys = _ValueSet(by_kind["key"])
        self.sha256 = _ValueSet(by_kind["sha256"])
        # Domains reversed ("moc.elpmaxe"): a host's suffixes of whole labels are then prefixes.
        self.domains = _ValueSet({d[::-1]: i for d, i in by_kind["domain"].items()})
        self.phash = [
            _PhashIndex(np.array(h, np.uint64), np.array(ids, np.int64), distance) for h, ids, distance in hashes
        ]

    @property
    def empty(self) -> bool:
        return not self.details

    def match_hosts(self, urls: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Entry ids of the domain entries each URL's host equals or ends in (``.`` + domain)."""
        if not len(self.domains.ids) or not len(urls):
            return np.full(len(urls), -1, np.int64)
        hosts = url_hosts(urls)
        if isinstance(hosts, pa.ChunkedArray):
            hosts = hosts.combine_chunks()
        encoded = pc.dictionary_encode(hosts)  # each host once: a ledger has few
        labels = pc.split_pattern(pc.utf8_reverse(encoded.dictionary), ".")
        depth = pc.max(pc.list_value_length(labels)).as_py() or 0
        best = np.full(len(encoded.dictionary), -1, np.int64)
        for k in range(1, depth + 1):
            suffix = pc.binary_join(pc.list_slice(labels, 0, k), ".")
            best = _take_min(best, self.domains.match(suffix))
        codes = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False)
        return np.where(codes >= 0, best[np.maximum(codes, 0)], -1)

    def match_facts(self, table: pa.Table) -> np.ndarray:
        """Entry ids of a validation ledger's rows (key, url, sha256, pixel_sha256, phash), -1 where none."""
        best = self.keys.match(table.column("key"))
        urls = table.column("url")
        if len(self.urls.ids):
            best = _take_min(best, self.urls.match(normalise_urls(urls)))
        best = _take_min(best, self.match_hosts(urls))
        for name in ("sha256", "pixel_sha256"):
            best = _take_min(best, self.sha256.match(table.column(name)))
        if self.phash:
            column = table.column("phash")
            valid = column.is_valid().to_numpy(zero_copy_only=False)
            if valid.any():
                query = pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.uint64, copy=False)
                for index in self.phash:
                    found = index.match(query[valid])
                    ids = np.full(len(valid), -1, np.int64)
                    ids[valid] = found
                    best = _take_min(best, ids)
        return best

    def pin(self, table: pa.Table, ids: np.ndarray) -> None:
        """Pin the key entries not pinned yet that ``ids`` (``match_facts`` of ``table``, a
        validation ledger's ok rows) matched to the facts of the first row each matched."""
        if not self.unpinned:
            return
        for i in np.flatnonzero(np.isin(ids, list(self.unpinned))):
            eid = int(ids[i])
            name = self.unpinned.pop(eid, None)
            if name is not None:
                self.new_pins[name] = {c: table.column(c)[int(i)].as_py() for c in PINNED}

    def match_download(self, table: pa.Table) -> np.ndarray:
        """Entry ids of a download ledger's rows: their key, and the sha256 of the bytes as fetched."""
        best = self.keys.match(table.column("key"))
        return _take_min(best, self.sha256.match(table.column("sha256")))


# ---------------------------------------------------------------------------------------------
# Applying
# ---------------------------------------------------------------------------------------------

_KEPT_COLUMNS = ["key", "source", "row", "status"]
_FACT_COLUMNS = ["url", "sha256", "pixel_sha256", "phash"]


def _ok(table: pa.Table) -> pa.Table:
    return table.filter(pc.fill_null(pc.equal(table.column("status"), OK), False))


def takedown_hits(
    storage: Storage, matcher: Matcher, facts: Sequence[str], downloads: Sequence[str]
) -> tuple[RowIndex, int]:
    """(source, row) -> entry id of every ok row a list matches, from the validation ledgers
    (``facts``: key, URL, domain, stored sha256, pixel sha256, perceptual hash) and the download
    ledgers (key, sha256 of the bytes as fetched); and how many rows were matched against.

    A ledger at a time, so memory is one ledger's columns whatever the dataset's size.
    """
    hits = RowIndex()
    rows = 0
    if matcher.empty:
        return hits, rows
    for ledger in facts:
        table = _ok(read_ledger_with(storage, ledger, _KEPT_COLUMNS, _FACT_COLUMNS))
        ids = matcher.match_facts(table)
        matcher.pin(table, ids)
        found = ids >= 0
        rows += table.num_rows
        if found.any():
            hits.add(table.column("source").filter(pa.array(found)), _rows(table)[found], ids[found])
    if len(matcher.keys.ids) or len(matcher.sha256.ids):
        for ledger in downloads:
            table = _ok(read_ledger_with(storage, ledger, _KEPT_COLUMNS, ["sha256"]))
            ids = matcher.match_download(table)
            found = ids >= 0
            if found.any():
                hits.add(table.column("source").filter(pa.array(found)), _rows(table)[found], ids[found])
    return hits, rows


@dataclass
class RecheckFates:
    """The recheck outcomes a release acts on, by (source, row).

    Args:
        dropped: rows whose outcome the recipe drops (values index ``drop_rows``).
        kept: rows whose outcome the recipe keeps, flagged (values index ``keep_rows``).
        drop_rows, keep_rows: their recheck rows (``tasks.formats.recheck_store.RECHECK_SCHEMA``),
            with ``detail`` as the ledger says it: the date of the check and what it saw.
    """

    dropped: RowIndex
    kept: RowIndex
    drop_rows: pa.Table
    keep_rows: pa.Table

    @classmethod
    def of(cls, recheck: pa.Table | None, actions: RecheckActions) -> RecheckFates:
        dropped, kept = RowIndex(), RowIndex()
        empty = pa.table({"outcome": pa.array([], pa.string()), "detail": pa.array([], pa.string())})
        if recheck is None or not recheck.num_rows:
            return cls(dropped, kept, empty, empty)
        acted = recheck.filter(pc.is_in(recheck.column("outcome"), value_set=pa.array(RECHECK_REASONS)))
        seen = pc.coalesce(acted.column("detail"), acted.column("outcome"))
        when = pc.coalesce(pc.strftime(acted.column("checked_at"), format="%Y-%m-%d"), "an unknown date")
        acted = acted.set_column(
            acted.column_names.index("detail"),
            "detail",
            pc.binary_join_element_wise("recheck on ", when, ": ", seen, ""),
        )
        drop = [o for o in RECHECK_REASONS if getattr(actions, o) == "drop"]
        is_drop = pc.is_in(acted.column("outcome"), value_set=pa.array(drop, pa.string()))
        drop_rows, keep_rows = acted.filter(is_drop), acted.filter(pc.invert(is_drop))
        for index, part in ((dropped, drop_rows), (kept, keep_rows)):
            index.add(part.column("source"), _rows(part), np.arange(part.num_rows, dtype=np.int64))
        return cls(dropped, kept, drop_rows, keep_rows)

    @property
    def empty(self) -> bool:
        return not self.drop_rows.num_rows and not self.keep_rows.num_rows


def overlay_path(dataset: str, ledger: str, digest: str) -> str:
    """Where the overlay of ``ledger`` with these rejections (``digest``) goes."""
    return f"{dataset}/upkeep/{digest[:16]}/{posixpath.basename(ledger)}"


def _overlay(storage: Storage, dataset: str, ledger: str, picked: np.ndarray, rejected: pa.Table) -> tuple[str, bool]:
    """(the overlay of ``ledger`` rejecting its rows ``picked``, with reason and detail of
    ``rejected``, whether this call wrote it). Named by the ledger and what it rejects, so a
    rerun that applies the same finds it and writes nothing."""
    sha = hashlib.sha256(f"{ledger}\n".encode())
    for key, reason, detail in zip(*(rejected.column(c).to_pylist() for c in ("key", "reason", "detail"))):
        sha.update(f"{key}\0{reason}\0{detail}\n".encode())
    path = overlay_path(dataset, ledger, sha.hexdigest())
    if storage.exists(path):
        return path, False
    table = read_parquet(storage, ledger)
    mask = np.zeros(table.num_rows, bool)
    mask[picked] = True
    at = np.zeros(table.num_rows, np.int64)
    at[picked] = np.arange(len(picked))
    flip, at_rows = pa.array(mask), pa.array(at)
    names = table.column_names
    for name in ("status", "reason", "detail"):
        new = (
            pa.array(np.full(len(picked), REJECTED, object), pa.string())
            if name == "status"
            else rejected.column(name).combine_chunks()
        )
        old = table.column(name) if name in names else pa.nulls(table.num_rows, pa.string())
        column = pc.if_else(flip, new.take(at_rows), old)
        table = (
            table.set_column(names.index(name), name, column) if name in names else table.append_column(name, column)
        )
        names = table.column_names
    write_parquet(storage, path, table)
    return path, True


def _at(values: pa.Array | pa.ChunkedArray, at: np.ndarray) -> pa.Array:
    """``values[at]``, null where ``at`` is -1."""
    if not len(values):
        return pa.nulls(len(at), values.type)
    taken = values.take(pa.array(np.maximum(at, 0)))
    return pc.if_else(pa.array(at >= 0), taken, pa.scalar(None, values.type))


def _rejected(
    table: pa.Table, picked: np.ndarray, entry: np.ndarray, drop: np.ndarray, details: pa.Array, drops: pa.Table
) -> pa.Table:
    """The rows ``picked`` of a kept ledger as upkeep rejects them: by the list entry ``entry``
    (an id of ``details``), else by the recheck row ``drop`` (of ``drops``)."""
    n = len(picked)
    listed = pc.if_else(pa.array(entry >= 0), TAKEN_DOWN, pa.scalar(None, pa.string()))
    part = table.select(["key", "source", "row"]).take(pa.array(picked))
    return pa.table(
        {
            "key": part.column("key"),
            "source": part.column("source"),
            "row": part.column("row"),
            "status": pa.array([REJECTED] * n, pa.string()),
            "reason": pc.coalesce(listed, _at(drops.column("outcome"), drop)),
            "detail": pc.coalesce(_at(details, entry), _at(drops.column("detail"), drop)),
            "video": table.column("video").take(pa.array(picked)),
        },
        schema=REMOVED_SCHEMA,
    )


def apply_upkeep(
    storage: Storage,
    dataset: str,
    tars: Sequence[str],
    ledgers: Sequence[str],
    *,
    lists: Sequence[LoadedList] = (),
    recheck: pa.Table | None = None,
    actions: RecheckActions | None = None,
    facts: Sequence[str] | None = None,
    downloads: Sequence[str] = (),
) -> UpkeepResult:
    """Apply the takedown lists and the recheck outcomes to the kept shards of a reshard.

    ``tars``/``ledgers``: the inputs (the curated shards, or the validated ones); their ok rows
    are what the reshard carries. ``facts``: the validation ledgers, whose rows hold the URL,
    digests and perceptual hash (default: ``ledgers``, when they are the validation ledgers);
    ``downloads``: the download ledgers (the sha256 of the bytes as fetched). ``recheck``: every
    rechecked row's latest state (``tasks.formats.recheck_store.read_current``); ``actions``: what
    the recipe does with each outcome.

    An ok row a list matches becomes ``rejected``/``taken_down``; one whose recheck outcome the
    recipe drops becomes ``rejected`` with that outcome as reason (a takedown wins where both
    apply). A list or a recheck removes a manifest row whole: every clip of a video. Inputs
    with no such row are returned as they are; the others as an overlay ledger beside the
    same tar. Nothing is downloaded: the facts are in the ledgers.
    """
    started = time.perf_counter()
    tars, ledgers = list(tars), list(ledgers)
    keys = any(entry.kind == "key" for loaded in lists for entry in loaded.entries)
    pins, gen = read_pins(storage, dataset) if keys else ({}, -1)
    matcher = Matcher(lists, pins)
    fates = RecheckFates.of(recheck, actions or RecheckActions())
    result = UpkeepResult(tars=tars, ledgers=list(ledgers))
    if matcher.empty and fates.empty:
        result.seconds = time.perf_counter() - started
        return result
    hits, _ = takedown_hits(storage, matcher, ledgers if facts is None else facts, downloads)
    if matcher.new_pins:
        write_pins(storage, dataset, {**pins, **matcher.new_pins}, gen + 1)
    details = pa.array(matcher.details, pa.string())
    removed: list[pa.Table] = []
    flagged: list[pa.Table] = []
    digest = hashlib.sha256()
    for i, ledger in enumerate(ledgers):
        table = read_ledger_with(storage, ledger, _KEPT_COLUMNS, ["video"])
        rows = _rows(table)
        sources = table.column("source")
        ok = pc.fill_null(pc.equal(table.column("status"), OK), False).to_numpy(zero_copy_only=False)
        entry = np.where(ok, hits.lookup(sources, rows), -1) if len(hits) else np.full(len(rows), -1, np.int64)
        drop = np.where(ok & (entry < 0), fates.dropped.lookup(sources, rows), -1)
        picked = np.flatnonzero((entry >= 0) | (drop >= 0))
        if len(picked):
            rejected = _rejected(table, picked, entry[picked], drop[picked], details, fates.drop_rows)
            path, wrote = _overlay(storage, dataset, ledger, picked, rejected)
            result.ledgers[i] = path
            result.overlays += wrote
            removed.append(rejected)
            digest.update(f"{path}\n".encode())
        keep = np.where(ok & (entry < 0) & (drop < 0), fates.kept.lookup(sources, rows), -1)
        marked = np.flatnonzero(keep >= 0)
        if len(marked):
            seen = fates.keep_rows.take(pa.array(keep[marked]))
            part = table.select(["key", "source", "row"]).take(pa.array(marked))
            flagged.append(
                part.append_column("upkeep", seen.column("outcome")).append_column("detail", seen.column("detail"))
            )
    if removed:
        result.removed = pa.concat_tables(removed)
    if flagged:
        result.flagged = _unique_rows(pa.concat_tables(flagged).cast(FLAGGED_SCHEMA))
        for source, row, outcome in zip(*(result.flagged.column(c).to_pylist() for c in ("source", "row", "upkeep"))):
            digest.update(f"{source}\0{row}\0{outcome}\n".encode())
    if removed or flagged:
        result.digest = digest.hexdigest()
    result.seconds = time.perf_counter() - started
    return result


# ---------------------------------------------------------------------------------------------
# Key entries pinned to their sample
# ---------------------------------------------------------------------------------------------


def pins_dir(dataset: str) -> str:
    return f"{dataset}/upkeep/pins"


def read_pins(storage: Storage, dataset: str) -> tuple[Pins, int]:
    """Every key entry's pin, from the latest version, and that version's number (-1: none)."""
    gens = [int(m[1]) for name in storage.listdir(pins_dir(dataset)) if (m := _PIN_VERSION.match(name))]
    if not gens:
        return {}, -1
    gen = max(gens)
    table = read_parquet(storage, f"{pins_dir(dataset)}/{gen:06d}.parquet")
    pins: Pins = {(r["list"], r["entry"]): {c: r[c] for c in (*PINNED, "pinned_at")} for r in table.to_pylist()}
    return pins, gen


def write_pins(storage: Storage, dataset: str, pins: Pins, gen: int) -> str:
    """Version ``gen`` of the pins (every one of them); returns its path."""
    now = clock.stamp()
    rows = [
        {
            "list": name,
            "entry": entry,
            **{c: facts.get(c) for c in PINNED},
            "pinned_at": facts.get("pinned_at") or now,
        }
        for (name, entry), facts in sorted(pins.items())
    ]
    path = f"{pins_dir(dataset)}/{gen:06d}.parquet"
    write_parquet(storage, path, pa.Table.from_pylist(rows, PINS_SCHEMA))
    return path
