"""An episode's rules, in one place: its turn budget, what follows a turn, how an
observation is appended (whole or not at all), and the sampling seed of each turn.

Token counts are in tokens; `cfg` is a `RolloutConfig` (max_response_tokens, max_turn_tokens).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from workflow_r1.rollout.environment import Environment
from workflow_r1.rollout.episode import FINISH_BUDGET, Episode


@dataclasses.dataclass
class OpenTurn:
    """The turn an episode is generating (a call may return mid-turn):
    tokens and log-probs so far, and its token cap (`turn_limit`)."""

    limit: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of an episode's turn `turn` (so turn t draws the same under any schedule)."""
    return (seed * 1_000_003 + turn) % (2 ** 31)


def turn_limit(cfg: Any, ep: Episode) -> int:
    """Tokens the episode's next turn may generate (<= 0: its response budget is spent)."""
    left = cfg.max_response_tokens - ep.response_length
    return min(left, cfg.max_turn_tokens) if cfg.max_turn_tokens else left


def end_turn(cfg: Any, env: Environment, ep: Episode, tokens: list[int], logprobs: Any) -> tuple[str, Any]:
    """Adds a generated turn to `ep` through `env.step` and says what follows: ("finish", reason)
    (the reason is set on `ep`), ("call", (operator, content)) or ("reply", text). A turn that
    spends the response budget ends the episode whatever it said."""
    step = env.step(ep, tokens)
    ep.add_turn(tokens, logprobs, step.turn)
    if ep.response_length >= cfg.max_response_tokens:
        ep.finish_reason = FINISH_BUDGET
    elif step.finish is not None:
        ep.finish_reason = step.finish
    elif step.call is not None:
        return "call", step.call
    else:
        return "reply", step.reply
    return "finish", ep.finish_reason


def observe(cfg: Any, env: Environment, ep: Episode, text: str, error_kind: str | None) -> list[int] | None:
    """Records an observation (a tool result or a reply) on the last turn and appends its tokens to
    `ep`; returns them. It is appended whole or not at all: one that would reach the response budget
    ends the episode ("budget") and gives None."""
    turn = ep.turns[-1]
    turn.observation, turn.error_kind = text, error_kind
    ids, content = env.observe(ep, text)
    if ep.response_length + len(ids) >= cfg.max_response_tokens:
        ep.finish_reason = FINISH_BUDGET
        return None
    ep.add_observation(ids, content)
    return list(ids)
