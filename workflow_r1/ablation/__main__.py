"""The loss ablation: GRPO, GSPO, GSsPO (and GSPO / GSsPO with the tight clip range 3e-4 / 4e-4),
each over several seeds with the same data and budgets; writes a PNG of reward, EM, format rate and
calls against step, a Markdown table of final EM with paired differences to GSsPO, and a JSON of
every number.

    # on a laptop CPU in minutes: the synthetic operator task (workflow_r1/envs/operators.py)
    python -m workflow_r1.ablation --task=operators --seeds=3 --out=docs/ablation --runs_dir=runs/ablation
    # the real environment through train.py, one run directory per loss and seed (GPU / TPU)
    python -m workflow_r1.ablation --task=workflow --config=configs/gsspo.py:paper --seeds=3 --out=runs/ablation \\
        --config.model.checkpoint=/models/Qwen2.5-7B-Instruct --config.executor.url=http://executor:8000 \\
        --config.data.train_files=data/train_10k.jsonl --config.data.eval_files=data/test_4k.jsonl

Each loss is its config file (configs/grpo.py, gspo.py, gsspo.py; `tight` is the config variant),
so the ablation changes nothing but the loss. `--config=configs/<loss>.py:PRESET` names the preset
of every run (any loss's file: each run uses its own loss's file at that preset); the
`--config.key=value` overrides (the trainer's syntax, checked against that file before anything
runs) apply to every run. Every run is a trainer run in <runs_dir>/<loss>-seed<N> (config.json,
metrics.jsonl, TensorBoard, checkpoints, eval/; a finished run is not repeated, an interrupted one
resumes), its curves read from metrics.jsonl and its final EM from its last evaluation. With
--task=operators the run is the `operators` preset (the synthetic task's budgets and optimiser,
configs/base.py) before the overrides, in this process;
with --task=workflow it is `python -m workflow_r1.train` (the runs of `workflow_r1.sweep`, as
launch/sweep.py's are). `--dry_run` prints what would run.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

from absl import app, flags
from ml_collections import config_flags

from workflow_r1 import configlib
from workflow_r1.ablation.runs import CONFIGS_DIR, VARIANTS, run_operators, run_workflow

_TASK = flags.DEFINE_enum("task", "operators", ["operators", "workflow"],
                          "operators: the synthetic task on a tiny model (CPU, minutes); workflow: train.py runs")
_CONFIG = config_flags.DEFINE_config_file(
    "config", default=f"{CONFIGS_DIR / 'gsspo.py'}:operators",
    help_string="the preset of every run as a loss's config file and preset, e.g. configs/gsspo.py:paper (each "
    "run uses its loss's file); --config.key=value overrides apply to every run")
_LOSSES = flags.DEFINE_list("losses", list(VARIANTS), f"which of {list(VARIANTS)}")
_SEEDS = flags.DEFINE_integer("seeds", 3, "how many seeds every loss runs")
_FIRST_SEED = flags.DEFINE_integer("first_seed", 0, "the first of them (workflow task): seeds first_seed .. "
                                   "first_seed + seeds - 1")
_OUT = flags.DEFINE_string("out", "runs/ablation", "output directory (the PNG, table and JSON)")
_RUNS_DIR = flags.DEFINE_string("runs_dir", "", "the runs' work directories ('' = <out>/runs)")
_NAME = flags.DEFINE_string("name", "ablation", "file stem of the outputs (<name>.png, .md, .json)")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the runs and exit")
# Flags that the trainer's syntax replaced: each is refused in one line naming the new form.
RETIRED = {"override": lambda value: f"--config.{value or 'key=value'}",
           "steps": lambda value: f"--config.steps={value or 'N'}",
           "preset": lambda value: f"--config=configs/gsspo.py:{value or 'PRESET'}"}

LOSS_FILES = sorted({stem for stem, _, _ in VARIANTS.values()})


def preset_of(spec: str, task: str) -> str:
    """The preset of `--config=configs/<loss>.py:PRESET`; ValueError (one line) for a file that is no
    loss's, a variant (the losses choose theirs), or another preset than `operators` with the operator task."""
    path, _, arg = spec.partition(":")
    preset, *variants = [a.strip() for a in (arg or "local").split(",")]
    if pathlib.Path(path).stem not in LOSS_FILES:
        raise ValueError(f"--config={spec}: name the preset with a loss's config file, e.g. "
                         f"--config=configs/gsspo.py:{preset} (each run uses its loss's file: {LOSS_FILES})")
    if variants:
        raise ValueError(f"--config={spec}: variants come from --losses (gspo-tight, gsspo-tight), not --config")
    if task == "operators" and preset != "operators":
        raise ValueError(f"--task=operators runs the operators preset; --config=...:{preset} is for --task=workflow")
    return preset


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    unknown = [n for n in _LOSSES.value if n not in VARIANTS]
    if unknown or _SEEDS.value < 1 or _FIRST_SEED.value < 0:
        print(f"error: --losses must name some of {list(VARIANTS)} (got {unknown}), --seeds must be >= 1 "
              "and --first_seed >= 0",
              file=sys.stderr)
        raise SystemExit(2)
    out = pathlib.Path(_OUT.value)
    runs_dir = pathlib.Path(_RUNS_DIR.value) if _RUNS_DIR.value else out / "runs"
    overrides = configlib.override_args(sys.argv[1:], _CONFIG.value)
    try:
        preset = preset_of(config_flags.get_config_filename(flags.FLAGS["config"]), _TASK.value)
        if _TASK.value == "operators":
            results = run_operators(_LOSSES.value, _SEEDS.value, 0, overrides, runs_dir, _DRY_RUN.value)
        else:
            results = run_workflow(_LOSSES.value, _SEEDS.value, 0, preset, overrides, runs_dir, _DRY_RUN.value,
                                   first_seed=_FIRST_SEED.value)
    except (ValueError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if _DRY_RUN.value:
        return
    from workflow_r1.ablation import report

    paths = report.write(results, out, _NAME.value)
    print(report.table(results))
    print(f"wrote {paths['png']}, {paths['md']} and {paths['json']}")


if __name__ == "__main__":
    app.run(main, flags_parser=configlib.parser(RETIRED))
