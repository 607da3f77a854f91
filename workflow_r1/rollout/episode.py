"""One row of a rollout: a question answered in a multi-turn loop, as tokens with their masks.

An episode's tokens are `prompt_ids + response_ids`. The response interleaves assistant turns (what
the policy sampled, end-of-turn token included: loss mask 1, segment id = turn index, the sampler's
log-probs) and observations (the chat-template rendering of an operator's result: mask 0,
segment id -1, log-prob 0). Everything the reward, the advantages, the batch packer and the logs
need is here, and nothing here knows how it was generated.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np

from workflow_r1.task.protocol import FINISH_ANSWER, FINISH_CALL_CAP, FINISH_TURN_CAP

# Why an episode ended: the protocol's reasons (task/protocol.py) and the engine's token budget.
FINISH_BUDGET = "budget"          # the response token budget is spent (a turn, or an observation, did not fit)
FINISH_REASONS = (FINISH_ANSWER, FINISH_CALL_CAP, FINISH_TURN_CAP, FINISH_BUDGET)


@dataclasses.dataclass
class Turn:
    """One assistant turn and what followed it.

    text: the decoded turn (end-of-turn token dropped). action: "tool" | "answer" | "warning".
    operator: the operator called (or "WarningOp" / an unknown name for warnings), None for answers.
    observation: the text returned to the policy (None when nothing was returned).
    error_kind: the executor's error kind for a failed call (None on success or without a call).
    policy_version: updates the policy that generated the turn had had (pipeline.py).
    """

    text: str
    action: str
    operator: str | None
    observation: str | None = None
    error_kind: str | None = None
    truncated_observation: bool = False
    policy_version: int = 0


@dataclasses.dataclass
class Episode:
    """A question's rollout. `group` indexes the question in its batch; rows of a group are adjacent.

    Lengths are in tokens. `response_ids`, `loss_mask`, `segment_ids` and `logprobs` are aligned.
    """

    question: Any                       # a data.Question (id, question, golden_answers, data_source)
    group: int
    sample: int
    messages: list[dict[str, str]]      # the conversation: system, user, then assistant / tool messages
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    segment_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    operator_rounds: int = 0            # observations returned (tool calls and warnings), the "calls" cap counts these
    finish_reason: str | None = None
    response_text: str = ""             # the response decoded with special tokens skipped (what the reward reads)
    reward: float = 0.0
    reward_format: float = 0.0
    reward_outcome: float = 0.0
    answer_source: str = ""             # where the scored answer came from (task.reward.SOURCE_*)
    seconds_executor: float = 0.0
    policy_version: int = 0             # updates the policy that generated its first turn had had (pipeline.py)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def generated_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def add_turn(self, token_ids: list[int], logprobs: np.ndarray, turn: Turn) -> None:
        """Appends a sampled assistant turn (mask 1, segment = its index)."""
        seg = len(self.turns)
        self.response_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.segment_ids.extend([seg] * len(token_ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": turn.text})

    def add_observation(self, token_ids: list[int], info_block: str) -> None:
        """Appends an observation (mask 0) rendered from tool message content `info_block`."""
        self.response_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.segment_ids.extend([-1] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.messages.append({"role": "tool", "content": info_block})
        self.operator_rounds += 1

    def tokens_by_version(self) -> Counter:
        """Policy version -> generated tokens of this episode's turns by that version."""
        seg = Counter(s for s in self.segment_ids if s >= 0)
        out: Counter = Counter()
        for i, turn in enumerate(self.turns):
            out[turn.policy_version] += seg[i]
        return out

    def operator_counts(self) -> Counter:
        """Operator name -> calls answered in this episode (warnings under their operator name:
        "WarningOp", or the unknown name the policy wrote). A call cut off by a cap is not counted."""
        return Counter(t.operator for t in self.turns if t.observation is not None and t.operator)

    def summary(self) -> dict[str, Any]:
        """A JSON-serialisable record of the episode (for trajectory logs and evaluation files)."""
        q = self.question
        return {
            "id": q.id, "data_source": q.data_source, "question": q.question,
            "golden_answers": list(q.golden_answers), "group": self.group, "sample": self.sample,
            "reward": self.reward, "reward_format": self.reward_format, "reward_outcome": self.reward_outcome,
            "answer_source": self.answer_source,
            "finish_reason": self.finish_reason, "turns": self.num_turns, "operator_rounds": self.operator_rounds,
            "operators": dict(self.operator_counts()), "prompt_tokens": len(self.prompt_ids),
            "response_tokens": self.response_length, "generated_tokens": self.generated_tokens,
            "policy_version": self.policy_version, "turn_versions": [t.policy_version for t in self.turns],
            "messages": self.messages,
        }
