"""The cross-run skill library: a finished run stores its accepted rules and failure modes as
text; a later run reads them through the skill_library tool; no example record is stored."""
import asyncio
import json

from rlmopt.config import RLMOptConfig
from rlmopt.harness import Harness
from rlmopt.library import SkillLibrary
from rlmopt.lm import FunctionLM, ScriptedLM
from rlmopt.pipeline import optimise
from rlmopt.tasks import intent_code
from rlmopt.tools import ToolSet
from tests.test_rlmopt_agent import COMMIT, LOOK, WRITE

NOTES = """```python
print(commit_prompt('never run', 'REFUSED-9: this commit is refused since it was never run'))
scratchpad_add('rule', 'RULE-17: list every intent with its code, one per line')
scratchpad_add('warning', 'WARN-23: the model invents codes when the table is missing')
print(synthesize_failures('code', describe_task()['seed_candidate'])['analysis'])
```"""
READ = "```python\nprint(skill_library())\n```"
FINAL = "```python\nfinal()\n```"


def _opt(tmp, replies, seed=7, library=None, sub_lm=None):
    lm = ScriptedLM(replies)
    rec = asyncio.run(optimise(intent_code.build(), RLMOptConfig(budget=60, seed=seed,
                                                                 polish_variants=False),
                               method="rlmopt", task_lm=intent_code.simulated_task_lm(),
                               optimizer_lm=lm, sub_lm=sub_lm, judge_lm=None, run_dir=tmp,
                               names={"task": "s", "optimizer": "o"}, log=lambda s: None,
                               library=library))
    return rec, lm


def test_a_finished_run_is_stored_and_offered_to_the_next_run(tmp_path):
    lib = SkillLibrary(tmp_path / "lib")
    sub = FunctionLM(lambda p: "DIAG-5: the codes are arbitrary; put the table in the prompt.")
    rec, _ = _opt(tmp_path / "r1", [LOOK, WRITE, NOTES, COMMIT], library=lib, sub_lm=sub)
    [entry] = lib.entries()
    assert rec["skill_library_entry"].endswith(".json") and entry["task"] == "intent_code"
    assert entry["rules"][0].startswith("the codes are arbitrary, so the training pairs")
    assert "RULE-17: list every intent" in entry["rules"][1]
    assert entry["failure_modes"][0].startswith("DIAG-5") and "WARN-23" in entry["failure_modes"][1]
    assert entry["val_score"] == rec["val_score"] and entry["commits"] == 1
    assert "REFUSED-9" not in json.dumps(entry)  # a refused commit's rationale is no rule
    stored = (tmp_path / "lib").glob("*.json").__next__().read_text()
    for ex in intent_code.build().examples:  # no example record (input or gold) is stored
        assert ex.inputs["message"] not in stored
    # a later run (another split seed) sees them through its tool
    _, lm2 = _opt(tmp_path / "r2", [READ, FINAL], seed=8, library=lib)
    assert "RULE-17" in lm2.prompts[1] and "DIAG-5" in lm2.prompts[1]
    assert len(lib.entries()) == 2  # and adds its own
    (tmp_path / "lib" / "zz-other.json").write_text(json.dumps({"task": "other", "seed": 1}))
    assert [e["seed"] for e in lib.lookup("intent_code")] == [8, 7, 1]  # this task newest first
    assert lib.lookup("intent_code", query="warn-23")[0]["seed"] == 7
    assert lib.lookup("other", limit=1)[0]["task"] == "other"  # this task's entries first


def test_without_a_library_the_tool_says_it_is_off_and_nothing_is_written(tmp_path):
    rec, lm = _opt(tmp_path / "r", [READ, FINAL])
    assert "no skill library is configured" in lm.prompts[1] and "skill_library_entry" not in rec
    h = Harness(intent_code.build(), intent_code.simulated_task_lm(), RLMOptConfig())
    out = asyncio.run(ToolSet(h).call("skill_library", [], {}))
    assert out["entries"] == []
