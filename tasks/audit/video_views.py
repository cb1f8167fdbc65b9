"""What the report shows of video sources: each source video's probed facts and clip fates, and strips of clip keyframes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats.ledger import COLUMNS, VIDEO_FACTS, read_ledgers
from tasks.formats.reasons import OK, original_of
from tasks.formats.storage import Storage

# Strips of keyframes: at most STRIP_VIDEOS videos, STRIP_CLIPS clips each, STRIP_SIDE px long side.
STRIP_VIDEOS = 8
STRIP_CLIPS = 12
STRIP_SIDE = 96
TABLE_ROWS = 10  # rows of a value table (resolutions, frame rates ...) before "other"
# The samples table's columns for videos (beside the thumbnail): the source video's key (a
# clip's video, or the video's own key on the one row of a video that gave no clip), the
# clip's span, the probe's facts, ``strip``: the rank of the clip's video among the strips
# (null for a clip no strip shows), and after the thumbnail ``keyframe``: the strip's picture.
STRIP = "strip"
KEYFRAME = "keyframe"  # the small keyframe of a clip a strip shows


def with_video_columns(
    base: pa.Table, ledger: pa.Table, video_sources: set[str], thumbs: dict[str, bytes]
) -> tuple[pa.Table, list[str]]:
    """``base`` (one row per ``ledger`` row) with the video columns, and the keys of the clips
    the strips show (``strip_keyframes`` gets their pictures); ``base`` as it is without videos.

    ``thumbs``: the keyframes validation kept of refused clips, by key; the strips prefer
    videos whose refused clips have one.
    """
    has_clips = "start_s" in ledger.column_names and pc.any(pc.is_valid(ledger.column("start_s"))).as_py()
    of_videos = pc.is_in(ledger.column("source"), pa.array(sorted(video_sources), pa.string()))
    if not has_clips and not pc.any(of_videos).as_py():
        return base, []

    def col(name: str) -> pa.ChunkedArray | pa.Array:
        return ledger.column(name) if name in ledger.column_names else pa.nulls(ledger.num_rows, COLUMNS[name])

    clip_video = col("video")
    # A video that gave no clip is its own row: its key names it.
    video = pc.if_else(pc.and_(of_videos, pc.is_null(clip_video)), ledger.column("key"), clip_video)
    start = col("start_s")
    base = base.append_column("video", video)
    base = base.append_column("start_s", start)
    base = base.append_column("clip_s", pc.subtract(col("end_s"), start))
    for name in VIDEO_FACTS:
        base = base.append_column(name, col(name))
    ranks = _strip_ranks(base, thumbs)
    shown = _strip_picks(base, ranks)
    strip = [ranks.get(v) if k in shown else None for k, v in zip(base["key"].to_pylist(), base["video"].to_pylist())]
    base = base.append_column(STRIP, pa.array(strip, pa.int32()))
    return base, sorted(shown)


def _clip_rows(samples: pa.Table) -> pa.Table:
    return samples.filter(pc.is_valid(samples.column("start_s")))


def _strip_ranks(samples: pa.Table, thumbs: dict[str, bytes]) -> dict[str, int]:
    """The videos the strips show, by rank: those with kept and refused clips first (both
    fates side by side), then refused only, then kept only; within each, those with fewest
    refused clips whose keyframe is lost (validation keeps a few per reason and shard; a
    duplicate's is in its candidate shard), then by key."""
    clips = _clip_rows(samples).select(["key", "video", "status", "reason"]).to_pylist()
    fates: dict[str, list[int]] = {}
    for c in clips:  # per video: kept, refused with a keyframe, refused without
        counts = fates.setdefault(c["video"], [0, 0, 0])
        counts[0 if c["status"] == OK else 1 if c["key"] in thumbs or _duplicate(c["reason"]) else 2] += 1

    def rank(item: tuple[str, list[int]]) -> tuple[int, int, str]:
        video, (kept, with_frame, without) = item
        refused = with_frame + without
        group = 0 if kept and refused else 1 if refused else 2
        return group, without, video

    chosen = sorted(fates.items(), key=rank)[:STRIP_VIDEOS]
    return {video: i for i, (video, _) in enumerate(chosen)}


def _duplicate(reason: str | None) -> bool:
    return original_of(reason) is not None


def _strip_picks(samples: pa.Table, ranks: dict[str, int]) -> set[str]:
    """Keys of the clips the strips show: of each chosen video, at most STRIP_CLIPS spread
    evenly over its clips in time order (its first among them)."""
    clips = _clip_rows(samples)
    clips = clips.filter(pc.is_in(clips.column("video"), pa.array(sorted(ranks), pa.string())))
    by_video: dict[str, list[tuple[float, str]]] = {}
    for c in clips.select(["key", "video", "start_s"]).to_pylist():
        by_video.setdefault(c["video"], []).append((c["start_s"], c["key"]))
    picked: set[str] = set()
    for spans in by_video.values():
        spans.sort()
        n = len(spans)
        step = max(n / STRIP_CLIPS, 1.0)
        picked.update(spans[int(i * step)][1] for i in range(min(STRIP_CLIPS, n)))
    return picked


def strip_keyframes(
    storage: Storage, ledger: pa.Table, candidates: list[str], keys: list[str], thumbs: dict[str, bytes]
) -> dict[str, bytes]:
    """Small JPEGs (long side STRIP_SIDE) of the keyframes of the strips' clips ``keys``: a
    refused clip's from the few validation kept (``thumbs``), a kept clip's (its ``jpg``
    member) from its validated shard, a duplicate's from the candidate shard dedup did not copy
    it from (``candidates``: the candidate ledgers); a clip without any has none."""
    from tasks.audit.curation_views import _thumbnail

    out = {}
    for k in keys:
        small = _thumbnail(thumbs[k], STRIP_SIDE) if k in thumbs else None
        if small is not None:
            out[k] = small
    left = [k for k in keys if k not in out]
    if left:
        out.update(_member_keyframes(storage, ledger, left))
        rows = ledger.filter(pc.is_in(ledger.column("key"), pa.array(left, pa.string())))
        reasons = dict(zip(rows.column("key").to_pylist(), rows.column("reason").to_pylist()))
        left = [k for k in left if k not in out and _duplicate(reasons.get(k))]
    if left and candidates:
        tables = read_ledgers(storage, candidates, ["key", "shard", "members"])
        out.update(_member_keyframes(storage, pa.concat_tables(tables.values()), left))
    return out


def _member_keyframes(storage: Storage, ledger: pa.Table, keys: list[str]) -> dict[str, bytes]:
    from tasks.audit.curation_views import member_thumbnails

    rows = ledger.filter(pc.is_in(ledger.column("key"), pa.array(sorted(keys), pa.string())))
    return member_thumbnails(storage, rows.select(["key", "shard", "members"]).to_pylist(), ("jpg",), STRIP_SIDE)


# ----------------------------------------------------------------------------- the view


def video_view(samples: pa.Table | None) -> dict[str, Any] | None:
    """The report template's video section, or None without videos: per source video (one
    count per video, not per clip) its outcome, histograms and tables of its probed facts and
    its clips, and the keyframe strips."""
    from tasks.audit.report_views import _histogram

    if samples is None or "video" not in samples.column_names or VIDEO_FACTS[0] not in samples.column_names:
        return None
    per = _per_video(samples)
    if not per:
        return None
    probed = [v for v in per if v["video_width"] is not None]

    def values(name: str, rows: list[dict[str, Any]]) -> np.ndarray:
        arr = np.array([r[name] for r in rows if r[name] is not None], dtype=float)
        return arr[np.isfinite(arr)]

    hists = [
        _histogram("video_duration_s", "Video duration (s)", values("video_duration_s", probed), False),
        _histogram("video_short_side", "Video short side (px)", values("short_side", probed), True),
        _histogram("video_kept_clips", "Kept clips per video", values("kept", per), True),
        _histogram("video_refused_clips", "Refused clips per video", values("refused", per), True),
    ]
    unprobed = len(per) - len(probed)
    tables = [
        _value_table("resolution", "Resolution (width x height)", [v["resolution"] for v in probed], unprobed),
        _value_table("fps", "Frame rate (fps)", [v["fps"] for v in probed], unprobed),
        _value_table("codec", "Codec / container", [v["codec"] for v in probed], unprobed),
    ]
    outcomes: dict[str, int] = {}
    for v in per:
        outcomes[v["outcome"]] = outcomes.get(v["outcome"], 0) + 1
    return {
        "videos": len(per),
        "probed": len(probed),
        "clips": sum(v["kept"] + v["refused"] for v in per),
        "outcomes": sorted(outcomes.items(), key=lambda kv: (-kv[1], kv[0])),
        "hists": hists,
        "tables": tables,
        "strips": _strips(samples, {v["video"]: v for v in per}),
        "max_videos": STRIP_VIDEOS,
        "max_clips": STRIP_CLIPS,
    }


def _per_video(samples: pa.Table) -> list[dict[str, Any]]:
    """One dict per source video: its facts, its kept and refused clips, its outcome."""
    from tasks.audit.report_views import reason_group

    rows = samples.filter(pc.is_valid(samples.column("video")))
    cols = ["video", "start_s", "status", "reason", *VIDEO_FACTS]
    out: dict[str, dict[str, Any]] = {}
    for r in rows.select(cols).to_pylist():
        v = out.get(r["video"])
        if v is None:
            v = out[r["video"]] = {"video": r["video"], "kept": 0, "refused": 0, "no_clip": None}
            v.update({f: None for f in VIDEO_FACTS})
        for f in VIDEO_FACTS:  # every row of a video has its facts; a row of an older ledger none
            if v[f] is None:
                v[f] = r[f]
        if r["start_s"] is None:
            v["no_clip"] = reason_group(str(r["reason"])) if r["reason"] else "no clip"
        elif r["status"] == OK:
            v["kept"] += 1
        else:
            v["refused"] += 1
    for v in out.values():
        w, h = v["video_width"], v["video_height"]
        v["short_side"] = min(w, h) if w and h else None
        v["resolution"] = f"{w}x{h}"
        v["fps"] = f"{v['video_fps']:.3f}".rstrip("0").rstrip(".") if v["video_fps"] is not None else "unknown"
        v["codec"] = f"{v['video_codec']} / {v['video_container']}"
        if v["kept"]:
            v["outcome"] = "kept clips"
        elif v["refused"]:
            v["outcome"] = "every clip refused"
        else:
            v["outcome"] = f"no clip: {v['no_clip']}"
    return [out[k] for k in sorted(out)]


def _value_table(name: str, title: str, values: list[str], unprobed: int) -> dict[str, Any]:
    """Videos per value, most first (ties by value), the TABLE_ROWS first and then "other";
    videos the probe refused (or an older ledger) as "not probed"."""
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    rows: list[dict[str, Any]] = [{"value": k, "n": n} for k, n in ranked[:TABLE_ROWS]]
    rest = ranked[TABLE_ROWS:]
    if rest:
        rows.append({"value": f"other ({len(rest)} values)", "n": sum(n for _, n in rest)})
    if unprobed:
        rows.append({"value": "not probed", "n": unprobed})
    total = sum(r["n"] for r in rows)
    for r in rows:
        r["share"] = f"{100.0 * r['n'] / total:.1f}%"
    return {"name": name, "title": title, "rows": rows}


def _strips(samples: pa.Table, per: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each strip: its video's facts and counts, and its clips' keyframes in time order."""
    from tasks.audit.report_views import fmt_num, image_uri, reason_group

    if STRIP not in samples.column_names:
        return []
    shown = samples.filter(pc.is_valid(samples.column(STRIP)))
    cols = ["key", "video", "start_s", "clip_s", "status", "reason", KEYFRAME, STRIP]
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in shown.select([c for c in cols if c in shown.column_names]).to_pylist():
        by_rank.setdefault(r[STRIP], []).append(r)
    strips = []
    for rank in sorted(by_rank):
        clips = sorted(by_rank[rank], key=lambda r: (r["start_s"], r["key"]))
        v = per[clips[0]["video"]]
        figs = []
        for c in clips:
            uri = image_uri(c.get(KEYFRAME))
            end = c["start_s"] + (c["clip_s"] or 0.0)
            figs.append(
                {
                    "key": c["key"],
                    "start_s": c["start_s"],
                    "span": f"{fmt_num(round(c['start_s'], 2))}-{fmt_num(round(end, 2))} s",
                    "status": c["status"],
                    "reason": c["reason"],
                    "group": reason_group(c["reason"]) if c["reason"] else None,
                    "uri": uri,
                }
            )
        facts = []
        if v["video_width"] is not None:
            facts.append(v["resolution"])
        if v["video_fps"] is not None:
            facts.append(f"{v['fps']} fps")
        if v["video_duration_s"] is not None:
            facts.append(f"{fmt_num(round(v['video_duration_s'], 2))} s")
        if v["video_codec"] is not None:
            facts.append(v["codec"])
        strips.append(
            {
                "video": v["video"],
                "facts": ", ".join(facts),
                "kept": v["kept"],
                "refused": v["refused"],
                "clips": v["kept"] + v["refused"],
                "figs": figs,
            }
        )
    return strips
