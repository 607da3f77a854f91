"""A synthetic operator task that a tiny policy learns on a laptop CPU within minutes: the
workflow protocol in miniature, as an environment (`rollout.environment.Environment`) that the
trainer rolls out with its own engine and sampler (`--config.env.kind=operators`; the loss
ablation's fast task).

An episode (token ids; the episode ends after the answer, and the batch pads the rest):

    [BOS, q] [think_0, act_0] [OBS, info_0] [think_1, act_1] [OBS, info_1] [think_2, act_2]
     prompt   policy           observation   policy           observation   policy

The question token q is one of 4 kinds; each kind has one operator that answers it correctly
(TARGET_OPERATOR[kind]). Each turn is a free "thought" token and an action:
  - act = an operator token: a call. The observation carries that operator's answer: RIGHT from
    the kind's operator, WRONG from any other;
  - act = ANSWER: the episode ends, answering with the last operator answer it observed (the way a
    policy restates an operator's result in `<answer>`); no answer observed yet = an empty answer;
  - any other token is a malformed turn (the WarningOp of the real protocol): [OBS, NOTHING].
Three turns at most (a call on the third turn gets no observation: the turn cap ends the episode).
The reward is the workflow reward's table (task/reward.py): format 0 when every turn is well formed
and the episode answered, else -0.5; outcome 1 (RIGHT), 0 (WRONG) or -1 (no or empty answer). The
optimum (reward 1, EM 1, one call) is: call the kind's operator, then answer. A random policy scores
about -1.4 (it rarely answers).

The policy is the trainer's tiny Qwen2 over this task's 16-token vocabulary (`model_config`); the
questions are drawn by `make_questions` (uniform kinds, a function of the seed only, so runs of
different losses with one seed are paired).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from workflow_r1.data.questions import Question
from workflow_r1.task import protocol, reward
from workflow_r1.task.reward import FORMAT_PENALTY
from workflow_r1.model import qwen2
from workflow_r1.model.config import get_preset
from workflow_r1.policy import DTYPES, with_lora
from workflow_r1.rollout.environment import Opening, Step
from workflow_r1.rollout.episode import Episode

PAD, BOS, OBS, ANSWER, NOTHING, RIGHT, WRONG = 0, 1, 2, 3, 4, 5, 6
KINDS = np.arange(7, 11)         # question tokens
OPERATORS = np.arange(11, 15)    # operator tokens
VOCAB = 16                       # 15 (and every token above) only makes a turn malformed
TARGET_OPERATOR = np.array([13, 11, 14, 12])  # kind -> the operator that answers it correctly
TURNS = 3
TURN_TOKENS = 2                  # a thought and an action
LENGTH = 2 + TURNS * 2 + (TURNS - 1) * 2     # 12 tokens
NAMES = {PAD: "PAD", BOS: "BOS", OBS: "OBS", ANSWER: "ANSWER", NOTHING: "NOTHING", RIGHT: "RIGHT", WRONG: "WRONG"}
DATA_SOURCE = "operators"
# The rollout section this task needs (the environment checks it).
ROLLOUT = {"max_prompt_tokens": 2, "max_response_tokens": 16, "max_turn_tokens": TURN_TOKENS,
           "max_assistant_turns": TURNS, "pad_multiple": 4}


def model_config(num_layers: int = 2) -> qwen2.Qwen2Config:
    """The `tiny` model preset over this task's 16-token vocabulary (no end-of-turn token: a turn is
    always TURN_TOKENS tokens)."""
    return get_preset("tiny").replace(vocab_size=VOCAB, num_layers=num_layers, eos_token_ids=(), pad_token_id=PAD)


def make_questions(seed: int, n: int, prefix: str = "q") -> list[Question]:
    """n questions of uniform kinds drawn with `seed`; the text is the kind's index, the gold "RIGHT"."""
    kinds = np.random.default_rng(seed).integers(0, len(KINDS), n)
    return [Question(id=f"{prefix}{i}", question=str(int(k)), golden_answers=("RIGHT",), data_source=DATA_SOURCE)
            for i, k in enumerate(kinds)]


def questions_for(run: Any) -> tuple[list[Question], list[Question]]:
    """(training, evaluation) questions of a run (a `run_config.Run`): one fresh question per prompt of
    every step (at least 4096), and `eval.max_questions` (default 512) evaluation questions, both
    drawn from the run's seed."""
    steps = run.run.steps or 4096 // run.rollout.prompts_per_step
    train = make_questions(run.run.seed, max(run.rollout.prompts_per_step * steps, 4096))
    return train, make_questions(10_000 + run.run.seed, run.eval.max_questions or 512, prefix="eval")


def policy(model: Any, remat: bool = False) -> qwen2.Qwen2:
    """A fresh tiny policy over the task's vocabulary (`model_config`) from the `model` section's seed
    and dtypes, with its LoRA adapters if any (its preset and checkpoint are not used)."""
    return with_lora(qwen2.create(model_config(), seed=model.seed, dtype=DTYPES[model.dtype],
                                  param_dtype=DTYPES[model.param_dtype], remat=remat), model)


def score(answer: np.ndarray, malformed: np.ndarray) -> dict[str, np.ndarray]:
    """Per-episode reward with its format and outcome terms (the workflow reward's table), and EM.

    answer: [B] RIGHT, WRONG, NOTHING (an empty answer) or -1 (never answered); malformed: [B] bool."""
    answered = answer >= 0
    em = answer == RIGHT
    fmt = np.where(answered & ~malformed, 0.0, FORMAT_PENALTY)
    outcome = np.where(em, 1.0, np.where(answer == WRONG, 0.0, -1.0))
    return {"reward": fmt + outcome, "format_ok": (fmt == 0.0).astype(np.float64), "em": em.astype(np.float64),
            "outcome": outcome}


def _name(token: int) -> str:
    token = int(token)
    if token in NAMES:
        return NAMES[token]
    if token in KINDS:
        return f"KIND{token - KINDS[0]}"
    if token in OPERATORS:
        return f"OP{token - OPERATORS[0]}"
    return f"T{token}"


def answer_of(episode: Episode) -> tuple[int, bool]:
    """(the answer token: RIGHT, WRONG, NOTHING or -1 = never answered; whether a turn was malformed)."""
    last, answer = NOTHING, -1
    for t in episode.turns:
        if t.action == "answer":
            answer = last
        elif t.action == "tool" and t.observation is not None:
            last = RIGHT if t.observation == "RIGHT" else WRONG
    return answer, any(t.action == "warning" for t in episode.turns)


class OperatorTaskEnvironment:
    """The task of the module docstring, one episode at a time (see `rollout.environment`)."""

    def __init__(self, rollout: Any = None):
        if rollout is not None:
            wrong = {k: v for k, v in ROLLOUT.items() if getattr(rollout, k) != v}
            if wrong:
                raise ValueError("the operator task needs " + ", ".join(
                    f"rollout.{k}={v}" for k, v in ROLLOUT.items()) + " (got " + ", ".join(
                    f"rollout.{k}={getattr(rollout, k)}" for k in wrong) + "); set them with --config.")

    def open(self, question: Any) -> Opening:
        kind = int(question.question)
        if not 0 <= kind < len(KINDS):
            raise ValueError(f"operator-task question {question.id!r} must name a kind 0..{len(KINDS) - 1}, "
                             f"got {question.question!r}")
        return Opening([{"role": "user", "content": f"KIND{kind}"}], [BOS, int(KINDS[kind])])

    def step(self, episode: Episode, turn_ids: Sequence[int]) -> Step:
        ids = [int(t) for t in turn_ids]
        act = ids[-1] if len(ids) == TURN_TOKENS else -1
        text = " ".join(_name(t) for t in ids)
        if act == ANSWER:
            action = protocol.Action("answer", None, "")
        elif act in OPERATORS:
            action = protocol.Action("tool", _name(act), str(int(episode.prompt_ids[1] - KINDS[0])))
        else:
            action = protocol.Action("warning", "WarningOp", "NOTHING")
        finish = protocol.should_stop(action, episode.num_turns + 1, episode.operator_rounds,
                                      max_operator_calls=TURNS, max_assistant_turns=TURNS)
        return Step.of(text, action, finish)

    def execute(self, calls: Sequence[tuple[str, str]]) -> list[tuple[str, str | None]]:
        """RIGHT from the kind's operator, WRONG from any other."""
        return [("RIGHT" if op == _name(TARGET_OPERATOR[int(kind)]) else "WRONG", None) for op, kind in calls]

    def observe(self, episode: Episode, text: str) -> tuple[list[int], str]:
        return [OBS, {"RIGHT": RIGHT, "WRONG": WRONG}.get(text, NOTHING)], text

    def score(self, episode: Episode) -> reward.RewardBreakdown:
        answer, malformed = answer_of(episode)
        s = score(np.array([answer]), np.array([malformed]))
        episode.response_text = " ".join(_name(t) for t in episode.response_ids)
        return reward.RewardBreakdown(total=float(s["reward"][0]), format=float(s["reward"][0] - s["outcome"][0]),
                                      outcome=float(s["outcome"][0]),
                                      answer_source=reward.SOURCE_POLICY if answer >= 0 else reward.SOURCE_NONE)


class OperatorSetup:
    """`env.kind=operators`: questions drawn from the run's seed, the tiny policy over this task's
    vocabulary (no tokenizer, no checkpoint to export beside), and this environment; no executor."""

    def __init__(self, run: Any):
        self.run = run

    def questions(self) -> tuple[list[Question], list[Question]]:
        return questions_for(self.run)

    def policy(self, mesh: Any = None) -> tuple[qwen2.Qwen2, None]:
        del mesh  # a tiny model: placed by the train state
        return policy(self.run.model, remat=self.run.model.remat), None

    def source_dir(self) -> None:
        return None

    def environment(self, tokenizer: Any = None) -> "OperatorTaskEnvironment":
        del tokenizer
        return OperatorTaskEnvironment(self.run.rollout)

    def executor_name(self) -> str:
        return "none (env.kind=operators)"

    def close(self) -> None:
        pass
