"""Deterministic stand-ins for the operator task, for tests and CPU comparisons without a model.

- `SimulatedExecutorLM`: an executor LLM that knows the task's golden answers. It replies with
  every tag among think/answer/feedback that the prompt mentions (as `FakeBackend` does), and its
  answer is the bare golden answer only when the prompt asks for a "short answer"; otherwise it
  hedges ("I believe the answer is X, though I am not certain"), which misses exact match and
  scores partial token F1. Since only the last step's answer is scored, only an edit of the
  ScEnsemble template changes the score: an optimizer must find the right component.
- `RULE`: the one edit that helps. `scripted_reflection` (a reflection LM for GEPA) and
  `scripted_agent` (replies of an rlmopt optimizer) propose exactly that edit; they exercise each
  method's machinery and accounting, not its search skill.
"""
from __future__ import annotations

import re
from typing import Iterable, Sequence

from rlmopt.lm import Completion, ScriptedLM
from rlmopt.task import Task

KEYWORD = "short answer"
RULE = "Give only the short answer (a name, number or phrase) inside the answer tags."
_TAGS = ("think", "answer", "feedback")


class SimulatedExecutorLM:
    """A deterministic executor LLM for `pairs` of (question, golden answer) (see the module
    docstring)."""

    name = "simulated"

    def __init__(self, pairs: Iterable[tuple[str, str]]):
        # longest question first, so a question that contains another is found first
        self.golds = sorted(pairs, key=lambda qa: -len(qa[0]))
        self.calls = 0

    @classmethod
    def for_task(cls, task: Task) -> "SimulatedExecutorLM":
        """For the operator task's questions (the first golden answer of each)."""
        return cls((e.inputs["question"], e.expected["answer_em"][0]) for e in task.examples)

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        self.calls += 1
        gold = next((g for q, g in self.golds if q in prompt), None)
        if gold is None:
            answer = "unknown"
        elif KEYWORD in prompt.lower():
            answer = gold
        else:
            answer = f"I believe the answer is {gold}, though I am not certain"
        parts = []
        for tag in _TAGS:
            if f"<{tag}>" in prompt:
                body = {"think": "I consider the question step by step.",
                        "feedback": "The solution looks correct.", "answer": answer}[tag]
                parts.append(f"<{tag}>{body}</{tag}>")
        text = "\n".join(parts) or answer
        return Completion(text, "stop", max(1, len(text) // 4))


def _current_instruction(prompt: str) -> str:
    """The component text GEPA's reflection prompt quotes first (between ``` fences)."""
    m = re.search(r"```\n?(.*?)```", prompt, re.S)
    return m.group(1).strip() if m else ""


def scripted_reflection(prompt: str) -> str:
    """A GEPA reflection LM (a plain callable): the current text plus RULE, in a ``` block."""
    current = _current_instruction(prompt)
    text = current if RULE in current else f"{current}\n\n{RULE}"
    return f"```\n{text}\n```"


def scripted_agent(components: Sequence[str] = ("ScEnsemble",)) -> ScriptedLM:
    """An rlmopt optimizer that appends RULE to `components` of the running best, evaluates the
    result on the whole validation split, commits it and stops."""
    names = repr(list(components))
    code = (
        "```python\n"
        "best = best_so_far()['candidate']\n"
        f"cand = {{k: v + '\\n\\n' + {RULE!r} for k, v in best.items() if k in {names}}}\n"
        "fb = run_candidate(cand)\n"
        "print(fb.get('summary', fb))\n"
        "print(commit_prompt(cand, 'asks the final step for the bare short answer, which the "
        "hedged replies miss'))\n"
        "final()\n"
        "```")
    return ScriptedLM([code, "```python\nfinal()\n```"])
