"""Issue 33's small runs: a 20-row manifest end to end, and a rerun that changes one curation threshold, beside img2dataset.

Every round runs, in turn (the order flips every round):

- ``ss-warm``: ``shardsmith run`` as a user's second command runs it, through the warm
  service the first command started (started once, untimed, before the rounds);
- ``ss-first``: the first command of an environment: no service yet, so it runs in its own
  process and starts one as it exits (stopped again, untimed, after the run);
- ``ss-off``: ``SHARDSMITH_WARM=0``, every command in its own process (the default before);
- ``i2d``: img2dataset 1.47 with its defaults (border 256 px, JPEG q95) on the same manifest;

then, on the demo's corpus (``shardsmith demo --images N``, untimed), the rerun that changes
``curate.alignment.min`` (a new value every time) through the warm service and without it, and
a no-op rerun of each. The warm service's own CPU during a run is counted as ``warm`` (the
command's process tree is the client only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.photos import ensure_unique_pool, write_manifest  # noqa: E402
from harness.procs import REPO, Session, timed, wait_for_quiet  # noqa: E402
from harness.report import add_round_flags, alternated, command, emit, fmt, machine, med, now, revision, table  # noqa: E402
from harness.servers import prefect_env, serve  # noqa: E402
from harness.tools import (  # noqa: E402
    I2D_ENCODE_QUALITY,
    I2D_IMAGE_SIZE,
    I2D_RESIZE_MODE,
    SHARDSMITH,
    ensure_img2dataset,
    i2d_command,
    i2d_env,
    write_recipe,
)

SMALL_TOOLS = ("ss-warm", "ss-first", "ss-off", "i2d")
RERUN_TOOLS = ("ss-warm", "ss-off")
TARGET_S = 5.0


class Bench:
    """The invocation's state: its session, servers, environments and the runs so far."""

    def __init__(self, session: Session, args: argparse.Namespace):
        self.s, self.args = session, args
        pool, _ = ensure_unique_pool(args.rows, seed=0)
        self.loop = serve(session, pool, prefect=False)
        names = sorted(os.listdir(pool))[: args.rows]
        self.manifest = session.work / "m.parquet"
        write_manifest(self.manifest, [f"{self.loop.base_url}/img/{n}" for n in names])
        home = session.work / "prefect-home"
        home.mkdir()
        self.warm_dir = session.work / "warm"
        self.env = prefect_env(home, SHARDSMITH_WARM="1", SHARDSMITH_WARM_DIR=str(self.warm_dir))
        self.runs: list[dict] = []
        self.threshold = 0.40

    def shardsmith(self, key: str, tool: str, rnd: int, args: list[str], env: dict[str, str]) -> None:
        if self.args.quiet_wait:
            wait_for_quiet(self.args.quiet_wait)
        watch = dict(self.loop.watch)
        service = self.service_pid(env)
        if service:
            watch["warm"] = service
        log = self.s.work / f"{key}-{tool}-{rnd}.log"
        t = timed(self.s.children, [str(SHARDSMITH), "run", *args], env, REPO, log, watch)
        self.runs.append(
            {"key": key, "tool": tool, "round": rnd, "wall": t.wall_s, "cpu": t.cpu_s + t.watched.get("warm", 0.0)}
        )
        print(f"  {key:8} {tool:9} round {rnd}: {t.wall_s:6.2f} s", flush=True)

    def service_pid(self, env: dict[str, str]) -> int | None:
        infos = list(Path(env["SHARDSMITH_WARM_DIR"]).glob("*.json"))
        return json.loads(infos[0].read_text())["pid"] if infos else None

    def start_service(self, recipe: Path) -> None:
        """The first command (untimed) and the service it starts, once it takes commands."""
        subprocess.run([str(SHARDSMITH), "run", str(recipe)], env=self.env, cwd=REPO, check=True, capture_output=True)
        self.wait_service(self.env)

    def wait_service(self, env: dict[str, str]) -> None:
        import time

        # Taking commands (its socket) with its cluster up (the scheduler's address written):
        # what a user's next command finds unless it comes within seconds of the first.
        deadline = time.monotonic() + 180
        folder = Path(env["SHARDSMITH_WARM_DIR"])
        while not (any(folder.glob("*.sock")) and any(folder.glob("*.scheduler"))):
            if time.monotonic() > deadline:
                raise SystemExit("the warm service did not start")
            time.sleep(0.2)

    def stop_service(self, env: dict[str, str]) -> None:
        subprocess.run([str(SHARDSMITH), "warm", "--stop"], env=env, cwd=REPO, check=True, capture_output=True)

    def small(self, rnd: int, tool: str) -> None:
        store = self.s.work / f"store-{tool}-{rnd}"
        recipe = self.s.work / f"small-{tool}-{rnd}.yaml"
        write_recipe(recipe, store, self.manifest, self.args.rows, self.args.workers)
        if tool == "i2d":
            if self.args.quiet_wait:
                wait_for_quiet(self.args.quiet_wait)
            out = self.s.work / f"i2d-{rnd}"
            cmd = i2d_command(
                self.manifest, out, self.args.workers, 64, self.args.rows,
                "--resize_mode", I2D_RESIZE_MODE, "--image_size", str(I2D_IMAGE_SIZE),
                "--encode_quality", str(I2D_ENCODE_QUALITY), "--encode_format", "jpg", "--timeout", "20",
            )  # fmt: skip
            t = timed(self.s.children, cmd, i2d_env(), self.s.work, self.s.work / f"i2d-{rnd}.log", self.loop.watch)
            self.runs.append({"key": "small", "tool": tool, "round": rnd, "wall": t.wall_s, "cpu": t.cpu_s})
            print(f"  small    i2d       round {rnd}: {t.wall_s:6.2f} s", flush=True)
            return
        env = self.env
        if tool == "ss-off":
            env = env | {"SHARDSMITH_WARM": "0"}
        elif tool == "ss-first":
            env = env | {"SHARDSMITH_WARM_DIR": str(self.s.work / f"warm-first-{rnd}")}
        self.shardsmith("small", tool, rnd, [str(recipe)], env)
        if tool == "ss-first":
            self.wait_service(env)
            self.stop_service(env)

    def rerun(self, rnd: int, tool: str, demo_env: dict[str, str]) -> None:
        self.threshold += 0.001
        env = demo_env | ({"SHARDSMITH_WARM": "0"} if tool == "ss-off" else {})
        recipe = str(REPO / "recipes" / "demo.yaml")
        self.shardsmith("rerun", tool, rnd, [recipe, "--set", f"curate.alignment.min={self.threshold:.3f}"], env)
        self.shardsmith("noop", tool, rnd, [recipe, "--set", f"curate.alignment.min={self.threshold:.3f}"], env)


def report(b: Bench, args: argparse.Namespace, started: str) -> str:
    def stats(key: str, tool: str) -> tuple[float | None, float | None, int]:
        runs = [r for r in b.runs if r["key"] == key and r["tool"] == tool]
        return med(r["wall"] for r in runs), med(r["cpu"] for r in runs), len(runs)

    lines = [
        f"## Small runs (`bench_small.py`), {started}",
        "",
        f"`{command('bench_small.py', None)}`; code {revision()}; {machine()}.",
        "",
    ]
    rows = []
    i2d_wall = stats("small", "i2d")[0]
    for key, label, tools in (
        ("small", f"{args.rows}-row manifest end to end", SMALL_TOOLS),
        ("rerun", f"demo ({args.demo_images} pictures): a rerun with a new curate.alignment.min", RERUN_TOOLS),
        ("noop", "the same rerun again (nothing to do)", RERUN_TOOLS),
    ):
        for tool in tools:
            wall, cpu, n = stats(key, tool)
            vs = fmt(wall / i2d_wall, ".2f") + "x" if key == "small" and wall and i2d_wall and tool != "i2d" else ""
            rows.append((label, tool, n, fmt(wall, ".2f"), fmt(cpu, ".1f"), vs))
    lines += table(["run", "tool", "runs", "wall s (median)", "CPU s (median)", "wall / img2dataset"], rows, "llrrrr")
    warm_small, warm_rerun = stats("small", "ss-warm")[0], stats("rerun", "ss-warm")[0]
    lines += [
        "",
        f"- {args.rows} rows end to end through the warm service: {fmt(warm_small, '.2f')} s "
        f"(target <= {TARGET_S:g} s: {'met' if warm_small is not None and warm_small <= TARGET_S else 'not met'})",
        f"- a rerun with one threshold changed: {fmt(warm_rerun, '.2f')} s "
        f"(target <= {TARGET_S:g} s: {'met' if warm_rerun is not None and warm_rerun <= TARGET_S else 'not met'})",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20, help="rows of the small manifest")
    p.add_argument("--workers", type=int, default=2, help="shardsmith Dask workers = img2dataset processes")
    p.add_argument("--demo-images", type=int, default=30, help="pictures in the demo corpus of the rerun")
    add_round_flags(p, "small", repeats=3, quiet_wait=30.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_img2dataset()
    started = now()
    with Session("small", keep=args.keep) as session:
        b = Bench(session, args)
        first = session.work / "warmup.yaml"
        write_recipe(first, session.work / "store-warmup", b.manifest, args.rows, args.workers)
        print("starting the warm service (untimed) ...", flush=True)
        b.start_service(first)
        for rnd, tool in alternated(SMALL_TOOLS, args.repeats):
            b.small(rnd, tool)
        demo = session.work / "demo"
        print(f"making the demo corpus of {args.demo_images} pictures (untimed) ...", flush=True)
        subprocess.run(
            [str(SHARDSMITH), "demo", "--dir", str(demo), "--images", str(args.demo_images)],
            env=b.env | {"SHARDSMITH_WARM": "0"}, cwd=REPO, check=True, capture_output=True,
        )  # fmt: skip
        demo_env = b.env | {"SHARDSMITH_DEMO_DIR": str(demo), "SHARDSMITH_WARM_DIR": str(session.work / "warm-demo")}
        subprocess.run(
            [str(SHARDSMITH), "run", str(REPO / "recipes" / "demo.yaml"), "--set", "curate.alignment.min=0.4"],
            env=demo_env, cwd=REPO, check=True, capture_output=True,
        )  # fmt: skip
        b.wait_service(demo_env)
        for rnd, tool in alternated(RERUN_TOOLS, args.repeats):
            b.rerun(rnd, tool, demo_env)
        for env in (b.env, demo_env):
            b.stop_service(env)
        emit(report(b, args, started), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
