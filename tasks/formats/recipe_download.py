"""Recipe models of the download and validate phases: sources, network, licenses, image and caption rules."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tasks.formats.recipe_base import NAME_PATTERN, Frozen
from tasks.formats.recipe_privacy import PrivacyConfig
from tasks.formats.recipe_upkeep import Recheck, RetryFailed
from tasks.formats.recipe_video import ClipConfig, VideoLimits


class VideoRules(VideoLimits):
    """A video source's header limits (see ``VideoLimits``) and its clips (``clips``: see ``ClipConfig``)."""

    clips: ClipConfig = ClipConfig()


class SourceConfig(Frozen):
    """One URL manifest.

    Args:
        name: source id, lowercase; it prefixes every sample key (``{name}-{row:09d}``; for a
            folder or pattern, ``{name}-{file tag}-{row in the file:09d}``).
        manifest: local path, http(s) URL or s3:// URL of a csv / tsv / jsonl / parquet file,
            optionally gzip-compressed (``.gz``); or a folder (``s3://bucket/prefix/``) or a
            glob / brace pattern (``data/*.parquet``, ``{a,b}/*.csv.gz``) of such files, local
            or on S3 (see tasks.formats.manifests.list_manifest_files).
        format: ``auto`` picks the format from the file name.
        url_column, caption_column, license_column: column names in the manifest.
        extra_columns: further columns carried into each sample's json; ``["*"]`` carries all.
        rows_per_shard: manifest rows per download shard (one Prefect task each); for a
            ``parquet_images`` source, rows of a file per ingest shard.
        kind: ``manifest`` (URLs to download, the default); ``webdataset``: ``manifest`` names
            existing tar shards (a ``.tar`` file, folder, glob or brace pattern, local or S3;
            img2dataset's ``NNNNN.parquet`` side files are read for URL and status), one
            ingest shard per tar; ``parquet_images``: parquet files whose ``image_column``
            holds the image bytes (raw, or Hugging Face's ``{bytes, path}`` struct); ``files``:
            ``manifest`` names a folder, glob or ``s3://`` prefix of video files (``media:
            video``), each one row, captioned by a ``.txt`` (or a ``.json``'s ``caption``,
            ``license``, ``url``) of the same name beside it. See tasks/sources/.
        image_column: the image bytes column of a ``parquet_images`` source.
        id_column: a column carried into each sample's json as the row's own id
            (``parquet_images``; for ``webdataset``, a field of the sample's json).
        media: ``image`` (default) or ``video``: the rows are videos (mp4, webm, mkv), fetched
            under ``download.video_max_bytes``, probed and cut into clips by
            ``validate.video`` (tasks/video/); every clip becomes a sample.
    """

    name: str = Field(pattern=NAME_PATTERN)
    manifest: str = Field(min_length=1)
    kind: Literal["manifest", "webdataset", "parquet_images", "files"] = "manifest"
    media: Literal["image", "video"] = "image"
    image_column: str = "image"
    id_column: str | None = None
    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = "auto"
    url_column: str = "url"
    caption_column: str | None = "caption"
    license_column: str | None = "license"
    extra_columns: tuple[str, ...] = ()
    rows_per_shard: int = Field(default=1000, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _files_are_videos(self) -> SourceConfig:
        if self.kind == "files" and self.media != "video":
            raise ValueError("kind: files takes folders of videos (media: video); images come in manifests or shards")
        return self


class NetworkConfig(Frozen):
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


class DownloadConfig(Frozen):
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
        respect_tdmrep: honour TDM-Rep (the W3C TDM Reservation Protocol): a ``tdm-reservation: 1``
            response header, or a rule of the origin's ``/.well-known/tdmrep.json`` (read once per
            origin per shard), rejects a row as ``opted_out``, the detail naming the policy. Default on.
        allowed_formats: image formats sniffed from the bytes that are kept (a video source
            keeps ``validate.video.containers``).
        video_max_bytes: the body cap of a video source's rows. Default 512 MiB.
        video_max_inflight: concurrent requests per shard of a video source (each body is held
            until it is cut into clips, so this bounds a worker's memory). Default 4.
        video_min_bytes_per_s, video_min_rate_after_s: a video body (streamed to disk, with no
            deadline for the whole of it: ``timeout_s`` bounds each wait for bytes) that averages
            less than this rate once that many seconds have passed ends as ``timeout``; 0 turns
            it off. Default 32 KiB/s after 30 s.
        shard_timeout_s: deadline for one shard's fetching. Rows still pending when it passes
            are recorded ``timeout`` (the detail says the shard deadline passed) and the shard
            commits. A backstop, not a pace: each request attempt has ``timeout_s`` already.
            Default 3600 s (one hour).
        network: the URL policy and SSRF guard.
        keep_raw: keep each chunk's raw shard (the bytes as fetched) beside its validated
            candidates, so that new validation settings judge the kept bytes again instead of
            fetching them. ``False`` keeps only the download ledger (every row's fetch outcome,
            size and sha256) and the candidates: no second copy of every image (the raw shards
            are most of a dataset's bytes), and less disk traffic. New validation settings then
            fetch the rows again, except for chunks already downloaded with their raw shard.
            The download phase cannot run alone then (it would keep nothing).
        retry_failed: rows that failed for a passing reason are fetched again by later runs
            (see ``RetryFailed``).
        recheck: released rows are checked again by later runs (see ``Recheck``).
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
    respect_tdmrep: bool = True
    allowed_formats: tuple[str, ...] = ("jpeg", "png", "webp", "gif", "bmp", "tiff")
    video_max_bytes: int = Field(default=512 * 1024 * 1024, ge=1024)
    video_max_inflight: int = Field(default=4, ge=1, le=64)
    video_min_bytes_per_s: float = Field(default=32 * 1024, ge=0)
    video_min_rate_after_s: float = Field(default=30.0, ge=0, le=24 * 3600)
    shard_timeout_s: float = Field(default=3600.0, gt=0, le=7 * 24 * 3600)
    network: NetworkConfig = NetworkConfig()
    keep_raw: bool = True
    retry_failed: RetryFailed = RetryFailed()
    recheck: Recheck = Recheck()


class LicenseReview(Frozen):
    """Who checked the sources' terms, and when. A release without one is blocked by the gate.

    Args:
        reviewed_by: a person or team.
        reviewed_on: date of the review (YYYY-MM-DD).
        notes: what was checked, links to the terms.
    """

    reviewed_by: str = Field(min_length=1)
    reviewed_on: dt.date
    notes: str = ""


class LicensePolicy(Frozen):
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


class ImageRules(Frozen):
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
            metadata segments and any bytes appended after the image are removed without
            touching the pixels (``privacy.metadata``). Default False.
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


class CaptionRules(Frozen):
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


class DedupConfig(Frozen):
    """Deduplication across the whole dataset; the first sample by (source, row) wins.

    Args:
        exact: sha256 of the normalised pixels.
        near: 64-bit perceptual hash (DCT pHash) within ``hamming_threshold`` bits.
    """

    exact: bool = True
    near: bool = True
    hamming_threshold: int = Field(default=4, ge=0, le=16)


class ValidateConfig(Frozen):
    """The validation phase: license, content and dedup.

    Args:
        license: the license policy.
        image: decoding limits, normalisation, resize and image rules.
        caption: caption cleanup and rules.
        dedup: exact and near-duplicate detection.
        video: what a video source's videos may declare (probed from their headers before a
            frame is decoded) and how they are cut into clips (``video.clips``).
        privacy: the recipe's top-level ``privacy:`` block, which the recipe copies here so that
            every stage judging samples has it; not written under ``validate:``.
    """

    license: LicensePolicy = LicensePolicy()
    image: ImageRules = ImageRules()
    caption: CaptionRules = CaptionRules()
    dedup: DedupConfig = DedupConfig()
    video: VideoRules = VideoRules()
    privacy: PrivacyConfig = PrivacyConfig()
