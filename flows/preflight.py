"""Before a CLI run starts Prefect or Dask: plan small manifests, tell whether there is work, or nothing to do.

Imports neither Prefect nor Dask, so a run with nothing to do ends in the time it takes to list
the storage. What it decides only picks when the CLI starts its cluster (now, or at the first
task), or that the last run already covered these phases over the same inputs; the flows check
everything again when they run, so a wrong guess costs seconds, never correctness.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tasks.formats.manifests import FilePlan, SourcePlan, combine, group_files, list_manifest_files, plan_files
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage

# Pretraining phases in order (flows.pretraining.PHASES, which imports Prefect).
PHASES = ("download", "validate", "curate", "reshard", "precache", "release")
LAST_RUN = "{dataset}/state/last-run.json"

# Up to this many groups of manifest files, together at most this many bytes, are planned in the
# flow's process: a task on the cluster would cost more than the planning itself.
LOCAL_PLAN_GROUPS = 4
LOCAL_PLAN_BYTES = 64 << 20

# Plans made before the flow started, taken once by the download flow of the same process.
_primed: dict[str, list[SourcePlan]] = {}


def _plan_key(recipe: Recipe) -> str:
    return json.dumps(
        [recipe.dataset, recipe.storage, [s.model_dump(mode="json") for s in recipe.sources]], sort_keys=True
    )


def list_groups(recipe: Recipe) -> list[tuple[Any, list]]:
    """(source, group of manifest files) for every URL manifest source: one planning task per
    group (sources of existing data are planned by ``combine_groups``)."""
    manifests = [s for s in recipe.sources if s.kind == "manifest"]
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(manifests)))) as pool:
        listed = list(pool.map(lambda s: list_manifest_files(s, recipe.storage_options), manifests))
    return [(source, group) for source, files in zip(manifests, listed) for group in group_files(files)]


def small(groups: list[tuple[Any, list]]) -> bool:
    """Whether the groups are few and small enough to plan in this process."""
    known = sum(f.size for _, g in groups for f in g if f.size >= 0)
    return len(groups) <= LOCAL_PLAN_GROUPS and known <= LOCAL_PLAN_BYTES


def plan_here(recipe: Recipe, storage: Storage, groups: list[tuple[Any, list]]) -> list[list[FilePlan]]:
    """Plan the groups in this process, side by side in threads."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(groups)))) as pool:
        return list(
            pool.map(lambda sg: plan_files(sg[0], sg[1], storage, recipe.dataset, recipe.storage_options), groups)
        )


def combine_groups(recipe: Recipe, groups: list[tuple[Any, list]], planned: list[list[FilePlan]]) -> list[SourcePlan]:
    """Every source's plan from its groups' file plans; a source of existing data (WebDataset
    shards, parquet with images) is listed and planned here, writing nothing."""
    from tasks.sources import plan_ingest

    by_source: dict[str, list[FilePlan]] = {s.name: [] for s in recipe.sources}
    for (source, _), plans in zip(groups, planned):
        by_source[source.name].extend(plans)
    return [
        combine(s, by_source[s.name]) if s.kind == "manifest" else plan_ingest(s, recipe.storage_options)
        for s in recipe.sources
    ]


def prime_plans(recipe: Recipe, storage: Storage) -> list[SourcePlan] | None:
    """Plan small manifests now, for the download flow to take; None when they are many or
    large (the flow plans those on the cluster)."""
    groups = list_groups(recipe)
    if not small(groups):
        return None
    plans = combine_groups(recipe, groups, plan_here(recipe, storage, groups))
    _primed[_plan_key(recipe)] = plans
    return plans


def take_primed(recipe: Recipe) -> list[SourcePlan] | None:
    """The plans ``prime_plans`` made for this recipe in this process, once."""
    return _primed.pop(_plan_key(recipe), None)


def _inputs_digest(ledgers: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(ledgers)).encode()).hexdigest()


def remember_run(
    storage: Storage,
    recipe: Recipe,
    phases: list[str],
    download_ledgers: list[str],
    run: str,
    release: str | None,
    outputs: list[str] | None = None,
    due_at: str | None = None,
) -> None:
    """What a complete run covered: the phases, over which inputs, the release it left, and the
    files (``outputs``) a later run would skip on, which ``up_to_date`` then looks for.

    ``due_at`` (ISO time): when the earliest retry of a passing failure or recheck of a released
    row falls due (``download.retry_failed``, ``download.recheck``); from then on a run has work
    though nothing else changed. The takedown lists' digest is kept too: a new entry is work."""
    record = {
        "recipe_hash": recipe.recipe_hash(),
        "phases": phases,
        "inputs": _inputs_digest(download_ledgers),
        "run": run,
        "release": release,
        "outputs": sorted(outputs or []),
        "due_at": due_at,
        "takedown": takedown_digest(recipe),
    }
    storage.write_bytes(
        LAST_RUN.format(dataset=recipe.dataset), json.dumps(record, sort_keys=True).encode(), fsync=False
    )


def takedown_digest(recipe: Recipe) -> str | None:
    """A digest of the recipe's takedown lists' contents (None without lists)."""
    if not recipe.takedown:
        return None
    from tasks.formats.takedown import lists_digest

    return lists_digest(recipe)


def upkeep_pending(recipe: Recipe, last: dict[str, Any]) -> str | None:
    """Why a run has work although its inputs did not change: a retry or a recheck fell due, or
    the takedown lists changed since the last run; None when neither."""
    from datetime import datetime

    from tasks.formats.clock import now

    due = last.get("due_at")
    if isinstance(due, str) and now() >= datetime.fromisoformat(due):
        return f"retries or rechecks due since {due}"
    if last.get("takedown") != takedown_digest(recipe):
        return "the takedown lists changed"
    return None


def _last_run(storage: Storage, recipe: Recipe) -> dict[str, Any] | None:
    try:
        last = json.loads(storage.read_bytes(LAST_RUN.format(dataset=recipe.dataset)))
    except (FileNotFoundError, ValueError):
        return None
    return last if isinstance(last, dict) and {"recipe_hash", "phases", "inputs", "run"} <= last.keys() else None


def phases_problem(recipe: Recipe, phases: Sequence[str]) -> str | None:
    """Why these phases cannot run with this recipe (here), or None."""
    if recipe.kind == "pretraining" and not recipe.download.keep_raw and _upto(phases) == ["download"]:
        return (
            "download.keep_raw is false: the download phase alone would keep only its ledgers, no "
            "samples; run --phase validate or a later phase (or set download.keep_raw: true)"
        )
    return gpu_problem(recipe, phases) or model_problem(recipe, phases)


def model_problem(recipe: Recipe, phases: Sequence[str]) -> str | None:
    """Why curation's dual encoder cannot load (an unreadable config, missing or truncated
    weights, no tokenizer files), or None: found before any download. Only where the cluster's
    workers run on this machine (local, cuda): an existing cluster's workers may see other
    folders (the curation phase checks there again, before any shard)."""
    upto = _upto(phases) if recipe.kind == "pretraining" else ["validate", "curate"]
    if "curate" not in upto or not recipe.curate.enabled or recipe.execution.cluster not in ("local", "cuda"):
        return None
    from tasks.models.dual_encoder import check_model
    from tasks.models.placement import CurateError

    try:
        check_model(recipe.curate.model, recipe.curate.tokenizer, load_tokenizer=False)
    except CurateError as err:
        return str(err)
    return None


def gpu_settings(recipe: Recipe, phases: Sequence[str]) -> list[str]:
    """The recipe's settings that need a CUDA GPU on the workers (a ``cuda`` device, ``gpu``
    decoding), of the stages these phases run (a fine-tuning run runs all of its phases)."""
    upto = _upto(phases) if recipe.kind == "pretraining" else ["validate", "curate"]
    stages = []
    if "validate" in upto and recipe.privacy.faces.mode != "off":
        stages.append(("privacy.faces", recipe.privacy.faces))
    if "curate" in upto and recipe.curate.enabled:
        stages.append(("curate", recipe.curate))
    if "precache" in upto and recipe.kind == "pretraining" and recipe.precache.enabled:
        stages.append(("precache", recipe.precache))
    wanted = []
    for name, cfg in stages:
        wanted += [f"{name}.device: cuda"] if cfg.device == "cuda" else []
        wanted += [f"{name}.decode: gpu"] if getattr(cfg, "decode", None) == "gpu" else []
    return wanted


def gpu_problem(recipe: Recipe, phases: Sequence[str]) -> str | None:
    """Why the run would fail on every shard: settings that need a CUDA GPU, and a cluster on this
    machine (``local``, ``cuda``) whose workers would see none, as torch tells; None otherwise.

    An existing cluster's workers are not asked: they may have GPUs this machine lacks (each
    stage still fails on a worker without one, naming the setting)."""
    if recipe.execution.cluster not in ("local", "cuda"):
        return None
    wanted = gpu_settings(recipe, phases)
    if not wanted:
        return None
    import torch  # only when a setting asks for a GPU

    if torch.cuda.is_available():
        return None
    return (
        f"{', '.join(wanted)}: needs a CUDA GPU, and torch sees none on this machine, where the "
        f"{recipe.execution.cluster} cluster's workers run; set it to auto (the GPU where a worker has one) or cpu"
    )


def _upto(phases: Sequence[str]) -> list[str]:
    """A phase runs the phases before it too."""
    last = max((PHASES.index(p) for p in phases if p in PHASES), default=-1)
    return list(PHASES[: last + 1])


def work_ahead(recipe: Recipe, phases: list[str]) -> int | None:
    """How many tasks the first phase of ``phases`` with work has for the cluster: None when
    it cannot tell (manifests too large to plan here, or not a pretraining recipe), 0 when none.

    Plans the manifests (kept for the download flow) and looks for uncommitted download and
    validation shards: their chunks are the tasks. When all are committed, the run has work
    only if the last complete run did not cover these phases over these very inputs with this
    recipe; the tasks are then the reshard's (``reshard_tasks``), or None.
    """
    from tasks.formats.ledger import committed
    from tasks.stages.onepass import chunk_paths

    if recipe.kind != "pretraining":
        return None
    storage = Storage(recipe.storage, recipe.storage_options)
    plans = prime_plans(recipe, storage)
    if plans is None:
        return None  # too large to plan here: the cluster plans it
    paths = chunk_paths(recipe, storage, [c for p in plans for c in p.chunks])
    ledgers = [ledger for (_, ledger), _ in paths.values()]
    pairs = [(ledger, cand_ledger) for (_, ledger), (_, cand_ledger) in paths.values()]
    done = committed(storage, [p for pair in pairs for p in pair])
    pending = sum(1 for pair in pairs if not set(pair) <= done)
    if pending:
        return pending
    last = _last_run(storage, recipe)
    covered = (
        last is not None and set(_upto(phases)) <= set(last["phases"]) and last["recipe_hash"] == recipe.recipe_hash()
    )
    if covered and last["inputs"] == _inputs_digest(ledgers) and upkeep_pending(recipe, last) is None:
        return 0
    return reshard_tasks(recipe, phases, plans)


def reshard_tasks(recipe: Recipe, phases: list[str], plans: list[SourcePlan]) -> int | None:
    """At most how many tasks the reshard (and the precache after it) can have, with every
    chunk validated: one per output shard, and there are no more outputs than the manifests
    have rows in shards of the recipe's size. None when no phase after validation is asked
    for or a source's rows are counted only when read.

    A ``--phase reshard`` right after a validate of 1,000 rows has one output: its cluster
    starts one worker, not one per core, each importing Prefect and the stages (3-4 CPU s).
    """
    if not set(_upto(phases)) - {"download", "validate", "curate"} or not all(p.rows_known for p in plans):
        return None
    rows = sum(p.rows for p in plans)
    return max(1, -(-rows // recipe.reshard.samples_per_shard))


def up_to_date(
    recipe: Recipe, phases: list[str], pending: int | None = None
) -> tuple[dict[str, Any] | None, list[str]]:
    """Whether this run has nothing to do: ``(the last run's record, [])`` when that run covered
    ``phases`` over exactly today's inputs with this recipe and the storage still holds all it
    left, its release the latest; ``(None, what the storage lost of it)`` when only the storage
    differs (this run is a repair, and says so); ``(None, [])`` when there is other work.
    ``pending``: what ``work_ahead`` already said for this run (computed here when not given;
    0 means the last run covered these phases over these inputs with this recipe)."""
    if pending is None and recipe.kind == "pretraining":
        pending = work_ahead(recipe, phases)
    if recipe.kind != "pretraining" or pending != 0:
        return None, []
    storage = Storage(recipe.storage, recipe.storage_options)
    last = _last_run(storage, recipe)
    if last is None:
        return None, []
    problems = stored_problems(storage, recipe, phases, last)
    return (None, problems) if problems else (last, [])


def stored_problems(storage: Storage, recipe: Recipe, phases: list[str], last: dict[str, Any]) -> list[str]:
    """Why the storage no longer holds what the last run left (its record is a note, the storage
    the truth): a file of a covered phase gone, the release it made gone or not whole, or no
    longer the latest. Empty when a run would find everything and do nothing."""
    from tasks.formats.ledger import committed
    from tasks.stages.release import latest, release_problems

    outputs = last.get("outputs")
    if not isinstance(outputs, list):
        return ["the last run recorded no outputs (an older version): run again to check them"]
    problems = [f"{rel} is missing" for rel in sorted(set(outputs) - committed(storage, outputs))]
    if "release" in phases:
        head, rel = latest(storage, recipe.dataset), last.get("release")
        gone = release_problems(storage, recipe.dataset, rel) if rel else ["the last run made no release"]
        problems += gone or ([] if head == rel else [f"release {rel} is not the latest ({head or 'none is'})"])
    return problems
