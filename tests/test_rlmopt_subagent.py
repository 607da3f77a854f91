"""Recursive sub-agents (rlmopt/subagent.py): a child agent in its own sandboxed REPL with a share
of the parent's budget; depth limit, budget accounting, sealing, transcripts, crashes."""
import asyncio
import json
import re

from rlmopt.agent import Agent, call_subagent
from rlmopt.lm import ScriptedLM
from rlmopt.tools import SEALED, ToolSet
from tests.rlmopt_fakes import toy_harness

RATIONALE = "adds the directive for field a so that more items are answered right"


def run(coro):
    return asyncio.run(coro)


def _parent(tmp_path, replies, budget=100, **cfg):
    h = toy_harness(budget=budget, run_dir=tmp_path, block_timeout_s=20, **cfg)
    run(h.evaluate_seed())
    tools = ToolSet(h)
    tools.agent_lm = ScriptedLM(replies) if isinstance(replies, list) else replies
    tools.spawn = call_subagent  # what an Agent gives its tools
    return h, tools


def _outputs(transcript: str) -> str:
    """The REPL outputs a child saw (the user messages after its opening)."""
    messages = json.loads(open(transcript).read())["messages"]
    return "\n".join(m["content"] for m in messages[2:] if m["role"] == "user")


CHILD = f"""```python
print('full', run_candidate("A<50 for {{x}}"))
r = run_candidate("A<50 for {{x}}", n=5)
print('five', r['n'], r['budget_left'])
print('more', run_candidate("A<60 for {{x}}", n=1))
print('commit', commit_prompt("A<50 for {{x}}", "{RATIONALE}"))
final(candidate="A<50 for {{x}}", answer="A<50 fixes field a")
```"""


def test_a_child_spends_at_most_its_budget_and_the_parent_pays_exactly_that(tmp_path):
    h, tools = _parent(tmp_path, [CHILD])
    calls_before, used_before = len(h.task_lm.lm.prompts), h.state.rollouts_used
    out = run(tools.call("call_subagent", ["does A<50 help?"], {"budget": 5}))
    assert out["spent"] == 5 and out["budget"] == 5 and out["answer"] == "A<50 fixes field a"
    assert out["candidate"] == {"system_prompt": "A<50 for {x}"}
    assert h.state.rollouts_used - used_before == 5 == len(h.task_lm.lm.prompts) - calls_before
    assert h.budget_left() == 95 and h.state.commits == []  # a child cannot commit
    seen = _outputs(out["transcript"])
    assert "needs 40 rollouts but 5 are left" in seen and "five 5 0" in seen
    assert "needs 1 rollouts but 0 are left" in seen and "a sub-agent cannot commit" in seen
    assert out["transcript"].endswith("subagents/sub1-depth1.json")
    assert h.meter.calls["subagent"] == 1
    # a child cannot be given more than the parent has left
    assert "between 0 and the 95 rollouts" in run(tools.call("call_subagent", ["q"], {"budget": 96}))["error"]


GRAND = """```python
r = run_candidate("A<30 for {x}", n=2)
final(answer=f"grandchild spent {remaining_budget()['used']}")
```"""


def _nesting(depth):
    child_1 = """```python
print('too much', call_subagent("deeper", budget=6))
g = call_subagent("deeper", budget=3)
print('grand', g.get('answer'), g.get('spent'), g.get('error'))
print('left', remaining_budget())
```"""
    child_2 = """```python
r = run_candidate("A<40 for {x}", n=3)
print('child run', r.get('n'), r.get('error'))
final(answer='done')
```"""
    # ScriptedLM serves child turn 1, then (depth 2 allowed) the grandchild, then child turn 2
    return [child_1, GRAND, child_2] if depth >= 2 else [child_1, child_2]


def test_nesting_charges_every_level_and_stops_at_the_depth_limit(tmp_path):
    h, tools = _parent(tmp_path / "deep", _nesting(2), subagent_max_depth=2)
    out = run(tools.call("call_subagent", ["nest"], {"budget": 5}))
    seen = _outputs(out["transcript"])
    assert "between 0 and the 5 rollouts" in seen  # 6 > the child's 5
    assert "grand grandchild spent 2 2 None" in seen
    assert "'used': 2, 'left': 3" in seen and "child run 3 None" in seen
    assert out["spent"] == 5 and h.state.rollouts_used == 5
    assert (tmp_path / "deep" / "subagents" / "sub2-depth2.json").exists()
    h, tools = _parent(tmp_path / "flat", _nesting(1), subagent_max_depth=1)
    out = run(tools.call("call_subagent", ["nest"], {"budget": 5}))
    seen = _outputs(out["transcript"])
    assert "depth limit: a sub-agent at depth 1 cannot start another" in seen
    assert out["spent"] == 3 and h.state.rollouts_used == 3
    assert not list((tmp_path / "flat" / "subagents").glob("*depth2*"))


def test_the_test_split_is_sealed_for_a_child(tmp_path):
    h = toy_harness(budget=100, run_dir=tmp_path, block_timeout_s=20)
    test_ids = [e.id for e in h.splits.test]
    code = f"""```python
for t in {test_ids[:3]!r}:
    print(view_example(t), read_trace(None, t), score_explain('x', example_id=t))
print(peek_examples('test'), query_examples(split='test'))
print(peek_examples('train', n=500), search_traces('item', limit=500))
final(answer='looked')
```"""
    run(h.evaluate_seed())
    tools = ToolSet(h)
    tools.agent_lm, tools.spawn = ScriptedLM([code]), call_subagent
    out = run(tools.call("call_subagent", ["show me the test set"], {"budget": 0}))
    seen = _outputs(out["transcript"])
    assert seen.count(SEALED) == 2 + 3 * 3  # peek, query; per id view, read_trace, score
    for e in h.splits.test:
        for text in (e.id, e.inputs["x"], e.expected["a"]):
            assert not re.search(rf"\b{re.escape(text)}\b", seen), text


class CrashingLM:
    """The parent's script; any prompt of a child (its skill text) raises."""

    def __init__(self, parent_replies):
        self.parent = ScriptedLM(parent_replies)

    async def complete(self, prompt, max_tokens):
        if "You are a sub-agent" in prompt:
            if "[block 1 output]" in prompt:  # the child's second turn: its LM dies
                raise RuntimeError("child LM exploded")
            return await ScriptedLM(['```python\nprint(run_candidate("A<50 for {x}", n=3))\n```']) \
                .complete(prompt, max_tokens)
        return await self.parent.complete(prompt, max_tokens)


def test_a_crashing_child_does_not_crash_the_parent(tmp_path):
    h = toy_harness(budget=100, run_dir=tmp_path, block_timeout_s=20)
    run(h.evaluate_seed())
    lm = CrashingLM(['```python\nr = call_subagent("why", budget=4)\nprint(r)\n```',
                     '```python\nprint("parent goes on", remaining_budget())\nfinal()\n```'])
    state = run(Agent(h, ToolSet(h), lm, log=lambda s: None).run())
    assert state.stop_reason == "agent called final()" and state.iteration == 2
    replies = [m["content"] for m in state.messages if m["role"] == "user"]
    assert "sub-agent crashed (RuntimeError: child LM exploded)" in replies[1]
    assert "parent goes on {'budget': 100, 'used': 3, 'left': 97}" in replies[2]
    assert h.state.rollouts_used == 3  # what the child spent before it crashed stays charged
    assert (tmp_path / "subagents" / "sub1-depth1.json").exists()


def test_a_child_may_be_given_exactly_what_is_left_and_no_more(tmp_path):
    # the parent spends 3 of 10, so 7 are left: 8 is refused, exactly 7 is allowed; the child
    # spends 2 and may hand its grandchild exactly its remaining 5 (not 6), which spends them all
    child_1 = """```python
r = run_candidate("A<40 for {x}", n=2)
print('over', call_subagent("deeper", budget=6).get('error'))
g = call_subagent("deeper", budget=5)
print('grand', g.get('error'), g.get('budget'), g.get('spent'), remaining_budget())
```"""
    grand = """```python
r = run_candidate("A<30 for {x}", n=5)
print(r.get('error'))
final(answer=f"grandchild spent {remaining_budget()['used']}")
```"""
    child_2 = "```python\nfinal(answer='child done')\n```"
    h, tools = _parent(tmp_path, [child_1, grand, child_2], budget=10, subagent_max_depth=2)
    assert "error" not in run(tools.call("run_candidate", ["A<20 for {x}"], {"n": 3}))
    assert h.budget_left() == 10 - 3
    over = run(tools.call("call_subagent", ["q"], {"budget": 8}))
    assert "between 0 and the 7 rollouts" in over["error"] and h.budget_left() == 7
    out = run(tools.call("call_subagent", ["spend all of it"], {"budget": 7}))
    assert "error" not in out and out["budget"] == 7 and out["answer"] == "child done"
    seen = _outputs(out["transcript"])
    assert "over budget=6: give a sub-agent between 0 and the 5 rollouts" in seen
    assert "grand None 5 5 {'budget': 7, 'used': 7, 'left': 0}" in seen
    assert out["spent"] == 2 + 5 and h.state.rollouts_used == 3 + 2 + 5 and h.budget_left() == 0
    subagents = [e for e in h.state.history if e["event"] == "subagent"]
    assert [(e["depth"], e["budget"], e["spent"]) for e in subagents] == [(2, 5, 5), (1, 7, 7)]



def test_a_childs_proposals_are_capped_and_stay_out_of_the_state(tmp_path):
    """A child that proposes 20 oversized candidates is refused each time; its last, valid
    proposal comes back to the parent without joining the harness state (the parent must run it,
    charged, to keep it), so state.json stays as it was."""
    child = """```python
for k in range(20):
    print(final(candidate="A<50 for {x} " + "z" * 100000 + str(k), answer="big"))
print(final(candidate="A<70 for {x}", answer="try A<70"))
```"""
    h, tools = _parent(tmp_path, [child])
    size = (tmp_path / "state.json").stat().st_size
    out = run(tools.call("call_subagent", ["propose something"], {"budget": 0}))
    seen = _outputs(out["transcript"])
    assert seen.count("max_candidate_chars") == 20, seen[:500]
    assert out["candidate"] == {"system_prompt": "A<70 for {x}"} and out["answer"] == "try A<70"
    assert out["candidate_id"] not in h.state.candidates and list(h.state.candidates) == [h.state.seed_id]
    assert (tmp_path / "state.json").stat().st_size < size + 1000
