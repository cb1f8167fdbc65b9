"""Dataset recipes: YAML files validated by one frozen pydantic model per stage config."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator

from tasks.formats.names import digest_of
from tasks.formats.recipe_base import NAME_PATTERN, Frozen, RecipeError
from tasks.formats.recipe_curate import CurateConfig, CurateGate
from tasks.formats.recipe_download import DownloadConfig, SourceConfig, ValidateConfig
from tasks.formats.recipe_finetune import FinetuneConfig, FinetuneGate
from tasks.formats.recipe_outputs import DownloadGate, PrecacheConfig, PrecacheGate, ReshardConfig, ValidateGate
from tasks.formats.recipe_privacy import PrivacyConfig
from tasks.formats.recipe_upkeep import TakedownList, UpkeepGate

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class GatesConfig(Frozen):
    """One gate per phase; a failed gate stops the flow and still writes its report."""

    download: DownloadGate = DownloadGate()
    validate_: ValidateGate = Field(default=ValidateGate(), alias="validate")
    curate: CurateGate = CurateGate()
    precache: PrecacheGate = PrecacheGate()
    finetune: FinetuneGate = FinetuneGate()
    upkeep: UpkeepGate = UpkeepGate()

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class ExecutionConfig(Frozen):
    """Where tasks run.

    Args:
        cluster: ``local`` (a Dask LocalCluster), ``cuda`` (a dask-cuda LocalCUDACluster) or the
            address of an existing Dask scheduler (``tcp://host:8786``).
        workers: worker processes of a local cluster (default: one per core).
        threads_per_worker: threads per worker process.
        task_retries: Prefect retries of a failed shard task.
    """

    cluster: str = "local"
    workers: int | None = Field(default=None, ge=1, le=512)
    threads_per_worker: int = Field(default=1, ge=1, le=64)
    task_retries: int = Field(default=2, ge=0, le=10)
    task_retry_delay_s: float = Field(default=2.0, ge=0, le=600)


# Option names that hold credentials (s3fs's key/secret/token, botocore's aws_* and any
# password, token or private key, at any depth): their values are masked in JSON dumps.
_CREDENTIAL = re.compile(r"(?i)secret|token|passw|credential|private|^key$|access_key|session")
MASKED = "***"


def masked_options(options: Any) -> Any:
    """``options`` with the value of every credential-named key replaced by ``MASKED``."""
    if isinstance(options, dict):
        return {k: MASKED if _CREDENTIAL.search(str(k)) and v else masked_options(v) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return [masked_options(v) for v in options]
    return options


class Recipe(Frozen):
    """A dataset recipe.

    Args:
        dataset: dataset name; the top folder under the storage root.
        kind: ``pretraining`` (caption pairs) or ``finetuning`` (conversations).
        storage: root URL, local path or ``s3://bucket/prefix``.
        storage_options: passed to fsspec (e.g. ``endpoint_url`` for S3-compatible stores),
            except ``file_mode``: the mode of local files written (default ``0644``, folders
            ``0755``; stricter such as ``0640`` or ``0600``; see ``tasks.formats.storage.file_modes``).
        sources: the URL manifests.
        curate: curation between validation and resharding (off unless ``curate.model`` is set).
        takedown: takedown lists (local files or ``s3://`` objects; see ``TakedownList``),
            applied by every release to every row, old and new, without downloading anything.
        privacy: faces, personal data in text and image metadata, applied by validation (and
            by fine-tuning's record checks, to every turn); see ``PrivacyConfig``.
    """

    dataset: str = Field(pattern=NAME_PATTERN)
    kind: Literal["pretraining", "finetuning"] = "pretraining"
    storage: str = Field(min_length=1)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    sources: tuple[SourceConfig, ...] = Field(min_length=1)
    download: DownloadConfig = DownloadConfig()
    validate_: ValidateConfig = Field(default=ValidateConfig(), alias="validate")
    privacy: PrivacyConfig = PrivacyConfig()
    curate: CurateConfig = CurateConfig()
    reshard: ReshardConfig = ReshardConfig()
    precache: PrecacheConfig = PrecacheConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    gates: GatesConfig = GatesConfig()
    execution: ExecutionConfig = ExecutionConfig()
    takedown: tuple[TakedownList, ...] = ()

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @field_validator("storage_options")
    @classmethod
    def _file_mode(cls, v: dict[str, Any]) -> dict[str, Any]:
        from tasks.formats.storage import FILE_MODE_OPTION, file_modes

        file_modes(v.get(FILE_MODE_OPTION))  # raises ValueError naming the setting
        return v

    @field_serializer("storage_options", when_used="json")
    def _hide_credentials(self, options: dict[str, Any]) -> dict[str, Any]:
        """Credentials never leave the process as JSON: Prefect records every flow's parameters
        (the phase flows take the recipe), and its UI and API show them. The recipe itself, in
        memory and pickled to Dask workers, keeps them."""
        return masked_options(options)

    @model_validator(mode="after")
    def _privacy_to_validation(self) -> Recipe:
        """The top-level ``privacy:`` block, copied into ``validate`` for the stages judging samples,
        and its ``text`` into ``finetune.conversation`` for the records' turns."""
        # A dumped recipe read again carries the copies; only a different one is an error.
        conv = self.finetune.conversation
        if ("privacy" in self.validate_.model_fields_set and self.validate_.privacy != self.privacy) or (
            "privacy" in conv.model_fields_set and conv.privacy != self.privacy.text
        ):
            raise ValueError(
                "privacy is a top-level block of the recipe, not validate.privacy or finetune.conversation.privacy"
            )
        object.__setattr__(self, "validate_", self.validate_.model_copy(update={"privacy": self.privacy}))
        conv = conv.model_copy(update={"privacy": self.privacy.text})
        object.__setattr__(self, "finetune", self.finetune.model_copy(update={"conversation": conv}))
        return self

    @model_validator(mode="after")
    def _unique_sources(self) -> Recipe:
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique, repeated: {', '.join(dupes)}")
        return self

    @property
    def fetched_sources(self) -> list[str]:
        """The sources whose rows are fetched from their URLs (``kind: manifest``): the ones a later
        run retries and rechecks. Existing data (shards, parquet, files) was fetched by another
        tool, which may have re-encoded the bytes, so its URLs do not serve the released ones."""
        return [s.name for s in self.sources if s.kind == "manifest"]

    @property
    def has_video(self) -> bool:
        """Some source's rows are videos (``media: video``)."""
        return any(s.media == "video" for s in self.sources)

    def download_for(self, source: str) -> DownloadConfig:
        """The download settings of one source's rows: a video source keeps the video
        containers ``validate.video`` accepts, under ``download.video_max_bytes``, at most
        ``download.video_max_inflight`` at a time."""
        if next(s for s in self.sources if s.name == source).media != "video":
            return self.download
        cfg = self.download
        return cfg.model_copy(
            update={
                "allowed_formats": self.validate_.video.containers,
                "max_bytes": cfg.video_max_bytes,
                "max_inflight": min(cfg.max_inflight, cfg.video_max_inflight),
                "per_host": min(cfg.per_host, cfg.video_max_inflight),
            }
        )

    def config_hash(self, *parts: BaseModel) -> str:
        """Hash of the given stage configs, for output names that change when they change."""
        return digest_of(*(p.model_dump(mode="json") for p in parts))

    def source_order(self) -> dict[str, int]:
        """Each source's place in the recipe: the order dedup keeps the first of a group by."""
        return {s.name: i for i, s in enumerate(self.sources)}

    def recipe_hash(self) -> str:
        """Hash of what the recipe says the dataset is: where and how it runs (``execution``,
        ``storage``, ``storage_options`` with their credentials and file modes) is left out, so
        moving the store or adding workers makes no new release."""
        exclude: dict[str, Any] = dict.fromkeys(("execution", "storage", "storage_options"), True)
        if not self.has_video:  # video settings name no new release of a dataset without videos
            exclude |= {
                "validate_": {"video"},
                "download": {
                    "video_max_bytes",
                    "video_max_inflight",
                    "video_min_bytes_per_s",
                    "video_min_rate_after_s",
                },
            }
        blob = json.dumps(self.model_dump(mode="json", exclude=exclude), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def _expand_env(value: Any, where: str, path: Path) -> Any:
    """Expand ``${VAR}`` and ``${VAR:-default}`` in string values."""
    if isinstance(value, dict):
        return {k: _expand_env(v, f"{where}.{k}" if where else str(k), path) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{where}[{i}]", path) for i, v in enumerate(value)]
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise RecipeError(f"{path}: {where}: environment variable {name} is not set")

        return _ENV_REF.sub(sub, value)
    return value


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"override {dotted}: {part} is not a mapping")
    node[parts[-1]] = value


def _format_errors(path: Path | str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = e.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{path}: {loc}: {e['msg']}{got_text}")
    return "\n".join(lines)


def parse_recipe(data: Any, path: Path | str = "<recipe>", overrides: dict[str, Any] | None = None) -> Recipe:
    """Validate recipe data; relative manifest, storage and model paths resolve against the file's folder."""
    path = Path(path)
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    data = _expand_env(data, "", path)
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    base = path.parent if path.name != "<recipe>" else Path.cwd()
    if isinstance(data.get("storage"), str):
        data["storage"] = _resolve_local(data["storage"], base)
    for src in data.get("sources") or []:
        if isinstance(src, dict) and isinstance(src.get("manifest"), str):
            src["manifest"] = _resolve_local(src["manifest"], base)
    pre = data.get("precache")
    if isinstance(pre, dict):
        stages = (
            ("image_latents", ("model",)),
            ("text", ("model", "tokenizer")),
            ("vision", ("model",)),
            ("image_embedding", ("model",)),
        )
        for stage, keys in stages:
            cfg = pre.get(stage)
            for key in keys:
                if isinstance(cfg, dict) and isinstance(cfg.get(key), str):
                    cfg[key] = _resolve_local(cfg[key], base)
    for i, entry in enumerate(data.get("takedown") or []):
        if isinstance(entry, str):
            data["takedown"][i] = _resolve_local(entry, base)
        elif isinstance(entry, dict) and isinstance(entry.get("path"), str):
            entry["path"] = _resolve_local(entry["path"], base)
    cur = data.get("curate")
    if isinstance(cur, dict):
        for key in ("model", "tokenizer"):
            if isinstance(cur.get(key), str):
                cur[key] = _resolve_local(cur[key], base)
        for head in (cur.get("heads") or {}).values() if isinstance(cur.get("heads"), dict) else ():
            if isinstance(head, dict) and isinstance(head.get("path"), str):
                head["path"] = _resolve_local(head["path"], base)
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_errors(path, err)) from None


def _resolve_local(value: str, base: Path) -> str:
    if "://" in value or os.path.isabs(value):
        return value
    return str((base / value).resolve())


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read and validate a recipe file; ``overrides`` maps dotted keys to values."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise RecipeError(f"{path}: cannot read recipe: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{path}{where}: not valid YAML: {getattr(err, 'problem', err)}") from None
    return parse_recipe(data, path, overrides)
