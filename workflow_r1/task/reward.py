"""Outcome + format reward of Workflow-R1 (docs/paper.md, Reward), on the full decoded response.

r = r_format + r_outcome, with r_format in {0, -0.5} and r_outcome in {1, 0, -1}:

| case                                  | reward |
|---------------------------------------|--------|
| valid format, correct                 |  1.0   |
| valid format, wrong                   |  0.0   |
| invalid format, correct               |  0.5   |
| invalid format, wrong                 | -0.5   |
| valid format, empty answer            | -1.0   |
| no or empty answer, invalid format    | -1.5   |

The response text is everything after the prompt, decoded with special tokens skipped: assistant
turns plus the observation blocks `<tool_response>\\n<info>...</info>\\n</tool_response>`.

Format: a scanner keeps a stack of open tags; a tag is top-level when it closes with the stack
otherwise empty. A close tag pops only when it matches the innermost open tag (a stray close tag is
ignored), so an unclosed `<think>` swallows everything after it. Tag names are read as in the
release: the text between `<` and the next `>`, first whitespace-separated word, which must start
with a letter (`<!...>` is skipped). The top-level sequence must then be
`think (tool tool_response think)* answer` with non-empty think and tool content and the answer
last. A bare top-level `<info>` block counts as a `tool_response` (our addition, for observation
renderings without the `<tool_response>` wrapper).

The WarningOp quirk (kept, as in the release): the warning text contains a literal
`<answer>...</answer>`, and the outcome reads the last `<answer>` of the whole response, observations
included. An episode that never answers but received a warning is therefore scored on the answer
"..." (outcome 0, total -0.5) instead of having none (-1.5). `answer_source` says where the scored
answer came from, so these episodes are counted (`rollout/answer_from_warning`).
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Sequence

from workflow_r1.task.operators import WARNING_TEXT
from workflow_r1.task.tags import last_tag

FORMAT_PENALTY = -0.5
_ALLOWED_TOP_LEVEL = frozenset({"think", "tool", "answer", "tool_response", "info"})
_OBSERVATION_TAGS = frozenset({"tool_response", "info"})
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


# Where the answer the outcome scores came from (`answer_source`).
SOURCE_NONE = "none"                # no non-empty answer anywhere: outcome -1
SOURCE_POLICY = "policy"            # an assistant turn wrote an <answer> block
SOURCE_WARNING = "warning"          # no assistant turn did: WarningOp's literal "<answer>...</answer>"
SOURCE_OBSERVATION = "observation"  # no assistant turn did: another observation's <answer> block


@dataclass(frozen=True)
class RewardBreakdown:
    """total = format + outcome; format in {0, -0.5}; outcome in {1, 0, -1}; answer_source one of
    the SOURCE_* values ("" when the assistant turns were not given)."""

    total: float
    format: float
    outcome: float
    answer_source: str = ""


def normalize_answer(text: str) -> str:
    """SQuAD / Search-R1 normalisation: lower-case, drop ASCII punctuation, articles a/an/the
    (whole words) become spaces, whitespace collapsed to single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def _as_list(golden_answers: Sequence[str] | str) -> list[str]:
    # Search-R1 parquet rows hold numpy arrays of strings; a single string means one gold answer.
    if isinstance(golden_answers, str):
        return [golden_answers]
    return [str(g) for g in golden_answers]


def exact_match(prediction: str, golden_answers: Sequence[str] | str) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(g) for g in _as_list(golden_answers)) else 0.0


def extract_answer(response_text: str) -> str | None:
    """Stripped content of the LAST `<answer>...</answer>` block, or None if there is none."""
    return last_tag(response_text, "answer")


def top_level_tags(text: str) -> list[tuple[str, str]]:
    """(name, inner text) of each top-level tag pair, in order (see the module docstring)."""
    found: list[tuple[str, str]] = []
    stack: list[tuple[str, int]] = []  # (name, index where the inner text starts)
    pos = 0
    while True:
        lt = text.find("<", pos)
        if lt < 0:
            break
        gt = text.find(">", lt + 1)
        if gt < 0:
            break  # no '>' after this '<', so none after any later '<' either
        inner = text[lt + 1:gt].strip()
        pos = gt + 1
        if inner.startswith("/"):
            words = inner[1:].split()
            if words and stack and stack[-1][0] == words[0]:
                name, start = stack.pop()
                if not stack:
                    found.append((name, text[start:lt]))
        elif inner and not inner.startswith("!"):
            name = inner.split()[0]
            if name[0].isalpha():
                stack.append((name, gt + 1))
    return found


def format_reward(response_text: str) -> float:
    """0.0 if the top-level tags follow `think (tool tool_response think)* answer`, else -0.5."""
    tags = top_level_tags(response_text)
    if not tags or any(name not in _ALLOWED_TOP_LEVEL for name, _ in tags):
        return FORMAT_PENALTY
    state = "think"
    for i, (name, inner) in enumerate(tags):
        if state == "think":
            if name != "think" or not inner.strip():
                return FORMAT_PENALTY
            state = "act"
        elif state == "act":
            if name == "tool" and inner.strip():
                state = "observation"
            elif name == "answer" and i == len(tags) - 1:
                state = "finished"
            else:
                return FORMAT_PENALTY
        elif state == "observation":
            if name not in _OBSERVATION_TAGS:
                return FORMAT_PENALTY
            state = "think"
    return 0.0 if state == "finished" else FORMAT_PENALTY


def answer_source(response_text: str, assistant_texts: Sequence[str]) -> str:
    """Where the answer `compute_reward` scores in `response_text` came from (a SOURCE_* value),
    given the texts of the response's assistant turns."""
    answer = extract_answer(response_text)
    if not answer:
        return SOURCE_NONE
    if any(last_tag(text, "answer") is not None for text in assistant_texts):
        return SOURCE_POLICY
    if WARNING_TEXT in response_text and answer == extract_answer(WARNING_TEXT):
        return SOURCE_WARNING
    return SOURCE_OBSERVATION


def compute_reward(response_text: str, golden_answers: Sequence[str] | str,
                   assistant_texts: Sequence[str] | None = None) -> RewardBreakdown:
    """Reward of one full response (assistant turns + observation blocks) against its gold answers;
    with `assistant_texts` (the response's assistant turns) the breakdown says where the answer
    came from."""
    answer = extract_answer(response_text)
    outcome = -1.0 if not answer else exact_match(answer, golden_answers)
    fmt = format_reward(response_text)
    source = "" if assistant_texts is None else answer_source(response_text, assistant_texts)
    return RewardBreakdown(total=fmt + outcome, format=fmt, outcome=outcome, answer_source=source)
