"""Where and in what precision models run: the device, the compute dtype, and the checks before a load.

Every model shardsmith runs (curation's dual encoder, precache's VAE, text and vision encoders,
the video VAE) is placed here. Weights stay in fp32; a ``bf16`` or ``fp16`` compute dtype runs
the matrix products and convolutions in it under ``torch.autocast`` (normalisations and
softmax stay fp32), which is what keeps embeddings within a cosine of 0.999 of fp32's while
the CPU's AMX or AVX512-BF16 units, or the GPU's tensor cores, do the work.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

IMAGE_EXTS = "jpg;jpeg;png;webp"
# Storage and compute dtypes by the recipe's names.
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
STORAGE_DTYPES = TORCH_DTYPES


class ModelError(RuntimeError):
    """A model that cannot run: a missing folder, a model of a kind we do not load, a device we do not have."""


class CurateError(ModelError):
    """A curation that cannot run: a missing or unknown model, a head that does not fit it."""


class PrecacheError(ModelError):
    """A precache that cannot run: a missing model, an unreadable shard, a model of a kind we do not know."""


def need_dir(path: str | None, what: str, error: type[ModelError] = PrecacheError) -> Path:
    """``path`` as a folder, or ``error`` naming the recipe field ``what`` (models are never downloaded)."""
    if not path or not Path(path).is_dir():
        raise error(
            f"{what}: no model directory at {path!r}; models are never downloaded at run time, point the "
            "recipe at a local folder (save_pretrained layout, or an open_clip checkpoint for a dual encoder)"
        )
    return Path(path)


def resolve_device(setting: str, what: str, error: type[ModelError] = PrecacheError) -> str:
    """``cuda`` when asked for, or on ``auto`` when this worker sees a GPU; ``cpu`` otherwise."""
    import torch

    if setting == "cuda" and not torch.cuda.is_available():
        raise error(f"{what} is cuda but this worker sees no CUDA GPU")
    if setting == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def decode_device(cfg: Any, what: str = "precache.decode") -> str:
    """``mixed`` (nvJPEG on the GPU) or ``cpu``, from a config's ``decode`` setting (of the
    precache or curate config, named by ``what``) and what the worker has."""
    import torch

    if cfg.decode == "gpu":
        if not torch.cuda.is_available():
            raise PrecacheError(f"{what} is gpu but this worker sees no CUDA GPU")
        return "mixed"
    if cfg.decode == "cpu":
        return "cpu"
    return "mixed" if torch.cuda.is_available() else "cpu"


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX), as /proc/cpuinfo's flags say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def compute_dtype(setting: str, device: str) -> str:
    """The compute dtype a model block's ``compute_dtype`` means on ``device``: ``auto`` is bf16
    on CPUs with AVX512-BF16 or AMX and on GPUs that support it, fp32 otherwise; an explicit
    ``fp32``/``bf16``/``fp16`` is taken as it is."""
    if setting != "auto":
        return setting
    if device == "cpu":
        return "bf16" if cpu_has_bf16() else "fp32"
    import torch

    return "bf16" if torch.cuda.is_bf16_supported() else "fp32"


def dtype_of(name: str) -> Any:
    import torch

    return getattr(torch, TORCH_DTYPES[name])


@contextlib.contextmanager
def running(device: str, dtype: str) -> Iterator[None]:
    """Inference on ``device`` computing in ``dtype``: no autograd, and autocast unless fp32."""
    import torch

    with torch.inference_mode():
        if dtype == "fp32":
            yield
            return
        with torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=dtype_of(dtype)):
            yield


def frozen(model: Any, device: str, dtype: str = "fp32") -> Any:
    """``model`` on ``device``, in eval mode, without gradients, for ``running(device, dtype)``.

    Weights are fp32 (a checkpoint saved in fp16 or bf16, which transformers loads as saved, is
    cast up). For a bf16 or fp16 ``dtype`` the weights of linear and convolution layers are
    kept in it: autocast would cast them to it at every call anyway (the same values), and
    keeping them so spares that copy per batch; normalisations and embeddings stay fp32. An
    fp32 model is not cast as a whole (diffusers warns then)."""
    import torch

    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        model = model.to(dtype=torch.float32)
    if dtype != "fp32":
        low = dtype_of(dtype)
        kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
        for module in model.modules():
            if isinstance(module, kinds):
                module.to(dtype=low)
    return model.to(device=device).eval().requires_grad_(False)


_DIGESTS: dict[tuple, str] = {}
_DIGESTS_LOCK = threading.Lock()


def folder_digest(*paths: str | None) -> str:
    """SHA-256 over every file of the given folders or files (relative name and content).

    Names embeddings: the same weights give the same name wherever the folder lies, and any
    change of weights, config or tokenizer gives another. Remembered per process by the files'
    sizes and modification times, so a run hashes a large checkpoint once.
    """
    files: list[tuple[str, str, int, int]] = []
    for n, path in enumerate(p for p in paths if p):
        root = Path(path)
        found = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
        for f in found:
            rel = f.name if f == root else f.relative_to(root).as_posix()
            if any(part.startswith(".") for part in Path(rel).parts):
                continue
            st = f.stat()
            files.append((f"{n}/{rel}", str(f), st.st_size, st.st_mtime_ns))
    key = tuple(files)
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    sha = hashlib.sha256()
    for rel, full, size, _ in files:
        sha.update(f"{rel}\0{size}\0".encode())
        with open(full, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                sha.update(block)
    digest = sha.hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS[key] = digest
    return digest


def quiet_model_loading(diffusers: bool) -> None:
    """No progress bars from loading or saving models (transformers' "Loading weights", the
    Hub's, and diffusers' when ``diffusers``: importing diffusers only for this would cost a
    text-only load seconds of CPU).

    In a Dask worker they interleave with the CLI's own progress lines, and each bar's tqdm
    creates a multiprocessing lock: a worker that the cluster's close ends before its
    finalizers run leaves those locks registered, and Python's resource tracker warns of
    "leaked semaphore objects" as the run exits. Idempotent; process-wide, as the libraries keep it.
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the Hub's bars too
    if diffusers:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()


class quiet_transformers:
    """transformers' warnings off while a model is built (a config it fills in warns about token
    ids outside a tiny vocabulary, once per worker and model, in every run's terminal)."""

    def __enter__(self) -> None:
        from transformers.utils import logging as transformers_logging

        self.level = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity(self.level)


def length_order(lengths: list[int]) -> list[int]:
    """Indices of ``lengths`` from the shortest to the longest (stable): batches cut from this
    order pad each caption to its neighbours' length, not to the longest of the whole set."""
    return sorted(range(len(lengths)), key=lambda i: lengths[i])
