"""The validation stage: license, caption and content checks per shard, then dedup across the dataset."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import Counter
from dataclasses import replace
from functools import partial
from typing import Any

import pyarrow as pa

from tasks.formats.ledger import PRIVACY_FACTS, VIDEO_FACTS, LedgerRow, read_ledger, write_parquet
from tasks.formats.manifests import chunk_name
from tasks.formats.names import digest_of
from tasks.formats.reasons import OK
from tasks.formats.recipe_download import ValidateConfig
from tasks.formats.shards import iter_samples
from tasks.formats.spooled import Payload
from tasks.formats.storage import Storage
from tasks.formats.tar_format import DEFAULT_MAX_MEMBER_BYTES
from tasks.formats.tar_reader import ShardError
from tasks.policies.captions import caption_verdict
from tasks.policies.images import process_image
from tasks.policies.licenses import license_verdict
from tasks.policies.metadata import Screen
from tasks.policies.personal import masked
from tasks.policies.privacy import FieldsOutcome, TextOutcome, check_fields, check_text, record_text
from tasks.policies.ruling import Ruling
from tasks.policies.sniff import EXTENSIONS, VIDEO_FORMATS
from tasks.stages.dedup import DEDUP_COLUMNS, duplicates_by_table, final_paths, finalize_shard, find_duplicates
from tasks.stages.privacy import FACE_PRESENT, clip_faces, face_look, hides_faces, shown_blurred
from tasks.stages.runner import DECIDE_FAILED, ShardResult, Verdict, failure_detail, run_shard

# Dedup lives in tasks/stages/dedup.py; named here too, where the flows and tests import it.
__all__ = ["DEDUP_COLUMNS", "duplicates_by_table", "final_paths", "finalize_shard", "find_duplicates"]

IMAGE_EXTS = frozenset(EXTENSIONS.values()) | {"jpeg", "tif"}
# Thumbnails of a few rejected samples per reason, for the audit report, beside the ledger.
THUMBS_SCHEMA = pa.schema([("key", pa.string()), ("thumbnail", pa.binary())])
THUMBNAILS_PER_REASON = 3
# Accepted samples whose faces were blurred keep a few thumbnails too, under this name.
BLURRED = "blurred"
# Threads that decode and re-encode images in one task: Pillow releases the GIL while it
# decodes, resizes and encodes, so they overlap each other and the fetches of a fused task.
DECODE_THREADS = max(
    1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
)

# Pass 1 of one shard: accepted candidates (before dedup) and every input's verdict. Its
# ledger (``table``) is a LEDGER_SCHEMA ledger: a shard whose candidates dedup leaves alone is
# final as it is, with no second copy.
CandidateResult = ShardResult


def stage_hash(*parts: Any) -> str:
    return digest_of(*parts)


def candidate_config_hash(recipe: Any) -> str:
    """Hash of the validation settings that change what a candidate shard holds (dedup decides later)."""
    cfg = recipe.validate_
    # The video rules only where there are videos: a recipe without them keeps its names.
    return recipe.config_hash(
        cfg.license, cfg.image, cfg.caption, cfg.privacy, *([cfg.video] if recipe.has_video else [])
    )


def candidate_paths(dataset: str, source: str, index: int, download_tar: str, config_hash: str) -> tuple[str, str]:
    """(tar, ledger) of a download shard's candidates, named by that shard and the config."""
    digest = stage_hash(download_tar, config_hash)
    stem = f"{dataset}/validate/candidates/{source}/{chunk_name(index)}-{digest}"
    return stem + ".tar", stem + ".ledger.parquet"


def thumbs_path(ledger_rel: str) -> str:
    """Where a candidate ledger's thumbnails are (written before it, only when there are any)."""
    return ledger_rel[: -len(".ledger.parquet")] + ".thumbs.parquet"


# A sample to judge: its key, members, and its download ledger row (source, row, url, origin).
Item = tuple[str, dict[str, bytes], dict[str, Any]]


class Judge:
    """One sample's verdict (license, caption, image), safe to call from several threads.

    Keeps the thumbnails of a few rejected samples per reason, for the audit report.

    Args:
        cfg: the recipe's validation config.
        thumbnails_per_reason: rejected samples per reason that get a thumbnail for the report.
    """

    def __init__(self, cfg: ValidateConfig, thumbnails_per_reason: int = THUMBNAILS_PER_REASON):
        self.cfg = cfg
        self.look = face_look(cfg.privacy)  # the face check, where the recipe asks for one
        self.limit = thumbnails_per_reason
        self.thumbs: list[tuple[str, bytes]] = []
        self._taken: Counter[str] = Counter()
        self._lock = threading.Lock()

    def want_thumbnail(self, reason: str) -> bool:
        with self._lock:
            return self._taken[reason] < self.limit

    def took_thumbnail(self, reason: str) -> bool:
        """Count one thumbnail for ``reason``; False when the cap was reached meanwhile."""
        with self._lock:
            if self._taken[reason] >= self.limit:
                return False
            self._taken[reason] += 1
            return True

    def __call__(self, item: Item) -> Verdict | list[Verdict]:
        key, members, down = item
        video = next((ext for ext in members if ext in VIDEO_FORMATS), None)
        if video is not None:  # a video source's sample: its clips
            return _judge_video(key, members, down, self, video)
        row, out, thumbnail = _judge(key, members, down, self)
        if thumbnail is not None:
            self.keep_thumbnail(key, thumbnail)
        return Verdict(row, out)

    def keep_thumbnail(self, key: str, thumbnail: bytes) -> None:
        with self._lock:
            self.thumbs.append((key, thumbnail))

    def run(
        self, storage: Storage, tar_rel: str, ledger_rel: str, items: Any, source: str, index: int, **kw: Any
    ) -> ShardResult:
        """Judge ``items()`` into the candidate shard ``tar_rel``; its thumbnails, then its ledger, commit it."""
        return run_shard(
            storage,
            tar_rel,
            ledger_rel,
            items,
            self,
            source=source,
            index=index,
            failed=failed_row,
            threads=DECODE_THREADS,
            before_commit=lambda: self.write_thumbs(storage, ledger_rel),
            **kw,
        )

    def write_thumbs(self, storage: Storage, ledger_rel: str) -> None:
        if self.thumbs:
            keys, blobs = zip(*sorted(self.thumbs))
            table = pa.table([list(keys), list(blobs)], schema=THUMBS_SCHEMA)
            write_parquet(storage, thumbs_path(ledger_rel), table)


def failed_row(item: Item, err: Exception) -> dict[str, Any]:
    """The ledger row of a sample whose judging raised: an error, the exception in its detail."""
    key, _, down = item
    detail = f"judging the sample: {failure_detail(err)}"
    return _base_row(key, down, None, TextOutcome(None), DECIDE_FAILED, detail)


def validate_shard(
    storage: Storage,
    source: str,
    index: int,
    download_tar: str,
    download_ledger: str,
    cfg: ValidateConfig,
    tar_rel: str,
    table_rel: str,
    thumbnails_per_reason: int = THUMBNAILS_PER_REASON,
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
) -> ShardResult:
    """Judge every sample of one download shard; write the accepted ones, re-encoded.

    ``max_member_bytes``: the download's body cap (``download.max_bytes``, a video source's
    ``video_max_bytes``). Video members are spilled to local files as they are read, so a
    video is never held whole in memory (:class:`SpooledBody`).

    The candidate ledger has a row for every sample the download accepted (the inputs of this
    phase), with its verdict, the normalised license, image size and the dedup hashes. It is
    written last and commits the shard. Samples are judged on a few threads while the tar is
    read.
    """
    expected: dict[str, dict[str, Any]] = {}

    def samples() -> Any:
        expected.update((r["key"], r) for r in read_ledger(storage, download_ledger).to_pylist() if r["status"] == OK)
        with storage.open(download_tar, "rb") as src:
            for sample in iter_samples(
                src, path=storage.url(download_tar), max_member_bytes=max_member_bytes, spill=_is_video
            ):
                down = expected.pop(sample.key, None)
                if down is None:
                    raise ShardError(
                        "tar_unexpected_sample",
                        storage.url(download_tar),
                        sample.key,
                        "sample has no ok row in the download ledger",
                    )
                yield sample.key, sample.members, down

    def all_there(_: Any) -> None:
        if expected:
            missing = ", ".join(sorted(expected)[:5])
            raise ShardError(
                "tar_missing_sample",
                storage.url(download_tar),
                None,
                f"{len(expected)} ok ledger rows have no sample in the tar: {missing}",
            )

    judge = Judge(cfg, thumbnails_per_reason)
    return judge.run(storage, tar_rel, table_rel, samples, source, index, check=all_there)


def _is_video(name: str) -> bool:
    return name.rpartition(".")[2] in VIDEO_FORMATS


def _text_checks(
    members: dict[str, Payload], down: dict[str, Any], cfg: ValidateConfig, written: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str | None, TextOutcome, str | None, str | None]:
    """The sample's json, normalised license, the caption's privacy outcome (its cleaned and
    checked text), and the first refusal (reason, detail): the license is judged first, its
    refusal is the row's whatever the caption; then the caption's rules, then its personal data,
    then the json's other fields' (``check_fields``: the json returned is as it left it).
    ``written``: the json member already parsed (``check_fields`` leaves it as it is)."""
    meta = written if written is not None else json.loads(members.get("json", b"{}"))
    licensed = license_verdict(meta.get("license"), down["source"], cfg.license)
    captioned = caption_verdict(
        meta.get("caption", members.get("txt", b"").decode("utf-8", "replace") or None), cfg.caption
    )
    if not licensed.ok or not captioned.ok:
        first = licensed if not licensed.ok else captioned
        detail = first.detail
        if meta.get("json_unread") and first.reason in ("license_missing", "caption_missing"):
            detail = f"{detail}; the sample's json member was not read: {masked(str(meta['json_unread']))}"
        return meta, licensed.value, TextOutcome(captioned.value), first.reason, detail
    private = check_text(captioned.value, cfg.privacy.text)
    if private.reason is not None:
        return meta, licensed.value, private, private.reason, private.detail
    # the json's other text (extra columns, an ingested shard's own json) and metadata copies
    fields = check_fields(meta, cfg.privacy.text)
    private = replace(private, fields=fields)
    return fields.meta, licensed.value, private, fields.reason, fields.detail


def _base_row(key: str, down: dict[str, Any], spdx: str | None, text: TextOutcome, reason, detail) -> dict[str, Any]:
    row = LedgerRow(
        key=key,
        source=down["source"],
        row=down["row"],
        reason=reason,
        url=down["url"],
        detail=detail,
        license=spdx,
        caption_chars=len(text.text) if text.text else None,
        origin=down.get("origin"),
    ).as_dict()
    row.update(dict.fromkeys(PRIVACY_FACTS))
    row.update(personal_data=text.kinds if text.scanned else None)
    return row


def _judge_video(key: str, members: dict[str, Payload], down: dict[str, Any], judge: Judge, ext: str) -> list[Verdict]:
    """A video's clips as samples (tasks/video/samples.py), or its one refused row; a few
    refused clips per reason leave their keyframe as the report's thumbnail."""
    cfg = judge.cfg
    written = json.loads(members.get("json", b"{}"))  # the time spans are read from it as written
    meta, spdx, text, reason, detail = _text_checks(members, down, cfg, written)
    caption = text.text
    # A video's rows carry its facts (nulls until probed), so a video source's ledger has them
    # even where every video was refused before its probe (tasks.formats.ledger.widened).
    row = {**_base_row(key, down, spdx, text, reason, detail), **dict.fromkeys(VIDEO_FACTS)}
    if reason is not None:
        return [Verdict(row)]
    record_text(row, meta, text)
    from tasks.video.samples import judge_video

    clean = partial(_checked_caption, cfg=cfg, fields=text.fields)
    verdicts = []
    for r, m, keyframe in judge_video(
        key,
        members[ext],
        meta,
        row,
        cfg.video,
        caption,
        clean,
        min_side=cfg.image.min_side,
        max_aspect=cfg.image.max_aspect_ratio,
        look=partial(clip_faces, judge.look) if judge.look is not None else None,
        look_frames=cfg.privacy.faces.clip_frames,
        spans_from=written,  # the spans as written, not as the json's check left them
    ):
        # Counted per reason without its payload (duplicate_of:<clip key>).
        if keyframe is not None and r["reason"] is not None and judge.took_thumbnail(r["reason"].split(":", 1)[0]):
            # a clip refused for its faces shows them blurred already; others are looked at now
            judge.keep_thumbnail(
                r["key"], keyframe if r["reason"] == FACE_PRESENT else shown_blurred(judge.look, keyframe)
            )
        verdicts.append(Verdict(r, m))
    return verdicts


def _exif_screen(cfg: ValidateConfig, found: list[tuple[str, TextOutcome]]) -> Screen | None:
    """What the EXIF fields a recipe keeps (``privacy.metadata.keep``) go through: the text
    rules, as the caption's. A field is written redacted under ``redact``, as it is under
    ``record``; under ``reject`` the sample is refused (``found`` holds each check)."""
    if not cfg.privacy.metadata.keep or cfg.privacy.text.mode == "off":
        return None

    def screen(name: str, value: str) -> str | None:
        got = check_text(value, cfg.privacy.text, f"exif:{name}")
        found.append((f"exif:{name}", got))
        return None if got.reason is not None else got.text

    return screen


def _checked_caption(text: str | None, cfg: ValidateConfig, fields: FieldsOutcome | None) -> Ruling[TextOutcome]:
    """A clip's own caption (its span's) under the caption rules, then the privacy check: the
    outcome, redacted or refused as the sample's caption is (the clip records it as its own,
    with its video's ``fields``)."""
    ruled = caption_verdict(text, cfg.caption)
    if not ruled.ok:
        return Ruling(TextOutcome(ruled.value, fields=fields), ruled.reason, ruled.detail)
    private = replace(check_text(ruled.value, cfg.privacy.text), fields=fields)
    return Ruling(private, private.reason, private.detail)


def _judge(
    key: str, members: dict[str, Payload], down: dict[str, Any], judge: Judge
) -> tuple[dict[str, Any], dict[str, bytes] | None, bytes | None]:
    """One sample's (ledger row, re-encoded members or None, thumbnail or None).

    Cheap checks (license, caption) come before decoding the image.
    """
    cfg = judge.cfg
    meta, spdx, text, reason, detail = _text_checks(members, down, cfg)
    caption = text.text
    image_ext = next((ext for ext in members if ext in IMAGE_EXTS), None)
    if reason is None and image_ext is None:
        reason, detail = "not_an_image", f"no image member in the sample (members: {', '.join(sorted(members))})"
    want_thumb = reason is not None and judge.want_thumbnail(reason)
    outcome = None
    if image_ext is not None and (reason is None or want_thumb):
        # Thumbnails only for the few rejected samples the report shows; an image the rules
        # reject is decoded once more for its thumbnail (rare, and capped per reason).
        # A sample refused before its image is looked at for faces only where its thumbnail
        # must not show them (faces blur or reject: hides_faces).
        kept_text: list[tuple[str, TextOutcome]] = []  # the kept EXIF fields' text, as checked
        screen = _exif_screen(cfg, kept_text) if reason is None else None
        image = partial(
            process_image, members[image_ext], cfg.image, keep_exif=cfg.privacy.metadata.keep, exif_screen=screen
        )
        checked = reason is None  # its faces are looked for as released (else for a thumbnail only)
        look = judge.look if checked else hides_faces(judge.look)
        outcome = image(thumbnail=want_thumb, look=look)
        if kept_text and text.fields is not None:  # recorded with the json's fields, as "exif:Artist"
            found = tuple((where, s) for where, got in kept_text for s in got.spans)
            redacted = text.fields.redacted or any(got.redacted for _, got in kept_text)
            text = replace(text, fields=replace(text.fields, spans=text.fields.spans + found, redacted=redacted))
        refused = next((got for _, got in kept_text if got.reason is not None), None)
        if outcome.reason is None and refused is not None:
            outcome = replace(outcome, reason=refused.reason, detail=refused.detail, data=None)
        if reason is None and outcome.reason is not None:
            reason, detail = outcome.reason, outcome.detail
            want_thumb = judge.want_thumbnail(reason)
            if want_thumb:
                outcome = image(thumbnail=True, look=hides_faces(look))
        elif reason is None:
            detail = outcome.detail  # a note on an accepted image (its size), if any
    row = _base_row(key, down, spdx, text, reason, detail)
    thumbnail = None
    if outcome is not None:
        row.update(
            format=outcome.src_format,
            pixel_sha256=outcome.pixel_sha256,
            phash=outcome.phash,
            width=outcome.width,
            height=outcome.height,
        )
        if outcome.facts is not None and checked:  # a thumbnail's look is not the sample's check
            row["faces"] = outcome.facts.get("faces_found", 0)
        if reason is not None and want_thumb and outcome.thumbnail and judge.took_thumbnail(reason):
            thumbnail = outcome.thumbnail
    if reason is not None:
        return row, None, thumbnail
    meta.update(
        caption=caption,
        license=spdx,
        license_raw=meta.get("license"),
        width=outcome.width,
        height=outcome.height,
        orig_width=outcome.orig_width,
        orig_height=outcome.orig_height,
        src_format=outcome.src_format,
        src_sha256=meta.get("sha256"),
        pixel_sha256=outcome.pixel_sha256,
        phash=f"{outcome.phash:016x}",
        format=outcome.ext,
        bytes=len(outcome.data),
        sha256=hashlib.sha256(outcome.data).hexdigest(),
    )
    done = [*(["blurred"] if outcome.changed else []), *(["metadata"] if outcome.metadata_removed else [])]
    if outcome.facts is not None:
        meta.update(
            faces=outcome.facts["faces"],
            faces_found=outcome.facts["faces_found"],
            faces_blurred=outcome.changed,
            faces_min_size=outcome.facts["faces_min_size"],
        )
    if outcome.metadata_removed:
        meta["metadata_removed"] = list(outcome.metadata_removed)
    row.update(bytes=len(outcome.data), sha256=meta["sha256"], privacy=",".join(done) or None)
    record_text(row, meta, text)
    out = {outcome.ext: outcome.data, "json": json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")}
    if caption is not None:
        out["txt"] = caption.encode("utf-8")
    # Thumbnails of accepted samples are kept only for the few blurred ones the report shows.
    if outcome.changed and outcome.thumbnail and judge.took_thumbnail(BLURRED):
        return row, out, outcome.thumbnail
    return row, out, None
