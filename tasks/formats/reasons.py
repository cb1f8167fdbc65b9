"""The stable reasons a ledger row can carry, with the status each implies."""

from __future__ import annotations

from tasks.formats.tar_format import SHARD_ERROR_REASONS

OK = "ok"
REJECTED = "rejected"
ERROR = "error"
STATUSES = (OK, REJECTED, ERROR)

# reason -> (status, what it means). Reasons are snake_case and never change meaning;
# http_<code> is the only family (bounded by the set of HTTP status codes).
REASONS: dict[str, tuple[str, str]] = {
    # manifest rows
    "unparsable_row": (REJECTED, "the manifest line could not be parsed (bad JSON, wrong field count)"),
    "missing_url": (REJECTED, "the row has no URL"),
    "invalid_url": (
        REJECTED,
        "the URL cannot be parsed, has no host, or a malformed host name (a label over 63 or a name over 253 characters, a character not valid in a host, bad IDNA); the detail says which",
    ),
    "unsupported_scheme": (REJECTED, "the URL scheme is not http, https, file or s3"),
    # manifest values (tasks/formats/manifests/values.py)
    "wrong_type": (
        REJECTED,
        "a list or object where the url, caption or license string belongs (JSON array/object, parquet list/struct/map), or an image column value that is neither bytes nor a {bytes, path} struct; never coerced, the detail names the column",
    ),
    # network policy (SSRF guard)
    "blocked_address": (
        REJECTED,
        "the host is or resolves to a loopback, private, link-local or other non-global address (the detail names it)",
    ),
    "credentials_in_url": (
        REJECTED,
        "the URL carries a user name or password (user:secret@host); refused, so they are never sent",
    ),
    "port_not_allowed": (
        REJECTED,
        "the URL's port (explicit, or its scheme's default) is not 80, 443 or in download.network.allowed_ports",
    ),
    "url_too_long": (REJECTED, "the URL is longer than download.network.max_url_chars"),
    "blocked_scheme": (
        REJECTED,
        "file:// or s3:// URL not allowed by the recipe (no file_root, bucket not listed, or outside the root)",
    ),
    "too_many_redirects": (REJECTED, "more redirect hops than download.max_redirects"),
    "robots_disallowed": (REJECTED, "robots.txt disallows our user agent for this path"),
    "opted_out": (
        REJECTED,
        "the site opted out of AI/TDM use: X-Robots-Tag carries an opt-out directive (noai, noimageai, noml, ...), or TDM-Rep reserves the rights (the tdm-reservation header, or the origin's /.well-known/tdmrep.json; the detail names the policy when one is given); at a recheck, robots.txt now disallowing the path too",
    ),
    # payload
    "too_large": (REJECTED, "the body exceeded download.max_bytes"),
    "empty_body": (REJECTED, "the server sent no bytes"),
    "not_an_image": (REJECTED, "the bytes are not a known image format (sniffed, not trusted from headers)"),
    "format_not_allowed": (
        REJECTED,
        "an image format not in download.allowed_formats / validate.image.allowed_formats",
    ),
    "truncated_image": (REJECTED, "the image ends before its format's end marker, or the decoder runs out of data"),
    # fetch failures
    "timeout": (
        ERROR,
        "the request did not complete within download.timeout_s, or the shard's download.shard_timeout_s passed first (the detail says which)",
    ),
    "connection_error": (ERROR, "connection refused, reset or closed early"),
    "dns_error": (ERROR, "the host name does not resolve"),
    "tls_error": (ERROR, "the TLS handshake failed"),
    "rate_limited": (ERROR, "429 with a Retry-After longer than download.max_retry_after_s"),
    "read_error": (ERROR, "a file:// or s3:// source could not be read"),
    "fetch_failed": (
        ERROR,
        "an unexpected exception while fetching or judging the row (the detail names it); the other rows go on",
    ),
    # content (tasks/policies/images.py)
    "file_too_small": (REJECTED, "the downloaded file is smaller than validate.image.min_bytes"),
    "file_too_large": (REJECTED, "the downloaded file is larger than validate.image.max_bytes"),
    "decompression_bomb": (
        REJECTED,
        "width x height in the header (or of the resize target) exceeds validate.image.max_pixels, or Pillow's own bomb limit; never decoded",
    ),
    "unsupported_image_mode": (
        REJECTED,
        "decoded, but the pixel mode has no defined 8-bit RGB conversion (float, signed or 32-bit samples)",
    ),
    "undecodable_image": (REJECTED, "the decoder failed on the bytes, or no decoder for the format"),
    "animated_image": (REJECTED, "an animated image while validate.image.animated is reject"),
    "image_too_small": (REJECTED, "the short side is below validate.image.min_side"),
    "aspect_ratio": (
        REJECTED,
        "long side / short side (of an image, or of a video's clips, from its declared size) is above validate.image.max_aspect_ratio",
    ),
    # video (tasks/video/probe.py): all from the container's headers, before a frame is decoded
    "not_a_video": (
        REJECTED,
        "the bytes are no video container shardsmith reads (sniffed, whatever the name or Content-Type says: an image named .mp4 is this); the detail names what they are",
    ),
    "video_unsupported_container": (REJECTED, "a container outside validate.video.containers (the detail names it)"),
    "video_unsupported_codec": (
        REJECTED,
        "the video stream's codec is outside validate.video.codecs (the detail names it)",
    ),
    "video_no_video_stream": (REJECTED, "the container holds no video stream (audio only, subtitles only, or none)"),
    "video_too_many_streams": (REJECTED, "more streams than validate.video.max_streams are declared"),
    "video_too_large": (
        REJECTED,
        "declared width x height over validate.video.max_width, max_height or max_pixels; never decoded",
    ),
    "video_too_long": (
        REJECTED,
        "declared duration over validate.video.max_duration_s, or declared frames over validate.video.max_frames; never decoded",
    ),
    "video_too_small": (
        REJECTED,
        "the clips' short side (declared width x height, scaled to validate.video.clips.max_side) is below validate.image.min_side, which the validation gate holds every sample to; never decoded",
    ),
    "video_too_short": (REJECTED, "declared duration below validate.video.min_duration_s (zero, or none declared)"),
    "video_truncated": (
        REJECTED,
        "the container's index is missing (an mp4 without moov) or fewer frames are present than it declares (a cut download)",
    ),
    "undecodable_video": (REJECTED, "the demuxer or the decoder failed on the bytes (the detail says how)"),
    "bad_segments": (
        REJECTED,
        "validate.video.clips.split is captions and the row's segments field is missing or not a list of spans with 0 <= start < end (the detail names the first bad one)",
    ),
    "video_no_clips": (
        REJECTED,
        "no span of the video is validate.video.clips.min_s long (a scene shorter than that is no clip either)",
    ),
    # clips (tasks/video/clips.py)
    "clip_static": (
        REJECTED,
        "the clip barely moves: its mean frame difference is below validate.video.clips.min_motion",
    ),
    "clip_black": (REJECTED, "the clip is (nearly) black: its mean level is below validate.video.clips.min_luma"),
    # reshard (tasks/stages/reshard.py), and ingested shards (tasks/sources/)
    "incomplete_sample": (
        REJECTED,
        "a sample lacks a member it needs: at reshard one of reshard.required_members (not carried); at ingest an image (a shard's sample without an image member, a parquet row whose image column holds no bytes); the detail names what is missing",
    ),
    # ingested shards and datasets (tasks/sources/)
    "duplicate_key": (
        REJECTED,
        "a key seen earlier in the same ingested shard (again after other keys, the same member twice, or a folder key equal to another once rekeyed flat), or listed again in its img2dataset side file; the first is kept",
    ),
    "unsafe_key": (
        REJECTED,
        "an ingested sample's key is not a safe name: a control, bidi or other format character, a backslash, an absolute path or an empty or '..' folder, or longer than 200 characters (relative folder keys are rekeyed, not refused) (the detail shows it escaped)",
    ),
    "forbidden_member": (
        REJECTED,
        "an ingested sample carries a member of a type never loaded (pickle, .pth, .pt, .ckpt, .pyd, .so, scripts; tasks/sources/tarsamples.py); the whole sample is refused",
    ),
    "upstream_failed": (
        ERROR,
        "the tool that wrote an ingested shard recorded a failure for the row (img2dataset: failed_to_download, failed_to_resize); its status and message in the detail",
    ),
    "source_changed": (
        ERROR,
        "a file of the source (an ingested parquet) holds fewer rows than when the run planned it: it changed meanwhile; the next run plans it again",
    ),
    "sample_missing": (
        ERROR,
        "the side file of an ingested shard (img2dataset's parquet) lists the sample as written, but the shard has no sample of that key",
    ),
    # precache
    "nonfinite_encoding": (
        ERROR,
        "a precached array (latent, embedding, feature) holds NaN or infinite values; the precache gate blocks the release",
    ),
    # license (tasks/policies/licenses.py)
    "license_missing": (REJECTED, "no license value and no validate.license.source_defaults entry for the source"),
    "license_not_allowed": (
        REJECTED,
        "the license, normalised to SPDX, is not in validate.license.allow, or is unrecognised under validate.license.unknown: reject",
    ),
    # caption (tasks/policies/captions.py)
    "caption_missing": (REJECTED, "no caption left after cleanup while validate.caption.required is set"),
    "caption_too_short": (
        REJECTED,
        "fewer than validate.caption.min_chars characters or min_words words after cleanup",
    ),
    "caption_too_long": (REJECTED, "more than validate.caption.max_chars characters after cleanup"),
    "caption_charset": (
        REJECTED,
        "share of junk characters (U+FFFD, private-use, unassigned, control characters, mojibake) above validate.caption.max_non_text_ratio",
    ),
    # privacy (tasks/models/faces.py, tasks/policies/personal.py; recipe privacy:)
    "face_present": (
        REJECTED,
        "the image, or a frame of a video clip looked at (privacy.faces.clip_frames), shows a face (privacy.faces.mode: reject; for a clip, blur too: its frames are not blurred), or more faces than privacy.faces.max_faces where they were to be blurred; the detail gives the count and the largest box",
    ),
    "personal_data": (
        REJECTED,
        "the caption, a text field of the sample's json, or a conversation turn holds personal data (e-mail address, phone number, payment card, IBAN, IP address, URL with credentials or a token) under privacy.text.mode: reject, or more than can be read or redacted; the detail names the field, kinds and offsets, never the values",
    ),
    # curation (tasks/curate/): scores over the sample's embeddings, against curate.* filters
    "low_alignment": (
        REJECTED,
        "the cosine of the image and caption embeddings (DataComp's CLIP score) is below curate.alignment's cut (min, or the keep_top fraction); score and cut in the detail",
    ),
    "low_aesthetic": (REJECTED, "the aesthetic head's score is below curate.heads.aesthetic's cut"),
    "unsafe_content": (REJECTED, "the NSFW head's score is above curate.heads.nsfw's cut"),
    "watermark": (REJECTED, "the watermark head's score is above curate.heads.watermark's cut"),
    # fine-tuning records (tasks/finetune/conversations.py, tasks/finetune/samples.py)
    "conversation_schema": (
        REJECTED,
        "the record is not an object with a conversations list of {from, value} strings, or its image field is not a string or a list of strings",
    ),
    "conversation_empty": (REJECTED, "the record has no turns"),
    "conversation_roles": (
        REJECTED,
        "roles are not human/gpt alternating, starting with human and ending with gpt, or more than finetune.conversation.max_turns turns",
    ),
    "conversation_empty_turn": (REJECTED, "a turn has no text besides image placeholders"),
    "conversation_reserved_tag": (
        REJECTED,
        "a turn's text holds a tag the tiler writes around an image (finetune.tiling: <img>, </img>, <tile_1>...):"
        " it would read as an image's tags",
    ),
    "placeholder_mismatch": (REJECTED, "the number of image placeholders differs from the number of images"),
    "conversation_too_long": (REJECTED, "more than finetune.conversation.max_chars characters over all turns"),
    "too_many_images": (REJECTED, "more images than finetune.conversation.max_images"),
    "image_rejected": (
        REJECTED,
        "one of the record's images was rejected by the download or validation phase (detail names it and why)",
    ),
    "image_failed": (ERROR, "one of the record's images could not be fetched (detail names it and why)"),
    "sample_too_long": (
        REJECTED,
        "more tokens than the padding cut-off (policy drop), or not even the first exchange fits (policy truncate)",
    ),
    # keeping a dataset current (tasks/stages/recheck.py, tasks/stages/upkeep.py)
    "link_dead": (
        REJECTED,
        "a recheck of a released row got 404 or 410, or its host did not answer download.recheck.dead_after checks in a row; dropped only where download.recheck.actions.link_dead is drop",
    ),
    "content_changed": (
        REJECTED,
        "a recheck of a released row got different bytes (another ETag, Last-Modified or sha256 than the download's); dropped only where download.recheck.actions.content_changed is drop",
    ),
    "taken_down": (
        REJECTED,
        "the row matches an entry of a takedown list (a URL, domain, sample key, sha256 or perceptual hash); the detail names the list and the entry",
    ),
    "text_only_over_ratio": (REJECTED, "a text-only record beyond finetune.text_only_ratio of the accepted samples"),
}


# Faults of an ingested tar shard (tasks/sources/): one error row stands for the rest of the
# shard, after a row for every sample read before the fault.
for _name, _meaning in SHARD_ERROR_REASONS.items():
    REASONS[_name] = (ERROR, f"ingested shard fault: {_meaning}; one row stands for the rest of the shard")

# Families: a stable prefix and a variable part. ``duplicate_of:<key>`` names the sample kept.
FAMILIES: dict[str, tuple[str, str]] = {
    "http_": (ERROR, "final HTTP status code after retries (http_404, http_503, ...)"),
    "duplicate_of:": (
        REJECTED,
        "an exact or near duplicate of an earlier sample (by source, row), named after the colon",
    ),
    "semantic_duplicate_of:": (
        REJECTED,
        "curation: the image embedding is within curate.semdedup.threshold (cosine) of an earlier kept sample's, named after the colon (crops, flips, re-encodes, overlays of one picture)",
    ),
    "low_score:": (REJECTED, "curation: below the cut of the head named after the colon (curate.heads.<name>)"),
    "high_score:": (REJECTED, "curation: above the cut of the head named after the colon (curate.heads.<name>)"),
}


# What curation (tasks/curate/) decides: about a sample's content as a whole, so a fine-tuning
# record whose image curation removed carries the reason itself, not ``image_rejected``.
CURATION_REASONS = frozenset(
    {
        "low_alignment",
        "low_aesthetic",
        "unsafe_content",
        "watermark",
        "semantic_duplicate_of",
        "low_score",
        "high_score",
    }
)


# Reasons of a fetch that may succeed later (an outage, a rate limit, a shard deadline): a later
# run fetches the row again (download.retry_failed). Every other error or rejection is final: a
# 404 or 410, a refusal by the URL policy, robots or an opt-out, bad or oversized content.
TRANSIENT_REASONS = frozenset({"timeout", "connection_error", "dns_error", "rate_limited", "read_error"})
# 5xx except those that say the server will never serve the request (501 Not Implemented, 505
# HTTP Version Not Supported), plus 408 Request Timeout, 425 Too Early and 429 Too Many Requests.
TRANSIENT_HTTP = frozenset({408, 425, 429} | set(range(500, 600)) - {501, 505})

# What a recheck of a released row found (tasks/stages/recheck.py), and which of them are reasons
# a release can drop the row for (download.recheck.actions).
RECHECK_OUTCOMES = ("unchanged", "unreachable", "link_dead", "content_changed", "opted_out")
RECHECK_REASONS = ("link_dead", "content_changed", "opted_out")
# Reasons a release gives a row that was released before and is dropped now without a new fetch.
UPKEEP_REASONS = (*RECHECK_REASONS, "taken_down")


def is_transient(reason: str | None) -> bool:
    """Whether a row's last outcome is a passing failure a later run fetches again."""
    if reason is None:
        return False
    if reason.startswith("http_"):
        code = reason[len("http_") :]
        return code.isdigit() and int(code) in TRANSIENT_HTTP
    return reason in TRANSIENT_REASONS


def is_curation_reason(reason: str | None) -> bool:
    return reason is not None and family(reason).rstrip(":") in CURATION_REASONS


DUPLICATE_OF = "duplicate_of:"  # an exact or near duplicate's reason, the kept sample's key after it


def duplicate_of(original: str) -> str:
    """The reason of a duplicate of ``original`` (a sample key, or a clip's index within its video)."""
    return DUPLICATE_OF + original


def original_of(reason: str | None) -> str | None:
    """The kept sample a ``duplicate_of:<key>`` reason names; None for any other reason."""
    return reason[len(DUPLICATE_OF) :] if reason is not None and reason.startswith(DUPLICATE_OF) else None


def family(reason: str) -> str:
    """The stable part of a reason, for grouping: ``duplicate_of:photos-000000012`` -> ``duplicate_of``."""
    for prefix in FAMILIES:
        if reason.startswith(prefix):
            return prefix.rstrip(":_") if prefix.endswith(":") else reason
    return reason


def status_of(reason: str | None) -> str:
    """Status implied by a reason; ``None`` means ok."""
    if reason is None:
        return OK
    for prefix, (status, _) in FAMILIES.items():
        if reason.startswith(prefix):
            return status
    try:
        return REASONS[reason][0]
    except KeyError:
        raise ValueError(f"unknown reason {reason!r}; add it to tasks/formats/reasons.py") from None
