"""The multi-hop QA and the multi-turn tool-calling tasks: a known-good and a known-bad prompt
scored with deterministic task LMs, the environment and metrics against hand values, user files."""
import asyncio
import json
import subprocess
import sys

import pytest

from rlmopt.config import RLMOptConfig
from rlmopt.harness import Harness
from rlmopt.lm import FunctionLM, ScriptedLM
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
    # the LAST "Answer:" is the answer: a reply that guesses, reasons, then answers again
    # scores its final answer, on the next line, on the same line, in any case
    for reply in ("Answer: a guess\nChecking the second paragraph again.\nAnswer: Esk",
                  "answer: a guess, but the paragraphs say otherwise. Final ANSWER: Esk",
                  "Answer: a guess\nAnswer:\n  Esk\n"):
        assert task.parse(reply) == {"answer_em": "Esk", "answer_f1": "Esk"}, reply
        assert task.score(task.parse(reply), task.examples[0]) == {"answer_em": 1.0, "answer_f1": 1.0}
    assert task.examples[0].expected["answer_em"] == "Esk"  # the first answer would score 0 and 0
    assert task.score({"answer_em": "a guess"}, task.examples[0]) == {"answer_em": 0.0, "answer_f1": 0.0}
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


@pytest.mark.parametrize("cancel, new_id", [("ev1", "ev4"), ("ev2", "ev4"), ("ev3", "ev3")])
def test_calendar_ids_after_a_cancel_never_overwrite_an_event(cancel, new_id):
    # ev1..ev3 (Dentist, Team lunch, Piano lesson); a new id is one past the highest id left,
    # so cancelling ev1 or ev2 leaves ev3 and the new event is ev4, never a second ev3
    task = tool_calls.build()
    state = task.examples[0].inputs["state"]
    titles = {"ev1": "Dentist", "ev2": "Team lunch", "ev3": "Piano lesson"}
    assert {k: v["title"] for k, v in state["events"].items()} == titles
    env = tool_calls.CalendarEnv(state)
    assert env.call("cancel_event", {"event_id": cancel}) == {"cancelled": cancel}
    assert env.call("create_event", {"title": "X", "date": "2026-03-10", "time": "14:00"}) == {"id": new_id}
    kept = {k: t for k, t in titles.items() if k != cancel}
    assert {k: v["title"] for k, v in env.state["events"].items()} == {**kept, new_id: "X"}
    assert env.call("create_event", {"title": "Y", "date": "2026-03-11", "time": "09:00"}) == \
        {"id": f"ev{int(new_id[2:]) + 1}"}
    assert len(env.state["events"]) == 4
    # the gold final state of a file's calls goes through the same environment
    end = tool_calls.final_state(state, [{"name": "cancel_event", "arguments": {"event_id": cancel}},
                                         {"name": "create_event", "arguments": {
                                             "title": "X", "date": "2026-03-10", "time": "14:00"}}])
    assert {k: v["title"] for k, v in end["events"].items()} == {**kept, new_id: "X"}


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
    val = [h.examples[i] for i in h.val_order]
    run(h.evaluate_seed())  # prose: one assistant call per episode, nothing to judge
    assert h.task_lm.lm.llm_calls == len(val)
    calls_before = h.task_lm.lm.llm_calls
    good = run(h.run_candidate(GOOD_TOOLS))
    half = run(h.run_candidate(HALF_TOOLS))
    assert good["fields"]["step_judge"] == 1.0 and half["fields"]["step_judge"] < 1.0
    # the judge rates each turn with calls, never the closing []: the half prompt writes dates
    # as "March 4", so of each gold plan the calls with a date argument are rated "no"
    plans = [e.expected["sequence_match"] for e in val]
    share = [sum("date" not in c["arguments"] for c in p) / len(p) for p in plans]
    assert half["fields"]["step_judge"] == pytest.approx(sum(share) / len(share))
    # per episode and prompt: one assistant call per plan step plus the closing [], one judge
    # call per plan step
    assert h.task_lm.lm.llm_calls - calls_before == 2 * sum(2 * len(p) + 1 for p in plans)
    trace = json.loads(h.replies[(h.resolve(HALF_TOOLS)[0], val[0].id)])
    assert ["judge" in t for t in trace["turns"]] == [True] * len(plans[0]) + [False]
    with pytest.raises(ValueError, match="give --judge_lm"):
        build_task_lm(task, "simulated")


def _episode(replies, judge_says):
    """One episode of the first request with scripted assistant replies and a judge that says
    judge_says(calls the assistant replied) ("yes"/"no"); returns (trace, parsed, judge prompts,
    LM calls)."""
    task = tool_calls.build(step_judge=True)
    judge = FunctionLM(lambda p: judge_says(p.rsplit("The assistant replied ", 1)[1]))
    lm = tool_calls.ToolEpisodeLM(ScriptedLM(replies), judge=judge)
    out = run(lm.complete(task.render(tool_calls.SEED, task.examples[0]), 192))
    return json.loads(out.text), task.parse(out.text), judge.prompts, lm.llm_calls


def test_the_step_judge_skips_the_closing_turn_and_a_reply_that_is_no_call_list():
    create = json.dumps([{"name": "create_event", "arguments": {
        "title": "Budget review", "date": "2026-03-10", "time": "14:00"}}])
    lookup = json.dumps([{"name": "find_contact", "arguments": {"name": "Noor Pell"}}])
    yes_for_create = lambda replied: "yes" if "create_event" in replied else "no"
    # create (judged yes), lookup (judged no), [] (closes; not judged): 1 of 2 rated turns
    trace, parsed, asked, calls = _episode([create, lookup, "[]"], yes_for_create)
    assert [t.get("judge") for t in trace["turns"]] == [1.0, 0.0, None]
    assert parsed["step_judge"] == 0.5 and parsed["json_valid"] == 1.0
    assert len(asked) == 2 and calls == 3 + 2  # three assistant turns, two judge calls
    assert not any(q.rstrip().split("The assistant replied ", 1)[1].startswith("[]") for q in asked)
    # one good turn then []: 1.0 (rating the [] turn with this judge would make it 0.5)
    trace, parsed, asked, calls = _episode([create, "[]"], yes_for_create)
    assert parsed["step_judge"] == 1.0 and len(asked) == 1 and calls == 3
    # a prose reply ends the episode unjudged: no rated turn, step_judge 0
    trace, parsed, asked, calls = _episode(["Sure, I will do that."], lambda r: "yes")
    assert [t.get("judge") for t in trace["turns"]] == [None] and trace["turns"][0]["valid"] is False
    assert parsed["step_judge"] == 0.0 and asked == [] and calls == 1


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
