"""bench_web.py's runs and their report: tables per run and per tool, ratios against issue 13's targets, fixed costs."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.report import fmt, med, ratio, table
from harness.tools import I2D_REQUIREMENT, I2D_TIMEOUT_S, ToolRun, spread

TARGET_RATE = 1.5  # shardsmith / img2dataset samples/s, at least
TARGET_CPU = 0.67  # shardsmith / img2dataset CPU s per 1,000 accepted samples, at most
TARGET_SMALL_S = 15.0  # a 20-row manifest end to end, wall
TARGET_NOOP_S = 10.0  # rerunning committed work (and re-checking it before a reshard), wall


@dataclass
class Run(ToolRun):
    """A run of a scenario. Its ``cpu_s`` includes a pre-started Prefect server's CPU meanwhile;
    ``prefect_cpu_s`` is that server's share of it (sampled when embedded in the CLI)."""

    scenario: str = ""
    reshard_s: float | None = None
    reasons: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # img2dataset, faulty: kind -> [ok, rows]
    first_size: tuple[int, int] | None = None
    disk_mb: float | None = None  # what the run left on disk: shards, ledgers, reports (logs apart)
    error: str | None = None


def _ok(runs: list[Run]) -> list[Run]:
    return [r for r in runs if r.error is None]


def summarize(runs: list[Run]) -> dict[str, dict]:
    """Medians over the successful rounds of each tool (or fixed step)."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r.tool for r in runs):
        rs = _ok([r for r in runs if r.tool == name])
        failed = sum(1 for r in runs if r.tool == name and r.error)
        if not rs:
            out[name] = {"n": 0, "failed": failed}
            continue
        out[name] = spread(rs) | {
            "failed": failed,
            "phase": med(r.phase_s for r in rs),
            "reshard": med(r.reshard_s for r in rs),
            "cpu": med(r.cpu_s for r in rs),
            "prefect_1k": med(
                1000 * r.prefect_cpu_s / max(r.ok, 1) if r.prefect_cpu_s is not None else None for r in rs
            ),
            "disk_mb": med(r.disk_mb for r in rs),
        }
    return out


def _verdict(value: float | None, target: float, at_least: bool) -> str:
    if value is None:
        return "-"
    return "met" if (value >= target if at_least else value <= target) else "**not met**"


def per_run_table(runs: list[Run]) -> list[str]:
    rows = []
    for r in runs:
        if r.error:
            rows.append([r.tool, r.round, f"failed: {r.error[:120]}", *[""] * 9])
            continue
        size = "x".join(map(str, r.first_size)) if r.first_size else "-"
        rows.append(
            [r.tool, r.round, f"{r.wall_s:.1f}", fmt(r.phase_s) + (f" (reshard {r.reshard_s:.1f})" if r.reshard_s is not None else ""),
             f"{r.ok} / {r.rows}", f"{r.rate:.1f}", f"{r.cpu_s:.1f}", f"{r.cpu_per_1k:.2f}",
             fmt(1000 * r.prefect_cpu_s / max(r.ok, 1), ".2f") if r.prefect_cpu_s is not None else "-",
             f"{1000 * r.server_cpu_s / max(r.ok, 1):.2f}", f"{r.other_load:.2f}", size]
        )  # fmt: skip
    head = ["tool", "round", "wall s", "phase s", "ok / rows", "samples/s (wall)", "CPU s", "CPU s / 1k ok",
            "of which Prefect server, CPU s / 1k", "image server CPU s / 1k", "other load, cores", "first image"]  # fmt: skip
    return table(head, rows, align="l" + "r" * 10 + "l")


def summary_table(s: dict[str, dict], labels: dict[str, str]) -> list[str]:
    rows = []
    for name, v in s.items():
        if not v["n"]:
            rows.append([labels.get(name, name), f"0 ({v['failed']} failed)", *["-"] * 6])
            continue
        failed = f" ({v['failed']} failed)" if v["failed"] else ""
        rows.append(
            [labels.get(name, name), f"{v['n']}{failed}", f"{v['wall']:.1f} ({v['wall_best']:.1f})",
             f"{v['rate']:.1f} ({v['rate_best']:.1f})", f"{v['cpu_1k']:.2f} ({v['cpu_1k_best']:.2f})",
             fmt(v["prefect_1k"], ".2f"), f"{'/'.join(map(str, v['ok']))} of {v['rows']}", fmt(v["disk_mb"], ".0f")]
        )  # fmt: skip
    head = [
        "tool",
        "runs",
        "wall s",
        "samples/s (wall)",
        "CPU s / 1k ok",
        "of which Prefect server",
        "ok",
        "MB on disk",
    ]
    return table(head, rows)


def compare(
    s: dict[str, dict], tool: str, base: str, rate_target: float | None, cpu_target: float | None
) -> tuple[list[str], list[tuple]]:
    """Ratio lines shardsmith / img2dataset, and rows for the targets table."""
    a, b = s.get(tool, {}), s.get(base, {})
    if not a.get("n") or not b.get("n"):
        return [f"- {tool} vs {base}: no ratio (a tool has no successful run)"], []
    rate, cpu = ratio(a["rate"], b["rate"]), ratio(a["cpu_1k"], b["cpu_1k"])
    aim_rate = f"; target >= {rate_target:g}x: {_verdict(rate, rate_target, True)}" if rate_target else ""
    aim_cpu = f"; target <= {cpu_target:g}x: {_verdict(cpu, cpu_target, False)}" if cpu_target else ""
    lines = [
        f"- {tool} / {base}, samples/s over the whole command: **{rate:.2f}x** ({a['rate']:.1f} vs {b['rate']:.1f}; > 1: shardsmith faster){aim_rate}",
        f"- {tool} / {base}, CPU s per 1,000 accepted samples: **{cpu:.2f}x** ({a['cpu_1k']:.2f} vs {b['cpu_1k']:.2f}; < 1: shardsmith cheaper; "
        f"i.e. img2dataset uses {1 / cpu:.2f}x shardsmith's CPU per sample){aim_cpu}",
    ]
    rows = [
        (
            f"{tool} / {base}: samples/s",
            f"{a['rate']:.1f}",
            f"{b['rate']:.1f}",
            f"{rate:.2f}x",
            f">= {rate_target:g}x" if rate_target else "reported",
            _verdict(rate, rate_target, True) if rate_target else "-",
        )
    ]
    rows.append(
        (
            f"{tool} / {base}: CPU s / 1k ok",
            f"{a['cpu_1k']:.2f}",
            f"{b['cpu_1k']:.2f}",
            f"{cpu:.2f}x",
            f"<= {cpu_target:g}x" if cpu_target else "reported",
            _verdict(cpu, cpu_target, False) if cpu_target else "-",
        )
    )
    return lines, rows


def agreement(runs: list[Run], expected: int, what: str) -> list[str]:
    """Warnings when the tools kept different numbers of samples, or other than expected
    (every URL is a distinct image, so both should keep the same ones)."""
    kept = {name: sorted({r.ok for r in _ok(runs) if r.tool == name}) for name in dict.fromkeys(r.tool for r in runs)}
    lines = []
    if len({ok for oks in kept.values() for ok in oks}) > 1:
        lines.append(
            "- WARNING: the tools kept different numbers of samples: "
            + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in kept.items() if v)
        )
    for name, oks in kept.items():
        if oks and (oks[0] != expected or oks[-1] != expected):
            lines.append(f"- WARNING: {name} kept {'/'.join(map(str, oks))} samples where {what} gives {expected}")
    return lines


def outcomes(runs: list[Run]) -> list[str]:
    """What each tool did with the rows it did not keep (first successful round)."""
    lines = []
    for name in dict.fromkeys(r.tool for r in runs):
        first = next((r for r in _ok(runs) if r.tool == name), None)
        if first is None:
            continue
        if first.by_kind:
            kinds = ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in sorted(first.by_kind.items(), key=lambda kv: -kv[1][1]))
            lines.append(f"- {name}, kept per row kind: {kinds}")
        if first.reasons:
            lines.append(
                f"- {name}, not kept: "
                + ", ".join(f"{k} {v}" for k, v in sorted(first.reasons.items(), key=lambda kv: -kv[1]))
            )
    return lines


def report(runs: list[Run], meta: dict, args, labels: dict[str, dict[str, str]], titles: dict[str, str]) -> str:
    """The whole report, as markdown: ``labels`` of each scenario's tools (or fixed steps) and
    ``titles`` of the scenarios, by scenario."""
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; load average before: {meta['load_before']}; code: {meta['revision']}; "
        f"{I2D_REQUIREMENT}; prefect {meta['prefect']}",
        f"- corpus: {meta['rows']} URLs, each a distinct synthetic image ({meta['url_mb']:.0f} MB, mean {meta['mean_kb']:.0f} KB, "
        f"200..2000 px; {meta['mix']}), served on loopback by `python -m tasks.demo.webserver`",
        f"- both tools: {args.workers} processes, {args.rows_per_shard} rows per shard; img2dataset --thread_count {args.threads}, "
        f"--timeout {I2D_TIMEOUT_S} --retries 0 (its defaults, stated); shardsmith: {meta['prefect_mode']}",
        "- wall = the whole command; phase = shardsmith's JSON `seconds` of its phases / img2dataset's first shard start to last "
        "shard end; CPU = user+sys of the tool's process tree"
        + (" plus the pre-started Prefect server's during the run" if args.prefect == "server" else "")
        + "; the image server's CPU and other work's load are apart; medians over rounds (best in brackets)",
    ]
    targets: list[tuple] = []
    for scenario in args.scenarios:
        rs = [r for r in runs if r.scenario == scenario]
        if not rs:
            continue
        s = summarize(rs)
        lines += ["", f"#### {scenario}: {titles[scenario]}", ""]
        if scenario == "faulty":
            mix = ", ".join(f"{k} {n}" for k, n in meta["faults"].items())
            lines += [
                f"Manifest: {mix} rows (slow = the whole image over {args.slow_ms} ms, so it is kept; timeout = never answers).",
                "",
            ]
        lines += ["Per run:", "", *per_run_table(rs), "", "Summary:", "", *summary_table(s, labels[scenario]), ""]
        if scenario == "validate":
            more, rows = compare(s, "shardsmith", "img2dataset", TARGET_RATE, TARGET_CPU)
            more2, rows2 = compare(s, "shardsmith-lean", "img2dataset", TARGET_RATE, TARGET_CPU)
            lines += more + more2 + agreement(rs, meta["rows"], "the manifest")
            targets += rows + rows2
        elif scenario == "faulty":
            more, rows = compare(s, "shardsmith-equal", "img2dataset", TARGET_RATE, None)
            more2, rows2 = compare(s, "shardsmith-defaults", "img2dataset", None, None)
            lines += (
                more
                + more2
                + agreement(rs, meta["faults"]["ok"] + meta["faults"].get("slow", 0), "the clean and slow rows")
                + ["", "Outcomes (round 1):", "", *outcomes(rs)]
            )
            targets += rows + rows2
        elif scenario == "download":
            more, rows = compare(s, "shardsmith", "img2dataset-raw", TARGET_RATE, None)
            lines += more + agreement(rs, meta["rows"], "the manifest")
            targets += rows
        else:
            fixed_lines, rows = fixed_summary(s, args)
            lines += fixed_lines
            targets += rows
    if targets:
        lines += [
            "",
            "#### Against issue 13's targets (ratios are shardsmith / img2dataset, medians)",
            "",
            *table(["figure", "shardsmith", "img2dataset", "ratio", "target", ""], targets, align="lrrrll"),
        ]
    return "\n".join(lines) + "\n"


def fixed_summary(s: dict[str, dict], args) -> tuple[list[str], list[tuple]]:
    lines, rows = [], []

    def wall(key: str) -> float | None:
        return s.get(key, {}).get("wall")

    small, noop, noop_big = wall("small"), wall("noop-small"), wall("noop-reshard")
    rs = s.get("reshard", {})
    overhead = rs["wall"] - rs["reshard"] if rs.get("n") and rs.get("reshard") is not None else None
    for label, value, target in (
        (f"{args.small_rows} rows end to end, wall s", small, TARGET_SMALL_S),
        (f"no-op rerun, {args.small_rows} rows, wall s", noop, TARGET_NOOP_S),
        ("no-op rerun of --phase reshard, wall s", noop_big, TARGET_NOOP_S),
        ("--phase reshard after validate: wall less the reshard phase, s", overhead, TARGET_NOOP_S),
    ):
        base = f"{wall('small-i2d'):.1f}" if label.startswith(f"{args.small_rows} rows") and wall("small-i2d") else "-"
        rows.append((label, fmt(value), base, "-", f"<= {target:g} s", _verdict(value, target, False)))
        lines.append(f"- {label}: {fmt(value)} (target <= {target:g} s: {_verdict(value, target, False)})")
    if rs.get("n"):
        lines.append(
            f"- --phase reshard after validate: {rs['wall']:.1f} s wall, of which the reshard phase {fmt(rs['reshard'])} s (JSON `reshard.seconds`)"
        )
    if s.get("small", {}).get("n"):
        lines.append(
            f"- {args.small_rows} rows end to end: {s['small']['cpu']:.1f} CPU s (img2dataset: {fmt(s.get('small-i2d', {}).get('cpu'))})"
        )
    return lines, rows
