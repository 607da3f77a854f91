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
from rlmopt.subagent import CHILD_SKILL, ChildToolSet, SubagentRun
from rlmopt.tools import TOOL_NAMES, ToolError, ToolSet

_BLOCK = re.compile(r"```(?:python|py|repl)?[ \t]*\n(.*?)```", re.S)
_MAX_IDLE_REPLIES = 3
_HISTORY_TURNS = 6  # agent/REPL exchanges kept verbatim; older ones are elided (scratchpad persists)


def code_blocks(reply: str) -> list[str]:
    """The fenced code blocks of a reply (```python, ```py, ```repl or bare fences)."""
    return [b for b in _BLOCK.findall(reply) if b.strip()]


async def finished(fut: asyncio.Future) -> Any:
    """Awaits `fut` (a REPL call in a thread) to its end even when the awaiting task is cancelled
    meanwhile, then re-raises the cancellation: a REPL is never closed under a running block."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise


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
            self.tools.deadline = repl.deadline  # waiting tools return before the block's end
            return asyncio.run_coroutine_threadsafe(self.tools.call(name, args, kwargs), loop).result()

        repl = Repl(dispatch, TOOL_NAMES, self.h.config)
        try:
            # a strict REPL missing a layer raises SandboxRefused
            await finished(asyncio.ensure_future(asyncio.to_thread(repl.start)))
            self.state.sandbox = repl.sandbox_report()
            self.log(layers.log_line(self.state.sandbox))
            while not self.state.stop_reason:
                self.state.stop_reason = self._stop_reason()
                if self.state.stop_reason:
                    break
                await self._turn(repl)
                self._save()
        finally:
            await self._stop_children()
            await asyncio.to_thread(repl.close)
        self._save()
        self.log(f"agent stopped: {self.state.stop_reason}")
        return self.state

    async def _stop_children(self) -> None:
        """Stops the sub-agents still running when this agent stops (each records its end)."""
        running = [r.task for r in self.tools.children.values() if r.running()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)

    def _news(self) -> str:
        """The results of sub-agents that finished since the agent last saw them, one line each."""
        lines = []
        for handle, r in self.tools.children.items():
            if not r.running() and not r.delivered:
                lines.append(f"[sub-agent {handle} finished: {json.dumps(r.report())}]")
        running = [h for h, r in self.tools.children.items() if r.running()]
        if running:
            lines.append(f"[sub-agents running: {', '.join(running)}; subagent_result(handle) "
                         "waits for one]")
        return "\n".join(lines) + "\n" if lines else ""

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
                                        + self._news() + self._status()})
            self.log(f"turn {self.state.iteration}: no code  {self._status()}")
            return
        self.state.idle = 0
        parts = []
        for k, block in enumerate(blocks):
            res = await finished(asyncio.ensure_future(asyncio.to_thread(repl.run, block)))
            text = res.output
            if res.error:
                text += ("\n" if text else "") + res.error
            if res.killed:
                text += ("\n" if text else "") + "KILLED: " + res.killed
            parts.append(f"[block {k + 1} output]\n{text.strip() or '(nothing printed)'}")
            if self.tools.finished:
                break
        out = truncate("\n\n".join(parts), self.h.config.output_chars)
        self.state.messages.append({"role": "user", "content": out + "\n" + self._news()
                                    + self._status()})
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
        # what its running children hold counts as not spent: the child waits for them
        return max(0, min(self.tools.budget - self.tools.spent, self.h.budget_left())), \
            self.tools.budget

    def _opening(self) -> list[dict]:
        t = self.tools.describe_task()
        intro = (f"Task: {t['name']}. {t['description']}\nDepth {self.tools.depth} of at most "
                 f"{self.h.config.subagent_max_depth}. Budget: {self.tools.budget} rollouts.\n"
                 f"Context from your parent:\n{self.context or '(none)'}\n\nQuestion: {self.question}")
        return [{"role": "system", "content": CHILD_SKILL.format(budget=self.tools.budget,
                                                                  max_iter=self.max_iterations)},
                {"role": "user", "content": intro}]


async def call_subagent(parent: ToolSet, question: str, context: str = "", budget: int = 0) -> dict:
    """Starts one child agent for `parent` (see rlmopt/subagent.py) on the event loop and waits for
    it until `parent.wait_until()` (the end of the calling block less a margin; unbounded outside
    an agent run). Returns its result {handle, status: "finished", answer, candidate_id,
    candidate, spent, budget, turns, stop_reason, transcript} (or {handle, status, error, spent}
    for a crash), or, if it is still running, {handle, status: "running", spent, budget}."""
    depth = getattr(parent, "depth", 0) + 1
    h = parent.h
    cfg = h.config
    if depth > cfg.subagent_max_depth:
        raise ToolError(f"depth limit: a sub-agent at depth {depth - 1} cannot start another "
                        f"(subagent_max_depth={cfg.subagent_max_depth}); work it out yourself")
    if parent.agent_lm is None:
        raise ToolError("sub-agents need the agent's LM; call_subagent works inside an agent run")
    budget = int(budget)
    have = parent.left()
    if not 0 <= budget <= have:
        raise ToolError(f"budget={budget}: give a sub-agent between 0 and the {have} rollouts "
                        "you have left")
    # handles count the starts in the history, so they stay unique across resumed sessions
    handle = f"sub{1 + sum(e.get('event') == 'subagent_start' for e in h.state.history)}"
    child = ChildToolSet(parent, depth, budget)
    transcript = h.run_dir / "subagents" / f"{handle}-depth{depth}.json" if h.run_dir else None
    agent = ChildAgent(child, parent.agent_lm, str(question), str(context), transcript,
                       log=lambda line: None)
    h.state.history.append({"event": "subagent_start", "handle": handle, "depth": depth,
                            "budget": budget, "question": str(question)[:500]})
    h.save()
    run = SubagentRun(handle, child, asyncio.ensure_future(_run_child(agent, handle, transcript)))
    parent.children[handle] = run
    await parent.wait_for(run.task)
    return run.report()


async def _run_child(agent: ChildAgent, handle: str, transcript: Path | None) -> dict:
    """One child's loop to its end; records its result in the harness history (event
    "subagent") and returns it. A crash becomes an error result, a cancellation (its parent
    stopped) a "stopped" one."""
    child, h = agent.tools, agent.h
    base = {"handle": handle, "depth": child.depth, "budget": child.budget,
            "transcript": str(transcript) if transcript else None}
    try:
        state = await agent.run()
    except asyncio.CancelledError:  # only its parent cancels it, and then waits for this result
        agent._save()
        return _record(h, base | {"status": "stopped", "spent": child.spent,
                                  "error": "sub-agent stopped: its parent agent stopped first"})
    except Exception as exc:  # a child's crash must never take the parent down
        agent._save()
        return _record(h, base | {"status": "crashed", "spent": child.spent,
                                  "error": f"sub-agent crashed ({type(exc).__name__}: {exc}); "
                                           "its spent rollouts are charged"})
    return _record(h, base | {"status": "finished", "answer": child.answer,
                              "candidate_id": child.claimed, "candidate": child.proposal,
                              "spent": child.spent, "turns": state.iteration,
                              "stop_reason": state.stop_reason})


def _record(h: Harness, result: dict) -> dict:
    result = json.loads(json.dumps(result))
    h.state.history.append({"event": "subagent", "handle": result["handle"],
                            "depth": result["depth"], "budget": result["budget"],
                            "spent": result["spent"], "stop_reason": result.get("stop_reason",
                                                                               result["status"]),
                            "result": result})
    h.save()
    return result
