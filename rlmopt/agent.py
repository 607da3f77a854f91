"""The recursive-LM agent loop (docs/rlmopt.md, Agent): each turn the optimizer LM writes Python in
fenced blocks; the blocks run in the sandboxed REPL, whose tools call back into the harness; the
printed output (truncated) is the next message. The loop ends when the agent calls final(), after
`optimizer_max_iterations` turns, when the budget is spent, or after three replies without code.

The conversation is saved to `agent.json` after every turn, so a resumed run continues from its
last turn (with a fresh REPL: variables are gone, the scratchpad is not).
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlmopt import stopping
from rlmopt.harness import Harness
from rlmopt.lm import BackendError, MeteredLM, render_chat
from rlmopt.sandbox import layers
from rlmopt.sandbox.repl import Repl
from rlmopt.skill import skill_prompt
from rlmopt.subagent import CHILD_SKILL, ChildToolSet
from rlmopt.tools import TOOL_NAMES, ToolError, ToolSet

_BLOCK = re.compile(r"```(?:python|py|repl)?[ \t]*\n(.*?)```", re.S)
_MAX_IDLE_REPLIES = 3
_HISTORY_TURNS = 6  # agent/REPL exchanges kept verbatim; older ones are elided (scratchpad persists)


def code_blocks(reply: str) -> list[str]:
    """The fenced code blocks of a reply (```python, ```py, ```repl or bare fences)."""
    return [b for b in _BLOCK.findall(reply) if b.strip()]


def truncate(text: str, limit: int) -> str:
    """Keeps the head and tail of `text` within `limit` characters."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - limit} characters cut] ...\n{text[-half:]}"


@dataclass
class AgentState:
    messages: list[dict] = field(default_factory=list)
    iteration: int = 0
    idle: int = 0
    last_turn_given: bool = False  # one more turn after the budget is spent, to commit or stop
    stop_reason: str = ""
    sandbox: dict = field(default_factory=dict)  # the REPL's layers in force (layers.summary)


class Agent:
    """Runs the search for one harness. `optimizer_lm` is metered as `role` ("optimizer"; a
    sub-agent's is "subagent"); `log` receives one progress line per turn; `transcript` is where
    the conversation is kept (default RUN_DIR/agent.json). The tools get `optimizer_lm` as their
    `agent_lm`, the LM their call_subagent starts child agents with."""

    def __init__(self, harness: Harness, tools: ToolSet, optimizer_lm: Any,
                 log: Callable[[str], None] = print, *, role: str = "optimizer",
                 transcript: Path | None = None):
        self.h, self.tools = harness, tools
        tools.agent_lm, tools.spawn = optimizer_lm, call_subagent
        self.lm = MeteredLM(optimizer_lm, harness.meter, role)
        self.log = log
        self.state = AgentState()
        self.max_iterations = harness.config.optimizer_max_iterations
        self.path = transcript or (harness.run_dir / "agent.json" if harness.run_dir else None)
        if self.path is not None and self.path.exists():
            self.state = AgentState(**json.loads(self.path.read_text()))

    def _save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(vars(self.state)))
            tmp.replace(self.path)

    def _opening(self) -> list[dict]:
        t = self.tools.describe_task()
        intro = (f"Task: {t['name']}. {t['description']}\nOutput fields: "
                 f"{json.dumps(t['fields'])}\nSplit sizes: {t['split_sizes']}\nSeed candidate:\n"
                 f"{json.dumps(t['seed_candidate'], indent=1)}\nSeed validation composite: "
                 f"{self.h.best_eval().composite:.3f}. Budget: {self.h.budget_left()} rollouts.\n"
                 "Begin by looking at the data.")
        return [{"role": "system", "content": skill_prompt(self.h.config)},
                {"role": "user", "content": intro}]

    def _context(self) -> list[dict]:
        msgs = self.state.messages
        head, turns = msgs[:2], msgs[2:]
        keep = 2 * _HISTORY_TURNS
        if len(turns) <= keep:
            return msgs
        note = {"role": "user", "content": f"[{(len(turns) - keep) // 2} earlier turns elided; "
                                           "use scratchpad_read() for your notes]"}
        return head + [note] + turns[-keep:]

    def budget(self) -> tuple[int, int]:
        """(rollouts left, rollouts given) to this agent."""
        return self.h.budget_left(), self.h.config.budget

    def _status(self) -> str:
        best = self.h.best_eval()
        left, given = self.budget()
        return (f"[turn {self.state.iteration}/{self.max_iterations}; budget "
                f"left {left} of {given}; running best "
                f"{best.composite:.3f}; commits {len(self.h.state.commits)}]")

    async def run(self) -> AgentState:
        if self.state.stop_reason:
            return self.state
        if not self.state.messages:
            self.state.messages = self._opening()
        elif self.state.iteration:
            self.state.messages.append({"role": "user", "content": "[the run was resumed after an "
                                        "interruption; the REPL is fresh, so variables are gone]"})
        loop = asyncio.get_running_loop()

        def dispatch(name: str, args: list, kwargs: dict) -> Any:
            return asyncio.run_coroutine_threadsafe(self.tools.call(name, args, kwargs), loop).result()

        repl = Repl(dispatch, TOOL_NAMES, self.h.config)
        await asyncio.to_thread(repl.start)  # a strict REPL missing a layer raises SandboxRefused
        self.state.sandbox = repl.sandbox_report()
        self.log(layers.log_line(self.state.sandbox))
        try:
            while not self.state.stop_reason:
                self.state.stop_reason = self._stop_reason()
                if self.state.stop_reason:
                    break
                await self._turn(repl)
                self._save()
        finally:
            await asyncio.to_thread(repl.close)
        self._save()
        self.log(f"agent stopped: {self.state.stop_reason}")
        return self.state

    def _stop_reason(self) -> str:
        if self.tools.finished:
            return "agent called final()"
        if self.state.iteration >= self.max_iterations:
            return f"optimizer_max_iterations ({self.max_iterations}) reached"
        if self.budget()[0] <= 0:
            if not self.state.last_turn_given:
                self.state.last_turn_given = True
                return ""
            return "budget spent"
        if self.state.idle >= _MAX_IDLE_REPLIES:
            return f"{_MAX_IDLE_REPLIES} replies in a row without code"
        return stopping.stop_reason(self.h)

    async def _turn(self, repl: Repl) -> None:
        self.state.iteration += 1
        try:
            reply = (await self.lm.complete(render_chat(self._context()),
                                            self.h.config.optimizer_max_tokens)).text
        except BackendError as exc:
            self.state.stop_reason = f"optimizer LM failed ({exc.kind}): {exc.message}"
            return
        self.state.messages.append({"role": "assistant", "content": reply})
        blocks = code_blocks(reply)
        if not blocks:
            self.state.idle += 1
            self.state.messages.append({"role": "user", "content": "No ```python block found. "
                                        "Write code in ```python fences, or call final() to stop. "
                                        + self._status()})
            self.log(f"turn {self.state.iteration}: no code  {self._status()}")
            return
        self.state.idle = 0
        parts = []
        for k, block in enumerate(blocks):
            res = await asyncio.to_thread(repl.run, block)
            text = res.output
            if res.error:
                text += ("\n" if text else "") + res.error
            if res.killed:
                text += ("\n" if text else "") + "KILLED: " + res.killed
            parts.append(f"[block {k + 1} output]\n{text.strip() or '(nothing printed)'}")
            if self.tools.finished:
                break
        out = truncate("\n\n".join(parts), self.h.config.output_chars)
        self.state.messages.append({"role": "user", "content": out + "\n" + self._status()})
        self.log(f"turn {self.state.iteration}: {len(blocks)} block(s)  {self._status()}")


# -- sub-agents (rlmopt/subagent.py): a child's loop, started by the call_subagent tool --------------

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
    out = {"answer": child.answer, "candidate_id": child.claimed, "candidate": child.proposal,
           "spent": child.spent, "budget": budget, "turns": state.iteration,
           "stop_reason": state.stop_reason, "transcript": str(transcript) if transcript else None}
    return json.loads(json.dumps(out))
