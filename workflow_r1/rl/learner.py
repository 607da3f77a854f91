"""The learner: owns the RL step from "episodes were scored" to "the policy has new weights".

    selection = learner.select(rewards, group_size=n, wanted=Q)     dynamic sampling (rl/dynamic_sampling.py)
    ... the trainer rolls out refills while selection.wants_refill(), adding their rewards
    batch, m = learner.prepare(host_batch, selection):
        advantages = ESTIMATORS[cfg.advantage](rewards, n)            [B], rows of a group adjacent
        batch      = only the varied groups, padded rows               with cfg.filter_groups
              -> shard_batch                                           rows over (data, fsdp)
    learner.update(batch):
        ref_logprobs = log π_ref(batch)        only when cfg.kl_coef > 0; π_ref = the initial policy
        plan  = packed episodes per row        only when cfg.pack_tokens > 0 (rl/packed.py), unshared
        share = each prompt once               only with cfg.share_prompts (rl/shared_prompt.py);
                                               with cfg.pack_tokens too, its responses packed
        state = train_step(state, batch, plan) old log-probs recomputed once, then M AdamW updates

The learner knows trajectories only through `trajectory.TrainBatch`: it imports no rollout,
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

from workflow_r1 import trajectory
from workflow_r1.rl import advantages as advantages_lib
from workflow_r1.rl import diagnostics, packed, scoring, shared_prompt, train_state
from workflow_r1.rl import train_step as ts
from workflow_r1.rl.dynamic_sampling import GroupSelection
from workflow_r1.trajectory import TrainBatch


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

    def __init__(self, model: nnx.Module, cfg: train_state.TrainConfig, mesh: Mesh | None = None):
        self.cfg, self.mesh = cfg, mesh
        # The devices a batch's rows are split over (the mesh's data x fsdp axes).
        self.batch_devices = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
        self.state = train_state.create_train_state(model, cfg, mesh)
        # The reference policy of the KL term is the initial one: keep a copy only when it is used. With
        # LoRA only the initial adapters are copied (B = 0: the base model itself); the frozen base is
        # shared with the train state, which never donates it.
        self.ref_state = (self.state.replace(params=reference_copy(self.state.params), opt_state=None,
                                             step=jnp.zeros((), jnp.int32)) if cfg.kl_coef else None)
        self.train_step: Callable[..., Any] = ts.make_train_step(cfg, mesh)
        self.grad_diagnostics = (diagnostics.make_grad_diagnostics(cfg, mesh) if cfg.grad_diagnostics_every
                                 else None)

    def select(self, rewards: Any, *, group_size: int, wanted: int) -> GroupSelection:
        """The step's group selection, started with its first rollout batch's [B] rewards; `wanted`:
        this host's questions per step (rl/dynamic_sampling.py)."""
        selection = GroupSelection(self.cfg, group_size, wanted)
        selection.add(rewards)
        return selection

    def prepare(self, host_batch: TrainBatch, selection: GroupSelection) -> tuple[TrainBatch | None, dict[str, float]]:
        """This host's rollout batch (NumPy, with `rewards`) -> the sharded batch the update takes.

        The advantages by `cfg.advantage` over the adjacent groups, then (with `cfg.filter_groups`)
        only the selected groups, padded to a row count every host shares. Returns (the batch, or
        None when no host kept a group: the step skips its update; metrics).
        """
        if host_batch.rewards is None:
            raise ValueError("the rollout batch has no rewards (rollout.pack fills them)")
        adv = advantages_lib.estimate(host_batch.rewards, selection.group_size, self.cfg.advantage)
        host_batch = host_batch.replace(advantages=adv, rewards=None)  # the update reads only the advantages
        metrics: dict[str, float] = {}
        if selection.keep is not None:
            if self.cfg.refill_rounds:
                metrics["train/refill_rounds"] = selection.refills
            host_batch, metrics["train/kept_group_fraction"] = selection.apply(host_batch, self.batch_devices)
            if host_batch is None:
                return None, metrics
        if self.cfg.share_prompts or self.cfg.filter_keep_shape:
            host_batch = self._group_micro_batches(host_batch)
        return trajectory.shard_batch(host_batch, self.mesh), metrics

    def _group_micro_batches(self, host_batch: TrainBatch) -> TrainBatch:
        """This host's rows reordered so that a group's samples share micro-batches (and so compute
        their prompt once, and a filtered batch's padding rows fill micro-batches of their own, which
        the update skips; `shared_prompt.micro_batch_order`). Each row keeps its mini-batch, so the
        update is the one the rows in their order would get, up to float rounding."""
        rows = host_batch.tokens.shape[0]
        total = rows * jax.process_count()
        if total % self.cfg.num_mini_batches:
            return host_batch  # the plan refuses the batch with the reason
        micro = scoring.num_micro(total // self.cfg.num_mini_batches, self.cfg.micro_batch_size)
        src = shared_prompt.micro_batch_order(ts.host_rows(self.mesh, rows), self.cfg.num_mini_batches, micro)
        return jax.tree.map(lambda x: np.asarray(x)[src], host_batch)

    def reference_logprobs(self, batch: TrainBatch) -> jax.Array:
        """log π_ref [B, T] of the batch's tokens under the reference (the initial) policy."""
        if self.ref_state is None:
            raise ValueError("no KL reference: train.kl_coef is 0")
        return self._score(self.ref_state, batch)

    def _score(self, state: train_state.TrainState, batch: TrainBatch) -> jax.Array:
        """log-probs [B, T] of the batch under `state`, scored as the update scores them."""
        t = self.cfg
        return scoring.compute_logprobs(state, batch, chunk_size=t.logprob_chunk_size,
                                        micro_batch_size=t.micro_batch_size, mesh=self.mesh,
                                        logprob_policy_only=t.logprob_policy_only, temperature=t.temperature)

    def update(self, batch: TrainBatch, step: int | None = None) -> dict[str, float]:
        """Reference log-probs (if KL is on), then the train step; the loss metrics averaged over updates.

        With `train.pack_tokens` the episodes are packed for the update (the plan is built here,
        on the host, and its fill logged as train/pack_fill, its rows per mini-batch as train/pack_rows);
        with `train.share_prompts` too, the share plan packs the responses instead (its
        train/share_token_fraction says how many positions the forward runs on).
        step: the run's step number; when it is a multiple of `cfg.grad_diagnostics_every`, the
        `diag/` metrics of `rl/diagnostics.py` are added: the three granularities' policy gradients
        of this batch at the parameters after the update, with the ratios taken against the
        log-probs before it (the off-policy state the clip acts on). The update itself is unchanged.
        """
        if batch.advantages is None:
            raise ValueError("the batch has no advantages; Learner.prepare computes them from its rewards")
        metrics: dict[str, float] = {}
        diag_batch = None
        if self.grad_diagnostics is not None and step is not None and step % self.cfg.grad_diagnostics_every == 0:
            old = batch.old_logprobs
            if old is None:  # the rollout policy's log-probs, before the train state is donated
                old = self._score(self.state, batch)
            diag_batch = batch.replace(old_logprobs=old, ref_logprobs=None)
        share = None
        if self.cfg.share_prompts:
            t0 = time.perf_counter()
            share = ts.make_share_plan(batch, self.cfg)
            metrics["time/share_plan_s"] = time.perf_counter() - t0
            metrics.update({f"train/{k}": v for k, v in shared_prompt.plan_stats(share, batch.tokens.shape).items()})
        if self.ref_state is not None:
            t0 = time.perf_counter()
            ref = (self.reference_logprobs(batch) if share is None else
                   scoring.compute_logprobs_shared(self.ref_state, batch, share, self.cfg, self.mesh))
            batch = batch.replace(ref_logprobs=jax.block_until_ready(ref))
            metrics["time/ref_logprobs_s"] = time.perf_counter() - t0
        plan = None
        if self.cfg.pack_tokens and share is None:  # with a share plan, that plan packs the responses
            t0 = time.perf_counter()
            plan = ts.make_plan(batch, self.cfg)
            metrics["time/pack_s"] = time.perf_counter() - t0
            metrics.update({f"train/{k}": v for k, v in packed.plan_stats(plan).items()})
        t0 = time.perf_counter()
        self.state, step_metrics = self.train_step(self.state, batch, plan, share)
        step_metrics = jax.device_get(step_metrics)
        metrics["time/update_s"] = time.perf_counter() - t0
        metrics.update({f"train/{k}": float(np.mean(v)) for k, v in step_metrics.items()})
        metrics["train/updates"] = int(self.state.step)
        if diag_batch is not None:
            t0 = time.perf_counter()
            diag = jax.device_get(self.grad_diagnostics(self.state, diag_batch))
            metrics.update({k: float(v) for k, v in diag.items()})
            metrics["time/grad_diagnostics_s"] = time.perf_counter() - t0
        return metrics

    def release_reference(self) -> None:
        """Frees the KL reference (after the last update). Idempotent."""
        self.ref_state = None
