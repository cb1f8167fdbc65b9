"""The fine-tuning demo corpus: generated conversations over the demo images, plus text-only records."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tasks.demo.images import ImageInfo, atomic_write, ensure_images

RECORDS_FILE = "finetune/records.jsonl"
TEXT_FILE = "finetune/text-only.json"
EXPECTED_FILE = "finetune/EXPECTED.json"

_QUESTIONS = (
    "Describe this image.",
    "What do you see in the picture?",
    "What is shown here?",
    "Give a short caption for this image.",
)
_FOLLOW_UPS = (
    ("Is it day or night?", "It looks like {when}."),
    ("How many shapes are there?", "I count the shapes described: {caption}"),
)
_FACTS = (
    ("What is {a} plus {b}?", "{a} plus {b} is {s}."),
    ("Name a colour between red and yellow.", "Orange lies between red and yellow."),
    ("Write one sentence about the sea.", "The sea covers most of the planet and moves with the tides."),
    ("Spell the word 'shard' backwards.", "Backwards, 'shard' is 'drahs'."),
)
# Deliberately bad records (after every 10th good one), and the reason each must get.
BAD = (
    (
        {
            "id": "bad-tag",  # the tiler's <img> as text: it would read as an image's start
            "conversations": [
                {"from": "human", "value": "What does the <img> tag do in HTML?"},
                {"from": "gpt", "value": "It embeds an image in the page."},
            ],
        },
        "conversation_reserved_tag",
    ),
    (
        {"id": "bad-roles", "conversations": [{"from": "gpt", "value": "Hi"}, {"from": "human", "value": "Hello"}]},
        "conversation_roles",
    ),
    (
        {
            "id": "bad-placeholder",
            "image": "images/{img}",
            "conversations": [{"from": "human", "value": "What is this?"}, {"from": "gpt", "value": "A picture."}],
        },
        "placeholder_mismatch",
    ),
    (
        {"id": "bad-empty", "conversations": [{"from": "human", "value": "Tell me."}, {"from": "gpt", "value": "   "}]},
        "conversation_empty_turn",
    ),
    (
        {
            "id": "bad-missing-file",
            "image": "images/does-not-exist.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat is this?"},
                {"from": "gpt", "value": "Nothing."},
            ],
        },
        "image_failed",
    ),
    ("{not json", "unparsable_row"),
)


def _when(caption: str) -> str:
    for word in ("dawn", "morning", "noon", "dusk", "night", "overcast"):
        if word in caption:
            return "night" if word == "night" else "day"
    return "day"


def _image_record(i: int, info: ImageInfo, extra: ImageInfo | None, rng: np.random.Generator) -> dict[str, Any]:
    q = _QUESTIONS[int(rng.integers(len(_QUESTIONS)))]
    turns = [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": info.caption}]
    images = [f"images/{info.name}"]
    if extra is not None:  # two images in one record, the second asked about in a later turn
        turns += [{"from": "human", "value": "<image>\nAnd this one?"}, {"from": "gpt", "value": extra.caption}]
        images.append(f"images/{extra.name}")
    elif rng.random() < 0.4:
        fq, fa = _FOLLOW_UPS[int(rng.integers(len(_FOLLOW_UPS)))]
        turns += [
            {"from": "human", "value": fq},
            {"from": "gpt", "value": fa.format(when=_when(info.caption), caption=info.caption)},
        ]
    rec: dict[str, Any] = {
        "id": f"img-{i:04d}",
        "image": images if len(images) > 1 else images[0],
        "conversations": turns,
    }
    if info.license:
        rec["license"] = info.license
    return rec


# Every fourth text-only record's question, from the third on, carries an e-mail address
# (redacted by the recipe's ``privacy.text``); the release must not hold the address itself.
PERSONAL_FIRST, PERSONAL_EVERY, PERSONAL_ADDRESS = 2, 4, "ana.reyes@example.org"


def _text_record(i: int, rng: np.random.Generator) -> dict[str, Any]:
    q, a = _FACTS[i % len(_FACTS)]
    x, y = int(rng.integers(2, 99)), int(rng.integers(2, 99))
    question = q.format(a=x, b=y)
    if i % PERSONAL_EVERY == PERSONAL_FIRST:
        question = f"I am {PERSONAL_ADDRESS}. {question}"
    turns = [{"from": "human", "value": question}, {"from": "gpt", "value": a.format(a=x, b=y, s=x + y)}]
    return {"id": f"txt-{i:04d}", "conversations": turns}


def write_finetune_corpus(out_dir: Path, n: int = 60, seed: int = 0, text_only: int = 30) -> dict[str, Any]:
    """Write ``finetune/records.jsonl`` (image records + bad rows) and ``finetune/text-only.json``.

    Images are the demo corpus's (``images/``, made if missing), referenced by relative path,
    so the recipe reads them as ``file://`` URLs under ``download.network.file_root``. Returns
    (and writes to ``finetune/EXPECTED.json``) the records per file and the conversation-level
    reasons the run must report.
    """
    from tasks.demo.models import make_all

    out_dir = Path(out_dir)
    images = ensure_images(out_dir, n, seed)
    make_all(out_dir / "models", ("clip",))  # the dual encoder recipes/demo-finetune.yaml curates with
    (out_dir / "finetune").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 7)
    lines: list[str] = []
    expected: dict[str, Any] = {"records": {}, "by_reason": {}}
    bad = iter(BAD)
    for i, info in enumerate(images):
        extra = images[(i + 1) % len(images)] if i % 7 == 3 else None
        lines.append(json.dumps(_image_record(i, info, extra, rng)))
        if i % 10 == 9:
            item = next(bad, None)
            if item is not None:
                rec, reason = item
                lines.append(rec if isinstance(rec, str) else json.dumps(rec).replace("{img}", info.name))
                expected["by_reason"][reason] = expected["by_reason"].get(reason, 0) + 1
    expected["curation"] = _curation_records(out_dir, images, lines, seed)
    atomic_write(out_dir / RECORDS_FILE, ("\n".join(lines) + "\n").encode())
    texts = [_text_record(i, rng) for i in range(text_only)]
    atomic_write(out_dir / TEXT_FILE, json.dumps(texts, indent=1).encode())
    expected["records"] = {"chat": len(lines), "text": len(texts)}
    atomic_write(out_dir / EXPECTED_FILE, json.dumps(expected, indent=2, sort_keys=True).encode())
    return expected


def _curation_records(out_dir: Path, images: list[ImageInfo], lines: list[str], seed: int) -> list[dict[str, Any]]:
    """Records curation must remove, appended to ``lines``: replies that describe another picture,
    and copies of earlier records' pictures (crop, flip, overlay). Returns their EXPECTED entries."""
    import io

    from PIL import Image

    from tasks.demo.copies import make_copy
    from tasks.demo.curation_rows import ALLOWED, content_words, rgb, save_jpeg
    from tasks.demo.images import render_image
    from tasks.policies.licenses import normalize_license

    rng = np.random.default_rng([seed, 33])
    out: list[dict[str, Any]] = []

    def add(rec: dict[str, Any], kind: str, reasons: list[str], original: str | None) -> None:
        out.append({"id": rec["id"], "row": len(lines), "kind": kind, "reasons": reasons, "original": original})
        lines.append(json.dumps(rec))

    def record(rid: str, name: str, answer: str) -> dict[str, Any]:
        turns = [{"from": "human", "value": "<image>\nDescribe this image."}, {"from": "gpt", "value": answer}]
        return {"id": rid, "image": f"images/{name}", "conversations": turns, "license": "CC0-1.0"}

    for n in range(3):
        _, data, meta = render_image(seed, 950_000 + n)
        other = next(
            i for i in images[n * 5 :] + images if not (content_words(i.caption) & content_words(meta["caption"]))
        )
        with Image.open(io.BytesIO(data)) as src:
            info = save_jpeg(
                out_dir / "images", f"cur-ft-mismatch-{n:02d}.jpg", rgb(src), {**meta, "caption": other.caption}, 0
            )
        add(record(f"mismatch-{n}", info.name, other.caption), "mismatch", ["low_alignment"], other.name)
    # Copies of pictures earlier single-image records show with an allowed license.
    shown = [i for k, i in enumerate(images) if k % 7 != 3 and normalize_license(i.license) in ALLOWED]
    for n, (info, kind) in enumerate(zip(shown[1::4], ("crop", "flip", "overlay"))):
        with Image.open(out_dir / "images" / info.name) as src:
            img = make_copy(rgb(src), kind, rng)
        copy = save_jpeg(
            out_dir / "images",
            f"cur-ft-copy-{n:02d}.jpg",
            img,
            {"caption": info.caption, "license": "CC0-1.0", "author": info.author},
            0,
        )
        add(
            record(f"copy-{n}", copy.name, info.caption), "copy", ["image_rejected", "semantic_duplicate_of"], info.name
        )
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "shardsmith-demo")
    print(json.dumps(write_finetune_corpus(target), indent=2))
