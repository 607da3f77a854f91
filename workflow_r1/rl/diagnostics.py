"""Same-batch gradient diagnostics: the GRPO, GSPO and GSsPO policy gradients of one batch, compared.

The three losses differ only in the unit their importance ratio and clip act on (token, sequence,
sub-sequence: `losses.policy_loss`'s `granularity`). Three end-to-end runs compare them through
noisy curves; this compares the gradients they would take on the *same* batch at the *same*
parameters, on the steps `train.grad_diagnostics_every` selects (docs/design.md, Gradient
diagnostics). Only the policy term is compared (no KL, no entropy), before gradient clipping.

Metrics (scalars), for granularities a, b in ("token", "sequence", "subsequence"):
  diag/cos_a_b          cosine similarity of the flattened gradients of a and b
  diag/norm_ratio_a_b   ||g_a|| / ||g_b||
  diag/grad_norm_a      ||g_a|| (global L2 norm over every parameter)
  diag/clipfrac_a       fraction of a's units whose clipped branch is active (`policy_loss` clipfrac)

Pure functions; `make_grad_diagnostics` jits them at the edge. Nothing here applies an update.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from workflow_r1 import sharding
from workflow_r1.rl import losses
from workflow_r1.rl import train_state, train_step as ts
from workflow_r1.trajectory import TrainBatch

Array = jax.Array
PAIRS = tuple(itertools.combinations(losses.GRANULARITIES, 2))


def _dot(a: Any, b: Any) -> Array:
    """Σ over every leaf of <a, b>, in float32."""
    return sum(jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32)) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compare(grads: Mapping[str, Any]) -> dict[str, Array]:
    """Cosines, norm ratios and norms of gradient pytrees keyed by granularity (see the module doc).

    A zero gradient has cosine 0 with everything and norm ratio 0 (or 0 / 0 = 0)."""
    sq = {g: _dot(x, x) for g, x in grads.items()}
    norm = {g: jnp.sqrt(v) for g, v in sq.items()}
    out: dict[str, Array] = {f"diag/grad_norm_{g}": n for g, n in norm.items()}
    names = [g for g in losses.GRANULARITIES if g in grads]
    for a, b in itertools.combinations(names, 2):
        den = norm[a] * norm[b]
        out[f"diag/cos_{a}_{b}"] = jnp.where(den > 0, _dot(grads[a], grads[b]) / jnp.where(den > 0, den, 1), 0.0)
        out[f"diag/norm_ratio_{a}_{b}"] = jnp.where(norm[b] > 0, norm[a] / jnp.where(norm[b] > 0, norm[b], 1), 0.0)
    return out


def policy_gradients(params: Any, graphdef: Any, batch: TrainBatch, cfg: train_state.TrainConfig,
                     frozen: Any = None) -> tuple[dict[str, Any], dict[str, Array]]:
    """The policy-term gradient of `batch` under each granularity, at `params`, and their clip fractions.

    Args:
      batch: a `TrainBatch` [B, T] with `old_logprobs` (the ratios' denominator); its ref_logprobs
        are ignored. Accumulated over micro-batches as the update does (`cfg.micro_batch_size`).
      cfg: the run's `train` section; only its granularity, KL and entropy coefficients are replaced.
      frozen: the parameters that do not train (the LoRA base; `TrainState.frozen`), or None.

    Returns:
      ({granularity: fp32 gradient pytree like params}, {"diag/clipfrac_<granularity>": scalar}).
    """
    if batch.old_logprobs is None:
        raise ValueError("gradient diagnostics need the batch's old_logprobs (the rollout policy's log-probs)")
    batch = batch.replace(ref_logprobs=None)
    grads, clip = {}, {}
    for g in losses.GRANULARITIES:
        c = cfg.replace(granularity=g, kl_coef=0.0, entropy_coef=0.0)
        _, grads[g], metrics = ts._loss_and_grads(params, graphdef, batch, c, frozen=frozen)
        clip[f"diag/clipfrac_{g}"] = metrics["clipfrac"]
    return grads, clip


def grad_diagnostics(params: Any, graphdef: Any, batch: TrainBatch, cfg: train_state.TrainConfig,
                     frozen: Any = None) -> dict[str, Array]:
    """`compare` of the three `policy_gradients`, plus their clip fractions (module doc)."""
    grads, clip = policy_gradients(params, graphdef, batch, cfg, frozen)
    return {**compare(grads), **clip}


def make_grad_diagnostics(cfg: train_state.TrainConfig,
                          mesh: Any = None) -> Callable[[train_state.TrainState, TrainBatch], dict[str, Array]]:
    """Jitted `(state, batch) -> metrics` of `grad_diagnostics` at the state's parameters (no donation)."""
    jitted = jax.jit(lambda s, b: grad_diagnostics(s.params, s.graphdef, train_state.constrain_rows(b), cfg, s.frozen),
                     compiler_options=train_state.compiler_options())

    def run(state: train_state.TrainState, batch: TrainBatch) -> dict[str, Array]:
        with sharding.use_mesh(mesh):
            return jitted(state, batch)

    return run


__all__ = ["PAIRS", "compare", "policy_gradients", "grad_diagnostics", "make_grad_diagnostics"]
