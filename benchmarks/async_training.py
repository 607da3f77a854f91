"""Asynchronous training's throughput: step time and trajectories/s at `train.max_staleness` k = 0,
1, 2 on the real 0.5B policy, with a long-tailed executor and with the embedded one.

    .venv/bin/python benchmarks/async_training.py [--staleness 0,1,1p,2] [--executors lognormal,embedded] \
        [--embedded_staleness 0,1] [--steps 5] [--out runs/async_bench]

A value "Kp" is k = K with partial rollouts (train.partial_rollouts: an episode's later turns by
newer versions).

Every run is the trainer itself (`workflow_r1.trainer.Trainer`, configs/gsspo.py:local: the bundled
Qwen2.5-Coder-0.5B-Instruct with LoRA, bf16 rollouts through the fused CPU sampler), one run after
the other in this process, with these overrides so that the runs compare: 2 questions x 4 samples
per step, every step updates (train.filter_groups=False: a step whose groups all agree would skip
its update in one run and not in another), no evaluation (data.eval_holdout=0). The figures are of
steps 2..N (step 1 compiles the programs): their wall time per step and trajectories per second,
the learner's wait for batches, the engine's wait for the executor, and the share of the wall time
with no tool call in flight (the executor idle); each k's ratio is against
k = 0 with the same executor, measured in the same process.

Executors:
  lognormal  the executor service with the fake LLM (instant answers) and every tool call delayed
             by a lognormal draw, median `--median_s` (1 s), p90 4x the median; each call's draw is
             seeded by the call and its count, so every run sees the same delays for the same calls
  embedded   the local preset's own: the bundled 0.5B as the operator LLM in this process,
             competing with the policy's decoding and the update for the same cores

On a CPU the update and the rollout share the cores: overlapping them gains the time the rollout
waits for tool calls (the executor's share), not more. Run it on a quiet machine.
"""
from __future__ import annotations

import json
import math
import pathlib
import random
import shutil
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from absl import app, flags  # noqa: E402

_STALENESS = flags.DEFINE_list("staleness", ["0", "1", "2"], "values of train.max_staleness ('Kp': with "
                                "train.partial_rollouts)")
_EXECUTORS = flags.DEFINE_list("executors", ["lognormal", "embedded"], "lognormal and/or embedded")
_EMBEDDED_STALENESS = flags.DEFINE_list("embedded_staleness", ["0", "1"], "values of k with the embedded executor")
_STEPS = flags.DEFINE_integer("steps", 5, "steps per run (the first is not timed)")
_MEDIAN = flags.DEFINE_float("median_s", 1.0, "median of the lognormal tool-call delay, seconds")
_OUT = flags.DEFINE_string("out", "runs/async_bench", "work directories and results.json")
_QUESTIONS = flags.DEFINE_integer("prompts_per_step", 2, "questions per step (x 4 samples)")

# sigma of a lognormal whose p90 is 4x its median: ln 4 / z_0.9.
_SIGMA = math.log(4.0) / 1.2815515655446004


def _delayed(execute, median_s: float):
    """`execute(calls)` after a lognormal delay seeded by the calls and how often they were made."""
    lock, seen = threading.Lock(), {}

    def run(calls):
        key = repr(list(calls))
        with lock:
            n = seen[key] = seen.get(key, -1) + 1
        out = execute(calls)
        time.sleep(random.Random(f"{key}|{n}").lognormvariate(math.log(median_s), _SIGMA))
        return out

    return run


def _run(label: str, executor: str, workdir: pathlib.Path) -> dict[str, float]:
    from workflow_r1 import configlib, run_config, trainer

    k, partial = int(label.rstrip("p")), label.endswith("p")
    overrides = [f"steps={_STEPS.value}", f"train.max_staleness={k}", f"train.partial_rollouts={partial}",
                 "train.filter_groups=False",
                 f"rollout.prompts_per_step={_QUESTIONS.value}", "data.eval_holdout=0", "eval.at_start=False",
                 "checkpoint.export_hf=False", "log_trajectories=0"]
    if executor == "lognormal":
        overrides.append("executor.llm=fake")
    cfg = configlib.load(f"{ROOT}/configs/gsspo.py:local", overrides)
    shutil.rmtree(workdir, ignore_errors=True)
    t = trainer.Trainer(run_config.Run.from_config(cfg), workdir)
    if executor == "lognormal":
        env = t.engine.environment
        env.execute = _delayed(env.execute, _MEDIAN.value)
    t.train()
    t.finish()
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()][1:]
    wall = sum(r["time/step_s"] for r in rows)
    episodes = sum(r["rollout/episodes"] for r in rows)
    return {"k": label, "executor": executor, "steps": len(rows), "step_s": wall / len(rows),
            "trajectories_per_s": episodes / wall,
            "learner_wait_s": sum(r.get("time/learner_wait_s", r["time/rollout_s"]) for r in rows) / len(rows),
            "update_s": sum(r["time/update_s"] for r in rows) / len(rows),
            "executor_wait_s": sum(r["time/executor_s"] for r in rows) / len(rows),
            "executor_idle": 1 - sum(r["time/executor_busy_s"] for r in rows) / wall,
            "rollout_s": sum(r["time/rollout_s"] for r in rows) / len(rows),
            "staleness": sum(r.get("async/staleness", 0.0) for r in rows) / len(rows),
            "version_wait_s": sum(r["time/version_wait_s"] for r in rows) / len(rows)}


def main(argv):
    del argv
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    # Each run builds its own trainer (its own jitted programs): a persistent compilation cache lets
    # the runs after the first load the programs instead of compiling them again.
    import jax
    jax.config.update("jax_compilation_cache_dir", str(out / "xla-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    results = []
    for executor in _EXECUTORS.value:
        if executor not in ("lognormal", "embedded"):
            raise app.UsageError(f"--executors: {executor!r} unknown; use lognormal and/or embedded")
        for k in (_STALENESS if executor == "lognormal" else _EMBEDDED_STALENESS).value:
            results.append(_run(k, executor, out / f"{executor}-k{k}"))
            print(json.dumps(results[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\n{'executor':<10} {'k':>2} {'step s':>7} {'traj/s':>7} {'vs k=0':>7} {'rollout s':>9} "
          f"{'update s':>8} {'learner wait s':>14} {'engine waits on executor s':>26} {'executor idle':>13} "
          f"{'staleness':>9} {'version wait s':>14}")
    for r in results:
        base = next(b for b in results if b["executor"] == r["executor"] and b["k"] == "0") if any(
            b["executor"] == r["executor"] and b["k"] == "0" for b in results) else r
        print(f"{r['executor']:<10} {r['k']:>2} {r['step_s']:>7.1f} {r['trajectories_per_s']:>7.3f} "
              f"{r['trajectories_per_s'] / base['trajectories_per_s']:>6.2f}x {r['rollout_s']:>9.1f} "
              f"{r['update_s']:>8.1f} {r['learner_wait_s']:>14.1f} {r['executor_wait_s']:>26.1f} "
              f"{r['executor_idle']:>12.0%} {r['staleness']:>9.2f} {r['version_wait_s']:>14.1f}")


if __name__ == "__main__":
    app.run(main)
