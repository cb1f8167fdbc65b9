"""Dataset recipes: YAML files validated by one frozen pydantic model per stage config."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file, the key and what was expected."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SourceConfig(_Frozen):
    """One URL manifest.

    Args:
        name: source id, lowercase; it prefixes every sample key (``{name}-{row:09d}``).
        manifest: local path, http(s) URL or s3:// URL of a csv / tsv / jsonl / parquet file,
            optionally gzip-compressed (``.gz``).
        format: ``auto`` picks the format from the file name.
        url_column, caption_column, license_column: column names in the manifest.
        extra_columns: further columns carried into each sample's json; ``["*"]`` carries all.
        rows_per_shard: manifest rows per download shard (one Prefect task each).
    """

    name: str = Field(pattern=NAME_PATTERN)
    manifest: str = Field(min_length=1)
    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = "auto"
    url_column: str = "url"
    caption_column: str | None = "caption"
    license_column: str | None = "license"
    extra_columns: tuple[str, ...] = ()
    rows_per_shard: int = Field(default=1000, ge=1, le=1_000_000)


class NetworkConfig(_Frozen):
    """Which addresses downloads may reach (SSRF guard).

    Args:
        allow_private_networks: allow every non-global address (loopback, private, link-local).
            Off by default; only for tests, demos and trusted intranets.
        allowed_networks: CIDRs allowed even though they are not global, e.g. ``127.0.0.1/32``.
        file_root: ``file://`` URLs are allowed only under this directory (off when unset).
        s3_buckets: ``s3://`` URLs are allowed only for these buckets.
    """

    allow_private_networks: bool = False
    allowed_networks: tuple[str, ...] = ()
    file_root: str | None = None
    s3_buckets: tuple[str, ...] = ()

    @field_validator("allowed_networks")
    @classmethod
    def _cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        for cidr in value:
            ipaddress.ip_network(cidr, strict=False)
        return value


class DownloadConfig(_Frozen):
    """How one download shard fetches its rows.

    Args:
        timeout_s: one deadline per request attempt, connect plus whole body.
        retries: further attempts after the first, for 429, 5xx and connection errors only.
        backoff_s: first backoff; doubles per attempt, capped by ``max_backoff_s``.
        max_retry_after_s: a larger ``Retry-After`` gives up instead of waiting.
        max_inflight: concurrent requests per shard.
        per_host: concurrent requests per host per shard.
        max_bytes: body cap, enforced while streaming whatever Content-Length says.
        max_redirects: redirect hops, each re-checked by the SSRF guard.
        user_agent: sent with every request; its first token is matched by robots.txt and
            ``X-Robots-Tag`` scopes.
        opt_out_directives: ``X-Robots-Tag`` directives that reject a sample as ``opted_out``.
        respect_robots_txt: fetch and honour robots.txt per host.
        allowed_formats: image formats sniffed from the bytes that are kept.
        network: the SSRF guard.
    """

    timeout_s: float = Field(default=20.0, gt=0, le=600)
    retries: int = Field(default=2, ge=0, le=10)
    backoff_s: float = Field(default=0.5, ge=0, le=60)
    max_backoff_s: float = Field(default=8.0, ge=0, le=600)
    max_retry_after_s: float = Field(default=30.0, ge=0, le=3600)
    max_inflight: int = Field(default=64, ge=1, le=1024)
    per_host: int = Field(default=16, ge=1, le=1024)
    max_bytes: int = Field(default=20 * 1024 * 1024, ge=1024)
    max_redirects: int = Field(default=5, ge=0, le=10)
    user_agent: str = "shardsmith/0.1 (+https://github.com/shardsmith/shardsmith)"
    opt_out_directives: tuple[str, ...] = ("noai", "noimageai", "noml")
    respect_robots_txt: bool = False
    allowed_formats: tuple[str, ...] = ("jpeg", "png", "webp", "gif", "bmp", "tiff")
    network: NetworkConfig = NetworkConfig()


class LicenseReview(_Frozen):
    """Who checked the sources' terms, and when. A release without one is blocked by the gate.

    Args:
        reviewed_by: a person or team.
        reviewed_on: date of the review (YYYY-MM-DD).
        notes: what was checked, links to the terms.
    """

    reviewed_by: str = Field(min_length=1)
    reviewed_on: dt.date
    notes: str = ""


class LicensePolicy(_Frozen):
    """Which licenses a sample may carry.

    Args:
        allow: SPDX ids accepted; aliases ("CC BY 4.0", license URLs) are normalised first.
        source_defaults: SPDX id per source name for rows without a license.
        unknown: what to do with a license that cannot be normalised to an SPDX id.
        review: the dataset-level license review (required for a release).
    """

    allow: tuple[str, ...] = ("CC0-1.0", "CC-BY-4.0", "CC-BY-SA-4.0", "Apache-2.0", "MIT", "CC-PDM-1.0")
    source_defaults: dict[str, str] = Field(default_factory=dict)
    unknown: Literal["reject", "allow"] = "reject"
    review: LicenseReview | None = None


class ImageRules(_Frozen):
    """Decoding limits, normalisation and per-image rules.

    Args:
        max_pixels: width x height cap read from the header before decoding (bombs are
            rejected, never decoded).
        allowed_formats: formats sniffed from the bytes that may be decoded.
        animated: ``first_frame`` keeps frame 0 of animated images; ``reject`` rejects them.
        min_side: smallest allowed short side, in pixels, after EXIF orientation.
        max_aspect_ratio: largest allowed long side / short side.
        min_bytes, max_bytes: bounds on the downloaded file size.
        resize_mode: img2dataset's modes. ``no`` keeps the resolution; ``keep_ratio``
            scales the short side to ``image_size``; ``center_crop`` scales the short side then
            crops a square; ``border`` scales the long side and pads to a square (white).
            Small images are scaled up.
        image_size: target size for the resize modes.
        output_format, quality: the re-encoding (always from pixels, so metadata and
            appended payloads are dropped); ``quality`` is ignored for PNG.
    """

    max_pixels: int = Field(default=50_000_000, ge=1)
    allowed_formats: tuple[str, ...] = ("jpeg", "png", "webp", "gif", "bmp", "tiff")
    animated: Literal["first_frame", "reject"] = "first_frame"
    min_side: int = Field(default=64, ge=1)
    max_aspect_ratio: float = Field(default=4.0, ge=1.0)
    min_bytes: int = Field(default=0, ge=0)
    max_bytes: int = Field(default=50 * 1024 * 1024, ge=1)
    resize_mode: Literal["no", "keep_ratio", "center_crop", "border"] = "no"
    image_size: int = Field(default=256, ge=8, le=16384)
    output_format: Literal["jpeg", "png", "webp"] = "jpeg"
    quality: int = Field(default=95, ge=1, le=100)


class CaptionRules(_Frozen):
    """Caption cleanup (whitespace, HTML entities) and bounds, applied after cleanup.

    Args:
        required: reject samples without a caption (``caption_missing``).
        min_chars, max_chars: length bounds (``caption_too_short`` / ``caption_too_long``).
        min_words: fewest words.
        max_non_text_ratio: largest share of junk characters (U+FFFD, private-use,
            unassigned, control characters, UTF-8-read-as-Latin-1 mojibake) before the caption
            is rejected as ``caption_charset``; every script, emoji and symbol counts as text.
    """

    required: bool = True
    min_chars: int = Field(default=3, ge=0)
    max_chars: int = Field(default=2000, ge=1)
    min_words: int = Field(default=1, ge=0)
    max_non_text_ratio: float = Field(default=0.1, ge=0, le=1)


class DedupConfig(_Frozen):
    """Deduplication across the whole dataset; the first sample by (source, row) wins.

    Args:
        exact: sha256 of the normalised pixels.
        near: 64-bit perceptual hash (DCT pHash) within ``hamming_threshold`` bits.
    """

    exact: bool = True
    near: bool = True
    hamming_threshold: int = Field(default=4, ge=0, le=16)


class ValidateConfig(_Frozen):
    """The validation phase: license, content and dedup.

    Args:
        license: the license policy.
        image: decoding limits, normalisation, resize and image rules.
        caption: caption cleanup and rules.
        dedup: exact and near-duplicate detection.
    """

    license: LicensePolicy = LicensePolicy()
    image: ImageRules = ImageRules()
    caption: CaptionRules = CaptionRules()
    dedup: DedupConfig = DedupConfig()


class ReshardConfig(_Frozen):
    """Resharding into equal-size shards (reorganize_tar).

    Args:
        samples_per_shard: every output shard holds exactly this many samples, the last the
            remainder (recorded as the release's ``tail``).
        seed: shuffle samples across the whole dataset with this seed; ``null`` keeps the
            (source, row) order.
        required_members: extensions every carried sample must have; by default the image
            (from ``validate.image.output_format``), ``json``, and ``txt`` when captions are
            required.
    """

    samples_per_shard: int = Field(default=1000, ge=1, le=10_000_000)
    seed: int | None = None
    required_members: tuple[str, ...] | None = None

    def required(self, validate: "ValidateConfig") -> tuple[str, ...]:
        if self.required_members is not None:
            return self.required_members
        image = {"jpeg": "jpg", "png": "png", "webp": "webp"}[validate.image.output_format]
        return (image, "json", "txt") if validate.caption.required else (image, "json")


class ImageLatentsConfig(_Frozen):
    """Image latents from a frozen diffusers ``AutoencoderKL``.

    Args:
        model: local directory of the VAE (``save_pretrained`` layout); never downloaded.
        subfolder: folder inside ``model`` that holds the VAE (``vae`` for a whole pipeline).
        resolution: images are resized (shorter side) and center-cropped to this square; a
            multiple of 8.
        store: ``mean_logvar`` keeps the latent distribution (mean and log-variance, so training
            can sample fresh noise every epoch), ``mean`` only the mean, ``sample`` one draw
            seeded by the key.
    """

    model: str = Field(min_length=1)
    subfolder: str | None = None
    resolution: int = Field(default=256, ge=8, le=4096, multiple_of=8)
    store: Literal["mean_logvar", "mean", "sample"] = "mean_logvar"


class TextEmbeddingsConfig(_Frozen):
    """Caption embeddings from a frozen transformers text encoder (CLIP text model or T5 encoder).

    Args:
        model: local directory of the encoder; never downloaded.
        tokenizer: local directory of its tokenizer (default: ``model``).
        max_length: captions are padded and truncated to this many tokens; the attention mask
            is stored beside the embedding.
    """

    model: str = Field(min_length=1)
    tokenizer: str | None = None
    max_length: int = Field(default=77, ge=1, le=4096)


class VisionFeaturesConfig(_Frozen):
    """Features of a frozen vision encoder (CLIP or SigLIP vision model) for VLM recipes.

    Args:
        model: local directory of the vision model; never downloaded.
        resolution: input size (default: the model config's ``image_size``).
    """

    model: str = Field(min_length=1)
    resolution: int | None = Field(default=None, ge=8, le=4096)


class PrecacheConfig(_Frozen):
    """Outputs of frozen encoders computed once per resharded shard (phase ``precache``).

    Nothing is precached unless at least one encoder is configured.

    Args:
        image_latents: VAE latents of the images.
        text: caption embeddings with their attention mask.
        vision: vision-encoder features.
        dtype: storage dtype of the arrays (``bf16`` is stored as its raw 16 bits, ``<u2``).
        batch_size: images per decode and encode batch.
        prefetch: batches DALI prepares ahead.
        decode: ``auto`` decodes on the GPU (DALI ``mixed``) when the worker has one.
        device: ``auto`` runs the encoders on the GPU when the worker has one.
    """

    image_latents: ImageLatentsConfig | None = None
    text: TextEmbeddingsConfig | None = None
    vision: VisionFeaturesConfig | None = None
    dtype: Literal["fp16", "bf16", "fp32"] = "fp16"
    batch_size: int = Field(default=16, ge=1, le=4096)
    prefetch: int = Field(default=2, ge=1, le=64)
    decode: Literal["auto", "cpu", "gpu"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @property
    def enabled(self) -> bool:
        return any((self.image_latents, self.text, self.vision))


class DownloadGate(_Frozen):
    """Thresholds of the download gate.

    Args:
        min_success_rate: ok / rows at least this.
        max_reason_rate: largest allowed share of rows per reason, e.g. ``{timeout: 0.05}``.
    """

    min_success_rate: float = Field(default=0.5, ge=0, le=1)
    max_reason_rate: dict[str, float] = Field(default_factory=dict)


class ValidateGate(_Frozen):
    """Thresholds of the validation gate.

    Args:
        max_reject_rate: rejected / rows of the phase at most this.
        min_samples: accepted samples at least this (and never below 1).
        require_license_review: block when the recipe has no license review.
    """

    max_reject_rate: float = Field(default=0.5, ge=0, le=1)
    min_samples: int = Field(default=1, ge=1)
    require_license_review: bool = True


class PrecacheGate(_Frozen):
    """Thresholds of the precache gate, per latent channel over the whole dataset.

    The defaults fit a VAE whose scaling factor is applied (unit-variance latents): a wrong
    scaling or a broken model moves the channel statistics far outside them.

    Args:
        max_abs_channel_mean: |mean| of every scaled latent channel at most this.
        min_channel_std: std of every scaled latent channel at least this.
        max_channel_std: std of every scaled latent channel at most this.
    """

    max_abs_channel_mean: float = Field(default=3.0, ge=0)
    min_channel_std: float = Field(default=0.05, ge=0)
    max_channel_std: float = Field(default=5.0, gt=0)


class GatesConfig(_Frozen):
    """One gate per phase; a failed gate stops the flow and still writes its report."""

    download: DownloadGate = DownloadGate()
    validate_: ValidateGate = Field(default=ValidateGate(), alias="validate")
    precache: PrecacheGate = PrecacheGate()

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class ExecutionConfig(_Frozen):
    """Where tasks run.

    Args:
        cluster: ``local`` (a Dask LocalCluster), ``cuda`` (a dask-cuda LocalCUDACluster) or the
            address of an existing Dask scheduler (``tcp://host:8786``).
        workers: worker processes of a local cluster (default: one per core).
        threads_per_worker: threads per worker process.
        task_retries: Prefect retries of a failed shard task.
    """

    cluster: str = "local"
    workers: int | None = Field(default=None, ge=1, le=512)
    threads_per_worker: int = Field(default=1, ge=1, le=64)
    task_retries: int = Field(default=2, ge=0, le=10)
    task_retry_delay_s: float = Field(default=2.0, ge=0, le=600)


class Recipe(_Frozen):
    """A dataset recipe.

    Args:
        dataset: dataset name; the top folder under the storage root.
        kind: ``pretraining`` (caption pairs) or ``finetuning`` (conversations).
        storage: root URL, local path or ``s3://bucket/prefix``.
        storage_options: passed to fsspec (e.g. ``endpoint_url`` for S3-compatible stores).
        sources: the URL manifests.
    """

    dataset: str = Field(pattern=NAME_PATTERN)
    kind: Literal["pretraining", "finetuning"] = "pretraining"
    storage: str = Field(min_length=1)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    sources: tuple[SourceConfig, ...] = Field(min_length=1)
    download: DownloadConfig = DownloadConfig()
    validate_: ValidateConfig = Field(default=ValidateConfig(), alias="validate")
    reshard: ReshardConfig = ReshardConfig()
    precache: PrecacheConfig = PrecacheConfig()
    gates: GatesConfig = GatesConfig()
    execution: ExecutionConfig = ExecutionConfig()

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _unique_sources(self) -> "Recipe":
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique, repeated: {', '.join(dupes)}")
        return self

    def config_hash(self, *parts: BaseModel) -> str:
        """Hash of the given stage configs, for output names that change when they change."""
        blob = json.dumps([p.model_dump(mode="json") for p in parts], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def recipe_hash(self) -> str:
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def _expand_env(value: Any, where: str, path: Path) -> Any:
    """Expand ``${VAR}`` and ``${VAR:-default}`` in string values."""
    if isinstance(value, dict):
        return {k: _expand_env(v, f"{where}.{k}" if where else str(k), path) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{where}[{i}]", path) for i, v in enumerate(value)]
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise RecipeError(f"{path}: {where}: environment variable {name} is not set")

        return _ENV_REF.sub(sub, value)
    return value


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"override {dotted}: {part} is not a mapping")
    node[parts[-1]] = value


def _format_errors(path: Path | str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = e.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{path}: {loc}: {e['msg']}{got_text}")
    return "\n".join(lines)


def parse_recipe(data: Any, path: Path | str = "<recipe>", overrides: dict[str, Any] | None = None) -> Recipe:
    """Validate recipe data; relative manifest and storage paths resolve against the file's folder."""
    path = Path(path)
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    data = _expand_env(data, "", path)
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    base = path.parent if path.name != "<recipe>" else Path.cwd()
    if isinstance(data.get("storage"), str):
        data["storage"] = _resolve_local(data["storage"], base)
    for src in data.get("sources") or []:
        if isinstance(src, dict) and isinstance(src.get("manifest"), str):
            src["manifest"] = _resolve_local(src["manifest"], base)
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_errors(path, err)) from None


def _resolve_local(value: str, base: Path) -> str:
    if "://" in value or os.path.isabs(value):
        return value
    return str((base / value).resolve())


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read and validate a recipe file; ``overrides`` maps dotted keys to values."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise RecipeError(f"{path}: cannot read recipe: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{path}{where}: not valid YAML: {getattr(err, 'problem', err)}") from None
    return parse_recipe(data, path, overrides)
