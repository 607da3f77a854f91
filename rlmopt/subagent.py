"""Recursive sub-agents (docs/rlmopt.md, Sub-agents): the tools and the skill of a child agent. Its
loop and `call_subagent` are in rlmopt/agent.py (`ChildAgent`, `call_subagent`), which the parent's
`Agent` gives its tools; `call_subagent(question, context, budget)` starts a child agent with its
own sandboxed REPL worker, its own conversation and a share of the parent's rollout budget.

- **Its own clock.** The child runs as a task on the harness's event loop, not inside the parent's
  code block: `call_subagent` waits for it only until shortly before the block's deadline
  (`ToolSet.wait_until`) and otherwise returns a handle ({"handle": "sub1", "status":
  "running"}); `subagent_result(handle)` waits again in a later block, and the agent loop hands a
  finished child's result to the parent in its next message. So a child that takes minutes
  still delivers its answer. A child still running when its parent stops is stopped (its spending
  stands).
- **Budget.** The child may spend at most the `budget` rollouts it was given (never more than the
  parent has left). Its share is reserved while it runs (the parent's `left()` excludes it) and
  every rollout it spends is charged to the same harness and counted by each of its ancestors as
  it happens, so the parent's budget falls by exactly what the child spent; what it did not
  spend is the parent's again once it ends.
- **Depth.** The parent agent is depth 0; a child at depth `subagent_max_depth` cannot start
  another one.
- **Sealing.** The child's tools are the parent's (a `ToolSet` over the same harness), so the
  test split is sealed for it exactly as for the parent. It cannot commit: only the depth-0 agent
  changes the running best; a child proposes a candidate through `final(candidate, answer)`,
  held to a commit's guards (length, placeholders) and kept out of the harness's candidates.
- **Record.** Its start and its result (answer, proposal, spending, stop reason) are harness
  history events (`subagent_start`, `subagent`, keyed by handle), so `subagent_result(handle)`
  still answers after the run is resumed; its conversation is RUN_DIR/subagents/<handle>-depth<d>.json.
- **Failure.** A child that crashes (its LM raising, anything in its loop) ends as an error
  returned to the parent, with what it spent still charged; the parent goes on.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from rlmopt.tools import ToolError, ToolSet

CHILD_SKILL = """You are a sub-agent of a prompt-optimisation agent. It gave you one question to
work out; answer it and stop. You have the same Python REPL and tools as your parent (see
describe_task() and the list below), with two differences: you cannot commit (commit_prompt is
refused), and your run_candidate budget is only the {budget} rollout(s) you were given.

TOOLS: describe_task, dataset_overview, peek_examples, view_example, query_examples,
score_explain, list_metrics, list_components, search_traces, describe_failure_patterns,
peek_failures, read_trace, synthesize_failures, synthesize_candidate, merge_candidates,
run_candidate(candidate, n=None), best_so_far, remaining_budget, pareto_frontier_status,
scratchpad_read, skill_library, call_subagent(question, context="", budget=0) and
subagent_result(handle) (if your depth allows), final(candidate=None, answer="").

Write Python in ```python fences; its printed output comes back to you. When you know the
answer, call final(candidate=..., answer="...") with your findings in a few sentences (and, if you
built one, the candidate you propose). You have at most {max_iter} replies."""


class ChildToolSet(ToolSet):
    """The tools of a sub-agent at `depth` with `budget` rollouts: the parent's, over the same
    harness, minus commits, with run_candidate capped at what is left of `budget`."""

    def __init__(self, parent: ToolSet, depth: int, budget: int):
        super().__init__(parent.h, parent.instructions, parent.library)
        self.parent, self.depth, self.budget, self.spent = parent, depth, budget, 0
        self.answer, self.claimed = "", None
        self.proposal: dict | None = None  # the candidate of `claimed`, kept by the child alone

    def left(self) -> int:
        """Rollouts this child may still spend: its share less what it and its descendants spent
        and what its running children hold."""
        return max(0, min(self.budget - self.spent - self.reserved(), self.h.budget_left()))

    async def run_candidate(self, candidate: Any, n: int | None = None) -> dict:
        # Charges are counted here, not after the evaluation: a sibling or the parent evaluating
        # at the same time changes rollouts_used too.
        out = await self.h.run_candidate(candidate, n, limit=self.left())
        charged = int(out.get("charged", 0))
        node: Any = self
        while isinstance(node, ChildToolSet):  # every ancestor's share pays for it
            node.spent += charged
            node = node.parent
        out["budget_left"] = self.left()
        return out

    def commit_prompt(self, candidate: Any, rationale: str = "") -> dict:
        raise ToolError("a sub-agent cannot commit; return the candidate to your parent with "
                        "final(candidate=..., answer=...)")

    def remaining_budget(self) -> dict:
        return {"budget": self.budget, "used": self.spent, "left": self.left()}

    def final(self, candidate: Any = None, answer: str = "") -> dict:
        """Ends the child; `candidate` (optional) is its proposal to the parent. It must pass the
        guards of Harness.proposal_reasons and stays out of the harness state (only the parent's
        own evaluation, charged, keeps it), so proposals cannot grow state.json."""
        if candidate is not None:
            cid, cand = self.h.resolve(candidate, register=False)
            reasons = self.h.proposal_reasons(cand)
            if reasons:
                raise ToolError(f"proposal of {cid} refused: " + "; ".join(reasons))
            self.claimed, self.proposal = cid, cand
        self.answer = str(answer)[:4000]
        self.finished = True
        return {"finished": True, "claimed": self.claimed}


@dataclass
class SubagentRun:
    """One started child: its `handle`, its tools and the asyncio task running its loop (whose
    result is the dict `call_subagent` documents). `delivered`: the parent has seen the result."""

    handle: str
    tools: ChildToolSet
    task: asyncio.Task
    delivered: bool = False

    def running(self) -> bool:
        return not self.task.done()

    def report(self) -> dict:
        if self.running():
            return {"handle": self.handle, "status": "running", "spent": self.tools.spent,
                    "budget": self.tools.budget,
                    "note": "the sub-agent runs on; call subagent_result(handle) in a later block"}
        self.delivered = True
        return self.task.result()
