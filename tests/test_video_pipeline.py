"""Video sources through the real CLI: a manifest of video URLs on loopback becomes a release of clips; hostile files end as one row each."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import av
import pyarrow.parquet as pq
import pytest
import torch
from test_video_hostile import _hostile
from video_fixtures import make_video, scene

from tasks.demo.webserver import ImageWeb

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _cli(*args: str, api_url: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_") or k == "SHARDSMITH_WARM"}
    env["PREFECT_API_URL"] = api_url
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def _release(
    tmp_path: Path,
    files: dict[str, bytes],
    api_url: str,
    clips: str = "{min_s: 1, max_s: 2}",
    segments: dict[str, str] | None = None,
    routes: dict[str, str] | None = None,
    extra: str = "",
):
    """Serve ``files``, run their manifest to a release; (the manifest's names in row order, the
    store). ``segments``: a segments column (name -> its text), carried into the samples;
    ``extra``: recipe YAML appended."""
    web_root = tmp_path / "web"
    web_root.mkdir()
    for name, data in files.items():
        (web_root / name).write_bytes(data)
    server = ImageWeb(root=web_root)
    server.start()
    try:
        names = [*files, "missing.mp4"]
        manifest = tmp_path / "m.csv"
        with open(manifest, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["url", "caption", "license", "segments"])
            for n in names:
                path = (routes or {}).get(n, "/img/" + n)
                out.writerow([server.url(path), f"a clip of {n}", "CC0-1.0", (segments or {}).get(n, "")])
        recipe = tmp_path / "r.yaml"
        recipe.write_text(
            f"""dataset: vids
storage: {tmp_path / "store"}
sources:
  - {{name: v, manifest: {manifest}, media: video, rows_per_shard: 8, extra_columns: [segments]}}
download:
  retries: 1  # a dropped transfer resumes on the next attempt
  network: {{allowed_networks: ["127.0.0.1/32"], any_port: true}}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}}}
  video: {{clips: {clips}}}
reshard: {{samples_per_shard: 3}}
gates:
  download: {{min_success_rate: 0.1}}
  validate: {{max_reject_rate: 0.95}}
execution: {{cluster: local, workers: 1}}
{extra}"""
        )
        done = _cli("run", str(recipe), api_url=api_url)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    return names, tmp_path / "store" / "vids"


def _fates(store: Path, names: list[str]) -> dict[str, tuple[str, str | None]]:
    ledger = pq.read_table(store / "releases" / "v0001" / "ledger.parquet").to_pylist()
    rows = sorted(r["row"] for r in ledger)
    assert rows == list(range(len(names))), "every manifest row ends as exactly one row"
    return {names[r["row"]]: (r["status"], r["reason"]) for r in ledger}


def test_a_manifest_of_videos_is_released_as_clips_with_every_video_accounted_for(tmp_path, prefect_api_url):
    cut = make_video(seconds=4, fps=10, size=(128, 72), cut_at=2.0)
    files = {
        "cut.mp4": cut,
        "plain.webm": make_video(seconds=3, fps=10, size=(128, 72), container="webm", codec="libvpx-vp9"),
        "still.mp4": make_video(seconds=3, fps=10, size=(128, 72), draw=lambda i, t: scene("still", i, (128, 72))),
        "short.mp4": make_video(seconds=0.5, fps=10, size=(128, 72)),
        "copy.mp4": cut,  # the same video at another URL: its clips are exact duplicates
        # Its connection drops after 3,000 bytes once: the next attempt asks for the rest.
        "dropped.mp4": make_video(seconds=2, fps=10, size=(128, 72), draw=lambda i, t: scene("b", i, (128, 72))),
    }
    routes = {"dropped.mp4": "/drop/dropped.mp4?after=3000&times=1"}
    names, store = _release(tmp_path, files, prefect_api_url, routes=routes)
    fates = _fates(store, names)
    assert fates["cut.mp4"] == ("ok", None)
    assert fates["plain.webm"] == ("ok", None)
    assert fates["still.mp4"] == ("rejected", "clip_static")
    assert fates["short.mp4"] == ("rejected", "video_no_clips")
    assert fates["copy.mp4"][1].startswith("duplicate_of:v-000000000_c")
    assert fates["missing.mp4"] == ("error", "http_404")
    assert fates["dropped.mp4"] == ("ok", None)
    downloads = [r for p in (store / "download").rglob("*.ledger.parquet") for r in pq.read_table(p).to_pylist()]
    (dropped,) = [r for r in downloads if r["row"] == names.index("dropped.mp4")]
    assert dropped["attempts"] == 2 and dropped["bytes"] == len(files["dropped.mp4"])

    # The report: clip lengths for its histogram, refused clips shown by their keyframes.
    (report,) = (store / "reports").glob("*/samples.parquet")
    shown = pq.read_table(report, columns=["key", "reason", "clip_s", "thumbnail"]).to_pylist()
    assert {r["clip_s"] for r in shown if r["reason"] is None} == {1.0, 2.0}
    static = [r for r in shown if r["reason"] == "clip_static"]
    assert static and all(r["thumbnail"][:3] == b"\xff\xd8\xff" for r in static)
    assert "Clip length (s)" in (report.parent / "report.html").read_text()

    # Released samples are clips: mp4 + keyframe + json + txt, each naming its video and span.
    samples = pq.read_table(store / "releases" / "v0001" / "samples.parquet").to_pylist()
    assert sorted(s["key"] for s in samples) == [
        "v-000000000_c000",
        "v-000000000_c001",
        "v-000000001_c000",
        "v-000000001_c001",
        "v-000000005_c000",
    ]
    assert {s["video"] for s in samples} == {"v-000000000", "v-000000001", "v-000000005"}
    members: dict[str, dict[str, bytes]] = {}
    for tar in sorted((store / "releases" / "v0001").glob("*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, ext = m.name.split(".", 1)
                members.setdefault(key, {})[ext] = tf.extractfile(m).read()
    clip = members["v-000000000_c001"]
    assert sorted(clip) == ["jpg", "json", "mp4", "txt"]
    meta = json.loads(clip["json"])
    assert (meta["video"], meta["start_s"], meta["end_s"]) == ("v-000000000", 2.0, 4.0)
    assert meta["video_codec"] == "h264" and meta["caption"] == "a clip of cut.mp4"
    # Megatron-Energon reads a release of clips as VidQASample (video: mp4), not the keyframe.
    assert b"__class__: VidQASample" in (store / "releases" / "v0001" / ".nv-meta" / "dataset.yaml").read_bytes()
    with av.open(io.BytesIO(clip["mp4"])) as box:
        frames = [f.to_ndarray(format="rgb24") for f in box.decode(video=0)]
    assert len(frames) == 20  # two seconds at the source's 10 fps
    # The second scene (a blue square on yellow) is what the clip holds, not the first.
    r, g, b = frames[0][2:8, 2:8].reshape(-1, 3).mean(axis=0)
    assert r > 150 and g > 130 and b < 100

    # A training loader reads the release's clips as frame tensors at the rate it asks for.
    from loaders.dataset import ReleaseDataset
    from loaders.release import open_release

    ds = ReleaseDataset(
        open_release(str(store / "releases" / "v0001")),
        mode="clips",
        clip_frames=8,
        clip_fps=4,
        image_size=32,
        shuffle=False,
        batch_size=5,
    )
    (batch,) = list(ds)
    assert tuple(batch["frames"].shape) == (5, 8, 3, 32, 32) and str(batch["frames"].dtype) == "torch.uint8"
    by_key = dict(zip(batch["key"], batch["frames_real"].tolist()))
    # Two-second clips give 8 frames at 4 fps; the webm's last clip (1 s) gives 4 and repeats one.
    assert by_key == {
        "v-000000000_c000": 8,
        "v-000000000_c001": 8,
        "v-000000001_c000": 8,
        "v-000000001_c001": 4,
        "v-000000005_c000": 8,
    }
    second = batch["frames"][batch["key"].index("v-000000000_c001")]
    assert (second[:, :, 0, 0].float().mean(dim=0) > torch.tensor([150.0, 130.0, -1.0])).all()


def test_small_and_scene_less_videos_end_as_one_row_each_and_never_fail_the_gate(tmp_path, prefect_api_url):
    flicker = [("a" if k % 2 == 0 else "b", i) for k in range(6) for i in range(5)]  # six 0.5 s scenes
    files = {
        "good.mp4": make_video(seconds=2, fps=10, size=(128, 72)),
        "tiny.mp4": make_video(seconds=2, fps=10, size=(48, 32)),  # below validate.image.min_side 64
        "wee.webm": make_video(seconds=2, fps=10, size=(32, 96), container="webm", codec="libvpx-vp9"),
        "flicker.mp4": make_video(seconds=3, fps=10, size=(128, 72), draw=lambda n, t: scene(*flicker[n], (128, 72))),
    }
    names, store = _release(tmp_path, files, prefect_api_url)  # the gate passed: the run released
    fates = _fates(store, names)
    assert fates["good.mp4"] == ("ok", None)
    assert fates["tiny.mp4"] == fates["wee.webm"] == ("rejected", "video_too_small")
    assert fates["flicker.mp4"] == ("rejected", "video_no_clips")
    rows = [r for p in (store / "validate").rglob("*.ledger.parquet") for r in pq.read_table(p).to_pylist()]
    detail = {names[r["row"]]: r["detail"] for r in rows if r["key"] == f"v-{r['row']:09d}"}
    assert detail["tiny.mp4"] == "48x32 declared: short side below validate.image.min_side 64"
    assert detail["flicker.mp4"].endswith(
        "6 scene(s) at clips.scene_threshold 0.2; the longest is 0.50 s (0.00-0.50 s), shorter than clips.min_s 1"
    )


def test_hostile_videos_through_the_cli_end_as_one_row_each_and_the_run_releases_the_rest(tmp_path, prefect_api_url):
    cases = _hostile()
    names, store = _release(tmp_path, {n: d for n, (d, _) in cases.items()}, prefect_api_url, clips="{min_s: 1}")
    fates = _fates(store, names)
    for name, (_, reason) in cases.items():
        status, got = fates[name]
        if name == "good.mp4":
            assert (status, got) == ("ok", None)
        elif reason is None:  # the same frames as good.mp4, whatever the name or where the index is
            assert got.startswith("duplicate_of:"), (name, got)
        elif name == "empty.mp4":
            assert got == "empty_body"  # refused at download, before any sniffing
        else:
            assert got == reason, (name, got)


def test_the_video_demo_releases_clips_and_every_row_has_the_fate_its_corpus_planted(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    out = subprocess.run(
        [sys.executable, "-m", "cli", "demo", "--video", "--dir", str(tmp_path / "demo"), "--workers", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Every video's fate matches what the corpus planted" in out.stdout
    release = tmp_path / "demo" / "store" / "demo-video" / "releases" / "v0001"
    expected = json.loads((tmp_path / "demo" / "manifests" / "VIDEO-EXPECTED.json").read_text())
    ledger = pq.read_table(release / "ledger.parquet").to_pylist()
    assert len(ledger) == expected["rows"] == 12
    assert sum(r["status"] == "ok" for r in ledger) == 4
    assert (release / "index.json").exists() and list(release.glob("*.tar"))
    # Precache stored each clip's frame latents beside its keyframe's; the loader draws them.
    from loaders.dataset import ReleaseDataset
    from loaders.release import open_release

    ds = ReleaseDataset(open_release(str(release)), mode="latents", batch_size=4, shuffle=False)
    (batch,) = list(ds)
    # Clips, latent frames, C, h, w: the recipe's 5 frames through the tiny Wan VAE (4x in time).
    assert tuple(batch["clip_latent"].shape) == (4, 2, 4, 16, 16)
    clip_meta = json.loads((release / "index.json").read_text())["precache"]["encodings"]["clip_latents"]
    assert clip_meta["model_class"] == "AutoencoderKLWan" and clip_meta["latent_frames"] == 2
    assert tuple(batch["latent"].shape) == (4, 4, 16, 16) and torch.isfinite(batch["clip_latent"]).all()
    # A clip's frames are not one picture repeated: the square moves.
    assert (batch["clip_latent"][:, 0] - batch["clip_latent"][:, -1]).abs().mean() > 0.01


def _video2dataset_shard(folder: Path, rows: list[dict]) -> None:
    """A shard as video2dataset's webdataset writer leaves it: ``00000.tar`` of the written rows
    ({key}.mp4, .txt, .json with its meta) and ``00000.parquet`` with every row's meta (url,
    key, status, error_message, caption ...), failures included."""
    metas, members = [], []
    for i, r in enumerate(rows):
        key = f"00000{i:04d}"
        ok = r.get("status", "success") == "success"
        meta = {
            "url": r["url"], "key": key, "status": "success" if ok else r["status"], "caption": r["caption"],
            "error_message": None if ok else "HTTP Error 403: Forbidden", "license": "CC-BY-4.0",
            "duration": 4.0 if ok else None,
        }  # fmt: skip
        metas.append(meta)
        if ok:
            members += [
                (f"{key}.mp4", r["mp4"]),
                (f"{key}.txt", r["caption"].encode()),
                (f"{key}.json", json.dumps(meta, indent=4).encode()),
            ]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    (folder / "00000.tar").write_bytes(buf.getvalue())
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(metas), folder / "00000.parquet")


def test_video2dataset_shards_are_ingested_as_videos_and_released_as_clips(tmp_path, prefect_api_url):
    shards = tmp_path / "v2d"
    shards.mkdir()
    cut = make_video(seconds=4, fps=10, size=(128, 72), cut_at=2.0)
    _video2dataset_shard(
        shards,
        [
            {"url": "https://example.org/a.mp4", "caption": "two scenes", "mp4": cut},
            {"url": "https://example.org/b.mp4", "caption": "never fetched", "status": "failed_to_download"},
            {"url": "https://example.org/c.mp4", "caption": "not a video", "mp4": b"<html>gone</html>"},
        ],
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"""dataset: v2d
storage: {tmp_path / "store"}
sources:
  - {{name: old, manifest: {shards}, kind: webdataset, media: video}}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}}}
  video: {{clips: {{min_s: 1, max_s: 2}}}}
gates:
  download: {{min_success_rate: 0.3}}
execution: {{cluster: local, workers: 1}}
"""
    )
    done = _cli("run", str(recipe), api_url=prefect_api_url)
    assert done.returncode == 0, done.stderr[-3000:]
    release = tmp_path / "store" / "v2d" / "releases" / "v0001"
    ledger = sorted(pq.read_table(release / "ledger.parquet").to_pylist(), key=lambda r: r["row"])
    assert [(r["status"], r["reason"]) for r in ledger] == [
        ("ok", None),
        ("error", "upstream_failed"),
        ("rejected", "not_a_video"),
    ]
    video = ledger[0]["key"]
    samples = pq.read_table(release / "samples.parquet").to_pylist()
    assert sorted(s["key"] for s in samples) == [f"{video}_c000", f"{video}_c001"]
    with tarfile.open(next(release.glob("*.tar"))) as tf:
        meta = json.loads(tf.extractfile(f"{video}_c001.json").read())
    assert meta["url"] == "https://example.org/a.mp4" and meta["caption"] == "two scenes"
    assert meta["upstream"]["duration"] == 4.0 and (meta["start_s"], meta["end_s"]) == (2.0, 4.0)


def test_caption_spans_become_clips_with_their_own_captions(tmp_path, prefect_api_url):
    video = make_video(seconds=6, fps=10, size=(128, 72), cut_at=3.0)
    spans = json.dumps(
        [
            {"start": 0.5, "end": 2.5, "caption": "the red square sets off, mail jane.doe@example.com"},
            {"start": 3.0, "end": 5.0, "caption": "  "},  # no caption left after cleanup
            [5.0, 6.0],  # no caption of its own: the row's
        ]
    )
    names, store = _release(
        tmp_path,
        {"spans.mp4": video, "bad.mp4": video},
        prefect_api_url,
        clips="{split: captions, min_s: 0.5, max_s: 5}",
        segments={"spans.mp4": spans, "bad.mp4": '[{"start": 4, "end": 2}]'},
        extra="privacy: {text: {mode: redact}}\n",  # a span's caption is checked as a row's is
    )
    fates = _fates(store, names)
    assert fates["spans.mp4"] == ("ok", None)
    assert fates["bad.mp4"] == ("rejected", "bad_segments")
    clips = {}
    for tar in (store / "releases" / "v0001").glob("*.tar"):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".json"):
                    meta = json.loads(tf.extractfile(m).read())
                    clips[(meta["start_s"], meta["end_s"])] = (meta["caption"], meta.get("personal_data"))
    # The spans' captions are also in the json's segments field, which every clip's json carries:
    # the json's fields are checked too, so the email is redacted there and recorded as found
    # there; the clip with it in its own caption records it as its caption's as well.
    assert {k: (caption, {(f["field"], f["kind"]) for f in found or ()}) for k, (caption, found) in clips.items()} == {
        (0.5, 2.5): ("the red square sets off, mail <EMAIL>", {("caption", "email"), ("segments", "email")}),
        (5.0, 6.0): ("a clip of spans.mp4", {("segments", "email")}),
    }
    validated = [
        r
        for p in (store / "validate").rglob("*.ledger.parquet")
        for r in pq.read_table(p, columns=["key", "reason", "start_s", "end_s", "personal_data", "privacy"]).to_pylist()
    ]
    # each clip's row records its own caption's check: the gate counts what each clip releases
    facts = {
        (r["start_s"], r["end_s"]): (r["personal_data"], r["privacy"]) for r in validated if r["start_s"] is not None
    }
    assert facts[(0.5, 2.5)] == facts[(5.0, 6.0)] == ("email", "redacted")
    assert {(r["start_s"], r["end_s"], r["reason"]) for r in validated if r["start_s"] == 3.0} == {
        (3.0, 5.0, "caption_missing")
    }


def _video_folder(put) -> None:
    """Three videos and their sidecars, written by ``put(name, bytes)``."""
    put("trip/day1.mp4", make_video(seconds=2, fps=10, size=(128, 72)))
    put("trip/day1.txt", b"a red square crosses the sky\n")
    put("trip/day2.webm", make_video(seconds=2, fps=10, size=(128, 72), container="webm", codec="libvpx-vp9",
                                     draw=lambda i, t: scene("b", i, (128, 72))))  # fmt: skip
    put(
        "trip/day2.json",
        json.dumps({"caption": "a blue square on sand", "license": "CC-BY-4.0", "camera": "x"}).encode(),
    )
    put("trip/notes.md", b"not a video: not listed")
    put("broken.mp4", b"<html>not a video</html>")


def _files_recipe(tmp_path: Path, manifest: str, storage: str, options: str = "{}") -> Path:
    recipe = tmp_path / "files.yaml"
    recipe.write_text(
        f"""dataset: trips
storage: {storage}
storage_options: {options}
sources:
  - {{name: cam, manifest: "{manifest}", kind: files, media: video}}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}, source_defaults: {{cam: CC0-1.0}}}}
  video: {{clips: {{min_s: 1, max_s: 2}}}}
gates:
  download: {{min_success_rate: 0.5}}
execution: {{cluster: local, workers: 1}}
"""
    )
    return recipe


def _captions(release_files) -> dict[str, tuple[str, str]]:
    out = {}
    for data in release_files:
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".json"):
                    meta = json.loads(tf.extractfile(m).read())
                    out[meta["file"].rsplit("/", 1)[-1]] = (meta["caption"], meta["license"])
    return out


def test_a_folder_of_videos_is_a_source_each_file_a_row_captioned_by_its_sidecar(tmp_path, prefect_api_url):
    root = tmp_path / "videos"

    def put(name: str, data: bytes) -> None:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)

    _video_folder(put)
    recipe = _files_recipe(tmp_path, str(root), str(tmp_path / "store"))
    done = _cli("run", str(recipe), api_url=prefect_api_url)
    assert done.returncode == 0, done.stderr[-3000:]
    release = tmp_path / "store" / "trips" / "releases" / "v0001"
    ledger = pq.read_table(release / "ledger.parquet").to_pylist()
    assert sorted((r["status"], r["reason"]) for r in ledger) == [
        ("ok", None),
        ("ok", None),
        ("rejected", "not_a_video"),
    ]
    captions = _captions(p.read_bytes() for p in release.glob("*.tar"))
    assert captions == {
        "day1.mp4": ("a red square crosses the sky", "CC0-1.0"),
        "day2.webm": ("a blue square on sand", "CC-BY-4.0"),
    }
    # An edited sidecar is a new version of its video's row: judged again, the rest kept.
    (root / "trip" / "day1.txt").write_text("the red square again\n")
    again = _cli("run", str(recipe), "--json", api_url=prefect_api_url)
    assert again.returncode == 0, again.stderr[-3000:]
    shards = json.loads(again.stdout)["download"]
    assert (shards["shards"], shards["shards_skipped"]) == (3, 2)


def test_an_s3_prefix_of_videos_is_a_source(tmp_path, s3_bucket, prefect_api_url):
    import s3fs

    bucket, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    _video_folder(lambda name, data: fs.pipe(f"{bucket}/in/{name}", data))
    recipe = _files_recipe(tmp_path, f"s3://{bucket}/in/", f"s3://{bucket}/store", json.dumps(options))
    done = _cli("run", str(recipe), api_url=prefect_api_url)
    assert done.returncode == 0, done.stderr[-3000:]
    release = f"{bucket}/store/trips/releases/v0001"
    ledger = pq.read_table(io.BytesIO(fs.cat(f"{release}/ledger.parquet"))).to_pylist()
    assert sorted((r["status"], r["reason"]) for r in ledger) == [
        ("ok", None),
        ("ok", None),
        ("rejected", "not_a_video"),
    ]
    captions = _captions(fs.cat(p) for p in fs.glob(f"{release}/*.tar"))
    assert captions["day2.webm"] == ("a blue square on sand", "CC-BY-4.0")


def test_a_video_larger_than_the_tar_readers_default_cap_is_released_read_from_files_not_memory(
    tmp_path, prefect_api_url
):
    # 65 MiB of padding in an mp4 "free" box after the movie: players skip it, and it takes
    # the body over the tar reader's default 64 MiB member cap, which validation used to read
    # the download shard with (the shard failed: tar_member_too_large).
    small = make_video(seconds=3, fps=10, size=(128, 72), cut_at=1.5)
    pad = 65 * 2**20
    big = small + (pad + 8).to_bytes(4, "big") + b"free" + bytes(pad)
    names, store = _release(tmp_path, {"big.mp4": big}, prefect_api_url)
    assert _fates(store, names)["big.mp4"] == ("ok", None)
    downloads = [r for p in (store / "download").rglob("*.ledger.parquet") for r in pq.read_table(p).to_pylist()]
    (row,) = [r for r in downloads if r["row"] == 0]
    assert row["bytes"] == len(big) > 64 * 2**20
    import hashlib

    assert row["sha256"] == hashlib.sha256(big).hexdigest()
    samples = pq.read_table(store / "releases" / "v0001" / "samples.parquet").to_pylist()
    assert sorted(s["key"] for s in samples) == ["v-000000000_c000", "v-000000000_c001"]

    # New clip settings judge the kept download shard again (no fetch: the server is gone):
    # its 65 MiB member is read into a local file, as the fetch wrote it.
    recipe = tmp_path / "r.yaml"
    recipe.write_text(recipe.read_text().replace("{min_s: 1, max_s: 2}", "{min_s: 1, max_s: 1}"))
    again = _cli("run", str(recipe), api_url=prefect_api_url)
    assert again.returncode == 0, again.stderr[-3000:]
    metas = []
    for tar in sorted((store / "releases" / "v0002").glob("*.tar")):
        with tarfile.open(tar) as tf:
            metas += [json.loads(tf.extractfile(m).read()) for m in tf.getmembers() if m.name.endswith(".json")]
    assert metas and all(m["video"] == "v-000000000" and m["duration_s"] == 1.0 for m in metas)
