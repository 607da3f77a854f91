"""The policy's train state and optimizer: `TrainConfig` (the `train` section), `TrainState` (what
the update changes, as pytrees orbax saves), AdamW with global-norm clipping and warm-up, and the
XLA options of every jitted step (the mesh is the `mesh` section's: `sharding.make_meshes`). The update itself is `rl/train_step.py`.

Sharding: parameters and AdamW moments are placed by the logical-axis table of
`workflow_r1.sharding`; `constrain_state` / `constrain_rows` pin trees inside jitted code.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from workflow_r1 import bounds, sharding
from workflow_r1.model import lora
from workflow_r1.rl import advantages, losses

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
      "dr_grpo" without the std division, "rloo" leave-one-out; `advantages.ESTIMATORS`).
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
    share_prompts: run each micro-batch's distinct prompts through the model once, every response
      of a prompt attending to its one copy (`rl/shared_prompt.py`), in the update, the old
      log-probs and the KL reference scoring; the log-probs, loss and gradients are the unshared
      ones to float rounding. The learner reorders each host's rows within their mini-batches so a
      group's samples share micro-batches. With pack_tokens too, each micro-batch's responses are
      packed into rows of pack_tokens positions, each continuing its own prompt's one copy;
      micro_batch_size then counts rows of the batch as without packing, and pack_tokens must hold
      the longest response (not episode).
    temperature: log-probs are of softmax(logits / temperature), the rollout's sampling temperature
      (both sides of the importance ratio must score the same distribution).
    filter_groups: dynamic sampling (DAPO): drop the groups whose n total rewards are all equal
      (advantage 0 on every row) before the update (`dynamic_sampling.varied_groups`; docs/design.md,
      Dynamic sampling); metric train/kept_group_fraction. A step that keeps none skips its update.
    filter_keep_shape: with filter_groups, pad the kept groups with inert rows to the whole rollout
      batch instead of to the next of a few row counts (`dynamic_sampling.filtered_rows`), and keep
      a group's samples in one micro-batch (as share_prompts does): micro-batches of padding alone
      are then skipped at run time (a `lax.cond` in the gradient pass), so the update costs what
      the kept rows cost but compiles once, not once per kept-row count (40-60 s each for the 0.5B
      on 2 CPU cores). The old log-probs of num_mini_batches > 1 still score every row.
    refill_rounds: with filter_groups, while fewer than rollout.prompts_per_step groups differ (all
      hosts), roll out up to this many more batches of the next questions and add their varied
      groups (DAPO's over-sampling; the update trains on at most prompts_per_step groups); metric
      train/refill_rounds. 0: off. Each refill costs a rollout and moves the data position on.
    max_staleness: policy versions a training token may lag the update: batch t is generated by
      version >= t-1-k (k = max_staleness). 0: synchronous, today's behaviour bit for bit. > 0: the
      policy loss multiplies each unit's (token / response / turn, by `granularity`) per-token losses
      by the decoupled behaviour weight min(exp(mean over the unit of old - sampler log-probs),
      behaviour_weight_cap), stop-gradient (`losses.policy_loss`'s behaviour_cap; docs/paper.md, Our
      extension); the batch must carry the sampler's log-probs. Not with tis_cap (the behaviour weight
      replaces it) nor refill_rounds (refills roll out synchronously inside a step).
    behaviour_weight_cap: the cap C of that weight (> 0); used only when max_staleness > 0.
    partial_rollouts: with max_staleness = k > 0, batch t's turn j is generated by version
      min(t - 1, max(0, t - 1 - k) + j) instead of every turn by max(0, t - 1 - k): episodes in
      flight continue with the newest weights the step allows at their next turn (pipeline.py).
    grad_diagnostics_every: every that many steps (rollout batches), also compute the GRPO, GSPO and
      GSsPO policy gradients of the same batch and log their cosines, norm ratios and clip
      fractions (`rl/diagnostics.py`; docs/design.md, Gradient diagnostics); the update applied is
      the configured one either way. 0: never. Costs about three more backward passes on those steps.
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
    filter_groups: bool = False
    filter_keep_shape: bool = False
    refill_rounds: int = 0
    max_staleness: int = 0
    behaviour_weight_cap: float = 2.0
    partial_rollouts: bool = False
    grad_diagnostics_every: int = 0
    pack_tokens: int = 0
    share_prompts: bool = False

    def __post_init__(self):
        if self.granularity not in losses.GRANULARITIES:
            raise ValueError(f"TrainConfig.granularity={self.granularity!r} unknown; use one of {losses.GRANULARITIES}")
        if self.advantage not in advantages.KINDS:
            raise ValueError(f"TrainConfig.advantage={self.advantage!r} unknown; use one of {advantages.KINDS}")
        c = bounds.check
        c("train.learning_rate", self.learning_rate, 0, 1, above=True)
        c("train.warmup_steps", self.warmup_steps, 0, bounds.MAX_COUNT, note=" (0: none)")
        c("train.weight_decay", self.weight_decay, 0, 10)
        c("train.adam_b1", self.adam_b1, 0, 0.9999)
        c("train.adam_b2", self.adam_b2, 0, 0.9999999)
        c("train.adam_eps", self.adam_eps, 0, 1, above=True)
        c("train.max_grad_norm", self.max_grad_norm, 0, 1e6, above=True, optional=True, note=" (None: no clipping)")
        c("train.clip_eps_low", self.clip_eps_low, 0, 1, above=True)
        c("train.clip_eps_high", self.clip_eps_high, 0, 100, above=True)
        c("train.dual_clip_c", self.dual_clip_c, 1, 1e6, above=True, optional=True, note=" (None: off)")
        c("train.kl_coef", self.kl_coef, 0, 1e3, note=" (0: no KL term)")
        c("train.tis_cap", self.tis_cap, 0, 1e6, above=True, optional=True, note=" (None: no correction)")
        c("train.entropy_coef", self.entropy_coef, 0, 1e3, note=" (0: no entropy term)")
        c("train.num_mini_batches", self.num_mini_batches, 1, bounds.MAX_COUNT)
        c("train.micro_batch_size", self.micro_batch_size, 1, bounds.MAX_COUNT, optional=True)
        c("train.logprob_chunk_size", self.logprob_chunk_size, 1, bounds.MAX_TOKENS, optional=True)
        c("train.logprob_unchunked_max_mb", self.logprob_unchunked_max_mb, 0, 1 << 30, note=" (0: always chunk)")
        c("train.temperature", self.temperature, 0, 100, above=True)
        c("train.grad_diagnostics_every", self.grad_diagnostics_every, 0, bounds.MAX_COUNT, note=" (0: off)")
        c("train.refill_rounds", self.refill_rounds, 0, 1000, note=" (0: off)")
        c("train.pack_tokens", self.pack_tokens, 0, bounds.MAX_TOKENS, note=" (0: no packing)")
        c("train.max_staleness", self.max_staleness, 0, 1000, note=" (0: synchronous)")
        c("train.behaviour_weight_cap", self.behaviour_weight_cap, 0, 1e6, above=True)
        if self.max_staleness and self.tis_cap is not None:
            raise ValueError("train.tis_cap and train.max_staleness > 0 both correct the sampler mismatch (the "
                             "behaviour weight replaces TIS); set train.tis_cap=None")
        if self.partial_rollouts and not self.max_staleness:
            raise ValueError("train.partial_rollouts changes weights between the turns of a batch rolled out ahead of "
                             "the learner; set train.max_staleness >= 1 or train.partial_rollouts=False")
        if self.max_staleness and self.refill_rounds:
            raise ValueError("train.refill_rounds rolls out synchronously inside a step, which train.max_staleness > 0 "
                             "does not allow; set train.refill_rounds=0 or train.max_staleness=0")
        if self.filter_keep_shape and not self.filter_groups:
            raise ValueError("train.filter_keep_shape pads the batch that filter_groups filters; set "
                             "train.filter_groups=True or train.filter_keep_shape=False")
        if self.refill_rounds and not self.filter_groups:
            raise ValueError("TrainConfig.refill_rounds refills the groups that filter_groups drops; set "
                             "train.filter_groups=True or train.refill_rounds=0")

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
        return merge_model(self.graphdef, self.params, self.frozen)

    def weights(self) -> Any:
        """nnx.State of every parameter of the model (trained and frozen; no copy)."""
        return self.params if self.frozen is None else nnx.merge_state(self.params, self.frozen)


def merge_model(graphdef: Any, params: Any, frozen: Any) -> nnx.Module:
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


# --------------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------------

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


def constrain_state(tree: Any) -> Any:
    """Pins a params / opt-state tree to its logical-axis shardings (no-op without a mesh)."""
    mesh = sharding.current_mesh()
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, sharding.state_shardings(tree, mesh))


def constrain_rows(tree: Any, lead: int = 0) -> Any:
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


def compiler_options() -> dict[str, Any] | None:
    """XLA options for the update's and scoring's jitted functions on the current default backend
    (None: XLA's defaults). On the CPU, XLA's oneDNN matmul path: about 1.4x faster fp32 matmuls
    than the default emitter on the machines we measured. (XLA:CPU's memory-optimized scheduler is
    not asked for: it cut the tiny preset's update at T = 5,120 from 10.7 to 5.9 GiB of
    temporaries but raised the `local` preset's LoRA + remat update at 4 x 1,024 from 2.2 to 8.5.)"""
    if jax.default_backend() == "cpu":
        return {"xla_cpu_experimental_onednn_custom_call": True}
    return None
