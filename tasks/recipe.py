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
        name: source id, lowercase; it prefixes every sample key (``{name}-{row:09d}``; for a
            folder or pattern, ``{name}-{file tag}-{row in the file:09d}``).
        manifest: local path, http(s) URL or s3:// URL of a csv / tsv / jsonl / parquet file,
            optionally gzip-compressed (``.gz``); or a folder (``s3://bucket/prefix/``) or a
            glob / brace pattern (``data/*.parquet``, ``{a,b}/*.csv.gz``) of such files, local
            or on S3 (see tasks.manifests.list_manifest_files).
        format: ``auto`` picks the format from the file name.
        url_column, caption_column, license_column: column names in the manifest.
        extra_columns: further columns carried into each sample's json; ``["*"]`` carries all.
        rows_per_shard: manifest rows per download shard (one Prefect task each); for a
            ``parquet_images`` source, rows of a file per ingest shard.
        kind: ``manifest`` (URLs to download, the default); ``webdataset``: ``manifest`` names
            existing tar shards (a ``.tar`` file, folder, glob or brace pattern, local or S3;
            img2dataset's ``NNNNN.parquet`` side files are read for URL and status), one
            ingest shard per tar; ``parquet_images``: parquet files whose ``image_column``
            holds the image bytes (raw, or Hugging Face's ``{bytes, path}`` struct). See
            tasks/sources/.
        image_column: the image bytes column of a ``parquet_images`` source.
        id_column: a column carried into each sample's json as the row's own id
            (``parquet_images``; for ``webdataset``, a field of the sample's json).
    """

    name: str = Field(pattern=NAME_PATTERN)
    manifest: str = Field(min_length=1)
    kind: Literal["manifest", "webdataset", "parquet_images"] = "manifest"
    image_column: str = "image"
    id_column: str | None = None
    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = "auto"
    url_column: str = "url"
    caption_column: str | None = "caption"
    license_column: str | None = "license"
    extra_columns: tuple[str, ...] = ()
    rows_per_shard: int = Field(default=1000, ge=1, le=1_000_000)


class NetworkConfig(_Frozen):
    """Which URLs and addresses downloads may reach (the URL policy and SSRF guard).

    Every URL, and every redirect target, is checked before any socket opens.

    Args:
        allow_private_networks: allow every non-global address (loopback, private, link-local).
            Off by default; only for tests, demos and trusted intranets.
        allowed_networks: CIDRs allowed even though they are not global, e.g. ``127.0.0.1/32``.
        allowed_ports: ports allowed besides 80 and 443, which are always allowed. A URL
            without a port uses its scheme's default (80 for http, 443 for https). Default none.
        any_port: allow every port (1-65535). Off by default; for tests and demos whose
            loopback server listens on a random port.
        max_url_chars: longer URLs are refused as ``url_too_long``. Default 2048, the limit
            browsers and CDNs work with.
        file_root: ``file://`` URLs are allowed only under this directory (off when unset).
        s3_buckets: ``s3://`` URLs are allowed only for these buckets.
    """

    allow_private_networks: bool = False
    allowed_networks: tuple[str, ...] = ()
    allowed_ports: tuple[int, ...] = ()
    any_port: bool = False
    max_url_chars: int = Field(default=2048, ge=64, le=1_000_000)
    file_root: str | None = None
    s3_buckets: tuple[str, ...] = ()

    @field_validator("allowed_networks")
    @classmethod
    def _cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        for cidr in value:
            ipaddress.ip_network(cidr, strict=False)
        return value

    @field_validator("allowed_ports")
    @classmethod
    def _ports(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        bad = [p for p in value if not 1 <= p <= 65535]
        if bad:
            raise ValueError(f"ports must be 1-65535, got {bad}")
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
        shard_timeout_s: deadline for one shard's fetching. Rows still pending when it passes
            are recorded ``timeout`` (the detail says the shard deadline passed) and the shard
            commits. A backstop, not a pace: each request attempt has ``timeout_s`` already.
            Default 3600 s (one hour).
        network: the URL policy and SSRF guard.
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
    shard_timeout_s: float = Field(default=3600.0, gt=0, le=7 * 24 * 3600)
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
        output_format, quality: the re-encoding (from pixels, so metadata and appended
            payloads are dropped); ``quality`` is ignored for PNG.
        skip_reencode: keep the input bytes of an image that re-encoding would not change
            otherwise (img2dataset's option): not resized, already in ``output_format``, one
            frame, 8-bit RGB, not EXIF-rotated. Still decoded, checked and hashed; its
            metadata and any bytes appended after the image are kept. Default False.
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
    skip_reencode: bool = False


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


class ConversationRules(_Frozen):
    """Checks on LLaVA-style conversation records (tasks/conversations.py).

    Args:
        placeholder: the image placeholder in turn text; its count must equal the images.
        max_chars: largest total characters over all turns (``conversation_too_long``).
        max_turns: most turns per record.
        max_images: most images per record (``too_many_images``).
        image_root: folder that relative image paths resolve against (default: the records
            file's folder); they become ``file://`` URLs, so ``download.network.file_root``
            must contain it.
        license: license of the images of records that carry none (SPDX id or alias).
        max_record_bytes: a JSONL line or JSON record over this is ``unparsable_row``.
        range_bytes: a plain JSONL file is read by one task per this many bytes (a JSON array
            or a gzip file by one task).
    """

    placeholder: str = Field(default="<image>", min_length=1)
    max_chars: int = Field(default=200_000, ge=1)
    max_turns: int = Field(default=256, ge=2)
    max_images: int = Field(default=16, ge=1)
    image_root: str | None = None
    license: str | None = None
    max_record_bytes: int = Field(default=1 << 20, ge=1024)
    range_bytes: int = Field(default=128 << 20, ge=1024)


class TilingConfig(_Frozen):
    """NVLM dynamic high-resolution tiling with 1-D tile tags (tasks/tiling.py).

    Args:
        tile_size: side of a square tile, in pixels (448 in NVLM).
        min_tiles, max_tiles: bounds on rows x cols of the grid (1 and 6 in NVLM).
        thumbnail: add a global thumbnail (one more tile) when the grid has more than one tile.
        tokens_per_tile: image tokens each tile (and the thumbnail) costs (256 in NVLM).
        tile_tag: tag before tile ``i`` (1-based), formatted with ``i``.
        thumbnail_tag: tag before the thumbnail.
        image_start, image_end: delimiters around one image's tags.
        store: ``grid`` stores the image and its grid (the loader cuts tiles); ``tiles`` also
            stores every tile and the thumbnail as JPEGs.
        quality: JPEG quality of stored tiles.
        max_pixels: width x height cap read from the header before any decoding.
    """

    tile_size: int = Field(default=448, ge=14, le=4096)
    min_tiles: int = Field(default=1, ge=1, le=64)
    max_tiles: int = Field(default=6, ge=1, le=64)
    thumbnail: bool = True
    tokens_per_tile: int = Field(default=256, ge=1, le=16384)
    tile_tag: str = "<tile_{i}>"
    thumbnail_tag: str = "<tile_global_thumbnail>"
    image_start: str = "<img>"
    image_end: str = "</img>"
    store: Literal["grid", "tiles"] = "grid"
    quality: int = Field(default=90, ge=1, le=100)
    max_pixels: int = Field(default=50_000_000, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> "TilingConfig":
        if self.min_tiles > self.max_tiles:
            raise ValueError("min_tiles must not exceed max_tiles")
        return self


class TokensConfig(_Frozen):
    """How tokens are counted (tasks/tokens.py).

    Args:
        tokenizer: local directory of a Hugging Face tokenizer (``tokenizer.json`` or a
            ``save_pretrained`` folder); never downloaded. Unset: the approximate counter.
        chars_per_token: the approximate counter's UTF-8 bytes per token.
        turn_overhead: tokens each turn adds for its role header and end marker.
        tags_are_special: tile tags and image delimiters are single special tokens (added to
            the tokenizer, as NVLM does), not text split into pieces.
    """

    tokenizer: str | None = None
    chars_per_token: float = Field(default=4.0, gt=0, le=64)
    turn_overhead: int = Field(default=4, ge=0, le=64)
    tags_are_special: bool = True


class PaddingConfig(_Frozen):
    """Constrained padding: the longest sample allowed (tasks/packing.py).

    Args:
        cutoff: ``percentile`` takes that percentile of the accepted samples' token counts
            (capped by ``max_tokens``); ``fixed`` uses ``max_tokens``.
        percentile: for ``cutoff: percentile``.
        max_tokens: the fixed cut-off, and the cap of the percentile one; never above the
            packing budget.
        policy: ``drop`` rejects longer samples (``sample_too_long``); ``truncate`` keeps
            the longest prefix of whole human/assistant exchanges that fits, and drops the
            sample when not even the first exchange fits.
    """

    cutoff: Literal["fixed", "percentile"] = "percentile"
    percentile: float = Field(default=99.0, gt=0, le=100)
    max_tokens: int = Field(default=8192, ge=1)
    policy: Literal["drop", "truncate"] = "truncate"


class PackingConfig(_Frozen):
    """Multimodal packing under a token budget and per-pack image and tile caps.

    Args:
        packed: write packs (one WebDataset sample per pack); off writes one sample per record.
        algorithm: ``balanced_greedy`` (longest first into the least-loaded pack that fits
            both limits) or ``ffd`` (first-fit decreasing).
        budget: tokens per pack (text + image tokens).
        max_images: images per pack.
        max_tiles: tiles (thumbnails included) per pack; unset: no cap.
        compare_batch_size: batch size of the pad-to-longest baseline the report compares with.
    """

    packed: bool = True
    algorithm: Literal["balanced_greedy", "ffd"] = "balanced_greedy"
    budget: int = Field(default=8192, ge=16)
    max_images: int = Field(default=16, ge=1)
    max_tiles: int | None = Field(default=None, ge=1)
    compare_batch_size: int = Field(default=8, ge=1)


class FinetuneConfig(_Frozen):
    """The fine-tuning dataset's stages (``kind: finetuning``).

    Args:
        conversation: record and conversation checks.
        tiling: dynamic high-resolution tiling and tile tags.
        tokens: token counting.
        padding: constrained padding cut-off and policy.
        packing: packing under a token budget.
        text_only_ratio: share of text-only records among accepted samples; surplus text-only
            records (chosen by a hash of their key) are rejected as ``text_only_over_ratio``.
            Unset keeps them all.
    """

    conversation: ConversationRules = ConversationRules()
    tiling: TilingConfig = TilingConfig()
    tokens: TokensConfig = TokensConfig()
    padding: PaddingConfig = PaddingConfig()
    packing: PackingConfig = PackingConfig()
    text_only_ratio: float | None = Field(default=None, ge=0, lt=1)


class FinetuneGate(_Frozen):
    """Thresholds of the fine-tuning gate (conversations and packs).

    Args:
        min_samples: accepted samples at least this.
        max_reject_rate: records not accepted / records at most this.
        min_fill_ratio: useful tokens / (packs x budget) at least this (packed releases).
        min_text_only_ratio, max_text_only_ratio: bounds on text-only samples / accepted.
    """

    min_samples: int = Field(default=1, ge=1)
    max_reject_rate: float = Field(default=0.5, ge=0, le=1)
    min_fill_ratio: float = Field(default=0.9, ge=0, le=1)
    min_text_only_ratio: float = Field(default=0.0, ge=0, le=1)
    max_text_only_ratio: float = Field(default=1.0, ge=0, le=1)


class GatesConfig(_Frozen):
    """One gate per phase; a failed gate stops the flow and still writes its report."""

    download: DownloadGate = DownloadGate()
    validate_: ValidateGate = Field(default=ValidateGate(), alias="validate")
    precache: PrecacheGate = PrecacheGate()
    finetune: FinetuneGate = FinetuneGate()

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
        storage_options: passed to fsspec (e.g. ``endpoint_url`` for S3-compatible stores),
            except ``file_mode``: the mode of local files written (default ``0644``, folders
            ``0755``; stricter such as ``0640`` or ``0600``; see ``tasks.storage.file_modes``).
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
    finetune: FinetuneConfig = FinetuneConfig()
    gates: GatesConfig = GatesConfig()
    execution: ExecutionConfig = ExecutionConfig()

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @field_validator("storage_options")
    @classmethod
    def _file_mode(cls, v: dict[str, Any]) -> dict[str, Any]:
        from tasks.storage import FILE_MODE_OPTION, file_modes

        file_modes(v.get(FILE_MODE_OPTION))  # raises ValueError naming the setting
        return v

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
        """Hash of what the recipe says the dataset is: where and how it runs (``execution``,
        ``storage``, ``storage_options`` with their credentials and file modes) is left out, so
        moving the store or adding workers makes no new release."""
        blob = json.dumps(self.model_dump(mode="json", exclude={"execution", "storage", "storage_options"}), sort_keys=True)
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
    """Validate recipe data; relative manifest, storage and model paths resolve against the file's folder."""
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
    pre = data.get("precache")
    if isinstance(pre, dict):
        for stage, keys in (("image_latents", ("model",)), ("text", ("model", "tokenizer")), ("vision", ("model",))):
            cfg = pre.get(stage)
            for key in keys if isinstance(cfg, dict) else ():
                if isinstance(cfg.get(key), str):
                    cfg[key] = _resolve_local(cfg[key], base)
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
