"""An episode's rules, the same in every engine: its turn budget, what ends it after a turn, whether
an observation fits, and the sampling seed of each turn.

Token counts are in tokens; `cfg` is a `RolloutConfig` (max_response_tokens, max_turn_tokens).
"""
from __future__ import annotations

from typing import Any

from workflow_r1.rollout.environment import Step
from workflow_r1.rollout.episode import FINISH_BUDGET, Episode


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of an episode's turn `turn` (so turn t draws the same in every engine)."""
    return (seed * 1_000_003 + turn) % (2 ** 31)


def turn_limit(cfg: Any, ep: Episode) -> int:
    """Tokens the episode's next turn may generate (<= 0: its response budget is spent)."""
    left = cfg.max_response_tokens - ep.response_length
    return min(left, cfg.max_turn_tokens) if cfg.max_turn_tokens else left


def after_turn(cfg: Any, ep: Episode, step: Step) -> tuple[str, Any]:
    """What follows a turn already added to `ep`: ("finish", reason), ("call", (operator, content))
    or ("reply", text). A turn that spends the response budget ends the episode whatever it said."""
    if ep.response_length >= cfg.max_response_tokens:
        return "finish", FINISH_BUDGET
    if step.finish is not None:
        return "finish", step.finish
    if step.call is not None:
        return "call", step.call
    return "reply", step.reply


def observation_fits(cfg: Any, ep: Episode, ids: list[int]) -> bool:
    """An observation is appended whole or not at all: one that would reach the response budget
    ends the episode ("budget") instead of being cut."""
    return ep.response_length + len(ids) < cfg.max_response_tokens
