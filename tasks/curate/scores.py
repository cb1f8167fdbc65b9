"""Scores from stored embeddings (alignment, heads), the cuts that filters make, and each sample's fate.

Scores depend on the embeddings and the heads, never on thresholds: a rerun with new thresholds
reads the stored scores and decides again, embedding nothing.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.curate.heads import load_head
from tasks.formats.ledger import read_parquet, write_parquet
from tasks.formats.names import digest_of
from tasks.formats.recipe_curate import CurateConfig, ScoreRule
from tasks.formats.storage import Storage

ALIGNMENT = "alignment"
# (score, side that fails) -> the stable reason of a sample removed by it; any other head is
# ``low_score:<name>`` / ``high_score:<name>``.
REASONS = {
    (ALIGNMENT, "low"): "low_alignment",
    ("aesthetic", "low"): "low_aesthetic",
    ("nsfw", "high"): "unsafe_content",
    ("watermark", "high"): "watermark",
}


def reason_for(name: str, side: str) -> str:
    return REASONS.get((name, side), f"{side}_score:{name}")


def score_names(cfg: CurateConfig) -> list[str]:
    """The scores every sample gets, in the order filters apply."""
    return [ALIGNMENT, *cfg.heads]


def rules(cfg: CurateConfig) -> dict[str, ScoreRule]:
    """The filters the recipe sets, by score; a score without one is only recorded."""
    out: dict[str, ScoreRule] = {}
    if cfg.alignment is not None and cfg.alignment.active:
        out[ALIGNMENT] = cfg.alignment
    out.update({name: h for name, h in cfg.heads.items() if h.active})
    return out


def heads_key(cfg: CurateConfig) -> list[Any]:
    """What the scores depend on besides the embeddings: each head's file and how it is applied."""
    from tasks.models.placement import folder_digest

    return [
        [name, folder_digest(h.path), h.model_dump(mode="json", exclude={"min", "max", "keep_top", "keep_bottom"})]
        for name, h in cfg.heads.items()
    ]


def scores_path(dataset: str, embeddings: str, heads: list[Any]) -> str:
    """The scores of one side shard under the heads: named by the heads and by the side shard's
    folder (the model and its compute dtype), so another model's scores are never read back."""
    folder, name = posixpath.split(embeddings)
    stem = name.removesuffix(".parquet")
    return f"{dataset}/curate/scores/{digest_of(heads, posixpath.basename(folder))}/{stem}.parquet"


def score_shard(storage: Storage, cfg: CurateConfig, embeddings: str, out: str) -> str:
    """Alignment and head scores of one side shard into ``out``; kept when it is already there
    with one row per embedding (from the footers)."""
    try:
        with storage.open(out, "rb") as fh, storage.open(embeddings, "rb") as eh:
            if pq.ParquetFile(fh).metadata.num_rows == pq.ParquetFile(eh).metadata.num_rows:
                return out
    except (FileNotFoundError, OSError, pa.ArrowInvalid):
        pass
    side = read_parquet(storage, embeddings)
    image_col = side.column("image").combine_chunks()
    text_col = side.column("text").combine_chunks()
    image, text = _matrix(image_col), _matrix(text_col)
    columns: dict[str, Any] = {c: side.column(c) for c in ("key", "source", "row", "error")}
    has_image = _valid(image_col)
    align = (image * text).sum(axis=1) if len(image) else np.zeros(0, np.float32)
    columns[ALIGNMENT] = pa.array(align.astype(np.float32), pa.float32(), mask=~(has_image & _valid(text_col)))
    dim = image.shape[1] if image.ndim == 2 and image.shape[1] else None
    for name, head_cfg in cfg.heads.items():
        head = load_head(name, head_cfg, dim)
        values = head(image) if len(image) else np.zeros(0, np.float32)
        columns[name] = pa.array(values, pa.float32(), mask=~has_image)
    write_parquet(storage, out, pa.table(columns))
    return out


def _valid(arr: pa.Array) -> np.ndarray:
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _matrix(col: Any) -> np.ndarray:
    """A fixed-size-list column as an (N, D) float32 matrix (nulls as zeros)."""
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    if len(arr) == 0:
        return np.zeros((0, 0), np.float32)
    dim = arr.type.list_size
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.float32)
    return values.reshape(len(arr), dim)


@dataclass(frozen=True)
class Cut:
    """Where a filter cuts one score: kept when ``low <= score <= high`` (``None``: no cut there).

    Args:
        name: the score.
        low, high: the bounds; from thresholds, or from kept fractions over the dataset.
        rule: what the recipe said, for the ledger's detail (``min 0.2``, ``keep_top 0.3``).
    """

    name: str
    low: float | None
    high: float | None
    rule: str

    def failed(self, value: float | None) -> str | None:
        """``low`` / ``high``: the side ``value`` falls out on; ``None`` when kept (or unscored)."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return None
        if self.low is not None and value < self.low:
            return "low"
        if self.high is not None and value > self.high:
            return "high"
        return None


def _kept(fraction: float, n: int) -> int:
    """How many of ``n`` scored samples a kept ``fraction`` keeps: ``ceil(fraction * n)``, at
    least one; samples tied with the last one kept are kept too (``Cut``)."""
    return min(max(1, math.ceil(fraction * n - 1e-9)), n)


def cuts(cfg: CurateConfig, scores: pa.Table) -> list[Cut]:
    """Each filter's bounds over the whole dataset's ``scores`` (one table holding them all)."""
    return cuts_over(cfg, lambda names: [scores])


def cuts_over(cfg: CurateConfig, read: Callable[[list[str]], Iterable[pa.Table]]) -> list[Cut]:
    """Each filter's bounds over the whole dataset, read in parts: ``read(names)`` yields a table
    per part (a shard's scores) holding those of ``names`` it has. Thresholds read nothing; the
    fractions take two passes over their columns for float32 scores (four at most), each
    holding one part and a histogram of 2**18 counters (``_Selection``), so memory stays the
    same whatever the size of the dataset. The bound is the ``_kept``-th highest value
    (``keep_top``) or lowest (``keep_bottom``), exactly the value sorting them all would give
    (float64 of the stored float32; null and NaN scores left out; -0.0 as 0.0)."""
    selections: dict[str, _Selection] = {}
    for name, rule in rules(cfg).items():
        if rule.keep_top is not None:
            selections[name] = _Selection(rule.keep_top, top=True)
        elif rule.keep_bottom is not None:
            selections[name] = _Selection(rule.keep_bottom, top=False)
    while wanted := [name for name, sel in selections.items() if not sel.done]:
        for part in read(wanted):
            for name in wanted:
                if name in part.column_names:
                    selections[name].count(_scored(part.column(name)))
        for name in wanted:
            selections[name].settle()
    out = []
    for name, rule in rules(cfg).items():
        low, high, said = rule.min, rule.max, []
        if rule.keep_top is not None:
            low = selections[name].value()
            said.append(f"keep_top {rule.keep_top:g}")
        if rule.keep_bottom is not None:
            high = selections[name].value()
            said.append(f"keep_bottom {rule.keep_bottom:g}")
        if rule.min is not None:
            said.append(f"min {rule.min:g}")
        if rule.max is not None:
            said.append(f"max {rule.max:g}")
        out.append(Cut(name, low, high, ", ".join(said)))
    return out


def _scored(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A score column's values as float64, nulls and NaNs left out."""
    values = col.drop_null().to_numpy(zero_copy_only=False).astype(np.float64)
    return values[~np.isnan(values)]


# Bits of a float64's order key (``_order_key``) that each pass of a selection fixes, top first.
_DIGITS = (18, 17, 16, 13)
# A float32 value (as float64) is fixed by its key's top 35 bits: sign, 11 exponent bits and
# float32's 23 mantissa bits; the 29 below are all 0 (all 1 for a negative value).
_FLOAT32_BITS = 35
_TOP = np.uint64(1 << 63)


def _order_key(values: np.ndarray) -> np.ndarray:
    """float64 values (no NaN) as uint64 in the same order: a positive value's bits with the
    sign bit set, a negative value's bits inverted; -0.0 as 0.0."""
    bits = (values + 0.0).view(np.uint64)
    return np.where(bits & _TOP, ~bits, bits | _TOP)


def _from_key(key: int) -> float:
    bits = key & ~(1 << 63) if key >> 63 else ~key & ((1 << 64) - 1)
    return float(np.array([bits], np.uint64).view(np.float64)[0])


class _Selection:
    """The value a kept fraction cuts at, found in passes over the scores (radix selection on
    ``_order_key``): a pass counts, among the values whose key starts with the bits fixed so far,
    the next ``_DIGITS`` bits, then fixes those of the bucket that holds the wanted rank. The
    first pass also counts the values, which gives the rank (the ``_kept``-th highest for
    ``top``, else lowest), and finds whether all are float32: then its two passes fix the value.

    Args:
        fraction: the kept fraction.
        top: ``keep_top`` (else ``keep_bottom``).
    """

    def __init__(self, fraction: float, top: bool) -> None:
        self.fraction, self.top = fraction, top
        self.n = 0
        self.float32 = True
        self.rank = 0  # ascending, 0-based, among the values whose key starts with ``prefix``
        self.prefix = 0
        self.bits = 0  # of the key fixed in ``prefix``
        self.passes = 0
        self.hist = np.zeros(1 << _DIGITS[0], np.int64)
        self.done = False

    def count(self, values: np.ndarray) -> None:
        """One part's scores (float64, no NaN) in this pass."""
        if self.passes == 0:
            self.n += len(values)
            with np.errstate(over="ignore"):  # a float64 beyond float32's range: inf, not equal
                self.float32 = self.float32 and bool(np.array_equal(values.astype(np.float32), values))
        keys = _order_key(values)
        if self.bits:
            keys = keys[(keys >> np.uint64(64 - self.bits)) == np.uint64(self.prefix)]
        width = _DIGITS[self.passes]
        digits = (keys >> np.uint64(64 - self.bits - width)) & np.uint64((1 << width) - 1)
        self.hist += np.bincount(digits.astype(np.intp), minlength=1 << width)

    def settle(self) -> None:
        """After a pass: fix its bits."""
        if self.passes == 0:
            if self.n == 0:
                self.done = True
                return
            kept = _kept(self.fraction, self.n)
            self.rank = self.n - kept if self.top else kept - 1
        cum = np.cumsum(self.hist)
        digit = int(np.searchsorted(cum, self.rank, side="right"))
        self.rank -= int(cum[digit - 1]) if digit else 0
        width = _DIGITS[self.passes]
        self.prefix = (self.prefix << width) | digit
        self.bits += width
        self.passes += 1
        self.done = self.bits == 64 or (self.float32 and self.bits >= _FLOAT32_BITS)
        self.hist = np.zeros(0 if self.done else 1 << _DIGITS[self.passes], np.int64)

    def value(self) -> float | None:
        """The cut; ``None`` when no value was scored."""
        if self.n == 0:
            return None
        rest = 64 - self.bits
        key = self.prefix << rest
        if rest and not key >> 63:  # a negative float32 value: the bits below are all 1
            key |= (1 << rest) - 1
        return _from_key(key)


def fate(
    row: dict[str, Any], applied: list[Cut], duplicate: tuple[str, float] | None, error: str | None = None
) -> tuple[str | None, str | None]:
    """(reason, detail) of a sample: ``undecodable_image`` when no decoder read its image
    (``error``), else the first filter it fails, in recipe order, then semantic dedup;
    ``(None, None)`` when it is kept."""
    if error is not None:
        return undecodable(error)
    for cut in applied:
        side = cut.failed(row.get(cut.name))
        if side is not None:
            return filtered(cut, side, row[cut.name])
    if duplicate is not None:
        return duplicated(duplicate)
    return None, None


def undecodable(error: str) -> tuple[str, str]:
    """(reason, detail) of a sample whose image no decoder read."""
    return "undecodable_image", f"curation could not decode the image (DALI, then Pillow): {error}"


def filtered(cut: Cut, side: str, value: float) -> tuple[str, str]:
    """(reason, detail) of a sample whose ``value`` falls out of ``cut`` on ``side`` (``Cut.failed``)."""
    reason, (detail,) = filtered_many(cut, side, [value])
    return reason, detail


def filtered_many(cut: Cut, side: str, values: list[float]) -> tuple[str, list[str]]:
    """``filtered`` of samples that fall out of ``cut`` on the same side: their reason, and a
    detail per value (``alignment 0.2010 < 0.3062 (keep_top 0.3)``)."""
    bound = cut.low if side == "low" else cut.high
    sign = "<" if side == "low" else ">"
    head, tail = f"{cut.name} ", f" {sign} {bound:.4f} ({cut.rule})"
    return reason_for(cut.name, side), [f"{head}{value:.4f}{tail}" for value in values]


def duplicated(duplicate: tuple[str, float]) -> tuple[str, str]:
    """(reason, detail) of a semantic duplicate: (the kept key, cosine) from semantic dedup."""
    kept, similarity = duplicate
    return f"semantic_duplicate_of:{kept}", f"cosine {similarity:.4f} to {kept}"
