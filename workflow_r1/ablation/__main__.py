"""The loss ablation: GRPO, GSPO, GSsPO (and GSPO / GSsPO with the tight clip range 3e-4 / 4e-4),
each over several seeds with the same data and budgets; writes a PNG of reward, EM, format rate and
calls against step, a Markdown table of final EM with paired differences to GSsPO, and a JSON of
every number.

    # on a laptop CPU in minutes: the synthetic operator task (workflow_r1/ablation/operator_task.py)
    python -m workflow_r1.ablation --task=operators --seeds=3 --out=docs/ablation --runs_dir=runs/ablation
    # the real environment through train.py, one run directory per loss and seed (GPU / TPU)
    python -m workflow_r1.ablation --task=workflow --preset=paper --seeds=3 --out=runs/ablation \\
        --override=model.checkpoint=/models/Qwen2.5-7B-Instruct --override=executor.url=http://executor:8000 \\
        --override=data.train_files=data/train_10k.jsonl --override=data.eval_files=data/test_4k.jsonl

Each loss is its config file (configs/grpo.py, gspo.py, gsspo.py; `tight` is the config variant),
so the ablation changes nothing but the loss. `--override=key=value` (repeatable) applies to every
run, as `--config.key=value` would. Every run is a trainer run in <runs_dir>/<loss>-seed<N> (config.json,
metrics.jsonl, TensorBoard, checkpoints, eval/; a finished run is not repeated, an interrupted one
resumes), its curves read from metrics.jsonl and its final EM from its last evaluation. With
--task=operators the run is the `tiny` preset with `env.kind=operators` and the task's budgets and
optimiser (ablation/runs.py: OPERATOR_RUN, OPERATOR_TRAIN) before the overrides, in this process;
with --task=workflow it is `python -m workflow_r1.train`. `--dry_run` prints what would run.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

from absl import app, flags

from workflow_r1.ablation.runs import VARIANTS, run_operators, run_workflow

_TASK = flags.DEFINE_enum("task", "operators", ["operators", "workflow"],
                          "operators: the synthetic task on a tiny model (CPU, minutes); workflow: train.py runs")
_LOSSES = flags.DEFINE_list("losses", list(VARIANTS), f"which of {list(VARIANTS)}")
_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds 0..N-1 for every loss")
_STEPS = flags.DEFINE_integer("steps", 0, "training steps (0 = the task's default / the config's)")
_PRESET = flags.DEFINE_string("preset", "tiny", "config preset of the workflow task (tiny, local, paper)")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "config override key=value for every run (repeatable)")
_OUT = flags.DEFINE_string("out", "runs/ablation", "output directory (the PNG, table and JSON)")
_RUNS_DIR = flags.DEFINE_string("runs_dir", "", "the runs' work directories ('' = <out>/runs)")
_NAME = flags.DEFINE_string("name", "ablation", "file stem of the outputs (<name>.png, .md, .json)")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the runs and exit")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    unknown = [n for n in _LOSSES.value if n not in VARIANTS]
    if unknown or _SEEDS.value < 1:
        print(f"error: --losses must name some of {list(VARIANTS)} (got {unknown}) and --seeds must be >= 1",
              file=sys.stderr)
        raise SystemExit(2)
    out = pathlib.Path(_OUT.value)
    runs_dir = pathlib.Path(_RUNS_DIR.value) if _RUNS_DIR.value else out / "runs"
    try:
        if _TASK.value == "operators":
            results = run_operators(_LOSSES.value, _SEEDS.value, _STEPS.value, _OVERRIDE.value, runs_dir,
                                    _DRY_RUN.value)
        else:
            results = run_workflow(_LOSSES.value, _SEEDS.value, _STEPS.value, _PRESET.value, _OVERRIDE.value, runs_dir,
                                   _DRY_RUN.value)
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
    app.run(main)
