"""A grid of config overrides -> one run directory per point, run one after another or printed.

    python launch/sweep.py --config=configs/gsspo.py:local --grid=train.learning_rate=1e-6,3e-6 \\
        --grid=seed=0,1,2 --config.steps=10 --root=runs/sweep-lr
    python launch/sweep.py ... --dry_run            # the commands, one per line (for a scheduler)
    python launch/sweep.py ... --launcher="bash launch/gpu.sh"   # each point through a launcher

Every point of the cross product of the `--grid` axes (values separated by commas), after the
fixed `--config.key=value` overrides (the trainer's syntax: they apply to every point), is one
`python -m workflow_r1.train --config=... --config.key=value ... --workdir=<root>/<point>` command,
its directory named by the point (`seed=0,train.learning_rate=1e-06`). Every override is checked
against the config file before anything runs (a wrong key is one line). Points whose work
directory already holds summary.json (a finished run) are skipped; an interrupted one resumes. A
failing point does not stop the others; the exit status is 1 if any failed. <root>/sweep.json
lists the points, their directories and commands. The runs are `workflow_r1.sweep`'s, as the loss
ablation's are.
"""
from __future__ import annotations

import pathlib
import shlex
import sys

from absl import app, flags
from ml_collections import config_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workflow_r1 import configlib, sweep  # noqa: E402  (after the repository is on the path)

_CONFIG = config_flags.DEFINE_config_file("config", default="configs/gsspo.py:local",
                                          help_string="config file and preset of every point; "
                                          "--config.key=value overrides apply to every point")
_GRID = flags.DEFINE_multi_string("grid", [], "an axis: key=v1,v2,... (repeat for more axes)")
_ROOT = flags.DEFINE_string("root", "runs/sweep", "parent of the points' work directories")
_MODULE = flags.DEFINE_string("module", "workflow_r1.train", "entry point of every point")
_LAUNCHER = flags.DEFINE_string("launcher", "", "command prefix replacing `python -m MODULE`'s python, e.g. "
                                "'bash launch/gpu.sh' (which itself runs MODULE)")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the commands, one per line, and exit")
# `--set=key=value` was the fixed overrides' flag: refused in one line naming the new form.
RETIRED = {"set": lambda value: f"--config.{value or 'key=value'}"}


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    spec = config_flags.get_config_filename(flags.FLAGS["config"])
    overrides = configlib.override_args(sys.argv[1:], _CONFIG.value)
    root = pathlib.Path(_ROOT.value)
    try:
        runs = sweep.grid_runs(spec, _GRID.value, overrides, root)
        sweep.check(runs)  # a wrong key or value: one line, before any run
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    commands = [r.command(_MODULE.value, _LAUNCHER.value) for r in runs]
    if _DRY_RUN.value:
        for c in commands:
            print(shlex.join(c))
        return
    sweep.write_manifest(root / "sweep.json", runs, commands, config=spec, overrides=overrides)
    failed = sweep.run(runs, commands, keep_going=True)
    if failed:
        print(f"{len(failed)} of {len(runs)} points failed: {', '.join(str(r.workdir) for r in failed)}",
              file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=configlib.parser(RETIRED))
