"""Clip frames decoded by DALI's video decoder (NVDEC on a GPU worker, libavcodec's VP8/VP9/MJPEG on the CPU), as PyAV's ``decode_clip`` takes them."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.models.placement import PrecacheError, decode_device
from tasks.video.frames import DEFAULT_MAX_PIXELS, FramePicker, decode_clip, fit_geometry

# What DALI 2.4's CPU build decodes (its docs: H.264, HEVC, AV1 and MPEG-4 are the GPU's only).
CPU_CODECS = frozenset({"vp8", "vp9", "mjpeg"})


class ClipDecodeError(ValueError):
    """A clip of a batch that could not be decoded; ``index`` is its place in the batch."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(f"clip {index}: {why}")
        self.index, self.why = index, why


@dataclass(frozen=True, slots=True)
class ClipPlan:
    """What DALI is asked for one clip: the frames by index in presentation order (repeats
    included), how many are real, and the resize and crop that fit them to a square."""

    frames: list[int]
    real: int
    codec: str
    resize: tuple[int, int] | None  # width, height before the crop
    start: tuple[int, int] | None  # top, left of the crop


def pick_frames(times: Sequence[float], frames: int, fps: float | None) -> tuple[list[int], int]:
    """Indexes of the frames ``decode_clip`` takes from frames shown at ``times`` (seconds, in
    presentation order), padded with the last pick, and the count of real ones."""
    picker = FramePicker(frames, fps)
    for i, t in enumerate(times):
        if picker.offer(i, t):
            break
    return picker.result()


def plan_clip(
    data: bytes, frames: int, fps: float | None, size: int | None, max_pixels: int = DEFAULT_MAX_PIXELS
) -> ClipPlan:
    """The clip's frame times from its container's packets (demuxed, not decoded: DALI counts
    frames the same way, every packet of the stream sorted by its timestamp), checked against
    ``max_pixels`` from the stream's header as ``decode_clip`` does."""
    import av

    if frames < 1:
        raise ValueError("frames must be >= 1")
    with av.open(io.BytesIO(data), mode="r") as box:
        stream = box.streams.video[0]
        w, h = stream.width, stream.height
        if w * h > max_pixels:
            raise ValueError(f"clip frames of {w}x{h} pixels are over max_pixels={max_pixels}")
        codec = stream.codec_context.name
        stamps: list[int] = []
        for packet in box.demux(stream):
            stamp = packet.pts if packet.pts is not None else packet.dts
            if packet.size and stamp is not None:
                stamps.append(stamp)
        base = stream.time_base
    stamps.sort()
    times = [float(s * base) for s in stamps] if base is not None else [float(s) for s in stamps]
    picked, real = pick_frames(times, frames, fps)
    if size is None:
        return ClipPlan(picked, real, codec, None, None)
    nw, nh, left, top = fit_geometry(w, h, size)  # as fit_image fits PyAV's frames
    return ClipPlan(picked, real, codec, (nw, nh), (top, left))


def clip_decoder(cfg: PrecacheConfig) -> tuple[str, str]:
    """``(decoder, device)`` for ``precache.clip_latents``: ``("dali", "mixed")`` on a worker
    with a GPU (as ``precache.decode`` decides), ``("pyav", "cpu")`` otherwise; ``decoder:
    dali`` on a worker without one is ``("dali", "cpu")``."""
    choice = cfg.clip_latents.decoder if cfg.clip_latents is not None else "auto"
    if choice == "pyav":
        return "pyav", "cpu"
    device = decode_device(cfg)
    if choice == "auto" and device != "mixed":
        return "pyav", "cpu"
    return "dali", device


class _Pipe:
    """One built DALI pipeline fed through external sources; one batch at a time."""

    def __init__(self, device: str, batch_size: int, fit: bool) -> None:
        from nvidia.dali import fn, pipeline_def, types

        self.lock = threading.Lock()
        self.fit = fit

        @pipeline_def(
            batch_size=batch_size,
            # Half the cores at most, as the image decode: on a CPU worker the encoder needs the rest.
            num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)),
            device_id=0 if device == "mixed" else None,
            prefetch_queue_depth=1,  # fed one batch per run
            exec_dynamic=True,
        )
        def pipe():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            picks = fn.external_source(name="frames", dtype=types.INT32, ndim=1)
            video = fn.decoders.video(encoded, device=device, frames=picks)  # (F, H, W, C)
            if fit:
                rx = fn.external_source(name="resize_x", dtype=types.FLOAT, ndim=0)
                ry = fn.external_source(name="resize_y", dtype=types.FLOAT, ndim=0)
                start = fn.external_source(name="start", dtype=types.INT32, ndim=1)
                shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
                # Triangle filter widened when shrinking, as PIL's BILINEAR in fit_image.
                video = fn.resize(video, resize_x=rx, resize_y=ry, interp_type=types.INTERP_LINEAR, antialias=True)
                video = fn.slice(video, start=start, shape=shape, axis_names="HW")
            return fn.transpose(video, perm=[0, 3, 1, 2])

        self.pipe = pipe()
        self.pipe.build()

    def run(self, datas: list[bytes], plans: list[ClipPlan], size: int | None) -> list[Any]:
        import numpy as np
        import torch

        from tasks.models.batches import to_torch

        with self.lock:
            p = self.pipe
            p.feed_input("encoded", [np.frombuffer(d, np.uint8) for d in datas])
            p.feed_input("frames", [np.asarray(pl.frames, np.int32) for pl in plans])
            if self.fit:
                p.feed_input("resize_x", [np.float32(pl.resize[0]) for pl in plans])  # type: ignore[index]
                p.feed_input("resize_y", [np.float32(pl.resize[1]) for pl in plans])  # type: ignore[index]
                p.feed_input("start", [np.asarray(pl.start, np.int32) for pl in plans])
                p.feed_input("shape", [np.asarray([size, size], np.int32) for _ in plans])
            (out,) = p.run()
            # Copied out before the next run may reuse DALI's buffers.
            if out.is_dense_tensor():
                return list(to_torch(out).clone())
            host = out.as_cpu() if hasattr(out, "as_cpu") else out
            return [torch.from_numpy(np.array(host[i])) for i in range(len(datas))]


_PIPES: dict[tuple[str, int, bool], _Pipe] = {}
_PIPES_LOCK = threading.Lock()


def _pipe(device: str, batch_size: int, fit: bool) -> _Pipe:
    """A pipeline per worker process and setting, built once (building one costs more than a batch)."""
    key = (device, batch_size, fit)
    with _PIPES_LOCK:
        if key not in _PIPES:
            _PIPES[key] = _Pipe(device, batch_size, fit)
        return _PIPES[key]


def _drop(device: str, batch_size: int, fit: bool) -> None:
    with _PIPES_LOCK:
        _PIPES.pop((device, batch_size, fit), None)


def dali_decode(
    datas: list[bytes],
    frames: int,
    fps: float | None,
    size: int | None,
    device: str = "cpu",
    batch_size: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> list[tuple[Any, int]]:
    """mp4 bytes of a batch of clips -> ``decode_clip``'s ``(uint8 (frames, 3, size, size), real
    frames)`` for each, decoded, resized and cropped by DALI on ``device`` (``mixed``: the
    tensors are on the GPU). Raises ClipDecodeError naming the clip's place in the batch."""
    plans = []
    for i, data in enumerate(datas):
        try:
            plan = plan_clip(data, frames, fps, size, max_pixels)
        except Exception as e:
            raise ClipDecodeError(i, str(e)) from e
        if device == "cpu" and plan.codec not in CPU_CODECS:
            raise ClipDecodeError(
                i,
                f"DALI's CPU video decoder does not decode {plan.codec} (only {', '.join(sorted(CPU_CODECS))}); "
                "decode it on a GPU worker or with decoder: pyav",
            )
        plans.append(plan)
    if not datas:
        return []
    bs = max(batch_size or len(datas), len(datas))
    pipe = _pipe(device, bs, size is not None)
    try:
        out = pipe.run(datas, plans, size)
    except Exception as e:
        # A failed run leaves the pipeline unusable; one clip at a time finds the one at fault.
        _drop(device, bs, size is not None)
        if len(datas) == 1:
            raise ClipDecodeError(0, f"DALI's video decoder failed: {_last_line(e)}") from e
        found: list[tuple[Any, int]] = []
        for i, data in enumerate(datas):
            try:
                found += dali_decode([data], frames, fps, size, device, bs, max_pixels)
            except ClipDecodeError as one:
                raise ClipDecodeError(i, one.why) from one
        return found
    return list(zip(out, [p.real for p in plans], strict=True))


def decode_clips(
    clips: list[tuple[str, bytes]],
    cfg: PrecacheConfig,
    size: int | None,
    where: str,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> list[Any]:
    """The frame stacks of ``(key, mp4 bytes)`` clips for ``precache.clip_latents``, decoded by
    the decoder it names (``clip_decoder``); a clip that fails raises PrecacheError naming
    ``where`` (the shard) and the sample."""
    clip = cfg.clip_latents
    if clip is None:
        return []
    decoder, device = clip_decoder(cfg)
    if decoder == "pyav":
        stacks = []
        for key, data in clips:
            try:
                stacks.append(decode_clip(data, clip.frames, clip.fps, size, max_pixels)[0])
            except Exception as e:
                raise PrecacheError(f"{where}: sample {key}: PyAV could not decode its clip: {e}") from e
        return stacks
    try:
        decoded = dali_decode([d for _, d in clips], clip.frames, clip.fps, size, device, cfg.batch_size, max_pixels)
    except ClipDecodeError as e:
        raise PrecacheError(f"{where}: sample {clips[e.index][0]}: {e.why}") from e
    return [t for t, _ in decoded]


def _last_line(e: BaseException) -> str:
    """DALI's reason without its pipeline traceback: the line after ``encountered:``."""
    text = str(e)
    lines = [line.strip() for line in text.partition("encountered:")[2 if "encountered:" in text else 0].splitlines()]
    why = next((line for line in lines if line), type(e).__name__)
    return why.split(" failed: ", 1)[-1] if why.startswith("Assert on") else why
