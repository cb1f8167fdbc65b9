"""The ``privacy:`` block of a recipe: faces, personal data in text, and image metadata.

Each decision is recorded: an accepted sample's json says what was found and done (face boxes,
the kinds and offsets of redacted spans, never their values), and a rejected one is a ledger
row with a stable reason (``face_present``, ``personal_data``). docs/guide/privacy.md says what
each detector finds, with its measured quality.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer

from tasks.formats.recipe_base import Frozen

# What the text scanner can find; ``url_secret`` is a URL carrying a user name, a password or a
# token-like query value (``?token=``, ``access_key=``, ...).
TextKind = Literal["email", "phone", "card", "iban", "ip", "url_secret"]
TEXT_KINDS: tuple[TextKind, ...] = ("email", "phone", "card", "iban", "ip", "url_secret")
# Long side of the copy the face detector works on, by default (``privacy.faces.work_side``).
FACE_WORK_SIDE = 640


# EXIF tags that may be kept: descriptive fields of the base IFD (IFD0). The Exif sub-IFD
# (DateTimeOriginal, BodySerialNumber, ...) is never read.
KEEPABLE = frozenset(
    {
        "ImageDescription",
        "Make",
        "Model",
        "Software",
        "ProcessingSoftware",
        "DateTime",
        "Artist",
        "HostComputer",
        "Copyright",
        "DocumentName",
        "PageName",
        "ImageID",
        "XResolution",
        "YResolution",
        "ResolutionUnit",
        "Rating",
        "RatingPercent",
        "XPTitle",
        "XPComment",
        "XPAuthor",
        "XPKeywords",
        "XPSubject",
    }
)

# Why the tags a recipe might name are never kept (check_keep's message).
_NEVER = {
    "Orientation": "applied to the pixels, never kept",
    "GPSInfo": "GPS position, never kept",
    "MakerNote": "maker notes (serial numbers, owner names), never kept",
    "MakerNoteSafety": "maker notes, never kept",
    "PrintImageMatching": "a maker-specific block, never kept",
    "DNGPrivateData": "a maker-specific block, never kept",
    "ExifOffset": "a pointer to a sub-IFD, never kept",
    "ExifInteroperabilityOffset": "a pointer to a sub-IFD, never kept",
    "SubIFDs": "a pointer to sub-IFDs, never kept",
    "XMLPacket": "embedded XMP, never kept",
    "IPTCNAA": "embedded IPTC, never kept",
    "ImageResources": "embedded Photoshop/IPTC resources, never kept",
    "InterColorProfile": "an embedded ICC profile, never kept",
    "CameraSerialNumber": "identifies a camera, never kept",
    "BodySerialNumber": "identifies a camera, never kept",
    "LensSerialNumber": "identifies a lens, never kept",
}


def check_keep(names: Iterable[str]) -> None:
    """Raise ValueError naming the first tag that is not an EXIF tag name or may not be kept.

    For the recipe's validation of ``privacy.metadata.keep``: names are those of
    ``PIL.ExifTags.TAGS``; only :data:`KEEPABLE` tags are kept.
    """
    from PIL import ExifTags

    known = set(ExifTags.TAGS.values())
    for name in names:
        if name in _NEVER:
            raise ValueError(f"EXIF tag {name!r}: {_NEVER[name]}")
        if name not in known:
            raise ValueError(f"{name!r} is not an EXIF tag name (PIL.ExifTags.TAGS)")
        if name not in KEEPABLE:
            raise ValueError(
                f"EXIF tag {name!r} cannot be kept: only these descriptive base-IFD tags can: {', '.join(sorted(KEEPABLE))}"
            )


class FacePrivacy(Frozen):
    """Faces in images, found by a detector whose weights ship inside its package.

    Args:
        mode: ``off``; ``record`` puts each face's box and score into the sample's json;
            ``blur`` also blurs each box in the released image (precache and embeddings see the
            blurred pixels); ``reject`` refuses a sample with a face (``face_present``).
        min_size: smallest face that counts: the longer side of its box, in pixels of the
            released image. A larger
            one is faster: the detector then works on a smaller copy of the image. In an image
            larger than ``work_side`` the smallest face looked for is larger still: the json's
            ``faces_min_size`` says, per image, how small a face it looked for.
        work_side: the long side, in pixels, of the copy the detector works on (at most the
            image's own). 640 finds every face of ``min_size`` 20 in images up to 640 px, and
            in a 4032 px photo only faces of 126 px and more; a larger value finds smaller
            faces in large released images (``resize_mode: no``), in time about quadratic in it.
        max_faces: most faces recorded (and blurred) per sample, largest first; a sample with
            more is ``face_present`` under ``reject``, and under ``blur`` too (it cannot be
            released with every face blurred); under ``record`` the first ``max_faces`` are
            recorded and its json says how many were found.
        min_score: the detector's last network's face probability at least this (0.8: on the
            labelled set, the recall of MTCNN's own 0.7 less one face in 326, and no false
            face on scikit-image's photographs; docs/guide/privacy.md gives the figures).
        clip_frames: how many frames of each video clip are looked at, spread evenly through
            it (odd: the middle one is the keyframe released beside the clip's mp4): at ``k / (n
            + 1)`` of the way through for ``k`` = 1..n. 3 (default) looks a quarter, half and
            three quarters through; a face on screen for less than about ``1 / (n + 1)`` of a
            clip can be missed. Each frame costs one detection (bench/RESULTS.md).
        device: where the detector's networks run: ``auto`` (this worker's CUDA GPU where it
            has one, as under ``--cluster cuda``; the CPU otherwise), ``cpu``, or ``cuda``: a
            run on a cluster of this machine's that has no GPU stops before it starts (exit 2),
            and a worker of an existing cluster that sees none fails its shards, naming this
            field. The networks compute in fp32 on either.
    """

    mode: Literal["off", "record", "blur", "reject"] = "off"
    min_size: int = Field(default=20, ge=8, le=4096)
    max_faces: int = Field(default=32, ge=1, le=1024)
    min_score: float = Field(default=0.8, ge=0.5, le=1.0)
    clip_frames: int = Field(default=3, ge=1, le=15)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    work_side: int = Field(default=FACE_WORK_SIDE, ge=160, le=8192)

    @model_serializer(mode="wrap")
    def _new_fields_only_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``work_side`` (added after datasets were made) is dumped only when set away from its
        default, so that a recipe without it keeps its outputs' names (they hash this dump)."""
        out = handler(self)
        if out.get("work_side") == FACE_WORK_SIDE:
            del out["work_side"]
        return out

    @field_validator("clip_frames")
    @classmethod
    def _odd(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError(f"{value} is even: an odd count keeps the keyframe (the middle frame) among them")
        return value


class TextPrivacy(Frozen):
    """Personal data in captions and in every turn of a conversation.

    Args:
        mode: ``off``; ``record`` keeps the text and records each span's kind and offsets;
            ``redact`` replaces each span with a typed placeholder (``<EMAIL>``, ``<PHONE>``,
            ``<CARD>``, ``<IBAN>``, ``<IP>``, ``<URL>``) and records kind and offsets;
            ``reject`` refuses the sample (``personal_data``).
        kinds: what is looked for.
        phone_region: the region (ISO 3166 alpha-2) whose national number formats are
            recognised; numbers in international form (``+44 ...``) are found for every region.
    """

    mode: Literal["off", "record", "redact", "reject"] = "record"
    kinds: tuple[TextKind, ...] = TEXT_KINDS
    phone_region: str = Field(default="US", pattern=r"^[A-Z]{2}$")


class MetadataPrivacy(Frozen):
    """Metadata of released images (EXIF, XMP, IPTC, comments, text chunks).

    Released images carry none, whether re-encoded or kept as fetched (``skip_reencode``:
    the segments are removed without touching the pixels), except the EXIF fields named here.

    Args:
        keep: EXIF tag names kept (e.g. ``Copyright``, ``Artist``): descriptive fields of the
            first IFD only (``KEEPABLE`` above). ``Orientation`` is never kept
            (it is applied to the pixels), nor are GPS, maker notes, serial numbers or fields
            that embed other metadata. A kept field's text goes through ``privacy.text`` as a
            caption does: redacted in the written EXIF, recorded as ``exif:Artist``, or the
            sample refused.
    """

    keep: tuple[str, ...] = ()

    @field_validator("keep")
    @classmethod
    def _keepable(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        check_keep(v)  # raises ValueError naming a tag that is unknown or may not be kept
        return v


class PrivacyConfig(Frozen):
    """Privacy checks applied by the validation phase (and by fine-tuning's record checks)."""

    faces: FacePrivacy = FacePrivacy()
    text: TextPrivacy = TextPrivacy()
    metadata: MetadataPrivacy = MetadataPrivacy()
