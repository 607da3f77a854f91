"""The learner: a rollout batch's rewards -> advantages -> KL reference log-probs -> M mini-batch updates.

Everything the RL algorithm does between "episodes were scored" and "the policy has new weights"
is here, so a reader follows one step in one file:

    adv   = advantages(rewards, n, cfg.advantage)                   [B], rows of a group adjacent
    batch = pack(episodes, adv)                                       (the caller: rollout/packing.py)
    batch = select_groups(batch, varied_groups(rewards, n), ...)      only with cfg.filter_groups
          -> shard_batch
    learner.update(batch):
        ref_logprobs = log π_ref(batch)        only when cfg.kl_coef > 0; π_ref = the initial policy
        plan  = packed episodes per row        only when cfg.pack_tokens > 0 (rl/packed.py)
        state = train_step(state, batch, plan) old log-probs recomputed once, then M AdamW updates

The learner knows trajectories only through `rl.batch.TrainBatch`: it imports no rollout,
environment, executor or sampler code (tests/test_imports.py checks this).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from workflow_r1.rl import advantages as advantages_lib
from workflow_r1.rl import diagnostics, packed
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


def varied_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """[B / group_size] bool: the groups of adjacent rows whose rewards are not all equal.

    A group of equal total rewards has advantage 0 on every row under every `train.advantage`
    kind, so it adds nothing to the policy gradient (docs/design.md, Dynamic sampling).
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or len(r) % group_size:
        raise ValueError(f"{r.shape} rewards do not split into groups of rollout.n={group_size}")
    g = r.reshape(-1, group_size)
    return g.max(axis=1) > g.min(axis=1)


def filtered_rows(kept_rows: int, full_rows: int, cfg: ts.TrainConfig, batch_devices: int = 1,
                  process_count: int = 1) -> int:
    """The row count a host pads its filtered batch to, from the largest count of kept rows on any host.

    The global batch (every host's rows) must still split into `cfg.num_mini_batches` mini-batches
    that are either one micro-batch or whole `micro_batch_size` micro-batches, over the
    `batch_devices` of the mesh's batch axes (data x fsdp). Sizes step through multiples
    q x {1, 2, 3, 4, 6, 8, 12, ...} of the smallest valid q: few distinct shapes, so few compilations
    of the train step; past two steps at most a third of the rows are padding. At most `full_rows`
    (the unfiltered batch, always a valid shape); 0 when no host kept a row.
    """
    if kept_rows <= 0:
        return 0
    p, mini, micro = process_count, cfg.num_mini_batches, cfg.micro_batch_size
    q, m = math.lcm(mini * batch_devices, p), 1
    while q * m < kept_rows * p:
        m = (m + m // 2 if m > 1 else 2) if m & (m - 1) == 0 else m * 4 // 3   # 1 2 3 4 6 8 12 16 ...
    size = q * m
    if micro and size // mini > micro:  # several micro-batches per mini-batch: whole ones
        qm = math.lcm(mini * micro, p)
        size = -(-size // qm) * qm
    return min(size // p, full_rows)


# What a padding row holds in the fields that decide whether a row counts (the rest copy a real row).
_INERT = {"loss_mask": 0, "segment_ids": -1, "sampler_logprobs": 0, "advantages": 0, "old_logprobs": 0,
          "ref_logprobs": 0}


def select_groups(batch: TrainBatch, keep: np.ndarray, group_size: int, rows: int | None = None) -> TrainBatch:
    """A host batch with only the rows of the kept groups, padded to `rows` with inert rows.

    Args:
      batch: the host `TrainBatch` [B, T] (NumPy), groups of `group_size` adjacent rows.
      keep: [B / group_size] bool (`varied_groups`).
      rows: the row count of the result (>= the kept rows; None: exactly the kept rows).

    Padding rows copy the first kept row (or row 0) with loss_mask 0, segment id -1, advantage 0
    and zero log-probs: they count in no loss term, no normalizer and no metric (a dummy row of
    `losses.policy_loss`), but keep the attention well defined.
    """
    idx = np.flatnonzero(np.repeat(np.asarray(keep, bool), group_size))
    rows = len(idx) if rows is None else rows
    if rows < len(idx):
        raise ValueError(f"cannot fit {len(idx)} kept rows into {rows}")
    pad = rows - len(idx)
    src = np.concatenate([idx, np.full(pad, idx[0] if len(idx) else 0, idx.dtype)])
    real = np.arange(rows) < len(idx)

    def take(x: Any, inert: float | None) -> Any:
        if x is None:
            return None
        x = np.asarray(x)[src]
        if inert is not None and pad:
            x[~real] = inert
        return x

    return batch.replace(**{f.name: take(getattr(batch, f.name), _INERT.get(f.name))
                            for f in dataclasses.fields(batch)})


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
        self.grad_diagnostics = (diagnostics.make_grad_diagnostics(cfg, mesh) if cfg.grad_diagnostics_every
                                 else None)

    def reference_logprobs(self, batch: TrainBatch) -> jax.Array:
        """log π_ref [B, T] of the batch's tokens under the reference (the initial) policy."""
        if self.ref_state is None:
            raise ValueError("no KL reference: train.kl_coef is 0")
        t = self.cfg
        return ts.compute_logprobs(self.ref_state, batch, chunk_size=t.logprob_chunk_size,
                                   micro_batch_size=t.micro_batch_size, mesh=self.mesh,
                                   logprob_policy_only=t.logprob_policy_only, temperature=t.temperature)

    def update(self, batch: TrainBatch, step: int | None = None) -> dict[str, float]:
        """Reference log-probs (if KL is on), then the train step; the loss metrics averaged over updates.

        With `train.pack_tokens` the episodes are packed for the update (the plan is built here,
        on the host, and its fill logged as train/pack_fill, its rows per mini-batch as train/pack_rows).
        step: the run's step number; when it is a multiple of `cfg.grad_diagnostics_every`, the
        `diag/` metrics of `rl/diagnostics.py` are added: the three granularities' policy gradients
        of this batch at the parameters after the update, with the ratios taken against the
        log-probs before it (the off-policy state the clip acts on). The update itself is unchanged.
        """
        metrics: dict[str, float] = {}
        diag_batch = None
        if self.grad_diagnostics is not None and step is not None and step % self.cfg.grad_diagnostics_every == 0:
            t = self.cfg
            old = batch.old_logprobs
            if old is None:  # the rollout policy's log-probs, before the train state is donated
                old = ts.compute_logprobs(self.state, batch, chunk_size=t.logprob_chunk_size,
                                          micro_batch_size=t.micro_batch_size, mesh=self.mesh,
                                          logprob_policy_only=t.logprob_policy_only, temperature=t.temperature)
            diag_batch = batch.replace(old_logprobs=old, ref_logprobs=None)
        if self.ref_state is not None:
            t0 = time.perf_counter()
            batch = batch.replace(ref_logprobs=jax.block_until_ready(self.reference_logprobs(batch)))
            metrics["time/ref_logprobs_s"] = time.perf_counter() - t0
        plan = None
        if self.cfg.pack_tokens:
            t0 = time.perf_counter()
            plan = ts.make_plan(batch, self.cfg)
            metrics["time/pack_s"] = time.perf_counter() - t0
            metrics.update({f"train/{k}": v for k, v in packed.plan_stats(plan).items()})
        t0 = time.perf_counter()
        self.state, step_metrics = self.train_step(self.state, batch, plan)
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
