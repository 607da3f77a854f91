"""The `env` config section: which operator pool the policy sees and which prompt set words it."""
from __future__ import annotations

import dataclasses

from workflow_r1 import bounds
from workflow_r1.task import operators, prompt_sets, protocol

KINDS = ("workflow", "operators")  # the environments a run can choose (`env.kind`)


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """The operator environment as the policy and the executor LLM see it.

    variant: operator pool, "workflow_r1" (seven operators) or "search" (Search replaces
      MultiAnswerGenerate); "all" lists every callable operator (docs/paper.md, Our choices).
    prompt_set: the words of the system message, the user message, the operator descriptions and the
      executor prompts: "faithful" (the paper's instructions in our wording), "concise" (our earlier
      wording), or a directory of prompt files replacing any faithful one (docs/paper.md, Prompt sets).
      The trainer sends the set's executor prompts with every operator call, so a remote executor
      runs them too.
    max_operator_calls: the call limit stated in the prompt and enforced by the rollout (paper 20).
    kind: which environment the trainer rolls out: "workflow" (this one: the paper's operators behind
      the executor) or "operators" (the loss ablation's synthetic task on a tiny model,
      envs/operators.py; it uses none of the fields above, nor the data and executor sections).
    """

    variant: str = "workflow_r1"
    prompt_set: str = prompt_sets.DEFAULT
    max_operator_calls: int = protocol.MAX_OPERATOR_CALLS
    kind: str = "workflow"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"env.kind={self.kind!r} unknown; use one of {KINDS}")
        operators.pool_for(self.variant)  # raises with the known variants
        bounds.check("env.max_operator_calls", self.max_operator_calls, 1, 1000)
        self.prompts  # a bad prompt set fails when the config is read, not mid-run

    @property
    def pool(self) -> tuple[str, ...]:
        return operators.pool_for(self.variant)

    @property
    def prompts(self) -> prompt_sets.PromptSet:
        return prompt_sets.load(self.prompt_set)

    def messages(self, question: str) -> list[dict[str, str]]:
        """The system + user chat messages that open an episode for `question`."""
        p, demo = self.prompts, self.prompts.demonstration
        opening = protocol.build_messages(question if demo is None else demo.question, self.pool,
                                          max_calls=self.max_operator_calls, template=p.policy, system=p.system,
                                          descriptions=p.descriptions)
        if demo is None:
            return opening
        return opening + [{"role": r, "content": c} for r, c in demo.messages] + [
            {"role": "user", "content": demo.then.format(question=question.strip())}]

    def operator_templates(self) -> dict[str, str]:
        """Operator name -> executor prompt template of this set (the `templates` of an executor call)."""
        return dict(self.prompts.templates)
