"""Dataset recipes: YAML files validated by one frozen pydantic model per stage config."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file, the key and what was expected."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SourceConfig(_Frozen):
    """One URL manifest.

    Args:
        name: source id, lowercase; it prefixes every sample key (``{name}-{row:09d}``).
        manifest: local path, http(s) URL or s3:// URL of a csv / tsv / jsonl / parquet file,
            optionally gzip-compressed (``.gz``).
        format: ``auto`` picks the format from the file name.
        url_column, caption_column, license_column: column names in the manifest.
        extra_columns: further columns carried into each sample's json; ``["*"]`` carries all.
        rows_per_shard: manifest rows per download shard (one Prefect task each).
    """

    name: str = Field(pattern=NAME_PATTERN)
    manifest: str = Field(min_length=1)
    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = "auto"
    url_column: str = "url"
    caption_column: str | None = "caption"
    license_column: str | None = "license"
    extra_columns: tuple[str, ...] = ()
    rows_per_shard: int = Field(default=1000, ge=1, le=1_000_000)


class NetworkConfig(_Frozen):
    """Which addresses downloads may reach (SSRF guard).

    Args:
        allow_private_networks: allow every non-global address (loopback, private, link-local).
            Off by default; only for tests, demos and trusted intranets.
        allowed_networks: CIDRs allowed even though they are not global, e.g. ``127.0.0.1/32``.
        file_root: ``file://`` URLs are allowed only under this directory (off when unset).
        s3_buckets: ``s3://`` URLs are allowed only for these buckets.
    """

    allow_private_networks: bool = False
    allowed_networks: tuple[str, ...] = ()
    file_root: str | None = None
    s3_buckets: tuple[str, ...] = ()

    @field_validator("allowed_networks")
    @classmethod
    def _cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        for cidr in value:
            ipaddress.ip_network(cidr, strict=False)
        return value


class DownloadConfig(_Frozen):
    """How one download shard fetches its rows.

    Args:
        timeout_s: one deadline per request attempt, connect plus whole body.
        retries: further attempts after the first, for 429, 5xx and connection errors only.
        backoff_s: first backoff; doubles per attempt, capped by ``max_backoff_s``.
        max_retry_after_s: a larger ``Retry-After`` gives up instead of waiting.
        max_inflight: concurrent requests per shard.
        per_host: concurrent requests per host per shard.
        max_bytes: body cap, enforced while streaming whatever Content-Length says.
        max_redirects: redirect hops, each re-checked by the SSRF guard.
        user_agent: sent with every request; its first token is matched by robots.txt and
            ``X-Robots-Tag`` scopes.
        opt_out_directives: ``X-Robots-Tag`` directives that reject a sample as ``opted_out``.
        respect_robots_txt: fetch and honour robots.txt per host.
        allowed_formats: image formats sniffed from the bytes that are kept.
        network: the SSRF guard.
    """

    timeout_s: float = Field(default=20.0, gt=0, le=600)
    retries: int = Field(default=2, ge=0, le=10)
    backoff_s: float = Field(default=0.5, ge=0, le=60)
    max_backoff_s: float = Field(default=8.0, ge=0, le=600)
    max_retry_after_s: float = Field(default=30.0, ge=0, le=3600)
    max_inflight: int = Field(default=64, ge=1, le=1024)
    per_host: int = Field(default=16, ge=1, le=1024)
    max_bytes: int = Field(default=20 * 1024 * 1024, ge=1024)
    max_redirects: int = Field(default=5, ge=0, le=10)
    user_agent: str = "shardsmith/0.1 (+https://github.com/shardsmith/shardsmith)"
    opt_out_directives: tuple[str, ...] = ("noai", "noimageai", "noml")
    respect_robots_txt: bool = False
    allowed_formats: tuple[str, ...] = ("jpeg", "png", "webp", "gif", "bmp", "tiff")
    network: NetworkConfig = NetworkConfig()


class ExecutionConfig(_Frozen):
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


class Recipe(_Frozen):
    """A dataset recipe.

    Args:
        dataset: dataset name; the top folder under the storage root.
        kind: ``pretraining`` (caption pairs) or ``finetuning`` (conversations).
        storage: root URL, local path or ``s3://bucket/prefix``.
        storage_options: passed to fsspec (e.g. ``endpoint_url`` for S3-compatible stores).
        sources: the URL manifests.
    """

    dataset: str = Field(pattern=NAME_PATTERN)
    kind: Literal["pretraining", "finetuning"] = "pretraining"
    storage: str = Field(min_length=1)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    sources: tuple[SourceConfig, ...] = Field(min_length=1)
    download: DownloadConfig = DownloadConfig()
    execution: ExecutionConfig = ExecutionConfig()

    @model_validator(mode="after")
    def _unique_sources(self) -> "Recipe":
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique, repeated: {', '.join(dupes)}")
        return self

    def config_hash(self, *parts: BaseModel) -> str:
        """Hash of the given stage configs, for output names that change when they change."""
        blob = json.dumps([p.model_dump(mode="json") for p in parts], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def recipe_hash(self) -> str:
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True)
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
    """Validate recipe data; relative manifest and storage paths resolve against the file's folder."""
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
