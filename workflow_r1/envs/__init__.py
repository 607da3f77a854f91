"""The environments a run can roll out, behind one factory: `env.kind` -> an `EnvSetup`.

    setup = envs.make(run)                         run: a `run_config.Run`
    train, evaluation = setup.questions()          data first: a bad file fails before a model loads
    model, tokenizer = setup.policy(mesh)          the initial policy (tokenizer None: token-level task)
    environment = setup.environment(tokenizer)     a `rollout.environment.Environment`
    ...
    setup.close()                                  the executor, if one was started

- "workflow" (`envs/workflow.py`): the paper's operators behind the executor, on question files.
- "operators" (`envs/operators.py`): the loss ablation's synthetic task on a tiny model.

The trainer and the evaluator never branch on the kind; a new environment is a module with an
`EnvSetup` and a line in `KINDS`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from workflow_r1.envs import operators, workflow
from workflow_r1.model import tokenizer as tokenizer_lib

log = logging.getLogger(__name__)


class EnvSetup(Protocol):
    """What a run needs of its environment kind."""

    def questions(self) -> tuple[list, list]:
        """(training, evaluation) questions (`data.Question`)."""

    def policy(self, mesh: Any = None) -> tuple[Any, Any]:
        """(the initial policy, an NNX Qwen2 placed on `mesh`; its HF tokenizer or None)."""

    def source_dir(self) -> Any:
        """The checkpoint directory whose tokenizer files an HF export copies, or None."""

    def environment(self, tokenizer: Any) -> Any:
        """The per-episode `rollout.environment.Environment` over the policy's tokenizer."""

    def executor_name(self) -> str:
        """What runs the environment's tool calls, for the run's first log line."""

    def close(self) -> None:
        """Frees what `environment` started (idempotent)."""


KINDS: dict[str, type] = {"workflow": workflow.WorkflowSetup, "operators": operators.OperatorSetup}


def make(run: Any) -> EnvSetup:
    """The setup of `run.env.kind` (checked against `task.config.KINDS` when the config is read)."""
    return KINDS[run.env.kind](run)


def fitting(questions: Sequence[Any], encode_prompt: Callable[[Any], tuple[Any, list[int]]], tokenizer: Any,
            limit: int, what: str) -> list:
    """The questions whose opening prompt has at most `limit` tokens (verl's overlong filter; the
    rest are logged and skipped). encode_prompt: the engine's (question -> (messages, prompt ids)).
    A question longer than `limit` by its size alone is never tokenized (a 10 MiB question would
    cost GBs of tokenizer memory); tokenizer None (a token-level task): every prompt is encoded."""
    kept = [q for q in questions if not (tokenizer is not None and tokenizer_lib.surely_longer(
        tokenizer, q.question, limit)) and len(encode_prompt(q)[1]) <= limit]
    if len(kept) < len(questions):
        log.warning("%d of %d %s questions have prompts over rollout.max_prompt_tokens=%d and are skipped",
                    len(questions) - len(kept), len(questions), what, limit)
    return kept


__all__ = ["EnvSetup", "KINDS", "fitting", "make"]
