"""bench_video.py's own parts: the corpus plan, both tools' settings, the video2dataset patches and the report."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_video import (  # noqa: E402
    FPS,
    Run,
    expected_spans,
    frame,
    patch_video2dataset,
    plan,
    render,
    scaled,
    shardsmith_recipe,
    v2d_config,
)

from tasks.formats.recipe import load_recipe  # noqa: E402


def test_the_plan_is_seeded_and_keeps_every_scene_between_two_and_ten_seconds_but_a_lone_twelve():
    assert plan(0, 3) == plan(0, 3) and plan(0, 3) != plan(1, 3)
    lone = 0
    for index in range(60):
        frames, scenes = plan(0, index)
        bounds = [s.start for s in scenes] + [frames]
        lengths = [(b - a) / FPS for a, b in zip(bounds, bounds[1:])]
        assert bounds[0] == 0 and all(x >= 2 for x in lengths), (index, lengths)
        if len(scenes) > 1:
            assert max(lengths) <= 10, (index, lengths)
        elif lengths[0] > 10:
            lone += 1
            assert lengths == [12.0]
            assert expected_spans(frames, scenes) == [(0, 250), (250, 300)]  # 10 s, then the 2 s rest
    assert lone, "the corpus has a scene longer than a clip"


def test_expected_spans_window_a_scene_and_drop_a_rest_under_the_minimum():
    frames, scenes = plan(0, 0)
    spans = expected_spans(frames, scenes)
    assert [a for a, _ in spans] == [s.start for s in scenes]  # every scene of this video is a clip
    assert spans[-1][1] == frames
    _, one = plan(0, 0)
    assert expected_spans(11 * FPS, one[:1], max_s=10, min_s=1.5) == [(0, 250)]  # a 1 s rest is no clip


def test_scenes_differ_across_a_cut_more_than_frames_inside_a_scene():
    for index in range(40):
        frames, scenes = plan(0, index)
        for cut in [s.start for s in scenes[1:]]:
            grey = [frame(scenes, i).mean(axis=2) for i in (cut - 2, cut - 1, cut)]
            inside = np.abs(grey[1] - grey[0]).mean() / 255
            across = np.abs(grey[2] - grey[1]).mean() / 255
            assert across > 0.2 > inside, (index, cut, across, inside)  # shardsmith's scene threshold


def test_the_recipe_is_one_shardsmith_accepts_with_the_equal_clip_settings(tmp_path):
    clips = {"split": "scenes", "min_s": 1, "max_s": 10, "max_side": 256, "crf": 23, "fps": 10}
    shardsmith_recipe(tmp_path / "r.yaml", tmp_path / "store", tmp_path / "m.parquet", clips, 5, 2)
    recipe = load_recipe(tmp_path / "r.yaml")
    got = recipe.validate_.video.clips
    assert (got.split, got.min_s, got.max_s, got.max_side, got.fps, got.crf) == ("scenes", 1, 10, 256, 10, 23)
    assert recipe.sources[0].media == "video" and recipe.sources[0].rows_per_shard == 5
    assert recipe.execution.workers == 2
    shardsmith_recipe(tmp_path / "d.yaml", tmp_path / "store", tmp_path / "m.parquet", None, None, None)
    default = load_recipe(tmp_path / "d.yaml")
    assert default.validate_.video.clips == type(got)() and default.execution.workers is None


def test_video2dataset_gets_the_height_that_gives_the_same_clip_size(tmp_path):
    assert scaled(256) == (256, 144) and scaled(640) == (320, 180)  # never upscaled
    v2d_config(tmp_path / "c.yaml", 256, 10.0, "exact", 5, 2, 32)
    config = json.loads((tmp_path / "c.yaml").read_text())  # JSON is YAML for its OmegaConf
    sub = config["subsampling"]
    assert sub["ResolutionSubsampler"]["args"] == {"height": 144, "resize_mode": "scale"}
    assert sub["FrameSubsampler"]["args"] == {"frame_rate": 10.0}
    assert sub["ClippingSubsampler"]["args"]["precision"] == "exact"
    assert sub["CutDetectionSubsampler"]["cuts_are_clips"] is True
    assert config["distribution"]["processes_count"] == 2 and config["storage"]["number_sample_per_shard"] == 5
    v2d_config(tmp_path / "k.yaml", 256, None, "keyframe_adjusted", 5, 2, 32)
    assert "FrameSubsampler" not in json.loads((tmp_path / "k.yaml").read_text())["subsampling"]


def test_the_video2dataset_patches_apply_once_and_fail_loudly_on_another_release(tmp_path):
    package = tmp_path / "video2dataset"
    (package / "subsamplers").mkdir(parents=True)
    init = "    def __init__(self, encode_format='mp4'):\n        self.encode_format = encode_format\n"
    (package / "subsamplers" / "resolution_subsampler.py").write_text(init)
    (package / "subsamplers" / "frame_subsampler.py").write_text(init + '        video_bytes = streams.pop("video")\n')
    patch_video2dataset(package)
    patch_video2dataset(package)  # a second time changes nothing
    frame_py = (package / "subsamplers" / "frame_subsampler.py").read_text()
    assert frame_py.count("self.encode_formats = ") == 1 and 'streams.pop("video")' not in frame_py
    assert "self.encode_formats = " in (package / "subsamplers" / "resolution_subsampler.py").read_text()
    (package / "subsamplers" / "resolution_subsampler.py").write_text("class Other: pass\n")
    with pytest.raises(SystemExit, match="cannot patch"):
        patch_video2dataset(package)


def _args(**kw) -> argparse.Namespace:
    base = dict(side=256, fps=10.0, workers=2, rows_per_shard=5, threads=32, seed=0)
    return argparse.Namespace(**(base | kw))


def test_the_report_gives_the_ratio_and_says_whether_the_target_holds():
    runs = [
        Run("ss-equal", 1, wall_s=20.0, cpu_s=40.0, ok=100, rows=40, phase_s=10.0),
        Run("v2d-equal", 1, wall_s=40.0, cpu_s=80.0, ok=100, rows=40, phase_s=30.0),
    ]
    text = "\n".join(render(runs, ["ss-equal", "v2d-equal"], _args()))
    assert "clips/s 2.00x over the whole command, 3.00x over the phase" in text
    assert ">= 1.5x video2dataset's clips/s on equal settings: 2.00x, met" in text
    runs[0].wall_s = 30.0
    assert "1.33x, NOT met" in "\n".join(render(runs, ["ss-equal", "v2d-equal"], _args()))
