"""An episode's rules (rollout/rules.py), which every engine follows: the turn budget, what follows
a turn, and an observation appended whole or not at all. Checked at their boundaries with a scripted
environment (no model)."""
import types

import numpy as np
import pytest

from workflow_r1.rollout import rules
from workflow_r1.rollout.environment import Step
from workflow_r1.rollout.episode import FINISH_BUDGET, Episode, Turn


def _cfg(response=10, turn=0):
    return types.SimpleNamespace(max_response_tokens=response, max_turn_tokens=turn)


class _Env:
    """step returns the scripted Step; observe renders an observation as `length` tokens."""

    def __init__(self, step=None, length=0):
        self.next_step, self.length = step, length

    def step(self, ep, tokens):
        return self.next_step

    def observe(self, ep, text):
        return list(range(self.length)), text


def _episode(response_tokens=0):
    ep = Episode(question=None, group=0, sample=0, messages=[], prompt_ids=[1, 2, 3])
    if response_tokens:
        ep.add_turn([7] * response_tokens, np.zeros(response_tokens), Turn("t", "tool", "Op"))
    return ep


def test_turn_limit_is_the_budget_left_capped_per_turn():
    assert rules.turn_limit(_cfg(10), _episode(4)) == 6
    assert rules.turn_limit(_cfg(10, turn=3), _episode(4)) == 3
    assert rules.turn_limit(_cfg(10, turn=8), _episode(4)) == 6
    assert rules.turn_limit(_cfg(4), _episode(4)) == 0


@pytest.mark.parametrize("step, want", [
    (Step(Turn("t", "tool", "Op"), call=("Op", "x")), ("call", ("Op", "x"))),
    (Step(Turn("t", "warning", "WarningOp"), reply="use a tool"), ("reply", "use a tool")),
    (Step(Turn("t", "answer", None), finish="answer"), ("finish", "answer")),
])
def test_a_turn_leads_to_what_the_environment_said(step, want):
    ep = _episode()
    assert rules.end_turn(_cfg(10), _Env(step), ep, [5, 6], np.zeros(2)) == want
    assert ep.response_ids == [5, 6] and len(ep.turns) == 1
    assert ep.finish_reason == (want[1] if want[0] == "finish" else None)


def test_a_turn_that_spends_the_budget_ends_the_episode_whatever_it_said():
    ep = _episode(8)
    step = Step(Turn("t", "tool", "Op"), call=("Op", "x"))
    assert rules.end_turn(_cfg(10), _Env(step), ep, [5, 6], np.zeros(2)) == ("finish", FINISH_BUDGET)
    assert ep.finish_reason == FINISH_BUDGET and len(ep.response_ids) == 10


def test_an_observation_is_appended_whole_or_not_at_all():
    ep = _episode(4)   # 6 of 10 tokens left: 5 fit (one is left for the next turn), 6 do not
    assert rules.observe(_cfg(10), _Env(length=5), ep, "result", None) == [0, 1, 2, 3, 4]
    assert ep.turns[-1].observation == "result" and len(ep.response_ids) == 9 and ep.finish_reason is None
    ep = _episode(4)
    assert rules.observe(_cfg(10), _Env(length=6), ep, "result", "timeout") is None
    assert ep.finish_reason == FINISH_BUDGET and len(ep.response_ids) == 4
    assert ep.turns[-1].observation == "result" and ep.turns[-1].error_kind == "timeout"


def test_turn_seeds_depend_on_the_seed_and_the_turn_only():
    assert rules.turn_seed(3, 1) == rules.turn_seed(3, 1) != rules.turn_seed(3, 2) != rules.turn_seed(4, 1)
    assert 0 <= rules.turn_seed(2 ** 40, 7) < 2 ** 31
