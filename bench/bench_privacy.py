"""The privacy checks beside the validation work they join, on one thread (issue 43).

- faces: ``FaceDetector.detect`` (MTCNN; also with a GPU's pyramid and crops, made by torch,
  run on the CPU) and, as the baseline, OpenCV's Haar cascade on decoded
  pixels beside ``process_image(data, ImageRules())`` on the same JPEGs, and validation's real
  pass over a tar of them with faces off and on (CPU time); one thread. Recall and precision at
  IoU >= 0.4 on tasks/demo/faces.py's labelled set (scikit-image's photographs and LFW faces,
  and generated pictures), for each ``min_score`` and ``min_size``.
- text: ``find_personal`` beside caption cleanup (``caption_verdict``) on captions of LAION's
  length distribution; false cards and IBANs among random strings that fail their checksums.
- metadata: ``process_image`` with ``skip_reencode`` with and without stripping (alternated per
  image), and the pixels and pixel key it keeps.

    .venv/bin/python bench/bench_privacy.py --stage faces|text|metadata [--repeats 3]
"""

from __future__ import annotations

import contextlib
import io
import math
import random
import re
import statistics
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from PIL import Image

from harness import report
from tasks.formats.recipe_download import CaptionRules, ImageRules
from tasks.formats.recipe_privacy import FacePrivacy, TextPrivacy
from tasks.policies import images
from tasks.policies.images import process_image


def best_of(repeats: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def jpeg(img: Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, **save)
    return buf.getvalue()


# --------------------------------------------------------------------------------------- faces


def validation_phase(tmp: Path, jpegs: list[bytes], faces: dict | None, image: dict | None = None) -> float:
    """CPU seconds of validation's real pass (``download_and_validate`` over an ingested tar of
    ``jpegs``: read, license and caption checks, decode, resize, encode, shard and ledger) with
    ``privacy.faces`` set to ``faces`` (None: off) and ``validate.image`` to ``image`` (None: the defaults)."""
    from functools import partial

    from tasks.formats.recipe import parse_recipe
    from tasks.formats.shards import ShardWriter
    from tasks.formats.storage import Storage
    from tasks.sources import ingest_rows, plan_ingest
    from tasks.stages.download import shard_paths
    from tasks.stages.onepass import download_and_validate
    from tasks.stages.validate import candidate_paths

    run = tmp / ("faces" if faces else "off")
    (run / "in").mkdir(parents=True)
    with open(run / "in" / "00000.tar", "wb") as fh, ShardWriter(fh) as tar:
        for i, data in enumerate(jpegs):
            tar.write_sample(f"{i:05d}", {"jpg": data, "txt": b"a picture", "json": b'{"license": "CC0-1.0"}'})
    privacy = {"text": {"mode": "off"}, **({"faces": faces} if faces else {})}
    source = {"name": "s", "manifest": str(run / "in"), "kind": "webdataset"}
    recipe = parse_recipe(
        {
            "dataset": "b",
            "storage": str(run / "out"),
            "sources": [source],
            "privacy": privacy,
            "validate": {"license": {"allow": ["CC0-1.0"]}, **({"image": image} if image else {})},
        }
    )
    ref = plan_ingest(recipe.sources[0]).chunks[0]
    down = shard_paths("b", ref, "cfg")
    cand = candidate_paths("b", ref.source, ref.index, down[0], "v")
    rows = partial(ingest_rows, recipe.sources[0])
    start = time.process_time()
    download_and_validate(
        ref, Storage(str(run / "out")), recipe.download_for("s"), recipe.validate_, down, cand, None, rows
    )
    return time.process_time() - start


def haar(min_size: int) -> Callable[[Image.Image], list[tuple[int, int, int, int]]]:
    """The baseline: OpenCV's Haar cascade ``frontalface_alt2`` as shardsmith ran it before MTCNN
    (a grey copy of at most 640 px, OpenCV's default scale step 1.1 and 3 neighbours)."""
    import cv2
    import cv2.data

    cascade = cv2.CascadeClassifier(cv2.data.haarcascades + "haarcascade_frontalface_alt2.xml")

    def detect(img: Image.Image) -> list[tuple[int, int, int, int]]:
        scale = min(1.0, 640 / max(img.size), 20 / min_size)
        grey = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.BOX).convert("L")
        found = cascade.detectMultiScale(np.asarray(grey), scaleFactor=1.1, minNeighbors=3, minSize=(20, 20))
        boxes = [tuple(round(v / scale) for v in box) for box in np.asarray(found).reshape(-1, 4)]
        return [b for b in boxes if max(b[2:]) >= min_size]

    return detect


def scored(items, detect: Callable[[Image.Image], list], groups: Iterable[str], min_size: int) -> list[list]:
    """(group, faces, recall, precision) at IoU >= 0.4 of ``detect`` on ``items``, faces >= ``min_size``."""
    from tasks.demo.faces import iou, match

    rows = []
    found_by_item = [detect(item.rgb) for item in items]
    for group in groups:
        t = f = m = 0
        for item, found in zip(items, found_by_item):
            if group not in ("all", item.group):
                continue
            small = [b for b in item.boxes if max(b[2:]) < min_size]  # a face's size: its box's longer side
            found = [b for b in found if all(iou(b, s) < 0.4 for s in small)]
            truth = [b for b in item.boxes if max(b[2:]) >= min_size]
            t, f, m = t + len(truth), f + len(found), m + match(found, truth)
        rows.append([group, t, f"{m / max(t, 1):.3f}", f"{m / max(f, 1):.3f}"])
    return rows


def faces(args) -> list[str]:
    import tempfile

    import cv2
    import torch

    from tasks.demo.faces import labelled_set
    from tasks.models.faces import WORK_SIDE, FaceDetector, face_detector

    torch.set_num_threads(1)  # one worker thread, as a Dask worker runs (OMP_NUM_THREADS=1)
    cv2.setNumThreads(1)
    items = labelled_set(generated=args.images, lfw=args.images // 2)
    jpegs = [jpeg(item.rgb) for item in items if max(item.rgb.size) <= 1024]
    decoded = [Image.open(io.BytesIO(b)).convert("RGB") for b in jpegs]
    if args.gpu:
        return gpu_only(jpegs, decoded, args.repeats)
    detector = face_detector(FacePrivacy(mode="record", device="cpu"))
    detector.detect(decoded[0])  # the networks' load is not timed
    cascade = haar(20)
    base = best_of(args.repeats, lambda: [process_image(b, ImageRules()) for b in jpegs])
    look = best_of(args.repeats, lambda: [detector.detect(img) for img in decoded])
    old = best_of(args.repeats, lambda: [cascade(img) for img in decoded])
    # a GPU's path (the pyramid and the crops made by torch on the networks' device), here on the CPU
    torch_made = FaceDetector(FacePrivacy(mode="record", device="cpu"))
    torch_made.pixels_on_device = True
    by_torch = best_of(args.repeats, lambda: [torch_made.detect(img) for img in decoded])
    n, sides = len(jpegs), [max(img.size) for img in decoded]
    with tempfile.TemporaryDirectory() as tmp:
        phase_off = min(validation_phase(Path(tmp) / f"{r}", jpegs, None) for r in range(args.repeats))
        on = {"mode": "record", "device": "cpu"}
        phase_on = min(validation_phase(Path(tmp) / f"{r}", jpegs, on) for r in range(args.repeats))
        gpu = gpu_rows(Path(tmp), jpegs, decoded, args.repeats, phase_off) if torch.cuda.is_available() else []
        # img2dataset's defaults: each image released at 256 px (bordered), and faces looked for at that size
        small = {"resize_mode": "border", "image_size": 256}
        small_off = min(validation_phase(Path(tmp) / f"256-{r}", jpegs, None, small) for r in range(args.repeats))
        small_on = min(validation_phase(Path(tmp) / f"256-{r}", jpegs, on, small) for r in range(args.repeats))
    lines = [
        f"{n} JPEGs, long side {min(sides)}-{max(sides)} px (mean {np.mean(sides):.0f}); work cap {WORK_SIDE} px; "
        f"one thread; best of {args.repeats}",
        "",
    ]
    lines += report.table(
        ["work per image", "samples/s", "ms"],
        [
            ["`process_image` (decode, resize, encode)", report.fmt(n / base), report.fmt(base / n * 1e3)],
            ["face detection: MTCNN (shardsmith)", report.fmt(n / look), report.fmt(look / n * 1e3)],
            ["face detection: Haar cascade (baseline)", report.fmt(n / old), report.fmt(old / n * 1e3)],
            [
                "face detection: MTCNN, pyramid and crops by torch (a GPU's path)",
                report.fmt(n / by_torch),
                report.fmt(by_torch / n * 1e3),
            ],
            ["validation phase, faces off (CPU)", report.fmt(n / phase_off), report.fmt(phase_off / n * 1e3)],
            ["validation phase, faces on (CPU)", report.fmt(n / phase_on), report.fmt(phase_on / n * 1e3)],
            *gpu,
            [
                "validation phase at 256 px (`border`), faces off (CPU)",
                report.fmt(n / small_off),
                report.fmt(small_off / n * 1e3),
            ],
            [
                "validation phase at 256 px (`border`), faces on (CPU)",
                report.fmt(n / small_on),
                report.fmt(small_on / n * 1e3),
            ],
        ],
        "lrr",
    )
    lines += [
        "",
        f"**phase with faces on / off: {phase_off / phase_on:.2f}x** (target 0.7; released at 256 px, img2dataset's "
        f"default: {small_off / small_on:.2f}x); MTCNN / Haar time: "
        f"{look / old:.2f}x; `process_image` with each beside it: {base / (base + look):.2f}x / {base / (base + old):.2f}x",
        "",
    ]
    groups = ("photos", "lfw", "generated", "all")
    low = face_detector(FacePrivacy(mode="record", min_score=0.5, max_faces=1024))
    found = {id(img): low.detect(img)[0] for img in (item.rgb for item in items)}
    rows = []
    for min_score in (0.7, 0.8, 0.95):
        at = lambda img, cut=min_score: [(f.x, f.y, f.w, f.h) for f in found[id(img)] if f.score >= cut]  # noqa: E731
        rows += [[f"MTCNN, `min_score` {min_score}", *row] for row in scored(items, at, groups, 20)]
    rows += [["Haar cascade", *row] for row in scored(items, cascade, groups, 20)]
    lines += report.table(["detector", "group", "faces", "recall", "precision"], rows, "llrrr")
    return lines + ["", *by_min_size(items, decoded, args.repeats)]


def gpu_rows(tmp: Path, jpegs: list[bytes], decoded: list[Image.Image], repeats: int, phase_off: float) -> list[list]:
    """The detector on this machine's GPU (``device: cuda``): its wall time per image, and the
    validation phase's CPU time with it on (the CPU work that is left: decoding, crops, launches)."""
    import torch

    from tasks.models.faces import face_detector

    detector = face_detector(FacePrivacy(mode="record", device="cuda"))
    detector.detect(decoded[0])

    def look() -> None:
        for img in decoded:
            detector.detect(img)
        torch.cuda.synchronize()

    took, n = best_of(repeats, look), len(jpegs)
    on = {"mode": "record", "device": "cuda"}
    phase = min(validation_phase(tmp / f"gpu{r}", jpegs, on) for r in range(repeats))
    return [
        ["face detection: MTCNN on the GPU (wall)", report.fmt(n / took), report.fmt(took / n * 1e3)],
        [
            f"validation phase, faces on the GPU (CPU; {phase_off / phase:.2f}x)",
            report.fmt(n / phase),
            report.fmt(phase / n * 1e3),
        ],
    ]


def gpu_only(jpegs: list[bytes], decoded: list[Image.Image], repeats: int) -> list[str]:
    """``--gpu`` (``make gpu-check``): the validation phase without faces and with them on the
    GPU, and the detector's wall time there, alone."""
    import tempfile

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--gpu: torch sees no CUDA GPU here")
    with tempfile.TemporaryDirectory() as tmp:
        off = min(validation_phase(Path(tmp) / f"{r}", jpegs, None) for r in range(repeats))
        rows = gpu_rows(Path(tmp), jpegs, decoded, repeats, off)
    n = len(jpegs)
    head = [f"{n} JPEGs; one thread; best of {repeats}", ""]
    return head + report.table(
        ["work per image", "samples/s", "ms"],
        [["validation phase, faces off (CPU)", report.fmt(n / off), report.fmt(off / n * 1e3)], *rows],
        "lrr",
    )


def by_min_size(items, decoded, repeats: int) -> list[str]:
    """Detection time and recall for each ``min_size``: a larger one works on a smaller copy."""
    from tasks.models.faces import face_detector

    rows = []
    for min_size in (20, 32, 48):
        mtcnn = face_detector(FacePrivacy(mode="record", min_size=min_size, max_faces=1024, device="cpu"))
        detectors = {"MTCNN": lambda img, d=mtcnn: [(f.x, f.y, f.w, f.h) for f in d.detect(img)[0]]}
        for name, detect in {**detectors, "Haar cascade": haar(min_size)}.items():
            took = best_of(repeats, lambda detect=detect: [detect(img) for img in decoded])
            row = scored(items, detect, ["all"], min_size)[0]
            rows.append([min_size, name, row[1], report.fmt(took / len(decoded) * 1e3), row[2], row[3]])
    head = ["`min_size`", "detector", "faces >= min_size", "ms per image", "recall", "precision"]
    return report.table(head, rows, "rlrrrr")


# ---------------------------------------------------------------------------------------- text

WORDS = (
    "the a of and with in on for to at by from photo image picture view stock vector illustration background white "
    "black red blue green small large old new modern vintage beautiful happy young woman man girl boy dog cat house "
    "garden street city beach sea mountain forest tree flower table chair room kitchen wedding dress shoes bag cake "
    "food coffee car bike road sunset sky clouds light dark wooden metal glass art design pattern abstract logo icon"
).split()
NUMBERS = ("2019", "2024", "1920x1080", "$19.99", "5D", "Mark IV", "10 pcs", "3/4", "No. 7", "1080p", "2024-05-01")
PLANTED = (
    "mail john.doe{n}@example.com|call (650) 253-{n:04d}|+44 20 7946 0{n:03d}|card 4111 1111 1111 1111|"
    "IBAN DE89 3704 0044 0532 0130 00|from 93.184.{m}.34|https://cdn.example.com/i.jpg?token=a8F3kQ9zP{n}"
).split("|")
IBAN_BBAN = dict(
    i.split(":") for i in "DE:18n GB:4a14n FR:10n11c2n NL:4a10n IT:1a10n12c PL:24n AT:16n CH:5n12c".split()
)


def captions(n: int, rng: random.Random) -> list[str]:
    """Lognormal lengths (median ~50 characters), ~20% with a number, ~1% with personal data."""
    out = []
    for _ in range(n):
        target, words = min(600, max(8, int(rng.lognormvariate(math.log(50), 0.65)))), []
        while sum(len(w) + 1 for w in words) < target:
            words.append(rng.choice(WORDS))
        for share, pool in ((0.2, NUMBERS), (0.01, PLANTED)):
            if rng.random() < share:
                words.insert(
                    rng.randrange(len(words) + 1), rng.choice(pool).format(n=rng.randrange(1000), m=rng.randrange(256))
                )
        out.append(" ".join(words))
    return out


def luhn_ok(digits: str) -> bool:
    doubled = (int(ch) * (1 + i % 2) for i, ch in enumerate(reversed(digits)))
    return sum(d - 9 if d > 9 else d for d in doubled) % 10 == 0


def card_shaped(rng: random.Random, valid: bool) -> str:
    while luhn_ok(digits := "".join(rng.choices("0123456789", k=rng.randint(13, 19)))) != valid:
        pass
    return digits if rng.random() < 0.5 else " ".join(digits[i : i + 4] for i in range(0, len(digits), 4))


def iban_shaped(rng: random.Random, right: bool) -> str:
    country = rng.choice(list(IBAN_BBAN))
    chars = {"n": "0123456789", "a": "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "c": "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"}
    bban = "".join("".join(rng.choices(chars[k], k=int(c))) for c, k in re.findall(r"(\d+)([nac])", IBAN_BBAN[country]))
    check = 98 - int("".join(str(int(ch, 36)) for ch in bban + country + "00")) % 97
    if not right:  # any other two digits but those congruent mod 97 (00, 01, 99 pass too)
        check = rng.choice([c for c in range(100) if c % 97 != check % 97])
    return f"{country}{check:02d}{bban}"


def text(args) -> list[str]:
    from tasks.policies.captions import caption_verdict
    from tasks.policies.personal import find_personal

    rng = random.Random(43)
    texts, rules, clean = captions(args.captions, rng), TextPrivacy(), CaptionRules()
    base = best_of(args.repeats, lambda: [caption_verdict(t, clean) for t in texts])
    scan = best_of(args.repeats, lambda: [find_personal(t, rules) for t in texts])

    def found(strings: Iterable[str], kind: str) -> int:
        return sum(1 for s in strings if find_personal(s, TextPrivacy(kinds=(kind,))))

    n = args.strings
    lengths = sorted(len(t) for t in texts)
    rows = [
        ["caption cleanup (`caption_verdict`), captions/s", f"{len(texts) / base:,.0f}"],
        ["`find_personal`, every kind, captions/s", f"**{len(texts) / scan:,.0f}**"],
        ["scanning time / cleanup time", f"{scan / base:.2f}"],
        ["captions with a finding", sum(1 for t in texts if find_personal(t, rules))],
        [
            f"false cards in {n:,} Luhn-invalid 13-19 digit strings",
            found((card_shaped(rng, False) for _ in range(n)), "card"),
        ],
        [
            f"false IBANs in {n:,} IBAN-shaped strings with a wrong mod-97",
            found((iban_shaped(rng, False) for _ in range(n)), "iban"),
        ],
        [
            f"cards in {n:,} Luhn-valid random strings (issuer prefix and length decide)",
            found((card_shaped(rng, True) for _ in range(n)), "card"),
        ],
    ]
    rows += json_fields(texts, args.repeats)
    head = f"{len(texts):,} captions, median {statistics.median(lengths):.0f} characters, p99 {lengths[int(0.99 * (len(lengths) - 1))]}; best of {args.repeats}"
    return [head, "", *report.table(["measure", "value"], rows, "lr")]


def json_fields(texts: list[str], repeats: int) -> list[list]:
    """``check_fields`` on jsons as an ingested img2dataset shard gives them (its own json as
    ``upstream``, its parquet row as ``upstream_row``: a copy of the caption in each, an exif)."""
    from tasks.policies.privacy import check_fields

    def ingested(caption: str, i: int) -> dict:
        own = {
            "url": f"https://example.com/images/{i}.jpg",
            "caption": caption,
            "key": f"{i:09d}",
            "status": "success",
            "error_message": None,
            "width": 512,
            "height": 384,
            "exif": '{"Image Make": "Canon"}',
            "sha256": f"{i:064x}",
        }
        return {"key": own["key"], "url": own["url"], "caption": caption, "upstream": own, "upstream_row": dict(own)}

    metas = [ingested(t, i) for i, t in enumerate(texts[:20_000])]
    rules = TextPrivacy(mode="redact")
    took = best_of(repeats, lambda: [check_fields(m, rules) for m in metas])
    return [["json fields (`check_fields`), img2dataset-style jsons, us each", f"{took / len(metas) * 1e6:.1f}"]]


# ------------------------------------------------------------------------------------ metadata


def tagged(rng: np.random.Generator, fmt: str) -> bytes:
    """A 256-1024 px photo-like image with EXIF (GPS, a serial, a maker note) and XMP."""
    w, h = (int(v) for v in rng.integers(256, 1025, size=2))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([127 + 100 * np.sin(xx * 0.01 + c) * np.cos(yy * 0.007 - c) for c in (0.0, 1.0, 2.0)], -1)
    img = Image.fromarray(np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8))
    exif = Image.Exif()
    exif.update({0x010F: "BenchCam", 0x8298: "(c) bench", 0x0112: 1})
    exif.get_ifd(0x8825).update({1: "N", 2: (52.0, 22.0, 3.5)})
    exif.get_ifd(0x8769).update({0xA431: "SN-0042", 0x927C: rng.bytes(int(rng.integers(2000, 12000)))})
    xmp = b"<x:xmpmeta>" + b"<rdf:li>tag</rdf:li>" * int(rng.integers(100, 300)) + b"</x:xmpmeta>"
    buf = io.BytesIO()
    extra = {"quality": 90, "xmp": xmp} if fmt != "png" else {}
    img.save(buf, {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt], exif=exif.tobytes(), **extra)
    return buf.getvalue()


@contextlib.contextmanager
def unstripped():
    """images.py as before this change: bytes kept as fetched with their metadata."""
    real = images.metadata
    images.metadata = types.SimpleNamespace(strip_metadata=lambda d, f, *keep: d, metadata_kinds=lambda d, f: ())
    try:
        yield
    finally:
        images.metadata = real


def meta(args) -> list[str]:
    rng = np.random.default_rng(43)
    items = [
        (tagged(rng, f), ImageRules(skip_reencode=True, output_format=f))
        for f in ("jpeg", "png", "webp") * (args.images // 3)
    ]
    same = 0
    for data, rules in items:
        with unstripped():
            before = process_image(data, rules)
        after = process_image(data, rules)
        with Image.open(io.BytesIO(data)) as a, Image.open(io.BytesIO(after.data)) as b:
            same += (
                np.array_equal(np.asarray(a), np.asarray(b))
                and after.pixel_sha256 == before.pixel_sha256
                and b"SN-0042" not in after.data
            )
    spent = {"before": [], "stripped": []}
    for rnd in range(args.repeats):  # alternated image by image, so that drift hits both alike
        t = {"before": 0.0, "stripped": 0.0}
        for data, rules in items:
            for which in report.in_turn(["before", "stripped"], rnd):
                with unstripped() if which == "before" else contextlib.nullcontext():
                    t[which] -= time.perf_counter()
                    process_image(data, rules)
                    t[which] += time.perf_counter()
        for k in t:
            spent[k].append(len(items) / t[k])
    b, s = (statistics.median(spent[k]) for k in ("before", "stripped"))
    rows = [["`skip_reencode` as before", report.fmt(b)], ["`skip_reencode`, metadata stripped", report.fmt(s)]]
    return [
        f"{len(items)} images (JPEG, PNG, WebP), medians of {args.repeats} passes",
        "",
        *report.table(["run", "samples/s"], rows, "lr"),
        "",
        f"**ratio {s / b:.3f}** (target >= 0.95); same pixels and pixel key, metadata gone: {same}/{len(items)}",
    ]


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__)
    p.add_argument("--stage", choices=("faces", "text", "metadata"), required=True)
    p.add_argument("--images", type=int, default=60, help="faces: generated pictures; metadata: images")
    p.add_argument("--gpu", action="store_true", help="faces: only the GPU's rows (make gpu-check)")
    p.add_argument("--captions", type=int, default=200_000)
    p.add_argument("--strings", type=int, default=1_000_000, help="random card- and IBAN-shaped strings per set")
    args = report.parse(p, argv)
    run = {"faces": faces, "text": text, "metadata": meta}[args.stage]
    report.emit(f"Privacy: {args.stage}", run(args), argv, args.markdown)


if __name__ == "__main__":
    main()
