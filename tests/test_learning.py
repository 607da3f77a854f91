"""End-to-end learning through the trainer (`trainer.Trainer`, what `python -m workflow_r1.train` runs):
the environment's rollouts through the rollout engine and the sampler, rewards, advantages, the
learner's update, the sampler refreshed with the new weights, evaluation, checkpoints.

The environment is the loss ablation's synthetic operator task (`env.kind=operators`,
workflow_r1/envs/operators.py): call the question kind's operator, then answer. A random
policy scores about -1.4 (it rarely answers); the optimum is 1. Each loss (GRPO token, GSPO
sequence, GSsPO sub-sequence; GSsPO also with bf16 compute) must lift the rollout reward from near
chance to near the optimum, and the same run with the advantage sign flipped must not. The
sampler's log-probs must also agree with the update's recomputed ones on the first step (a shift
check). "Near the optimum" is loose on purpose: a run may settle with one or two question kinds
on a wrong operator (a WRONG answer scores 0, and a group that agrees on it has no advantage left),
so the checks are what every run reaches: the format learned (every turn well formed, an answer
given), a reward far above chance and greedy EM far above chance (about 0.02). The Workflow-R1 environment goes through the same trainer in tests/test_train.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from workflow_r1.ablation import runs

STEPS = 80  # the ablation's run (the `operators` preset, configs/base.py)
# No intermediate checkpoints, trajectories or TensorBoard: the learning is what is checked here.
FAST = ["checkpoint.every_steps=0", "log_trajectories=0", "tensorboard=False", "eval.max_questions=64",
        "eval.batch_size=64"]


def train(tmp_path, loss: str, steps: int = STEPS, extra: tuple[str, ...] = ()) -> list[dict]:
    workdir = tmp_path / loss
    runs.train_in_process(runs.spec(loss, "operators"), runs.operator_overrides(0, steps, [*FAST, *extra]), workdir)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rollout/reward" in r]


def _check_learns(rows, what):
    curve = [r["rollout/reward"] for r in rows]
    start, end = np.mean(curve[:2]), np.mean(curve[-10:])
    print(f"{what}: reward {start:.3f} -> {end:.3f} in {len(curve)} steps, eval EM {rows[-1]['eval/em']:.3f}")
    assert start < -1.2, f"a random policy should score about -1.4, got {start:.3f}"
    assert end > 0.0, f"{what}: mean reward only reached {end:.3f} (curve {np.round(curve, 2)})"
    assert rows[-1]["eval/format_ok"] > 0.9, f"{what}: final greedy format rate {rows[-1]['eval/format_ok']:.3f}"
    assert rows[-1]["eval/em"] > 0.3, f"{what}: final greedy EM {rows[-1]['eval/em']:.3f}"
    # Sampler and update score the same tokens with the same weights on the first step: the
    # recomputed old log-probs match the sampler's on every policy token (checks the t-1 shift).
    assert rows[0]["train/sampler_mismatch"] < 1e-4, rows[0]["train/sampler_mismatch"]


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_policy_learns_the_operator_task(tmp_path, loss):
    _check_learns(train(tmp_path, loss), loss)


def test_gsspo_learns_with_bf16_compute(tmp_path):
    """GSsPO with mixed precision (bf16 matmuls, fp32 master weights; model/mixed.py)."""
    _check_learns(train(tmp_path, "gsspo", extra=("model.dtype=bfloat16",)), "gsspo, bf16 compute")


def test_sign_flipped_advantages_do_not_learn(tmp_path, monkeypatch):
    """The same run with -A must drive the reward down, not up: the gradient sign is right."""
    from workflow_r1.rl import advantages

    real = advantages.estimate
    monkeypatch.setattr(advantages, "estimate", lambda *a, **k: -real(*a, **k))
    curve = [r["rollout/reward"] for r in train(tmp_path, "gsspo", steps=20)]
    assert np.mean(curve[-3:]) < np.mean(curve[:2]) - 0.03, f"sign-flipped training raised the reward: {curve}"
