"""Recursive sub-agents (docs/rlmopt.md, Sub-agents): `call_subagent(question, context, budget)`
starts a child agent with its own sandboxed REPL worker, its own conversation and a share of the
parent's rollout budget, runs it to its `final(...)`, and returns what it found.

- **Budget.** The child may spend at most the `budget` rollouts it was given (never more than the
  parent has left). Its evaluations are charged to the same harness, so the parent's budget falls
  by exactly what the child spent; what it did not spend stays the parent's.
- **Depth.** The parent agent is depth 0; a child at depth `subagent_max_depth` cannot start
  another one.
- **Sealing.** The child's tools are the parent's (a `ToolSet` over the same harness), so the
  test split is sealed for it exactly as for the parent. It cannot commit: only the depth-0 agent
  changes the running best; a child proposes a candidate through `final(candidate, answer)`.
- **Transcript.** Its conversation is saved as RUN_DIR/subagents/sub<k>-depth<d>.json.
- **Failure.** A child that crashes (its LM raising, anything in its loop) ends as an error
  returned to the parent, with what it spent still charged; the parent goes on.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlmopt.agent import Agent
from rlmopt.tools import ToolError, ToolSet

CHILD_SKILL = """You are a sub-agent of a prompt-optimisation agent. It gave you one question to
work out; answer it and stop. You have the same Python REPL and tools as your parent (see
describe_task() and the list below), with two differences: you cannot commit (commit_prompt is
refused), and your run_candidate budget is only the {budget} rollout(s) you were given.

TOOLS: describe_task, dataset_overview, peek_examples, view_example, query_examples,
score_explain, list_metrics, list_components, search_traces, describe_failure_patterns,
peek_failures, read_trace, synthesize_failures, synthesize_candidate, merge_candidates,
run_candidate(candidate, n=None), best_so_far, remaining_budget, pareto_frontier_status,
scratchpad_read, skill_library, call_subagent(question, context="", budget=0) (if your depth
allows), final(candidate=None, answer="").

Write Python in ```python fences; its printed output comes back to you. When you know the
answer, call final(candidate=..., answer="...") with your findings in a few sentences (and, if you
built one, the candidate you propose). You have at most {max_iter} replies."""


class ChildToolSet(ToolSet):
    """The tools of a sub-agent at `depth` with `budget` rollouts: the parent's, over the same
    harness, minus commits, with run_candidate capped at what is left of `budget`."""

    def __init__(self, parent: ToolSet, depth: int, budget: int):
        super().__init__(parent.h, parent.instructions, parent.library)
        self.depth, self.budget, self.spent = depth, budget, 0
        self.answer, self.claimed = "", None

    def left(self) -> int:
        return min(self.budget - self.spent, self.h.budget_left())

    async def run_candidate(self, candidate: Any, n: int | None = None) -> dict:
        before = self.h.state.rollouts_used
        out = await self.h.run_candidate(candidate, n, limit=self.left())
        self.spent += self.h.state.rollouts_used - before
        out["budget_left"] = self.left()
        return out

    def commit_prompt(self, candidate: Any, rationale: str = "") -> dict:
        raise ToolError("a sub-agent cannot commit; return the candidate to your parent with "
                        "final(candidate=..., answer=...)")

    def remaining_budget(self) -> dict:
        return {"budget": self.budget, "used": self.spent, "left": self.left()}

    def final(self, candidate: Any = None, answer: str = "") -> dict:
        if candidate is not None:
            self.claimed = self.h.resolve(candidate)[0]
        self.answer = str(answer)[:4000]
        self.finished = True
        return {"finished": True, "claimed": self.claimed}


class ChildAgent(Agent):
    """The loop of one sub-agent: the parent's loop with the child's opening, budget and cap."""

    def __init__(self, tools: ChildToolSet, lm: Any, question: str, context: str,
                 transcript: Path | None, log):
        super().__init__(tools.h, tools, lm, log=log, role="subagent", transcript=transcript)
        self.question, self.context = question, context
        self.max_iterations = tools.h.config.subagent_max_iterations

    def budget(self) -> tuple[int, int]:
        return self.tools.left(), self.tools.budget

    def _opening(self) -> list[dict]:
        t = self.tools.describe_task()
        intro = (f"Task: {t['name']}. {t['description']}\nDepth {self.tools.depth} of at most "
                 f"{self.h.config.subagent_max_depth}. Budget: {self.tools.budget} rollouts.\n"
                 f"Context from your parent:\n{self.context or '(none)'}\n\nQuestion: {self.question}")
        return [{"role": "system", "content": CHILD_SKILL.format(budget=self.tools.budget,
                                                                  max_iter=self.max_iterations)},
                {"role": "user", "content": intro}]


async def call_subagent(parent: ToolSet, question: str, context: str = "", budget: int = 0) -> dict:
    """Runs one child agent for `parent` (see the module docstring) and returns {answer,
    candidate_id, candidate, spent, budget, turns, stop_reason, transcript} or {error, spent}."""
    depth = getattr(parent, "depth", 0) + 1
    cfg = parent.h.config
    if depth > cfg.subagent_max_depth:
        raise ToolError(f"depth limit: a sub-agent at depth {depth - 1} cannot start another "
                        f"(subagent_max_depth={cfg.subagent_max_depth}); work it out yourself")
    if parent.agent_lm is None:
        raise ToolError("sub-agents need the agent's LM; call_subagent works inside an agent run")
    budget = int(budget)
    have = parent.left() if isinstance(parent, ChildToolSet) else parent.h.budget_left()
    if not 0 <= budget <= have:
        raise ToolError(f"budget={budget}: give a sub-agent between 0 and the {have} rollouts "
                        "you have left")
    child = ChildToolSet(parent, depth, budget)
    transcript = None
    if parent.h.run_dir is not None:
        folder = parent.h.run_dir / "subagents"
        k = len(list(folder.glob("sub*-depth*.json"))) + 1 if folder.is_dir() else 1
        transcript = folder / f"sub{k}-depth{depth}.json"
    agent = ChildAgent(child, parent.agent_lm, str(question), str(context), transcript,
                       log=lambda line: None)
    agent._save()  # claims the transcript's name before a grandchild counts the folder
    try:
        state = await agent.run()
    except Exception as exc:  # a child's crash must never take the parent down
        agent._save()
        if isinstance(parent, ChildToolSet):  # a grandchild's spending is its parent's too
            parent.spent += child.spent
        return {"error": f"sub-agent crashed ({type(exc).__name__}: {exc}); its spent rollouts "
                         "are charged", "spent": child.spent,
                "transcript": str(transcript) if transcript else None}
    if isinstance(parent, ChildToolSet):
        parent.spent += child.spent
    parent.h.state.history.append({"event": "subagent", "depth": depth, "budget": budget,
                                   "spent": child.spent, "turns": state.iteration,
                                   "stop_reason": state.stop_reason})
    parent.h.save()
    out = {"answer": child.answer, "candidate_id": child.claimed,
           "candidate": parent.h.state.candidates.get(child.claimed) if child.claimed else None,
           "spent": child.spent, "budget": budget, "turns": state.iteration,
           "stop_reason": state.stop_reason, "transcript": str(transcript) if transcript else None}
    return json.loads(json.dumps(out))
