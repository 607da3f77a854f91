"""Sweeps: a list of trainer runs, each a config with its overrides and a work directory, run one
after another as `python -m workflow_r1.train` commands (or printed for a scheduler).

Two programs make their runs here: `launch/sweep.py` (the cross product of `--grid` axes over any
config keys) and the loss ablation (`workflow_r1.ablation --task=workflow`: losses x seeds, each
loss its own config file). What they share:

- every run's config and overrides are checked (`configlib.load`) before anything runs, so a wrong
  key or value is one line and no run has started;
- a run whose work directory already holds summary.json (written last by a finished run) is
  skipped; an interrupted one is run again and resumes from its newest checkpoint (the trainer's);
- `run` goes through the runs in order, and either keeps going past a failed run (the sweep: the
  failures are returned) or stops at the first (the ablation: it raises CalledProcessError);
- a run that exits 0 without summary.json was preempted (SIGTERM: it saved and stopped,
  preemption.py): the sweep stops there, and the same command resumes it.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence

FINISHED = "summary.json"  # what a finished trainer run writes last


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a sweep: `config` (FILE.py:PRESET) with `overrides` (key=value, applied in order)
    in `workdir`; `point` names what varies across the sweep (for the manifest)."""

    config: str
    overrides: tuple[str, ...]
    workdir: pathlib.Path
    point: dict[str, str] = dataclasses.field(default_factory=dict)

    def command(self, module: str = "workflow_r1.train", launcher: str = "") -> list[str]:
        """`python -m MODULE --config=... --config.key=value ... --workdir=...`; a launcher (e.g.
        "bash launch/gpu.sh", which itself runs the trainer) replaces `python -m MODULE`."""
        head = shlex.split(launcher) if launcher else [sys.executable, "-m", module]
        return [*head, f"--config={self.config}", *(f"--config.{o}" for o in self.overrides),
                f"--workdir={self.workdir}"]

    @property
    def finished(self) -> bool:
        return (pathlib.Path(self.workdir) / FINISHED).is_file()


def parse_axis(text: str) -> tuple[str, list[str]]:
    """"train.learning_rate=1e-6,3e-6" -> ("train.learning_rate", ["1e-6", "3e-6"])."""
    key, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise ValueError(f"--grid={text!r} must look like key=v1,v2,...")
    return key.strip(), items


def points(grid: Sequence[str]) -> list[list[tuple[str, str]]]:
    """The cross product of the axes `key=v1,v2,...`, first axis slowest: [[(key, value), ...], ...]."""
    axes = [parse_axis(g) for g in grid]
    keys = [k for k, _ in axes]
    if len(set(keys)) < len(keys):
        raise ValueError(f"--grid names a key twice: {keys}")
    return [list(zip(keys, combo)) for combo in itertools.product(*(v for _, v in axes))]


def point_name(point: Sequence[tuple[str, str]]) -> str:
    """A directory name for a point: key=value pairs sorted by key, joined by commas, odd characters as _."""
    name = ",".join(f"{k}={v}" for k, v in sorted(point)) or "default"
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)


def grid_runs(config: str, grid: Sequence[str], overrides: Sequence[str], root: pathlib.Path) -> list[Run]:
    """One run per point of the grid: the fixed `overrides`, then the point's; in root/<point_name>."""
    return [Run(config, (*overrides, *(f"{k}={v}" for k, v in point)), pathlib.Path(root) / point_name(point),
                dict(point)) for point in points(grid)]


def check(runs: Sequence[Run]) -> None:
    """Loads every run's config with its overrides: a wrong key or value raises ConfigError (one line)."""
    from workflow_r1 import configlib

    for r in runs:
        configlib.load(r.config, list(r.overrides))


def write_manifest(path: pathlib.Path, runs: Sequence[Run], commands: Sequence[Sequence[str]], **about) -> None:
    """`path` (JSON): `about` and every run's point, work directory and command."""
    path.parent.mkdir(parents=True, exist_ok=True)
    listed = [{"point": r.point, "workdir": str(r.workdir), "command": list(c)} for r, c in zip(runs, commands)]
    path.write_text(json.dumps({**about, "points": listed}, indent=2))


def run(runs: Sequence[Run], commands: Sequence[Sequence[str]], keep_going: bool = True) -> list[Run]:
    """Runs each command whose run is not finished, in order, printing a line per run; returns the
    runs that failed (keep_going), or raises CalledProcessError at the first failure."""
    failed = []
    for i, (r, cmd) in enumerate(zip(runs, commands)):
        if r.finished:
            print(f"[{i + 1}/{len(runs)}] {r.workdir}: finished before, skipped", flush=True)
            continue
        print(f"[{i + 1}/{len(runs)}] {shlex.join(cmd)}", flush=True)
        code = subprocess.run(list(cmd)).returncode
        if code == 0 and not r.finished:  # preempted: the machine is going away, the next run would be too
            print(f"[{i + 1}/{len(runs)}] {r.workdir}: preempted, sweep stopped; rerun the same command to resume",
                  flush=True)
            break
        if code != 0:
            if not keep_going:
                raise subprocess.CalledProcessError(code, list(cmd))
            failed.append(r)
    return failed
