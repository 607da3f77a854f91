"""Scoring: per-token log-probs of a batch under a policy, without gradients, in micro-batches of rows.

Shapes: B responses, T token positions, k micro-batches, R packed rows of P positions.

The learner scores a batch twice before it updates (rl/learner.py): the old log-probs (the
current policy, when the update takes several mini-batches) and the KL reference log-probs (the
initial policy). Both go through `forward_logprobs` (episode rows) or `forward_logprobs_packed`
(the episodes packed into rows, `train.pack_tokens`) or `forward_logprobs_shared` (each prompt
once, `train.share_prompts`); `compute_logprobs` / `compute_logprobs_shared` are the jitted entry
point, and `score_program` the function that `workflow_r1.aot` compiles for a TPU topology.

Row splits are strided (`split_rows`): part i holds rows i, i + n, i + 2n, ... . A [B, ...] array
sharded in contiguous blocks over (data, fsdp) then splits without moving data: every part is
itself spread evenly over the same devices. The train step splits mini-batches and micro-batches
the same way.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from workflow_r1 import sharding, trajectory
from workflow_r1.rl import packed, shared_prompt
from workflow_r1.rl.logprobs import token_logprobs
from workflow_r1.rl.train_state import TrainConfig, TrainState, compiler_options, constrain_rows, merge_model
from workflow_r1.trajectory import TrainBatch

Array = jax.Array


def split_rows(tree: Any, n: int, what: str) -> Any:
    """[B, ...] leaves -> [n, B/n, ...]; part i holds rows i, i + n, i + 2n, ... (strided)."""
    b = jax.tree.leaves(tree)[0].shape[0]
    if b % n:
        raise ValueError(f"a batch of {b} rows does not split into {n} {what}; "
                         f"make the rollout batch a multiple of {n} rows or change the config")

    def one(x: Array) -> Array:
        return jnp.swapaxes(x.reshape((b // n, n) + x.shape[1:]), 0, 1)

    return constrain_rows(jax.tree.map(one, tree), lead=1)


def merge_rows(x: Array) -> Array:
    """Inverse of `split_rows` for one array: [n, B/n, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def num_micro(rows: int, micro_batch_size: int | None) -> int:
    """Micro-batches of `micro_batch_size` rows in `rows` (1 when None or not smaller)."""
    if micro_batch_size is None or micro_batch_size >= rows:
        return 1
    if rows % micro_batch_size:
        raise ValueError(f"mini-batch of {rows} rows is not a multiple of TrainConfig.micro_batch_size="
                         f"{micro_batch_size}")
    return rows // micro_batch_size


def packed_logprobs(model: nnx.Module, mb: TrainBatch, plan: packed.PackPlan, policy_only: bool,
                    kw: dict[str, Any]) -> tuple[Array, Array]:
    """(logp, entropy) in the episode layout [b, T] of mini-batch mb, scored on packed rows plan [r, P]."""
    row, col, seg = plan.row, plan.col, plan.segment
    tokens, positions, loss_mask = packed.model_inputs(mb.tokens, mb.positions, mb.loss_mask, plan)
    logp, entropy = token_logprobs(model, tokens, positions, None, score_mask=loss_mask if policy_only else None,
                                   segment_ids=seg, **kw)
    back = functools.partial(packed.scatter, plan_row=row, plan_col=col, segment=seg, shape=mb.tokens.shape)
    return back(logp), back(entropy)


def forward_logprobs(params: Any, graphdef: Any, tokens: Array, positions: Array, input_mask: Array,
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
    k = num_micro(tokens.shape[0], micro_batch_size)
    if k == 1:
        return run(rows)
    _, (logp, ent) = jax.lax.scan(lambda c, x: (c, run(x)), None, split_rows(rows, k, "micro-batches"))
    return merge_rows(logp), merge_rows(ent)


def forward_logprobs_packed(params: Any, graphdef: Any, minis: TrainBatch, plan: packed.PackPlan,
                            cfg: TrainConfig, frozen: Any = None) -> Array:
    """No-gradient logp [B, T] of the whole batch from its packed rows: minis [M, b, T] (the
    mini-batch split), plan [M, R, P]; micro-batches of packed rows as in the update."""
    model = merge_model(graphdef, jax.lax.stop_gradient(params), frozen)
    kw = dict(chunk_size=cfg.logprob_chunk_size, with_entropy=False, temperature=cfg.temperature)
    k = num_micro(plan.row.shape[1], cfg.micro_batch_size)

    def mini(_: None, xs: tuple[TrainBatch, packed.PackPlan]) -> tuple[None, Array]:
        mb, mplan = xs
        mb = constrain_rows(mb)
        if k == 1:
            return None, packed_logprobs(model, mb, mplan, cfg.logprob_policy_only, kw)[0]
        # Micro-batches hold disjoint episodes: their scattered log-probs add up to the mini-batch's.
        def micro(acc: Array, p: packed.PackPlan) -> tuple[Array, None]:
            return acc + packed_logprobs(model, mb, constrain_rows(p), cfg.logprob_policy_only, kw)[0], None

        acc, _ = jax.lax.scan(micro, jnp.zeros(mb.tokens.shape, jnp.float32),
                              split_rows(mplan, k, "packed micro-batches"))
        return None, acc

    _, logp = jax.lax.scan(mini, None, (minis, plan))
    return merge_rows(logp)


def forward_logprobs_shared(params: Any, graphdef: Any, minis: TrainBatch, share: shared_prompt.SharePlan,
                            cfg: TrainConfig, frozen: Any = None) -> Array:
    """No-gradient logp [B, T] of the whole batch with each micro-batch's prompts computed once:
    minis [M, b, T] (the mini-batch split), share [M, k, ...] (`shared_prompt.make_plan`);
    micro-batches as in the update."""
    model = merge_model(graphdef, jax.lax.stop_gradient(params), frozen)
    kw = dict(chunk_size=cfg.logprob_chunk_size, with_entropy=False, temperature=cfg.temperature)

    def micro(_: None, xs: tuple[TrainBatch, shared_prompt.SharePlan]) -> tuple[None, Array]:
        rows, plan = xs
        rows = constrain_rows(rows)
        score_mask = rows.loss_mask if cfg.logprob_policy_only else None
        return None, shared_prompt.token_logprobs(model, rows.tokens, rows.positions, plan, score_mask=score_mask,
                                                  **kw)[0]

    def mini(_: None, xs: tuple[TrainBatch, shared_prompt.SharePlan]) -> tuple[None, Array]:
        mb, plan = xs
        k = plan.prompt_row.shape[0]
        _, logp = jax.lax.scan(micro, None, (split_rows(constrain_rows(mb), k, "micro-batches"), plan))
        return None, merge_rows(logp)

    _, logp = jax.lax.scan(mini, None, (minis, share))
    return merge_rows(logp)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def shared_score_program(params: Any, batch: TrainBatch, share: shared_prompt.SharePlan, *, graphdef: Any,
                         cfg: TrainConfig) -> Array:
    """logp [B, T] of the batch with its prompts shared: the program `compute_logprobs_shared` runs
    and `workflow_r1.aot` compiles."""
    m = share.prompt_row.shape[0]
    return forward_logprobs_shared(params, graphdef, split_rows(batch, m, "mini-batches"), share, cfg)


def compute_logprobs_shared(state: TrainState, batch: TrainBatch, share: shared_prompt.SharePlan, cfg: TrainConfig,
                            mesh: Mesh | None = None) -> Array:
    """`compute_logprobs` of a TrainState with the batch's prompts shared (share: its plan
    [M, k, ...], `train_step.make_share_plan`): logp [B, T] fp32, jitted, no gradient."""
    with sharding.use_mesh(mesh):
        return shared_score_program(state.weights(), batch, share, graphdef=state.graphdef, cfg=cfg)


def score_program(params: Any, tokens: Array, positions: Array, input_mask: Array, score_mask: Array | None, *,
                  graphdef: Any, micro_batch_size: int | None, chunk_size: int | None, with_entropy: bool,
                  temperature: float, mesh: Mesh | None) -> tuple[Array, Array]:
    """`forward_logprobs` of a batch's arrays with every static argument by keyword: the program
    `compute_logprobs` jits and `workflow_r1.aot` compiles (the reference log-probs)."""
    del mesh  # only a cache key: the trace depends on the mesh through sharding constraints
    return forward_logprobs(params, graphdef, tokens, positions, input_mask, score_mask, micro_batch_size,
                            chunk_size, with_entropy, temperature)


@functools.cache
def _score_jit() -> Callable[..., tuple[Array, Array]]:
    # Built on first use: the compiler options depend on the backend, unknown at import time.
    return jax.jit(score_program, compiler_options=compiler_options(),
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
    positions = trajectory.positions_from_mask(input_mask) if positions is None else jnp.asarray(positions)
    score_mask = get("loss_mask") if logprob_policy_only else None
    score_mask = None if score_mask is None else jnp.asarray(score_mask)
    with sharding.use_mesh(mesh):
        logp, ent = _score_jit()(params, tokens, positions, input_mask, score_mask, graphdef=graphdef,
                                 micro_batch_size=micro_batch_size, chunk_size=chunk_size,
                                 with_entropy=with_entropy, temperature=float(temperature), mesh=mesh)
    return (logp, ent) if with_entropy else logp


__all__ = ["compute_logprobs", "compute_logprobs_shared", "forward_logprobs", "forward_logprobs_packed",
           "forward_logprobs_shared", "merge_rows", "num_micro",
           "packed_logprobs", "score_program", "shared_score_program", "split_rows"]
