"""The environment protocol: what an episode is made of, for an engine that only samples tokens.

An environment answers three questions about one episode, and nothing in it knows how the policy's
tokens were sampled or how many episodes run at once:

    opening = env.open(question)            the prompt: chat messages and their token ids
    step    = env.step(episode, turn_ids)    one assistant turn -> its record, and what follows:
                                               the end (step.finish), a tool call (step.call) whose
                                               result `env.execute` returns, or a reply with no call
    ids     = env.observe(episode, text)     the observation's token ids to append (mask 0)
    score   = env.score(episode)             the reward, its format / outcome terms, the answer's source

`execute(calls)` runs the tool calls of many episodes at once (the Workflow-R1 environment sends
them to the executor concurrently); the engine, which drives episodes independently, calls it with
one call at a time, from a thread of its own per call in flight. The episode itself (`rollout.episode.Episode`) holds the tokens,
masks and log-probs; the engine appends what `step` and `observe` return and owns the token budget.

Two environments implement it: `envs.workflow.WorkflowEnvironment` (the paper's protocol,
operators and reward) and `envs.operators.OperatorTaskEnvironment` (the synthetic task of
the loss ablation).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from workflow_r1.task import reward
from workflow_r1.rollout.episode import Episode, Turn


@dataclasses.dataclass(frozen=True)
class Opening:
    """The start of an episode: the conversation (for logs) and the prompt's token ids."""

    messages: list[dict[str, str]]
    prompt_ids: list[int]


@dataclasses.dataclass(frozen=True)
class Step:
    """What one assistant turn leads to.

    turn: the turn as the episode records it (decoded text, action, operator).
    finish: the episode ends after this turn (a `FINISH_*` reason), or None.
    call: (operator, content) to run with `execute` before the observation, or None.
    reply: the observation text when no call is needed (a warning), or None.
    Exactly one of finish, call and reply is set.
    """

    turn: Turn
    finish: str | None = None
    call: tuple[str, str] | None = None
    reply: str | None = None

    @classmethod
    def of(cls, text: str, action: Any, finish: str | None) -> "Step":
        """The step of a turn `text` parsed as `action` (a `protocol.Action`) that ends the episode
        when `finish` (a `protocol.should_stop` reason) is set, else calls its tool or gets a reply."""
        turn = Turn(text=text, action=action.kind, operator=action.operator)
        if finish:
            return cls(turn, finish=finish)
        if action.kind == "tool":
            return cls(turn, call=(action.operator, action.content))
        return cls(turn, reply=action.content)


class Environment(Protocol):
    """A per-episode environment (see the module docstring). Token counts are in policy tokens."""

    def open(self, question: Any) -> Opening: ...

    def step(self, episode: Episode, turn_ids: Sequence[int]) -> Step: ...

    def execute(self, calls: Sequence[tuple[str, str]]) -> list[tuple[str, str | None]]:
        """(observation text, error kind or None) per call, in order; never raises."""
        ...

    def observe(self, episode: Episode, text: str) -> tuple[list[int], str]:
        """(token ids to append, the tool message content) of an observation text."""
        ...

    def score(self, episode: Episode) -> reward.RewardBreakdown: ...
