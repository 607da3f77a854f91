"""The multi-turn protocol between the policy and the operator environment
(docs/paper.md, The multi-turn protocol).

- `build_messages`: the system + user chat messages of appendix D.1 (a prompt set's wording, by
  default our faithful one, `prompt_sets.py`), with the operator list rendered from the registry in
  `operators.py`.
- `parse_turn`: one assistant turn -> one `Action` (tool call, final answer, or warning).
- `format_observation`: an operator result -> the `<info>...</info>` block, truncated to 2048
  characters (1024 head + 1024 tail around a marker) as in the release.
- `should_stop`: the episode limits (20 operator rounds, 21 assistant turns): why an episode ends.

Wire format of one observation in the conversation (what the reward's state machine sees):
the tool message content is `<info>TEXT</info>`, and Qwen's chat template renders it inside the
next user block as `<tool_response>\\n<info>TEXT</info>\\n</tool_response>`
(`format_tool_response` builds that text form).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from workflow_r1.task.operators import WARNING_TEXT, builtin_text, pool_for, render_operator_list
from workflow_r1.task.tags import first_block

MAX_OPERATOR_CALLS = 20  # observation rounds per episode ("MAXIMUM of 20 operator calls")
MAX_ASSISTANT_TURNS = 21  # generations per episode: 20 tool rounds plus the final answer turn
MAX_OBSERVATION_CHARS = 2048  # characters, not tokens (code-faithful, docs/paper.md, Our choices)
TRUNCATION_MARKER = "...(truncated)..."
# Why an episode ends, as far as the protocol decides (the token budget is the engine's: FINISH_BUDGET).
FINISH_ANSWER = "answer"          # the policy gave <answer>...</answer>
FINISH_CALL_CAP = "call_cap"      # the operator-call limit was reached (20 in the paper)
FINISH_TURN_CAP = "turn_cap"      # the assistant-turn limit was reached (21 in the paper)

# The faithful prompt set's messages (prompt_sets/faithful/; env.prompt_set selects another set).
SYSTEM_PROMPT = builtin_text("faithful", "system.txt")
USER_TEMPLATE = builtin_text("faithful", "policy.txt")

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


def turn_decided(text: str) -> bool:
    """True when `parse_turn` of `text` can no longer change as the turn goes on: it holds a
    complete `<tool>` or `<answer>` block, and the other tag does not open before it unclosed (it
    would open first once closed). Where a turn may stop early (`rollout.stop_at_action`)."""
    blocks = {tag: first_block(text, tag) for tag in ("tool", "answer")}
    done = [b.start for b in blocks.values() if b is not None]
    if not done:
        return False
    first = min(done)
    return all(b is not None or not 0 <= text.find(f"<{tag}>") < first for tag, b in blocks.items())


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
                       max_calls: int = MAX_OPERATOR_CALLS, template: str = USER_TEMPLATE,
                       descriptions: Mapping[str, str] | None = None) -> str:
    """The user message of appendix D.1 for `question`, listing the operators of `variant`.

    `template` and `descriptions` are a prompt set's user-message template (over {operators},
    {max_calls} and {question}) and operator descriptions (`prompt_sets.load` checks them).
    """
    operators = render_operator_list(pool_for(variant), descriptions)
    return template.format(operators=operators, max_calls=max_calls, question=question.strip())


def build_messages(question: str, variant: str | Sequence[str] = "workflow_r1", *,
                   max_calls: int = MAX_OPERATOR_CALLS, template: str = USER_TEMPLATE,
                   system: str = SYSTEM_PROMPT, descriptions: Mapping[str, str] | None = None,
                   ) -> list[dict]:
    """System + user chat messages for the policy: [{"role", "content"}, ...]."""
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": render_user_prompt(question, variant, max_calls, template, descriptions)},
    ]


def should_stop(action: Action, assistant_turns: int, operator_rounds: int,
                max_operator_calls: int = MAX_OPERATOR_CALLS,
                max_assistant_turns: int = MAX_ASSISTANT_TURNS) -> str | None:
    """Why the episode ends after a turn that produced `action`, or None if it goes on (docs/paper.md,
    The multi-turn protocol): FINISH_ANSWER, FINISH_TURN_CAP or FINISH_CALL_CAP, checked in that order.

    `assistant_turns` counts generations so far including this one; `operator_rounds` counts the
    observation rounds already returned (WarningOp and unknown-operator rounds count: the release
    caps user turns). The token budget (8192 response tokens) is the rollout engine's to check.
    """
    if action.kind == "answer":
        return FINISH_ANSWER
    if assistant_turns >= max_assistant_turns:
        return FINISH_TURN_CAP
    if operator_rounds >= max_operator_calls:
        return FINISH_CALL_CAP
    return None
