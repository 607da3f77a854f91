"""The policy-prompt task: a scripted policy through the real rollout engine and HTTP executor, the
placeholder guard, the prompt-set hand-off, the CLI end to end, and the dependency rule."""
import asyncio
import json
import subprocess
import sys

import pytest

from rlmopt.config import RLMOptConfig
from rlmopt.harness import Harness
from rlmopt.pipeline import PolicyRollout, build_task_lm
from rlmopt.tasks import policy_prompt, policy_sim
from tests.rlmopt_fakes import run_compare
from workflow_r1.task import prompt_sets
from workflow_r1.task.config import EnvConfig

RATIONALE = "tells the policy to copy the operator answer instead of hedging"


@pytest.fixture()
def harness():
    task = policy_prompt.build("bundled", 9)
    lm = build_task_lm(task, "scripted")
    h = Harness(task, lm, RLMOptConfig(budget=100))
    yield h
    lm.close()


def _run(*steps):
    async def body():
        return [await step() for step in steps]
    return asyncio.run(body())


def _no_think(template: str) -> str:
    """A template that never mentions the think tags (the scripted policy then breaks the format)."""
    keep = [line for line in template.splitlines() if "<think>" not in line]
    return "\n".join(keep)


def test_good_template_beats_seed_and_bad_one_through_the_rollout_engine(harness):
    h = harness
    good = policy_sim.with_rule(h.seed["policy"])
    bad = _no_think(h.seed["policy"])
    assert "{question}" in bad and "{operators}" in bad and "{max_calls}" in bad
    seed, ev_good, ev_bad = _run(h.evaluate_seed, lambda: h.run_candidate(good),
                                 lambda: h.run_candidate(bad))
    # the seed hedges (no exact match, partial F1) in a valid format
    assert seed.fields["answer_em"] == 0.0 and 0.0 < seed.fields["answer_f1"] < 1.0
    assert seed.fields["format_valid"] == 1.0 and seed.fields["answered"] == 1.0
    assert ev_good["fields"] == {"answer_em": 1.0, "answer_f1": 1.0, "format_valid": 1.0, "answered": 1.0}
    assert ev_bad["fields"]["format_valid"] == 0.0
    assert ev_good["composite"] > seed.composite > ev_bad["composite"]
    # one engine.run per candidate: each evaluation's questions were rolled out as one batch
    assert h.task_lm.lm.engine_runs == 3 and h.task_lm.lm.llm_calls == 3 * len(h.val_order)
    trace = h.trace(ev_good["candidate_id"], h.val_order[0])
    conv = json.loads(trace["reply"])
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert policy_sim.RULE in conv["messages"][1]["content"]
    assert conv["turns"][0]["operator"] == "AnswerGenerate" and conv["finish_reason"] == "answer"
    commit = h.commit_prompt(good, RATIONALE)
    assert commit["accepted"], commit["reasons"]


def test_placeholder_dropping_template_is_refused(harness):
    h = harness
    seed = h.seed["policy"]
    dropped = seed.replace("{max_calls}", "20")
    assert h.task.check({"policy": dropped})[0].startswith("policy guard:")
    assert "{max_calls}" in h.task.check({"policy": dropped})[0]
    # an unknown placeholder passes the seed's placeholder guard, only the task's guard refuses it
    extra = seed + "\n{hint}"
    [ev] = _run(lambda: h.run_candidate(extra))
    assert ev["composite"] == 0.0  # the runner refused the template: a failed call, scored 0
    commit = h.commit_prompt(extra, RATIONALE)
    assert not commit["accepted"]
    assert any(r.startswith("policy guard:") and "unknown ['hint']" in r for r in commit["reasons"])
    assert h.task.check({"policy": policy_sim.with_rule(seed)}) == []


def test_export_is_a_prompt_set_that_env_config_accepts(tmp_path):
    task = policy_prompt.build("bundled", 6, prompt_set="concise")
    cand = {"policy": policy_sim.with_rule(task.seed_candidate["policy"])}
    path = task.export(cand, tmp_path)
    env = EnvConfig(prompt_set=path)
    assert env.prompts.policy.strip() == cand["policy"].strip()
    # the other texts are the base set's (concise), not the faithful ones
    assert env.prompts.templates == prompt_sets.load("concise").templates
    assert policy_sim.RULE in env.messages("Who?")[1]["content"]
    with pytest.raises(ValueError, match="missing \\['question'\\]"):
        policy_prompt.write_prompt_set({"policy": "Answer {operators} {max_calls}"}, tmp_path / "bad")


def test_cli_end_to_end_with_the_scripted_agent_and_policy(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rlmopt.run", "--task=policy_prompt", "--questions=9",
         "--task_lm=scripted", "--optimizer_lm=scripted", "--budget=10", "--config.polish_variants=False",
         f"--run_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rec = json.loads((tmp_path / "record.json").read_text())
    assert rec["bench"] == "policy_prompt" and rec["val_score"] > rec["seed_val_score"]
    assert rec["test_score"] > rec["seed_test_score"]
    env = EnvConfig(prompt_set=rec["exported"])
    assert policy_sim.RULE in env.prompts.policy
    assert rec["extra"]["executor_llm_calls"] > 0


def test_policy_spec_errors_are_one_line():
    task = policy_prompt.build("bundled", 3)
    with pytest.raises(ValueError, match="use scripted, local or local:HF_DIR"):
        build_task_lm(task, "openai:http://x", policy_rollout=PolicyRollout())
    with pytest.raises(ValueError, match="hf/ export"):
        policy_prompt.load_policy("local:/nonexistent-dir", task, 64)


def test_policy_task_never_imports_the_training_side():
    """Transitively: importing the task and its runner loads neither workflow_r1.rl nor the trainer."""
    code = ("import sys; import rlmopt.run, rlmopt.compare; from rlmopt.tasks import policy_prompt, "
            "policy_sim; bad = sorted(m for m in sys.modules if m.startswith(('workflow_r1.rl', "
            "'workflow_r1.trainer', 'workflow_r1.train', 'workflow_r1.eval'))); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_compare_accepts_the_task(tmp_path):
    md = run_compare(tmp_path, "policy_prompt", budget=10, task_lm="scripted")
    for m in ("rlmopt", "gepa"):  # both put RULE into the template: every test question is matched
        assert f"| {m} | 1.000 | +" in md, md
        rec = json.loads((tmp_path / m / "policy_prompt" / "seed7" / "record.json").read_text())
        assert policy_sim.RULE in prompt_sets.load(rec["exported"]).policy
    assert "| baseline | 0.336 | - |" in md


@pytest.mark.parametrize("max_tokens, expected", [(None, 1024), (64, 64)])
def test_the_executor_generation_limit_reaches_the_in_process_executor(max_tokens, expected):
    task = policy_prompt.build("bundled", 6)
    lm = build_task_lm(task, "scripted", executor_max_tokens=max_tokens)
    try:
        assert lm._server.service.config.max_tokens == expected
    finally:
        lm.close()
