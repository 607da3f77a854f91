"""The multi-turn protocol between the policy and the operator environment
(docs/paper.md, The multi-turn protocol).

- `build_messages`: the system + user chat messages of appendix D.1 (our wording, same protocol and
  constraints), with the operator list rendered from the registry in `operators.py`.
- `parse_turn`: one assistant turn -> one `Action` (tool call, final answer, or warning).
- `format_observation`: an operator result -> the `<info>...</info>` block, truncated to 2048
  characters (1024 head + 1024 tail around a marker) as in the release.
- `should_stop`: the episode limits (20 operator rounds, 21 assistant turns).

Wire format of one observation in the conversation (what the reward's state machine sees):
the tool message content is `<info>TEXT</info>`, and Qwen's chat template renders it inside the
next user block as `<tool_response>\\n<info>TEXT</info>\\n</tool_response>`
(`format_tool_response` builds that text form).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from workflow_r1.env.operators import WARNING_TEXT, pool_for, render_operator_list
from workflow_r1.env.tags import first_block

MAX_OPERATOR_CALLS = 20  # observation rounds per episode ("MAXIMUM of 20 operator calls")
MAX_ASSISTANT_TURNS = 21  # generations per episode: 20 tool rounds plus the final answer turn
MAX_OBSERVATION_CHARS = 2048  # characters, not tokens (code-faithful, docs/paper.md, Our choices)
TRUNCATION_MARKER = "...(truncated)..."

SYSTEM_PROMPT = "You are a helpful assistant and an expert in reasoning and problem solving."

USER_TEMPLATE = """\
Answer the given question. Every time you receive new information from an operator, you must \
reason inside <think> and </think> before taking any further action, so you will have several \
thinking sessions: one after each piece of operator information, not just one at the start. After \
reasoning, if an operator would raise your chance of answering correctly, you can call one of the \
operators described below, and you MUST follow its exact format.

Available Operators:
{operators}

Before each operator call, reason inside <think> and </think> about why you choose this operator, \
how you will use it and what you expect to learn. The operator's response will be returned between \
<info> and </info>. After receiving it, think again inside <think> and </think> about what the \
information means, how it helps answer the original question, and what your next step should be.

CRITICAL INSTRUCTION: Do not settle for simple, single-step operator calls. You are REQUIRED to \
actively explore diverse, complex and unconventional combinations of operators. Your goal is not \
only to answer but to discover how different operators can work together; lazy or simplistic \
one-step strategies are unacceptable. Show deep reasoning through rich, multi-step operator \
orchestration.

IMPORTANT CONSTRAINT: You have a MAXIMUM of {max_calls} operator calls. Plan your strategy wisely: \
gather enough information and reach a confident answer within this limit.

Always follow this cycle: think, then optionally call an operator, then think again about the \
information you receive, then decide your next step. Repeat until you have enough information to \
answer confidently. When you are truly certain you can answer correctly, give only the final answer, \
a few words or a short phrase, inside <answer> and </answer>. If you are not certain, keep gathering \
information and reasoning.

Query: {question}"""

_MAX_NAME_ECHO = 80  # an unknown operator name is echoed back at most this long


@dataclass(frozen=True)
class Action:
    """The action of one assistant turn.

    kind:
        "tool": call `operator` (a name in the pool) with `content` (text after the first colon,
            stripped). The caller executes it and returns the result as the observation.
        "answer": the episode ends; `content` is the stripped text inside `<answer>` (may be "").
        "warning": no operator is executed; `content` is the observation text to return verbatim.
            `operator` is "WarningOp" for a format violation, or the offending name when the
            policy called an operator outside its pool ("Unknown operator: ..." text).
    """

    kind: Literal["tool", "answer", "warning"]
    operator: str | None
    content: str

    @property
    def is_final(self) -> bool:
        return self.kind == "answer"


def unknown_operator_text(name: str, pool: Sequence[str]) -> str:
    """Observation for a call to an operator outside `pool` (the release's text; a long name is
    echoed shortened). The parser uses it with the policy's pool, the executor server with every
    operator it runs."""
    shown = name if len(name) <= _MAX_NAME_ECHO else name[:_MAX_NAME_ECHO] + "..."
    return f"Unknown operator: {shown}. Available operators: [{', '.join(pool)}]"


def parse_turn(text: str, pool: Sequence[str]) -> Action:
    """Parse one decoded assistant turn into an Action (docs/paper.md, The multi-turn protocol).

    Rules: the first complete `<tool>BODY</tool>` or `<answer>...</answer>` block, whichever opens
    first, decides the turn; one action per turn, later blocks are ignored. A tool BODY is split at
    its first ":" into the operator name and content (both stripped); a body without a colon or
    with an empty name gives WarningOp. A name outside `pool` gives the unknown-operator
    observation. A turn with neither block gives WarningOp. `<think>` is not required here: the
    format reward charges for it.
    """
    tool = first_block(text, "tool")
    answer = first_block(text, "answer")
    if answer is not None and (tool is None or answer.start < tool.start):
        return Action("answer", None, answer.inner.strip())
    if tool is None:
        return Action("warning", "WarningOp", WARNING_TEXT)
    name, colon, content = tool.inner.partition(":")
    name = name.strip()
    if not colon or not name:
        return Action("warning", "WarningOp", WARNING_TEXT)
    if name not in pool:
        return Action("warning", name, unknown_operator_text(name, pool))
    return Action("tool", name, content.strip())


def truncate_middle(text: str, max_chars: int = MAX_OBSERVATION_CHARS) -> str:
    """Keep the first max_chars//2 and the last max_chars - max_chars//2 characters of `text`
    around TRUNCATION_MARKER when it is longer than `max_chars` characters; else return it as is."""
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return text[:head] + TRUNCATION_MARKER + (text[len(text) - tail:] if tail else "")


def format_observation(text: str, max_chars: int = MAX_OBSERVATION_CHARS) -> str:
    """An operator result as the tool message content: `<info>` + middle-truncated text + `</info>`."""
    return f"<info>{truncate_middle(text, max_chars)}</info>"


def format_tool_response(info_block: str) -> str:
    """The text Qwen's chat template produces around one tool message in the next user block."""
    return f"<tool_response>\n{info_block}\n</tool_response>"


def render_user_prompt(question: str, variant: str | Sequence[str] = "workflow_r1",
                       max_calls: int = MAX_OPERATOR_CALLS, template: str = USER_TEMPLATE) -> str:
    """The user message of appendix D.1 for `question`, listing the operators of `variant`.

    `template` replaces our wording (a `str.format` template over {operators}, {max_calls} and
    {question}; `env.config.EnvConfig.user_template_file` checks a user's file).
    """
    operators = render_operator_list(pool_for(variant))
    return template.format(operators=operators, max_calls=max_calls, question=question.strip())


def build_messages(question: str, variant: str | Sequence[str] = "workflow_r1", *,
                   max_calls: int = MAX_OPERATOR_CALLS, template: str = USER_TEMPLATE,
                   system: str = SYSTEM_PROMPT) -> list[dict]:
    """System + user chat messages for the policy: [{"role", "content"}, ...]."""
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": render_user_prompt(question, variant, max_calls, template)},
    ]


def should_stop(action: Action, assistant_turns: int, operator_rounds: int,
                max_operator_calls: int = MAX_OPERATOR_CALLS,
                max_assistant_turns: int = MAX_ASSISTANT_TURNS) -> bool:
    """Whether the episode ends after a turn that produced `action` (docs/paper.md, The multi-turn protocol).

    `assistant_turns` counts generations so far including this one; `operator_rounds` counts the
    observation rounds already returned (WarningOp and unknown-operator rounds count: the release
    caps user turns). The token budget (8192 response tokens) is the rollout engine's to check.
    """
    if action.kind == "answer":
        return True
    if assistant_turns >= max_assistant_turns:
        return True
    return operator_rounds >= max_operator_calls
