"""The learner: a rollout batch's rewards -> advantages -> KL reference log-probs -> M mini-batch updates.

Everything the RL algorithm does between "episodes were scored" and "the policy has new weights"
is here, so a reader follows one step in one file:

    adv   = advantages(rewards, n, cfg.advantage)                   [B], rows of a group adjacent
    batch = pack(episodes, adv) -> shard_batch                        (the caller: rollout/packing.py)
    learner.update(batch):
        ref_logprobs = log π_ref(batch)        only when cfg.kl_coef > 0; π_ref = the initial policy
        state = train_step(state, batch)       old log-probs recomputed once, then M AdamW updates

The learner knows trajectories only through `rl.batch.TrainBatch`: it imports no rollout,
environment, executor or sampler code (tests/test_imports.py checks this).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from workflow_r1.rl import advantages as advantages_lib
from workflow_r1.rl import train_step as ts
from workflow_r1.rl.batch import TrainBatch

# The values of `train.advantage`: how a group's rewards become one advantage per response.
ADVANTAGES = advantages_lib.KINDS


def advantages(rewards: np.ndarray, group_size: int, kind: str = "grpo") -> np.ndarray:
    """[B] float32 advantages of [B] rewards in adjacent groups of `group_size` (docs/paper.md, Objectives).

    kind: "grpo" (R - mean_g) / (std_g + eps), std unbiased; "dr_grpo" R - mean_g (Dr. GRPO: no
    std division); "rloo" R - mean of the other responses of the group (leave-one-out). A group of
    one response gets 0 under every kind.
    """
    r = jnp.asarray(np.asarray(rewards, np.float32))
    if kind == "grpo":
        out = advantages_lib.grpo_advantages(r, group_size=group_size)
    elif kind == "dr_grpo":
        out = advantages_lib.grpo_advantages(r, group_size=group_size, std_normalize=False)
    elif kind == "rloo":
        out = advantages_lib.rloo_advantages(r, group_size=group_size)
    else:
        raise ValueError(f"train.advantage={kind!r} unknown; use one of {ADVANTAGES}")
    return np.asarray(out, np.float32)


def reference_copy(params: Any) -> Any:
    """A frozen copy of the initial parameters for the KL reference, stored in bfloat16 where that is
    exact (released checkpoints, the bundled model included, hold bf16 values): half the memory, the
    same log-probs, since the model casts every weight to its compute dtype before use."""
    def one(x: jax.Array) -> jax.Array:
        if x.dtype == jnp.float32 and bool(jnp.all(x.astype(jnp.bfloat16).astype(jnp.float32) == x)):
            return x.astype(jnp.bfloat16)
        return jnp.copy(x)

    return jax.tree.map(one, params)


class Learner:
    """The policy's train state, its KL reference and its update, from the `train` section.

    Args:
      model: the initial policy (an NNX Qwen2, already placed on `mesh`).
      cfg: the `train` section. mesh: the training mesh (None: one device).
    """

    def __init__(self, model: nnx.Module, cfg: ts.TrainConfig, mesh: Mesh | None = None):
        self.cfg, self.mesh = cfg, mesh
        self.state = ts.create_train_state(model, cfg, mesh)
        # The reference policy of the KL term is the initial one: keep a copy only when it is used. With
        # LoRA only the initial adapters are copied (B = 0: the base model itself); the frozen base is
        # shared with the train state, which never donates it.
        self.ref_state = (self.state.replace(params=reference_copy(self.state.params), opt_state=None,
                                             step=jnp.zeros((), jnp.int32)) if cfg.kl_coef else None)
        self.train_step: Callable[..., Any] = ts.make_train_step(cfg, mesh)

    def reference_logprobs(self, batch: TrainBatch) -> jax.Array:
        """log π_ref [B, T] of the batch's tokens under the reference (the initial) policy."""
        if self.ref_state is None:
            raise ValueError("no KL reference: train.kl_coef is 0")
        t = self.cfg
        return ts.compute_logprobs(self.ref_state, batch, chunk_size=t.logprob_chunk_size,
                                   micro_batch_size=t.micro_batch_size, mesh=self.mesh,
                                   logprob_policy_only=t.logprob_policy_only, temperature=t.temperature)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """Reference log-probs (if KL is on), then the train step; the loss metrics averaged over updates."""
        metrics: dict[str, float] = {}
        if self.ref_state is not None:
            t0 = time.perf_counter()
            batch = batch.replace(ref_logprobs=jax.block_until_ready(self.reference_logprobs(batch)))
            metrics["time/ref_logprobs_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.state, step_metrics = self.train_step(self.state, batch)
        step_metrics = jax.device_get(step_metrics)
        metrics["time/update_s"] = time.perf_counter() - t0
        metrics.update({f"train/{k}": float(np.mean(v)) for k, v in step_metrics.items()})
        metrics["train/updates"] = int(self.state.step)
        return metrics

    def release_reference(self) -> None:
        """Frees the KL reference (after the last update). Idempotent."""
        self.ref_state = None
