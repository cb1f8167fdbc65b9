"""Issue 13's figures: shardsmith beside img2dataset on web manifests (clean, faulty, download only) and fixed costs."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from harness.photos import ensure_unique_pool, write_manifest
from harness.procs import Children, Session, Timed, default_role, settle, timed
from harness.report import (
    add_round_flags,
    alternated,
    command,
    emit,
    in_turn,
    machine,
    revision,
)
from harness.servers import prefect_env, serve
from harness.tools import (
    I2D_ENCODE_QUALITY,
    I2D_IMAGE_SIZE,
    I2D_RESIZE_MODE,
    I2D_TIMEOUT_S,
    REPO,
    add_tool_flags,
    ensure_img2dataset,
    first_image_size,
    i2d_command,
    i2d_env,
    i2d_outputs,
    run_command,
    summary,
    write_recipe,
)
from web_report import Run, report

SCENARIOS = ("validate", "faulty", "download", "fixed")
FAULT_KINDS = ("404", "500", "slow", "timeout", "truncated", "corrupt", "html", "empty")
I2D_RESIZE = (
    "--resize_mode",
    I2D_RESIZE_MODE,
    "--image_size",
    str(I2D_IMAGE_SIZE),
    "--encode_quality",
    str(I2D_ENCODE_QUALITY),
    "--encode_format",
    "jpg",
)
I2D_NET = ("--timeout", str(I2D_TIMEOUT_S), "--retries", "0")  # img2dataset 1.47's defaults, stated


@dataclass(frozen=True)
class Tool:
    """One command of a scenario.

    Args:
        name: key in the tables.
        label: what it is, in words.
        shardsmith: True for ``shardsmith run``, False for img2dataset.
        phase: shardsmith's ``--phase``. Default validate.
        sets: shardsmith's ``--set KEY=VALUE`` overrides. Default none.
        i2d: img2dataset arguments after the common ones (input, output, processes, threads).
    """

    name: str
    label: str
    shardsmith: bool
    phase: str = "validate"
    sets: tuple[str, ...] = ()
    i2d: tuple[str, ...] = ()


def scenario_tools(scenario: str, args) -> list[Tool]:
    """The tools one round of a scenario runs, in turn (the fixed scenario has its own steps)."""
    i2d_default = Tool(
        "img2dataset",
        f"img2dataset defaults ({I2D_RESIZE_MODE} {I2D_IMAGE_SIZE}, jpg q{I2D_ENCODE_QUALITY}, timeout {I2D_TIMEOUT_S} s, no retries)",
        False,
        i2d=I2D_RESIZE + I2D_NET,
    )
    if scenario == "validate":
        # img2dataset keeps only its outputs; shardsmith keeps the bytes as fetched beside them
        # by default (download.keep_raw), so that new validation settings need no new fetch.
        lean = Tool(
            "shardsmith-lean",
            "shardsmith --phase validate, download.keep_raw=false (no raw shards, as img2dataset keeps none)",
            True,
            sets=("download.keep_raw=false",),
        )
        return [Tool("shardsmith", "shardsmith run --phase validate, recipe defaults", True), lean, i2d_default]
    if scenario == "faulty":
        # Equal settings: img2dataset's timeout, no retries, as many requests in flight per
        # shard as img2dataset has threads per process, and no cap per host below that.
        equal = (
            f"download.timeout_s={I2D_TIMEOUT_S}",
            "download.retries=0",
            f"download.max_inflight={args.threads}",
            f"download.per_host={args.threads}",
        )
        return [
            Tool(
                "shardsmith-equal",
                f"shardsmith --phase validate, img2dataset's network settings ({' '.join(equal)})",
                True,
                sets=equal,
            ),
            Tool(
                "shardsmith-defaults",
                "shardsmith --phase validate, recipe defaults (its own timeout, retries and per-host limit)",
                True,
            ),
            i2d_default,
        ]
    if scenario == "download":
        return [
            Tool("shardsmith", "shardsmith run --phase download (bytes stored as fetched)", True, phase="download"),
            Tool(
                "img2dataset-raw",
                "img2dataset --resize_mode no --disable_all_reencoding True (bytes stored as fetched)",
                False,
                i2d=("--resize_mode", "no", "--disable_all_reencoding", "True") + I2D_NET,
            ),
        ]
    raise ValueError(scenario)


TITLES = {
    "validate": "manifest to validated 256 px shards (`--phase validate`) beside img2dataset's defaults; shardsmith with its defaults and without raw shards",
    "faulty": "the same with faulty URLs; shardsmith with img2dataset's network settings and with its own defaults",
    "download": "download only (`--phase download`) beside img2dataset storing bytes as fetched",
    "fixed": "fixed costs: {small} rows end to end, no-op reruns, `--phase reshard` right after a {rows}-row `--phase validate`",
}
FIXED_STEPS = {
    "small": "shardsmith --phase validate, {small}-row manifest, new store",
    "small-i2d": "img2dataset defaults, the same {small} rows",
    "noop-small": "the same shardsmith command again (all committed: the nightly no-op)",
    "big-validate": "shardsmith --phase validate, {rows} rows, new store (set-up of the next two)",
    "reshard": "shardsmith --phase reshard right after it (re-checks download and validate, then reshards)",
    "noop-reshard": "the same --phase reshard again (all committed)",
}


# ------------------------------------------------------------------------------------- corpus


def fault_path(kind: str, name: str, row: int, slow_ms: int) -> str:
    """The loopback path of one row of the faulty manifest (tasks/demo/webserver.py's routes)."""
    return {
        "ok": f"/img/{name}",
        "404": f"/status/404?u={row}",
        "500": f"/status/500?u={row}",
        "slow": f"/trickle/{slow_ms}/{name}",  # the whole image, spread over slow_ms
        "timeout": f"/hang?u={row}",  # never answers
        "truncated": f"/truncated/{name}",  # the first half, as a complete response
        "corrupt": f"/corrupt/{name}",  # the magic number, then garbage
        "html": f"/html-as-jpeg?u={row}",
        "empty": f"/empty/{name}",  # 200, 0 bytes
    }[kind]


def write_faulty_manifest(
    path: Path, base_url: str, names: list[str], share: float, slow_ms: int, seed: int
) -> dict[str, int]:
    """The clean manifest's rows with ``share`` of them turned faulty, the kinds in equal parts
    at seeded random rows; a ``kind`` column says which. Returns rows per kind."""
    import numpy as np

    n = len(names)
    kinds = ["ok"] * n
    for j, row in enumerate(np.random.default_rng([seed, 13]).choice(n, size=round(n * share), replace=False)):
        kinds[int(row)] = FAULT_KINDS[j % len(FAULT_KINDS)]
    urls = [base_url + fault_path(k, name, i, slow_ms) for i, (k, name) in enumerate(zip(kinds, names))]
    write_manifest(path, urls, kind=kinds)
    return {k: kinds.count(k) for k in ("ok", *FAULT_KINDS)}


# ------------------------------------------------------------------------------------ runs


class Roles:
    """TreeSampler's role function: names the CLI's embedded Prefect server apart, and keeps
    each process's start time, so that a process left behind is found by id, never by name."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def __call__(self, p, root) -> str:
        with contextlib.suppress(Exception):
            self.seen[p.pid] = p.create_time()
            cmd = " ".join(p.cmdline())
            # Prefect's own `prefect server start`, or the CLI's (`python -m flows.local_server`).
            if ("uvicorn" in cmd or "flows.local_server" in cmd) and "prefect" in cmd:
                return "prefect-server"
        return default_role(p, root)

    def stop_leftovers(self) -> list[str]:
        """Kill what of the run's tree is still alive after the command ended (same pid and start time)."""
        import psutil

        left = []
        for pid, created in self.seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:80]}")
                    p.kill()
        return left


@dataclass
class Context:
    args: argparse.Namespace
    session: Session
    watch: dict[str, int]  # image server, and the pre-started Prefect server if any
    api: str | None  # the pre-started Prefect server's API; None: each CLI starts its own

    @property
    def children(self) -> Children:
        return self.session.children

    @property
    def work(self) -> Path:
        return self.session.work

    @property
    def home(self) -> Path:  # PREFECT_HOME of every shardsmith run (its database persists, as a user's does)
        return self.session.work / "prefect-home"


def _measure(
    ctx: Context, run: Run, cmd: list[str], env: dict[str, str], cwd: Path, log: Path, prefect: bool
) -> Timed | None:
    """Run and fill the run's times; on failure record the error, keep the folders, return None.

    ``prefect``: the command uses Prefect, so a pre-started server's CPU meanwhile is its cost
    (img2dataset's runs leave it out: that server idles for shardsmith's sake).
    """
    roles = Roles()
    try:
        t = timed(ctx.children, cmd, env, cwd, log, ctx.watch, timeout=ctx.args.run_timeout, role=roles)
    except SystemExit as err:
        run.error = str(err).splitlines()[0]
        ctx.session.keep = True  # its log
        print(f"  FAILED {run.scenario} {run.tool} round {run.round}: {err}", flush=True)
        return None
    finally:
        left = roles.stop_leftovers()
        if left:
            print(f"  warning: {run.tool} left processes behind, killed: {left}", flush=True)
    run.wall_s, run.cpu_s = t.wall_s, t.cpu_s + (t.watched.get("prefect", 0.0) if prefect else 0.0)
    run.server_cpu_s, run.other_cpu_s = t.watched.get("server", 0.0), t.other_s
    if prefect:
        run.prefect_cpu_s = (
            t.watched["prefect"] if "prefect" in t.watched else t.sampler.by_role().get("prefect-server")
        )
    return t


def run_shardsmith(ctx: Context, run: Run, tool: Tool, manifest: Path, folder: Path) -> Run:
    """``shardsmith run RECIPE --phase P --json`` in ``folder`` (reused: a second run finds its work committed)."""
    folder.mkdir(parents=True, exist_ok=True)
    store, recipe = folder / "store", folder / "recipe.yaml"
    if not recipe.exists():
        write_recipe(recipe, store, manifest, ctx.args.rows_per_shard, ctx.args.workers)
    cmd = run_command(recipe, tool.phase, *tool.sets)
    t = _measure(ctx, run, cmd, prefect_env(ctx.home, ctx.api), REPO, folder / f"{run.tool}-{run.round}.log", True)
    if t is None:
        return run
    try:
        result = summary(t.stdout)
        if "up_to_date" in result:  # the last run covered these phases over the same inputs
            run.reasons = {"up to date: nothing to do": 1}
            return run
        dl, val, rs = result["download"], result.get("validate"), result.get("reshard")
    except (ValueError, KeyError) as err:
        run.error = f"unreadable --json output ({err!r})"
        return run
    run.rows = dl["counts"]["rows"]
    run.ok = (val or dl)["counts"]["ok"]
    run.phase_s = sum(p["seconds"] for p in (dl, val, rs) if p)
    run.reasons = {f"download {k}": v for k, v in dl["counts"]["by_reason"].items()}
    if val:
        run.reasons.update({f"validate {k}": v for k, v in val["counts"]["by_reason"].items()})
        if val.get("tars"):
            run.first_size = first_image_size([store / rel for rel in val["tars"]])
    if rs:
        run.reshard_s = rs["seconds"]
    return run


def run_img2dataset(ctx: Context, run: Run, tool: Tool, manifest: Path, folder: Path, kinds: bool) -> Run:
    folder.mkdir(parents=True, exist_ok=True)
    a = ctx.args
    cmd = i2d_command(manifest, folder / "out", a.workers, a.threads, a.rows_per_shard, *tool.i2d)
    if kinds:
        cmd += ["--save_additional_columns", '["kind"]']
    if _measure(ctx, run, cmd, i2d_env(), folder, folder / "stderr.log", prefect=False) is None:
        return run
    t, run.phase_s = i2d_outputs(folder / "out")
    statuses = t.get("status", [])
    run.rows, run.ok = len(statuses), sum(s == "success" for s in statuses)
    for status, message in zip(statuses, t.get("error_message", [None] * len(statuses))):
        if status != "success":
            key = (message or status).split(":", 1)[0][:60]
            run.reasons[key] = run.reasons.get(key, 0) + 1
    for status, kind in zip(statuses, t.get("kind", [])):
        run.by_kind.setdefault(kind, [0, 0])
        run.by_kind[kind][0] += status == "success"
        run.by_kind[kind][1] += 1
    run.first_size = first_image_size(list((folder / "out").glob("*.tar")))
    return run


def run_tool(
    ctx: Context,
    scenario: str,
    tool: Tool,
    rnd: int,
    manifest: Path,
    folder: Path,
    kinds: bool = False,
    key: str | None = None,
) -> Run:
    """One timed run, after waiting for the machine to go quiet; prints its line."""
    settle(ctx.args.quiet_wait)
    run = Run(key or tool.name, rnd, scenario=scenario)
    if tool.shardsmith:
        run_shardsmith(ctx, run, tool, manifest, folder)
    else:
        run_img2dataset(ctx, run, tool, manifest, folder, kinds)
    if run.error is None:
        run.disk_mb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.suffix != ".log") / 1e6
        extra = f", reshard {run.reshard_s:.1f} s" if run.reshard_s is not None else ""
        print(
            f"  {scenario} round {rnd} {run.tool:<20} {run.wall_s:7.1f} s wall = {run.rate:6.1f} samples/s{extra}; "
            f"{run.cpu_per_1k:.2f} CPU s/1k; {run.ok}/{run.rows} ok; other load {run.other_load:.2f} cores",
            flush=True,
        )
    return run


def rounds_of(ctx: Context, scenario: str, tools: list[Tool], manifest: Path, kinds: bool = False) -> list[Run]:
    """``--repeats`` rounds of every tool in turn; even rounds run them in reverse order."""
    runs = []
    for rnd, tool in alternated(tools, ctx.args.repeats):
        folder = ctx.work / f"{scenario}-{tool.name}-{rnd}"
        runs.append(run_tool(ctx, scenario, tool, rnd, manifest, folder, kinds))
        if not ctx.args.keep and runs[-1].error is None:
            shutil.rmtree(folder, ignore_errors=True)
    return runs


def fixed(ctx: Context, small: Path, big: Path) -> list[Run]:
    """Per round: 20 rows end to end (img2dataset beside it) and again; then a full
    ``--phase validate``, ``--phase reshard`` on its store, and that reshard again."""
    ss, i2d = scenario_tools("validate", ctx.args)[::2]
    reshard = Tool("shardsmith", "shardsmith --phase reshard", True, phase="reshard")
    runs: list[Run] = []
    for rnd in range(1, ctx.args.repeats + 1):
        small_dir, big_dir, i2d_dir = (ctx.work / f"fixed-{k}-{rnd}" for k in ("small", "big", "i2d"))
        for key, tool in in_turn([("small", ss), ("small-i2d", i2d)], rnd):
            runs.append(run_tool(ctx, "fixed", tool, rnd, small, small_dir if tool.shardsmith else i2d_dir, key=key))
        if next(r for r in runs if r.round == rnd and r.tool == "small").error is None:
            runs.append(run_tool(ctx, "fixed", ss, rnd, small, small_dir, key="noop-small"))
        runs.append(run_tool(ctx, "fixed", ss, rnd, big, big_dir, key="big-validate"))
        if runs[-1].error is None:
            runs.append(run_tool(ctx, "fixed", reshard, rnd, big, big_dir, key="reshard"))
            if runs[-1].error is None:
                runs.append(run_tool(ctx, "fixed", reshard, rnd, big, big_dir, key="noop-reshard"))
        if not ctx.args.keep and not any(r.error for r in runs if r.round == rnd):
            for folder in (small_dir, big_dir, i2d_dir):
                shutil.rmtree(folder, ignore_errors=True)
    return runs


# ----------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/bench_web.py",
        description="Issue 13's figures: shardsmith beside img2dataset on a loopback web of distinct photo-like images, "
        "both tools alternated, medians over rounds, ratios against the issue's targets. Pick scenarios with the flags.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("scenarios (at least one)")
    g.add_argument(
        "--validate",
        action="store_true",
        help="--phase validate (256 px border), shardsmith's defaults and download.keep_raw=false, beside img2dataset's defaults",
    )
    g.add_argument(
        "--faulty",
        action="store_true",
        help="the same with --faulty-share of the URLs faulty; shardsmith with img2dataset's network settings and with its defaults",
    )
    g.add_argument(
        "--download", action="store_true", help="--phase download beside img2dataset --disable_all_reencoding True"
    )
    g.add_argument(
        "--fixed",
        action="store_true",
        help="fixed costs: a --small-rows manifest end to end, no-op reruns, --phase reshard after a --rows validate",
    )
    g.add_argument("--all", action="store_true", help="every scenario, in the order above")
    p.add_argument("--rows", type=int, default=10_000, help="URLs in the manifest, each a distinct image")
    p.add_argument(
        "--small-rows", type=int, default=20, help="rows of the fixed scenario's small manifest (and of the warm-up)"
    )
    p.add_argument(
        "--faulty-share",
        type=float,
        default=0.2,
        help="share of faulty rows, the kinds in equal parts: " + ", ".join(FAULT_KINDS),
    )
    p.add_argument("--slow-ms", type=int, default=3000, help="how long a slow row takes to arrive (complete)")
    p.add_argument("--seed", type=int, default=0, help="seed of the image pool and of the faulty rows")
    add_round_flags(p, "web", repeats=3)
    add_tool_flags(p, rows_per_shard=1000)
    p.add_argument(
        "--prefect",
        choices=("embedded", "server"),
        default="embedded",
        help="embedded: each shardsmith command starts its own Prefect server (its CPU is in the tool's tree); server: one started beforehand, its CPU during each run added and shown apart",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        default=3600.0,
        help="stop a command after this many seconds and record it as failed",
    )
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed --small-rows run of each tool before the rounds (it fills caches and the Prefect database)",
    )
    args = p.parse_args(argv)
    args.scenarios = [s for s in SCENARIOS if args.all or getattr(args, s)]
    if not args.scenarios:
        p.error("pick at least one scenario: --validate, --faulty, --download, --fixed or --all")
    if args.rows < 1 or args.small_rows < 1 or args.repeats < 1 or not 0 <= args.faulty_share <= 1:
        p.error("--rows, --small-rows and --repeats must be at least 1, --faulty-share within 0..1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now().astimezone()
    pool_dir, sizes = ensure_unique_pool(max(args.rows, args.small_rows), args.seed)
    names = list(sizes)
    ensure_img2dataset()
    runs: list[Run] = []
    faults: dict[str, int] = {}
    with Session("web", args.keep) as s:
        loop = serve(s, pool_dir, prefect=args.prefect == "server")
        base_url = loop.base_url
        ctx = Context(args, s, loop.watch, loop.api)
        ctx.home.mkdir(exist_ok=True)
        clean, small = s.work / "manifest.parquet", s.work / "manifest-small.parquet"
        write_manifest(clean, [f"{base_url}/img/{name}" for name in names[: args.rows]])
        write_manifest(small, [f"{base_url}/img/{name}" for name in names[: args.small_rows]])
        print(
            f"{args.rows} URLs at {base_url}; scenarios {', '.join(args.scenarios)}; {args.repeats} round(s); Prefect {args.prefect}",
            flush=True,
        )
        if args.warmup:
            print(f"warm-up (not timed): each tool on {args.small_rows} rows ...", flush=True)
            for tool in scenario_tools("validate", args):
                run = run_tool(ctx, "warm-up", tool, 0, small, s.work / f"warmup-{tool.name}")
                if run.error:
                    raise SystemExit(f"warm-up of {tool.name} failed: {run.error}")
        for scenario in args.scenarios:
            print(f"{scenario}:", flush=True)
            if scenario == "faulty":
                manifest = s.work / "manifest-faulty.parquet"
                faults = write_faulty_manifest(
                    manifest, base_url, names[: args.rows], args.faulty_share, args.slow_ms, args.seed
                )
                runs += rounds_of(ctx, scenario, scenario_tools(scenario, args), manifest, kinds=True)
            elif scenario == "fixed":
                runs += fixed(ctx, small, clean)
            else:
                runs += rounds_of(ctx, scenario, scenario_tools(scenario, args), clean)
    exts = [n.rsplit(".", 1)[1] for n in names[: args.rows]]
    meta = {
        "revision": revision(),
        "command": command("bench_web.py", argv),
        # when the rounds ran: from the start of the invocation (pool and img2dataset checks
        # included) to the report
        "date": started.strftime("%Y-%m-%d %H:%M") + dt.datetime.now().astimezone().strftime("-%H:%M %Z"),
        "machine": machine(memory=True),
        "load_before": s.load_before,
        "prefect": metadata.version("prefect"),
        "prefect_mode": "each command starts its own Prefect server (no PREFECT_API_URL), inside its process tree"
        if args.prefect == "embedded"
        else "one Prefect server started beforehand (PREFECT_API_URL), its CPU during each run added",
        "rows": args.rows,
        "url_mb": sum(sizes[n] for n in names[: args.rows]) / 1e6,
        "mean_kb": sum(sizes[n] for n in names[: args.rows]) / args.rows / 1e3,
        "mix": ", ".join(
            f"{100 * exts.count(e) / len(exts):.0f}% {e}" for e in sorted(set(exts), key=lambda e: -exts.count(e))
        ),
        "faults": faults,
    }
    labels = {
        scenario: {k: v.format(rows=args.rows, small=args.small_rows) for k, v in FIXED_STEPS.items()}
        if scenario == "fixed"
        else {t.name: t.label for t in scenario_tools(scenario, args)}
        for scenario in args.scenarios
    }
    titles = {k: v.format(small=args.small_rows, rows=args.rows) for k, v in TITLES.items()}
    emit(report(runs, meta, args, labels, titles), args.markdown)
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
