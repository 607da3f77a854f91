"""The Direct and CoT baselines: one greedy answer per question, without operators.

Both run through the same rollout engine as the workflow policy, with a one-turn limit and a prompt
of their own (no operator list), so the episodes, the reward (the answer is the last `<answer>`
block, scored by `task.reward`) and the statistics are those of the workflow evaluation:

- direct: the question straight to the model, asked for the short answer in `<answer>` tags. Its
  format reward is always the penalty (no `<think>` block): read `em`, not `format_ok`.

The answer is extracted as a baseline's is in the QA literature, not as strictly as the workflow
reward reads it: the last `<answer>` block if there is one, else the text after the last `</think>`,
else the whole reply (a small model asked for tags often replies "Paris" without them; scoring that
as no answer would measure tag-following, not what the model knows).
- cot: the model reasons in `<think>` first, then answers in `<answer>` tags.

The paper ran these baselines on its executor LLM (Qwen2.5-32B-Instruct); point `--checkpoint` at
that model to reproduce its setting, or at the policy to see what the operators add to it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from workflow_r1.task import protocol, reward
from workflow_r1.rollout.engine import RolloutConfig, RolloutEngine
from workflow_r1.envs.workflow import WorkflowEnvironment

DIRECT = ("Answer the question below. Reply with the final answer only, a few words or a short phrase, "
          "inside <answer> and </answer>, and nothing else.\n\nQuestion: {question}")
COT = ("Answer the question below. First reason step by step inside <think> and </think>. Then give the "
       "final answer only, a few words or a short phrase, inside <answer> and </answer>.\n\nQuestion: {question}")
PROMPTS = {"direct": DIRECT, "cot": COT}
METHODS = ("workflow", *PROMPTS)


@dataclasses.dataclass(frozen=True)
class PromptEnv:
    """The part of `EnvConfig` the engine reads, for a one-turn prompt without operators."""

    template: str
    system_prompt: str = protocol.SYSTEM_PROMPT
    pool: tuple[str, ...] = ()
    max_operator_calls: int = 1

    def messages(self, question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": self.template.format(question=question.strip())}]

    def operator_templates(self) -> dict[str, str]:
        """No operators, so no executor prompts."""
        return {}


def baseline_answer(response_text: str) -> str:
    """The answer of a one-turn baseline reply (see the module docstring); "" if there is none."""
    tagged = reward.extract_answer(response_text)
    if tagged is not None:
        return tagged
    return response_text.rsplit("</think>", 1)[-1].strip()


def score_baseline(response_text: str, golden_answers: Any, assistant_texts: Any = None) -> reward.RewardBreakdown:
    """The workflow reward's terms for a baseline reply, its answer read by `baseline_answer`."""
    answer = baseline_answer(response_text)
    outcome = reward.exact_match(answer, golden_answers) if answer else -1.0
    fmt = reward.format_reward(response_text)
    return reward.RewardBreakdown(total=fmt + outcome, format=fmt, outcome=outcome,
                                  answer_source=reward.SOURCE_POLICY if answer else reward.SOURCE_NONE)


def _no_operators(calls: list[tuple[str, str]], templates: Any = None) -> list[Any]:
    raise AssertionError(f"a one-turn baseline never calls operators, got {calls[:1]}")


def baseline_engine(method: str, policy: Any, tokenizer: Any, rollout: RolloutConfig) -> RolloutEngine:
    """A rollout engine that answers in one turn with the `method` prompt ("direct" or "cot").

    The turn may use the whole response budget (`rollout.max_turn_tokens` is lifted: a CoT answer
    is longer than one workflow turn)."""
    if method not in PROMPTS:
        raise ValueError(f"baseline method {method!r} unknown; use one of {sorted(PROMPTS)}")
    cfg = dataclasses.replace(rollout, max_assistant_turns=1, max_turn_tokens=0)
    return RolloutEngine(policy, cfg, WorkflowEnvironment.of(tokenizer, _no_operators, PromptEnv(PROMPTS[method]), cfg,
                                                        score=score_baseline))
