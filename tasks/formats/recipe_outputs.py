"""Recipe models of the reshard and precache phases, and the gates of the pretraining phases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.formats.recipe_base import ComputeDtype, Frozen
from tasks.formats.recipe_download import ValidateConfig


class ReshardConfig(Frozen):
    """Resharding into equal-size shards (reorganize_tar).

    Args:
        samples_per_shard: every output shard holds exactly this many samples, the last the
            remainder (recorded as the release's ``tail``).
        seed: shuffle samples across the whole dataset with this seed; ``null`` keeps the
            (source, row) order.
        required_members: extensions every carried sample must have; by default the image
            (from ``validate.image.output_format``), ``json``, and ``txt`` when captions are
            required.
    """

    samples_per_shard: int = Field(default=1000, ge=1, le=10_000_000)
    seed: int | None = None
    required_members: tuple[str, ...] | None = None

    def required(self, validate: ValidateConfig) -> tuple[str, ...]:
        if self.required_members is not None:
            return self.required_members
        image = {"jpeg": "jpg", "png": "png", "webp": "webp"}[validate.image.output_format]
        return (image, "json", "txt") if validate.caption.required else (image, "json")


class ImageLatentsConfig(Frozen):
    """Image latents from a frozen diffusers ``AutoencoderKL``.

    Args:
        model: local directory of the VAE (``save_pretrained`` layout); never downloaded.
        subfolder: folder inside ``model`` that holds the VAE (``vae`` for a whole pipeline).
        resolution: images are resized (shorter side) and center-cropped to this square; a
            multiple of 8.
        store: ``mean_logvar`` keeps the latent distribution (mean and log-variance, so training
            can sample fresh noise every epoch), ``mean`` only the mean, ``sample`` one draw
            seeded by the key.
        compute_dtype: this encoder's compute precision (default ``None``: ``precache.compute_dtype``).
    """

    model: str = Field(min_length=1)
    subfolder: str | None = None
    resolution: int = Field(default=256, ge=8, le=4096, multiple_of=8)
    store: Literal["mean_logvar", "mean", "sample"] = "mean_logvar"
    compute_dtype: ComputeDtype | None = None


class ClipLatentsConfig(Frozen):
    """Latents of video clips at the ``image_latents`` resolution and with its ``store``:
    ``frames`` frames taken every ``1 / fps`` seconds from the clip's first (decoded as
    ``decoder`` says; a short clip repeats its last frame), each through the ``image_latents``
    VAE, or the whole clip through a video VAE (``model``). Stored as ``clip_latent*.npy`` of
    shape ``(T, C, h, w)`` beside the keyframe's latents: ``T = frames`` through the image VAE,
    ``T = 1 + (frames - 1) / r`` through a video VAE of temporal compression ``r``.

    Args:
        frames: frames per clip. Default 8. A video VAE takes ``1 + k * r`` frames (``1, 5, 9,
            ...`` for Wan's and CogVideoX's ``r = 4``, ``1, 9, 17, ...`` for LTX-Video's 8);
            another count stops precache before any work.
        fps: the rate they are taken at; ``None`` takes consecutive frames. Default 4.
        model: local folder of a diffusers video VAE (``save_pretrained`` layout; never
            downloaded), its class read from its ``config.json``: ``AutoencoderKLWan``,
            ``AutoencoderKLLTXVideo``, ``AutoencoderKLCogVideoX`` or
            ``AutoencoderKLHunyuanVideo``. Default ``None``: frames through the image VAE.
        subfolder: folder inside ``model`` that holds the VAE (``vae`` for a whole pipeline).
        decoder: ``auto`` decodes with DALI's video decoder on the GPU (NVDEC, resized and
            cropped there too) on a worker with one, as ``precache.decode`` decides, and with
            PyAV on the CPU otherwise; ``pyav`` always PyAV; ``dali`` always DALI, whose CPU
            build decodes VP8, VP9 and MJPEG but not H.264 (``validate.video.clips.codec``).
            Both take the same frames; pixels differ by decoder and resizer rounding. A clip
            that fails to decode fails the shard with an error naming it and its sample.
            Default auto.
        compute_dtype: this encoder's compute precision (default ``None``: ``precache.compute_dtype``).
    """

    frames: int = Field(default=8, ge=1, le=256)
    fps: float | None = Field(default=4.0, gt=0, le=240)
    model: str | None = Field(default=None, min_length=1)
    subfolder: str | None = None
    decoder: Literal["auto", "pyav", "dali"] = "auto"
    compute_dtype: ComputeDtype | None = None


class TextEmbeddingsConfig(Frozen):
    """Caption embeddings from a frozen transformers text encoder (CLIP text model or T5 encoder).

    Args:
        model: local directory of the encoder; never downloaded.
        tokenizer: local directory of its tokenizer (default: ``model``).
        max_length: captions are padded and truncated to this many tokens; the attention mask
            is stored beside the embedding.
        compute_dtype: this encoder's compute precision (default ``None``: ``precache.compute_dtype``).
    """

    model: str = Field(min_length=1)
    tokenizer: str | None = None
    max_length: int = Field(default=77, ge=1, le=4096)
    compute_dtype: ComputeDtype | None = None


class VisionFeaturesConfig(Frozen):
    """Features of a frozen vision encoder (CLIP or SigLIP vision model) for VLM recipes.

    Args:
        model: local directory of the vision model; never downloaded.
        resolution: input size (default: the model config's ``image_size``).
        compute_dtype: this encoder's compute precision (default ``None``: ``precache.compute_dtype``).
    """

    model: str = Field(min_length=1)
    resolution: int | None = Field(default=None, ge=8, le=4096)
    compute_dtype: ComputeDtype | None = None


class ImageEmbeddingConfig(Frozen):
    """Pooled image embeddings of a CLIP-family dual encoder (one L2-normalised vector per sample).

    When the recipe's curation uses the same model (the same folder digest), the embeddings it
    stored are read back instead of encoded again.

    Args:
        model: local folder of the dual encoder, as ``curate.model`` takes it; never downloaded.
        compute_dtype: this encoder's compute precision (default ``None``: ``precache.compute_dtype``).
    """

    model: str = Field(min_length=1)
    compute_dtype: ComputeDtype | None = None


class PrecacheConfig(Frozen):
    """Outputs of frozen encoders computed once per resharded shard (phase ``precache``).

    Nothing is precached unless at least one encoder is configured.

    Args:
        image_latents: VAE latents of the images.
        clip_latents: VAE latents of sampled frames of video clips (needs ``image_latents``).
        text: caption embeddings with their attention mask.
        vision: vision-encoder features.
        image_embedding: a dual encoder's pooled image embedding (``image_emb.npy``), reused
            from curation when it embedded the samples with the same model.
        dtype: storage dtype of the arrays (``bf16`` is stored as its raw 16 bits, ``<u2``).
        batch_size: images per decode and encode batch.
        prefetch: batches DALI prepares ahead.
        decode: ``auto`` decodes on the GPU (DALI ``mixed``) when the worker has one; ``gpu``
            always (see ``device``), ``cpu`` never.
        device: ``auto`` runs the encoders on the GPU when the worker has one; ``cuda`` always:
            a run on a cluster of this machine's that has no GPU stops before it starts (exit
            2), and a worker of an existing cluster that sees none fails its shards.
        compute_dtype: the precision the encoders compute in (weights stay fp32; matrix
            products and convolutions run under autocast): ``auto`` takes bf16 on CPUs with
            AVX512-BF16 or AMX and on GPUs that support it, fp32 otherwise. Each encoder's block
            may set its own ``compute_dtype`` instead. The dtypes used name the latent shards and
            are recorded per encoding in index.json. ``dtype`` (storage) is its own setting.
    """

    image_latents: ImageLatentsConfig | None = None
    clip_latents: ClipLatentsConfig | None = None
    text: TextEmbeddingsConfig | None = None
    vision: VisionFeaturesConfig | None = None
    image_embedding: ImageEmbeddingConfig | None = None
    dtype: Literal["fp16", "bf16", "fp32"] = "fp16"
    batch_size: int = Field(default=16, ge=1, le=4096)
    prefetch: int = Field(default=2, ge=1, le=64)
    decode: Literal["auto", "cpu", "gpu"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compute_dtype: ComputeDtype = "auto"

    @property
    def enabled(self) -> bool:
        return any((self.image_latents, self.text, self.vision, self.image_embedding))

    @model_validator(mode="after")
    def _clips_need_the_vae(self) -> PrecacheConfig:
        if self.clip_latents is not None and self.image_latents is None:
            raise ValueError(
                "clip_latents takes its frame size and store from image_latents (whose VAE also encodes the frames "
                "unless clip_latents.model names a video VAE): configure image_latents too"
            )
        return self


class DownloadGate(Frozen):
    """Thresholds of the download gate.

    Args:
        min_success_rate: ok / rows at least this.
        max_reason_rate: largest allowed share of rows per reason, e.g. ``{timeout: 0.05}``.
    """

    min_success_rate: float = Field(default=0.5, ge=0, le=1)
    max_reason_rate: dict[str, float] = Field(default_factory=dict)


class ValidateGate(Frozen):
    """Thresholds of the validation gate.

    Args:
        max_reject_rate: rejected / rows of the phase at most this.
        min_samples: accepted samples at least this (and never below 1).
        require_license_review: block when the recipe has no license review.
        max_face_rate: accepted samples released with a face that is not blurred (``privacy.faces``
            on ``record``), share at most this; with ``blur`` or ``reject`` none is released. Faces
            are common in web images, so the default bounds nothing: set it to hold a dataset to it.
        max_personal_data_rate: accepted samples released with personal data in their text
            (``privacy.text`` on ``record``), share at most this; ``redact`` and ``reject`` release none.
    """

    max_reject_rate: float = Field(default=0.5, ge=0, le=1)
    min_samples: int = Field(default=1, ge=1)
    require_license_review: bool = True
    max_face_rate: float = Field(default=1.0, ge=0, le=1)
    max_personal_data_rate: float = Field(default=0.05, ge=0, le=1)


class PrecacheGate(Frozen):
    """Thresholds of the precache gate, per latent channel over the whole dataset.

    The defaults fit a VAE whose scaling factor is applied (unit-variance latents): a wrong
    scaling or a broken model moves the channel statistics far outside them.

    Args:
        max_abs_channel_mean: |mean| of every scaled latent channel at most this.
        min_channel_std: std of every scaled latent channel at least this.
        max_channel_std: std of every scaled latent channel at most this.
    """

    max_abs_channel_mean: float = Field(default=3.0, ge=0)
    min_channel_std: float = Field(default=0.05, ge=0)
    max_channel_std: float = Field(default=5.0, gt=0)
