"""Recipe models of the curation phase: the dual encoder, the score filters, semantic dedup, the gate."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from tasks.formats.recipe_base import ComputeDtype, Frozen

HEAD_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class ScoreRule(Frozen):
    """Which samples a score keeps: thresholds, or a kept fraction of the dataset.

    Args:
        min: keep samples whose score is at least this.
        max: keep samples whose score is at most this.
        keep_top: keep this fraction of the samples with the highest scores (DataComp's
            "top 30% by CLIP score" is ``keep_top: 0.3``); ties at the cut are kept.
        keep_bottom: keep this fraction of the samples with the lowest scores.

    ``min`` and ``max`` may be combined; a fraction excludes the thresholds on its side. The
    fractions are of the samples that reach the curation phase, decided over the whole dataset.
    """

    min: float | None = None
    max: float | None = None
    keep_top: float | None = Field(default=None, gt=0, le=1)
    keep_bottom: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _one_rule_per_side(self) -> ScoreRule:
        if self.keep_top is not None and self.keep_bottom is not None:
            raise ValueError("keep_top and keep_bottom exclude each other")
        if self.keep_top is not None and self.min is not None:
            raise ValueError("keep_top and min both set the low cut: give one")
        if self.keep_bottom is not None and self.max is not None:
            raise ValueError("keep_bottom and max both set the high cut: give one")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.min, self.max, self.keep_top, self.keep_bottom))


class HeadConfig(ScoreRule):
    """A small head over the image embedding, loaded from a local file, and its filter.

    The file is a torch state dict (``.pth``/``.pt``, loaded with ``weights_only``) or a
    ``.safetensors`` file of linear layers applied in key order: LAION-aesthetics' linear
    predictor (``weight`` (1, D), ``bias``) and its MLP (``layers.0.weight`` ... ``layers.7.bias``)
    load as they are.

    Args:
        path: the head's file; never downloaded.
        activation: between the linear layers (LAION's aesthetic MLP has none, ``none``).
        output: ``raw`` (the last layer's value), ``sigmoid`` of it, or ``softmax`` over the last
            layer's outputs, taking ``output_index``.
        output_index: the output used when the last layer has several (default 0; a two-class
            softmax head's positive class is usually 1).
        normalize: L2-normalise the embedding before the head, as LAION's heads expect.
        min, max, keep_top, keep_bottom: as ``ScoreRule``; none set scores without filtering.
    """

    path: str = Field(min_length=1)
    activation: Literal["none", "relu", "gelu"] = "none"
    output: Literal["raw", "sigmoid", "softmax"] = "raw"
    output_index: int = Field(default=0, ge=0)
    normalize: bool = True


class CurateGate(Frozen):
    """Thresholds of the curation gate.

    Args:
        max_removed_rate: samples the phase removes / samples in, at most this.
        max_reason_rate: per reason family (``low_alignment``, ``semantic_duplicate_of`` ...),
            its share of the samples in at most this.
        min_mean_alignment: mean image-text alignment of the kept samples at least this.
        min_samples: kept samples at least this (never below 1).
    """

    max_removed_rate: float = Field(default=0.7, ge=0, le=1)
    max_reason_rate: dict[str, float] = Field(default_factory=dict)
    min_mean_alignment: float | None = None
    min_samples: int = Field(default=1, ge=1)


class SemDedupRule(Frozen):
    """Semantic deduplication of the image embeddings (SemDeDup: k-means, then pairs within clusters).

    Args:
        threshold: cosine similarity at or above which two samples are duplicates; the earliest
            in (recipe source order, row) is kept.
        clusters: k of the k-means; default about the square root of the samples.
        seed: of the k-means.
    """

    threshold: float = Field(default=0.95, gt=0, le=1)
    clusters: int | None = Field(default=None, ge=1)
    seed: int = 0


class CurateConfig(Frozen):
    """Curation (phase ``curate``, between validation and resharding): off unless ``model`` is set.

    Every sample's image and caption are embedded once by a CLIP-family dual encoder; the
    embeddings are stored beside the samples, named by the model's digest, and reused by later
    runs, by new thresholds and by precache. Scores and filters decide from them.

    Args:
        model: local folder of the dual encoder: a transformers ``CLIPModel`` or ``SiglipModel``
            (``save_pretrained`` layout), or an open_clip checkpoint (``open_clip_config.json``
            with ``open_clip_pytorch_model.bin`` or ``open_clip_model.safetensors``); never
            downloaded.
        tokenizer: folder of its tokenizer (default: ``model``).
        max_length: caption tokens (default: the model's context length).
        batch_size: images per decode and encode batch.
        prefetch: batches DALI decodes ahead of the encoder.
        decode: ``auto`` decodes on the GPU (DALI ``mixed``) when the worker has one; ``gpu``
            always (see ``device``), ``cpu`` never.
        device: ``auto`` runs the encoder on the GPU when the worker has one; ``cuda`` always:
            a run on a cluster of this machine's that has no GPU stops before it starts (exit
            2), and a worker of an existing cluster that sees none fails its shards.
        compute_dtype: the precision the towers compute in (weights stay fp32; matrix products
            run under autocast). ``auto`` takes bf16 on CPUs with AVX512-BF16 or AMX and on GPUs
            that support it, fp32 otherwise. Side shards are named by it (and record it), so
            embeddings of two dtypes never mix; the stored embeddings are float16 either way.
        alignment: the image-text alignment filter (cosine of the two embeddings, DataComp's
            CLIP score); removed samples are ``low_alignment``.
        heads: named heads over the image embedding: ``aesthetic`` (removed:
            ``low_aesthetic``), ``nsfw`` (``unsafe_content``), ``watermark`` (``watermark``), or
            any other name (``low_score:<name>`` / ``high_score:<name>``).
        semdedup: semantic deduplication (``semantic_duplicate_of:<key>``); off when absent.
    """

    model: str | None = None
    tokenizer: str | None = None
    max_length: int | None = Field(default=None, ge=1, le=4096)
    batch_size: int = Field(default=64, ge=1, le=4096)
    prefetch: int = Field(default=2, ge=1, le=64)
    decode: Literal["auto", "cpu", "gpu"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compute_dtype: ComputeDtype = "auto"
    alignment: ScoreRule | None = None
    heads: dict[str, HeadConfig] = Field(default_factory=dict)
    semdedup: SemDedupRule | None = None

    @model_validator(mode="after")
    def _names(self) -> CurateConfig:
        for name in self.heads:
            if not HEAD_NAME.match(name) or name == "alignment":
                raise ValueError(f"head name {name!r}: lowercase letters, digits and _, not 'alignment'")
        if self.alignment is not None and (self.alignment.max is not None or self.alignment.keep_bottom is not None):
            raise ValueError("alignment keeps the best-matching samples: use min or keep_top")
        return self

    @property
    def enabled(self) -> bool:
        return self.model is not None
