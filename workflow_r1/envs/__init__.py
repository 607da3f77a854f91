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

from typing import Any, Protocol

from workflow_r1.envs import operators, workflow


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


__all__ = ["EnvSetup", "KINDS", "make"]
