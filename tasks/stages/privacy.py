"""The recipe's face check as validation applies it to the pixels of one image.

tasks/models/faces.py finds the faces in the image as it is to be released (after resizing);
``record`` writes their boxes into the json, ``blur`` blurs them in the released image,
``reject`` refuses the sample (``face_present``). Under ``blur`` an image with more faces than
``max_faces`` is refused: it would be released with faces that were not blurred. A video clip
is looked at in ``clip_frames`` frames spread through it (3: a quarter, half and three quarters
through; the middle one is the keyframe released beside its mp4; ``clip_faces``): its faces are
recorded, or the clip is refused under ``reject``, and under ``blur`` too, since a clip's frames
are not blurred. The text check is tasks/policies/privacy.py.
"""

from __future__ import annotations

import io
import json
from typing import Any

from PIL import Image

from tasks.formats.reasons import status_of
from tasks.formats.recipe_privacy import FacePrivacy, PrivacyConfig
from tasks.policies.images import PixelVerdict

FACE_PRESENT = "face_present"


class FaceLook:
    """The face check as ``process_image``'s look: boxes found, blurred or refused."""

    def __init__(self, rules: FacePrivacy):
        from tasks.models.faces import face_detector

        self.rules = rules
        self.detector = face_detector(rules)  # one per process and rules; its cascade one per thread

    def __call__(self, image: Image.Image) -> PixelVerdict:
        from tasks.models.faces import blur_faces

        faces, found = self.detector.detect(image)
        facts: dict[str, Any] = {
            "faces": [{"box": [f.x, f.y, f.w, f.h], "score": round(float(f.score), 3)} for f in faces],
            "faces_found": found,
            # the smallest face looked for, in these pixels: min_size, or more in a large image
            "faces_min_size": self.detector.smallest_face(*image.size),
        }
        if not faces:
            return PixelVerdict(facts=facts)
        mode = self.rules.mode
        largest = faces[0]
        box = f"{largest.w}x{largest.h} at ({largest.x}, {largest.y})"
        if mode == "reject":
            detail = f"{found} face{'s' if found != 1 else ''} found, the largest {box}"
            return PixelVerdict(FACE_PRESENT, detail, image=blur_faces(image, faces), facts=facts)
        if mode == "blur" and found > len(faces):
            detail = f"{found} faces found > privacy.faces.max_faces {self.rules.max_faces}: not all can be blurred"
            return PixelVerdict(FACE_PRESENT, detail, image=blur_faces(image, faces), facts=facts)
        if mode == "blur":
            return PixelVerdict(image=blur_faces(image, faces), facts=facts)
        return PixelVerdict(facts=facts)


def face_look(cfg: PrivacyConfig) -> FaceLook | None:
    """The look ``process_image`` gets, or None where faces are not looked for."""
    return None if cfg.faces.mode == "off" else FaceLook(cfg.faces)


def hides_faces(look: FaceLook | None) -> FaceLook | None:
    """``look`` where it hides faces (``blur``, ``reject``): what a thumbnail of a sample refused
    before its face check goes through, so that the report shows no face the release would not."""
    return look if look is not None and look.rules.mode in ("blur", "reject") else None


def shown_blurred(look: FaceLook | None, jpeg: bytes) -> bytes:
    """A report thumbnail (JPEG bytes) with the faces ``look`` finds blurred, where it hides faces."""
    look = hides_faces(look)
    if look is None:
        return jpeg
    from tasks.models.faces import blur_faces

    with Image.open(io.BytesIO(jpeg)) as img:
        rgb = img.convert("RGB")
    faces, _ = look.detector.detect(rgb)
    if not faces:
        return jpeg
    out = io.BytesIO()
    blur_faces(rgb, faces).save(out, "JPEG", quality=85)
    return out.getvalue()


def clip_faces(
    look: FaceLook,
    row: dict[str, Any],
    members: dict[str, bytes],
    stills: tuple[tuple[str, Image.Image], ...] = (),
) -> tuple[dict[str, Any], dict[str, bytes] | None, bytes | None]:
    """A kept clip after the face check of its keyframe (``members["jpg"]``, its middle frame)
    and ``stills`` (its other frames looked at, by their share of the way through:
    ``privacy.faces.clip_frames``): (its row, its members or None when refused, a thumbnail of
    the frame with the faces blurred when refused).

    The row's ``faces`` is the most faces one frame shows; the clip's json gets the keyframe's
    boxes (``faces``, in its pixels), ``faces_found`` and ``faces_frames`` (faces per frame
    looked at, by its share of the way through: ``0.25``, ``0.5``, ``0.75`` for 3 frames). Under
    ``reject``, and under ``blur`` (the mp4's frames are released as they are), a clip with a
    face in any of these frames is refused (``face_present``), for the earliest such frame.
    """
    with Image.open(io.BytesIO(members["jpg"])) as img:
        frames = {"0.5": img.convert("RGB")}
    frames.update(stills)
    verdicts = {at: look(frame) for at, frame in sorted(frames.items())}
    counts = {at: v.facts["faces_found"] for at, v in verdicts.items()}
    row = {**row, "faces": max(counts.values())}
    for at, verdict in verdicts.items():
        reason, detail, facts = verdict.reason, verdict.detail, verdict.facts
        if reason is None and facts["faces"] and look.rules.mode == "blur":
            largest = facts["faces"][0]["box"]
            reason = FACE_PRESENT
            detail = (
                f"{facts['faces_found']} face(s), the largest {largest[2]}x{largest[3]}:"
                " a clip's frames are not blurred, so privacy.faces: blur refuses it"
            )
        if reason is not None:
            thumb = io.BytesIO()
            (verdict.image if verdict.image is not None else frames[at]).save(thumb, "JPEG", quality=85)
            where = "keyframe" if at == "0.5" else f"frame {at} of the way through"
            refused = {**row, "status": status_of(reason), "reason": reason, "detail": f"{where}: {detail}"}
            return {**refused, "bytes": None, "sha256": None}, None, thumb.getvalue()
    meta = json.loads(members["json"])
    middle = verdicts["0.5"].facts
    meta.update(
        faces=middle["faces"], faces_found=row["faces"], faces_frames=counts, faces_min_size=middle["faces_min_size"]
    )
    return row, {**members, "json": json.dumps(meta, ensure_ascii=False, sort_keys=True).encode()}, None
