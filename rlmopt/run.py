"""`python -m rlmopt.run`: optimise a task's prompt and write record.json + summary.md.

Harness, agent and sandbox settings are `--config.KEY=VALUE` overrides of every field of
RLMOptConfig (e.g. `--config.field_floor=0.1`); `--budget` and `--seed` override theirs.

    python -m rlmopt.run --task=intent_code --method=rlmopt --budget=60 \
        --optimizer_lm=openai:https://HOST/v1 --optimizer_model=MODEL --task_lm=local
    python -m rlmopt.run --task=jsonl:my_task.json --method=baseline --task_lm=local
    python -m rlmopt.run --task=operator_env --method=gepa --task_lm=simulated --optimizer_lm=scripted
    python -m rlmopt.run --task=policy_prompt --task_lm=local --executor_lm=local --prompt_set=concise
    python -m rlmopt.run --task=bfcl_multi_turn:base,docs=compact,n=8 --method=baseline --task_lm=local

LM specs: `fake` | `openai:URL` | `local` (the bundled 0.5B) | `local:CHECKPOINT_DIR`, and
`simulated` (a deterministic stand-in task LM of the intent-code and operator tasks). For the
operator task the task LM is the executor LLM behind an in-process executor (or --executor_url),
and `--optimizer_lm=scripted` is a fixed stand-in optimizer (rlmopt/tasks/operator_sim.py). For
the policy-prompt task the task LM is the policy (`scripted`, `local`, `local:HF_DIR`) rolled out
by the rollout engine, and `--executor_lm` the executor LLM (rlmopt/tasks/policy_sim.py). For
BFCL multi-turn the task LM is the assistant of each episode in the benchmark's environments, and
`simulated` / `scripted` are its stand-ins (rlmopt/tasks/bfcl_multi_turn.py). The
method `gepa` runs the GEPA baseline (rlmopt/baselines/gepa_adapter.py). The run directory
(--run_dir, default runs/rlmopt/<method>/<task>/seed<N>) resumes a crashed run: cached task-LM
replies are reused, the harness state and the agent's conversation are reloaded.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import Path

from absl import app, flags
from rlmopt import cost
from rlmopt.config import RLMOptConfig, define_config_flag
from rlmopt.library import SkillLibrary
from rlmopt.lm import build_lm
from rlmopt.pipeline import (METHODS, PolicyRollout, build_optimizer_lm, build_task_lm, load_task,
                             method_config, optimise)
from rlmopt.sandbox.layers import SandboxRefused
from workflow_r1 import configlib
from workflow_r1.assets.registry import AssetError

__all__ = ["optimise", "load_task", "main"]  # optimise and load_task re-exported for callers

FLAGS = flags.FLAGS
flags.DEFINE_string("task", "intent_code", "intent_code | operator_env[:QUESTIONS] | "
                    "policy_prompt[:QUESTIONS] | multihop_qa[:FILE] | tool_calls[:FILE] | "
                    "bfcl_multi_turn[:SPLIT][,docs=json|compact][,steps=N][,n=N] | jsonl:SPEC.json "
                    "(QUESTIONS: bundled, or a Search-R1/FlashRAG .jsonl/.parquet file; "
                    "bfcl_multi_turn: rlmopt/tasks/bfcl_multi_turn.py)")
flags.DEFINE_enum("method", "rlmopt", METHODS,
                  "rlmopt: the agent searches; gepa: the GEPA baseline; baseline: the seed prompt only")
flags.DEFINE_bool("step_judge", False, "tool_calls: add the step_judge field, each turn rated by "
                  "--judge_lm")
flags.DEFINE_integer("questions", 60, "operator_env, policy_prompt: use the first N questions")
flags.DEFINE_string("prompt_set", "faithful", "operator_env, policy_prompt: the base prompt set "
                    "(faithful, concise or a directory); the seed candidate is its text")
flags.DEFINE_string("executor_url", "", "operator_env, policy_prompt: a running executor (default: "
                    "one in-process)")
flags.DEFINE_string("executor_lm", "", "policy_prompt: the in-process executor's LLM, simulated | "
                    "fake | local[:DIR] | openai:URL ('' = simulated for --task_lm=scripted, else local)")
flags.DEFINE_integer("max_prompt_tokens", 4096, "policy_prompt: longer opening prompts score 0")
flags.DEFINE_integer("max_response_tokens", 2048, "policy_prompt: an episode's response budget "
                     "(tokens, observations included)")
flags.DEFINE_integer("max_turn_tokens", 512, "policy_prompt: one assistant turn's cap (tokens)")
flags.DEFINE_integer("executor_max_tokens", None, "operator_env, policy_prompt: the in-process "
                     "executor's generation limit per LLM attempt (tokens; default: the executor's, 1024)")
flags.DEFINE_integer("max_calls", 20, "policy_prompt: operator-call limit ({max_calls} of policy.txt)")
flags.DEFINE_integer("budget", None, "rollouts (task-LM calls on validation examples) the agent "
                     "may spend (default: config.budget, 30)")
flags.DEFINE_integer("seed", None, "split and subsample seed (default: config.seed, 7)")
flags.DEFINE_enum("sandbox", None, ["strict", "best_effort"], "the agent REPL's sandbox: strict "
                  "refuses to run agent code when a layer promised on this host is missing, "
                  "best_effort runs with what holds (default: config.sandbox, strict; "
                  "docs/rlmopt.md, Sandbox)")
flags.DEFINE_string("task_lm", "local", "task LM spec: fake | openai:URL | local[:DIR] | simulated")
flags.DEFINE_string("optimizer_lm", "local", "optimizer LM spec: fake | openai:URL | local[:DIR]")
flags.DEFINE_string("sub_lm", "", "sub-LM for the synthesis tools and polish rewrite; "
                    "'' = the optimizer LM, 'none' = off (also turns the diagnose gate off)")
flags.DEFINE_string("judge_lm", "none", "LM for judge rationales on mismatches, or none")
flags.DEFINE_string("task_model", "default", "model name sent to an openai task LM")
flags.DEFINE_string("optimizer_model", "default", "model name sent to an openai optimizer/sub/judge LM")
flags.DEFINE_string("api_key_env", "OPENAI_API_KEY", "environment variable holding the API key")
flags.DEFINE_string("prices", "", "price table (JSON, USD per million tokens per role; "
                    "rlmopt/cost.py) for record.json's cost estimate; '' = no estimate")
flags.DEFINE_string("skill_library", "", "a directory: the agent reads what earlier runs learned "
                    "there (skill_library tool) and this run adds its own; '' = off")
flags.DEFINE_string("run_dir", "", "run directory (default runs/rlmopt/<method>/<task>/seed<N>)")


def _lm(spec: str, model: str):
    if spec == "none":
        return None
    return build_lm(spec, api_key=os.environ.get(FLAGS.api_key_env, ""), model=model)


def main(argv: list[str]) -> None:
    del argv
    try:  # bad flag values end in one line naming them and the fix
        prices = cost.load_prices(FLAGS.prices) if FLAGS.prices else None
        library = SkillLibrary(FLAGS.skill_library) if FLAGS.skill_library else None
        task = load_task(FLAGS.task, FLAGS.questions, prompt_set=FLAGS.prompt_set,
                         step_judge=FLAGS.step_judge)
        judge_lm = _lm(FLAGS.judge_lm, FLAGS.optimizer_model)
        config = configlib.to_dataclass(RLMOptConfig, FLAGS.config, "config")
        changes = {"budget": FLAGS.budget, "seed": FLAGS.seed, "sandbox": FLAGS.sandbox}
        config = method_config(dataclasses.replace(
            config, **{k: v for k, v in changes.items() if v is not None}), FLAGS.method)
        key = os.environ.get(FLAGS.api_key_env, "")
        task_lm = build_task_lm(task, FLAGS.task_lm, model=FLAGS.task_model, api_key=key,
                                executor_url=FLAGS.executor_url, policy_rollout=PolicyRollout(
                                    FLAGS.executor_lm, FLAGS.max_prompt_tokens,
                                    FLAGS.max_response_tokens, FLAGS.max_turn_tokens,
                                    FLAGS.max_calls),
                                executor_max_tokens=FLAGS.executor_max_tokens, judge_lm=judge_lm)
        rlm = FLAGS.method == "rlmopt"
        optimizer_lm = build_optimizer_lm(task, FLAGS.optimizer_lm, FLAGS.method,
                                          model=FLAGS.optimizer_model, api_key=key)
        sub_default = FLAGS.optimizer_lm if rlm and FLAGS.optimizer_lm != "scripted" else "none"
        sub_lm = _lm(FLAGS.sub_lm or sub_default, FLAGS.optimizer_model)
    except (ValueError, AssetError) as exc:  # AssetError: the BFCL wheel could not be fetched or unpacked
        raise SystemExit(f"rlmopt.run: {exc}") from None
    run_dir = Path(FLAGS.run_dir or f"runs/rlmopt/{FLAGS.method}/{task.name}/seed{config.seed}")
    try:
        asyncio.run(optimise(task, config, method=FLAGS.method, task_lm=task_lm,
                             optimizer_lm=optimizer_lm, sub_lm=sub_lm, judge_lm=judge_lm,
                             run_dir=run_dir, names={"task": FLAGS.task_lm,
                                                     "optimizer": FLAGS.optimizer_lm},
                             prices=prices, library=library))
    except SandboxRefused as exc:
        raise SystemExit(f"rlmopt.run: {exc}") from None


if __name__ == "__main__":
    define_config_flag(sys.argv[1:])
    app.run(main, flags_parser=configlib.parse_flags)
