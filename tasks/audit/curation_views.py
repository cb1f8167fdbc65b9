"""What the report shows of curation: each score's histogram with its cut, samples per score decile, duplicate groups."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pyarrow as pa

from tasks.formats.ledger import read_parquet, read_tables, write_parquet
from tasks.formats.storage import Storage

CURATION_JSON = "curation.json"
CURATION_THUMBS = "curation-thumbs.parquet"
PER_DECILE = 3  # samples shown per decile of each score
GROUPS = 12  # duplicate groups shown
THUMB_SIDE = 112
# A cut's label (font-size 10 in plots.svg.j2): an upper bound of its characters' width, its
# gap to the cut's line and to the plot's edge, and the lines between two cuts' labels.
CUT_CHAR_W = 6.0
CUT_GAP = 3.0
CUT_LINE = 12


def _thumbnail(data: bytes, side: int = THUMB_SIDE) -> bytes | None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as src:
            src.draft("RGB", (side * 2, side * 2))
            img = src.convert("RGB")
            img.thumbnail((side, side))
            out = io.BytesIO()
            img.save(out, "JPEG", quality=80)
            return out.getvalue()
    except Exception:  # noqa: BLE001 - a sample the report cannot draw is shown without a picture
        return None


def build_curation_views(
    storage: Storage, shards: list[tuple[str, str, str]], cuts: list[dict[str, Any]], names: list[str], model: str
) -> tuple[dict[str, Any], pa.Table]:
    """The report's curation data and its thumbnails, from each shard's (validated tar, ledger, fates).

    Deciles: per score, ``PER_DECILE`` samples of each tenth of the scored samples, spread over
    it by value from its lowest (ties ordered by key, so the same data gives the same page).
    Groups: the largest semantic-duplicate groups, the kept sample first.
    """
    fates = read_tables(storage, [f for _, _, f in shards])
    ledgers = read_tables(storage, [led for _, led, _ in shards], ["key", "status", "members"])
    where: dict[str, tuple[str, dict[str, Any]]] = {}
    for tar, led, _ in shards:
        for r in ledgers[led].to_pylist():
            if r["status"] == "ok":
                where[r["key"]] = (tar, r)
    table = pa.concat_tables([fates[f] for _, _, f in shards], promote_options="default") if shards else None
    rows = table.to_pylist() if table is not None else []
    data: dict[str, Any] = {"model": model, "samples": len(rows), "scores": [], "deciles": {}, "groups": []}
    wanted: set[str] = set()
    by_cut = {c["name"]: c for c in cuts}
    for name in names:
        scored = sorted((r for r in rows if r.get(name) is not None), key=lambda r: (r[name], r["key"]))
        values = np.array([r[name] for r in scored], dtype=float)
        cut = by_cut.get(name, {})
        data["scores"].append(
            {
                "name": name,
                "n": len(scored),
                "mean": float(values.mean()) if len(values) else None,
                "values": _spread(values).round(5).tolist(),
                "low": cut.get("low"),
                "high": cut.get("high"),
                "rule": cut.get("rule", ""),
                "removed": sum(1 for r in scored if (r["reason"] or "").startswith(_prefix(name, cut))),
            }
        )
        deciles = []
        for d in range(10):
            part = scored[d * len(scored) // 10 : (d + 1) * len(scored) // 10]
            if not part:
                continue
            # spread over the decile by value, lowest first: the first decile's first thumbnails
            # are the lowest scores, where a low cut bites
            shown = [part[i * len(part) // PER_DECILE] for i in range(min(PER_DECILE, len(part)))]
            wanted.update(r["key"] for r in shown)
            deciles.append(
                {
                    "decile": d + 1,
                    "lo": part[0][name],
                    "hi": part[-1][name],
                    "samples": [{"key": r["key"], "value": r[name], "reason": r["reason"]} for r in shown],
                }
            )
        data["deciles"][name] = deciles
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("duplicate_of"):
            groups.setdefault(r["duplicate_of"], []).append(r)
    for kept, dups in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:GROUPS]:
        dups = sorted(dups, key=lambda r: r["key"])
        wanted.update([kept, *(r["key"] for r in dups)])
        data["groups"].append(
            {
                "kept": kept,
                "members": [{"key": r["key"], "similarity": r["similarity"], "reason": r["reason"]} for r in dups],
            }
        )
    return data, _thumbs(storage, where, wanted)


def _spread(sorted_values: np.ndarray, cap: int = 20_000) -> np.ndarray:
    """At most ``cap`` of the sorted values at evenly spaced ranks: the histogram keeps its shape
    (each bin within 1/cap of its share) while the page stays small for a million samples."""
    if len(sorted_values) <= cap:
        return sorted_values
    return sorted_values[np.linspace(0, len(sorted_values) - 1, cap).round().astype(int)]


def _prefix(name: str, cut: dict[str, Any]) -> str:
    from tasks.curate.scores import reason_for

    return reason_for(name, "low" if cut.get("low") is not None else "high")


def _thumbs(storage: Storage, where: dict[str, tuple[str, dict[str, Any]]], keys: set[str]) -> pa.Table:
    """key, caption and thumbnail of each sample the page shows, read from the validated shards."""
    out = []
    by_tar: dict[str, list[dict[str, Any]]] = {}
    for key in sorted(keys):
        if key in where:
            by_tar.setdefault(where[key][0], []).append(where[key][1])
    for tar, rows in sorted(by_tar.items()):
        for r, got in zip(rows, _members(storage, tar, rows, ("txt", "jpg", "jpeg", "png", "webp"))):
            caption = got.pop("txt").decode("utf-8", "replace") if "txt" in got else None
            image = next(reversed(got.values()), b"")
            out.append({"key": r["key"], "caption": caption, "thumbnail": _thumbnail(image)})
    schema = pa.schema([("key", pa.string()), ("caption", pa.string()), ("thumbnail", pa.binary())])
    return pa.Table.from_pylist(out, schema=schema)


def _members(storage: Storage, tar: str, rows: list[dict[str, Any]], exts: tuple[str, ...]) -> list[dict[str, bytes]]:
    """Of each ledger row of a sample in ``tar``, its members whose extension is one of ``exts``
    (extension -> bytes; the last of an extension), read by the offsets the row records."""
    out = []
    with storage.open(tar, "rb") as fh:
        for r in rows:
            got: dict[str, bytes] = {}
            for m in r["members"]:
                ext = m["name"].rsplit(".", 1)[-1]
                if ext in exts:
                    fh.seek(m["offset"])
                    got[ext] = fh.read(m["size"])
            out.append(got)
    return out


def member_thumbnails(
    storage: Storage, rows: list[dict[str, Any]], exts: tuple[str, ...], side: int = THUMB_SIDE
) -> dict[str, bytes]:
    """Thumbnails (JPEG, long side ``side``) of the first member of ``exts`` of each sample, by
    key, from ledger rows (key, shard, members); a sample without one, whose image does not
    decode or whose shard is gone, has none."""
    by_tar: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["shard"] and r["members"]:
            by_tar.setdefault(r["shard"], []).append(r)
    out: dict[str, bytes] = {}
    for tar, mine in sorted(by_tar.items()):
        try:
            members = _members(storage, tar, mine, exts)
        except FileNotFoundError:  # a work shard deleted since: its samples are shown without
            continue
        for r, got in zip(mine, members):
            data = next((got[e] for e in exts if e in got), None)
            thumb = _thumbnail(data, side) if data is not None else None
            if thumb is not None:
                out[r["key"]] = thumb
    return out


def write_curation_files(storage: Storage, rel_dir: str, data: dict[str, Any], thumbs: pa.Table) -> dict[str, str]:
    """Write the curation data beside the run's report; returns the report's links to them."""
    storage.write_bytes(f"{rel_dir}/{CURATION_JSON}", json.dumps(data, sort_keys=True).encode())
    write_parquet(storage, f"{rel_dir}/{CURATION_THUMBS}", thumbs)
    return {"curation": CURATION_JSON}


def read_curation(storage: Storage, rel_dir: str) -> tuple[dict[str, Any], pa.Table] | None:
    """What ``write_curation_files`` wrote for the run, or ``None`` for a run without curation."""
    rel = f"{rel_dir}/{CURATION_JSON}"
    if not storage.exists(rel):
        return None
    return json.loads(storage.read_bytes(rel)), read_parquet(storage, f"{rel_dir}/{CURATION_THUMBS}")


def _cut_label(x: float, text: str, width: float, side: str) -> dict[str, Any]:
    """Where a cut's label stands: beside its line, on the side of what the cut keeps (a low
    cut's label to its right, a high cut's to its left), and on the other side where that side
    has no room, so that the whole label stays inside the plot's ``width``."""
    w = CUT_CHAR_W * len(text)
    right_fits = x + CUT_GAP + w <= width - CUT_GAP
    left_fits = x - CUT_GAP - w >= CUT_GAP
    if (side == "low" and right_fits) or (side != "low" and not left_fits and right_fits):
        return {"label_x": f"{x + CUT_GAP:.2f}", "anchor": "start"}
    if left_fits:
        return {"label_x": f"{x - CUT_GAP:.2f}", "anchor": "end"}
    return {"label_x": f"{CUT_GAP:.2f}", "anchor": "start"}  # wider than either side: from the edge


def curation_view(curation: tuple[dict[str, Any], pa.Table] | None) -> dict[str, Any] | None:
    """The report template's curation section: histograms with cuts, decile strips, groups."""
    from tasks.audit.report_views import _histogram, fmt_num

    if curation is None:
        return None
    data, thumbs = curation
    pics = {r["key"]: r for r in thumbs.to_pylist()}

    def fig(key: str, **extra: Any) -> dict[str, Any]:
        p = pics.get(key, {})
        thumb = p.get("thumbnail")
        uri = "data:image/jpeg;base64," + base64.b64encode(thumb).decode("ascii") if thumb else None
        caption = p.get("caption")
        if isinstance(caption, str) and len(caption) > 120:
            caption = caption[:120] + "..."
        return {"key": key, "uri": uri, "caption": caption, "reason": None, "value": None, **extra}

    scores = []
    for s in data["scores"]:
        # The title is the score's name: a standalone plot adds the count itself (plots.svg.j2).
        h = _histogram(s["name"], s["name"], np.array(s["values"], dtype=float), False)
        if s["n"]:
            lo, hi = float(h["bars"][0]["lo"]), float(h["bars"][-1]["hi"])
            span = (hi - lo) or 1.0
            h["cuts"] = []
            for side, v in (("low", s["low"]), ("high", s["high"])):
                if v is None:
                    continue
                x = h["left"] + (h["right"] - h["left"]) * (min(max(v, lo), hi) - lo) / span
                text = f"{side} cut {fmt_num(v)}"
                # one line per cut, so a low and a high cut close together do not overwrite each other
                y = h["top"] + 2 + CUT_LINE * len(h["cuts"])
                h["cuts"].append({"x": f"{x:.2f}", "text": text, "y": y, **_cut_label(x, text, h["width"], side)})
        deciles = [
            {
                **d,
                "lo_text": fmt_num(d["lo"]),
                "hi_text": fmt_num(d["hi"]),
                "figs": [fig(x["key"], value=fmt_num(x["value"]), reason=x["reason"]) for x in d["samples"]],
            }
            for d in data["deciles"].get(s["name"], [])
        ]
        scores.append(
            {
                "name": s["name"],
                "hist": h,
                "rule": s["rule"],
                "removed": s["removed"],
                "mean": fmt_num(s["mean"]) if s["mean"] is not None else "-",
                "deciles": deciles,
            }
        )
    groups = [
        {
            "kept": fig(g["kept"]),
            "members": [fig(m["key"], similarity=fmt_num(m["similarity"]), reason=m["reason"]) for m in g["members"]],
        }
        for g in data["groups"]
    ]
    return {"model": data["model"][:16], "samples": data["samples"], "scores": scores, "groups": groups}
