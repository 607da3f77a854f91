"""The `env` config section: which operator pool the policy sees and the words of its prompt."""
from __future__ import annotations

import dataclasses
import functools
import pathlib

from workflow_r1.env import operators, protocol

_TEMPLATE_FIELDS = ("operators", "max_calls", "question")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """The operator environment as the policy sees it.

    variant: operator pool, "workflow_r1" (seven operators) or "search" (Search replaces
      MultiAnswerGenerate); "all" lists every callable operator (docs/paper.md, Our choices).
    user_template_file: a text file replacing our user-prompt wording; a `str.format` template that
      must use {operators}, {max_calls} and {question} ("" = ours, `protocol.USER_TEMPLATE`).
    system_prompt: replaces our one-line system message ("" = ours, `protocol.SYSTEM_PROMPT`).
    max_operator_calls: the call limit stated in the prompt and enforced by the rollout (paper 20).
    """

    variant: str = "workflow_r1"
    user_template_file: str = ""
    system_prompt: str = ""
    max_operator_calls: int = protocol.MAX_OPERATOR_CALLS

    def __post_init__(self):
        operators.pool_for(self.variant)  # raises with the known variants
        if self.max_operator_calls < 1:
            raise ValueError(f"max_operator_calls must be >= 1, got {self.max_operator_calls}")
        self.user_template()  # a bad template file fails when the config is read, not mid-run

    @property
    def pool(self) -> tuple[str, ...]:
        return operators.pool_for(self.variant)

    def user_template(self) -> str:
        return _read_template(self.user_template_file) if self.user_template_file else protocol.USER_TEMPLATE

    def messages(self, question: str) -> list[dict[str, str]]:
        """The system + user chat messages that open an episode for `question`."""
        return protocol.build_messages(question, self.pool, max_calls=self.max_operator_calls,
                                       template=self.user_template(),
                                       system=self.system_prompt or protocol.SYSTEM_PROMPT)


@functools.cache
def _read_template(path: str) -> str:
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"env.user_template_file {path} not found")
    text = file.read_text(encoding="utf-8")
    try:
        used = set(operators.template_placeholders(text))
    except ValueError as exc:
        raise ValueError(f"env.user_template_file {path} is not a str.format template ({exc}); "
                         "write literal braces as '{{' and '}}'") from None
    missing = [f for f in _TEMPLATE_FIELDS if f not in used]
    extra = sorted(used - set(_TEMPLATE_FIELDS))
    if missing or extra:
        raise ValueError(f"env.user_template_file {path} must use exactly the placeholders "
                         f"{{operators}}, {{max_calls}} and {{question}}; missing {missing}, unknown {extra}")
    return text
