"""The curation phase: embeddings once per sample, scores, semantic dedup, filters, curated shards, the gate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import dask
import pyarrow as pa
from prefect import task

from flows.phase import Phase, all_skipped, phase_flow
from flows.semdedup import run_semdedup
from flows.validate import ValidateSummary
from tasks.audit.runrecord import RunRecord
from tasks.curate.decide import ShardDecision, ShardInput, decide
from tasks.curate.embed import EmbedResult, embed_shard, embeddings_path
from tasks.curate.finalize import curate_shard, curated_paths
from tasks.curate.scores import Cut, heads_key, reason_for, score_names, score_shard, scores_path
from tasks.formats.ledger import COUNT_COLUMNS, Counts, committed, committed_pairs, read_tables
from tasks.formats.reasons import family
from tasks.formats.recipe import Recipe
from tasks.formats.recipe_curate import CurateConfig
from tasks.formats.storage import Storage
from tasks.stages.runner import ShardResult


@dataclass
class CurateSummary:
    """What curation did, and where its shards and ledgers are (the reshard phase reads them as it
    reads validation's).

    ``embedded``: samples embedded in this run (0 when every side shard was reused);
    ``reused``: samples whose stored embeddings were read instead; ``cuts``: each filter's
    bounds as applied; ``model``: the dual encoder's digest; ``compute_dtype``: what its towers
    computed in (``curate.compute_dtype`` resolved on a worker).
    """

    dataset: str
    run: str
    counts: Counts
    shards: int
    shards_skipped: int
    embedded: int
    reused: int
    model: str
    cuts: list[dict[str, Any]] = field(default_factory=list)
    compute_dtype: str = "fp32"
    seconds: float = 0.0
    samples_per_s: float = 0.0
    report: str = ""
    ledgers: list[str] = field(default_factory=list)
    tars: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    side_shards: dict[str, str] = field(default_factory=dict)  # curated tar -> its samples' embeddings
    semdedup: dict[str, int] = field(default_factory=dict)  # what semantic dedup computed now


@task(name="curate-digests")
def digests_task(cfg: CurateConfig) -> tuple[str, str, list[Any]]:
    """The dual encoder's digest, the dtype it computes in, and the heads' digests (on a worker:
    where the models are and run). A model folder that cannot load (an unreadable config,
    truncated weights, no tokenizer) stops the phase here, in one line, before any shard."""
    from tasks.curate.embed import curate_placement
    from tasks.models.dual_encoder import check_model
    from tasks.models.placement import folder_digest

    check_model(cfg.model, cfg.tokenizer)
    return folder_digest(cfg.model, cfg.tokenizer), curate_placement(cfg)[1], heads_key(cfg)


@task(name="curate-embed", task_run_name="embed-{name}")
def embed_task(
    storage: Storage, cfg: CurateConfig, shard: ShardInput, run: str, name: str
) -> tuple[ShardInput, EmbedResult]:
    """Embed one validated shard (unless its side shard is stored), then score it."""
    result = embed_shard(storage, cfg, shard.tar, shard.ledger, shard.embeddings, run)
    score_shard(storage, cfg, shard.embeddings, shard.scores)
    return shard, result


@task(name="curate-decide")
def decide_task(
    storage: Storage,
    dataset: str,
    cfg: CurateConfig,
    shards: list[ShardInput],
    dedup: list[str],
    source_order: dict[str, int],
) -> tuple[list[Cut], list[ShardDecision]]:
    """The cuts and every shard's fates; ``dedup``: semantic dedup's decision files (over every
    row), decided again among the samples the filters keep where a filter removes a group's
    first sample (``decide``); ``source_order``: the recipe's order of sources."""
    from tasks.curate.semdedup import read_duplicates

    dups = read_duplicates(storage, dedup)
    return decide(storage, dataset, cfg, shards, dups, dedup=dedup, source_order=source_order)


@task(name="curate-views")
def views_task(
    storage: Storage, shards: list[tuple[str, str, str]], cuts: list[dict[str, Any]], names: list[str], model: str
) -> tuple[dict[str, Any], pa.Table]:
    from tasks.audit.curation_views import build_curation_views

    return build_curation_views(storage, shards, cuts, names, model)


@task(name="curate-shard", task_run_name="curate-{decision.shard.source}-{decision.shard.index}")
def curate_task(storage: Storage, decision: ShardDecision, tar_rel: str, ledger_rel: str) -> ShardResult:
    return curate_shard(storage, decision, tar_rel, ledger_rel)


def _embedded_by(storage: Storage, paths: list[str]) -> dict[str, str]:
    """The run that computed each stored side shard, from its footer (footers read side by side:
    on object stores each is a request)."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.parquet as pq

    def one(p: str) -> str:
        with storage.open(p, "rb") as fh:
            meta = pq.ParquetFile(fh).metadata.metadata or {}
        return meta.get(b"shardsmith.run", b"").decode()

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(paths)))) as pool:
        return dict(zip(paths, pool.map(one, paths)))


def _embed(
    ph: Phase, cfg: CurateConfig, shards: list[ShardInput]
) -> tuple[list[ShardInput], int, int, dict[str, float]]:
    """Every shard with its side shard and scores: stored ones read back, the others embedded on
    the cluster (``GPU`` resource on a cuda cluster). Returns the shards, samples embedded now,
    samples reused, and the encoders' timings."""
    storage = ph.storage
    stored = committed(storage, [s.embeddings for s in shards] + [s.scores for s in shards])
    ready = [s for s in shards if s.embeddings in stored and s.scores in stored]
    runs = _embedded_by(storage, [s.embeddings for s in ready])
    out = {s.tar: ShardInput(**{**s.__dict__, "embedded_by": runs[s.embeddings]}) for s in ready}
    annotations = {"resources": {"GPU": 1}} if ph.recipe.execution.cluster == "cuda" else {}
    todo = [s for s in shards if s.tar not in out]
    with dask.annotate(**annotations):
        futures = {
            ph.submit(embed_task, storage, cfg, s, ph.run.run, s.embeddings.rsplit("/", 1)[-1]): s.tar for s in todo
        }
    embedded = reused = 0
    timings: dict[str, float] = {}
    for shard, result in ph.gather(futures, 0.0, 60.0, "embed"):
        out[shard.tar] = ShardInput(**{**shard.__dict__, "embedded_by": result.run})
        embedded += result.embedded
        reused += result.samples - result.embedded
        for k, v in result.timings.items():
            timings[k] = round(timings.get(k, 0.0) + v, 3)
    counted = read_tables(storage, [s.scores for s in ready], ["key"])
    reused += sum(t.num_rows for t in counted.values() if t is not None)
    return [out[s.tar] for s in shards], embedded, reused, timings


@phase_flow(name="curate", validate_parameters=False)  # inputs: earlier phases' typed results (flows/phase.py)
def curate_flow(recipe: Recipe, validated: ValidateSummary, run: RunRecord) -> tuple[CurateSummary, RunRecord]:
    """Embed every validated shard once (stored side shards are reused), score, dedup semantically,
    apply the filters, write the curated shards, gate and report."""
    from flows.audit import report_dir
    from tasks.audit.curate_gate import curate_gate
    from tasks.audit.curation_views import write_curation_files

    ph = Phase(recipe, run, "curate", "curation shards done")
    storage, cfg = ph.storage, recipe.curate
    timings = {"start": ph.seconds}
    mark = time.perf_counter()
    annotations = {"resources": {"GPU": 1}} if recipe.execution.cluster == "cuda" else {}
    with dask.annotate(**annotations):
        model, dtype, heads = digests_task.submit(cfg).result()
    shards = []
    for tar, led, (source, index) in zip(validated.tars, validated.ledgers, validated.chunks):
        emb = embeddings_path(recipe.dataset, model, led, dtype)
        shards.append(ShardInput(tar, led, source, index, emb, scores_path(recipe.dataset, emb, heads)))
    shards, embedded, reused, enc_timings = _embed(ph, cfg, shards)
    timings["embed"] = round(time.perf_counter() - mark, 3)
    mark = time.perf_counter()
    dedup, dedup_done = run_semdedup(ph, cfg, shards, f"{model}-{dtype}")
    timings["semdedup"] = round(time.perf_counter() - mark, 3)
    mark = time.perf_counter()
    order = recipe.source_order()  # as run_semdedup orders them
    applied, decisions = decide_task.submit(storage, recipe.dataset, cfg, shards, dedup, order).result()
    timings["decide"] = round(time.perf_counter() - mark, 3)
    mark = time.perf_counter()

    names = {d.shard.tar: curated_paths(recipe.dataset, d) for d in decisions}
    done = committed_pairs(storage, list(names.values()))
    counted = read_tables(storage, sorted(done), COUNT_COLUMNS)
    results: list[ShardResult] = []
    futures = {}
    for d in decisions:
        tar_rel, ledger_rel = names[d.shard.tar]
        if ledger_rel in done:
            c = Counts.of(counted[ledger_rel])
            results.append(ShardResult(d.shard.source, d.shard.index, tar_rel, ledger_rel, c, 0.0, True, c.ok))
        else:
            futures[ph.submit(curate_task, storage, d, tar_rel, ledger_rel)] = d.shard.tar
    results += ph.gather(futures, 60.0, 40.0, "curate")
    results.sort(key=lambda r: (r.source, r.index))
    timings["write"] = round(time.perf_counter() - mark, 3)
    mark = time.perf_counter()

    tables = read_tables(storage, [r.ledger for r in results])
    # promote: ledgers written before a column came (the clip columns) have nulls there
    ledger = pa.concat_tables([tables[r.ledger] for r in results], promote_options="default") if results else None
    counts = Counts.of(ledger) if ledger is not None else Counts.zero()
    reasons = sorted(
        {family(reason_for(c.name, "low")) for c in applied if c.low is not None}
        | {family(reason_for(c.name, "high")) for c in applied if c.high is not None}
    )
    reasons += ["semantic_duplicate_of"] if cfg.semdedup is not None else []
    empty = pa.table(
        {"key": pa.array([], pa.string()), "status": pa.array([], pa.string()), "reason": pa.array([], pa.string())}
    )
    gate, links = ph.judge(
        [r.ledger for r in results], (recipe.gates.curate, reasons),
        lambda: curate_gate(ledger if ledger is not None else empty, recipe.gates.curate, reasons),
    )  # fmt: skip
    shown = [(d.shard.tar, d.shard.ledger, d.fates) for d in decisions]
    data, thumbs = views_task.submit(storage, shown, [c.__dict__ for c in applied], score_names(cfg), model).result()
    data.update(embedded=embedded, reused=reused)
    views = write_curation_files(storage, report_dir(recipe, run.run), data, thumbs)
    timings["gate"] = round(time.perf_counter() - mark, 3)
    seconds = ph.seconds
    summary = CurateSummary(
        dataset=recipe.dataset,
        run=run.run,
        counts=counts,
        shards=len(results),
        shards_skipped=sum(r.skipped for r in results),
        embedded=embedded,
        reused=reused,
        model=model,
        compute_dtype=dtype,
        cuts=[c.__dict__ for c in applied],
        seconds=round(seconds, 3),
        samples_per_s=ph.rate(sum(r.rows for r in results if not r.skipped), seconds),
        ledgers=[r.ledger for r in results],
        tars=[r.tar for r in results],
        side_shards={names[d.shard.tar][0]: d.shard.embeddings for d in decisions},
        timings={**timings, **{f"encoder_{k}": v for k, v in enc_timings.items()}},
        semdedup=dedup_done,
    )
    ph.record(
        counts,
        ledger if ledger is not None else empty,
        summary.samples_per_s,
        gate,
        {**links, **views},
        seconds=seconds,
        shards=summary.shards,
        skipped=all_skipped(results),
        timings=summary.timings,
    )
    summary.report = ph.close(gate)
    ph.logger.info(
        "curate: %d in, %d kept, %d removed; embedded %d samples now, %d reused from earlier runs (model %s)",
        counts.rows,
        counts.ok,
        counts.rejected,
        embedded,
        reused,
        model[:16],
    )
    return summary, ph.run
