"""Dynamic sampling (DAPO): train only on the groups whose rewards vary, refilling a step that has too few.

A group of n samples whose total rewards are all equal has advantage 0 on every row under every
`train.advantage` estimator, so it adds nothing to the policy gradient but its compute
(docs/design.md, Dynamic sampling). With `train.filter_groups` the learner keeps the varied groups
of a step; with `train.refill_rounds` > 0 the trainer rolls out up to that many more batches of the
next questions while fewer than `rollout.prompts_per_step` groups (all hosts) vary, and the step
trains on the first `prompts_per_step` varied groups of them all.

Every host must run the same program: `GroupSelection` decides with counts gathered from every host,
and the kept rows are padded (with inert rows) to one row count that still splits into the
configured mini- and micro-batches over the mesh (`filtered_rows`).

    selection = GroupSelection(cfg, group_size=n, wanted=questions_on_this_host)
    selection.add(rewards)                     each rollout batch of the step: [B_i] rewards
    while selection.wants_refill(): ...        roll out more, add their rewards
    batch, fraction = selection.apply(host_batch, batch_devices)     [rows, T] or None
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from workflow_r1 import sharding
from workflow_r1.rl import shapes
from workflow_r1.rl.train_state import TrainConfig
from workflow_r1.trajectory import TrainBatch


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


def filtered_rows(kept_rows: int, full_rows: int, cfg: TrainConfig, batch_devices: int = 1,
                  process_count: int = 1) -> int:
    """The row count a host pads its filtered batch to, from the largest count of kept rows on any host.

    The global batch (every host's rows) must still split into `cfg.num_mini_batches` mini-batches
    that are either one micro-batch or whole `micro_batch_size` micro-batches, over the
    `batch_devices` of the mesh's batch axes (data x fsdp). Sizes step through the ladder
    q x {1, 2, 3, 4, 6, 8, 12, ...} of the smallest valid q (`shapes.ladder_ceil`): few distinct
    shapes, so few compilations of the train step. At most `full_rows` (the unfiltered batch,
    always a valid shape), and `full_rows` itself with `cfg.filter_keep_shape`; 0 when no host kept
    a row.
    """
    if kept_rows <= 0:
        return 0
    if cfg.filter_keep_shape:
        return full_rows
    p, mini, micro = process_count, cfg.num_mini_batches, cfg.micro_batch_size
    size = shapes.ladder_ceil(kept_rows * p, math.lcm(mini * batch_devices, p))
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


class GroupSelection:
    """Which groups of one step's rollout batches (the first and its refills) the update keeps.

    Args:
      cfg: the `train` section (`filter_groups`, `refill_rounds`, the batch split).
      group_size: n, the samples per question (adjacent rows).
      wanted: this host's questions per step; the step trains on at most that many groups a host.
    """

    def __init__(self, cfg: TrainConfig, group_size: int, wanted: int):
        self.cfg, self.group_size, self.wanted = cfg, group_size, wanted
        self.keep: np.ndarray | None = np.zeros(0, bool) if cfg.filter_groups else None  # [groups so far]
        self.batches = 0

    def add(self, rewards: Any) -> None:
        """One rollout batch's [B_i] rewards (whole groups), in the order its rows follow the others'."""
        self.batches += 1
        if self.keep is not None:
            self.keep = np.concatenate([self.keep, varied_groups(np.asarray(rewards), self.group_size)])

    @property
    def refills(self) -> int:
        """Rollout batches added after the step's first."""
        return max(self.batches - 1, 0)

    def wants_refill(self) -> bool:
        """True while refill rounds are left and fewer than `wanted` x hosts groups vary on all
        hosts together. Every host calls it the same number of times (it gathers their counts)."""
        return (self.keep is not None and self.refills < self.cfg.refill_rounds
                and sum(sharding.allgather_objects(int(self.keep.sum()))) < self.wanted * jax.process_count())

    def apply(self, host_batch: TrainBatch, batch_devices: int = 1) -> tuple[TrainBatch | None, float]:
        """This host's batch with only the kept groups (at most the first `wanted`), every host padded
        to the same row count (`filtered_rows`, `select_groups`); None when no host keeps a group.
        Returns (batch, varied groups / groups over all hosts). Without `filter_groups`: (the batch, 1)."""
        if self.keep is None:
            return host_batch, 1.0
        n, keep = self.group_size, self.keep
        counts = np.array(sharding.allgather_objects((int(keep.sum()), keep.size)))  # [hosts, 2]
        fraction = float(counts[:, 0].sum() / counts[:, 1].sum())
        keep = keep & (np.cumsum(keep) <= self.wanted)  # a refilled batch trains on `wanted` groups
        rows = filtered_rows(min(int(counts[:, 0].max()), self.wanted) * n, self.wanted * n, self.cfg,
                             batch_devices, jax.process_count())
        return (select_groups(host_batch, keep, n, rows) if rows else None), fraction


__all__ = ["GroupSelection", "filtered_rows", "select_groups", "varied_groups"]
