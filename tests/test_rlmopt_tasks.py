"""The multi-hop QA and the multi-turn tool-calling tasks: a known-good and a known-bad prompt
scored with deterministic task LMs, the environment and metrics against hand values, user files."""
import asyncio
import json
import subprocess
import sys

import pytest

from rlmopt.config import RLMOptConfig
from rlmopt.harness import Harness
from rlmopt.lm import FunctionLM
from rlmopt.pipeline import build_task_lm, load_task
from rlmopt.tasks import multihop_qa, tool_calls


def run(coro):
    return asyncio.run(coro)


GOOD_QA = multihop_qa.SEED_PROMPT.replace("Answer:", "Reply with the short answer only (a name, "
                                          "number or phrase).\nAnswer:")


def test_multihop_good_prompt_beats_the_seed():
    task = multihop_qa.build()
    assert len(task.examples) == 16 and all("{context}" in v for v in task.seed_candidate.values())
    h = Harness(task, multihop_qa.simulated_reader(task), RLMOptConfig(budget=100))
    seed = run(h.evaluate_seed())
    good = run(h.run_candidate(GOOD_QA))
    assert seed.fields["answer_em"] == 0.0 and good["fields"] == {"answer_em": 1.0, "answer_f1": 1.0}
    # "Based on the paragraphs, I believe it is Esk, as far as I can tell." against "Esk":
    # 14 tokens after SQuAD normalisation ("the" dropped), 1 shared with the 1-token gold:
    # P = 1/14, R = 1, F1 = 2PR / (P + R) = 2/15
    assert task.score(task.parse("Based on the paragraphs, I believe it is Esk, as far as I can "
                                 "tell."), task.examples[0])["answer_f1"] == pytest.approx(2 / 15)
    assert 0 < seed.fields["answer_f1"] < 0.3 and good["composite"] - seed.composite > 0.7


def test_multihop_reads_the_answer_line_and_needs_the_supporting_paragraphs(tmp_path):
    task = multihop_qa.build()
    assert task.parse("Reasoning: ...\nAnswer: Lake Sorrel\nmore")["answer_em"] == "Lake Sorrel"
    assert task.parse("  Esk\nbecause")["answer_em"] == "Esk"
    ex = task.examples[0]
    reader = multihop_qa._reader(task)
    dropped = ex.inputs["context"].split("\n\n")
    keep = [b for b in dropped if not b.startswith(ex.expected["supporting_titles"][0])]
    assert reader(f"short answer\n{chr(10).join(keep)}\n{ex.inputs['question']}") == "The paragraphs do not say."
    # your own file, HotpotQA's distractor format as .jsonl
    rows = [{"_id": f"q{k}", "question": f"Where is {k}?", "answer": f"place {k}",
             "context": [[f"T{k}", [f"{k} is in place {k}."]], ["Other", ["Nothing."]]],
             "supporting_facts": [[f"T{k}", 0]]} for k in range(10)]
    (tmp_path / "mine.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    mine = load_task(f"multihop_qa:{tmp_path / 'mine.jsonl'}")
    assert len(mine.examples) == 10 and mine.examples[3].inputs["context"].startswith("T3: 3 is in")
    del rows[0]["context"]
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]))
    with pytest.raises(ValueError, match=r"record 1: missing \['context'\]"):
        multihop_qa.build(str(tmp_path / "bad.jsonl"))


def test_calendar_environment_against_hand_values():
    task = tool_calls.build()
    env = tool_calls.CalendarEnv(task.examples[0].inputs["state"])
    assert env.call("create_event", {"title": "X", "date": "2026-03-10", "time": "14:00"}) == {"id": "ev4"}
    assert env.call("invite", {"event_id": "ev4", "email": "a@b"})["invited"] == "a@b"
    assert env.call("cancel_event", {"event_id": "ev9"}) == {"error": "no event 'ev9'"}
    assert [e["id"] for e in env.call("list_events", {"date": "2026-03-05"})] == ["ev2"]
    assert "error" in env.call("find_contact", {"name": "Nobody"})
    assert "error" in env.call("create_event", {"title": "no date"})
    assert env.state["events"]["ev4"]["guests"] == ["a@b"]
    assert task.examples[0].inputs["state"]["events"].keys() == {"ev1", "ev2", "ev3"}  # untouched


GOOD_TOOLS = {"tool_descriptions": tool_calls.SEED["tool_descriptions"] + "\n\nReply each turn with "
              "a JSON list of tool calls [{\"name\": ..., \"arguments\": {...}}]; reply [] when the "
              "request is done. Write dates as YYYY-MM-DD."}
HALF_TOOLS = {"tool_descriptions": tool_calls.SEED["tool_descriptions"] + "\n\nReply each turn with "
              "a JSON list of tool calls; reply [] when done."}


def _tool_harness(step_judge=False, judge=None):
    task = tool_calls.build(step_judge=step_judge)
    lm = tool_calls.ToolEpisodeLM(tool_calls.simulated_agent(task), judge=judge)
    return task, Harness(task, lm, RLMOptConfig(budget=100))


def test_tool_calling_good_prompt_beats_a_half_prompt_which_beats_the_seed():
    task, h = _tool_harness()
    seed = run(h.evaluate_seed())
    # prose replies: no call, invalid JSON, the state unchanged, which is right only for the
    # read-only requests (final_state_equal, weight 0.3)
    read_only = [e for e in h.splits.val if e.expected["final_state_equal"] == e.inputs["state"]]
    assert seed.fields["json_valid"] == seed.fields["tool_recall"] == 0.0
    assert seed.composite == pytest.approx(0.3 * len(read_only) / len(h.splits.val))
    half = run(h.run_candidate(HALF_TOOLS))
    good = run(h.run_candidate(GOOD_TOOLS))
    assert good["composite"] == 1.0 and 0.3 < half["composite"] < 0.9
    # the task role's meter counts every turn's prompt, not one per episode
    inner = h.task_lm.lm.lm.prompts
    assert h.meter.prompt_tokens["task"] == sum(len(p) // 4 for p in inner)
    assert h.meter.calls["task"] < len(inner) == h.task_lm.lm.llm_calls
    assert h.meter.estimated_prompt["task"] == h.meter.calls["task"]  # FunctionLM reports none
    assert half["fields"]["json_valid"] == 1.0 and half["fields"]["tool_recall"] == 1.0
    # hand values for one request: list_events(date="March 4"), cancel_event("ev1"), []
    ex = next(e for e in task.examples if e.inputs["request"].startswith("Cancel my dentist"))
    run(h.evaluate(h.resolve(HALF_TOOLS)[0], [ex.id]))
    scores = h.scores(h.resolve(HALF_TOOLS)[0], [ex.id]).per_example[ex.id]
    assert scores == {"tool_recall": 1.0, "tool_precision": 1.0, "argument_match": 0.5,
                      "sequence_match": 0.0, "final_state_equal": 1.0, "json_valid": 1.0}
    trace = json.loads(h.replies[(h.resolve(HALF_TOOLS)[0], ex.id)])
    assert [t["calls"] for t in trace["turns"]][-1] == [] and len(trace["turns"]) == 3


def test_the_step_judge_rates_each_turn():
    judge = FunctionLM(lambda p: "no" if "March" in p.rsplit("The assistant replied", 1)[1] else "yes")
    task, h = _tool_harness(step_judge=True, judge=judge)
    assert "step_judge" in task.weights
    good = run(h.run_candidate(GOOD_TOOLS))
    half = run(h.run_candidate(HALF_TOOLS))
    assert good["fields"]["step_judge"] == 1.0 and half["fields"]["step_judge"] < 1.0
    with pytest.raises(ValueError, match="give --judge_lm"):
        build_task_lm(task, "simulated")


def test_a_bad_tool_file_is_refused_and_the_cli_writes_a_record_with_costs(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps([{"request": "r", "state": {}, "calls": [
        {"name": "fly", "arguments": {}}]}]))
    with pytest.raises(ValueError, match=r"unknown tool\(s\) \['fly'\]"):
        tool_calls.build(str(tmp_path / "bad.json"))
    (tmp_path / "prices.json").write_text(json.dumps({"default": {"prompt": 1.0, "completion": 2.0}}))
    for task in ("tool_calls", "multihop_qa"):
        out = subprocess.run([sys.executable, "-m", "rlmopt.run", f"--task={task}",
                              "--method=baseline", "--task_lm=simulated", "--optimizer_lm=none",
                              f"--prices={tmp_path / 'prices.json'}", f"--run_dir={tmp_path / task}"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        rec = json.loads((tmp_path / task / "record.json").read_text())
        assert rec["bench"] == task and rec["cost_usd_estimate"] > 0
