"""Curation quality, issue 32: do the scores mean something? On the demo corpus, whose rows' truth is known.

``--phase curate`` with no filter; the alignment AUC of the mismatched captions, the watermark head's AUC, and the recall
of planted copies by embedding cosine beside pHash Hamming distance (the baseline) at equal precision.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

from harness.procs import BENCH_DIR, REPO
from harness.report import emit, parse, parser, table
from harness.servers import child_env
from harness.tools import run_command


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC: the chance a positive scores above a negative (ties count half)."""
    pos, neg = np.asarray(pos, float)[:, None], np.asarray(neg, float)[None, :]
    return float((pos > neg).mean() + 0.5 * (pos == neg).mean())


def best_recall(scores: np.ndarray, truth: np.ndarray, n_true: int, min_precision: float) -> tuple[float, float]:
    """(recall, threshold): the most true pairs found by ``score >= threshold`` with precision >= ``min_precision``."""
    order = np.argsort(-scores, kind="stable")
    tp = np.cumsum(truth[order])
    ok = (tp / np.arange(1, len(order) + 1)) >= min_precision - 1e-12
    ok &= np.r_[
        scores[order][1:] != scores[order][:-1], True
    ]  # only cut between distinct scores: a threshold keeps every tie
    if not ok.any():
        return 0.0, float("inf")
    best = int(np.argmax(np.where(ok, tp, -1)))
    return float(tp[best] / n_true), float(scores[order][best])


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, repeats=1)
    p.add_argument("--images", type=int, default=300, help="pictures of the demo corpus (default 300)")
    args = parse(p, argv)

    import pyarrow.parquet as pq

    from tasks.demo.corpus import prepare_demo

    demo = BENCH_DIR / "curation" / f"demo-{args.images}"
    server, expected = prepare_demo(demo, n=args.images, port=0)
    try:
        sets = [
            "validate.dedup.near=false",
            "validate.dedup.exact=false",
            "curate.alignment=null",
            "curate.heads.watermark.max=null",
            "curate.semdedup=null",
            "gates.curate.max_removed_rate=1",
        ]
        cmd = run_command(REPO / "recipes" / "demo.yaml", "curate", *sets)
        out = subprocess.run(
            cmd, env=child_env(SHARDSMITH_DEMO_DIR=str(demo)), capture_output=True, text=True, cwd=REPO
        )
        if out.returncode:
            print(out.stderr[-3000:])
            return 1
        result = json.loads(out.stdout)
    finally:
        server.stop()
    store = demo / "store"
    cur = [r for p in result["curate"]["ledgers"] for r in pq.read_table(store / p).to_pylist()]
    by_key = {r["key"]: r for r in cur}
    truth = {c["key"]: c for c in expected["curation"]}
    kinds = {k: c["kind"] for k, c in truth.items()}
    scores = {r["key"]: dict(r["scores"] or []) for r in cur}

    align = np.array([scores[k]["alignment"] for k in by_key])
    is_mis = np.array([kinds.get(k) == "mismatch" for k in by_key])
    a_auc = auc(align[~is_mis], align[is_mis])
    wm = np.array([scores[k]["watermark"] for k in by_key])
    is_wm = np.array([kinds.get(k) == "watermark" for k in by_key])
    w_auc = auc(wm[is_wm], wm[~is_wm])

    # Pairs: every pair of curated samples; the true ones are (copy, its original).
    val = [
        r
        for p in result["validate"]["ledgers"]
        for r in pq.read_table(store / p, columns=["key", "status", "phash"]).to_pylist()
    ]
    phash, vectors = {r["key"]: r["phash"] for r in val if r["status"] == "ok"}, {}
    for f in sorted((store / "demo" / "curate" / "embeddings").rglob("*.parquet")):
        t = pq.read_table(f, columns=["key", "image"])
        for k, v in zip(t.column("key").to_pylist(), t.column("image").to_pylist()):
            if v is not None and k in by_key:
                vectors[k] = np.asarray(v, np.float32)
    keys = sorted(k for k in by_key if k in vectors and k in phash)
    # The original of each copy, by picture name: the manifests say which row holds which picture.
    original_key = _original_keys(demo, expected)
    true_pairs = {
        frozenset((c, original_key[c]))
        for c, v in truth.items()
        if v["kind"] == "copy" and c in vectors and original_key[c] in vectors
    }
    x = np.stack([vectors[k] for k in keys])
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ph = np.array([phash[k] for k in keys], dtype=np.uint64)
    iu = np.triu_indices(len(keys), 1)
    cos = (x @ x.T)[iu]
    ham = np.array([bin(int(a) ^ int(b)).count("1") for a, b in zip(ph[iu[0]], ph[iu[1]])])
    is_true = np.array([frozenset((keys[i], keys[j])) in true_pairs for i, j in zip(*iu)])
    n_true = len(true_pairs)

    rows = [
        (
            "alignment: ROC AUC of the mismatched captions (target >= 0.95)",
            f"**{a_auc:.3f}**",
            f"mismatched at most {align[is_mis].max():.3f}, others at least {align[~is_mis].min():.3f}",
        ),
        (
            "watermark head: ROC AUC of the watermarked",
            f"{w_auc:.3f}",
            f"marked at least {wm[is_wm].min():.3f}, others at most {wm[~is_wm].max():.3f}",
        ),
    ]
    for p in (1.0, 0.95, 0.9):
        r_e, t_e = best_recall(cos, is_true, n_true, p)
        r_p, t_p = best_recall(-ham.astype(float), is_true, n_true, p)
        rows.append(
            (
                f"copies found at precision >= {p:.2f}: embedding cosine / pHash (the baseline)",
                f"**{r_e / max(r_p, 1e-9):.2f}x**",
                f"recall {r_e:.3f} (cos >= {t_e:.4f}) / {r_p:.3f} (Hamming <= {-t_p:g}); target: recall >= 0.9, above pHash's",
            )
        )
    by_kind: dict[str, list[float]] = {}
    for c, v in truth.items():
        if v["kind"] == "copy" and c in vectors and original_key[c] in vectors:
            by_kind.setdefault(v["augmentation"], []).append(float(x[keys.index(c)] @ x[keys.index(original_key[c])]))
    lines = [
        f"The demo corpus of {args.images} pictures: {len(by_key)} curated samples, {len(cos):,} pairs; {int(is_mis.sum())} mismatched captions, "
        f"{n_true} copies, {int(is_wm.sum())} watermarked",
        "",
        *table(("figure", "value", "detail"), rows, "lrl"),
        "",
        "- copy cosine to its original: "
        + ", ".join(f"{k} {min(v):.3f}..{max(v):.3f}" for k, v in sorted(by_kind.items())),
        f"- distinct pairs' cosine: p99.9 {np.percentile(cos[~is_true], 99.9):.4f}, max {cos[~is_true].max():.4f}",
    ]
    emit("Do the scores mean something? (`bench_curation_quality.py`)", lines, argv, args.markdown)
    return 0


def _original_keys(demo: Path, expected: dict) -> dict[str, str]:
    """key of each copy -> key of the row holding its original picture (from the manifests)."""
    import gzip

    import pyarrow.parquet as pq

    rows: dict[str, list[str | None]] = {}
    text = (demo / "manifests" / "photos.csv").read_text().splitlines()[1:]
    rows["photos"] = [line.split(",")[0].rsplit("/", 1)[-1] if line else None for line in text]
    with gzip.open(demo / "manifests" / "art.jsonl.gz", "rt") as fh:
        art = []
        for line in fh:
            try:
                art.append((json.loads(line).get("url") or "").rsplit("/", 1)[-1])
            except ValueError:
                art.append(None)
        rows["art"] = art
    rows["scans"] = [
        (u or "").rsplit("/", 1)[-1]
        for u in pq.read_table(demo / "manifests" / "scans.parquet").column("url").to_pylist()
    ]
    where = {name: f"{src}-{i:09d}" for src, names in rows.items() for i, name in enumerate(names) if name}
    return {c["key"]: where[c["original"]] for c in expected["curation"] if c["kind"] == "copy"}


if __name__ == "__main__":
    raise SystemExit(main())
