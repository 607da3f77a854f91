"""The runs of the loss ablation: which config each loss is, and how a run of each task is made and read.

- operators: `operator_task.train` in this process, with the `train` section of the loss's `tiny`
  config plus OPERATOR_TRAIN and the user's overrides;
- workflow: `python -m workflow_r1.train` in out/runs/<loss>-seed<N> (a finished run, one with
  summary.json, is not repeated; an interrupted one resumes), its curves read from metrics.jsonl
  and its final EM from the last evaluation.

Results have the layout that `ablation.report` reads.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

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


def run_operators(names: list[str], seeds: int, steps: int, overrides: list[str], dry_run: bool = False,
                  task_overrides: dict | None = None) -> dict:
    """Every loss of `names` x seeds 0..seeds-1 on the operator task; `task_overrides` replace
    fields of `operator_task.TaskConfig` (e.g. fewer evaluation questions in tests)."""
    from workflow_r1 import configlib
    from workflow_r1.ablation import operator_task
    from workflow_r1.rl.train_step import TrainConfig

    task = operator_task.TaskConfig(**({"steps": steps} if steps else {}), **(task_overrides or {}))
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
                 out: pathlib.Path, dry_run: bool = False) -> dict:
    """Every loss of `names` x seeds 0..seeds-1 as train.py runs under out/runs/."""
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
