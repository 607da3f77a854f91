"""The operator-environment task through the real HTTP executor, the prompt-set export, the GEPA
baseline on the synthetic task with a scripted reflection LM, and `rlmopt.compare` end to end."""
import asyncio
import json
import re
from pathlib import Path

import pytest

from rlmopt import compare
from rlmopt.baselines import gepa_adapter
from rlmopt.config import RLMOptConfig
from rlmopt.harness import Harness
from rlmopt.lm import FunctionLM
from rlmopt.pipeline import optimise
from rlmopt.tasks import intent_code, operator_env, operator_sim
from tests.rlmopt_fakes import run_compare
from workflow_r1.task import prompt_sets
from workflow_r1.executor.fake_backend import FakeBackend

RATIONALE = "asks the final step for the bare short answer the scorer expects"


def run(coro):
    return asyncio.run(coro)


def _good_and_bad(seed):
    good = {**seed, "ScEnsemble": seed["ScEnsemble"] + "\n\n" + operator_sim.RULE}
    # the bad set never asks ScEnsemble for <answer> tags: each question needs a repair attempt
    bad_text = seed["ScEnsemble"].split("Reply in this format:")[0] + \
        "Reply with your analysis inside <think></think> tags."
    return good, {**seed, "ScEnsemble": bad_text}


@pytest.fixture()
def harness():
    task = operator_env.build("bundled", 9)
    lm = operator_env.OperatorWorkflowLM(operator_sim.SimulatedExecutorLM.for_task(task))
    h = Harness(task, lm, RLMOptConfig(budget=100))
    yield h
    lm.close()


def in_one_loop(h, *steps):
    """Runs harness coroutines in one event loop (the executor client keeps a session per loop)
    and closes the client's session; returns their results."""
    async def body():
        try:
            return [await step() for step in steps]
        finally:
            await h.task_lm.lm.client.aclose()
    return run(body())


def test_operator_task_scores_a_good_and_a_bad_template_set_through_the_executor(harness):
    h = harness
    good, bad = _good_and_bad(h.seed)
    seed, ev_good, ev_bad = in_one_loop(h, h.evaluate_seed, lambda: h.run_candidate(good),
                                        lambda: h.run_candidate(bad))
    assert ev_good["fields"] == {"answer_em": 1.0, "answer_f1": 1.0, "format_valid": 1.0,
                                 "call_economy": 1.0} and ev_good["composite"] == pytest.approx(1.0)
    # the faithful set: hedged final answers (no exact match, partial F1), no repairs
    assert seed.fields["answer_em"] == 0.0 and 0 < seed.fields["answer_f1"] < 1
    assert seed.fields["call_economy"] == 1.0 and seed.fields["format_valid"] == 1.0
    # the bad set: one repair attempt per question (5 calls for 4 steps), still hedged
    assert ev_bad["fields"]["call_economy"] == pytest.approx(0.8)
    assert ev_bad["fields"]["answer_em"] == 0.0 and ev_bad["composite"] < seed.composite
    trace = h.trace(ev_good["candidate_id"], h.val_order[0])
    steps = json.loads(trace["reply"])["steps"]
    assert [s["operator"] for s in steps] == list(operator_env.WORKFLOW)
    assert "ScEnsemble answer: " in steps[-1]["observation"] and steps[-1]["error_kind"] is None
    assert trace["prediction"]["answer_em"] == h.examples[h.val_order[0]].expected["answer_em"][0]


def test_fake_backend_workflow_is_well_formed_and_wrong():
    task = operator_env.build("bundled", 6)
    lm = operator_env.OperatorWorkflowLM(FakeBackend(default_answer="fake answer"))
    try:
        h = Harness(task, lm, RLMOptConfig())
        ev, = in_one_loop(h, h.evaluate_seed)
    finally:
        lm.close()
    assert ev.fields == {"answer_em": 0.0, "answer_f1": 0.0, "format_valid": 1.0,
                         "call_economy": 1.0}
    assert lm.llm_calls == 4 * len(h.val_order)


class _RecordingBackend(FakeBackend):
    """FakeBackend that remembers the generation limit of every call (tokens)."""

    def __init__(self):
        super().__init__()
        self.limits: list[int] = []

    async def complete(self, prompt, max_tokens):
        self.limits.append(max_tokens)
        return await super().complete(prompt, max_tokens)


@pytest.mark.parametrize("max_tokens, expected", [(None, 1024), (64, 64)])
def test_the_executor_generation_limit_reaches_the_executor_llm(max_tokens, expected):
    llm = _RecordingBackend()
    lm = operator_env.OperatorWorkflowLM(llm, max_tokens=max_tokens)
    try:
        h = Harness(operator_env.build("bundled", 6), lm, RLMOptConfig())
        in_one_loop(h, h.evaluate_seed)
    finally:
        lm.close()
    assert llm.limits and set(llm.limits) == {expected}


def test_a_template_that_drops_a_placeholder_is_refused_at_commit(harness):
    h = harness
    good, _ = _good_and_bad(h.seed)
    # Review loses {solution}; Revise still has one, so only the per-template check notices
    broken = {**good, "Review": good["Review"].replace("Solution: {solution}", "")}
    in_one_loop(h, h.evaluate_seed, lambda: h.run_candidate(broken), lambda: h.run_candidate(good))
    r = h.commit_prompt(broken, RATIONALE)
    assert not r["accepted"]
    assert any(x.startswith("template guard:") and "solution" in x for x in r["reasons"])
    assert h.commit_prompt(good, RATIONALE)["accepted"]


def test_a_candidate_is_exported_as_a_prompt_set_that_loads(tmp_path, harness):
    good, _ = _good_and_bad(harness.seed)
    path = harness.task.export(good, tmp_path)
    assert Path(path) == tmp_path / "prompt_set"
    loaded = prompt_sets.load(path)
    faithful = prompt_sets.load("faithful")
    assert {op: loaded.templates[op] for op in good} == good
    assert loaded.templates["Custom"] == faithful.templates["Custom"]
    assert sorted(p.name for p in Path(path).iterdir()) == sorted(
        f"{op}.template.txt" for op in operator_env.WORKFLOW)
    with pytest.raises(ValueError, match="Review"):
        operator_env.write_prompt_set({"Review": "no placeholders"}, tmp_path / "bad")


def _table_reflection(prompt: str) -> str:
    """A scripted GEPA reflection LM for the intent-code task: it reads (message, expected code)
    pairs from the reflective dataset in the prompt and appends 'intent: code' lines."""
    current = re.search(r"```\n?(.*?)```", prompt, re.S).group(1).strip()
    lines = []
    for intent, phrasings in intent_code.PHRASINGS.items():
        for message in phrasings:
            at = prompt.find(message)
            code = re.search(r'\\?"code\\?": \\?"(\w\w)', prompt[at:]) if at >= 0 else None
            if code and not any(line.startswith(intent) for line in lines):
                lines.append(f"{intent.replace('_', ' ')}: {code.group(1)}")
    return "```\n" + "\n".join([current] + lines) + "\n```"


def test_gepa_adapter_runs_on_the_synthetic_task(tmp_path):
    assert gepa_adapter.auto_budget(1, 19) == 456  # 10 trials: 19 + 30 + 350 + 3 x 19
    assert gepa_adapter.auto_budget(4, 20) == 1665  # 41 trials: 20 + 30 + 1435 + 9 x 20
    task = intent_code.build()
    task_lm = intent_code.simulated_task_lm()
    config = RLMOptConfig(budget=60, polish_variants=False)
    rec = run(optimise(task, config, method="gepa", task_lm=task_lm,
                       optimizer_lm=FunctionLM(_table_reflection), sub_lm=None, judge_lm=None,
                       run_dir=tmp_path, names={"task": "simulated", "optimizer": "scripted"},
                       log=lambda s: None))
    g = rec["extra"]["gepa"]
    assert rec["method"] == "gepa" and g["max_metric_calls"] == 60 + 19
    assert g["native_light_metric_calls"] == 456 and g["metric_calls"] >= 19
    assert rec["extra"]["calls_by_role"]["optimizer"] >= 1
    assert rec["rollouts_used"] == g["task_lm_calls"] > 0
    assert rec["seed_test_score"] == 0.0 and rec["test_score"] > 0.0
    assert rec["val_score"] > rec["seed_val_score"] == 0.0
    assert rec["chosen"]["label"] == "claimed"
    # GEPA saw train and validation only: every search-time prompt is a train or val message
    state = json.loads((tmp_path / "state.json").read_text())["state"]
    test_msgs = {intent_code.build().examples[int(i[1:])].inputs["message"]
                 for i in rec["per_example_test"]}
    search_prompts = task_lm.prompts[:19 + rec["rollouts_used"]]
    assert not any(p.rsplit("message:", 1)[-1].strip() in test_msgs for p in search_prompts)
    assert any(e["event"] == "gepa_eval" for e in state["history"])


def test_compare_table_pairs_test_examples_across_seeds():
    def rec(seed, scores, method):
        return {"seed": seed, "task_lm": "t", "test_score": sum(scores) / len(scores),
                "val_score": 0.0, "rollouts_used": 1, "wall_clock_s": 1.0, "method": method,
                "per_example_test": {f"q{i}": v for i, v in enumerate(scores)},
                "extra": {"api_calls": 3, "calls_by_role": {"task": 1}, "total_tokens": 10}}
    records = {"rlmopt": [rec(7, [1, 1, 0], "rlmopt"), rec(8, [1, 0, 1], "rlmopt")],
               "baseline": [rec(7, [0, 1, 0], "baseline"), rec(8, [0, 0, 0], "baseline")]}
    md = compare.table(records, "t")
    # paired differences 1, 0, 0, 1, 0, 1: mean 0.5, sd sqrt(0.3), SE sqrt(0.3 / 6) = 0.2236
    assert "| rlmopt | 0.667 | +0.500 ± 0.224 | " in md and "| 8 | 0.667 | 0.000 |" in md


def test_compare_runs_end_to_end_with_the_fake_backend(tmp_path):
    md = run_compare(tmp_path, "operator_env", budget=6, task_lm="fake",
                     extra=("--config.optimizer_max_iterations=3", "--executor_max_tokens=64"))
    # the settings that differ from the defaults are named under the title
    assert "Settings: optimizer_max_iterations=3, executor max_tokens=64." in md, md
    for m in ("rlmopt", "gepa", "baseline"):
        assert re.search(rf"^\| {m} \| 0\.200 \| ", md, re.M), md  # fake: format + economy only
        rec = json.loads((tmp_path / m / "operator_env" / "seed7" / "record.json").read_text())
        assert rec["extra"]["executor_llm_calls"] > 0
        prompt_sets.load(rec["exported"])
    assert "rlmopt − gepa on test: +0.000 ± 0.000" in md and "| 7 | 0.200 | 0.200 | 0.200 |" in md
    # run again: every run directory is resumed (nothing recomputed) and its counts survive
    calls = {m: json.loads((tmp_path / m / "operator_env" / "seed7" / "record.json").read_text())
             ["extra"]["executor_llm_calls"] for m in ("rlmopt", "gepa", "baseline")}
    again = run_compare(tmp_path, "operator_env", budget=6, task_lm="fake",
                        extra=("--config.optimizer_max_iterations=3",))
    assert "| 7 | 0.200 | 0.200 | 0.200 |" in again
    for m, n in calls.items():
        rec = json.loads((tmp_path / m / "operator_env" / "seed7" / "record.json").read_text())
        assert rec["extra"]["executor_llm_calls"] == n, m
