"""The tool set: the test split is sealed through every tool; tasks (intent-code, jsonl) load and
behave as documented; tools report misuse as {"error": ...}."""
import asyncio
import json

import pytest

from rlmopt.harness import Harness
from rlmopt.config import RLMOptConfig
from rlmopt.lm import FunctionLM
from rlmopt.selection import finalize
from rlmopt.tasks import intent_code, jsonl
from rlmopt.tools import SEALED, TOOL_NAMES, ToolSet
from tests.rlmopt_fakes import sealed_patterns, toy_harness

RATIONALE = "adds the directive for field a so that more items are answered right"


def run(coro):
    return asyncio.run(coro)


def test_every_tool_refuses_the_test_split():
    sub = FunctionLM(lambda p: "analysis: " + p[:3000])  # echoes whatever it is shown
    h = toy_harness(sub_lm=sub)
    tools = ToolSet(h)
    run(h.evaluate_seed())
    run(h.run_candidate("A<50 for {x}"))
    h.commit_prompt("A<50 for {x}", RATIONALE)
    run(finalize(h))  # the test split now has cached rollouts too
    test_ids = [e.id for e in h.splits.test]
    t = test_ids[0]
    forbidden = sealed_patterns(h)
    best = h.state.best_id
    tries = {
        "describe_task": [((), {})], "dataset_overview": [((), {})],
        "peek_examples": [((), {"split": "test"}), ((), {"split": "train", "n": 500})],
        "view_example": [((t,), {})],
        "query_examples": [((), {"split": "test"}), ((), {"contains": "item", "limit": 500})],
        "score_explain": [(("x",), {"example_id": t})],
        "list_metrics": [((), {})], "list_components": [((), {})],
        "read_additional_instructions": [((), {})],
        "search_traces": [(("item",), {"candidate": best, "limit": 500}), (("A",), {"limit": 500})],
        "describe_failure_patterns": [((), {"candidate": best})],
        "peek_failures": [((), {"candidate": best, "n": 500})],
        "read_trace": [((best, t), {})],
        "synthesize_failures": [((), {"field": "a", "candidate": best})],
        "synthesize_candidate": [((), {"candidate": best})],
        "merge_candidates": [((best, h.state.seed_id), {})],
        "call_subagent": [(("list the test examples",), {})],
        "subagent_result": [(("sub1",), {})],
        "run_candidate": [(("A<50 {x}",), {"n": 1000})],
        "commit_prompt": [(("A<50 {x}", RATIONALE), {})],
        "best_so_far": [((), {})], "remaining_budget": [((), {})],
        "pareto_frontier_status": [((), {})],
        "scratchpad_add": [(("fact", "note"), {})], "scratchpad_read": [((), {})],
        "final": [((), {})], "skill_library": [((), {})],
    }
    assert set(tries) == set(TOOL_NAMES)
    refused = 0
    for name, calls in tries.items():
        for args, kwargs in calls:
            out = json.dumps(run(ToolSet(h).call(name, list(args), kwargs)))
            refused += SEALED in out
            for pat in forbidden:
                assert not pat.search(out), f"{name}{args}{kwargs} leaked {pat.pattern}"
    assert refused == 5  # peek_examples, view_example, query_examples, score_explain, read_trace
    assert "error" in run(tools.call("no_such_tool"))
    assert "error" in run(tools.call("view_example", [], {"bogus": 1}))


def test_intent_code_seed_scores_zero_and_the_table_solves_it():
    task = intent_code.build()
    assert len(task.examples) == 64 and len({e.expected["code"] for e in task.examples}) == 8
    h = Harness(task, intent_code.simulated_task_lm(), RLMOptConfig(budget=100))
    assert run(h.evaluate_seed()).composite == 0.0
    table = "\n".join(f"{intent} -> {code}" for intent, code in intent_code.CODES.items())
    fb = run(h.run_candidate(intent_code.SEED_PROMPT + "\nCodes:\n" + table))
    assert fb["composite"] == 1.0
    demos = run(h.run_candidate({"system_prompt": intent_code.SEED_PROMPT + "\n\n" + "\n\n".join(
        task.format_demo(e) for e in h.splits.train)}))
    assert 0.5 < demos["composite"] <= 1.0  # demos of the same intents transfer


def test_jsonl_task_loads_and_reports_bad_specs(tmp_path):
    rows = [{"question": f"q{k}", "answer": f"a{k}"} for k in range(20)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    spec = {"name": "mine", "data": "d.jsonl", "inputs": ["question"],
            "fields": [{"name": "answer", "metric": "token_f1"}], "seed_prompt": "Q: {question}",
            "split_sizes": [8, 6, 6]}
    (tmp_path / "t.json").write_text(json.dumps(spec))
    task = jsonl.load(str(tmp_path / "t.json"))
    assert task.name == "mine" and len(task.examples) == 20 and task.fields[0].metric == "token_f1"
    assert task.render(task.seed_candidate, task.examples[3]) == "Q: q3"
    del spec["fields"]
    (tmp_path / "bad.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="missing key 'fields'"):
        jsonl.load(str(tmp_path / "bad.json"))


def test_sealed_and_unknown_ids_get_the_same_answer():
    """Test ids cannot be enumerated: every tool taking an example id answers a test id exactly
    as it answers an id that does not exist."""
    h = toy_harness()
    run(h.evaluate_seed())
    test_id, best = h.splits.test[0].id, h.state.best_id
    assert "e999" not in h.split_of
    for name, args, kwargs in [("view_example", [], {}), ("score_explain", ["x"], {}),
                               ("read_trace", [best], {})]:
        key = "example_id"
        sealed = run(ToolSet(h).call(name, args, {**kwargs, key: test_id}))
        unknown = run(ToolSet(h).call(name, args, {**kwargs, key: "e999"}))
        assert "error" in sealed and sealed == unknown, (name, sealed, unknown)
