"""The loss ablation: GRPO, GSPO, GSsPO (and GSPO / GSsPO with the tight clip range 3e-4 / 4e-4),
each over several seeds with the same data and budgets; writes a PNG of reward, EM, format rate and
calls against step, a Markdown table of final EM with paired differences to GSsPO, and a JSON of
every number.

    # on a laptop CPU in minutes: the synthetic operator task (workflow_r1/ablation/operator_task.py)
    python -m workflow_r1.ablation --task=operators --seeds=3 --out=docs/ablation
    # the real environment through train.py, one run directory per loss and seed (GPU / TPU)
    python -m workflow_r1.ablation --task=workflow --preset=paper --seeds=3 --out=runs/ablation \\
        --override=model.checkpoint=/models/Qwen2.5-7B-Instruct --override=executor.url=http://executor:8000 \\
        --override=data.train_files=data/train_10k.jsonl --override=data.eval_files=data/test_4k.jsonl

Each loss is its config file (configs/grpo.py, gspo.py, gsspo.py; `tight` is the config variant),
so the ablation changes nothing but the loss. `--override=key=value` (repeatable) applies to every
run, as `--config.key=value` would. With --task=operators the `train` section of the `tiny` preset
is used with the task's optimiser settings (OPERATOR_TRAIN) before the overrides. With
--task=workflow each run is `python -m workflow_r1.train` in out/runs/<loss>-seed<N> (a finished run
is not repeated; an interrupted one resumes) and its curves are read from metrics.jsonl; the final EM
is the run's last evaluation. `--dry_run` prints what would run.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

from absl import app, flags

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
# name -> (config file stem, config variant, label)
VARIANTS = {
    "grpo": ("grpo", "", "GRPO (token)"),
    "gspo": ("gspo", "", "GSPO (sequence)"),
    "gsspo": ("gsspo", "", "GSsPO (sub-sequence)"),
    "gspo-tight": ("gspo", "tight", "GSPO, clip 3e-4/4e-4"),
    "gsspo-tight": ("gsspo", "tight", "GSsPO, clip 3e-4/4e-4"),
}
# The operator task's optimiser: a tiny model learns in tens of steps at this rate; the same for every loss.
OPERATOR_TRAIN = ("train.learning_rate=3e-3", "train.weight_decay=0.0", "train.num_mini_batches=2",
                  "train.micro_batch_size=32", "train.logprob_chunk_size=4", "train.kl_coef=0.0")
# The workflow task's curves: our name -> the trainer's metric.
WORKFLOW_METRICS = {"reward": "rollout/reward", "em": "rollout/em", "format_ok": "rollout/format_ok",
                    "calls": "rollout/calls"}

_TASK = flags.DEFINE_enum("task", "operators", ["operators", "workflow"],
                          "operators: the synthetic task on a tiny model (CPU, minutes); workflow: train.py runs")
_LOSSES = flags.DEFINE_list("losses", list(VARIANTS), f"which of {list(VARIANTS)}")
_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds 0..N-1 for every loss")
_STEPS = flags.DEFINE_integer("steps", 0, "training steps (0 = the task's default / the config's)")
_PRESET = flags.DEFINE_string("preset", "tiny", "config preset of the workflow task (tiny, local, paper)")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "config override key=value for every run (repeatable)")
_OUT = flags.DEFINE_string("out", "runs/ablation", "output directory")
_NAME = flags.DEFINE_string("name", "ablation", "file stem of the outputs (<name>.png, .md, .json)")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the runs and exit")


def spec(name: str, preset: str) -> str:
    stem, variant, _ = VARIANTS[name]
    return f"{CONFIGS_DIR / stem}.py:{preset}" + (f",{variant}" if variant else "")


def train_command(name: str, seed: int, preset: str, steps: int, overrides: list[str],
                  workdir: pathlib.Path) -> list[str]:
    """The `python -m workflow_r1.train` command of one workflow-task run."""
    sets = [f"seed={seed}", *([f"steps={steps}"] if steps else []), *overrides]
    return [sys.executable, "-m", "workflow_r1.train", f"--config={spec(name, preset)}", f"--workdir={workdir}",
            *(f"--config.{s}" for s in sets)]


def read_workflow_run(workdir: pathlib.Path) -> dict:
    """A finished train.py run as {"curve": [...], "final": {...}} (see ablation/report.py)."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [{k: row[m] for k, m in WORKFLOW_METRICS.items()} for row in rows if WORKFLOW_METRICS["reward"] in row]
    evals = [row for row in rows if "eval/em" in row]
    if not curve or not evals:
        raise ValueError(f"{workdir / 'metrics.jsonl'} has no training steps or no evaluation; "
                         "the run did not finish (run the ablation again to resume it)")
    last = evals[-1]
    final = {"em": last["eval/em"], "em_stderr": last.get("eval/em_stderr", 0.0), "episodes": last.get("eval/episodes")}
    return {"curve": curve, "final": final}


def run_operators(names: list[str], seeds: int, steps: int, overrides: list[str], dry_run: bool) -> dict:
    from workflow_r1 import configlib
    from workflow_r1.ablation import operator_task
    from workflow_r1.rl.train_step import TrainConfig

    task = operator_task.TaskConfig(**({"steps": steps} if steps else {}))
    results = {"task": "operators", "title": "operator task, tiny model", "reference": "gsspo",
               "task_config": vars(task), "overrides": [*OPERATOR_TRAIN, *overrides], "variants": {}}
    for name in names:
        cfg = configlib.load(spec(name, "tiny"), [*OPERATOR_TRAIN, *overrides])
        train_cfg = configlib.to_dataclass(TrainConfig, cfg.train, "train")
        v = results["variants"][name] = {"label": VARIANTS[name][2], "train": vars(train_cfg), "seeds": {}}
        for seed in range(seeds):
            if dry_run:
                print(f"{name} seed {seed}: {task.steps} steps, granularity {train_cfg.granularity}, clip "
                      f"{train_cfg.clip_eps_low}/{train_cfg.clip_eps_high}, lr {train_cfg.learning_rate}")
                continue
            t0 = time.perf_counter()
            curve, final = operator_task.train(train_cfg, seed, task)
            v["seeds"][str(seed)] = {"curve": curve, "final": final, "seconds": time.perf_counter() - t0}
            print(f"{name} seed {seed}: reward {curve[0]['reward']:+.3f} -> {curve[-1]['reward']:+.3f}, final greedy "
                  f"EM {final['em']:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return results


def run_workflow(names: list[str], seeds: int, steps: int, preset: str, overrides: list[str],
                 out: pathlib.Path, dry_run: bool) -> dict:
    results = {"task": "workflow", "title": f"workflow environment, preset {preset}", "reference": "gsspo",
               "overrides": overrides, "variants": {}}
    for name in names:
        v = results["variants"][name] = {"label": VARIANTS[name][2], "seeds": {}}
        for seed in range(seeds):
            workdir = out / "runs" / f"{name}-seed{seed}"
            cmd = train_command(name, seed, preset, steps, overrides, workdir)
            if dry_run:
                print(" ".join(cmd))
                continue
            if not (workdir / "summary.json").is_file():
                subprocess.run(cmd, check=True)
            v["seeds"][str(seed)] = read_workflow_run(workdir)
    return results


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    unknown = [n for n in _LOSSES.value if n not in VARIANTS]
    if unknown or _SEEDS.value < 1:
        print(f"error: --losses must name some of {list(VARIANTS)} (got {unknown}) and --seeds must be >= 1",
              file=sys.stderr)
        raise SystemExit(2)
    out = pathlib.Path(_OUT.value)
    try:
        if _TASK.value == "operators":
            results = run_operators(_LOSSES.value, _SEEDS.value, _STEPS.value, _OVERRIDE.value, _DRY_RUN.value)
        else:
            results = run_workflow(_LOSSES.value, _SEEDS.value, _STEPS.value, _PRESET.value, _OVERRIDE.value, out,
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
