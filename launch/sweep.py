"""A grid of config overrides -> one run directory per point, run one after another or printed.

    python launch/sweep.py --config=configs/gsspo.py:local --grid=train.learning_rate=1e-6,3e-6 \\
        --grid=seed=0,1,2 --set=steps=10 --root=runs/sweep-lr
    python launch/sweep.py ... --dry_run            # the commands, one per line (for a scheduler)
    python launch/sweep.py ... --launcher="bash launch/gpu.sh"   # each point through a launcher

Every point of the cross product of the `--grid` axes (values separated by commas), plus the fixed
`--set` overrides, is one `python -m workflow_r1.train --config=... --config.key=value ...
--workdir=<root>/<point>` command, its directory named by the point (`seed=0,train.learning_rate=1e-06`).
Every override is checked against the config file before anything runs (a wrong key is one line).
Points whose work directory already holds summary.json (a finished run) are skipped; an
interrupted one resumes. A failing point does not stop the others; the exit status is 1 if any
failed. <root>/sweep.json lists the points, their directories and commands.
"""
from __future__ import annotations

import itertools
import json
import pathlib
import re
import shlex
import subprocess
import sys

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_CONFIG = flags.DEFINE_string("config", "configs/gsspo.py:local", "config file and preset of every point")
_GRID = flags.DEFINE_multi_string("grid", [], "an axis: key=v1,v2,... (repeat for more axes)")
_SET = flags.DEFINE_multi_string("set", [], "a fixed override key=value for every point (repeatable)")
_ROOT = flags.DEFINE_string("root", "runs/sweep", "parent of the points' work directories")
_MODULE = flags.DEFINE_string("module", "workflow_r1.train", "entry point of every point")
_LAUNCHER = flags.DEFINE_string("launcher", "", "command prefix replacing `python -m MODULE`'s python, e.g. "
                                "'bash launch/gpu.sh' (which itself runs MODULE)")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the commands, one per line, and exit")


def parse_axis(text: str) -> tuple[str, list[str]]:
    """"train.learning_rate=1e-6,3e-6" -> ("train.learning_rate", ["1e-6", "3e-6"])."""
    key, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise ValueError(f"--grid={text!r} must look like key=v1,v2,...")
    return key.strip(), items


def points(grid: list[str]) -> list[list[tuple[str, str]]]:
    """The cross product of the axes, first axis slowest: [[(key, value), ...], ...]."""
    axes = [parse_axis(g) for g in grid]
    keys = [k for k, _ in axes]
    if len(set(keys)) < len(keys):
        raise ValueError(f"--grid names a key twice: {keys}")
    return [list(zip(keys, combo)) for combo in itertools.product(*(v for _, v in axes))]


def point_name(point: list[tuple[str, str]]) -> str:
    """A directory name for a point: key=value pairs sorted by key, joined by commas, odd characters as _."""
    name = ",".join(f"{k}={v}" for k, v in sorted(point)) or "default"
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)


def command(config: str, overrides: list[str], workdir: pathlib.Path, module: str, launcher: str) -> list[str]:
    head = shlex.split(launcher) if launcher else [sys.executable, "-m", module]
    return [*head, f"--config={config}", *(f"--config.{o}" for o in overrides), f"--workdir={workdir}"]


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from workflow_r1 import configlib

    root = pathlib.Path(_ROOT.value)
    try:
        grid = points(_GRID.value)
        plan = []
        for point in grid:
            overrides = [*_SET.value, *(f"{k}={v}" for k, v in point)]
            configlib.load(_CONFIG.value, overrides)  # a wrong key or value: one line, before any run
            workdir = root / point_name(point)
            plan.append({"point": dict(point), "workdir": str(workdir),
                         "command": command(_CONFIG.value, overrides, workdir, _MODULE.value, _LAUNCHER.value)})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if _DRY_RUN.value:
        for p in plan:
            print(shlex.join(p["command"]))
        return
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps({"config": _CONFIG.value, "set": _SET.value, "points": plan},
                                                indent=2))
    failed = []
    for i, p in enumerate(plan):
        if (pathlib.Path(p["workdir"]) / "summary.json").is_file():
            print(f"[{i + 1}/{len(plan)}] {p['workdir']}: finished before, skipped", flush=True)
            continue
        print(f"[{i + 1}/{len(plan)}] {shlex.join(p['command'])}", flush=True)
        if subprocess.run(p["command"]).returncode != 0:
            failed.append(p["workdir"])
    if failed:
        print(f"{len(failed)} of {len(plan)} points failed: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    app.run(main)
