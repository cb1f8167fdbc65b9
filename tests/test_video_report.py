"""The report's video section: per source video its probed facts and clip fates, counted once per video, and keyframe strips in time order."""

from __future__ import annotations

import base64
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_report import Page, make_run
from test_video_pipeline import _release
from video_fixtures import make_video, scene

from tasks.audit.report import render_html
from tasks.audit.video_views import STRIP_CLIPS, STRIP_SIDE, STRIP_VIDEOS, with_video_columns
from tasks.formats.ledger import (
    CORE_COLUMNS,
    LEDGER_SCHEMA,
    PRIVACY_FACTS,
    VIDEO_FACTS,
    VIDEO_LEDGER_SCHEMA,
    ledger_schema,
)

SMALL, WIDE = (128, 72), (160, 96)


def _hists(page: Page) -> dict[str, dict]:
    """Each histogram of the page: its n and its bars as (lo, hi, count), from the tags in order."""
    out: dict[str, dict] = {}
    current = None
    for tag, a in page.tags:
        if tag == "div" and "data-hist" in a:
            current = out.setdefault(a["data-hist"], {"n": int(a["data-n"]), "bars": []})
        elif tag == "rect" and a.get("class") == "bar" and current is not None:
            current["bars"].append((float(a["data-lo"]), float(a["data-hi"]), int(a["data-count"])))
    return out


def _strips(page: Page) -> list[tuple[dict, list[dict]]]:
    """Each strip (its attributes) with its figures' attributes and their pictures, in page order."""
    strips: list[tuple[dict, list[dict]]] = []
    for tag, a in page.tags:
        if tag == "div" and a.get("class") == "strip":
            strips.append((a, []))
        elif tag == "figure" and a.get("class", "").startswith("frame"):
            strips[-1][1].append(dict(a))
        elif tag == "img" and strips and strips[-1][1] and "src" not in strips[-1][1][-1]:
            strips[-1][1][-1]["src"] = a["src"]
    return strips


def _count_in(bars: list[tuple[float, float, int]], value: float) -> int:
    """The count of the bar holding ``value`` (the last bar holds its upper edge)."""
    for i, (lo, hi, count) in enumerate(bars):
        if lo <= value < hi or (i == len(bars) - 1 and value == hi):
            return count
    raise AssertionError(f"no bar holds {value}: {bars}")


def _values(page: Page, table: str) -> dict[str, int]:
    return {row: int(c["value"]) for (t, _, row, col), c in page.cells.items() if t == table and col == "videos"}


# ----------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def run(tmp_path_factory, prefect_api_url):
    tmp = tmp_path_factory.mktemp("video-report")
    cut = make_video(seconds=4, fps=10, size=SMALL, cut_at=2.0)
    files = {
        "cut.mp4": cut,  # two kept clips
        "plain.webm": make_video(seconds=3, fps=10, size=SMALL, container="webm", codec="libvpx-vp9"),
        "still.mp4": make_video(seconds=3, fps=10, size=SMALL, draw=lambda i, t: scene("still", i, SMALL)),
        "short.mp4": make_video(seconds=0.5, fps=10, size=SMALL),  # no clip: video_no_clips
        "copy.mp4": cut,  # both clips duplicates of cut.mp4's
        # Its square moves for two seconds, then stops: a kept clip, then a static one.
        "half.mp4": make_video(seconds=4, fps=25, size=WIDE, draw=lambda i, t: scene("a", i if t < 2 else 50, WIDE)),
        "sound.mp4": make_video(audio=True, video=False),  # the probe refuses it: no facts
    }
    names, store = _release(tmp, files, prefect_api_url)
    (report,) = (store / "reports").glob("*/report.html")
    return names, store, report


def _key(names: list[str], name: str) -> str:
    return f"v-{names.index(name):09d}"


@pytest.mark.slow
def test_validation_ledger_rows_of_videos_carry_the_probe_facts(run):
    names, store, _ = run
    rows = []
    for path in (store / "validate").rglob("*.ledger.parquet"):
        table = pq.read_table(path)
        # The video facts, then what the privacy checks found (every validation ledger ends so).
        assert table.schema.remove_metadata().equals(
            ledger_schema(*VIDEO_LEDGER_SCHEMA.names[len(CORE_COLUMNS) :], *PRIVACY_FACTS)
        ), path
        rows += table.to_pylist()
    by_key = {r["key"]: r for r in rows}
    for clip in (f"{_key(names, 'cut.mp4')}_c000", f"{_key(names, 'cut.mp4')}_c001"):
        r = by_key[clip]
        facts = {f: r[f] for f in VIDEO_FACTS}
        assert facts == {
            "video_duration_s": 4.0,
            "video_width": 128,
            "video_height": 72,
            "video_fps": 10.0,
            "video_codec": "h264",
            "video_container": "mp4",
        }
    webm = by_key[f"{_key(names, 'plain.webm')}_c000"]
    assert (webm["video_codec"], webm["video_container"]) == ("vp9", "webm")
    half = by_key[f"{_key(names, 'half.mp4')}_c001"]
    assert (half["reason"], half["video_width"], half["video_height"], half["video_fps"]) == (
        "clip_static",
        160,
        96,
        25,
    )
    # A video that gave no clip has its one row, with its facts when it was probed.
    short = by_key[_key(names, "short.mp4")]
    assert (short["reason"], short["video_duration_s"], short["video_width"]) == ("video_no_clips", 0.5, 128)
    sound = by_key[_key(names, "sound.mp4")]
    assert sound["reason"] == "video_no_video_stream" and all(sound[f] is None for f in VIDEO_FACTS)


@pytest.mark.slow
def test_the_report_counts_each_source_video_once(run):
    names, _, report = run
    page = Page(report.read_text())
    (section,) = page.find("p", data_videos="7")  # seven judged: missing.mp4 ended at download
    assert _values(page, "video-outcomes") == {
        "kept clips": 3,  # cut, plain, half
        "every clip refused": 2,  # still, copy
        "no clip: video_no_clips": 1,
        "no clip: video_no_video_stream": 1,
    }
    assert _values(page, "video-resolution") == {"128x72": 5, "160x96": 1, "not probed": 1}
    assert _values(page, "video-fps") == {"10": 5, "25": 1, "not probed": 1}
    assert _values(page, "video-codec") == {"h264 / mp4": 5, "vp9 / webm": 1, "not probed": 1}
    hists = _hists(page)
    durations = hists["video_duration_s"]
    assert durations["n"] == 6 and sum(c for *_, c in durations["bars"]) == 6
    assert _count_in(durations["bars"], 4.0) == 3  # cut, copy, half
    assert _count_in(durations["bars"], 0.5) == 1
    assert hists["video_short_side"]["n"] == 6 and _count_in(hists["video_short_side"]["bars"], 96) == 1
    # One bar per count of clips: 0, 1, 2 kept (and refused) clips per video.
    assert [c for *_, c in hists["video_kept_clips"]["bars"]] == [4, 1, 2]
    assert [c for *_, c in hists["video_refused_clips"]["bars"]] == [4, 1, 2]
    # The samples' own histogram still counts clips, not videos: five kept, of 1 and 2 s.
    assert _hists(page)["clip_s"]["n"] == 5


@pytest.mark.slow
def test_strips_show_each_videos_clips_in_time_order_refused_ones_marked(run):
    names, _, report = run
    strips = _strips(Page(report.read_text()))
    order = [s["data-video"] for s, _ in strips]
    # Both fates first (half), then refused only (still, copy), then kept only (cut, plain).
    assert order == [_key(names, n) for n in ("half.mp4", "still.mp4", "copy.mp4", "cut.mp4", "plain.webm")]
    marks = {
        s["data-video"]: [(f["data-key"], float(f["data-start"]), f["class"], f.get("data-reason")) for f in figs]
        for s, figs in strips
    }
    half, cut = _key(names, "half.mp4"), _key(names, "cut.mp4")
    assert marks[half] == [
        (f"{half}_c000", 0.0, "frame kept", None),
        (f"{half}_c001", 2.0, "frame refused", "clip_static"),
    ]
    copy = _key(names, "copy.mp4")
    assert marks[copy] == [
        (f"{copy}_c000", 0.0, "frame refused", f"duplicate_of:{cut}_c000"),
        (f"{copy}_c001", 2.0, "frame refused", f"duplicate_of:{cut}_c001"),
    ]
    assert [m[2] for m in marks[cut]] == ["frame kept", "frame kept"]
    # Every clip shown has its keyframe (a kept one's from its shard, a duplicate's from its
    # candidate shard), small.
    from PIL import Image

    for _, figs in strips:
        for f in figs:
            assert f["src"].startswith("data:image/jpeg;base64,"), f
            with Image.open(io.BytesIO(base64.b64decode(f["src"].split(",", 1)[1]))) as img:
                assert max(img.size) <= STRIP_SIDE
    # The second scene of cut.mp4 (a blue square on yellow) is its second clip's keyframe.
    with Image.open(io.BytesIO(base64.b64decode(strips[3][1][1]["src"].split(",", 1)[1]))) as img:
        r, g, b = img.convert("RGB").resize((1, 1)).getpixel((0, 0))
    assert r > 120 and g > 110 and b < 100


# ----------------------------------------------------------------------------- bounds, and images untouched


def _clip_ledger(videos: int, clips: int) -> pa.Table:
    """A validation ledger of ``videos`` videos of ``clips`` one-second clips each, every other refused."""
    rows = []
    for v in range(videos):
        for c in reversed(range(clips)):  # written out of time order: the strip sorts them
            refused = c % 2 == 1
            rows.append(
                {
                    "key": f"v{v:02d}_c{c:03d}",
                    "source": "v",
                    "row": v,
                    "status": "rejected" if refused else "ok",
                    "reason": "clip_static" if refused else None,
                    "video": f"v{v:02d}",
                    "start_s": float(c),
                    "end_s": float(c + 1),
                    "width": 64,
                    "height": 36,
                    "video_duration_s": float(clips),
                    "video_width": 64 + v,
                    "video_height": 36,
                    "video_fps": 29.97,
                    "video_codec": "h264",
                    "video_container": "mp4",
                }
            )
    return pa.Table.from_pylist(rows, schema=VIDEO_LEDGER_SCHEMA)


def test_strips_are_bounded_and_spread_over_each_video():
    from tasks.audit.validate_samples import REPORT_COLUMNS, _with_aspect

    ledger = _clip_ledger(videos=STRIP_VIDEOS + 5, clips=STRIP_CLIPS * 3)
    base, shown = with_video_columns(_with_aspect(ledger.select(REPORT_COLUMNS)), ledger, {"v"}, {})
    assert len(shown) == STRIP_VIDEOS * STRIP_CLIPS
    page = Page(render_html(make_run(), base.append_column("thumbnail", pa.nulls(base.num_rows, pa.binary()))))
    strips = _strips(page)
    assert len(strips) == STRIP_VIDEOS
    for attrs, figs in strips:
        starts = [float(f["data-start"]) for f in figs]
        # Spread over the whole video in time order, from its first clip.
        assert starts == [3.0 * i for i in range(STRIP_CLIPS)]
        assert attrs["data-shown"] == str(STRIP_CLIPS)
        refused = [f["class"] == "frame refused" for f in figs]
        assert (
            refused == [f.get("data-reason") == "clip_static" for f in figs] == [i % 2 == 1 for i in range(STRIP_CLIPS)]
        )
    # Thirteen sizes: the ten most frequent (ties by value), then the rest as one row.
    sizes = _values(page, "video-resolution")
    assert len(sizes) == 11 and sizes[f"other ({STRIP_VIDEOS + 5 - 10} values)"] == STRIP_VIDEOS + 5 - 10
    assert _values(page, "video-fps") == {"29.97": STRIP_VIDEOS + 5}


def test_a_report_of_images_has_no_video_section_and_image_ledgers_no_video_facts():
    from tasks.audit.validate_samples import REPORT_COLUMNS, _with_aspect

    images = pa.Table.from_pylist(
        [{"key": "p-0", "source": "p", "row": 0, "status": "ok", "width": 64, "height": 48}], schema=LEDGER_SCHEMA
    )
    base = _with_aspect(images.select(REPORT_COLUMNS))
    same, shown = with_video_columns(base, images, set(), {})
    assert same is base and shown == []
    assert 'id="videos"' not in render_html(make_run(), base)
    assert not set(VIDEO_FACTS) & set(LEDGER_SCHEMA.names)
