"""Image formats sniffed from the bytes, cheap end-marker checks for truncation, and the verdict on fetched bytes."""

from __future__ import annotations

from tasks.policies.ruling import Ruling

# How much of a body kept in a file its sniff reads: magic numbers are in the first bytes, and
# Matroska's DocType or an HTML page's start within the first few KiB.
SNIFF_BYTES = 64 * 1024
EXTENSIONS = {
    "jpeg": "jpg",
    "png": "png",
    "webp": "webp",
    "gif": "gif",
    "bmp": "bmp",
    "tiff": "tiff",
    "avif": "avif",
    "heif": "heic",
}

# Video containers, sniffed by sniff_container; a source of videos (media: video) keeps these
# (their member in a sample is named by the format).
VIDEO_FORMATS = ("mp4", "webm", "mkv", "avi")

# Things servers send instead of an image, named in details so a person sees what came back.
_NOT_IMAGES = (
    (b"<!doctype html", "HTML"),
    (b"<html", "HTML"),
    (b"<?xml", "XML"),
    (b"<svg", "SVG"),
    (b"%pdf-", "PDF"),
    (b"\x1f\x8b", "gzip"),
    (b"pk\x03\x04", "zip"),
    (b"{", "JSON"),
)


def sniff_format(data: bytes) -> str | None:
    """The image format the bytes start with, or None; headers and file names are not trusted."""
    head = data[:32]
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:2] == b"BM" and len(data) >= 26:
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"avif", b"avis"):
            return "avif"
        if brand in (b"heic", b"heix", b"mif1", b"msf1", b"heim", b"heis"):
            return "heif"
    return None


def sniff_container(data: bytes) -> str | None:
    """The video container the bytes start with: ``mp4`` (ISO BMFF, also mov and m4v), ``webm``
    or ``mkv`` (Matroska's DocType), ``avi``; None. Check :func:`sniff_format` first: AVIF and
    HEIF images are ISO BMFF files too."""
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "webm" if b"webm" in data[:64] else "mkv"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def describe_start(data: bytes) -> str:
    """What bytes that are not an image start with, for a detail: ``HTML, starts with '<!DOCTYPE html>'``."""
    head = data[:16]
    stripped = data.lstrip()[:16].lower()
    kind = next((name for magic, name in _NOT_IMAGES if stripped.startswith(magic)), None)
    if head.isascii() and all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        shown = "starts with " + repr(head.decode("ascii"))
    else:
        shown = "starts with bytes " + head[:8].hex(" ")
    return f"{kind}, {shown}" if kind else shown


def truncation(fmt: str, data: bytes) -> str | None:
    """How the bytes stop before the format's end (received versus declared), or None.

    Data after the end marker (appended payloads) is not truncation; validation re-encodes
    from pixels and drops it.
    """
    if fmt == "jpeg":
        # EOI marker; some encoders pad after it, so look for it anywhere past the header.
        if data.rfind(b"\xff\xd9") < 2:
            return f"jpeg without its end marker (EOI) in {len(data)} bytes"
    elif fmt == "png":
        if data.rfind(b"IEND") < 8:
            return f"png without its IEND chunk in {len(data)} bytes"
    elif fmt == "gif":
        if data.rstrip(b"\x00")[-1:] != b";" and data.rfind(b"\x00;") < 0:
            return f"gif without its trailer in {len(data)} bytes"
    elif fmt == "webp":
        declared = int.from_bytes(data[4:8], "little") + 8
        if len(data) < declared:
            return f"webp: received {len(data)} of the {declared} bytes its RIFF header declares"
    elif fmt == "bmp":
        declared = int.from_bytes(data[2:6], "little")
        if declared > len(data):
            return f"bmp: received {len(data)} of the {declared} bytes its header declares"
    return None


def is_truncated(fmt: str, data: bytes) -> bool:
    """True when the bytes stop before the format's end marker (see :func:`truncation`)."""
    return truncation(fmt, data) is not None


def bytes_verdict(
    data: bytes, allowed_formats: tuple[str, ...], content_type: str | None = None, size: int | None = None
) -> Ruling[str]:
    """Fetched bytes judged: sniffed format (the verdict's value, once known), allowlist, truncation.

    The detail says what the bytes are and what the server called them (``Content-Type``).
    ``size``: the whole body's length when ``data`` holds only its first bytes (a body streamed
    to a file); truncation is then not judged, since its end markers are past the prefix.
    """
    served = f"Content-Type {content_type}" if content_type else "no Content-Type"
    if not data:
        return Ruling(None, "empty_body", f"0 bytes ({served})")
    if any(f in VIDEO_FORMATS for f in allowed_formats):
        return container_verdict(data, allowed_formats, served, size)
    fmt = sniff_format(data)
    if fmt is None:
        return Ruling(None, "not_an_image", f"{describe_start(data)} ({size or len(data)} bytes, {served})")
    if fmt not in allowed_formats:
        return Ruling(
            fmt, "format_not_allowed", f"{fmt} is not in allowed_formats ({', '.join(allowed_formats)}; {served})"
        )
    if size is not None and size > len(data):
        return Ruling(fmt)
    cut = truncation(fmt, data)
    if cut is not None:
        return Ruling(fmt, "truncated_image", f"{cut} ({served})")
    return Ruling(fmt)


def container_verdict(
    data: bytes, allowed: tuple[str, ...], served: str | None = None, size: int | None = None
) -> Ruling[str]:
    """Bytes that should be a video: the container sniffed (an image or anything else is
    ``not_a_video``, the detail says what it is), and whether it is ``allowed``; ``served``
    (what the server called it) ends the detail, with ``size`` when ``data`` is only the body's
    first bytes. The probe reads the rest from the headers."""
    tail = f" ({size or len(data)} bytes, {served})" if served else ""
    image = sniff_format(data)
    fmt = None if image else sniff_container(data)
    if fmt is None:
        return Ruling(None, "not_a_video", (f"a {image} image" if image else describe_start(data)) + tail)
    if fmt not in allowed:
        return Ruling(fmt, "video_unsupported_container", f"{fmt}; allowed: {', '.join(allowed)}{tail}")
    return Ruling(fmt)
