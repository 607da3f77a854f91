"""Clipped policy-gradient losses for GRPO (token), GSPO (sequence) and GSsPO (sub-sequence).

One function, `policy_loss`, computes all three objectives of docs/paper.md (Objectives) from per-token arrays
[B, T] (B responses, T token positions; a response's prompt tokens and observation tokens carry
loss_mask 0). The three granularities differ only in the *unit* that shares one importance ratio:

- ``"token"``       (GRPO, verl "vanilla"): every policy token is its own unit; ratio
  w_t = exp(clamp(logp_t - old_t, -20, 20)); PPO clip; dual-clip (c = 3) for negative advantages.
- ``"sequence"``    (GSPO, verl ``compute_policy_loss_gspo``): all policy tokens of a response form one
  unit; ratio s_i = exp(mean_{t in y_i}(logp_t - old_t)) (geometric mean of the token ratios).
- ``"subsequence"`` (GSsPO, reconstructed in docs/paper.md, Objectives): each assistant turn (= maximal run of
  mask-1 tokens, or the given ``segment_ids``) is a unit with ratio r_s = exp(mean_{t in s}(logp - old)).

For every granularity the loss is (docs/paper.md, Objectives; Clipping, KL and aggregation)

    L = (1/N) Σ_i (1/|U_i|) Σ_{u in U_i} (1/|u|) Σ_{t in u} ℓ_t  + kl_coef · (1/N) Σ_i mean_{t in y_i} kl_t
        − entropy_coef · (1/N) Σ_i mean_{t in y_i} H_t

with N the number of valid responses (rows with at least one policy token), U_i the units of
response i and ℓ_t = max(−A_i ρ_t, −A_i clip(ρ_t, 1 − ε_low, 1 + ε_high)). For sequence / subsequence
units ρ_t is the stop-gradient surrogate

    log ρ_t = clamp(sg[log r_u] + logp_t − sg[logp_t], −20, 10)

whose value is the unit ratio r_u and whose gradient is r_u ∇logp_t, so that the gradient of the
token-mean over the unit equals the gradient of the unit-level objective (docs/paper.md, Objectives).

Everything is a pure function of arrays, jit-friendly, and NaN-free on masked tokens, empty
segments and rows without any policy token (whatever values those positions hold, even inf/NaN).
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from workflow_r1.trajectory import segment_ids_from_mask

Array = jax.Array
Granularity = Literal["token", "sequence", "subsequence"]

GRANULARITIES: tuple[str, ...] = ("token", "sequence", "subsequence")

# verl clamps the token log-ratio to [-20, 20] before exp (vanilla loss), and the sequence
# log-ratio at max 10 (GSPO); we add min -20 (docs/paper.md, Our choices) for the sequence/sub-sequence form.
TOKEN_LOG_RATIO_CLAMP: tuple[float, float] = (-20.0, 20.0)
UNIT_LOG_RATIO_CLAMP: tuple[float, float] = (-20.0, 10.0)
# verl low_var_kl: the log-ratio is clamped to [-20, 20] and the k3 value to [-10, 10].
KL_LOG_RATIO_CLAMP: tuple[float, float] = (-20.0, 20.0)
KL_VALUE_CLAMP: tuple[float, float] = (-10.0, 10.0)
# Clamp for the exponent of the truncated-IS weight exp(old - sampler); only protects exp from
# overflow, the cap `tis_cap` is what truncates.
TIS_LOG_CLAMP: tuple[float, float] = (-20.0, 20.0)


def _row_segment_sum(x: Array, seg: Array) -> Array:
    """Per-row segment sums: out[b, k] = Σ_t [seg[b, t] == k] x[b, t].

    Args:
      x: [B, T] values (zero them where they must not count).
      seg: [B, T] int32 segment index, already clipped to [0, T).

    Returns:
      [B, T] sums for segment ids 0..T-1 (a row has at most T non-empty segments).
    """
    num_segments = x.shape[-1]
    # vmap over rows keeps the batch dimension a scatter batch dimension, so a batch-sharded input
    # stays sharded (no all-gather of [B, T]).
    return jax.vmap(lambda xr, sr: jax.ops.segment_sum(xr, sr, num_segments=num_segments))(x, seg)


def _segment_lengths(seg: Array, valid: Array, dtype: jnp.dtype) -> Array:
    """Length (token count) of each valid token's segment, broadcast to tokens; 0 elsewhere. [B, T]."""
    seg_c = jnp.clip(seg, 0, seg.shape[-1] - 1)
    validf = valid.astype(dtype)
    counts = _row_segment_sum(validf, seg_c)
    return jnp.take_along_axis(counts, seg_c, axis=-1) * validf


def _safe_div(num: Array, den: Array) -> Array:
    """num / den where den > 0, else 0; no inf/NaN in the value or in the gradient."""
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), 0)


def policy_loss(
    logprobs: Array,
    old_logprobs: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    segment_ids: Array | None = None,
    granularity: Granularity = "subsequence",
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = 3.0,
    ref_logprobs: Array | None = None,
    kl_coef: float | Array = 0.0,
    sampler_logprobs: Array | None = None,
    tis_cap: float | None = None,
    entropy: Array | None = None,
    entropy_coef: float | Array = 0.0,
    normalizer: float | Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Clipped surrogate loss (to minimise) for GRPO / GSPO / GSsPO, plus KL, entropy and metrics.

    Args:
      logprobs: [B, T] log π_θ(y_t | ·) of the sampled tokens under the current parameters, in nats;
        the array to differentiate. Any dtype; computed in at least float32.
      old_logprobs: [B, T] log π_old of the same tokens (recomputed by the trainer before the update).
      advantages: [B] one advantage per response (e.g. `advantages.grpo_advantages`).
      loss_mask: [B, T] int/bool, 1 on policy-generated tokens, 0 on prompt, observation and pad.
      segment_ids: [B, T] int32 turn index (0, 1, ... < T) on policy tokens, -1 elsewhere. None:
        computed by `trajectory.segment_ids_from_mask` (maximal runs of mask-1 tokens). Only "subsequence" uses
        it for the loss; with that granularity, tokens with segment id -1 are excluded from
        everything (loss, KL, entropy, counts). Ids need not be contiguous or start at 0; absent ids
        are simply not segments. The other granularities use it only for the segment metrics.
      granularity: "token" (GRPO), "sequence" (GSPO) or "subsequence" (GSsPO). Static.
      clip_eps_low, clip_eps_high: PPO clip range [1 - ε_low, 1 + ε_high] on the unit ratio.
      dual_clip_c: dual-clip constant c (verl clip_ratio_c) for A < 0; applied only for "token"
        (verl vanilla). None disables it. Static.
      ref_logprobs: [B, T] log π_ref of the tokens; enables the k3 KL term and metric `kl_ref`.
      kl_coef: β of the KL term (paper 0.001). Added only when `ref_logprobs` is given.
      sampler_logprobs: [B, T] log-prob of the tokens under the sampler that produced them. Enables metric
        `sampler_mismatch` and, with `tis_cap`, the truncated importance-sampling correction.
      tis_cap: cap C of the truncated IS weight: every per-token loss is multiplied by
        sg[min(exp(old_logprobs - sampler_logprobs), C)]. None: no correction. Static.
      entropy: [B, T] per-token entropy of π_θ (nats). Logged as metric `entropy`; enters the loss
        only as −entropy_coef · entropy term.
      entropy_coef: coefficient of the entropy bonus (default 0: no loss term).
      normalizer: None -> every term is a mean over this call's valid responses. A number N ->
        every term is (sum over this call's valid responses) / N. For gradient accumulation pass
        N = number of valid responses in the whole mini-batch to every micro-batch: the sum of the
        micro-batch losses (and of their gradients) then equals the full mini-batch loss
        (gradient). N <= 0 is treated as 1 (the sum is then 0 anyway in the intended use).

    Returns:
      (loss, metrics). loss: scalar. metrics: dict of scalars, all stop-gradient and NaN-free, all
      averages over *this call's* data regardless of `normalizer` (combine micro-batches with the
      counts `num_responses`, `num_units`, `num_tokens`):
        pg_loss           policy term, mean over valid responses
        clipfrac          fraction of units (segments / responses / tokens) whose clipped branch is
                          active (-A clip(r) > -A r, as verl's pg_clipfrac), flat over the units
        clipfrac_dual     ("token" with dual clip only) fraction of tokens where the dual clip binds
        ratio_min/mean/max  unit ratios (mean is flat over units); 1.0 when there is no unit
        approx_kl         k3 estimate of KL(π_old ‖ π_θ): exp(d) - 1 - d with d = logprobs - old_logprobs,
                          per-response token-mean, mean over responses
        kl_ref            (ref_logprobs given) k3 KL to the reference, same averaging; the loss term
        entropy           (entropy given) per-response token-mean, mean over responses
        sampler_mismatch  (sampler_logprobs given) |sampler_logprobs - old_logprobs|, same averaging
        tis_weight_mean   (tis active) mean truncated IS weight over policy tokens, same averaging
        segments_per_response  turns (segment ids) per valid response
        segment_length    mean turn length in tokens, flat over turns
        num_responses, num_units, num_tokens   counts in this call (float)
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} unknown; use one of {GRANULARITIES}")
    logp = jnp.asarray(logprobs)
    if logp.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {logp.shape}")
    advantages = jnp.asarray(advantages)
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B]={logp.shape[:1]} (one per response), got {advantages.shape}")
    for name, arr in (("old_logprobs", old_logprobs), ("loss_mask", loss_mask), ("segment_ids", segment_ids),
                      ("ref_logprobs", ref_logprobs), ("sampler_logprobs", sampler_logprobs), ("entropy", entropy)):
        if arr is not None and jnp.shape(arr) != logp.shape:
            raise ValueError(f"{name} must have the shape of logprobs {logp.shape}, got {jnp.shape(arr)}")
    if tis_cap is not None and sampler_logprobs is None:
        raise ValueError("tis_cap needs sampler_logprobs (the sampler's log-probs of the tokens)")
    # kl_coef without ref_logprobs is allowed (the KL term is simply off: the train step passes its
    # configured β whether or not the batch carries reference log-probs). A nonzero entropy
    # coefficient without the entropy array is always a caller bug, so it fails loudly.
    if isinstance(entropy_coef, (int, float)) and entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} but entropy is None: pass per-token entropy "
                         "or set entropy_coef=0")

    dtype = jnp.promote_types(logp.dtype, jnp.float32)
    mask = jnp.asarray(loss_mask).astype(bool)
    seg = segment_ids_from_mask(mask) if segment_ids is None else jnp.asarray(segment_ids).astype(jnp.int32)
    turn_valid = mask & (seg >= 0)
    valid = turn_valid if granularity == "subsequence" else mask
    validf = valid.astype(dtype)
    sg = jax.lax.stop_gradient

    def clean(x: Array) -> Array:
        # Zero every non-policy position first: masked slots may hold anything (inf, NaN, pad
        # values) and must not reach exp, divisions or gradients.
        return jnp.where(valid, jnp.asarray(x).astype(dtype), 0)

    n_tok_row = validf.sum(-1)                                   # [B] policy tokens per response
    row_valid = n_tok_row > 0                                    # [B] False = dummy row
    n_resp = row_valid.astype(dtype).sum()
    if normalizer is None:
        denom = jnp.maximum(n_resp, 1)
    else:
        normalizer = jnp.asarray(normalizer, dtype)
        denom = jnp.where(normalizer > 0, normalizer, 1)

    def response_sum(per_token: Array) -> Array:
        """Σ_i over valid rows of the token-mean of `per_token` over the row's policy tokens."""
        return _safe_div((per_token * validf).sum(-1), n_tok_row).sum()

    logp_c = clean(logp)
    old_c = clean(old_logprobs)
    adv = jnp.where(row_valid, advantages.astype(dtype), 0)[:, None]   # [B, 1]
    log_ratio = logp_c - old_c                                           # [B, T], 0 off-policy tokens

    # --- unit log-ratio and unit length, broadcast to tokens ---------------------------------------
    if granularity == "token":
        unit_len = validf
        unit_log_ratio = log_ratio
        lo, hi = TOKEN_LOG_RATIO_CLAMP
    elif granularity == "sequence":
        unit_len = n_tok_row[:, None] * validf
        unit_log_ratio = _safe_div(log_ratio.sum(-1), n_tok_row)[:, None] * validf
        lo, hi = UNIT_LOG_RATIO_CLAMP
    else:
        seg_c = jnp.clip(seg, 0, seg.shape[-1] - 1)
        sums = jnp.take_along_axis(_row_segment_sum(log_ratio, seg_c), seg_c, axis=-1)
        unit_len = _segment_lengths(seg, valid, dtype)
        unit_log_ratio = _safe_div(sums, unit_len) * validf
        lo, hi = UNIT_LOG_RATIO_CLAMP
    inv_len = _safe_div(validf, unit_len)                 # 1/|u| on policy tokens, 0 elsewhere
    n_units_row = inv_len.sum(-1)                         # [B] number of units per response
    # Token weight of the two-stage mean: 1/|u| inside the unit, then 1/|U_i| over the units.
    weight = inv_len * _safe_div(jnp.ones_like(n_units_row), n_units_row)[:, None]

    # --- clipped surrogate ------------------------------------------------------------------------
    # Value = unit ratio, gradient = ratio * ∇logp_t (per token). For "token" this is exactly
    # exp(clamp(logp - old)) with the usual gradient.
    log_rho = jnp.clip(sg(unit_log_ratio) + logp_c - sg(logp_c), lo, hi)
    rho = jnp.exp(log_rho)
    loss1 = -adv * rho
    loss2 = -adv * jnp.clip(rho, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = jnp.maximum(loss1, loss2)
    clipped = (loss2 > loss1) & valid
    metrics: dict[str, Array] = {}
    if granularity == "token" and dual_clip_c is not None:
        # verl vanilla: for A < 0 the loss is capped at -A·c, so a huge ratio on a bad action cannot
        # produce an unbounded update.
        loss3 = -adv * dual_clip_c
        neg = adv < 0
        dual = neg & (per_token > loss3) & valid
        per_token = jnp.where(neg, jnp.minimum(per_token, loss3), per_token)
        metrics["clipfrac_dual"] = _safe_div(dual.astype(dtype).sum(), validf.sum())

    if sampler_logprobs is not None:
        sampler_c = clean(sampler_logprobs)
        metrics["sampler_mismatch"] = _safe_div(response_sum(jnp.abs(sampler_c - old_c)), n_resp)
        if tis_cap is not None:
            # Truncated IS for sampler-vs-trainer mismatch: a constant per-token weight (sg only
            # guards callers whose old/sampler log-probs still carry a gradient).
            tis = sg(jnp.minimum(jnp.exp(jnp.clip(old_c - sampler_c, *TIS_LOG_CLAMP)), tis_cap)) * validf
            per_token = per_token * tis
            metrics["tis_weight_mean"] = _safe_div(response_sum(tis), n_resp)

    per_row = (per_token * weight).sum(-1)                # [B], 0 for dummy rows
    pg_sum = per_row.sum()
    loss = pg_sum / denom
    metrics["pg_loss"] = _safe_div(pg_sum, n_resp)

    # --- KL to the reference (k3, verl low_var_kl), per-response token-mean -------------------------
    if ref_logprobs is not None:
        delta = jnp.clip(clean(ref_logprobs) - logp_c, *KL_LOG_RATIO_CLAMP)
        kl = jnp.clip(jnp.exp(delta) - delta - 1.0, *KL_VALUE_CLAMP)
        kl_sum = response_sum(kl)
        loss = loss + kl_coef * kl_sum / denom
        metrics["kl_ref"] = _safe_div(kl_sum, n_resp)

    if entropy is not None:
        ent_sum = response_sum(clean(entropy))
        loss = loss - entropy_coef * ent_sum / denom
        metrics["entropy"] = _safe_div(ent_sum, n_resp)

    # --- diagnostics --------------------------------------------------------------------------------
    n_units = n_units_row.sum()
    unit_ratio = sg(rho)
    has_units = n_units > 0
    metrics["clipfrac"] = _safe_div((clipped.astype(dtype) * inv_len).sum(), n_units)
    metrics["ratio_mean"] = jnp.where(has_units, _safe_div((unit_ratio * inv_len).sum(), n_units), 1.0)
    metrics["ratio_min"] = jnp.where(has_units, jnp.min(jnp.where(valid, unit_ratio, jnp.inf)), 1.0)
    metrics["ratio_max"] = jnp.where(has_units, jnp.max(jnp.where(valid, unit_ratio, -jnp.inf)), 1.0)
    d = jnp.clip(sg(log_ratio), *TOKEN_LOG_RATIO_CLAMP)
    metrics["approx_kl"] = _safe_div(response_sum(jnp.exp(d) - 1.0 - d), n_resp)

    # Turn statistics come from the segment ids whatever the loss granularity.
    turn_len = unit_len if granularity == "subsequence" else _segment_lengths(seg, turn_valid, dtype)
    n_turns_row = _safe_div(turn_valid.astype(dtype), turn_len).sum(-1)
    n_turns = jnp.where(row_valid, n_turns_row, 0).sum()
    metrics["segments_per_response"] = _safe_div(n_turns, n_resp)
    turn_tokens = jnp.where(row_valid[:, None], turn_valid, False).astype(dtype).sum()
    metrics["segment_length"] = _safe_div(turn_tokens, n_turns)
    metrics["num_responses"] = n_resp
    metrics["num_units"] = n_units
    metrics["num_tokens"] = validf.sum()
    metrics = {k: sg(jnp.asarray(v, dtype)) for k, v in metrics.items()}
    return loss, metrics
