"""Typed flow parameters: the forms the Prefect UI shows, with the recipe models' bounds."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BaseModel, Field, model_validator

from tasks.formats.recipe import ExecutionConfig
from tasks.formats.recipe_base import Frozen
from tasks.formats.recipe_curate import CurateConfig, CurateGate, ScoreRule, SemDedupRule
from tasks.formats.recipe_download import DownloadConfig
from tasks.formats.recipe_outputs import DownloadGate, ReshardConfig, ValidateGate
from tasks.formats.recipe_privacy import FacePrivacy, TextPrivacy

# Keys of ``RecipeOverrides.extra`` and of ``--set``: dotted recipe paths.
_DOTTED = r"^[a-z_]+(\.[a-z_]+)+$"

RecipePath = Annotated[
    str,
    Field(
        min_length=1,
        description="Recipe YAML; a relative path is relative to the project folder (the deployments' working directory).",
    ),
]
ClusterChoice = Annotated[
    str,
    Field(
        pattern=r"^(local|cuda|(tcp|tls|ucx|inproc)://\S+)$",
        description="local (a Dask LocalCluster), cuda (one worker per GPU) or an existing scheduler, tcp://host:8786. Empty: the recipe's.",
    ),
]
Workers = Annotated[
    int, Field(ge=1, le=512, description="Worker processes of a local cluster. Empty: the recipe's (or one per core).")
]
StorageRoot = Annotated[
    str, Field(min_length=1, description="Storage root, a local path or s3://bucket/prefix. Empty: the recipe's.")
]


def _like(model: type[BaseModel], name: str, key: str, description: str) -> Any:
    """An optional field with the bounds of ``model.name``, overriding the recipe key ``key``.

    Bounds come from the recipe model itself, so the form and the recipe never disagree.
    """
    bounds: dict[str, Any] = {}
    for meta in model.model_fields[name].metadata:
        for attr in ("ge", "gt", "le", "lt"):
            if isinstance(meta, getattr(annotated_types, attr.capitalize())):
                bounds[attr] = getattr(meta, attr)
    return Field(default=None, description=description, json_schema_extra={"recipe_key": key}, **bounds)


class RecipeOverrides(Frozen):
    """Recipe values for one run; empty fields keep the recipe's.

    Args:
        samples_per_shard: samples in every released shard (``reshard.samples_per_shard``).
        download_timeout_s: deadline per request attempt (``download.timeout_s``).
        download_retries: further attempts for 429, 5xx and connection errors (``download.retries``).
        max_inflight: concurrent requests per download shard (``download.max_inflight``).
        per_host: concurrent requests per host per shard (``download.per_host``).
        keep_raw: keep each chunk's raw shard beside its candidates (``download.keep_raw``).
        task_retries: Prefect retries of a failed shard task (``execution.task_retries``).
        min_success_rate: download gate, ok / rows at least (``gates.download.min_success_rate``).
        max_reject_rate: validation gate, rejected / rows at most (``gates.validate.max_reject_rate``).
        min_samples: validation gate, accepted samples at least (``gates.validate.min_samples``).
        alignment_min: curation, keep samples whose image-text alignment is at least this
            (``curate.alignment.min``).
        alignment_keep_top: curation, keep this fraction with the best alignment (``curate.alignment.keep_top``).
        aesthetic_min: curation, keep samples whose aesthetic score is at least this (``curate.heads.aesthetic.min``).
        nsfw_max: curation, keep samples whose NSFW score is at most this (``curate.heads.nsfw.max``).
        watermark_max: curation, keep samples whose watermark score is at most this (``curate.heads.watermark.max``).
        semdedup_threshold: curation, cosine at or above which two images are duplicates
            (``curate.semdedup.threshold``).
        curate_max_removed_rate: curation gate, removed / samples in at most (``gates.curate.max_removed_rate``).
        curate_compute_dtype: what curation's dual encoder computes in: auto, fp32, bf16 or fp16
            (``curate.compute_dtype``).
        privacy_faces: faces in released images: off, record, blur or reject (``privacy.faces.mode``).
        privacy_text: personal data in captions and turns: off, record, redact or reject
            (``privacy.text.mode``).
        extra: any other recipe key, dotted (``{"validate.image.min_side": 128}``), as ``--set`` takes.
    """

    samples_per_shard: int | None = _like(
        ReshardConfig,
        "samples_per_shard",
        "reshard.samples_per_shard",
        "Samples per released shard; the last shard holds the remainder.",
    )
    download_timeout_s: float | None = _like(
        DownloadConfig, "timeout_s", "download.timeout_s", "Seconds per request attempt, connect plus body."
    )
    download_retries: int | None = _like(
        DownloadConfig,
        "retries",
        "download.retries",
        "Further attempts after the first, for 429, 5xx and connection errors.",
    )
    max_inflight: int | None = _like(
        DownloadConfig, "max_inflight", "download.max_inflight", "Concurrent requests per download shard."
    )
    per_host: int | None = _like(
        DownloadConfig, "per_host", "download.per_host", "Concurrent requests per host per download shard."
    )
    keep_raw: bool | None = _like(
        DownloadConfig,
        "keep_raw",
        "download.keep_raw",
        "Keep each chunk's raw shard (bytes as fetched) beside its candidates; off: only the download ledgers.",
    )
    task_retries: int | None = _like(
        ExecutionConfig, "task_retries", "execution.task_retries", "Prefect retries of a failed shard task."
    )
    min_success_rate: float | None = _like(
        DownloadGate, "min_success_rate", "gates.download.min_success_rate", "Download gate: ok / rows at least this."
    )
    max_reject_rate: float | None = _like(
        ValidateGate,
        "max_reject_rate",
        "gates.validate.max_reject_rate",
        "Validation gate: rejected / rows at most this.",
    )
    min_samples: int | None = _like(
        ValidateGate, "min_samples", "gates.validate.min_samples", "Validation gate: accepted samples at least this."
    )
    alignment_min: float | None = _like(
        ScoreRule,
        "min",
        "curate.alignment.min",
        "Curation: keep samples whose image-text alignment (cosine) is at least this.",
    )
    alignment_keep_top: float | None = _like(
        ScoreRule,
        "keep_top",
        "curate.alignment.keep_top",
        "Curation: keep this fraction of the samples, those with the best image-text alignment (DataComp: 0.3).",
    )
    aesthetic_min: float | None = _like(
        ScoreRule, "min", "curate.heads.aesthetic.min", "Curation: keep samples whose aesthetic score is at least this."
    )
    nsfw_max: float | None = _like(
        ScoreRule, "max", "curate.heads.nsfw.max", "Curation: keep samples whose NSFW score is at most this."
    )
    watermark_max: float | None = _like(
        ScoreRule, "max", "curate.heads.watermark.max", "Curation: keep samples whose watermark score is at most this."
    )
    semdedup_threshold: float | None = _like(
        SemDedupRule,
        "threshold",
        "curate.semdedup.threshold",
        "Curation: cosine similarity at or above which two images are semantic duplicates.",
    )
    curate_max_removed_rate: float | None = _like(
        CurateGate,
        "max_removed_rate",
        "gates.curate.max_removed_rate",
        "Curation gate: samples removed / samples in at most this.",
    )
    curate_compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] | None = _like(
        CurateConfig,
        "compute_dtype",
        "curate.compute_dtype",
        "Curation: what the dual encoder computes in; auto is bf16 where the CPU or GPU has it, fp32 otherwise.",
    )
    privacy_faces: Literal["off", "record", "blur", "reject"] | None = _like(
        FacePrivacy,
        "mode",
        "privacy.faces.mode",
        "Privacy: faces in released images are recorded (boxes in the json), blurred, or refuse the sample.",
    )
    privacy_text: Literal["off", "record", "redact", "reject"] | None = _like(
        TextPrivacy,
        "mode",
        "privacy.text.mode",
        "Privacy: personal data in captions and turns is recorded (kinds and offsets), redacted, or refuses the sample.",
    )
    extra: dict[Annotated[str, Field(pattern=_DOTTED)], Any] = Field(
        default_factory=dict, description='Other recipe keys, dotted: {"validate.image.min_side": 128}.'
    )

    @model_validator(mode="before")
    @classmethod
    def _dotted_keys(cls, data: Any) -> Any:
        # Callers and `--set` pass {"reshard.samples_per_shard": 500}; those keys belong in extra.
        if isinstance(data, dict) and any("." in str(k) for k in data):
            data = dict(data)
            extra = dict(data.pop("extra", None) or {})
            for k in [k for k in data if "." in str(k)]:
                extra[k] = data.pop(k)
            data["extra"] = extra
        return data

    def dotted(self) -> dict[str, Any]:
        """The overrides as dotted recipe keys, for ``load_recipe``; typed fields win over ``extra``."""
        out = dict(self.extra)
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if name != "extra" and value is not None:
                out[info.json_schema_extra["recipe_key"]] = value
        return out


def cluster_or_env(cluster: str | None) -> str | None:
    """A flow's ``cluster`` parameter, else ``SHARDSMITH_CLUSTER`` (set on the compose stack's
    worker, so that deployed runs use the stack's Dask scheduler), else None (the recipe's)."""
    return cluster or os.environ.get("SHARDSMITH_CLUSTER") or None


def recipe_overrides(
    overrides: RecipeOverrides | dict[str, Any] | None,
    cluster: str | None = None,
    storage: str | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """Dotted recipe overrides from a flow's parameters (the explicit ones win).

    Without a ``cluster`` parameter, ``SHARDSMITH_CLUSTER`` names one (``cluster_or_env``).
    """
    cluster = cluster_or_env(cluster)
    if isinstance(overrides, dict):
        overrides = RecipeOverrides.model_validate(overrides)
    return explicit_overrides(overrides.dotted() if overrides is not None else {}, cluster, storage, workers)


def explicit_overrides(
    dotted: dict[str, Any] | None, cluster: str | None = None, storage: str | None = None, workers: int | None = None
) -> dict[str, Any]:
    """Dotted recipe overrides (``--set``, a flow's ``overrides``) with the explicit cluster,
    storage root and worker count on top, where given."""
    out = dict(dotted or {})
    for key, value in (("execution.cluster", cluster), ("storage", storage), ("execution.workers", workers)):
        if value:
            out[key] = value
    return out
