"""Web manifests, issues 2 and 13: shardsmith beside img2dataset 1.47 at its defaults on the same loopback URLs.

Each URL a distinct photo-like image; both tools get ``--workers`` processes and ``--rows-per-shard``. Scenarios
(``--validate``, ``--faulty``, ``--download``, ``--fixed``) say their targets in ``--help``; a command that fails or
outlasts ``--run-timeout`` is recorded as failed, its folder kept, what it left running killed.
"""

from __future__ import annotations

import shutil
import sys
from collections import namedtuple
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import harness.tools as ht
from harness.photos import ensure_pool, write_manifest
from harness.procs import REPO, Session, settle, timed
from harness.report import emit, fmt, in_turn, med, parse, parser, per_1k, ratio, table
from harness.servers import prefect_env, serve

SCENARIOS = ("validate", "faulty", "download", "fixed")
FAULTS = {
    "404": "/status/404?u={i}",
    "500": "/status/500?u={i}",
    "slow": "/trickle/{ms}/{n}",
    "timeout": "/hang?u={i}",
    "truncated": "/truncated/{n}",
    "corrupt": "/corrupt/{n}",
    "html": "/html-as-jpeg?u={i}",
    "empty": "/empty/{n}",
}
# One command of a scenario: its key, what it is, ``shardsmith run`` (else img2dataset), --phase, --set overrides, img2dataset's arguments.
Tool = namedtuple("Tool", "name label shardsmith phase sets i2d", defaults=("validate", (), ()))
I2D = Tool(
    "img2dataset",
    "img2dataset defaults (border 256, jpg q95, timeout 10 s, no retries)",
    False,
    i2d=ht.I2D_RESIZE + ht.I2D_NET,
)
FIXED = {
    "small": "shardsmith --phase validate, {small}-row manifest, new store",
    "small-i2d": "img2dataset defaults, the same {small} rows",
    "noop-small": "the same shardsmith command again (the nightly no-op)",
    "big-validate": "shardsmith --phase validate, {rows} rows, new store",
    "reshard": "shardsmith --phase reshard right after it",
    "noop-reshard": "the same --phase reshard again (all committed)",
}


def scenario_tools(scenario: str, args) -> list[Tool]:
    """The tools one round of a scenario runs, in turn."""
    if scenario == "validate":  # shardsmith keeps the bytes as fetched beside its outputs by default
        return [
            Tool("shardsmith", "shardsmith --phase validate, recipe defaults", True),
            Tool(
                "shardsmith-lean",
                "the same, download.keep_raw=false (no raw shards)",
                True,
                sets=("download.keep_raw=false",),
            ),
            I2D,
        ]
    if scenario == "faulty":  # img2dataset's timeout, no retries, as many requests in flight as it has threads
        equal = (
            "download.timeout_s=10",
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
                "shardsmith --phase validate, recipe defaults (its timeout, retries, per-host limit)",
                True,
            ),
            I2D,
        ]
    raw = ("--resize_mode", "no", "--disable_all_reencoding", "True", *ht.I2D_NET)
    return [
        Tool("shardsmith", "shardsmith --phase download (bytes stored as fetched)", True, phase="download"),
        Tool(
            "img2dataset-raw",
            "img2dataset --resize_mode no --disable_all_reencoding True (bytes as fetched)",
            False,
            i2d=raw,
        ),
    ] + (
        [
            Tool(
                "img2dataset-reencode",
                "img2dataset --resize_mode no (decode and re-encode)",
                False,
                i2d=raw[:2] + ht.I2D_NET,
            )
        ]
        if args.reencode
        else []
    )


@dataclass
class Run(ht.ToolRun):
    """A run of a scenario; ``cpu_s`` includes a pre-started Prefect server's CPU meanwhile."""

    scenario: str = ""
    reshard_s: float | None = None
    reasons: dict = field(default_factory=dict)  # what was not kept, and why
    disk_mb: float | None = None  # what the run left on disk (logs apart)
    error: str | None = None


def prefect_role(p, root) -> str:
    """TreeSampler's role function: the CLI's own Prefect server apart."""
    cmd = " ".join(p.cmdline())
    return "prefect-server" if ("uvicorn" in cmd or "flows.local_server" in cmd) and "prefect" in cmd else "other"


class Bench:
    """The invocation: its session, servers (``watch``), a Prefect API (None: each command starts its own)."""

    def __init__(self, args, s: Session, loop) -> None:
        self.args, self.s, self.watch, self.api, self.home = args, s, loop.watch, loop.api, s.work / "prefect-home"

    def measure(
        self, run: Run, cmd: list[str], env: dict, cwd: Path, log: Path, prefect: bool, watch: dict | None = None
    ):
        """Run and fill the run's times (a pre-started server's CPU is shardsmith's); on failure keep the error and the folders."""
        try:
            t = timed(
                self.s.children, cmd, env, cwd, log, watch or self.watch, self.args.run_timeout, prefect_role, True
            )
        except SystemExit as err:
            run.error, self.s.keep = str(err).splitlines()[0], True
            return print(f"  FAILED {run.scenario} {run.tool} round {run.round}: {err}", flush=True)
        run.took(t, prefect).cpu_s += t.watched.get("prefect", 0.0) if prefect else 0.0
        if prefect and "prefect" not in t.watched:
            run.prefect_cpu_s = t.sampler.by_role().get("prefect-server")
        return t

    def run(self, scenario: str, tool: Tool, rnd: int, manifest: Path, folder: Path, key: str | None = None) -> Run:
        """One timed run in ``folder`` (reused: a second shardsmith run finds its work committed)."""
        settle(self.args.quiet_wait)
        run, a = Run(key or tool.name, rnd, scenario=scenario), self.args
        folder.mkdir(parents=True, exist_ok=True)
        if tool.shardsmith:
            if not (recipe := folder / "recipe.yaml").exists():
                ht.write_recipe(recipe, folder / "store", manifest, a.rows_per_shard, a.workers)
            cmd, log = ht.run_command(recipe, tool.phase, *tool.sets), folder / f"{run.tool}-{rnd}.log"
            if (t := self.measure(run, cmd, prefect_env(self.home, self.api), REPO, log, True)) is None:
                return run
            res = ht.summary(t.stdout)
            if "up_to_date" not in res:  # else the last run covered these phases over the same inputs
                dl, val, rs = res["download"], res.get("validate"), res.get("reshard")
                run.rows, run.ok, run.phase_s = (
                    dl["counts"]["rows"],
                    (val or dl)["counts"]["ok"],
                    sum(x["seconds"] for x in (dl, val, rs) if x),
                )
                run.reasons = dl["counts"]["by_reason"] | (val["counts"]["by_reason"] if val else {})
                run.reshard_s = rs["seconds"] if rs else None
        else:
            cmd = ht.i2d_command(manifest, folder / "out", a.workers, a.threads, a.rows_per_shard, *tool.i2d)
            if self.measure(run, cmd, ht.i2d_env(), folder, folder / "stderr.log", False) is None:
                return run
            t, run.phase_s = ht.i2d_outputs(folder / "out")
            statuses = t.get("status", [])
            run.rows, run.ok = len(statuses), statuses.count("success")
            for status, message in zip(statuses, t.get("error_message", [None] * len(statuses))):
                if status != "success":
                    why = (message or status).split(":", 1)[0][:60]
                    run.reasons[why] = run.reasons.get(why, 0) + 1
        run.disk_mb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.suffix != ".log") / 1e6
        print(f"  {scenario} round {rnd} {run.tool}: {run.line()}", flush=True)
        return run

    def rounds(self, scenario: str, manifest: Path) -> list[Run]:
        runs = []
        for rnd in range(1, self.args.repeats + 1):
            for tool in in_turn(scenario_tools(scenario, self.args), rnd):
                runs.append(
                    self.run(scenario, tool, rnd, manifest, folder := self.s.work / f"{scenario}-{tool.name}-{rnd}")
                )
                if not self.args.keep and runs[-1].error is None:
                    shutil.rmtree(folder, ignore_errors=True)
        return runs

    def fixed(self, small: Path, big: Path) -> list[Run]:
        """Per round: the small manifest end to end (img2dataset beside it) and again; a full validate,
        ``--phase reshard`` on its store, and that reshard again."""
        ss, reshard, runs = scenario_tools("validate", self.args)[0], Tool("shardsmith", "", True, phase="reshard"), []
        for rnd in range(1, self.args.repeats + 1):
            small_dir, big_dir, i2d_dir = (self.s.work / f"fixed-{k}-{rnd}" for k in ("small", "big", "i2d"))
            for key, tool in in_turn([("small", ss), ("small-i2d", I2D)], rnd):
                runs.append(self.run("fixed", tool, rnd, small, small_dir if tool.shardsmith else i2d_dir, key))
            if next(r for r in runs[::-1] if r.tool == "small").error is None:
                runs.append(self.run("fixed", ss, rnd, small, small_dir, "noop-small"))
            runs.append(self.run("fixed", ss, rnd, big, big_dir, "big-validate"))
            for key in ("reshard", "noop-reshard"):
                runs += [self.run("fixed", reshard, rnd, big, big_dir, key)] if runs[-1].error is None else []
            if not self.args.keep and not any(r.error for r in runs if r.round == rnd):
                for folder in (small_dir, big_dir, i2d_dir):
                    shutil.rmtree(folder, ignore_errors=True)
        return runs


def verdict(value: float | None, target: float | None, at_least: bool = False) -> str:
    if value is None or target is None:
        return "-"
    return "met" if (value >= target if at_least else value <= target) else "**not met**"


def summarize(runs: list[Run]) -> dict[str, dict]:
    """Medians over each tool's successful rounds (best in brackets in the table)."""
    out = {}
    for name in dict.fromkeys(r.tool for r in runs if r.error is None):
        rs = [r for r in runs if r.tool == name and r.error is None]
        out[name] = ht.spread(rs) | {
            "cpu": med(r.cpu_s for r in rs),
            "reshard": med(r.reshard_s for r in rs),
            "prefect": med(per_1k(r.prefect_cpu_s, r.ok) for r in rs),
            "disk": med(r.disk_mb for r in rs),
        }
    return out


def ratio_rows(
    scenario: str, s: dict[str, dict], tool: str, base: str, rate_aim: float | None, cpu_aim: float | None
) -> list[tuple]:
    """The targets table's rows of ``tool`` / ``base``: samples/s and CPU per 1,000 accepted samples."""
    if tool not in s or base not in s:
        return [(f"{scenario}: {tool} / {base}", "-", "-", "no successful run", "-", "-")]
    rows = []
    for what, key, aim, higher in (("samples/s", "rate", rate_aim, True), ("CPU s / 1k ok", "cpu_1k", cpu_aim, False)):
        r = ratio(s[tool][key], s[base][key])
        target = (f">= {aim}x" if higher else f"<= {aim}x") if aim else "reported"
        rows.append(
            (
                f"{scenario}: {tool} / {base}, {what}",
                f"{s[tool][key]:.2f}",
                f"{s[base][key]:.2f}",
                f"**{r:.2f}x**",
                target,
                verdict(r, aim, higher),
            )
        )
    return rows


def report(runs: list[Run], args, faults: dict[str, int]) -> list[str]:
    lines, targets = [], []
    for scenario in args.scenarios:
        s = summarize(rs := [r for r in runs if r.scenario == scenario])
        lines += ["", f"### {scenario}", ""]
        labels = (
            {t.name: t.label for t in scenario_tools(scenario, args)}
            if scenario != "fixed"
            else {k: v.format(small=args.small_rows, rows=args.rows) for k, v in FIXED.items()}
        )
        rows = [
            [
                labels.get(k, k),
                v["n"],
                f"{v['wall']:.1f} ({v['wall_best']:.1f})",
                f"{v['rate']:.1f} ({v['rate_best']:.1f})",
                f"{v['cpu_1k']:.2f} ({v['cpu_1k_best']:.2f})",
                fmt(v["prefect"], ".2f"),
                f"{'/'.join(map(str, v['ok']))} of {v['rows']}",
                fmt(v["disk"], ".0f"),
            ]
            for k, v in s.items()
        ]
        lines += table(
            ["tool", "runs ok", "wall s", "samples/s", "CPU s / 1k ok", "of which Prefect", "ok", "MB on disk"], rows
        )
        lines += [f"- {r.tool} round {r.round} failed: {r.error}" for r in rs if r.error]
        if scenario == "fixed":
            wall, rsh = {k: v["wall"] for k, v in s.items()}, s.get("reshard", {})
            for label, v, base, aim in (
                (f"{args.small_rows} rows end to end, wall s", wall.get("small"), fmt(wall.get("small-i2d")), 15.0),
                ("no-op rerun, wall s", wall.get("noop-small"), "-", 10.0),
                ("no-op --phase reshard, wall s", wall.get("noop-reshard"), "-", 10.0),
                (
                    "--phase reshard after validate, less the reshard phase, s",
                    rsh["wall"] - rsh["reshard"] if rsh.get("reshard") else None,
                    "-",
                    10.0,
                ),
            ):
                targets.append((f"fixed: {label}", fmt(v), base, "-", f"<= {aim:g} s", verdict(v, aim)))
            continue
        if scenario == "faulty":
            lines += [
                "",
                "Rows: "
                + ", ".join(f"{k} {n}" for k, n in faults.items())
                + f" (slow: the whole image over {args.slow_ms} ms, so kept)",
            ]
        base = "img2dataset-raw" if scenario == "download" else "img2dataset"
        for t in scenario_tools(scenario, args):
            if t.shardsmith:
                aim = 1.5 if scenario == "validate" or t.name in ("shardsmith", "shardsmith-equal") else None
                targets += ratio_rows(scenario, s, t.name, base, aim, 0.67 if scenario == "validate" else None)
        targets += (
            ratio_rows(scenario, s, "shardsmith", "img2dataset-reencode", None, None)
            if args.reencode and scenario == "download"
            else []
        )
        due = faults["ok"] + faults["slow"] if scenario == "faulty" else args.rows
        lines += [
            f"- WARNING: {k} kept {'/'.join(map(str, v['ok']))} samples where {due} are due"
            for k, v in s.items()
            if v["ok"] != [due]
        ]
        for r in {r.tool: r for r in rs[::-1] if r.error is None and r.reasons}.values():  # each tool's first round
            lines.append(
                f"- {r.tool}, not kept: "
                + ", ".join(f"{k} {n}" for k, n in sorted(r.reasons.items(), key=lambda kv: -kv[1]))
            )
    return lines + [
        "",
        "### Against the targets (shardsmith / img2dataset, medians)",
        "",
        *table(["figure", "shardsmith", "img2dataset", "ratio", "target", ""], targets, "lrrrll"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, repeats=3, quiet_wait=90.0, keep="web")
    helps = {
        "validate": "shardsmith --phase validate, also with download.keep_raw=false, beside img2dataset (>= 1.5x samples/s, <= 0.67x CPU)",
        "faulty": "the same with --faulty-share of the rows faulty, shardsmith with img2dataset's network settings (>= 1.5x) and its own",
        "download": "--phase download beside img2dataset storing the bytes as fetched (>= 1.5x)",
        "fixed": "--small-rows end to end (<= 15 s) and again (no-op), --phase reshard after a --rows validate and again (<= 10 s)",
        "all": "every scenario, in this order",
    }
    for name, text in helps.items():
        p.add_argument(f"--{name}", action="store_true", help=text)
    p.add_argument(
        "--reencode", action="store_true", help="download: also img2dataset --resize_mode no (re-encodes every image)"
    )
    p.add_argument(
        "--rows", type=int, default=10_000, help="URLs in the manifest, each a distinct image (default 10000)"
    )
    p.add_argument(
        "--small-rows", type=int, default=20, help="rows of the small manifest: fixed scenario, warm-up (default 20)"
    )
    p.add_argument(
        "--faulty-share",
        type=float,
        default=0.2,
        help="share of faulty rows: 404, 500, slow, never answering, truncated, corrupt, HTML, empty (default 0.2)",
    )
    p.add_argument(
        "--slow-ms", type=int, default=3000, help="how long a slow row takes to arrive, complete (default 3000)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the image pool and of the faulty rows")
    ht.add_tool_flags(p, rows_per_shard=1000)
    p.add_argument(
        "--prefect",
        choices=("embedded", "server"),
        default="embedded",
        help="embedded: each shardsmith command starts its own Prefect server; server: one started beforehand",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        default=3600.0,
        help="stop a command after this many seconds: failed (default 3600)",
    )
    p.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="skip the untimed --small-rows run of each tool"
    )
    args = parse(p, argv)
    args.scenarios = [s for s in SCENARIOS if args.all or getattr(args, s)]
    if not args.scenarios or args.rows < 1 or args.small_rows < 1 or not 0 <= args.faulty_share <= 1:
        p.error("pick a scenario (--validate, --faulty, --download, --fixed or --all); --rows and --small-rows >= 1")
    import numpy as np

    pool_dir, sizes = ensure_pool(max(args.rows, args.small_rows), args.seed)
    names, runs, faults = list(sizes), [], {}
    ht.ensure_img2dataset()
    with Session("web", args.keep) as s:
        loop = serve(s, pool_dir, prefect=args.prefect == "server")
        b, url = Bench(args, s, loop), loop.base_url
        clean, small, faulty = s.work / "manifest.parquet", s.work / "manifest-small.parquet", s.work / "faulty.parquet"
        write_manifest(clean, [f"{url}/img/{n}" for n in names[: args.rows]])
        write_manifest(small, [f"{url}/img/{n}" for n in names[: args.small_rows]])
        kinds = ["ok"] * args.rows  # the faulty rows at seeded rows, the kinds in equal parts
        for j, row in enumerate(
            np.random.default_rng([args.seed, 13]).choice(
                args.rows, size=round(args.rows * args.faulty_share), replace=False
            )
        ):
            kinds[int(row)] = list(FAULTS)[j % len(FAULTS)]
        write_manifest(
            faulty,
            [
                url + (FAULTS.get(k) or "/img/{n}").format(n=n, i=i, ms=args.slow_ms)
                for i, (k, n) in enumerate(zip(kinds, names))
            ],
            kind=kinds,
        )
        faults = {k: kinds.count(k) for k in ("ok", *FAULTS)}
        for tool in scenario_tools("validate", args) if args.warmup else []:
            print(f"warm-up (not timed): {tool.name} on {args.small_rows} rows", flush=True)
            if (run := b.run("warm-up", tool, 0, small, s.work / f"warmup-{tool.name}")).error:
                raise SystemExit(f"warm-up of {tool.name} failed: {run.error}")
        for scenario in args.scenarios:
            print(f"{scenario}:", flush=True)
            if scenario == "fixed":
                runs += b.fixed(small, clean)
            else:
                runs += b.rounds(scenario, faulty if scenario == "faulty" else clean)
    mb = sum(sizes[n] for n in names[: args.rows]) / 1e6
    note = f"{args.rows} URLs, {mb:.0f} MB, mean {mb / args.rows * 1e3:.0f} KB; prefect {metadata.version('prefect')}, {args.prefect}"
    emit("Web manifests (`bench_web.py`)", report(runs, args, faults), argv, args.markdown, note)
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
