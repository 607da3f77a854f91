"""Evaluation throughput: greedy evaluation (python -m workflow_r1.evaluate's code path) in questions/s.

    .venv/bin/python benchmarks/eval.py [--batches 8,32] [--methods workflow,direct]
    .venv/bin/python benchmarks/eval.py --config=configs/gsspo.py:tiny --batches=2   # smoke run

For each batch size B and method: B bundled questions evaluated greedily as one batch, with the
`--config` preset's policy, rollout budgets and executor (default `local`: the bundled
Qwen2.5-Coder-0.5B-Instruct with bf16 rollouts, and the embedded executor running the same model
as the operator LLM in-process, Search over the bundled corpus). Each (batch, method) is first
warmed up on B other questions, so no compilation is timed. Reports questions/s, generated tokens/s,
the EM, the turns and calls per question and the share of wall time spent waiting for the executor.

The peer in the same run is the Direct baseline (one answer, no operators) on the same questions
and policy: the workflow's cost over answering straight away.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from absl import app, flags  # noqa: E402

from workflow_r1.host_memory import peak_rss_gb  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/gsspo.py:local", "config file and preset (as for training)")
_OVERRIDES = flags.DEFINE_multi_string("override", [], "config override key=value (repeatable)")
_BATCHES = flags.DEFINE_list("batches", ["8", "32"], "evaluation batch sizes (questions)")
_METHODS = flags.DEFINE_list("methods", ["workflow", "direct"], "workflow and/or direct, cot")


def main(argv: list[str]) -> None:
    del argv
    import jax

    from workflow_r1 import configlib, run_config
    from workflow_r1.data.questions import bundled_questions
    from workflow_r1.eval import baselines, evaluate, policy_source
    from workflow_r1.executor.connect import connect
    from workflow_r1.envs.workflow import WorkflowEnvironment
    from workflow_r1.rollout import RolloutEngine
    from workflow_r1.sampler import Sampler

    run = run_config.Run.from_config(configlib.load(str(REPO / _CONFIG.value), _OVERRIDES.value))
    print(f"jax {jax.__version__}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, config {_CONFIG.value}",
          flush=True)
    model, tokenizer, what = policy_source.load("", run.model)
    sampler = Sampler(model, tokenizer, cache_size=run.rollout.cache_size, dtype=run.rollout.sampler_dtype or None,
                      weights_dtype=run.rollout.weights_dtype or None)
    questions = bundled_questions()
    batches = [int(b) for b in _BATCHES.value]
    if 2 * max(batches) > len(questions):
        raise app.UsageError(f"batch {max(batches)} needs {2 * max(batches)} questions (timed + warm-up); "
                             f"{len(questions)} are bundled")
    rows = []
    with connect(run.executor) as ex:
        calls_s = [0.0]

        def execute(calls):  # the executor's wall time as the engine sees it
            t0 = time.perf_counter()
            out = ex.client.execute_many_sync(calls)
            calls_s[0] += time.perf_counter() - t0
            return out

        for method in _METHODS.value:
            engine = (RolloutEngine(sampler, run.rollout, WorkflowEnvironment.of(tokenizer, execute, run.env, run.rollout))
                      if method == "workflow"
                      else baselines.baseline_engine(method, sampler, tokenizer, run.rollout))
            for b in batches:
                evaluate(engine, questions[-b:], batch_size=b)  # warm-up: compiles this row count
                calls_s[0] = 0.0
                result = evaluate(engine, questions[:b], batch_size=b)
                m = result.metrics["all"]
                row = {"method": method, "batch": b, "seconds": result.seconds,
                       "questions_per_s": b / result.seconds,
                       "gen_tok_per_s": m["generated_tokens"] * b / result.seconds, "em": m["em"],
                       "turns": m["turns"], "calls": m["calls"], "exec_share": calls_s[0] / result.seconds,
                       "peak_rss_gb": peak_rss_gb(),
                       "load": os.getloadavg()[0]}
                rows.append(row)
                print(row, flush=True)
    print(f"\npolicy: {what}; executor: {run.executor.url or 'embedded ' + run.executor.llm}")
    print("\n| method | batch | questions/s | generated tok/s | EM | turns | calls | executor wait | "
          "peak RSS (GB) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['batch']} | {r['questions_per_s']:.3f} | {r['gen_tok_per_s']:.1f} | "
              f"{r['em']:.3f} | {r['turns']:.2f} | {r['calls']:.2f} | {r['exec_share']:.0%} | "
              f"{r['peak_rss_gb']:.1f} | {r['load']:.2f} |")


if __name__ == "__main__":
    app.run(main)
