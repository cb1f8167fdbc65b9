"""Image formats sniffed from the bytes, and cheap end-marker checks for truncation."""

from __future__ import annotations

EXTENSIONS = {"jpeg": "jpg", "png": "png", "webp": "webp", "gif": "gif", "bmp": "bmp", "tiff": "tiff", "avif": "avif", "heif": "heic"}


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


def is_truncated(fmt: str, data: bytes) -> bool:
    """True when the bytes stop before the format's end marker.

    Data after the end marker (appended payloads) is not truncation; validation re-encodes
    from pixels and drops it.
    """
    if fmt == "jpeg":
        # EOI marker; some encoders pad after it, so look for it anywhere past the header.
        return data.rfind(b"\xff\xd9") < 2
    if fmt == "png":
        return data.rfind(b"IEND") < 8
    if fmt == "gif":
        return data.rstrip(b"\x00")[-1:] != b";" and data.rfind(b"\x00;") < 0
    if fmt == "webp":
        declared = int.from_bytes(data[4:8], "little") + 8
        return len(data) < declared
    if fmt == "bmp":
        declared = int.from_bytes(data[2:6], "little")
        return declared > len(data)
    return False
