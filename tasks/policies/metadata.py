"""Metadata removed from JPEG, PNG and WebP bytes without re-encoding the pixels, and the EXIF fields a recipe keeps.

Decisions (tests/test_metadata_strip.py pins each one):

- What is removed. JPEG: COM and every APPn segment (APP1 EXIF, XMP and extended XMP; APP2
  ICC, MPF and FlashPix; APP13 Photoshop/IPTC; APP0 JFXX thumbnails; APP3-APP12, APP15) but
  the two that decoding reads (below), wherever they are (between progressive scans too),
  and everything after EOI (appended payloads, the further images of an MPO). PNG: every
  ancillary chunk but a ``tRNS`` the colour type reads (tEXt, zTXt, iTXt, eXIf, tIME, iCCP,
  unknown and private chunks) and everything after IEND. WebP: EXIF, XMP, ICCP and unknown
  chunks, their VP8X flags cleared, the RIFF size fixed, everything after the RIFF payload
  dropped; a simple (VP8 / VP8L) file keeps only its bitstream chunk. Segments no decoded
  pixel depends on, which can only carry data (``other``): JPEG markers other than SOFn, DHT, DAC, DQT,
  DRI, SOS and one DNL of its own size (4) after a scan; parameterless markers (RSTn, TEM)
  between segments; every APP14 Adobe segment but the one kept; a PNG PLTE but in a palette
  file (a suggested palette in colour types 2 and 6, none allowed in 0 and 4); a tRNS beside
  an alpha channel (colour types 4 and 6); a WebP ALPH, VP8 or VP8L chunk after the
  bitstream; VP8X's reserved bits and bytes and anything past its 10 bytes.
- What is kept, because decoded pixels depend on it: JPEG's APP0 JFIF (libjpeg takes a
  3-component file with it as YCbCr; its thumbnail is cut, the density kept) and one APP14
  Adobe, the last before the first scan (libjpeg reads each one's transform until then, the
  last one winning), written as libjpeg writes it: version 100, no flags, and the transform
  as libjpeg takes it (0: RGB or CMYK; another value: YCbCr or YCCK, written 1 or 2); PNG's
  IHDR, IDAT, IEND and, in a palette file, PLTE; tRNS where the colour type reads it (0, 2
  and 3); WebP's VP8X (rewritten: the flags decoders read, zero reserved bytes, the canvas
  size), ALPH, VP8, VP8L, ANIM and ANMF. Pixel data is copied byte for byte, so the pixels
  are the same bits with Pillow, libjpeg, libpng and libwebp (tasks.policies.decoders), and
  so is the pixel hash.
- What decoders read two ways gives None (the caller re-encodes): a PNG tRNS not of its
  colour type's size (2 bytes for grey, 6 for RGB; Pillow reads its first bytes, libpng
  ignores it), longer than the palette libpng reads (its entries up to the bit depth's), a
  second one, one before PLTE or after the first IDAT; a palette of part entries or over 256,
  or a second one; an IHDR not of 13 bytes; a WebP ALPH chunk in a VP8X file whose alpha flag
  is clear (Pillow decodes it, libwebp does not).
- Not removed, because finding it would mean decoding: bytes inside the compressed data
  itself (after a JPEG scan's last code, padding inside a VP8 chunk, after a PNG's zlib
  stream), and table contents no pixel uses: a DQT or DHT table no component or scan uses,
  Huffman codes a scan never emits, quantiser values of coefficients that are all zero, PNG
  palette entries no pixel uses. Each can carry data; only a re-encode removes it.
- ICC (JPEG APP2, PNG iCCP, WebP ICCP) is removed: samples are taken as sRGB (no decoder
  here applies a profile) and the re-encode path (tasks.policies.pixels.encode) writes none,
  so both paths release the same thing; a profile also carries device and author text.
- PNG's colour and rendering hints (gAMA, cHRM, sRGB, cICP, mDCv, cLLi, sBIT, pHYs, bKGD,
  hIST, sPLT) are removed for the same reason: neither Pillow nor libpng (as imagecodecs
  calls it) changes decoded pixels by them, and a re-encoded PNG has none.
- Orientation goes with the EXIF. Callers strip only images that are not EXIF-rotated
  (images.py keeps input bytes only then); a rotated image is re-encoded with the rotation
  applied.
- Kept EXIF fields (``privacy.metadata.keep``): a new EXIF holding only the named
  descriptive base-IFD tags (:data:`KEEPABLE`), copied from the input's EXIF (JPEG's first
  APP1 EXIF, PNG's eXIf, WebP's EXIF chunk), written after SOI / JFIF (JPEG), before the
  first IDAT (PNG), or as a WebP EXIF chunk with its VP8X flag; a simple-format WebP gets a
  VP8X synthesised from its bitstream header (canvas size, alpha flag), which libwebp and
  Pillow decode to the same pixels. Orientation, GPS, maker notes, sub-IFD and data
  pointers, tags embedding other metadata (XMP, IPTC, ICC) and serial numbers are never
  kept (:func:`check_keep` says why for each); fields that would take the EXIF over one
  JPEG segment (64 KiB) are left out. Only the named IFD0 entries are handed to Pillow's
  EXIF parser, however many entries the input's IFD0 claims. A field is kept only as its tag
  holds it: text for a text tag (str, or bytes where it was stored as BYTE or UNDEFINED), one
  number for a numeric one; never several numbers, which can spell anything. Its text goes
  through the caller's screen (privacy.text): bytes decoded as UTF-8 (XP* fields as UTF-16),
  NULs removed; a field the screen changes is written as the screened text.
- Hostile bytes: one pass over segment headers (JPEG's entropy-coded data is searched for
  the next marker by a compiled pattern, in C), never a read past the data, at most
  :data:`MAX_SEGMENTS` segments; a length past the end, a truncated header, an unknown
  critical chunk or marker, APNG chunks, or no end marker give None (the caller re-encodes).
  A 10 MB metadata segment costs one length read, and the output holds copies of the kept
  segments only.
"""

from __future__ import annotations

import re
import sys
import zlib
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from numbers import Number
from typing import Any, Literal

from PIL import ExifTags, Image, TiffTags

from tasks.formats.recipe_privacy import KEEPABLE, check_keep
from tasks.policies.decoders import DECODE_ERRORS, MAX_SEGMENTS, webp_info

__all__ = ["KEEPABLE", "KINDS", "MAX_SEGMENTS", "check_keep", "exif_kept", "metadata_kinds", "strip_metadata"]

# What metadata_kinds reports, in this order. ``other`` is any other removed segment that can
# carry data (unknown APPn or chunks, tIME, MPF, JFIF extension thumbnails); rendering hints
# (gAMA, sRGB, pHYs, ...) are removed but not reported.
KINDS = ("exif", "gps", "xmp", "iptc", "icc", "comment", "text", "other", "trailing")

# MAX_SEGMENTS (decoders): segments walked before giving up. A file with more is refused
# before it gets here (decoders.segments_problem); the walks stop there all the same.

_TAG_IDS: dict[str, list[int]] = {}
for _tag, _name in ExifTags.TAGS.items():
    _TAG_IDS.setdefault(_name, []).append(_tag)

_MAX_EXIF = 65533  # a JPEG APP1 payload, "Exif\0\0" included
_EXIF_PREFIX = b"Exif\x00\x00"
_EXIF_ERRORS = (*DECODE_ERRORS, TypeError, AttributeError, ArithmeticError)
_GPS_POINTER = 0x8825
_TIFF_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4}  # bytes per value
_XMP_GPS = (b"exif:GPS", b"GPSLatitude", b"GPSLongitude")
_XMP_GPS_SCAN = 256 * 1024  # how far into an XMP packet GPS fields are looked for

# JPEG. At a segment boundary: optional fill bytes, then the marker. After SOS: the first
# marker that is not byte stuffing (FF 00) or a restart (FF D0-D7).
_JPEG_MARKER = re.compile(rb"\xff+([^\xff])")
_JPEG_NEXT = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_SOI, _EOI, _SOS, _DNL, _TEM, _COM = 0xD8, 0xD9, 0xDA, 0xDC, 0x01, 0xFE
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # not DHT, JPG, DAC
_APP0, _APP1, _APP2, _APP13, _APP14, _APP15 = 0xE0, 0xE1, 0xE2, 0xED, 0xEE, 0xEF
_JFIF_LEN = 14  # "JFIF\0", version, units, densities, thumbnail size: what libjpeg reads
_ADOBE_LEN = 12  # "Adobe", version, flags0, flags1, transform: what libjpeg and Pillow read
_ADOBE_HEAD = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00"  # all but the transform, as libjpeg writes it
_XMP_IDS = (b"http://ns.adobe.com/xap/1.0/\x00", b"http://ns.adobe.com/xmp/extension/\x00")

# PNG.
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_KEEP = {b"IHDR", b"IDAT", b"IEND"}  # and PLTE and tRNS where the colour type reads them
_PNG_COLOURS = {b"\x00", b"\x02", b"\x03", b"\x04", b"\x06"}  # grey, RGB, palette, grey + alpha, RGBA
_PNG_TRNS = {0: 2, 2: 6, 3: 0}  # colour type -> tRNS length (0: one byte per palette entry at most)
_PNG_APNG = {b"acTL", b"fcTL", b"fdAT"}
_PNG_HINTS = {b"gAMA", b"cHRM", b"sRGB", b"cICP", b"mDCv", b"cLLi", b"sBIT", b"pHYs", b"bKGD", b"hIST", b"sPLT"}
_PNG_TEXT = {b"tEXt", b"zTXt", b"iTXt"}
_PNG_TEXT_KINDS = {
    b"XML:com.adobe.xmp": "xmp",
    b"Raw profile type xmp": "xmp",
    b"Raw profile type exif": "exif",
    b"Raw profile type APP1": "exif",
    b"Raw profile type iptc": "iptc",
    b"Raw profile type 8bim": "iptc",
    b"Raw profile type icc": "icc",
    b"Raw profile type icm": "icc",
    b"Comment": "comment",
}

# WebP (VP8X flag bits, as libwebp's mux_types.h; the others are reserved).
_WEBP_ICC, _WEBP_ALPHA, _WEBP_EXIF, _WEBP_XMP, _WEBP_ANIMATION = 0x20, 0x10, 0x08, 0x04, 0x02
_WEBP_RESERVED = 0xFF & ~(_WEBP_ICC | _WEBP_ALPHA | _WEBP_EXIF | _WEBP_XMP | _WEBP_ANIMATION)
_WEBP_KEEP = {b"ALPH", b"VP8 ", b"VP8L", b"ANIM", b"ANMF"}
_WEBP_IMAGE = {b"VP8 ", b"VP8L", b"ANMF"}
# A still image's alpha and bitstream: one of each, the alpha first. Another after the bitstream
# is read by no decoder, so it is data, removed as ``other``.
_WEBP_STILL = {b"ALPH", b"VP8 ", b"VP8L"}
_WEBP_KINDS = {b"EXIF": "exif", b"XMP ": "xmp", b"ICCP": "icc"}

Part = tuple[int, int] | bytes  # a range of the input kept as is, or new bytes


@dataclass
class _Scan:
    """One walk over a file's segments: what to keep, what was there, and where kept EXIF goes.

    Args:
        ok: the structure was whole; False when the walk gave up (strip answers None).
        parts: input ranges kept and new bytes, in output order.
        kinds: the kinds of metadata found.
        exif: the source EXIF (TIFF bytes, ``Exif\\0\\0`` stripped), the first one.
        insert_at: the index in ``parts`` where a kept EXIF segment goes (-1: at the end).
        flags: WebP only, the VP8X flags byte to write (None: no VP8X in the input).
        alpha: WebP only, a simple VP8L file's alpha hint (for a synthesised VP8X).
    """

    ok: bool = True
    parts: list[Part] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)
    exif: bytes | None = None
    insert_at: int = -1
    flags: int | None = None
    alpha: bool = False

    def keep(self, start: int, end: int) -> None:
        last = self.parts[-1] if self.parts and len(self.parts) > self.insert_at else None
        if isinstance(last, tuple) and last[1] == start:
            self.parts[-1] = (last[0], end)
        else:
            self.parts.append((start, end))

    def mark(self) -> None:
        """Kept EXIF goes here: before the next part."""
        self.insert_at = len(self.parts)

    def fail(self) -> _Scan:
        self.ok = False
        return self

    def found_exif(self, tiff: bytes) -> None:
        self.kinds.add("exif")
        if tiff[:6] == _EXIF_PREFIX:
            tiff = tiff[6:]
        if self.exif is None:
            self.exif = tiff
        if _tiff_has_gps(tiff):
            self.kinds.add("gps")

    def found_xmp(self, packet: bytes) -> None:
        self.kinds.add("xmp")
        head = packet[:_XMP_GPS_SCAN]
        if any(name in head for name in _XMP_GPS):
            self.kinds.add("gps")


def _ifd0(tiff: bytes) -> tuple[Literal["little", "big"], int, array[int]] | None:
    """(byte order, offset of the first entry, the entries as 16-bit words) of a TIFF block's IFD0, or None.

    The entries are read as one array (each is six words, the tag first): no per-entry Python
    work, however many entries a hostile block claims (at most 65535).
    """
    order = tiff[:2]
    if order not in (b"II", b"MM"):
        return None
    bo: Literal["little", "big"] = "little" if order == b"II" else "big"
    offset = int.from_bytes(tiff[4:8], bo)
    if offset + 2 > len(tiff):
        return None
    count = int.from_bytes(tiff[offset : offset + 2], bo)
    block = memoryview(tiff)[offset + 2 : offset + 2 + 12 * count]
    words = array("H")
    words.frombytes(block[: len(block) - len(block) % 12])
    if bo != sys.byteorder:
        words.byteswap()
    return bo, offset + 2, words


def _tiff_has_gps(tiff: bytes) -> bool:
    """Whether a TIFF/EXIF block's IFD0 holds a GPS IFD pointer."""
    ifd = _ifd0(tiff)
    return ifd is not None and _GPS_POINTER in ifd[2][::6]


def _tiff_subset(tiff: bytes, tags: tuple[int, ...]) -> bytes | None:
    """A small TIFF holding only IFD0's entries for ``tags`` (first of each), values copied, or None when none is there.

    What Pillow then parses, instead of every entry of a hostile IFD (65535 entries: 0.1 s in
    Pillow's per-entry loop, about 1 ms here).
    """
    ifd = _ifd0(tiff)
    if ifd is None:
        return None
    bo, first, words = ifd
    names = words[::6]
    chosen: list[tuple[bytes, bytes, bool]] = []  # (tag, type and count; value or out-of-line data; out of line)
    for tag in tags:
        try:
            pos = first + 12 * names.index(tag)
        except ValueError:
            continue
        kind, count = int.from_bytes(tiff[pos + 2 : pos + 4], bo), int.from_bytes(tiff[pos + 4 : pos + 8], bo)
        size = _TIFF_SIZES.get(kind, 0) * count
        if size == 0 or size > _MAX_EXIF:
            continue
        if size <= 4:
            chosen.append((tiff[pos : pos + 8], tiff[pos + 8 : pos + 12], False))
            continue
        where = int.from_bytes(tiff[pos + 8 : pos + 12], bo)
        if where + size <= len(tiff):
            chosen.append((tiff[pos : pos + 8], tiff[where : where + size], True))
    if not chosen:
        return None
    head = (b"II*\x00" if bo == "little" else b"MM\x00*") + (8).to_bytes(4, bo)
    entries, values = [len(chosen).to_bytes(2, bo)], []
    at = 8 + 2 + 12 * len(chosen) + 4
    for entry, value, outside in chosen:
        if outside:
            entries.append(entry + at.to_bytes(4, bo))
            values.append(value + b"\x00" * (len(value) & 1))
            at += len(value) + (len(value) & 1)
        else:
            entries.append(entry + value)
    return head + b"".join(entries) + b"\x00" * 4 + b"".join(values)


def _unchanged(parts: list[Part], size: int) -> bool:
    pos = 0
    for part in parts:
        if not isinstance(part, tuple) or part[0] != pos:
            return False
        pos = part[1]
    return pos == size


def _join(data: bytes, parts: Iterable[Part]) -> bytes:
    view = memoryview(data)
    return b"".join(view[p[0] : p[1]] if isinstance(p, tuple) else p for p in parts)


# --- JPEG ---------------------------------------------------------------------------------


def _scan_jpeg(data: bytes) -> _Scan:
    scan = _Scan()
    size = len(data)
    if data[:2] != b"\xff\xd8":
        return scan.fail()
    scan.keep(0, 2)
    scan.mark()
    pos, scanned, jfif, dnl = 2, False, False, False
    components = 0  # the frame's (SOFn)
    # The Adobe segment decoders read: where it goes in parts, where it is, its transform.
    adobe: tuple[int, int, int] | None = None
    for _ in range(MAX_SEGMENTS):
        found = _JPEG_MARKER.match(data, pos)
        if found is None:
            return scan.fail()
        start = found.end() - 2  # fill bytes before the marker are dropped
        marker = data[start + 1]
        if marker == _EOI:
            if not scanned:
                return scan.fail()
            scan.keep(start, start + 2)
            if start + 2 < size:
                scan.kinds.add("trailing")
            return scan
        if marker == _TEM or 0xD0 <= marker <= 0xD7:  # parameterless, between segments: skipped, data
            scan.kinds.add("other")
            pos = start + 2
            continue
        # SOI again, reserved markers (FF 02-BF) and JPGn (FF F0-FD): libjpeg refuses them.
        if marker == _SOI or marker < 0xC0 or 0xF0 <= marker <= 0xFD:
            return scan.fail()
        if start + 4 > size:
            return scan.fail()
        length = int.from_bytes(data[start + 2 : start + 4], "big")
        end = start + 2 + length
        if length < 2 or end > size:
            return scan.fail()
        if _APP0 <= marker <= _APP15 or marker == _COM:
            payload = data[start + 4 : end]
            if marker == _APP0 and not jfif and not scanned and payload[:5] == b"JFIF\x00" and length >= 2 + _JFIF_LEN:
                jfif = True
                first = len(scan.parts) == 1  # nothing kept before it but SOI
                if length == 2 + _JFIF_LEN and payload[12:14] == b"\x00\x00":
                    scan.keep(start, end)
                else:  # the thumbnail (a copy of the picture as it was) is cut
                    scan.parts.append(b"\xff\xe0\x00\x10" + payload[:12] + b"\x00\x00")
                if first:
                    scan.mark()  # kept EXIF follows the JFIF segment
            elif marker == _APP14 and payload[:5] == b"Adobe":
                # libjpeg reads the transform of each Adobe segment of 12 bytes or more until the
                # first scan, the last one winning: that one is kept (put in at the first scan).
                if adobe is not None or scanned or len(payload) < _ADOBE_LEN:
                    scan.kinds.add("other")
                if not scanned and len(payload) >= _ADOBE_LEN:
                    adobe = (len(scan.parts), start, payload[_ADOBE_LEN - 1])
            else:
                _jpeg_kind(scan, marker, payload)
            pos = end
            continue
        pos = end
        if marker == _DNL:
            # No decoder here reads a DNL (libjpeg skips it); one of its own size (the line count)
            # after a scan is kept, any other (before the frame, longer, a second) is data.
            if not scanned or dnl or length != 4:
                scan.kinds.add("other")
                continue
            dnl = True
        elif not _jpeg_structure(marker):  # a segment no decoder reads: data
            scan.kinds.add("other")
            continue
        if marker in _SOF and length >= 8:
            components = data[start + 9]
        if marker == _SOS and adobe is not None:
            at, where, transform = adobe
            scan.parts.insert(at, _adobe_part(data, where, transform, components))
            if at < scan.insert_at:
                scan.insert_at += 1
            adobe = None
        scan.keep(start, end)
        if marker == _SOS:
            following = _JPEG_NEXT.search(data, end)
            if following is None:
                return scan.fail()
            scan.keep(end, following.start())
            scanned = True
            pos = following.start()
    return scan.fail()


def _jpeg_structure(marker: int) -> bool:
    """A segment a decoder reads: SOFn, DHT and DAC (FF C0-CF but JPG, FF C8), DQT, DRI and SOS."""
    return (0xC0 <= marker <= 0xCF and marker != 0xC8) or marker in (0xDA, 0xDB, 0xDD)


def _adobe_part(data: bytes, start: int, transform: int, components: int) -> Part:
    """The Adobe segment at ``start`` as libjpeg writes it: version 100, no flags, the transform
    as libjpeg takes it (0: RGB or CMYK; another: YCbCr for 3 components, YCCK for 4), the
    input's range where it is that already. libjpeg reads only the transform (Pillow the version
    too, into ``info``, not the pixels), so the other bytes, and other transform values, would
    be data."""
    if transform:
        transform = 2 if components == 4 else 1
    segment = _ADOBE_HEAD + bytes([transform])
    return (start, start + len(segment)) if data[start : start + len(segment)] == segment else segment


def _jpeg_kind(scan: _Scan, marker: int, payload: bytes) -> None:
    if marker == _COM:
        scan.kinds.add("comment")
    elif marker == _APP1 and payload[:6] == _EXIF_PREFIX:
        scan.found_exif(payload[6:])
    elif marker == _APP1 and payload.startswith(_XMP_IDS):
        scan.found_xmp(payload)
    elif marker == _APP2 and payload[:12] == b"ICC_PROFILE\x00":
        scan.kinds.add("icc")
    elif marker == _APP13:
        scan.kinds.add("iptc")
    else:
        scan.kinds.add("other")


def _exif_app1(exif: bytes) -> bytes:
    return b"\xff\xe1" + (2 + len(exif)).to_bytes(2, "big") + exif


# --- PNG ----------------------------------------------------------------------------------


def _scan_png(data: bytes) -> _Scan:
    scan = _Scan()
    size = len(data)
    if data[:8] != _PNG_SIGNATURE:
        return scan.fail()
    scan.keep(0, 8)
    if data[8:16] != b"\x00\x00\x00\x0dIHDR" or data[25:26] not in _PNG_COLOURS:
        return scan.fail()  # no IHDR of its size, or no colour type decoders know
    colour, depth = data[25], data[24]
    pos, idat, trns = 8, False, False
    palette: int | None = None  # the palette entries libpng reads (colour type 3)
    for _ in range(MAX_SEGMENTS):
        if pos + 12 > size:
            return scan.fail()
        length = int.from_bytes(data[pos : pos + 4], "big")
        tag = data[pos + 4 : pos + 8]
        end = pos + 12 + length
        if length > 0x7FFFFFFF or end > size or not tag.isalpha() or (pos == 8) != (tag == b"IHDR"):
            return scan.fail()
        if tag == b"IEND":
            if not idat:
                return scan.fail()
            scan.keep(pos, end)
            if end < size:
                scan.kinds.add("trailing")
            return scan
        if tag == b"IDAT" and not idat:
            if colour == 3 and palette is None:
                return scan.fail()
            idat = True
            scan.mark()  # kept EXIF goes before the first IDAT, where Pillow reads it at open
        if tag == b"PLTE" and colour == 3:
            # The palette: one, before the pixels, whole entries, at most 256 (libpng refuses others).
            if palette is not None or idat or trns or length == 0 or length % 3 or length > 768:
                return scan.fail()
            palette = min(length // 3, 1 << depth)  # libpng drops entries past the bit depth's
            scan.keep(pos, end)
        elif tag == b"tRNS" and colour in _PNG_TRNS:
            # Read differently where it is not as the colour type says (Pillow reads its first
            # bytes, libpng ignores it): left to the re-encode.
            want = _PNG_TRNS[colour]
            if trns or idat or (length != want if want else not 0 < length <= (palette or 0)):
                return scan.fail()
            trns = True
            scan.keep(pos, end)
        elif tag in (b"PLTE", b"tRNS"):
            # A suggested palette (colour types 2 and 6) or none allowed (0 and 4), transparency
            # beside an alpha channel: no decoder's pixels read them, so they can only carry data.
            scan.kinds.add("other")
        elif tag in _PNG_KEEP:
            scan.keep(pos, end)
        elif tag[0] < 0x61 or tag in _PNG_APNG:  # an unknown critical chunk, or animation
            return scan.fail()
        elif tag == b"eXIf":
            scan.found_exif(data[pos + 8 : end - 4])
        elif tag in _PNG_TEXT:
            keyword = data[pos + 8 : pos + 8 + min(length, 80)].split(b"\x00", 1)[0]
            kind = _PNG_TEXT_KINDS.get(keyword, "text")
            if kind == "xmp":
                scan.found_xmp(data[pos + 8 : min(end - 4, pos + 8 + _XMP_GPS_SCAN)])
            else:
                scan.kinds.add(kind)
        elif tag == b"iCCP":
            scan.kinds.add("icc")
        elif tag not in _PNG_HINTS:
            scan.kinds.add("other")
        pos = end
    return scan.fail()


def _png_chunk(tag: bytes, body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + tag + body + zlib.crc32(tag + body).to_bytes(4, "big")


# --- WebP ---------------------------------------------------------------------------------


def _scan_webp(data: bytes) -> _Scan:
    scan = _Scan()
    size = len(data)
    if data[:4] != b"RIFF" or data[8:12] != b"WEBP" or size < 20:
        return scan.fail()
    riff_end = 8 + int.from_bytes(data[4:8], "little")
    if riff_end > size or riff_end < 20:
        return scan.fail()
    if riff_end < size:
        scan.kinds.add("trailing")
    first = data[12:16]
    simple = first in (b"VP8 ", b"VP8L")
    if not simple and first != b"VP8X":
        return scan.fail()
    pos, image = 12, False
    for _ in range(MAX_SEGMENTS):
        if pos == riff_end:
            return scan if image else scan.fail()
        if pos + 8 > riff_end:
            return scan.fail()
        tag = data[pos : pos + 4]
        length = int.from_bytes(data[pos + 4 : pos + 8], "little")
        end = pos + 8 + length + (length & 1)
        if end > riff_end:
            return scan.fail()
        if pos == 12 and tag == b"VP8X":
            if length < 10:
                return scan.fail()
            # Released as 10 bytes: the flags decoders read, three zero bytes, the canvas size.
            scan.flags = data[20] & (_WEBP_ALPHA | _WEBP_ANIMATION)
            if data[20] & _WEBP_RESERVED or data[21:24] != b"\x00\x00\x00" or length > 10:
                scan.kinds.add("other")  # reserved bits and bytes, or more: read by no decoder
            scan.parts.append(bytes([scan.flags]))  # the flags (with the chunk header: _webp_assemble)
            if data[21:24] == b"\x00\x00\x00":
                scan.keep(21, 30)
            else:
                scan.parts.append(b"\x00\x00\x00")
                scan.keep(24, 30)
        elif pos == 12 or (not simple and tag in _WEBP_KEEP and not (image and tag in _WEBP_STILL)):
            if tag == b"ALPH" and not data[20] & _WEBP_ALPHA:
                return scan.fail()  # alpha the header does not announce: Pillow reads it, libwebp not
            scan.keep(pos, end)
            image = image or tag in _WEBP_IMAGE
            if pos == 12 and tag == b"VP8L" and length >= 5:
                scan.alpha = bool(data[24] & 0x10)  # alpha_is_used, bit 28 of the VP8L header
        elif tag == b"EXIF":
            scan.found_exif(data[pos + 8 : pos + 8 + length])
        elif tag == b"XMP ":
            scan.found_xmp(data[pos + 8 : pos + 8 + min(length, _XMP_GPS_SCAN)])
        else:
            scan.kinds.add(_WEBP_KINDS.get(tag, "other"))
        pos = end
    return scan.fail()


def _webp_assemble(data: bytes, scan: _Scan, exif: bytes | None) -> bytes | None:
    parts = list(scan.parts)
    if exif is not None:
        tiff = exif[6:] if exif[:6] == _EXIF_PREFIX else exif
        parts.append(b"EXIF" + len(tiff).to_bytes(4, "little") + tiff + b"\x00" * (len(tiff) & 1))
    if scan.flags is not None:
        # parts[0] is the VP8X flags byte; the chunk header is written again below.
        flags = scan.flags | (_WEBP_EXIF if exif is not None else 0)
        parts[0] = b"VP8X" + (10).to_bytes(4, "little") + bytes([flags])
        if exif is None and data[12:21] == parts[0] and _unchanged([(0, 21), *scan.parts[1:]], len(data)):
            return data
    elif exif is not None:
        info = webp_info(data)
        if info is None or not (0 < info.width <= 1 << 24 and 0 < info.height <= 1 << 24):
            return None
        flags = _WEBP_EXIF | (_WEBP_ALPHA if scan.alpha else 0)
        canvas = (info.width - 1).to_bytes(3, "little") + (info.height - 1).to_bytes(3, "little")
        parts.insert(0, b"VP8X" + (10).to_bytes(4, "little") + bytes([flags, 0, 0, 0]) + canvas)
    elif _unchanged([(0, 12), *scan.parts], len(data)):
        return data
    body = _join(data, parts)
    return b"RIFF" + (4 + len(body)).to_bytes(4, "little") + b"WEBP" + body


# --- EXIF kept ----------------------------------------------------------------------------


def _tag_ids(keep: Iterable[str]) -> tuple[int, ...]:
    keep = tuple(keep)
    check_keep(keep)
    return tuple(tag for name in dict.fromkeys(keep) for tag in _TAG_IDS[name])


# What the caller does to a kept field's text (privacy.text's rules): the text to write (redacted
# where the rules redact), or None to write nothing of it.
Screen = Callable[[str, str], str | None]


def _screened(value: Any, name: str, screen: Screen | None) -> Any:
    """A kept value after ``screen``: ASCII text as it is, Windows' XP* fields as UTF-16, other
    bytes (a text field stored as BYTE or UNDEFINED) as UTF-8.

    Bytes come back as they were when ``screen`` changes nothing, else as the screened text; the
    text screened has its NULs removed (UTF-16 text stored as bytes is read as it shows).
    """
    if screen is None:
        return value
    if isinstance(value, str):
        return _screened_text(value, value, name, screen)
    if isinstance(value, bytes) and name.startswith("XP"):
        text = screen(name, value.decode("utf-16-le", "replace").rstrip("\x00"))
        return None if text is None else text.encode("utf-16-le") + b"\x00\x00"
    if isinstance(value, bytes):
        return _screened_text(value, value.decode("utf-8", "replace"), name, screen)
    return value


def _screened_text(value: Any, text: str, name: str, screen: Screen) -> Any:
    shown = text.replace("\x00", "")
    got = screen(name, shown)
    return None if got is None else value if got == shown else got


def _typed(tag: int, value: Any) -> bool:
    """Whether ``value`` is what ``tag`` holds: text (str, or the bytes of a BYTE or UNDEFINED
    field) for a text tag, one number for a numeric one. Several numbers where one is meant can
    spell anything, and Pillow cannot write a number into a text tag."""
    kind = TiffTags.lookup(tag).type
    text = isinstance(value, (str, bytes))
    number = isinstance(value, Number)
    return text if kind == TiffTags.ASCII else number if kind is not None else text or number


def _build_exif(get: Callable[[int], Any], tags: tuple[int, ...], screen: Screen | None = None) -> bytes | None:
    """A new EXIF (``Exif\\0\\0`` + TIFF) with ``tags`` whose values ``get`` reads (after ``screen``),
    each kept while it fits one segment."""
    out = Image.Exif()
    for tag in tags:
        try:
            value = get(tag)
        except _EXIF_ERRORS:
            continue
        if value is None or not _typed(tag, value):
            continue
        value = _screened(value, ExifTags.TAGS.get(tag, str(tag)), screen)
        if value is None:
            continue
        out[tag] = value
        try:
            fits = len(out.tobytes()) <= _MAX_EXIF
        except _EXIF_ERRORS:
            fits = False
        if not fits:
            del out[tag]
    if not len(out):
        return None
    return out.tobytes()


def exif_kept(source_exif: Image.Exif, keep: Iterable[str], screen: Screen | None = None) -> bytes | None:
    """The EXIF to write into a re-encoded image (Pillow's ``save(..., exif=...)``): only the ``keep`` tags
    of ``source_exif``'s base IFD, their text through ``screen``; None when none of them is
    there. Raises ValueError as :func:`check_keep`."""
    tags = _tag_ids(keep)
    if not tags:
        return None
    return _build_exif(source_exif.get, tags, screen)


def _exif_from(tiff: bytes | None, tags: tuple[int, ...], screen: Screen | None = None) -> bytes | None:
    subset = _tiff_subset(tiff, tags) if tags and tiff else None
    if subset is None:
        return None
    source = Image.Exif()
    try:
        source.load(subset)
    except _EXIF_ERRORS:
        return None
    return _build_exif(source.get, tags, screen)


# --- public -------------------------------------------------------------------------------

_SCANNERS: dict[str, Callable[[bytes], _Scan]] = {"jpeg": _scan_jpeg, "png": _scan_png, "webp": _scan_webp}


def strip_metadata(data: bytes, fmt: str, keep: tuple[str, ...] = (), screen: Screen | None = None) -> bytes | None:
    """The same ``jpeg``, ``png`` or ``webp`` image with its metadata removed and its pixel data copied as is.

    ``keep`` names EXIF fields written into the result (a new EXIF holding only them, see the
    module docstring), their text through ``screen`` where given. None when the bytes cannot be rewritten safely (broken or truncated
    structure, unknown critical segments, another format): the caller re-encodes. Returns
    ``data`` itself when there is nothing to remove. Never raises on hostile bytes; raises
    ValueError for a ``keep`` name :func:`check_keep` refuses. The caller applies EXIF
    orientation first: the result has none.
    """
    tags = _tag_ids(keep)
    scanner = _SCANNERS.get(fmt)
    if scanner is None:
        return None
    scan = scanner(data)
    if not scan.ok:
        return None
    exif = _exif_from(scan.exif, tags, screen)
    if fmt == "webp":
        return _webp_assemble(data, scan, exif)
    if exif is None:
        return data if _unchanged(scan.parts, len(data)) else _join(data, scan.parts)
    segment = _exif_app1(exif) if fmt == "jpeg" else _png_chunk(b"eXIf", exif[6:])
    parts = list(scan.parts)
    parts.insert(scan.insert_at if scan.insert_at >= 0 else len(parts), segment)
    return _join(data, parts)


def metadata_kinds(data: bytes, fmt: str) -> tuple[str, ...]:
    """The kinds of metadata (:data:`KINDS`) that ``data`` carries, in that order, from one walk over its segment headers.

    For the sample's json and ledger detail. Of a broken file, the kinds seen before the break.
    """
    scanner = _SCANNERS.get(fmt)
    if scanner is None:
        return ()
    kinds = scanner(data).kinds
    return tuple(kind for kind in KINDS if kind in kinds)
