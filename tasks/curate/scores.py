"""Scores from stored embeddings (alignment, heads), the cuts that filters make, and each sample's fate.

Scores depend on the embeddings and the heads, never on thresholds: a rerun with new thresholds
reads the stored scores and decides again, embedding nothing.
"""

from __future__ import annotations

import math
import posixpath
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
    from tasks.curate.encoder import folder_digest

    return [
        [name, folder_digest(h.path), h.model_dump(mode="json", exclude={"min", "max", "keep_top", "keep_bottom"})]
        for name, h in cfg.heads.items()
    ]


def scores_path(dataset: str, embeddings: str, heads: list[Any]) -> str:
    stem = posixpath.basename(embeddings).removesuffix(".parquet")
    return f"{dataset}/curate/scores/{digest_of(heads)}/{stem}.parquet"


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


def _fraction_cut(values: np.ndarray, fraction: float, top: bool) -> float | None:
    """The score at which ``fraction`` of ``values`` (the highest when ``top``) are kept; ties kept."""
    if not len(values):
        return None
    ordered = np.sort(values)[::-1] if top else np.sort(values)
    keep = max(1, math.ceil(fraction * len(ordered) - 1e-9))
    return float(ordered[min(keep, len(ordered)) - 1])


def cuts(cfg: CurateConfig, scores: pa.Table) -> list[Cut]:
    """Each filter's bounds over the whole dataset's ``scores`` (a fraction needs all of them)."""
    out = []
    for name, rule in rules(cfg).items():
        col = scores.column(name) if name in scores.column_names else pa.array([], pa.float32())
        values = col.drop_null().to_numpy(zero_copy_only=False).astype(np.float64)
        values = values[~np.isnan(values)]
        low, high, said = rule.min, rule.max, []
        if rule.keep_top is not None:
            low = _fraction_cut(values, rule.keep_top, top=True)
            said.append(f"keep_top {rule.keep_top:g}")
        if rule.keep_bottom is not None:
            high = _fraction_cut(values, rule.keep_bottom, top=False)
            said.append(f"keep_bottom {rule.keep_bottom:g}")
        if rule.min is not None:
            said.append(f"min {rule.min:g}")
        if rule.max is not None:
            said.append(f"max {rule.max:g}")
        out.append(Cut(name, low, high, ", ".join(said)))
    return out


def fate(
    row: dict[str, Any], applied: list[Cut], duplicate: tuple[str, float] | None, error: str | None = None
) -> tuple[str | None, str | None]:
    """(reason, detail) of a sample: ``undecodable_image`` when no decoder read its image
    (``error``), else the first filter it fails, in recipe order, then semantic dedup;
    ``(None, None)`` when it is kept."""
    if error is not None:
        return "undecodable_image", f"curation could not decode the image (DALI, then Pillow): {error}"
    for cut in applied:
        side = cut.failed(row.get(cut.name))
        if side is not None:
            bound = cut.low if side == "low" else cut.high
            sign = "<" if side == "low" else ">"
            return reason_for(cut.name, side), f"{cut.name} {row[cut.name]:.4f} {sign} {bound:.4f} ({cut.rule})"
    if duplicate is not None:
        kept, similarity = duplicate
        return f"semantic_duplicate_of:{kept}", f"cosine {similarity:.4f} to {kept}"
    return None, None
