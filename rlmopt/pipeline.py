"""One run end to end, shared by `python -m rlmopt.run` and `python -m rlmopt.compare`: the task
and LMs from their specs, the search of a method (rlmopt's agent, GEPA, or none), the final stage,
`record.json`, and the operator task's prompt-set export. No flags here (the entry points own them).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

from rlmopt import record
from rlmopt.agent import Agent
from rlmopt.config import RLMOptConfig
from rlmopt.harness import Harness
from rlmopt.lm import FunctionLM, build_lm
from rlmopt.sandbox import repl
from rlmopt.selection import finalize
from rlmopt.task import Task
from rlmopt.tasks import (bfcl_multi_turn, intent_code, jsonl, multihop_qa, operator_env,
                          operator_sim, policy_prompt, policy_sim, tool_calls)
from rlmopt.tools import ToolSet

METHODS = ["rlmopt", "gepa", "baseline"]


def load_task(spec: str, questions: int = 60, prompt_set: str = "faithful",
              step_judge: bool = False) -> Task:
    """The task named by `spec`; `prompt_set` is the base prompt set of the environment tasks;
    `step_judge` adds the tool-calling task's LM-judged step field."""
    kind, _, rest = spec.partition(":")
    if kind == "intent_code":
        return intent_code.build()
    if kind == "multihop_qa":
        return multihop_qa.build(rest)
    if kind == "tool_calls":
        return tool_calls.build(rest, step_judge=step_judge)
    if kind == "bfcl_multi_turn":
        return bfcl_multi_turn.build(rest)
    if kind == "operator_env":
        return operator_env.build(rest or "bundled", questions, prompt_set=prompt_set)
    if kind == "policy_prompt":
        return policy_prompt.build(rest or "bundled", questions, prompt_set=prompt_set)
    if kind == "jsonl" and rest:
        return jsonl.load(rest)
    raise ValueError(f"--task={spec!r} not understood; use intent_code, operator_env[:QUESTIONS], "
                     "policy_prompt[:QUESTIONS], multihop_qa[:FILE], tool_calls[:FILE], "
                     "bfcl_multi_turn[:SPLIT,OPTIONS] or jsonl:SPEC.json")


@dataclasses.dataclass(frozen=True)
class PolicyRollout:
    """How the policy_prompt task rolls out: the executor LLM spec ("" = simulated for the scripted
    policy, else local), token budgets of an episode (tokens) and the operator-call limit."""

    executor_lm: str = ""
    max_prompt_tokens: int = 4096
    max_response_tokens: int = 2048
    max_turn_tokens: int = 512
    max_calls: int = 20


def _policy_rollout_lm(task: policy_prompt.PolicyPromptTask, spec: str, opts: PolicyRollout, *,
                       model: str, api_key: str, executor_url: str,
                       executor_max_tokens: int | None):
    from workflow_r1.rollout.engine import RolloutConfig

    # The scripted policy reads bytes: its prompts are ~4x longer in tokens than a BPE model's.
    prompt_tokens = 4 * opts.max_prompt_tokens if spec == "scripted" else opts.max_prompt_tokens
    cfg = RolloutConfig(prompts_per_step=1, n=1, max_prompt_tokens=prompt_tokens,
                        max_response_tokens=opts.max_response_tokens,
                        max_turn_tokens=opts.max_turn_tokens)
    policy, tokenizer = policy_prompt.load_policy(spec, task, cfg.cache_size)
    llm = None
    if not executor_url:
        executor = opts.executor_lm or ("simulated" if spec == "scripted" else "local")
        if executor == "simulated":
            llm = policy_sim.simulated_executor_lm(task)
        elif executor == "fake":
            from workflow_r1.executor.fake_backend import FakeBackend
            llm = FakeBackend()
        else:
            llm = build_lm(executor, api_key=api_key, model=model)
    return policy_prompt.PolicyRolloutLM(policy, tokenizer, llm=llm, url=executor_url or None,
                                         rollout=cfg, prompt_set=task.prompt_set,
                                         max_calls=opts.max_calls,
                                         executor_max_tokens=executor_max_tokens)


def build_task_lm(task: Task, spec: str, *, model: str = "default", api_key: str = "",
                  executor_url: str = "", policy_rollout: PolicyRollout | None = None,
                  executor_max_tokens: int | None = None, judge_lm=None):
    """The task LM of `task` named by `spec`; for the operator task, the workflow runner over an
    executor whose LLM `spec` names (`simulated`, `fake`, `local[:DIR]`, `openai:URL`); for the
    policy-prompt task, the rollout runner of the policy `spec` names (`scripted`, `local[:HF_DIR]`)
    over an executor whose LLM `policy_rollout.executor_lm` names. Either task's in-process
    executor generates at most `executor_max_tokens` per attempt (None: the executor's default).
    For the tool-calling task, the episode runner over the assistant LM `spec` names
    (`simulated` or any LM spec), with `judge_lm` as its step judge when the task has one; for
    BFCL multi-turn, the episode runner in the benchmark's environments over the assistant LM
    `spec` names (`simulated` or any LM spec)."""
    if isinstance(task, bfcl_multi_turn.BfclTask):
        inner = bfcl_multi_turn.simulated_agent(task) if spec == "simulated" else \
            build_lm(spec, api_key=api_key, model=model)
        return bfcl_multi_turn.BfclEpisodeLM(inner, task)
    if isinstance(task, tool_calls.ToolCallTask):
        judged = "step_judge" in task.weights
        if judged and judge_lm is None:
            raise ValueError("the tool_calls step judge needs a judge LM: give --judge_lm")
        inner = tool_calls.simulated_agent(task) if spec == "simulated" else \
            build_lm(spec, api_key=api_key, model=model)
        return tool_calls.ToolEpisodeLM(inner, judge=judge_lm if judged else None)
    if isinstance(task, multihop_qa.MultiHopTask) and spec == "simulated":
        return multihop_qa.simulated_reader(task)
    if isinstance(task, policy_prompt.PolicyPromptTask):
        return _policy_rollout_lm(task, spec, policy_rollout or PolicyRollout(), model=model,
                                  api_key=api_key, executor_url=executor_url,
                                  executor_max_tokens=executor_max_tokens)
    if isinstance(task, operator_env.OperatorTask):
        if executor_url:
            return operator_env.OperatorWorkflowLM(url=executor_url)
        if spec == "simulated":
            llm = operator_sim.SimulatedExecutorLM.for_task(task)
        elif spec == "fake":
            from workflow_r1.executor.fake_backend import FakeBackend
            llm = FakeBackend()
        else:
            llm = build_lm(spec, api_key=api_key, model=model)
        return operator_env.OperatorWorkflowLM(llm, max_tokens=executor_max_tokens)
    if spec == "simulated":
        if task.name != "intent_code":
            raise ValueError("--task_lm=simulated exists for the intent_code, operator_env, "
                             "multihop_qa, tool_calls and bfcl_multi_turn tasks")
        return intent_code.simulated_task_lm()
    return build_lm(spec, api_key=api_key, model=model)


def build_optimizer_lm(task: Task, spec: str, method: str, *, model: str = "default",
                       api_key: str = ""):
    """The optimizer LM (rlmopt's agent, GEPA's reflection LM); `scripted` is the fixed stand-in
    of the operator task."""
    if spec == "none" or method == "baseline":
        return None
    if spec == "scripted":
        if isinstance(task, bfcl_multi_turn.BfclTask):
            if method == "gepa":
                return FunctionLM(bfcl_multi_turn.scripted_reflection)
            return bfcl_multi_turn.scripted_agent()
        if isinstance(task, policy_prompt.PolicyPromptTask):
            if method == "gepa":
                return FunctionLM(policy_sim.scripted_reflection)
            return policy_sim.scripted_agent()
        if not isinstance(task, operator_env.OperatorTask):
            raise ValueError("--optimizer_lm=scripted exists for the operator_env, policy_prompt "
                             "and bfcl_multi_turn tasks only")
        if method == "gepa":
            return FunctionLM(operator_sim.scripted_reflection)
        return operator_sim.scripted_agent()
    return build_lm(spec, api_key=api_key, model=model)




async def optimise(task: Task, config: RLMOptConfig, *, method: str, task_lm, optimizer_lm,
                   sub_lm, judge_lm, run_dir: Path, names: dict, log=print,
                   prices: dict | None = None, library=None) -> dict:
    """One run end to end; returns the record (also written to run_dir). `prices`: a checked
    price table (rlmopt.cost.load_prices) for the record's cost estimate, or None. `library`: a
    `rlmopt.library.SkillLibrary` the agent reads through its skill_library tool and an rlmopt
    run adds what it learned to, or None (off)."""
    run_dir = Path(run_dir)
    if method == "rlmopt":  # a strict sandbox that cannot hold refuses before the seed's LM calls
        await asyncio.to_thread(repl.preflight, config)
    h = Harness(task, task_lm, config, sub_lm=sub_lm, judge_lm=judge_lm, run_dir=run_dir)
    seed = await h.evaluate_seed()
    log(f"seed validation composite {seed.composite:.3f} on {len(seed.ids)} examples; "
        f"budget {config.budget} rollouts")
    iterations, stop, gepa_info, sandbox = 0, "baseline: no search", None, None
    if method == "rlmopt":  # a resumed run whose agent had stopped returns at once
        agent = Agent(h, ToolSet(h, library=library), optimizer_lm, log=log)
        state = await agent.run()
        iterations, stop, sandbox = state.iteration, state.stop_reason, state.sandbox or None
    elif method == "gepa":
        from rlmopt.baselines import gepa_adapter  # gepa is needed only here
        done = run_dir / gepa_adapter.GEPA_FILE
        if h.state.phase != "search" and done.exists():  # a resumed run: the search is over
            gepa_info = json.loads(done.read_text())
        else:
            gepa_info = await gepa_adapter.search(h, optimizer_lm, mode=config.gepa_budget,
                                                  minibatch_size=config.gepa_minibatch, log=log)
        iterations, stop = gepa_info["candidates"], f"gepa: {gepa_info['metric_calls']} metric calls"
    h.state.phase = "final"
    h.save()
    final = await finalize(h)
    rec = record.build_record(h, final, method=method, task_lm=names["task"],
                              optimizer_lm=names["optimizer"], iterations=iterations,
                              stop_reason=stop, prices=prices, sandbox=sandbox)
    if gepa_info is not None:
        rec["extra"]["gepa"] = gepa_info
    if hasattr(task_lm, "llm_calls"):  # the environment tasks: LLM calls behind the executor
        rec["extra"]["executor_llm_calls"] = h.executor_llm_calls()
    exported = task.export(h.state.candidates[final.chosen_id], run_dir)
    if exported:
        rec["exported"] = exported
        log(f"chosen candidate exported: {exported}")
    if library is not None and method == "rlmopt":
        rec["skill_library_entry"] = str(library.save(h, final.chosen_id, final.val.composite,
                                                      final.seed_val.composite))
    record.write(run_dir, rec)
    log(f"chosen {final.chosen_label} ({final.chosen_id}): validation {final.val.composite:.3f} "
        f"(seed {final.seed_val.composite:.3f}), test {final.test.composite:.3f} "
        f"(seed {final.seed_test.composite:.3f}); rollouts {h.state.rollouts_used}; "
        f"record: {run_dir / 'record.json'}")
    for lm in (task_lm, optimizer_lm, sub_lm, judge_lm):
        if hasattr(lm, "aclose"):
            await lm.aclose()
    return rec


def method_config(config: RLMOptConfig, method: str) -> RLMOptConfig:
    """The polish stage belongs to rlmopt: off for the baseline and GEPA rows."""
    return config if method == "rlmopt" else dataclasses.replace(config, polish_variants=False)


