"""The recipe's face check as validation applies it to the pixels of one image.

tasks/models/faces.py finds the faces in the image as it is to be released (after resizing);
``record`` writes their boxes into the json, ``blur`` blurs them in the released image,
``reject`` refuses the sample (``face_present``). Under ``blur`` an image with more faces than
``max_faces`` is refused: it would be released with faces that were not blurred. The text
check is tasks/policies/privacy.py.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

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
