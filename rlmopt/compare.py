"""`python -m rlmopt.compare`: every method across seeds on one task, as a Markdown table.

    python -m rlmopt.compare --task=operator_env --methods=rlmopt,gepa,baseline --seeds=3 \
        --budget=40 --task_lm=simulated --optimizer_lm=scripted --out=docs/rlmopt_compare.md

Seed i runs with split seed `--first_seed + i` (default 7, 8, 9); every method of one seed sees
the same train/validation/test split and the same task LM, and is scored by the same final stage
(`selection.finalize`) and written by the same `record.json` writer (`rlmopt.pipeline.optimise`), in
`--run_root/<method>/<task>/seed<N>`. An existing run directory is resumed, not repeated.
Harness and agent settings are `--config.KEY=VALUE` overrides of RLMOptConfig, as in rlmopt.run
(e.g. `--config.optimizer_max_iterations=6` for a slow local optimizer LM); `--budget` and
`--gepa_budget` set theirs. The table names every setting that differs from the defaults.

The table (the head-to-head of docs/rlmopt.md, Compare): per method, the test composite averaged
over seeds; its paired difference to the baseline (the seed prompt) with the paired standard error
over all (seed, test example) pairs; validation; rollouts (search task-LM calls); LM calls (all
roles; for the operator task the executor-LLM calls behind each workflow instead of one per
workflow); tokens (estimated where a backend does not report them); the estimated cost (`--prices`,
rlmopt/cost.py); wall clock; then calls, tokens and cost per method and role. Then
rlmopt - gepa paired, and one row per seed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from absl import app, flags

from rlmopt import cost, gates
from rlmopt.config import RLMOptConfig, define_config_flag
from rlmopt.pipeline import (METHODS, build_optimizer_lm, build_task_lm, load_task, method_config,
                             optimise)
from rlmopt.sandbox.layers import SandboxRefused
from rlmopt.task import Task
from workflow_r1 import configlib
from workflow_r1.assets.registry import AssetError

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The flags of `python -m rlmopt.compare` (defined only when it runs, so importing this module
    next to rlmopt.run, which has flags of the same names, is fine)."""
    flags.DEFINE_string("task", "operator_env",
                        "intent_code | operator_env[:QUESTIONS] | policy_prompt[:QUESTIONS] | jsonl:SPEC.json")
    flags.DEFINE_list("methods", ["rlmopt", "gepa", "baseline"], f"any of {METHODS}")
    flags.DEFINE_integer("seeds", 3, "number of split seeds")
    flags.DEFINE_integer("first_seed", 7, "the first split seed")
    flags.DEFINE_integer("budget", 40, "rlmopt's rollout budget (GEPA's, matched, is budget + |val|)")
    flags.DEFINE_enum("gepa_budget", "matched", ["matched", "light"], "GEPA's metric-call limit")
    flags.DEFINE_integer("questions", 60, "operator_env, policy_prompt: use the first N questions")
    flags.DEFINE_string("task_lm", "simulated", "task LM spec (rlmopt.run)")
    flags.DEFINE_string("optimizer_lm", "scripted", "optimizer / reflection LM spec (rlmopt.run)")
    flags.DEFINE_string("task_model", "default", "model name sent to an openai task LM")
    flags.DEFINE_string("optimizer_model", "default", "model name sent to an openai optimizer LM")
    flags.DEFINE_string("api_key_env", "OPENAI_API_KEY", "environment variable holding the API key")
    flags.DEFINE_string("run_root", "runs/rlmopt/compare", "where the run directories go")
    flags.DEFINE_string("out", "", "also write the Markdown table to this file")
    flags.DEFINE_string("prices", "", "price table (JSON, USD per million tokens per role; "
                        "rlmopt/cost.py) for the cost column; '' = no estimate")
    flags.DEFINE_integer("executor_max_tokens", None,
                         "operator_env, policy_prompt: the in-process executor's generation limit "
                         "per LLM attempt (tokens; default: the executor's, 1024)")


async def run_all(task: Task, methods: Sequence[str], seeds: Sequence[int], base: RLMOptConfig, *,
                  task_lm: str, optimizer_lm: str, run_root: Path,
                  build: Callable, log=print, prices: dict | None = None) -> dict[str, list[dict]]:
    """The records of every method at every seed: {method: [record per seed]}. `build(method)`
    returns (task LM, optimizer LM) for one run (fresh objects: a run closes its LMs); `prices`:
    a checked price table for each record's cost estimate."""
    out: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in seeds:
        for method in methods:
            config = method_config(dataclasses.replace(base, seed=seed), method)
            t_lm, o_lm = build(method)
            log(f"== {method}, seed {seed}")
            rec = await optimise(task, config, method=method, task_lm=t_lm, optimizer_lm=o_lm,
                                 sub_lm=None, judge_lm=None,
                                 run_dir=run_root / method / task.name / f"seed{seed}",
                                 names={"task": task_lm, "optimizer": optimizer_lm}, log=log,
                                 prices=prices)
            out[method].append(rec)
    return out


def lm_calls(rec: dict) -> int:
    """All LM calls of a run; executor-LLM calls replace the task role's workflow count."""
    extra = rec["extra"]
    if "executor_llm_calls" in extra:
        return extra["api_calls"] - extra["calls_by_role"].get("task", 0) + \
            extra["executor_llm_calls"]
    return extra["api_calls"]


def _paired(new: list[dict], old: list[dict]) -> tuple[float, float]:
    """Mean paired test difference and its SE over all (seed, example) pairs."""
    a, b = [], []
    for rn, ro in zip(new, old):
        ids = sorted(rn["per_example_test"])
        a += [rn["per_example_test"][i] for i in ids]
        b += [ro["per_example_test"][i] for i in ids]
    return gates.paired_stats(a, b)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _cost_cell(recs: list[dict]) -> str:
    """The mean estimated cost over seeds, or "-" when any run has none (no or a partial table)."""
    costs = [r.get("cost_usd_estimate") for r in recs]
    return "-" if any(c is None for c in costs) else cost.usd(_mean(costs))


def _role_means(recs: list[dict]) -> dict[str, dict]:
    """Per role, the mean over seeds of calls, tokens and cost (cost None if any seed lacks it);
    a role absent from a seed's run counts as 0 there."""
    roles = sorted({role for r in recs for role in r["extra"].get("by_role", {})})
    out = {}
    for role in roles:
        rows = [r["extra"].get("by_role", {}).get(role) for r in recs]
        mean = {k: _mean([(row or {}).get(k, 0) for row in rows])
                for k in ("calls", "prompt_tokens", "cached_tokens", "completion_tokens")}
        usd = [row["cost_usd"] if row else 0.0 for row in rows]
        mean["cost_usd"] = None if any(c is None for c in usd) else _mean(usd)
        out[role] = mean
    return out


def table(records: dict[str, list[dict]], title: str, settings: str = "") -> str:
    """The comparison as Markdown (see the module docstring); `settings`, if any, is printed under
    the title."""
    methods = list(records)
    first = next(iter(records.values()))
    n_test = len(first[0]["per_example_test"])
    lines = [f"## {title}", "",
             f"{len(first)} seed(s) ({', '.join(str(r['seed']) for r in first)}), {n_test} test "
             f"examples each; task LM `{first[0]['task_lm']}`. Means over seeds; ± is the paired "
             "standard error over all (seed, test example) pairs." +
             (f" Settings: {settings}." if settings else ""), "",
             "| method | test | Δ test vs baseline | validation | rollouts | LM calls | tokens "
             "| cost (USD) | wall clock (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        recs = records[m]
        delta = "-"
        if "baseline" in records and m != "baseline":
            d, se = _paired(recs, records["baseline"])
            delta = f"{d:+.3f} ± {se:.3f}"
        lines.append(
            f"| {m} | {_mean([r['test_score'] for r in recs]):.3f} | {delta} | "
            f"{_mean([r['val_score'] for r in recs]):.3f} | "
            f"{_mean([r['rollouts_used'] for r in recs]):.0f} | {_mean([lm_calls(r) for r in recs]):.0f} | "
            f"{_mean([r['extra']['total_tokens'] for r in recs]):.0f} | {_cost_cell(recs)} | "
            f"{_mean([r['wall_clock_s'] for r in recs]):.1f} |")
    lines += ["", "LM calls and tokens per role (means over seeds; prompt tokens, of them cached, "
              "completion tokens; estimated where a backend does not report them):", "",
              "| method | role | LM calls | prompt tokens | cached | completion tokens | cost (USD) |",
              "|---|---|---|---|---|---|---|"]
    for m in methods:
        for role, row in _role_means(records[m]).items():
            usd = cost.usd(row["cost_usd"])
            lines.append(f"| {m} | {role} | {row['calls']:.0f} | {row['prompt_tokens']:.0f} | "
                         f"{row['cached_tokens']:.0f} | {row['completion_tokens']:.0f} | {usd} |")
    if "rlmopt" in records and "gepa" in records:
        d, se = _paired(records["rlmopt"], records["gepa"])
        lines += ["", f"rlmopt − gepa on test: {d:+.3f} ± {se:.3f} (paired SE)."]
    if "gepa" in records:
        g = records["gepa"][0]["extra"]["gepa"]
        lines += ["", f"GEPA budget: {g['budget_mode']}, max_metric_calls {g['max_metric_calls']} "
                  f"(its native auto=light budget here: {g['native_light_metric_calls']}); metric "
                  f"calls used per seed: {[r['extra']['gepa']['metric_calls'] for r in records['gepa']]}."]
    lines += ["", "| seed | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for k, r0 in enumerate(first):
        cells = [f"{records[m][k]['test_score']:.3f}" for m in methods]
        lines.append(f"| {r0['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def settings_line(config: RLMOptConfig, executor_max_tokens: int | None) -> str:
    """The settings of a comparison that differ from the defaults (budget and seed excluded: the
    table shows them), e.g. "optimizer_max_iterations=6, executor max_tokens=256"."""
    default = RLMOptConfig()
    parts = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(RLMOptConfig)
             if f.name not in ("budget", "seed")
             and getattr(config, f.name) != getattr(default, f.name)]
    if executor_max_tokens is not None:
        parts.append(f"executor max_tokens={executor_max_tokens}")
    return ", ".join(parts)


def main(argv: list[str]) -> None:
    del argv
    key = os.environ.get(FLAGS.api_key_env, "")

    def build(method: str):
        return (build_task_lm(task, FLAGS.task_lm, model=FLAGS.task_model, api_key=key,
                              executor_max_tokens=FLAGS.executor_max_tokens),
                build_optimizer_lm(task, FLAGS.optimizer_lm, method, model=FLAGS.optimizer_model,
                                   api_key=key))

    try:  # bad flag values end in one line naming them and the fix
        unknown = [m for m in FLAGS.methods if m not in METHODS]
        if unknown or not FLAGS.methods:
            raise ValueError(f"--methods {FLAGS.methods}: use some of {METHODS}")
        prices = cost.load_prices(FLAGS.prices) if FLAGS.prices else None
        task = load_task(FLAGS.task, FLAGS.questions)
        for method in FLAGS.methods:  # cheap: no optimizer spec starts anything
            build_optimizer_lm(task, FLAGS.optimizer_lm, method, model=FLAGS.optimizer_model,
                               api_key=key)
        base = dataclasses.replace(configlib.to_dataclass(RLMOptConfig, FLAGS.config, "config"),
                                   budget=FLAGS.budget, gepa_budget=FLAGS.gepa_budget)
        seeds = [FLAGS.first_seed + i for i in range(FLAGS.seeds)]
        records = asyncio.run(run_all(task, FLAGS.methods, seeds, base, task_lm=FLAGS.task_lm,
                                      optimizer_lm=FLAGS.optimizer_lm,
                                      run_root=Path(FLAGS.run_root), build=build,
                                      prices=prices))
    except (ValueError, SandboxRefused, AssetError) as exc:
        raise SystemExit(f"rlmopt.compare: {exc}") from None
    md = table(records, f"{task.name}: {', '.join(FLAGS.methods)} (budget {FLAGS.budget})",
               settings_line(base, FLAGS.executor_max_tokens))
    print(md)
    if FLAGS.out:
        Path(FLAGS.out).write_text(md)


if __name__ == "__main__":
    define_flags()
    define_config_flag(sys.argv[1:])
    app.run(main, flags_parser=configlib.parse_flags)
