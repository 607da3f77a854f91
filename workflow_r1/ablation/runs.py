"""The runs of the loss ablation: which config each loss is, and how a run of each task is made and read.

Every run is a trainer run (`trainer.Trainer`, what `python -m workflow_r1.train` runs) in
out/runs/<loss>-seed<N>, with its config.json, metrics.jsonl, TensorBoard, checkpoints and final
evaluation; its curves are read from metrics.jsonl and its final EM from the last evaluation. A
finished run (one with summary.json) is not repeated; an interrupted one resumes.

- operators: the `operators` preset of the loss's config (the synthetic task of envs/operators.py,
  its budgets and optimiser: configs/base.py), OPERATOR_DIAGNOSTICS, then the user's overrides; in
  this process (the runs of one loss share nothing but the code);
- workflow: `python -m workflow_r1.train` with the chosen preset and the user's overrides, run as a
  `workflow_r1.sweep` (the runner of launch/sweep.py's grids too).

Results have the layout that `ablation.report` reads.
"""
from __future__ import annotations

import json
import pathlib
import shlex
import time

from workflow_r1 import metrics, sweep
from workflow_r1.eval import compare

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
# name -> (config file stem, config variant, label)
VARIANTS = {
    "grpo": ("grpo", "", "GRPO (token)"),
    "gspo": ("gspo", "", "GSPO (sequence)"),
    "gsspo": ("gsspo", "", "GSsPO (sub-sequence)"),
    "gspo-tight": ("gspo", "tight", "GSPO, clip 3e-4/4e-4"),
    "gsspo-tight": ("gsspo", "tight", "GSsPO, clip 3e-4/4e-4"),
}
# The operator task's runs: the `operators` preset of each loss's config (configs/base.py).
OPERATOR_PRESET = "operators"
# The ablation's runs also compare the three losses' gradients of the same batch every 4 steps
# (docs/design.md, Gradient diagnostics); the user's overrides come after, so they can change it.
OPERATOR_DIAGNOSTICS = ("train.grad_diagnostics_every=4",)
# The runs' curves: our name -> the trainer's metric.
WORKFLOW_METRICS = {"reward": "rollout/reward", "em": "rollout/em", "format_ok": "rollout/format_ok",
                    "calls": "rollout/calls"}


def spec(name: str, preset: str) -> str:
    stem, variant, _ = VARIANTS[name]
    return f"{CONFIGS_DIR / stem}.py:{preset}" + (f",{variant}" if variant else "")


def workflow_runs(names: list[str], seeds: int, steps: int, preset: str, overrides: list[str],
                  runs_dir: pathlib.Path, first_seed: int = 0) -> list[sweep.Run]:
    """The workflow task's trainer runs, loss-major: `spec(loss, preset)` with `seed=N` (and `steps`
    unless 0) before the user's overrides, in runs_dir/<loss>-seed<N>, N = first_seed ... first_seed
    + seeds - 1."""
    return [sweep.Run(spec(name, preset), (f"seed={seed}", *([f"steps={steps}"] if steps else []), *overrides),
                      pathlib.Path(runs_dir) / f"{name}-seed{seed}", {"loss": name, "seed": str(seed)})
            for name in names for seed in range(first_seed, first_seed + seeds)]


def operator_overrides(seed: int, steps: int, overrides: list[str]) -> list[str]:
    """The config overrides of one operator-task run of the `operators` preset (the model's
    initialisation is the seed's too)."""
    return [f"seed={seed}", f"model.seed={seed}", *([f"steps={steps}"] if steps else []), *overrides]


def train_in_process(config: str, overrides: list[str], workdir: pathlib.Path) -> dict:
    """One trainer run as train.py makes it (config -> Run -> Trainer -> train -> finish), with
    summary.json written last; returns the summary."""
    from workflow_r1 import configlib, run_config, trainer

    t0 = time.perf_counter()
    t = trainer.Trainer(run_config.Run.from_config(configlib.load(config, overrides)), workdir)
    last = t.train()
    if t.preempted:  # SIGTERM: saved; no summary.json, so rerunning the ablation resumes this run
        t.close()
        print(t.preempted, flush=True)
        raise SystemExit(0)
    t.finish()
    summary = {"steps": t.total_steps, "workdir": str(workdir), "seconds": time.perf_counter() - t0,
               **{k: v for k, v in last.items() if k.startswith(("eval/", "rollout/reward", "rollout/em"))}}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


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
    # Each held-out question's EM (0 or 1) in the first and the last evaluation, so losses and the
    # before/after change can be compared question by question (paired), not only seed by seed.
    for key, row in (("before", evals[0]), ("after", last)):
        step = int(row.get("step", 0))
        if len(evals) > 1 and metrics.step_file(workdir / "eval", step).exists():
            final[key] = {q["id"]: compare.exact_match(q) for q in metrics.read_step_rows(workdir / "eval", step)}
    # Same-batch gradient diagnostics, on the steps `train.grad_diagnostics_every` selected (if any).
    diags = ({k[len("diag/"):]: v for k, v in row.items() if k.startswith("diag/")} for row in rows)
    diagnostics = [{"step": row["step"], **d} for row, d in zip(rows, diags) if d]
    return {"curve": curve, "final": final, **({"diagnostics": diagnostics} if diagnostics else {})}


def run_operators(names: list[str], seeds: int, steps: int, overrides: list[str], runs_dir: pathlib.Path,
                  dry_run: bool = False) -> dict:
    """Every loss of `names` x seeds 0..seeds-1 on the operator task, as trainer runs in runs_dir/<loss>-seed<N>."""
    from workflow_r1 import configlib
    from workflow_r1.rl.train_state import TrainConfig

    overrides = [*OPERATOR_DIAGNOSTICS, *overrides]
    results = {"task": "operators", "title": "operator task, tiny model", "reference": "gsspo",
               "preset": OPERATOR_PRESET, "overrides": [*([f"steps={steps}"] if steps else []), *overrides],
               "variants": {}}
    for name in names:
        cfg = configlib.load(spec(name, OPERATOR_PRESET), operator_overrides(0, steps, overrides))
        train_cfg = configlib.to_dataclass(TrainConfig, cfg.train, "train")
        v = results["variants"][name] = {"label": VARIANTS[name][2], "train": vars(train_cfg), "seeds": {}}
        for seed in range(seeds):
            workdir = pathlib.Path(runs_dir) / f"{name}-seed{seed}"
            if dry_run:
                print(f"{name} seed {seed}: {cfg.steps} steps, granularity {train_cfg.granularity}, clip "
                      f"{train_cfg.clip_eps_low}/{train_cfg.clip_eps_high}, lr {train_cfg.learning_rate} -> {workdir}")
                continue
            t0 = time.perf_counter()
            if not (workdir / "summary.json").is_file():
                train_in_process(spec(name, OPERATOR_PRESET), operator_overrides(seed, steps, overrides), workdir)
            run = v["seeds"][str(seed)] = read_workflow_run(workdir)
            print(f"{name} seed {seed}: reward {run['curve'][0]['reward']:+.3f} -> {run['curve'][-1]['reward']:+.3f}, "
                  f"final greedy EM {run['final']['em']:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return results


def run_workflow(names: list[str], seeds: int, steps: int, preset: str, overrides: list[str],
                 runs_dir: pathlib.Path, dry_run: bool = False, first_seed: int = 0) -> dict:
    """Every loss of `names` x seeds 0..seeds-1 as train.py runs in runs_dir/<loss>-seed<N> (a
    `workflow_r1.sweep`: checked first, finished runs skipped, stopping at the first failure)."""
    results = {"task": "workflow", "title": f"workflow environment, preset {preset}", "reference": "gsspo",
               "overrides": overrides, "variants": {}}
    runs = workflow_runs(names, seeds, steps, preset, overrides, runs_dir, first_seed)
    sweep.check(runs)  # a wrong key or value: one line, before any run
    commands = [r.command() for r in runs]
    if dry_run:
        for c in commands:
            print(shlex.join(c))
        return results
    sweep.run(runs, commands, keep_going=False)
    for r in runs:
        v = results["variants"].setdefault(r.point["loss"], {"label": VARIANTS[r.point["loss"]][2], "seeds": {}})
        v["seeds"][r.point["seed"]] = read_workflow_run(r.workdir)
    return results
