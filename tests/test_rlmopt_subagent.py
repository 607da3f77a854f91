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


class SlowChildLM:
    """The parent's script is served at once; a child's replies (its prompts carry the child
    skill) come from `child` after `delay[k]` seconds (reply k on the child's k-th turn). The
    parent's reply number `hold_at` (1-based) is held until `until()` holds, and then raises
    when `crash` (a run that dies mid-way): events, not timings, order the test."""

    def __init__(self, parent, child, delay, hold_at=None, until=None, crash=False):
        self.parent, self.child, self.delay = ScriptedLM(parent), child, delay
        self.hold_at, self.until, self.crash, self.child_turns = hold_at, until, crash, 0

    async def complete(self, prompt, max_tokens):
        if "You are a sub-agent" in prompt:
            self.child_turns += 1
            k = min(self.child_turns, len(self.child)) - 1
            if self.delay[k]:
                await asyncio.sleep(self.delay[k])
            return await ScriptedLM([self.child[k]]).complete(prompt, max_tokens)
        if self.hold_at is not None and len(self.parent.prompts) + 1 == self.hold_at:
            for _ in range(600):
                if self.until():
                    break
                await asyncio.sleep(0.05)
            if self.crash:
                raise RuntimeError("power cut")
        return await self.parent.complete(prompt, max_tokens)


SLOW_CHILD = """```python
r = run_candidate("A<50 for {x}", n=5)
final(candidate="A<50 for {x}", answer=f"A<50 fixes field a ({r['composite']:.2f} on 5)")
```"""
START = """```python
h = call_subagent("does A<50 help?", budget=6)
print('started', h['status'], h['handle'], remaining_budget())
print('parent run', run_candidate("A<20 for {x}", n=5).get('error'))
```"""
POLL = """```python
r = subagent_result('sub1')
print('result', r['status'], r.get('answer'), r.get('spent'))
if r['status'] == 'finished':
    final()
```"""


def test_a_child_slower_than_the_parents_block_still_delivers_its_answer(tmp_path):
    """A child whose LM takes 3 s per reply outlives the parent's 2 s block: the parent gets a
    handle (its 6 rollouts held back from it meanwhile), its block is not killed, and a later
    block gets the child's answer; the 5 rollouts the child spent are charged once."""
    h = toy_harness(budget=10, run_dir=tmp_path, block_timeout_s=2)
    run(h.evaluate_seed())
    lm = SlowChildLM([START, POLL], [SLOW_CHILD], delay=[3.0])
    state = run(Agent(h, ToolSet(h), lm, log=lambda s: None).run())
    seen = "\n".join(m["content"] for m in state.messages if m["role"] == "user")
    assert "KILLED" not in seen and state.stop_reason == "agent called final()", seen
    assert "started running sub1 {'budget': 10, 'used': 0, 'left': 4}" in seen
    assert "parent run budget: this evaluation needs 5 rollouts but 4 are left" in seen
    assert "result finished A<50 fixes field a (0.40 on 5) 5" in seen
    assert h.state.rollouts_used == 5 and h.budget_left() == 5
    done = [e for e in h.state.history if e["event"] == "subagent"]
    assert [(e["handle"], e["spent"], e["result"]["candidate"]) for e in done] == \
        [("sub1", 5, {"system_prompt": "A<50 for {x}"})]


def test_a_childs_result_survives_a_resume_and_a_stopping_parent_stops_its_child(tmp_path):
    # the parent dies after its child finished but before it read the result; the resumed
    # parent (a fresh REPL) gets the recorded result without the child running again
    h = toy_harness(budget=10, run_dir=tmp_path, block_timeout_s=2)
    run(h.evaluate_seed())
    lm = SlowChildLM([START, POLL], [SLOW_CHILD], delay=[3.0], hold_at=2, crash=True,
                     until=lambda: any(e["event"] == "subagent" for e in h.state.history))
    try:
        run(Agent(h, ToolSet(h), lm, log=lambda s: None).run())
        raise AssertionError("the run should have died")
    except RuntimeError as exc:
        assert str(exc) == "power cut"
    h = toy_harness(budget=10, run_dir=tmp_path, block_timeout_s=2)
    assert h.state.rollouts_used == 5
    lm2 = SlowChildLM([POLL], [SLOW_CHILD], delay=[3.0])
    state = run(Agent(h, ToolSet(h), lm2, log=lambda s: None).run())
    seen = "\n".join(m["content"] for m in state.messages if m["role"] == "user")
    assert "result finished A<50 fixes field a (0.40 on 5) 5" in seen and lm2.child_turns == 0
    assert state.stop_reason == "agent called final()" and h.state.rollouts_used == 5
    # a parent that stops while its child waits on its LM stops the child; what it spent stands
    h = toy_harness(budget=10, run_dir=tmp_path / "stop", block_timeout_s=2)
    run(h.evaluate_seed())
    first = '```python\nprint(run_candidate("A<40 for {x}", n=3)["n"])\n```'
    lm = SlowChildLM([START, "```python\nfinal()\n```"], [first, SLOW_CHILD], delay=[0, 60.0],
                     hold_at=2, until=lambda: h.state.rollouts_used >= 3)
    state = run(Agent(h, ToolSet(h), lm, log=lambda s: None).run())
    assert state.stop_reason == "agent called final()" and h.state.rollouts_used == 3
    (end,) = [e["result"] for e in h.state.history if e["event"] == "subagent"]
    assert end["status"] == "stopped" and end["spent"] == 3 and "parent agent stopped" in end["error"]
    h = toy_harness(budget=10, run_dir=tmp_path / "stop", block_timeout_s=2)
    assert run(ToolSet(h).call("subagent_result", ["sub1"]))["status"] == "stopped"


class DepthLM:
    """Scripted replies per depth (a child's opening says "Depth d of at most"), reply k of
    depth d on its k-th turn, each after delays[d] seconds."""

    def __init__(self, scripts, delays):
        self.scripts, self.delays, self.turns = scripts, delays, [0] * len(scripts)

    async def complete(self, prompt, max_tokens):
        m = re.search(r"Depth (\d) of at most", prompt)
        d = int(m.group(1)) if m else 0
        self.turns[d] += 1
        await asyncio.sleep(self.delays[d])
        k = min(self.turns[d], len(self.scripts[d])) - 1
        return await ScriptedLM([self.scripts[d][k]]).complete(prompt, max_tokens)


def test_a_child_that_gave_its_whole_share_to_a_slow_grandchild_waits_for_it(tmp_path):
    """The child hands all 5 of its rollouts to a grandchild slower than a block: the child's
    budget is held, not spent, so it goes on polling instead of stopping, and the grandchild's
    answer travels up both levels."""
    child = ['```python\ng = call_subagent("deeper", budget=5)\n'
             'print("child got", g["status"], remaining_budget())\n```',
             '```python\nr = subagent_result("sub2")\nif r["status"] == "finished":\n'
             '    final(answer="via grandchild: " + r["answer"])\n```']
    grand = ['```python\nr = run_candidate("A<30 for {x}", n=4)\nfinal(answer=f"grand spent {r[\'n\']}")\n```']
    h = toy_harness(budget=10, run_dir=tmp_path, block_timeout_s=2)
    run(h.evaluate_seed())
    lm = DepthLM([[START.replace("budget=6", "budget=5"), POLL], child, grand], [0, 0, 4.0])
    state = run(Agent(h, ToolSet(h), lm, log=lambda s: None).run())
    seen = "\n".join(m["content"] for m in state.messages if m["role"] == "user")
    assert "KILLED" not in seen and "result finished via grandchild: grand spent 4 4" in seen, seen
    assert "child got running {'budget': 5, 'used': 0, 'left': 0}" in _outputs(
        str(tmp_path / "subagents" / "sub1-depth1.json"))
    assert "parent run None" in seen  # the 5 not held for the child were the parent's to spend
    assert h.state.rollouts_used == 5 + 4 and h.budget_left() == 1


_DIES = """
import asyncio, os, sys
sys.path.insert(0, {root!r})
import signal
from rlmopt.agent import Agent
from rlmopt.sandbox.repl import Repl
from rlmopt.tools import ToolSet
from tests.rlmopt_fakes import toy_harness
from tests.test_rlmopt_subagent import START, SLOW_CHILD, SlowChildLM

workers, start = [], Repl.start
def tracked(self):
    start(self)
    workers.append(self.proc.pid)
Repl.start = tracked

h = toy_harness(budget=10, run_dir={run_dir!r}, block_timeout_s=2)
asyncio.run(h.evaluate_seed())
first = '```python\\nprint(run_candidate("A<40 for {{x}}", n=3)["n"])\\n```'

def die():
    if h.state.rollouts_used >= 3:  # the machine dies with the child running: no cleanup runs
        for pid in workers:
            os.killpg(pid, signal.SIGKILL)
        os._exit(9)
    return False

lm = SlowChildLM([START, "```python\\nfinal()\\n```"], [first, SLOW_CHILD], delay=[0, 60.0],
                 hold_at=2, until=die)
asyncio.run(Agent(h, ToolSet(h), lm, log=lambda s: None).run())
"""


def test_a_child_running_when_the_process_died_is_reported_lost(tmp_path):
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[1])
    code = _DIES.format(root=root, run_dir=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 9, out.stderr[-2000:]
    h = toy_harness(budget=10, run_dir=tmp_path, block_timeout_s=2)
    assert h.state.rollouts_used == 3  # what it spent before the death stays charged
    lost = run(ToolSet(h).call("subagent_result", ["sub1"]))
    assert lost["status"] == "lost" and "still running when the run stopped" in lost["error"]
    assert "no sub-agent 'sub2'" in run(ToolSet(h).call("subagent_result", ["sub2"]))["error"]
