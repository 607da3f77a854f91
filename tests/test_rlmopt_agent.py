"""The recursive-LM agent loop with a scripted optimizer LM, and `rlmopt.run.optimise` end to end
on the intent-code task with the deterministic simulated task LM."""
import asyncio
import json

from rlmopt.agent import Agent, code_blocks, truncate
from rlmopt.config import RLMOptConfig
from rlmopt.harness import Harness
from rlmopt.lm import ScriptedLM
from rlmopt.run import optimise
from rlmopt.tasks import intent_code
from rlmopt.tools import ToolSet

LOOK = """Let me look at the data.
```python
t = describe_task()
print(t['fields'], t['split_sizes'])
train = peek_examples('train', n=100)
print(len(train), train[0]['expected'])
```"""
WRITE = """I will put the training pairs into the prompt as a lookup.
```python
seed = describe_task()['seed_candidate']['system_prompt']
demos = "\\n\\n".join(f"message: {r['inputs']['message']}\\nOutput: {r['expected']['code']}" for r in train)
cand = seed + "\\n\\nKnown messages and their codes:\\n\\n" + demos
fb = run_candidate(cand)
print(fb['summary'][:300])
```"""
COMMIT = """```python
r = commit_prompt(cand, "the codes are arbitrary, so the training pairs must be shown to the model")
print(r['accepted'], r['reasons'])
final(cand)
```"""


def _run(coro):
    return asyncio.run(coro)


def test_code_blocks_and_truncate():
    assert code_blocks("a\n```python\nx=1\n```\nb\n```\ny=2\n```") == ["x=1\n", "y=2\n"]
    assert code_blocks("no code here") == []
    cut = truncate("a" * 50 + "b" * 50, 20)
    assert cut.startswith("a" * 10) and cut.endswith("b" * 10) and "80 characters cut" in cut


def test_old_turns_are_elided_from_the_context():
    task = intent_code.build()
    h = Harness(task, intent_code.simulated_task_lm(), RLMOptConfig())
    a = Agent(h, ToolSet(h), ScriptedLM(["x"]), log=lambda s: None)
    a.state.messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}] + [
        {"role": r, "content": f"{r}{k}"} for k in range(20) for r in ("assistant", "user")]
    ctx = a._context()
    assert [m["content"] for m in ctx[:2]] == ["S", "U"] and "14 earlier turns elided" in ctx[2]["content"]
    assert [m["content"] for m in ctx[3:]] == [f"{r}{k}" for k in range(14, 20) for r in ("assistant", "user")]


def test_scripted_agent_finds_the_table_commits_and_stops(tmp_path):
    task = intent_code.build()
    lm = ScriptedLM([LOOK, "I think I know what to do.", WRITE, COMMIT])
    config = RLMOptConfig(budget=60, block_timeout_s=20)
    logs = []
    rec = _run(optimise(task, config, method="rlmopt", task_lm=intent_code.simulated_task_lm(),
                        optimizer_lm=lm, sub_lm=None, judge_lm=None, run_dir=tmp_path,
                        names={"task": "simulated", "optimizer": "scripted"}, log=logs.append))
    assert rec["extra"]["stop_reason"] == "agent called final()"
    sandbox = rec["sandbox"]  # the layers in force, in record.json and the log
    assert sandbox["mode"] == "strict" and set(sandbox["in_force"]) >= set(sandbox["promised"])
    assert [line for line in logs if line.startswith("sandbox (strict): in force rlimits, ")]
    assert rec["extra"]["agent_iterations"] == 4 and rec["extra"]["calls_by_role"]["optimizer"] == 4
    assert len(rec["commits"]) == 1 and rec["seed_val_score"] == 0.0
    assert rec["val_score"] > 0.5 and rec["test_score"] > 0.5 and rec["rollouts_used"] == 19
    assert "No ```python block" in lm.prompts[2]  # the reply without code was answered
    assert "26 {'code': '" in lm.prompts[1]  # the REPL's printed output came back
    assert any(line.startswith("turn 3") for line in logs)
    saved = json.loads((tmp_path / "record.json").read_text())
    assert saved["test_score"] == rec["test_score"] and (tmp_path / "summary.md").exists()
    # a finished run directory does not run the agent again
    h = Harness(task, intent_code.simulated_task_lm(), config, run_dir=tmp_path)
    assert _run(Agent(h, ToolSet(h), ScriptedLM(["```python\nprint(1)\n```"])).run()).iteration == 4


def test_a_runaway_block_is_killed_and_the_agent_goes_on():
    task = intent_code.build()
    h = Harness(task, intent_code.simulated_task_lm(), RLMOptConfig(block_timeout_s=1))
    _run(h.evaluate_seed())
    lm = ScriptedLM(["```python\nwhile True:\n    pass\n```", "```python\nfinal()\n```"])
    st = _run(Agent(h, ToolSet(h), lm, log=lambda s: None).run())
    assert "KILLED: the block ran past 1 s" in lm.prompts[1] and st.stop_reason == "agent called final()"


def test_agent_stops_on_iterations_idle_replies_and_budget():
    task = intent_code.build()

    def agent(replies, **cfg):
        h = Harness(task, intent_code.simulated_task_lm(), RLMOptConfig(**cfg))
        _run(h.evaluate_seed())
        return Agent(h, ToolSet(h), ScriptedLM(replies), log=lambda s: None)

    st = _run(agent(["```python\nprint(remaining_budget())\n```"], optimizer_max_iterations=3).run())
    assert st.iteration == 3 and "optimizer_max_iterations" in st.stop_reason
    st = _run(agent(["thinking..."], optimizer_max_iterations=10).run())
    assert st.iteration == 3 and "without code" in st.stop_reason
    spend = "```python\nimport random\nprint(run_candidate('code please ' + str(random.random())))\n```"
    a = agent([spend], budget=19, optimizer_max_iterations=10)
    st = _run(a.run())
    assert st.stop_reason == "budget spent" and st.iteration == 2 and a.h.state.rollouts_used == 19
    assert "budget" in a.state.messages[-1]["content"]  # the last turn saw the refusal


def test_rlmopt_never_imports_the_trainer_or_rl():
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "rlmopt"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("workflow_r1.rl", "workflow_r1.trainer",
                                            "workflow_r1.train", "torch")), f"{path}: {name}"


def test_cli_writes_record_and_summary(tmp_path):
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, "-m", "rlmopt.run", "--task=intent_code", "--task_lm=simulated",
         "--optimizer_lm=fake", "--budget=19", "--config.polish_demos=(3,)", f"--run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "turn 1: no code" in out.stdout and "chosen " in out.stdout
    rec = json.loads((tmp_path / "record.json").read_text())
    assert rec["method"] == "rlmopt" and rec["bench"] == "intent_code" and rec["seed"] == 7
    assert rec["val_score"] >= rec["seed_val_score"] == 0.0
    assert "| seed |" in (tmp_path / "summary.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "rlmopt.run", "--task=nope", f"--run_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--task='nope' not understood" in bad.stderr
    assert [p["label"] for p in rec["pool"]] == ["seed", "polish:demos3", "polish:rewrite"]
    key = subprocess.run([sys.executable, "-m", "rlmopt.run", "--config.field_flor=0.1"],
                         capture_output=True, text=True, timeout=120)
    assert key.returncode == 1 and key.stderr.strip() == \
        "error: config key field_flor unknown; did you mean field_floor?", key.stderr


def test_a_crashed_run_resumes_from_its_directory(tmp_path):
    class Crash(Exception):
        pass

    class CrashingLM(ScriptedLM):
        async def complete(self, prompt, max_tokens):
            if len(self.prompts) == 2:
                raise Crash("power cut")
            return await super().complete(prompt, max_tokens)

    task, config = intent_code.build(), RLMOptConfig(budget=60, block_timeout_s=20)
    kw = dict(method="rlmopt", sub_lm=None, judge_lm=None, run_dir=tmp_path,
              names={"task": "simulated", "optimizer": "scripted"}, log=lambda s: None)
    first_lm = intent_code.simulated_task_lm()
    try:
        _run(optimise(task, config, task_lm=first_lm, optimizer_lm=CrashingLM([LOOK, WRITE]), **kw))
    except Crash:
        pass
    state = json.loads((tmp_path / "state.json").read_text())["state"]
    assert state["rollouts_used"] == 19 and not (tmp_path / "record.json").exists()
    second_lm, resumed = intent_code.simulated_task_lm(), ScriptedLM([LOOK, WRITE, COMMIT])
    rec = _run(optimise(task, config, task_lm=second_lm, optimizer_lm=resumed, **kw))
    assert "resumed after an interruption" in resumed.prompts[0] and "Known messages" in resumed.prompts[0]
    assert rec["extra"]["agent_iterations"] == 5 and rec["rollouts_used"] == 19  # re-run was cached
    assert len(rec["commits"]) == 1 and rec["val_score"] > 0.5
    assert not set(first_lm.prompts) & set(second_lm.prompts)  # no task-LM call was repeated
