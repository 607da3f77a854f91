"""Independent NumPy reference for `workflow_r1.rl.losses.policy_loss`, written from docs/paper.md (Objectives).

Plain Python loops over responses, segments and tokens; float64; no JAX. Segments are found by
scanning the mask (or grouping the given ids), and each unit's ratio is the closed form
r_u = exp(clamp(mean_{t in u}(logp_t − old_t))) (docs/paper.md, Objectives), so this shares no code path with
the stop-gradient surrogate of the JAX version.

Gradients: differentiate this function with finite differences. With `detached_logp=None` the
derivative is that of the closed-form objective J(θ) (what the paper's gradient formulas describe).
Passing `detached_logp` (held fixed while `logp` moves) evaluates the stop-gradient surrogate
log ρ_t = clamp(mean_u(detached − old) + logp_t − detached_t) instead; its finite differences are
the gradient of a loss containing sg[·], which differs from the closed form only where per-token
constant weights (truncated IS) vary inside a unit. The behaviour weight (`behaviour_cap`) is one
constant per unit, so with it the closed form's gradient is still the surrogate's.
"""
from __future__ import annotations

import math

import numpy as np


def segments_from_mask(mask_row: np.ndarray) -> list[list[int]]:
    """Maximal runs of 1s in one row, as lists of token positions, left to right."""
    runs: list[list[int]] = []
    inside = False
    for t, m in enumerate(mask_row):
        if m:
            if not inside:
                runs.append([])
                inside = True
            runs[-1].append(t)
        else:
            inside = False
    return runs


def segment_ids_from_mask(mask: np.ndarray) -> np.ndarray:
    """[B, T] turn index per policy token, -1 elsewhere (loop version)."""
    out = np.full(mask.shape, -1, np.int64)
    for i in range(mask.shape[0]):
        for k, run in enumerate(segments_from_mask(mask[i])):
            out[i, run] = k
    return out


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def reference_policy_loss(
    logprobs, old_logprobs, advantages, loss_mask, *, segment_ids=None, granularity="subsequence",
    clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0, ref_logprobs=None, kl_coef=0.0,
    sampler_logprobs=None, tis_cap=None, behaviour_cap=None, entropy=None, entropy_coef=0.0, normalizer=None,
    detached_logp=None,
) -> tuple[float, dict[str, float]]:
    """Loss and metrics of docs/paper.md (Objectives) by loops; same arguments and metric names as the JAX version."""
    logp = np.asarray(logprobs, np.float64)
    old = np.asarray(old_logprobs, np.float64)
    det = logp if detached_logp is None else np.asarray(detached_logp, np.float64)
    adv = np.asarray(advantages, np.float64)
    mask = np.asarray(loss_mask).astype(bool)
    B, T = logp.shape
    seg = segment_ids_from_mask(mask) if segment_ids is None else np.asarray(segment_ids)
    lo, hi = (-20.0, 20.0) if granularity == "token" else (-20.0, 10.0)

    pg_sum = kl_sum = ent_sum = mis_sum = tis_sum = ak_sum = 0.0
    mis_seq_sum = beh_sum = 0.0
    turn_mismatches: list[float] = []
    unit_capped: list[bool] = []
    n_resp = 0
    unit_ratios: list[float] = []
    unit_clipped: list[bool] = []
    n_tokens = n_dual = 0
    n_turns = turn_tokens = 0
    for i in range(B):
        if granularity == "subsequence":
            toks = [t for t in range(T) if mask[i, t] and seg[i, t] >= 0]
        else:
            toks = [t for t in range(T) if mask[i, t]]
        if not toks:
            continue  # dummy row: not a response
        n_resp += 1
        n_tokens += len(toks)
        a = adv[i]

        # Units sharing one ratio.
        if granularity == "token":
            units = [[t] for t in toks]
        elif granularity == "sequence":
            units = [toks]
        else:
            by_id: dict[int, list[int]] = {}
            for t in toks:
                by_id.setdefault(int(seg[i, t]), []).append(t)
            units = list(by_id.values())

        # Turn statistics (from the ids, whatever the granularity).
        turn_ids = {int(seg[i, t]) for t in range(T) if mask[i, t] and seg[i, t] >= 0}
        n_turns += len(turn_ids)
        turn_tokens += sum(1 for t in range(T) if mask[i, t] and seg[i, t] >= 0)

        unit_losses = []
        beh_tokens = []  # the behaviour weight of each of the response's tokens
        for u in units:
            if behaviour_cap is not None:
                # Decoupled weight: geometric mean of π_old / μ over the unit, capped, one per unit.
                log_gap = sum(old[i, t] - sampler_logprobs[i, t] for t in u) / len(u)
                raw = math.exp(_clamp(log_gap, -20, 20))
                w_unit = min(raw, behaviour_cap)
                unit_capped.append(raw >= behaviour_cap)
                beh_tokens += [w_unit] * len(u)
            lr_det = sum(det[i, t] - old[i, t] for t in u) / len(u)
            r_unit = math.exp(_clamp(lr_det, lo, hi))
            c_low, c_high = 1.0 - clip_eps_low, 1.0 + clip_eps_high
            unit_ratios.append(r_unit)
            unit_clipped.append(-a * min(max(r_unit, c_low), c_high) > -a * r_unit)
            token_losses = []
            for t in u:
                rho = math.exp(_clamp(lr_det + logp[i, t] - det[i, t], lo, hi))
                l = max(-a * rho, -a * min(max(rho, c_low), c_high))
                if granularity == "token" and dual_clip_c is not None and a < 0:
                    if l > -a * dual_clip_c:
                        n_dual += 1
                    l = min(l, -a * dual_clip_c)
                if sampler_logprobs is not None and tis_cap is not None:
                    w = min(math.exp(_clamp(old[i, t] - sampler_logprobs[i, t], -20, 20)), tis_cap)
                    l *= w
                if behaviour_cap is not None:
                    l *= w_unit
                token_losses.append(l)
            unit_losses.append(sum(token_losses) / len(token_losses))
        pg_sum += sum(unit_losses) / len(unit_losses)

        if ref_logprobs is not None:
            ks = []
            for t in toks:
                d = _clamp(ref_logprobs[i, t] - logp[i, t], -20, 20)
                ks.append(_clamp(math.exp(d) - d - 1, -10, 10))
            kl_sum += sum(ks) / len(ks)
        if entropy is not None:
            ent_sum += sum(entropy[i, t] for t in toks) / len(toks)
        if sampler_logprobs is not None:
            mis_sum += sum(abs(sampler_logprobs[i, t] - old[i, t]) for t in toks) / len(toks)
            if tis_cap is not None:
                tis_sum += sum(min(math.exp(old[i, t] - sampler_logprobs[i, t]), tis_cap) for t in toks) / len(toks)
            mis_seq_sum += abs(sum(old[i, t] - sampler_logprobs[i, t] for t in toks) / len(toks))
            for k in sorted(turn_ids):
                turn = [t for t in range(T) if mask[i, t] and seg[i, t] == k]
                turn_mismatches.append(abs(sum(old[i, t] - sampler_logprobs[i, t] for t in turn) / len(turn)))
        if behaviour_cap is not None:
            beh_sum += sum(beh_tokens) / len(beh_tokens)
        aks = []
        for t in toks:
            d = _clamp(logp[i, t] - old[i, t], -20, 20)
            aks.append(math.exp(d) - 1 - d)
        ak_sum += sum(aks) / len(aks)

    denom = max(n_resp, 1) if normalizer is None else (normalizer if normalizer > 0 else 1)
    loss = pg_sum / denom
    if ref_logprobs is not None:
        loss += kl_coef * kl_sum / denom
    if entropy is not None:
        loss -= entropy_coef * ent_sum / denom

    per = max(n_resp, 1)
    m: dict[str, float] = {
        "pg_loss": pg_sum / per,
        "clipfrac": (sum(unit_clipped) / len(unit_clipped)) if unit_clipped else 0.0,
        "ratio_min": min(unit_ratios) if unit_ratios else 1.0,
        "ratio_max": max(unit_ratios) if unit_ratios else 1.0,
        "ratio_mean": (sum(unit_ratios) / len(unit_ratios)) if unit_ratios else 1.0,
        "approx_kl": ak_sum / per,
        "segments_per_response": n_turns / per,
        "segment_length": turn_tokens / max(n_turns, 1),
        "num_responses": float(n_resp),
        "num_units": float(len(unit_ratios)),
        "num_tokens": float(n_tokens),
    }
    if granularity == "token" and dual_clip_c is not None:
        m["clipfrac_dual"] = n_dual / max(n_tokens, 1)
    if ref_logprobs is not None:
        m["kl_ref"] = kl_sum / per
    if entropy is not None:
        m["entropy"] = ent_sum / per
    if sampler_logprobs is not None:
        m["sampler_mismatch"] = mis_sum / per
        m["sampler_mismatch_sequence"] = mis_seq_sum / per
        m["sampler_mismatch_subsequence"] = (sum(turn_mismatches) / len(turn_mismatches)) if turn_mismatches else 0.0
        if tis_cap is not None:
            m["tis_weight_mean"] = tis_sum / per
    if behaviour_cap is not None:
        m["behaviour_weight_mean"] = beh_sum / per
        m["behaviour_capped_frac"] = (sum(unit_capped) / len(unit_capped)) if unit_capped else 0.0
    return float(loss), m
