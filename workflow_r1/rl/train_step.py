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

Sharding. Parameters and optimizer moments are placed by the logical-axis table of
`workflow_r1.sharding` (FSDP over "fsdp", tensor parallelism over "tensor"); the batch is sharded
over (data, fsdp). The same code runs on one device (mesh=None), simulated CPU devices, a GPU, or
a multi-host TPU slice (call `sharding.maybe_initialize_distributed()` first, and build batches
with `batch.shard_batch`, which assembles each host's rows into one global array).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from workflow_r1 import sharding
from workflow_r1.model import lora, qwen2
from workflow_r1.rl import advantages, losses, packed
from workflow_r1.rl.batch import TrainBatch
from workflow_r1.rl.logprobs import token_logprobs

Array = jax.Array


# --------------------------------------------------------------------------------------------------
# Configuration and state
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of the update. Defaults are the paper's run (docs/paper.md, Hyper-parameters).

    Optimizer: AdamW(b1, b2, eps, weight_decay on every parameter, as torch's AdamW in verl),
    after clipping the global gradient norm to `max_grad_norm` (None: no clipping); learning rate
    constant after a linear warm-up of `warmup_steps` optimizer updates from 0 (0: none).
    Loss: see `losses.policy_loss`. `kl_coef` applies only when the batch carries ref_logprobs.
    advantage: how a group's rewards become advantages, one of `advantages.KINDS` ("grpo" the paper's,
      "dr_grpo" without the std division, "rloo" leave-one-out; `rl.learner.advantages`).
    Batching: `num_mini_batches` optimizer updates per rollout batch; `micro_batch_size` rows per
    gradient-accumulation step (None: the whole mini-batch at once); `logprob_chunk_size` positions
    per log-softmax chunk (None: whole sequence; see `logprobs.py`), except that a micro-batch whose
    fp32 logits [B, T, V] take at most `logprob_unchunked_max_mb` MiB is scored in one piece
    (no recomputation in the backward pass; 0: always chunk). `logprob_policy_only` runs the output
    head only on policy tokens (loss_mask 1), the only ones the loss reads; False scores every
    position (same loss, more work; for comparisons).
    pack_tokens: 0 (off) scores each episode in its own row of the batch's padded length T. > 0
      packs each mini-batch's episodes first-fit-decreasing into rows of this many tokens, each
      episode attending only to itself with its own positions (`rl/packed.py`); the loss, its
      gradient and the metrics are those of the unpacked batch (to float rounding). With packing,
      `micro_batch_size` counts packed rows, so a micro-batch holds at most micro_batch_size x
      pack_tokens tokens (None: all of a mini-batch's packed rows at once). It must hold the
      longest episode. The number of packed rows depends on the batch, and each new count
      compiles the step once more.
    temperature: log-probs are of softmax(logits / temperature), the rollout's sampling temperature
      (both sides of the importance ratio must score the same distribution).
    Mesh: sizes of the (data, fsdp, tensor) axes for `make_mesh`; one may be -1 (the rest).
    remat: None keeps the model's own setting; True/False overrides it in `create_train_state`.
    filter_groups: dynamic sampling (DAPO): drop the groups whose n total rewards are all equal
      (advantage 0 on every row) before the update (`learner.varied_groups`; docs/design.md,
      Dynamic sampling); metric train/kept_group_fraction. A step that keeps none skips its update.
    grad_diagnostics_every: every that many steps (rollout batches), also compute the GRPO, GSPO and
      GSsPO policy gradients of the same batch and log their cosines, norm ratios and clip
      fractions (`rl/diagnostics.py`; docs/design.md, Gradient diagnostics); the update applied is
      the configured one either way. 0: never. Costs about three more backward passes on those steps.
    cpu_onednn: on the CPU backend, compile with XLA's oneDNN matmul path
      (xla_cpu_experimental_onednn_custom_call), about 1.4x faster fp32 matmuls than the default
      emitter on the machines we measured; ignored on GPU/TPU.
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.01
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    advantage: str = "grpo"
    granularity: str = "subsequence"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = 3.0
    kl_coef: float = 0.001
    tis_cap: float | None = None
    entropy_coef: float = 0.0
    num_mini_batches: int = 4
    micro_batch_size: int | None = None
    logprob_chunk_size: int | None = 256
    logprob_unchunked_max_mb: int = 1024
    logprob_policy_only: bool = True
    temperature: float = 1.0
    mesh_data: int = -1
    mesh_fsdp: int = 1
    mesh_tensor: int = 1
    remat: bool | None = None
    filter_groups: bool = False
    grad_diagnostics_every: int = 0
    cpu_onednn: bool = True
    pack_tokens: int = 0

    def __post_init__(self):
        if self.granularity not in losses.GRANULARITIES:
            raise ValueError(f"TrainConfig.granularity={self.granularity!r} unknown; use one of {losses.GRANULARITIES}")
        if self.advantage not in advantages.KINDS:
            raise ValueError(f"TrainConfig.advantage={self.advantage!r} unknown; use one of {advantages.KINDS}")
        if self.num_mini_batches < 1:
            raise ValueError(f"TrainConfig.num_mini_batches must be >= 1, got {self.num_mini_batches}")
        for name in ("micro_batch_size", "logprob_chunk_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1 or None, got {v}")
        if not self.temperature > 0:
            raise ValueError(f"TrainConfig.temperature must be > 0, got {self.temperature}")
        if self.grad_diagnostics_every < 0:
            raise ValueError(f"TrainConfig.grad_diagnostics_every must be >= 0 (0: off), got "
                             f"{self.grad_diagnostics_every}")
        if self.warmup_steps < 0:
            raise ValueError(f"TrainConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.pack_tokens < 0:
            raise ValueError(f"TrainConfig.pack_tokens must be >= 0 (0: no packing), got {self.pack_tokens}")

    def replace(self, **kw: Any) -> "TrainConfig":
        return dataclasses.replace(self, **kw)


@flax.struct.dataclass
class TrainState:
    """Everything the update changes, as plain pytrees (orbax can save params/opt_state/step).

    graphdef: the model's static structure (not a pytree leaf; rebuild the model with `state.model()`).
    params: nnx.State of the parameters that train (arrays, sharded by the logical-axis table): all
      of the model's, or only its LoRA adapters (`model.lora`) when it has them.
    opt_state: the optax state of `make_optimizer(cfg)` over `params` (moments sharded like them).
    step: int32 scalar, number of optimizer updates applied so far.
    frozen: nnx.State of the parameters that do not train (the LoRA base), or None (full
      fine-tuning). Never donated by the train step, never checkpointed (it reloads from the model).
    """

    graphdef: Any = flax.struct.field(pytree_node=False)
    params: Any
    opt_state: Any
    step: Array
    frozen: Any = None

    def model(self) -> nnx.Module:
        return _merge(self.graphdef, self.params, self.frozen)

    def weights(self) -> Any:
        """nnx.State of every parameter of the model (trained and frozen; no copy)."""
        return self.params if self.frozen is None else nnx.merge_state(self.params, self.frozen)


def _merge(graphdef: Any, params: Any, frozen: Any) -> nnx.Module:
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


# --------------------------------------------------------------------------------------------------
# Mesh, optimizer
# --------------------------------------------------------------------------------------------------

def make_mesh(cfg: TrainConfig, devices: Any = None) -> Mesh:
    """The (data, fsdp, tensor) mesh of `cfg.mesh_*` over `devices` (default: all, every host)."""
    return sharding.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor, devices=devices)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """g * min(1, max_norm / ||g||) (torch `clip_grad_norm_` without its 1e-6), as one scalar factor.

    Same result as `optax.clip_by_global_norm`, whose per-leaf `g / norm * max_norm` contains a
    division that XLA will not duplicate into the Adam moment updates, so every scaled gradient gets
    materialised (one extra write + read of the full gradient). A scalar multiply fuses.
    """

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, optax.EmptyState]:
        del params
        norm = optax.tree.norm(updates)
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) then AdamW with a constant (optionally warmed-up) rate."""
    # optax counts updates from 0 in the schedule's argument, as `learning_rate_at` expects.
    lr = functools.partial(learning_rate_at, cfg) if cfg.warmup_steps else cfg.learning_rate
    parts = [] if cfg.max_grad_norm is None else [clip_by_global_norm(cfg.max_grad_norm)]
    parts.append(optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts)


def learning_rate_at(cfg: TrainConfig, step: Array | int) -> Array:
    """The learning rate of update number `step` (0-based): lr · min(1, (step + 1) / warmup_steps).

    The warm-up starts at lr / warmup_steps rather than 0, so no rollout batch is spent on an update
    of size zero; it reaches the full rate at update warmup_steps - 1.
    """
    lr = jnp.asarray(cfg.learning_rate, jnp.float32)
    if not cfg.warmup_steps:
        return lr
    return lr * jnp.minimum(1.0, (jnp.asarray(step, jnp.float32) + 1.0) / cfg.warmup_steps)


def _constrain_state(tree: Any) -> Any:
    """Pins a params / opt-state tree to its logical-axis shardings (no-op without a mesh)."""
    mesh = sharding.current_mesh()
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, sharding.state_shardings(tree, mesh))


def _constrain_rows(tree: Any, lead: int = 0) -> Any:
    """Pins [(lead dims), B, ...] arrays to batch sharding on the B dimension (no-op without a mesh)."""
    def one(x: Array) -> Array:
        return sharding.constrain(x, (None,) * lead + ("batch",) + (None,) * (x.ndim - lead - 1))

    return jax.tree.map(one, tree)


def create_train_state(model: nnx.Module, cfg: TrainConfig, mesh: Mesh | None = None) -> TrainState:
    """Splits the model into a `TrainState` and initialises the optimizer, placed on `mesh`.

    The parameters are (re)placed on their logical-axis shardings (a no-op for a model loaded with
    `checkpoint.load(..., mesh=mesh)`); the AdamW moments get the same shardings. A model with
    LoRA adapters trains only those (`lora.trainable`): the rest is the state's `frozen` part.
    """
    if cfg.remat is not None:
        model.remat = cfg.remat
    if lora.has_adapters(model):
        graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
    else:
        (graphdef, params), frozen = nnx.split(model), None
    tx = make_optimizer(cfg)
    if mesh is None:
        opt_state = jax.jit(tx.init)(params)
    else:
        params = jax.device_put(params, sharding.state_shardings(params, mesh))
        if frozen is not None:
            frozen = jax.device_put(frozen, sharding.state_shardings(frozen, mesh))
        opt_shardings = sharding.state_shardings(jax.eval_shape(tx.init, params), mesh)
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step = jnp.zeros((), jnp.int32)
    if mesh is not None:
        step = jax.device_put(step, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return TrainState(graphdef=graphdef, params=params, opt_state=opt_state, step=step, frozen=frozen)


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

    return _constrain_rows(jax.tree.map(one, tree), lead=1)


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
    model = _merge(graphdef, params, frozen)
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
        mb, mplan = (_constrain_rows(xs), None) if plan is None else (batch, _constrain_rows(xs))
        (loss, metrics), grads = grad_fn(params, graphdef, mb, normalizer, cfg, mplan, frozen)
        acc = _constrain_state(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads))
        return (loss_sum + loss, acc), metrics

    zeros = _constrain_state(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    xs = _split_rows(batch, k, "micro-batches") if plan is None else _split_rows(plan, k, "packed micro-batches")
    (loss, grads), metrics = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), xs)
    return loss, grads, _combine_metrics(metrics)


def _forward_logprobs(params: Any, graphdef: Any, tokens: Array, positions: Array, input_mask: Array,
                      score_mask: Array | None, micro_batch_size: int | None, chunk_size: int | None,
                      with_entropy: bool, temperature: float = 1.0, frozen: Any = None) -> tuple[Array, Array]:
    """No-gradient (logp, entropy) [B, T] over micro-batches of rows (0 where score_mask is 0)."""
    params = jax.lax.stop_gradient(params)

    def run(x: tuple[Array, ...]) -> tuple[Array, Array]:
        t, p, m, s = _constrain_rows(x)
        # Forward only: chunking costs no recomputation here, so always chunk (least memory).
        return token_logprobs(_merge(graphdef, params, frozen), t, p, m, score_mask=s, chunk_size=chunk_size,
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
    model = _merge(graphdef, jax.lax.stop_gradient(params), frozen)
    kw = dict(chunk_size=cfg.logprob_chunk_size, with_entropy=False, temperature=cfg.temperature)
    k = _num_micro(plan.row.shape[1], cfg.micro_batch_size)

    def mini(_: None, xs: tuple[TrainBatch, packed.PackPlan]) -> tuple[None, Array]:
        mb, mplan = xs
        mb = _constrain_rows(mb)
        if k == 1:
            return None, _packed_logprobs(model, mb, mplan, cfg.logprob_policy_only, kw)[0]
        # Micro-batches hold disjoint episodes: their scattered log-probs add up to the mini-batch's.
        def micro(acc: Array, p: packed.PackPlan) -> tuple[Array, None]:
            return acc + _packed_logprobs(model, mb, _constrain_rows(p), cfg.logprob_policy_only, kw)[0], None

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
    return _constrain_state(params), _constrain_state(opt_state), metrics


def _train_step(state: TrainState, batch: TrainBatch, cfg: TrainConfig,
                plan: packed.PackPlan | None = None) -> tuple[TrainState, dict[str, Array]]:
    m = cfg.num_mini_batches
    batch = _constrain_rows(batch)
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
        params, opt_state, metrics = _apply_update(params, opt_state, step, _constrain_rows(mb), state.graphdef, cfg,
                                                   mplan, state.frozen)
        return (params, opt_state, step + 1), metrics

    (params, opt_state, step), metrics = jax.lax.scan(body, (state.params, state.opt_state, state.step),
                                                      (minis, plan))
    return state.replace(params=params, opt_state=opt_state, step=step), metrics


def compiler_options(cfg: TrainConfig | None = None) -> dict[str, Any] | None:
    """XLA options for our jitted functions on the current default backend (None: XLA's defaults)."""
    if jax.default_backend() == "cpu" and (cfg is None or cfg.cpu_onednn):
        return {"xla_cpu_experimental_onednn_custom_call": True}
    return None


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
    jitted = jax.jit(lambda s, b, p: _loss_and_grads(s.params, s.graphdef, _constrain_rows(b), cfg, p, s.frozen),
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
