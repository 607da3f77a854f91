"""The policy update: log-probs, GRPO / GSPO / GSsPO loss, gradients and AdamW, jitted and sharded.

Shapes: B responses in a rollout batch, T token positions, M mini-batches (optimizer updates per
rollout batch), k micro-batches per mini-batch (gradient accumulation).

One call of the step returned by `make_train_step` (the jitted `update`) consumes a whole rollout
batch (the trajectory contract, `workflow_r1.trajectory.TrainBatch`) and performs M AdamW updates, as verl does with
`ppo_mini_batch_size` (paper: 512 prompts per rollout step, 128 per mini-batch, so M = 4; docs/paper.md, Hyper-parameters):

    if old_logprobs are absent and M > 1: old = logp under the current params (no gradient)
    for each of the M mini-batches:                                    (a lax.scan; one program)
        grads = Σ over its k micro-batches of ∇ policy_loss(..., normalizer=N_valid(mini-batch))
                (a micro-batch without a valid row adds 0 and is skipped: lax.cond)
        params, opt_state = AdamW(clip_by_global_norm(grads))

Exact accumulation. `losses.policy_loss` averages over valid responses; with `normalizer=N` it returns
(sum over the micro-batch's responses) / N instead, so summing micro-batch losses and gradients with N
= the mini-batch's valid-response count gives exactly the mini-batch loss and gradient.

Row splits are strided (`scoring.split_rows`): mini-batch (or micro-batch) i takes rows i, i + n,
i + 2n, ... . (The advantages are computed before the step, so which rows share a mini-batch does
not change the objective.) The old log-probs come from `rl/scoring.py`; the configuration, train
state and optimizer from `rl/train_state.py`.

Sharding. Parameters and optimizer moments are placed by the logical-axis table of
`workflow_r1.sharding` (FSDP over "fsdp", tensor parallelism over "tensor"); the batch is sharded
over (data, fsdp). The same code runs on one device (mesh=None), simulated CPU devices, a GPU, or
a multi-host TPU slice (call `sharding.maybe_initialize_distributed()` first, and build batches
with `trajectory.shard_batch`, which assembles each host's rows into one global array).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from workflow_r1 import sharding
from workflow_r1.rl import losses, packed, scoring, shared_prompt
from workflow_r1.rl.logprobs import token_logprobs
from workflow_r1.rl.train_state import (TrainConfig, TrainState, compiler_options, constrain_rows, constrain_state,
                                        learning_rate_at, make_optimizer, merge_model)
from workflow_r1.trajectory import TrainBatch

Array = jax.Array


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------

# How each `policy_loss` metric combines over micro-batches: a count to weight by, or a reduction.
_SUMMED = ("num_responses", "num_units", "num_tokens")
_WEIGHTS = {"clipfrac": "num_units", "ratio_mean": "num_units", "clipfrac_dual": "num_tokens",
            "behaviour_capped_frac": "num_units"}
# Flat means over turns: weighted by the micro-batch's turn count.
_PER_TURN = ("segment_length", "sampler_mismatch_subsequence")


def _combine_metrics(m: Mapping[str, Array]) -> dict[str, Array]:
    """Per-micro-batch metrics [k] -> scalars over the whole mini-batch (weighted by their counts)."""
    out: dict[str, Array] = {}
    turns = m["segments_per_response"] * m["num_responses"]
    has_units = m["num_units"] > 0
    for key, v in m.items():
        if key in _SUMMED:
            out[key] = v.sum()
        elif key == "ratio_min":
            out[key] = jnp.where(has_units.any(), jnp.min(jnp.where(has_units, v, jnp.inf)), 1.0)
        elif key == "ratio_max":
            out[key] = jnp.where(has_units.any(), jnp.max(jnp.where(has_units, v, -jnp.inf)), 1.0)
        else:
            w = turns if key in _PER_TURN else m[_WEIGHTS.get(key, "num_responses")]
            out[key] = jnp.where(w.sum() > 0, (v * w).sum() / jnp.maximum(w.sum(), 1e-30), 0.0)
    return out


# --------------------------------------------------------------------------------------------------
# Loss, gradients, update
# --------------------------------------------------------------------------------------------------

def _valid_rows(batch: TrainBatch, granularity: str) -> Array:
    """[B] bool: responses that count in `policy_loss`'s average (at least one scored token)."""
    m = batch.loss_mask.astype(bool)
    if granularity == "subsequence":
        m = m & (batch.segment_ids >= 0)
    return jnp.any(m, axis=1)


def _micro_loss(params: Any, graphdef: Any, mb: TrainBatch, normalizer: Array, cfg: TrainConfig,
                plan: packed.PackPlan | None = None, frozen: Any = None,
                share: shared_prompt.SharePlan | None = None) -> tuple[Array, dict[str, Array]]:
    """Loss of one micro-batch (sum over its responses / normalizer) and its metrics; differentiated
    w.r.t. `params` only (`frozen`, the LoRA base, is a constant).

    plan: None, mb is the micro-batch's rows. Packed: mb is the whole mini-batch [b, T] and plan
    [r, P] the micro-batch's packed rows; the model scores those, the log-probs go back to the
    episode layout, and the loss counts only the episodes the plan holds.
    share: the micro-batch's shared-prompt plan (`rl/shared_prompt.py`), or None.
    """
    model = merge_model(graphdef, params, frozen)
    kw = dict(chunk_size=cfg.logprob_chunk_size, unchunked_max_bytes=cfg.logprob_unchunked_max_mb << 20,
              with_entropy=True, entropy_grad=cfg.entropy_coef != 0, temperature=cfg.temperature)
    if share is not None:
        score_mask = mb.loss_mask if cfg.logprob_policy_only else None
        logp, entropy = shared_prompt.token_logprobs(model, mb.tokens, mb.positions, share, score_mask=score_mask, **kw)
    elif plan is None:
        # Only policy tokens are scored: every term of the loss (ratios, KL, entropy) lives on them.
        score_mask = mb.loss_mask if cfg.logprob_policy_only else None
        logp, entropy = token_logprobs(model, mb.tokens, mb.positions, mb.input_mask, score_mask=score_mask, **kw)
    else:
        logp, entropy = scoring.packed_logprobs(model, mb, plan, cfg.logprob_policy_only, kw)
        # Episodes of other micro-batches become rows without policy tokens: they add nothing.
        mb = mb.replace(loss_mask=mb.loss_mask * packed.episodes_in(plan.row, plan.segment,
                                                                    mb.tokens.shape[0])[:, None])
    # On-policy without stored old log-probs: old = sg(logp), so every ratio is exactly 1.
    old = jax.lax.stop_gradient(logp) if mb.old_logprobs is None else mb.old_logprobs
    return losses.policy_loss(
        logp, old, mb.advantages, mb.loss_mask, segment_ids=mb.segment_ids, granularity=cfg.granularity,
        clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, dual_clip_c=cfg.dual_clip_c,
        ref_logprobs=mb.ref_logprobs, kl_coef=cfg.kl_coef, sampler_logprobs=mb.sampler_logprobs, tis_cap=cfg.tis_cap,
        behaviour_cap=cfg.behaviour_weight_cap if cfg.max_staleness else None,
        entropy=entropy, entropy_coef=cfg.entropy_coef, normalizer=normalizer)


def _loss_and_grads(params: Any, graphdef: Any, batch: TrainBatch, cfg: TrainConfig,
                    plan: packed.PackPlan | None = None, frozen: Any = None,
                    share: shared_prompt.SharePlan | None = None) -> tuple[Array, Any, dict[str, Array]]:
    """Mini-batch loss and fp32 gradients of `params`, accumulated exactly over micro-batches.

    plan: None, or the mini-batch's packed rows [R, P] (micro-batches are then of packed rows).
    share: None, or the mini-batch's shared-prompt plan, leaves [k, ...] (one per micro-batch).
    """
    normalizer = _valid_rows(batch, cfg.granularity).sum().astype(jnp.float32)
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)
    k = scoring.num_micro(batch.tokens.shape[0] if plan is None else plan.row.shape[0], cfg.micro_batch_size)
    if k == 1:
        share = None if share is None else jax.tree.map(lambda x: x[0], share)
        (loss, metrics), grads = grad_fn(params, graphdef, batch, normalizer, cfg, plan, frozen, share)
        return loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads), metrics

    def body(carry: tuple[Array, Any], xs: Any) -> tuple[tuple[Array, Any], dict[str, Array]]:
        loss_sum, acc = carry
        xs, mshare = xs
        mb, mplan = (constrain_rows(xs), None) if plan is None else (batch, constrain_rows(xs))
        run = lambda: grad_fn(params, graphdef, mb, normalizer, cfg, mplan, frozen, mshare)  # noqa: E731
        if plan is None:
            # A micro-batch with no valid row (a filtered batch's padding, train.filter_keep_shape)
            # adds zero to the loss, the gradients and every metric count: skip its passes.
            out = jax.eval_shape(run)
            (loss, metrics), grads = jax.lax.cond(
                _valid_rows(mb, cfg.granularity).any(), run,
                lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out))
        else:
            (loss, metrics), grads = run()
        acc = constrain_state(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads))
        return (loss_sum + loss, acc), metrics

    zeros = constrain_state(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    xs = scoring.split_rows(batch, k, "micro-batches") if plan is None else scoring.split_rows(plan, k, "packed micro-batches")
    (loss, grads), metrics = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), (xs, share))
    return loss, grads, _combine_metrics(metrics)


def _apply_update(params: Any, opt_state: Any, step: Array, batch: TrainBatch, graphdef: Any,
                  cfg: TrainConfig, plan: packed.PackPlan | None = None,
                  frozen: Any = None, share: shared_prompt.SharePlan | None = None) -> tuple[Any, Any, dict[str, Array]]:
    """One optimizer update on one mini-batch (plan: its packed rows [R, P], or None; share: its
    shared-prompt plan [k, ...], or None)."""
    loss, grads, metrics = _loss_and_grads(params, graphdef, batch, cfg, plan, frozen, share)
    updates, opt_state = make_optimizer(cfg).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                   learning_rate=learning_rate_at(cfg, step))
    return constrain_state(params), constrain_state(opt_state), metrics


def update(state: TrainState, batch: TrainBatch, cfg: TrainConfig, plan: packed.PackPlan | None = None,
           frozen: Any = None, share: shared_prompt.SharePlan | None = None) -> tuple[TrainState, dict[str, Array]]:
    """The whole update of one rollout batch, unjitted: the old log-probs (when absent and M > 1),
    then `cfg.num_mini_batches` AdamW updates. `make_train_step` jits it; `workflow_r1.aot` compiles
    it for a TPU topology. Returns (new state, metrics: dict of [M] arrays).

    frozen: the LoRA base when the caller passes it apart from `state` (whose `frozen` is then None),
    so that donating the state does not donate the base; default `state.frozen`. The new state
    carries `state.frozen` as it came. share: the batch's shared-prompt plan [M, k, ...]
    (`make_share_plan`), or None.
    """
    frozen = state.frozen if frozen is None else frozen
    m = cfg.num_mini_batches
    batch = constrain_rows(batch)
    if batch.old_logprobs is None and m > 1 and share is not None:
        old = scoring.forward_logprobs_shared(
            state.params, state.graphdef, scoring.split_rows(batch, m, "mini-batches (TrainConfig.num_mini_batches)"),
            share, cfg, frozen)
        batch = batch.replace(old_logprobs=old)
    elif batch.old_logprobs is None and m > 1 and plan is not None:
        old = scoring.forward_logprobs_packed(
            state.params, state.graphdef, scoring.split_rows(batch, m, "mini-batches (TrainConfig.num_mini_batches)"),
            plan, cfg, frozen)
        batch = batch.replace(old_logprobs=old)
    elif batch.old_logprobs is None and m > 1:
        # Updates 2..M see parameters that moved; their ratios need the pre-update log-probs
        # (verl recomputes them with the actor before updating; docs/paper.md, Clipping, KL and aggregation).
        old, _ = scoring.forward_logprobs(
            state.params, state.graphdef, batch.tokens, batch.positions, batch.input_mask,
            batch.loss_mask if cfg.logprob_policy_only else None, cfg.micro_batch_size, cfg.logprob_chunk_size,
            with_entropy=False, temperature=cfg.temperature, frozen=frozen)
        batch = batch.replace(old_logprobs=old)
    if m == 1:
        # One update: no loop, so XLA can write the new parameters and moments over the donated
        # old ones (a scan's carry keeps both alive: twice the parameters and optimizer state).
        params, opt_state, metrics = _apply_update(state.params, state.opt_state, state.step, batch, state.graphdef,
                                                   cfg, None if plan is None else jax.tree.map(lambda x: x[0], plan),
                                                   frozen, None if share is None else jax.tree.map(lambda x: x[0], share))
        metrics = jax.tree.map(lambda x: x[None], metrics)
        return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics
    minis = scoring.split_rows(batch, m, "mini-batches (TrainConfig.num_mini_batches)")

    def body(carry: tuple[Any, Any, Array], xs: tuple[TrainBatch, packed.PackPlan | None, Any]):
        params, opt_state, step = carry
        mb, mplan, mshare = xs
        params, opt_state, metrics = _apply_update(params, opt_state, step, constrain_rows(mb), state.graphdef, cfg,
                                                   mplan, frozen, mshare)
        return (params, opt_state, step + 1), metrics

    (params, opt_state, step), metrics = jax.lax.scan(body, (state.params, state.opt_state, state.step),
                                                      (minis, plan, share))
    return state.replace(params=params, opt_state=opt_state, step=step), metrics


def make_plan(batch: TrainBatch, cfg: TrainConfig, num_mini_batches: int | None = None) -> packed.PackPlan:
    """The host-side packing plan of a batch under `cfg.pack_tokens` (see `rl/packed.py`); reads the
    batch's masks back to the host, so one process only."""
    if jax.process_count() > 1:
        raise ValueError("train.pack_tokens works on one process only; set train.pack_tokens=0 for multi-host runs")
    return packed.make_plan(jax.device_get(batch.input_mask), jax.device_get(batch.loss_mask),
                            num_mini_batches=num_mini_batches or cfg.num_mini_batches, pack_tokens=cfg.pack_tokens,
                            rows_per_micro=cfg.micro_batch_size)


def make_share_plan(batch: TrainBatch, cfg: TrainConfig, num_mini_batches: int | None = None) -> shared_prompt.SharePlan:
    """The host-side shared-prompt plan of a batch under `cfg.share_prompts` (`rl/shared_prompt.py`),
    leaves [M, k, ...], the same on every process; with `cfg.pack_tokens` its responses packed.

    Each process reads only the rows it holds and sends their records (`shared_prompt.row_records`:
    7 int32 a row, not its tokens) to the others; every process then builds the plan of the global
    batch from them.
    """
    columns = (batch.tokens, batch.positions, batch.input_mask, batch.loss_mask)
    if jax.process_count() == 1:
        records = shared_prompt.row_records(*jax.device_get(columns))
    else:
        rows, local = _addressable_rows(columns)
        mine = np.concatenate([rows[:, None].astype(np.int32), shared_prompt.row_records(*local, row_ids=rows)], axis=1)
        every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.shape[1])
        records = np.full((batch.tokens.shape[0], len(shared_prompt.RECORD)), -1, np.int32)
        records[every[:, 0]] = every[:, 1:]
        if len(np.unique(every[:, 0])) != records.shape[0]:
            raise ValueError("the processes' rows do not cover the batch once; train.share_prompts needs the "
                             "batch's rows split over (data, fsdp)")
    return shared_prompt.plan_from_records(records, batch.tokens.shape[1],
                                           num_mini_batches=num_mini_batches or cfg.num_mini_batches,
                                           micro_batch_size=cfg.micro_batch_size, pack_tokens=cfg.pack_tokens)


def _addressable_rows(arrays: tuple[jax.Array, ...]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The global rows [n] this process holds of [B, T] arrays (each row once, however many of its
    devices hold a copy) and those rows of each array."""
    total = arrays[0].shape[0]
    first: dict[int, Any] = {}
    for shard in arrays[0].addressable_shards:
        first.setdefault(shard.index[0].indices(total)[0], shard)
    starts = sorted(first)
    rows = np.concatenate([np.arange(s, s + first[s].data.shape[0]) for s in starts])

    def local(x: jax.Array) -> np.ndarray:
        by_start = {shard.index[0].indices(total)[0]: shard for shard in x.addressable_shards}
        return np.concatenate([np.asarray(by_start[s].data) for s in starts])

    return rows, [local(x) for x in arrays]


def host_rows(mesh: Mesh | None, rows: int) -> np.ndarray:
    """The global indices (ascending) of the batch rows this process places when every process
    places `rows` rows (`trajectory.shard_batch`: its rows fill its devices' parts in order)."""
    if mesh is None or jax.process_count() == 1:
        return np.arange(rows)
    total = rows * jax.process_count()
    index = sharding.batch_sharding(mesh, 1).addressable_devices_indices_map((total,))
    spans = sorted({sl[0].indices(total)[:2] for sl in index.values()})
    return np.concatenate([np.arange(a, b) for a, b in spans])


def make_train_step(cfg: TrainConfig, mesh: Mesh | None = None, *,
                    donate: bool = True) -> Callable[..., tuple[TrainState, dict[str, Array]]]:
    """The jitted update: `step(state, batch, plan=None) -> (new_state, metrics)`.

    With `cfg.pack_tokens` > 0 the episodes are scored packed (plan: `make_plan(batch, cfg)`,
    built here when not given); with `cfg.share_prompts` each prompt once (share:
    `make_share_plan(batch, cfg)`, built here when not given), and with both the share plan packs
    the responses (no `plan`).

    Performs `cfg.num_mini_batches` optimizer updates on the rollout batch (rows B, a multiple of
    num_mini_batches x micro_batch_size). metrics: dict of [M] arrays, one entry per update:
    loss, grad_norm, learning_rate and the `policy_loss` metrics combined over micro-batches.
    With donate=True the input state's buffers are reused for the output (do not use it afterwards);
    its `frozen` part (the LoRA base) is an undonated input, returned as it is.
    """
    jitted = jax.jit(functools.partial(update, cfg=cfg), donate_argnums=(0,) if donate else (),
                     compiler_options=compiler_options())

    def step(state: TrainState, batch: TrainBatch, plan: packed.PackPlan | None = None,
             share: shared_prompt.SharePlan | None = None) -> tuple[TrainState, dict[str, Array]]:
        if cfg.pack_tokens and not cfg.share_prompts and plan is None:
            plan = make_plan(batch, cfg)
        if cfg.share_prompts and share is None:
            share = make_share_plan(batch, cfg)
        with sharding.use_mesh(mesh):
            new, metrics = jitted(state.replace(frozen=None), batch, plan=plan, frozen=state.frozen, share=share)
        return new.replace(frozen=state.frozen), metrics

    return step


def make_loss_and_grads(
        cfg: TrainConfig, mesh: Mesh | None = None,
) -> Callable[[TrainState, TrainBatch], tuple[Array, Any, dict[str, Array]]]:
    """Jitted `(state, batch) -> (loss, grads, metrics)` of one mini-batch (the whole batch), with
    micro-batch accumulation per `cfg.micro_batch_size`; no update. For checks and diagnostics.
    With `cfg.pack_tokens` > 0 the batch is scored packed (one mini-batch's plan; with
    `cfg.share_prompts`, the share plan's packed responses)."""
    jitted = jax.jit(lambda s, b, p, sh: _loss_and_grads(s.params, s.graphdef, constrain_rows(b), cfg, p, s.frozen, sh),
                     compiler_options=compiler_options())

    def run(state: TrainState, batch: TrainBatch):
        plan = share = None
        if cfg.pack_tokens and not cfg.share_prompts:
            plan = jax.tree.map(lambda x: x[0], make_plan(batch, cfg, num_mini_batches=1))
        if cfg.share_prompts:
            share = jax.tree.map(lambda x: x[0], make_share_plan(batch, cfg, num_mini_batches=1))
        with sharding.use_mesh(mesh):
            return jitted(state, batch, plan, share)

    return run


__all__ = ["host_rows", "make_loss_and_grads", "make_plan", "make_share_plan", "make_train_step", "update"]
