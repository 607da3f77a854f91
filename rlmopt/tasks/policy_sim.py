"""Deterministic stand-ins for the policy-prompt task, for tests and CPU runs without a model.

- `ScriptedPolicy`: a policy for the rollout engine (its `Policy` protocol) over the byte-level
  tokenizer. It reads each row's opening prompt (the chat-templated system + user message) and
  plays two turns: an AnswerGenerate call on the row's question, then an answer built from the
  operator's observation. What it writes depends on the user prompt only:
    * it opens each turn with a <think> block only when the prompt mentions "<think>" (else the
      response breaks the format the reward checks);
    * it answers with the operator's answer verbatim only when the prompt contains `RULE`; else it
      hedges ("I think it is X, but I am not sure"), which misses exact match.
  So a user template's wording, not luck, decides its score.
- `simulated_executor_lm`: a `FakeBackend` that answers each question with its first golden answer.
- `scripted_agent` (an rlmopt optimizer) and `scripted_reflection` (a GEPA reflection LM) put
  `RULE` into the policy template (they exercise each method's machinery, not search skill).
"""
from __future__ import annotations

import re
from typing import Any, Iterable

from rlmopt.lm import ScriptedLM
from rlmopt.task import Task
from workflow_r1.rollout import scripted

RULE = "Copy the operator's answer word for word into <answer> and </answer>, adding nothing."
_INFO = re.compile(r"<info>(.*?)</info>", re.S)
_FENCED = re.compile(r"```\n?(.*?)```", re.S)


class ScriptedPolicy(scripted.ScriptedPolicy):
    """A `rollout.engine.Policy` that plays the script of the module docstring.

    questions: the question texts it may be asked (the one a prompt contains is the row's
    question; longest first, so a question inside another is not taken for it).
    """

    def __init__(self, tokenizer: Any, questions: Iterable[str]):
        super().__init__()
        self.tokenizer = tokenizer
        self.questions = sorted(set(questions), key=len, reverse=True)
        self.eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self._prompts: dict[int, tuple[str, int]] = {}  # row id -> its opening prompt's text, length

    def turn(self, row_id: int, k: int, sequence: list[int]) -> list[int]:
        if k == 0:
            self._prompts[row_id] = (self.tokenizer.decode(sequence, skip_special_tokens=False), len(sequence))
        prompt, length = self._prompts[row_id]
        observed = self.tokenizer.decode(sequence[length:], skip_special_tokens=False)
        return self.tokenizer.encode(self._turn(prompt, k, observed), add_special_tokens=False) + [self.eos]

    def _turn(self, prompt: str, turn: int, observed: str) -> str:
        think = "<think>" in prompt
        question = next((q for q in self.questions if q in prompt), "unknown question")
        if turn == 0:
            body = f"<tool>AnswerGenerate: {question}</tool>"
            return f"<think>I will ask AnswerGenerate.</think>\n{body}" if think else body
        info = _INFO.findall(observed)
        at = info[-1].rfind("answer:") if info else -1  # "AnswerGenerate answer: X"
        answer = info[-1][at + len("answer:"):].strip() if at >= 0 else "unknown"
        if RULE not in prompt:
            answer = f"I think it is {answer}, but I am not sure"
        body = f"<answer>{answer}</answer>"
        return f"<think>The operator answered.</think>\n{body}" if think else body


def scripted_policy(task: Task) -> tuple[ScriptedPolicy, Any]:
    """(policy, tokenizer) for `task`'s questions, over the byte-level tokenizer."""
    from workflow_r1.model import tokenizer as tokenizer_lib

    tokenizer = tokenizer_lib.byte_level()
    return ScriptedPolicy(tokenizer, (e.inputs["question"] for e in task.examples)), tokenizer


def simulated_executor_lm(task: Task) -> Any:
    """An executor LLM that answers every question of `task` with its first golden answer."""
    from workflow_r1.executor.fake_backend import FakeBackend

    return FakeBackend(answers={e.inputs["question"]: e.expected["answer_em"][0] for e in task.examples})


def scripted_agent() -> ScriptedLM:
    """An rlmopt optimizer that appends RULE to the running best's policy template, evaluates it on
    the whole validation split, commits it and stops."""
    code = (
        "```python\n"
        "best = best_so_far()['candidate']\n"
        f"cand = {{'policy': best['policy'].replace('Query:', {RULE!r} + '\\n\\nQuery:', 1)}}\n"
        "fb = run_candidate(cand)\n"
        "print(fb.get('summary', fb))\n"
        "print(commit_prompt(cand, 'tells the policy to copy the operator answer instead of "
        "hedging, which misses exact match'))\n"
        "final()\n"
        "```")
    return ScriptedLM([code, "```python\nfinal()\n```"])


def with_rule(template: str) -> str:
    """`template` with RULE before its "Query:" line (at the end when it has none)."""
    if RULE in template:
        return template
    if "Query:" in template:
        return template.replace("Query:", f"{RULE}\n\nQuery:", 1)
    return f"{template}\n\n{RULE}"


def scripted_reflection(prompt: str) -> str:
    """A GEPA reflection LM (a plain callable): the template GEPA quotes first (between ```
    fences), with RULE, in a ``` block."""
    m = _FENCED.search(prompt)
    return f"```\n{with_rule(m.group(1).strip() if m else '')}\n```"
