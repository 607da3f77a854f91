"""The policy update: log-probs, GRPO / GSPO / GSsPO loss, gradients and AdamW, jitted and sharded.

Shapes: B responses in a rollout batch, T token positions, M mini-batches (optimizer updates per
rollout batch), k micro-batches per mini-batch (gradient accumulation).

One call of the step returned by `make_train_step` consumes a whole rollout batch (the trajectory
contract of `rl/batch.py`, a `TrainBatch`) and performs M AdamW updates, as verl does with
`ppo_mini_batch_size` (paper: 512 prompts per rollout step, 128 per mini-batch, so M = 4; docs/paper.md, Hyper-parameters):

    if old_logprobs are absent and M > 1: old = logp under the current params (no gradient)
    for each of the M mini-batches:                                    (a lax.scan; one program)
        grads = Σ over its k micro-batches of ∇ policy_loss(..., normalizer=N_valid(mini-batch))
        params, opt_state = AdamW(clip_by_global_norm(grads))

Exact accumulation. `losses.policy_loss` averages over valid responses; with `normalizer=N` it returns
(sum over the micro-batch's responses) / N instead, so summing micro-batch losses and gradients with N
= the mini-batch's valid-response count gives exactly the mini-batch loss and gradient.

Row splits are strided: mini-batch (or micro-batch) i takes rows i, i + n, i + 2n, ... . A [B, ...]
array sharded in contiguous blocks over (data, fsdp) then splits without moving data: every part is
itself spread evenly over the same devices. (The advantages are computed before the step, so which
rows share a mini-batch does not change the objective.)

The configuration, train state, mesh and optimizer are in `rl/train_state.py` (re-exported here).

Sharding. Parameters and optimizer moments are placed by the logical-axis table of
`workflow_r1.sharding` (FSDP over "fsdp", tensor parallelism over "tensor"); the batch is sharded
over (data, fsdp). The same code runs on one device (mesh=None), simulated CPU devices, a GPU, or
a multi-host TPU slice (call `sharding.maybe_initialize_distributed()` first, and build batches
with `batch.shard_batch`, which assembles each host's rows into one global array).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from workflow_r1 import sharding
from workflow_r1.model import qwen2
from workflow_r1.rl import losses, packed
from workflow_r1.rl.batch import TrainBatch
from workflow_r1.rl.logprobs import token_logprobs
from workflow_r1.rl.train_state import (TrainConfig, TrainState, clip_by_global_norm, compiler_options,
                                        constrain_rows, constrain_state, create_train_state, learning_rate_at,
                                        make_mesh, make_optimizer, merge_model)

Array = jax.Array


# --------------------------------------------------------------------------------------------------
# Row splits, metrics
# --------------------------------------------------------------------------------------------------

def _split_rows(tree: Any, n: int, what: str) -> Any:
    """[B, ...] leaves -> [n, B/n, ...]; part i holds rows i, i + n, i + 2n, ... (strided)."""
    b = jax.tree.leaves(tree)[0].shape[0]
    if b % n:
        raise ValueError(f"a batch of {b} rows does not split into {n} {what}; "
                         f"make the rollout batch a multiple of {n} rows or change the config")

    def one(x: Array) -> Array:
        return jnp.swapaxes(x.reshape((b // n, n) + x.shape[1:]), 0, 1)

    return constrain_rows(jax.tree.map(one, tree), lead=1)


def _merge_rows(x: Array) -> Array:
    """Inverse of `_split_rows` for one array: [n, B/n, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _num_micro(rows: int, micro_batch_size: int | None) -> int:
    if micro_batch_size is None or micro_batch_size >= rows:
        return 1
    if rows % micro_batch_size:
        raise ValueError(f"mini-batch of {rows} rows is not a multiple of TrainConfig.micro_batch_size="
                         f"{micro_batch_size}")
    return rows // micro_batch_size


# How each `policy_loss` metric combines over micro-batches: a count to weight by, or a reduction.
_SUMMED = ("num_responses", "num_units", "num_tokens")
_WEIGHTS = {"clipfrac": "num_units", "ratio_mean": "num_units", "clipfrac_dual": "num_tokens"}


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
            w = turns if key == "segment_length" else m[_WEIGHTS.get(key, "num_responses")]
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
                plan: packed.PackPlan | None = None, frozen: Any = None) -> tuple[Array, dict[str, Array]]:
    """Loss of one micro-batch (sum over its responses / normalizer) and its metrics; differentiated
    w.r.t. `params` only (`frozen`, the LoRA base, is a constant).

    plan: None, mb is the micro-batch's rows. Packed: mb is the whole mini-batch [b, T] and plan
    [r, P] the micro-batch's packed rows; the model scores those, the log-probs go back to the
    episode layout, and the loss counts only the episodes the plan holds.
    """
    model = merge_model(graphdef, params, frozen)
    kw = dict(chunk_size=cfg.logprob_chunk_size, unchunked_max_bytes=cfg.logprob_unchunked_max_mb << 20,
              with_entropy=True, entropy_grad=cfg.entropy_coef != 0, temperature=cfg.temperature)
    if plan is None:
        # Only policy tokens are scored: every term of the loss (ratios, KL, entropy) lives on them.
        score_mask = mb.loss_mask if cfg.logprob_policy_only else None
        logp, entropy = token_logprobs(model, mb.tokens, mb.positions, mb.input_mask, score_mask=score_mask, **kw)
    else:
        logp, entropy = _packed_logprobs(model, mb, plan, cfg.logprob_policy_only, kw)
        # Episodes of other micro-batches become rows without policy tokens: they add nothing.
        mb = mb.replace(loss_mask=mb.loss_mask * packed.episodes_in(plan.row, plan.segment,
                                                                    mb.tokens.shape[0])[:, None])
    # On-policy without stored old log-probs: old = sg(logp), so every ratio is exactly 1.
    old = jax.lax.stop_gradient(logp) if mb.old_logprobs is None else mb.old_logprobs
    return losses.policy_loss(
        logp, old, mb.advantages, mb.loss_mask, segment_ids=mb.segment_ids, granularity=cfg.granularity,
        clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, dual_clip_c=cfg.dual_clip_c,
        ref_logprobs=mb.ref_logprobs, kl_coef=cfg.kl_coef, sampler_logprobs=mb.sampler_logprobs, tis_cap=cfg.tis_cap,
        entropy=entropy, entropy_coef=cfg.entropy_coef, normalizer=normalizer)


def _packed_logprobs(model: nnx.Module, mb: TrainBatch, plan: packed.PackPlan, policy_only: bool,
                     kw: dict[str, Any]) -> tuple[Array, Array]:
    """(logp, entropy) in the episode layout [b, T] of mini-batch mb, scored on packed rows plan [r, P]."""
    row, col, seg = plan.row, plan.col, plan.segment
    tokens, positions, loss_mask = packed.model_inputs(mb.tokens, mb.positions, mb.loss_mask, plan)
    logp, entropy = token_logprobs(model, tokens, positions, None, score_mask=loss_mask if policy_only else None,
                                   segment_ids=seg, **kw)
    back = functools.partial(packed.scatter, plan_row=row, plan_col=col, segment=seg, shape=mb.tokens.shape)
    return back(logp), back(entropy)


def _loss_and_grads(params: Any, graphdef: Any, batch: TrainBatch, cfg: TrainConfig,
                    plan: packed.PackPlan | None = None, frozen: Any = None) -> tuple[Array, Any, dict[str, Array]]:
    """Mini-batch loss and fp32 gradients of `params`, accumulated exactly over micro-batches.

    plan: None, or the mini-batch's packed rows [R, P] (micro-batches are then of packed rows).
    """
    normalizer = _valid_rows(batch, cfg.granularity).sum().astype(jnp.float32)
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)
    k = _num_micro(batch.tokens.shape[0] if plan is None else plan.row.shape[0], cfg.micro_batch_size)
    if k == 1:
        (loss, metrics), grads = grad_fn(params, graphdef, batch, normalizer, cfg, plan, frozen)
        return loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads), metrics

    def body(carry: tuple[Array, Any], xs: Any) -> tuple[tuple[Array, Any], dict[str, Array]]:
        loss_sum, acc = carry
        mb, mplan = (constrain_rows(xs), None) if plan is None else (batch, constrain_rows(xs))
        (loss, metrics), grads = grad_fn(params, graphdef, mb, normalizer, cfg, mplan, frozen)
        acc = constrain_state(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads))
        return (loss_sum + loss, acc), metrics

    zeros = constrain_state(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    xs = _split_rows(batch, k, "micro-batches") if plan is None else _split_rows(plan, k, "packed micro-batches")
    (loss, grads), metrics = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), xs)
    return loss, grads, _combine_metrics(metrics)


def _forward_logprobs(params: Any, graphdef: Any, tokens: Array, positions: Array, input_mask: Array,
                      score_mask: Array | None, micro_batch_size: int | None, chunk_size: int | None,
                      with_entropy: bool, temperature: float = 1.0, frozen: Any = None) -> tuple[Array, Array]:
    """No-gradient (logp, entropy) [B, T] over micro-batches of rows (0 where score_mask is 0)."""
    params = jax.lax.stop_gradient(params)

    def run(x: tuple[Array, ...]) -> tuple[Array, Array]:
        t, p, m, s = constrain_rows(x)
        # Forward only: chunking costs no recomputation here, so always chunk (least memory).
        return token_logprobs(merge_model(graphdef, params, frozen), t, p, m, score_mask=s, chunk_size=chunk_size,
                              with_entropy=with_entropy, temperature=temperature)

    rows = (tokens, positions, input_mask, score_mask)
    k = _num_micro(tokens.shape[0], micro_batch_size)
    if k == 1:
        return run(rows)
    _, (logp, ent) = jax.lax.scan(lambda c, x: (c, run(x)), None, _split_rows(rows, k, "micro-batches"))
    return _merge_rows(logp), _merge_rows(ent)


def _forward_logprobs_packed(params: Any, graphdef: Any, minis: TrainBatch, plan: packed.PackPlan,
                             cfg: TrainConfig, frozen: Any = None) -> Array:
    """No-gradient logp [B, T] of the whole batch from its packed rows: minis [M, b, T] (the
    mini-batch split), plan [M, R, P]; micro-batches of packed rows as in the update."""
    model = merge_model(graphdef, jax.lax.stop_gradient(params), frozen)
    kw = dict(chunk_size=cfg.logprob_chunk_size, with_entropy=False, temperature=cfg.temperature)
    k = _num_micro(plan.row.shape[1], cfg.micro_batch_size)

    def mini(_: None, xs: tuple[TrainBatch, packed.PackPlan]) -> tuple[None, Array]:
        mb, mplan = xs
        mb = constrain_rows(mb)
        if k == 1:
            return None, _packed_logprobs(model, mb, mplan, cfg.logprob_policy_only, kw)[0]
        # Micro-batches hold disjoint episodes: their scattered log-probs add up to the mini-batch's.
        def micro(acc: Array, p: packed.PackPlan) -> tuple[Array, None]:
            return acc + _packed_logprobs(model, mb, constrain_rows(p), cfg.logprob_policy_only, kw)[0], None

        acc, _ = jax.lax.scan(micro, jnp.zeros(mb.tokens.shape, jnp.float32),
                              _split_rows(mplan, k, "packed micro-batches"))
        return None, acc

    _, logp = jax.lax.scan(mini, None, (minis, plan))
    return _merge_rows(logp)


def _apply_update(params: Any, opt_state: Any, step: Array, batch: TrainBatch, graphdef: Any,
                  cfg: TrainConfig, plan: packed.PackPlan | None = None,
                  frozen: Any = None) -> tuple[Any, Any, dict[str, Array]]:
    """One optimizer update on one mini-batch (plan: its packed rows [R, P], or None)."""
    loss, grads, metrics = _loss_and_grads(params, graphdef, batch, cfg, plan, frozen)
    updates, opt_state = make_optimizer(cfg).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                   learning_rate=learning_rate_at(cfg, step))
    return constrain_state(params), constrain_state(opt_state), metrics


def _train_step(state: TrainState, batch: TrainBatch, cfg: TrainConfig,
                plan: packed.PackPlan | None = None) -> tuple[TrainState, dict[str, Array]]:
    m = cfg.num_mini_batches
    batch = constrain_rows(batch)
    if batch.old_logprobs is None and m > 1 and plan is not None:
        old = _forward_logprobs_packed(state.params, state.graphdef,
                                       _split_rows(batch, m, "mini-batches (TrainConfig.num_mini_batches)"), plan, cfg,
                                       state.frozen)
        batch = batch.replace(old_logprobs=old)
    elif batch.old_logprobs is None and m > 1:
        # Updates 2..M see parameters that moved; their ratios need the pre-update log-probs
        # (verl recomputes them with the actor before updating; docs/paper.md, Clipping, KL and aggregation).
        old, _ = _forward_logprobs(state.params, state.graphdef, batch.tokens, batch.positions, batch.input_mask,
                                   batch.loss_mask if cfg.logprob_policy_only else None, cfg.micro_batch_size,
                                   cfg.logprob_chunk_size, with_entropy=False, temperature=cfg.temperature,
                                   frozen=state.frozen)
        batch = batch.replace(old_logprobs=old)
    if m == 1:
        # One update: no loop, so XLA can write the new parameters and moments over the donated
        # old ones (a scan's carry keeps both alive: twice the parameters and optimizer state).
        params, opt_state, metrics = _apply_update(state.params, state.opt_state, state.step, batch, state.graphdef,
                                                   cfg, None if plan is None else jax.tree.map(lambda x: x[0], plan),
                                                   state.frozen)
        metrics = jax.tree.map(lambda x: x[None], metrics)
        return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics
    minis = _split_rows(batch, m, "mini-batches (TrainConfig.num_mini_batches)")

    def body(carry: tuple[Any, Any, Array], xs: tuple[TrainBatch, packed.PackPlan | None]):
        params, opt_state, step = carry
        mb, mplan = xs
        params, opt_state, metrics = _apply_update(params, opt_state, step, constrain_rows(mb), state.graphdef, cfg,
                                                   mplan, state.frozen)
        return (params, opt_state, step + 1), metrics

    (params, opt_state, step), metrics = jax.lax.scan(body, (state.params, state.opt_state, state.step),
                                                      (minis, plan))
    return state.replace(params=params, opt_state=opt_state, step=step), metrics


def make_plan(batch: TrainBatch, cfg: TrainConfig, num_mini_batches: int | None = None) -> packed.PackPlan:
    """The host-side packing plan of a batch under `cfg.pack_tokens` (see `rl/packed.py`); reads the
    batch's masks back to the host, so one process only."""
    if jax.process_count() > 1:
        raise ValueError("train.pack_tokens works on one process only; set train.pack_tokens=0 for multi-host runs")
    return packed.make_plan(jax.device_get(batch.input_mask), jax.device_get(batch.loss_mask),
                            num_mini_batches=num_mini_batches or cfg.num_mini_batches, pack_tokens=cfg.pack_tokens,
                            rows_per_micro=cfg.micro_batch_size)


def make_train_step(cfg: TrainConfig, mesh: Mesh | None = None, *,
                    donate: bool = True) -> Callable[..., tuple[TrainState, dict[str, Array]]]:
    """The jitted update: `step(state, batch, plan=None) -> (new_state, metrics)`.

    With `cfg.pack_tokens` > 0 the episodes are scored packed (plan: `make_plan(batch, cfg)`,
    built here when not given).

    Performs `cfg.num_mini_batches` optimizer updates on the rollout batch (rows B, a multiple of
    num_mini_batches x micro_batch_size). metrics: dict of [M] arrays, one entry per update:
    loss, grad_norm, learning_rate and the `policy_loss` metrics combined over micro-batches.
    With donate=True the input state's buffers are reused for the output (do not use it afterwards);
    its `frozen` part (the LoRA base) is an undonated input, returned as it is.
    """
    def run(state: TrainState, frozen: Any, batch: TrainBatch, plan: Any) -> tuple[TrainState, dict[str, Array]]:
        new, metrics = _train_step(state.replace(frozen=frozen), batch, cfg, plan)
        return new.replace(frozen=None), metrics

    jitted = jax.jit(run, donate_argnums=(0,) if donate else (), compiler_options=compiler_options(cfg))

    def step(state: TrainState, batch: TrainBatch,
             plan: packed.PackPlan | None = None) -> tuple[TrainState, dict[str, Array]]:
        if cfg.pack_tokens and plan is None:
            plan = make_plan(batch, cfg)
        with sharding.use_mesh(mesh):
            new, metrics = jitted(state.replace(frozen=None), state.frozen, batch, plan)
        return new.replace(frozen=state.frozen), metrics

    return step


def make_loss_and_grads(
        cfg: TrainConfig, mesh: Mesh | None = None,
) -> Callable[[TrainState, TrainBatch], tuple[Array, Any, dict[str, Array]]]:
    """Jitted `(state, batch) -> (loss, grads, metrics)` of one mini-batch (the whole batch), with
    micro-batch accumulation per `cfg.micro_batch_size`; no update. For checks and diagnostics.
    With `cfg.pack_tokens` > 0 the batch is scored packed (one mini-batch's plan)."""
    jitted = jax.jit(lambda s, b, p: _loss_and_grads(s.params, s.graphdef, constrain_rows(b), cfg, p, s.frozen),
                     compiler_options=compiler_options(cfg))

    def run(state: TrainState, batch: TrainBatch):
        plan = None
        if cfg.pack_tokens:
            plan = jax.tree.map(lambda x: x[0], make_plan(batch, cfg, num_mini_batches=1))
        with sharding.use_mesh(mesh):
            return jitted(state, batch, plan)

    return run


def _compute_logprobs_impl(params, tokens, positions, input_mask, score_mask, *, graphdef, micro_batch_size,
                           chunk_size, with_entropy, temperature, mesh):
    del mesh  # only a cache key: the trace depends on the mesh through sharding constraints
    return _forward_logprobs(params, graphdef, tokens, positions, input_mask, score_mask, micro_batch_size,
                             chunk_size, with_entropy, temperature)


@functools.cache
def _compute_logprobs_jit() -> Callable[..., tuple[Array, Array]]:
    # Built on first use: the compiler options depend on the backend, unknown at import time.
    return jax.jit(_compute_logprobs_impl, compiler_options=compiler_options(),
                   static_argnames=("graphdef", "micro_batch_size", "chunk_size", "with_entropy", "temperature",
                                    "mesh"))


def compute_logprobs(model_or_state: nnx.Module | TrainState, batch: TrainBatch | Mapping[str, Any], *,
                     chunk_size: int | None = 256, micro_batch_size: int | None = None, mesh: Mesh | None = None,
                     logprob_policy_only: bool = True, with_entropy: bool = False,
                     temperature: float = 1.0) -> Array | tuple[Array, Array]:
    """Per-token log-probs [B, T] fp32 of `batch.tokens` (token t predicted from position t - 1;
    0 at t = 0), jitted, no gradient. Used for old_logprobs (current policy) and ref_logprobs (the
    reference model).

    Args:
      model_or_state: an NNX Qwen2 or a `TrainState`.
      batch: a `TrainBatch` or a mapping with tokens, positions and input_mask [B, T].
      chunk_size: positions per log-softmax chunk (None: all at once).
      micro_batch_size: rows per forward pass (None: all B rows at once).
      mesh: the mesh the arrays live on (activates the model's sharding constraints).
      logprob_policy_only: score only the tokens with loss_mask 1 (others get 0), which is all the loss
        needs and skips the output head elsewhere; False (or no loss_mask in the batch): all t >= 1.
      with_entropy: also return the per-token entropy [B, T].
      temperature: score under softmax(logits / temperature) (the rollout's sampling temperature).
    """
    if isinstance(model_or_state, TrainState):
        graphdef, params = model_or_state.graphdef, model_or_state.weights()
    else:
        graphdef, params = nnx.split(model_or_state)
    get = batch.get if isinstance(batch, Mapping) else (lambda key: getattr(batch, key, None))
    tokens = jnp.asarray(get("tokens"))
    input_mask = get("input_mask")
    input_mask = jnp.ones(tokens.shape, jnp.int32) if input_mask is None else jnp.asarray(input_mask)
    positions = get("positions")
    positions = qwen2.positions_from_mask(input_mask) if positions is None else jnp.asarray(positions)
    score_mask = get("loss_mask") if logprob_policy_only else None
    score_mask = None if score_mask is None else jnp.asarray(score_mask)
    with sharding.use_mesh(mesh):
        logp, ent = _compute_logprobs_jit()(params, tokens, positions, input_mask, score_mask, graphdef=graphdef,
                                          micro_batch_size=micro_batch_size, chunk_size=chunk_size,
                                          with_entropy=with_entropy, temperature=float(temperature), mesh=mesh)
    return (logp, ent) if with_entropy else logp


__all__ = ["TrainConfig", "TrainState", "make_mesh", "make_optimizer", "clip_by_global_norm", "learning_rate_at", "create_train_state",
           "compiler_options", "make_plan", "make_train_step", "make_loss_and_grads", "compute_logprobs"]
