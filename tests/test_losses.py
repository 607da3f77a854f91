"""Tests for workflow_r1.rl.losses: NumPy reference, identities, torch goldens, NaN safety, accumulation, sharding."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

try:  # tests/ is on sys.path under pytest's default (rootdir-less) import mode
    from reference_losses import reference_policy_loss, segment_ids_from_mask as np_segment_ids
except ImportError:  # tests imported as a package
    from tests.reference_losses import reference_policy_loss, segment_ids_from_mask as np_segment_ids
from workflow_r1 import trajectory
from workflow_r1.rl import losses
from workflow_r1.rl.advantages import grpo_advantages

GRANS = ("token", "sequence", "subsequence")


# ------------------------------------------------------------------------------------------------
# Test data
# ------------------------------------------------------------------------------------------------
def make_batch(seed: int, B: int = 8, T: int = 48, dummy_rows: tuple[int, ...] = (3,),
               single_turn_rows: tuple[int, ...] = (1, 6), big_frac: float = 0.05,
               garbage: float = 30.0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random multi-turn batch: a masked prompt, 2-4 assistant turns separated by observations, padding.

    Row `dummy_rows` are all-masked; `single_turn_rows` have one turn. Log-ratios are spread enough
    that some units are clipped, and a few tokens get |logp - old| = 1.5 so dual clip binds too.
    Masked positions hold `garbage` so that any leak through the mask shows up.
    """
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), np.int32)
    for i in range(B):
        if i in dummy_rows:
            continue
        t = int(rng.integers(1, 5))
        turns = 1 if i in single_turn_rows else int(rng.integers(2, 5))
        for _ in range(turns):
            length = int(rng.integers(1, 8))
            mask[i, t:min(t + length, T)] = 1
            t += length + int(rng.integers(1, 5))
            if t >= T - 1:
                break
    logp = -rng.exponential(1.0, (B, T))
    noise = rng.normal(0.0, 0.3, (B, T)) + rng.normal(0.0, 0.2, (B, 1))
    big = rng.random((B, T)) < big_frac
    noise = noise + big * rng.choice([-1.5, 1.5], (B, T))
    old = logp - noise
    ref = logp + rng.normal(0.0, 0.3, (B, T))
    sampler = old + rng.normal(0.0, 0.3, (B, T))
    ent = rng.exponential(1.0, (B, T))
    adv = rng.normal(0.0, 1.0, B)
    off = mask == 0
    out = {"logp": logp, "old_logp": old, "ref_logp": ref, "sampler_logp": sampler, "entropy": ent}
    out = {k: np.where(off, garbage, v).astype(dtype) for k, v in out.items()}
    out["advantages"] = adv.astype(dtype)
    out["loss_mask"] = mask
    return out


FULL_OPTS = dict(kl_coef=0.05, entropy_coef=0.01, tis_cap=1.5)


def call_kwargs(b: dict, full: bool) -> dict:
    """Keyword arguments beyond the four positional arrays."""
    if not full:
        return {}
    return dict(ref_logprobs=b["ref_logp"], sampler_logprobs=b["sampler_logp"], entropy=b["entropy"], **FULL_OPTS)


_COMPILED: dict = {}


def _compiled(granularity: str, static: tuple):
    """jit(value_and_grad) of the loss w.r.t. logp, for one set of static options (cached)."""
    key = (granularity, static)
    if key not in _COMPILED:
        opts = dict(static)

        def f(logp, old, adv, mask, arrays):
            return losses.policy_loss(logp, old, adv, mask, granularity=granularity, **arrays, **opts)

        _COMPILED[key] = jax.jit(jax.value_and_grad(f, has_aux=True))
    return _COMPILED[key]


def run(b: dict, granularity: str, full: bool = False, **kw) -> tuple[float, dict[str, float], np.ndarray]:
    """(loss, metrics, d loss / d logp) of the JAX loss on batch `b` (jitted; float64 under x64)."""
    args = {**call_kwargs(b, full), **kw}
    arrays = {k: jnp.asarray(v) for k, v in args.items() if isinstance(v, (np.ndarray, jax.Array))}
    static = tuple(sorted((k, v) for k, v in args.items() if k not in arrays))
    (loss, m), g = _compiled(granularity, static)(
        *(jnp.asarray(b[k]) for k in ("logp", "old_logp", "advantages", "loss_mask")), arrays)
    return float(loss), {k: float(v) for k, v in m.items()}, np.asarray(g)


def ref_loss(b: dict, granularity: str, full: bool = False, **kw):
    args = {**call_kwargs(b, full), **kw}
    return reference_policy_loss(b["logp"], b["old_logp"], b["advantages"], b["loss_mask"],
                                 granularity=granularity, **args)


# ------------------------------------------------------------------------------------------------
# Segmentation
# ------------------------------------------------------------------------------------------------
def test_segment_ids_from_mask_matches_loop():
    rng = np.random.default_rng(0)
    mask = (rng.random((7, 23)) < 0.5).astype(np.int32)
    mask[0] = 0
    mask[1] = 1
    mask[2] = 0
    mask[2, -1] = 1
    got = np.asarray(trajectory.segment_ids_from_mask(jnp.asarray(mask)))
    np.testing.assert_array_equal(got, np_segment_ids(mask))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got[1], np.zeros(23))
    assert got[2, -1] == 0 and (got[2, :-1] == -1).all()


# ------------------------------------------------------------------------------------------------
# 1. NumPy reference: values, metrics, gradients
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("full", [False, True], ids=["plain", "kl_ent_tis"])
@pytest.mark.parametrize("granularity", GRANS)
def test_matches_numpy_reference(granularity, full):
    b = make_batch(seed=1)
    loss, m, _ = run(b, granularity, full)
    ref, rm = ref_loss(b, granularity, full)
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-7)
    assert set(m) == set(rm), (sorted(m), sorted(rm))
    for k in rm:
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # The batch exercises both branches of the clip at the unit level, and the dual clip.
    assert 0.0 < rm["clipfrac"] < 1.0
    if granularity == "token":
        assert rm["clipfrac_dual"] > 0.0
    assert rm["num_responses"] == 7.0 and rm["segments_per_response"] > 1.5


@pytest.mark.parametrize("full", [False, True], ids=["plain", "kl_ent_tis"])
@pytest.mark.parametrize("granularity", GRANS)
def test_matches_numpy_reference_with_asymmetric_clip(granularity, full):
    """DAPO-style clip-higher range [1 - 0.2, 1 + 0.28]: each side of the clip uses its own bound."""
    b = make_batch(seed=1)
    loss, m, _ = run(b, granularity, full, clip_eps_low=0.2, clip_eps_high=0.28)
    ref, rm = ref_loss(b, granularity, full, clip_eps_low=0.2, clip_eps_high=0.28)
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-7)
    for k in rm:
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # The two bounds differ on this batch: the symmetric range gives another loss.
    assert abs(loss - run(b, granularity, full)[0]) > 1e-4


def _beyond_the_unit_clamp(dtype=np.float32) -> dict[str, np.ndarray]:
    """make_batch(seed=1) with unit log-ratios outside UNIT_LOG_RATIO_CLAMP = (-20, 10):
    row 0 every token +12 (A < 0, so the unclipped branch -A·r is the one that counts), row 2 every
    token -25 (A > 0), and the first turn of row 4 at +15 (A < 0; its other turns unchanged)."""
    b = make_batch(seed=1, dtype=dtype)
    on = b["loss_mask"] == 1
    b["old_logp"][0] = np.where(on[0], b["logp"][0] - 12.0, b["old_logp"][0])
    b["old_logp"][2] = np.where(on[2], b["logp"][2] + 25.0, b["old_logp"][2])
    first = np_segment_ids(b["loss_mask"])[4] == 0
    b["old_logp"][4] = np.where(first, b["logp"][4] - 15.0, b["old_logp"][4])
    b["advantages"][[0, 2, 4]] = np.asarray([-1.0, 1.0, -0.7], dtype)
    return b


@pytest.mark.parametrize("full", [False, True], ids=["plain", "kl_ent_tis"])
@pytest.mark.parametrize("granularity", GRANS)
def test_unit_log_ratio_beyond_the_clamp_matches_reference(granularity, full):
    b = _beyond_the_unit_clamp()
    loss, m, g = run(b, granularity, full)
    ref, rm = ref_loss(b, granularity, full)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    for k in rm:
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert np.isfinite(g).all() and np.isfinite(loss)
    if granularity != "token":
        lo, hi = losses.UNIT_LOG_RATIO_CLAMP
        np.testing.assert_allclose(m["ratio_max"], np.exp(hi), rtol=1e-5)  # r = e^12 and e^15 clamp to e^10
        np.testing.assert_allclose(m["ratio_min"], np.exp(lo), rtol=1e-5)  # r = e^-25 clamps to e^-20
        if not full:
            # Where the clamp binds the unit ratio is constant in logp: no gradient (the closed form's
            # finite differences are 0 there too).
            np.testing.assert_array_equal(g[0], 0.0)
            np.testing.assert_array_equal(g[2], 0.0)


def _fd_entries(mask: np.ndarray, rng, n: int = 6) -> list[tuple[int, int]]:
    on = np.argwhere(mask == 1)
    picks = [tuple(on[k]) for k in rng.choice(len(on), n, replace=False)]
    picks.append(tuple(np.argwhere(mask == 0)[5]))  # an observation token: gradient 0
    return picks


@pytest.mark.parametrize("granularity", GRANS)
def test_gradient_matches_finite_differences(granularity):
    """jax.grad of the sg-surrogate == finite differences of the closed-form objective (float64).

    Without per-token IS weights the surrogate's gradient must equal the true gradient of the
    unit-ratio objective; with TIS it must equal the FD of the reference surrogate with the
    detached quantities held fixed.
    """
    b = make_batch(seed=2, dtype=np.float64)
    rng = np.random.default_rng(3)
    h = 1e-6
    # The TIS surrogate check (second pass) runs for GSsPO only, to keep the suite fast.
    for full in ((False, True) if granularity == "subsequence" else (False,)):
        kw = call_kwargs(b, full)
        with jax.enable_x64(True):
            _, _, g = run(b, granularity, full)
        assert g.dtype == np.float64 and np.isfinite(g).all()
        for (i, t) in _fd_entries(b["loss_mask"], rng):
            vals = []
            for s in (+1, -1):
                lp = b["logp"].copy()
                lp[i, t] += s * h
                # Closed form (no TIS) or surrogate with detached = unperturbed logp (TIS).
                det = b["logp"] if full else None
                vals.append(reference_policy_loss(lp, b["old_logp"], b["advantages"], b["loss_mask"],
                                                  granularity=granularity, detached_logp=det, **kw)[0])
            fd = (vals[0] - vals[1]) / (2 * h)
            np.testing.assert_allclose(g[i, t], fd, rtol=1e-6, atol=1e-10, err_msg=f"{granularity} {full} {(i, t)}")


# ------------------------------------------------------------------------------------------------
# 2. Identities
# ------------------------------------------------------------------------------------------------
def test_gsspo_with_one_segment_is_gspo():
    b = make_batch(seed=4)
    one_seg = np.where(b["loss_mask"] == 1, 0, -1).astype(np.int32)
    l1, _, g1 = run(b, "subsequence", segment_ids=one_seg)
    l2, _, g2 = run(b, "sequence")
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-8)
    # Single-turn responses: GSsPO (turn segments) and GSPO score them identically.
    single = make_batch(seed=5, single_turn_rows=tuple(range(8)))
    np.testing.assert_allclose(run(single, "subsequence")[0], run(single, "sequence")[0], rtol=1e-6)


def test_gsspo_with_singleton_segments_is_token_loss_without_dual_clip():
    b = make_batch(seed=6, big_frac=0.15)
    T = b["logp"].shape[1]
    unique = np.where(b["loss_mask"] == 1, np.arange(T)[None, :], -1).astype(np.int32)
    l1, _, g1 = run(b, "subsequence", segment_ids=unique)
    l2, _, g2 = run(b, "token", dual_clip_c=None)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-8)
    # With dual clip the token loss differs on this batch (it binds on some tokens).
    l3, m3, _ = run(b, "token")
    assert m3["clipfrac_dual"] > 0 and abs(l3 - l2) > 1e-4


@pytest.mark.parametrize("granularity", GRANS)
def test_equal_rewards_in_every_group_give_zero_policy_gradient(granularity):
    b = make_batch(seed=7)
    rewards = np.repeat(np.array([0.0, 1.0, 0.3, -0.5]), 2)               # 4 groups of 2, equal inside
    b["advantages"] = np.asarray(grpo_advantages(jnp.asarray(rewards, jnp.float32), group_size=2))
    np.testing.assert_array_equal(b["advantages"], 0.0)
    loss, _, g = run(b, granularity)
    assert loss == 0.0
    np.testing.assert_array_equal(g, 0.0)
    # With a KL term, only the KL pushes: its gradient is the k3 derivative β (1 - e^(ref - logp)) / |y_i| / N.
    _, _, gk = run(b, granularity, full=True)
    m = b["loss_mask"] == 1
    n_tok = m.sum(-1, keepdims=True)
    expect = np.where(m, FULL_OPTS["kl_coef"] * (1 - np.exp(b["ref_logp"] - b["logp"])) / np.maximum(n_tok, 1) / 7, 0)
    np.testing.assert_allclose(gk, expect, rtol=1e-4, atol=1e-9)


# ------------------------------------------------------------------------------------------------
# 3. Golden checks: torch re-derivations of verl / TRL / GSPO
# ------------------------------------------------------------------------------------------------
def torch_agg_loss(loss_mat, mask, mode):
    """verl agg_loss for the modes used here."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        seq = (loss_mat * mask).sum(-1) / mask.sum(-1)
        return seq.mean()
    raise ValueError(mode)


def torch_verl_vanilla(old, logp, adv_tok, mask, eps_low, eps_high, c, mode):
    """verl compute_policy_loss (vanilla): token ratio, PPO clip, dual clip for A < 0."""
    neg_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    l1 = -adv_tok * ratio
    l2 = -adv_tok * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    cl1 = torch.maximum(l1, l2)
    clipfrac = ((l2 > l1).double() * mask).sum() / mask.sum()
    l3 = -adv_tok * c
    cl2 = torch.minimum(l3, cl1)
    clipfrac_lower = ((cl1 > l3).double() * (adv_tok < 0).double() * mask).sum() / mask.sum()
    pg = torch.where(adv_tok < 0, cl2, cl1)
    return torch_agg_loss(pg, mask, mode), clipfrac, clipfrac_lower


def torch_verl_low_var_kl(logp, ref):
    kl = torch.clamp(ref - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10.0, max=10.0)


def torch_verl_gspo(old, logp, adv_tok, mask, eps_low, eps_high):
    """verl compute_policy_loss_gspo: sg-surrogate sequence ratio, clamp max 10, seq-mean-token-mean."""
    neg_kl = logp - old
    seq_len = mask.sum(-1).clamp(min=1)
    neg_kl_seq = (neg_kl * mask).sum(-1) / seq_len
    log_s = logp - logp.detach() + neg_kl_seq.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    l1 = -adv_tok * s
    l2 = -adv_tok * torch.clamp(s, 1 - eps_low, 1 + eps_high)
    return torch_agg_loss(torch.maximum(l1, l2), mask, "seq-mean-token-mean")


def torch_trl_grpo(old, logp, adv, mask, ref, beta, eps_low, eps_high, level):
    """TRL GRPOTrainer._compute_loss, loss_type="grpo": per-sequence token mean, then batch mean.

    level "token" is GRPO; level "sequence" is TRL's GSPO (importance_sampling_level="sequence",
    gradient through the closed-form sequence ratio, no stop-gradient trick).
    """
    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef1 = torch.exp(log_w)
    coef2 = torch.clamp(coef1, 1 - eps_low, 1 + eps_high)
    a = adv.unsqueeze(1)
    per_tok = -torch.min(coef1 * a, coef2 * a)
    if beta != 0.0:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_tok = per_tok + beta * kl
    return ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _golden_batch(seed):
    # No all-masked rows here: verl's seq-mean-token-mean divides by the row length.
    b = make_batch(seed=seed, dummy_rows=(), dtype=np.float64)
    # A ratio of e^1.6 ≈ 5 > c = 3 on one token of each negative-advantage row: the dual clip binds.
    for i in np.flatnonzero(b["advantages"] < 0):
        t = np.flatnonzero(b["loss_mask"][i])[0]
        b["old_logp"][i, t] = b["logp"][i, t] - 1.6
    return b


def _jax64_value_grad(b, granularity, **kw):
    with jax.enable_x64(True):
        loss, m, g = run(b, granularity, **kw)
    assert g.dtype == np.float64
    return loss, m, g


def _torch_inputs(b):
    t = {k: torch.tensor(b[k], dtype=torch.float64) for k in ("old_logp", "ref_logp", "advantages")}
    t["mask"] = torch.tensor(b["loss_mask"], dtype=torch.float64)
    t["logp"] = torch.tensor(b["logp"], dtype=torch.float64, requires_grad=True)
    t["adv_tok"] = t["advantages"].unsqueeze(-1) * t["mask"]
    return t


def test_golden_verl_vanilla_grpo_with_dual_clip_and_kl():
    """verl as run in the paper: micro-batch 1, token-mean, loss / grad-accum count, + β·KL."""
    b = _golden_batch(8)
    beta = 0.001
    t = _torch_inputs(b)
    B = b["logp"].shape[0]
    total = 0.0
    for i in range(B):  # one micro-batch per response, scaled by 1 / (number of micro-batches)
        sl = slice(i, i + 1)
        pg, _, _ = torch_verl_vanilla(t["old_logp"][sl], t["logp"][sl], t["adv_tok"][sl], t["mask"][sl],
                                      0.2, 0.2, 3.0, "token-mean")
        kl = torch_agg_loss(torch_verl_low_var_kl(t["logp"][sl], t["ref_logp"][sl]), t["mask"][sl], "token-mean")
        total = total + (pg + beta * kl) / B
    total.backward()
    _, clipfrac, clipfrac_lower = torch_verl_vanilla(t["old_logp"], t["logp"].detach(), t["adv_tok"], t["mask"],
                                                     0.2, 0.2, 3.0, "token-mean")
    loss, m, g = _jax64_value_grad(b, "token", ref_logprobs=b["ref_logp"], kl_coef=beta)
    np.testing.assert_allclose(loss, total.item(), rtol=1e-10)
    np.testing.assert_allclose(g, t["logp"].grad.numpy(), rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(m["clipfrac"], clipfrac.item(), rtol=1e-12)
    np.testing.assert_allclose(m["clipfrac_dual"], clipfrac_lower.item(), rtol=1e-12)
    assert clipfrac_lower.item() > 0


def test_golden_trl_grpo():
    b = _golden_batch(9)
    beta = 0.04
    t = _torch_inputs(b)
    ref = torch_trl_grpo(t["old_logp"], t["logp"], t["advantages"], t["mask"], t["ref_logp"], beta, 0.2, 0.28, "token")
    ref.backward()
    # TRL has no dual clip; its k3 is unclamped (no clamp binds on these inputs).
    loss, _, g = _jax64_value_grad(b, "token", dual_clip_c=None, clip_eps_high=0.28,
                                   ref_logprobs=b["ref_logp"], kl_coef=beta)
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-10)
    np.testing.assert_allclose(g, t["logp"].grad.numpy(), rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("impl", ["verl", "trl"])
def test_golden_gspo(impl):
    b = _golden_batch(10)
    # GSPO paper clip range (3e-4 / 4e-4) so that some sequences clip.
    eps_low, eps_high = 3e-4, 4e-4
    t = _torch_inputs(b)
    if impl == "verl":
        ref = torch_verl_gspo(t["old_logp"], t["logp"], t["adv_tok"], t["mask"], eps_low, eps_high)
    else:
        ref = torch_trl_grpo(t["old_logp"], t["logp"], t["advantages"], t["mask"], None, 0.0, eps_low, eps_high,
                             "sequence")
    ref.backward()
    loss, m, g = _jax64_value_grad(b, "sequence", clip_eps_low=eps_low, clip_eps_high=eps_high)
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-10)
    np.testing.assert_allclose(g, t["logp"].grad.numpy(), rtol=1e-9, atol=1e-13)
    assert 0.0 < m["clipfrac"] < 1.0


# ------------------------------------------------------------------------------------------------
# 4. NaN safety
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", GRANS)
def test_all_masked_batch_is_zero_and_finite(granularity):
    b = make_batch(seed=11, garbage=np.nan)
    b["loss_mask"][:] = 0
    for k in ("logp", "old_logp", "ref_logp", "sampler_logp", "entropy"):
        b[k][:] = np.nan
    b["logp"][0, :3] = -np.inf
    loss, m, g = run(b, granularity, full=True)
    assert loss == 0.0
    assert all(np.isfinite(v) for v in m.values()), m
    assert m["num_responses"] == 0.0 and m["ratio_mean"] == 1.0
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("granularity", GRANS)
def test_non_finite_values_on_masked_tokens_change_nothing(granularity):
    clean = make_batch(seed=12, garbage=0.0)
    dirty = make_batch(seed=12, garbage=np.inf)
    dirty["logp"] = np.where(clean["loss_mask"] == 1, dirty["logp"], -np.inf).astype(np.float32)
    dirty["old_logp"] = np.where(clean["loss_mask"] == 1, dirty["old_logp"], np.nan).astype(np.float32)
    lc, mc, gc = run(clean, granularity, full=True)
    ld, md, gd = run(dirty, granularity, full=True)
    assert lc == ld and mc == md
    assert np.isfinite(gd).all()
    np.testing.assert_array_equal(gd, gc)


def test_empty_segment_ids_are_not_segments():
    """Segment ids with gaps (empty segments) give the same loss as the relabelled contiguous ids."""
    b = make_batch(seed=13)
    seg = np_segment_ids(b["loss_mask"])
    gappy = np.where(seg >= 0, seg * 3 + 1, -1).astype(np.int32)           # ids 1, 4, 7, ...; 0, 2, 3, ... empty
    l1, m1, g1 = run(b, "subsequence", segment_ids=gappy)
    l2, m2, g2 = run(b, "subsequence")
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-6, atol=1e-9)
    for k in m2:
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-6, err_msg=k)
    r, rm = ref_loss(b, "subsequence", segment_ids=gappy)
    np.testing.assert_allclose(l1, r, rtol=1e-5)
    np.testing.assert_allclose(m1["segments_per_response"], rm["segments_per_response"], rtol=1e-6)


@pytest.mark.parametrize("granularity", GRANS)
def test_padded_dummy_rows_change_nothing(granularity):
    full = make_batch(seed=14)
    b = {k: v[:4] for k, v in full.items()}                            # 4 real responses (row 3 is a dummy already)
    pad = make_batch(seed=15, B=4, dummy_rows=(0, 1, 2, 3), garbage=np.nan)
    padded = {k: np.concatenate([b[k], pad[k]], 0) for k in b}
    padded["advantages"][4:] = np.nan                                  # even NaN advantages on dummy rows
    n_valid = np.asarray((b["loss_mask"].sum(-1) > 0).sum(), np.float32)
    # normalizer = own count is the plain mean (and reuses the accumulation test's compiled function).
    l1, m1, g1 = run(b, granularity, full=True, normalizer=n_valid)
    l2, m2, g2 = run(padded, granularity, full=True)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    for k in m1:
        np.testing.assert_allclose(m2[k], m1[k], rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(g2[:4], g1, rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(g2[4:], 0.0)


# ------------------------------------------------------------------------------------------------
# 5. Gradient accumulation
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", GRANS)
def test_gradient_accumulation_matches_full_batch(granularity):
    b = make_batch(seed=16, dummy_rows=(3, 5, 6))
    n_valid = float((b["loss_mask"].sum(-1) > 0).sum())
    assert n_valid == 5.0
    full_l, _, full_g = run(b, granularity, full=True)
    acc_l, acc_g, naive = 0.0, [], 0.0
    for sl in (slice(0, 4), slice(4, 8)):                              # the second has two dummy rows
        mb = {k: v[sl] for k, v in b.items()}
        # The normalizer is an array argument: one compiled function serves every micro-batch.
        l, _, g = run(mb, granularity, full=True, normalizer=np.asarray(n_valid, np.float32))
        acc_l += l
        acc_g.append(g)
        # Each micro-batch as its own mean: summing those is not the full-batch loss.
        own = np.asarray((mb["loss_mask"].sum(-1) > 0).sum(), np.float32)
        naive += run(mb, granularity, full=True, normalizer=own)[0]
    np.testing.assert_allclose(acc_l, full_l, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate(acc_g, 0), full_g, rtol=1e-5, atol=1e-9)
    assert abs(naive - full_l) > 1e-3


# ------------------------------------------------------------------------------------------------
# 6. jit + sharding
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", GRANS)
def test_jit_on_8_device_mesh_matches_unsharded(granularity):
    assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated CPU devices"
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",))
    b = make_batch(seed=17, dummy_rows=(2, 5))
    rows = NamedSharding(mesh, P("data"))
    rows_tok = NamedSharding(mesh, P("data", None))
    sharded = {k: jax.device_put(v, rows if v.ndim == 1 else rows_tok) for k, v in b.items()}
    # Same jitted function as `run(b, granularity, full=True)`, now fed batch-sharded inputs.
    args = call_kwargs(sharded, True)
    arrays = {k: v for k, v in args.items() if isinstance(v, jax.Array)}
    static = tuple(sorted((k, v) for k, v in args.items() if k not in arrays))
    (ls, ms), gs = _compiled(granularity, static)(
        *(sharded[k] for k in ("logp", "old_logp", "advantages", "loss_mask")), arrays)
    assert gs.sharding.is_equivalent_to(rows_tok, 2)                   # the gradient stays batch-sharded
    lu, mu, gu = run(b, granularity, full=True)
    np.testing.assert_allclose(float(ls), lu, rtol=1e-6)
    for k in mu:
        np.testing.assert_allclose(float(ms[k]), mu[k], rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(np.asarray(gs), gu, rtol=1e-5, atol=1e-9)


def test_argument_errors_name_the_fix():
    b = make_batch(seed=18)

    def shapes(**kw):  # trace only (no compile): the checks run at trace time
        return jax.eval_shape(lambda: losses.policy_loss(b["logp"], b["old_logp"], kw.pop("adv", b["advantages"]),
                                                         b["loss_mask"], **kw))

    with pytest.raises(ValueError, match="granularity"):
        shapes(granularity="turn")
    with pytest.raises(ValueError, match="advantages must be"):
        shapes(adv=b["logp"])
    with pytest.raises(ValueError, match="tis_cap needs sampler_logprobs"):
        shapes(tis_cap=2.0)
    with pytest.raises(ValueError, match=r"^behaviour_cap needs sampler_logprobs .*set behaviour_cap=None"):
        shapes(behaviour_cap=2.0)
    with pytest.raises(ValueError, match=r"^behaviour_cap and tis_cap both correct .*; set tis_cap=None"):
        shapes(behaviour_cap=2.0, tis_cap=2.0, sampler_logprobs=b["sampler_logp"])
    with pytest.raises(ValueError, match="entropy is None"):
        shapes(entropy_coef=0.01)
    # kl_coef without ref_logprobs: the KL term is off (not an error).
    assert "kl_ref" not in shapes(kl_coef=0.001)[1]


# ------------------------------------------------------------------------------------------------
# 7. Decoupled behaviour weight (asynchronous training)
# ------------------------------------------------------------------------------------------------
BEHAVIOUR_CAP = 2.0


def make_mixed_version_batch(seed: int, dtype=np.float64) -> dict[str, np.ndarray]:
    """make_batch whose turns come from different policy versions: the behaviour log-probs of turn k
    of row i are old − gap[i, k] (+ 0.02 token noise), one gap per turn by its version lag.

    Lag 0 (the learner's own version): gap 0; lag 1: N(0, 0.3); lag 2: N(0, 0.8). Row 0 has gap +1.5
    on every turn (weight e^1.5 > C = 2 at every granularity); row 2's first turn +1.5 and its later
    turns −0.6 (capped as a turn, not as a whole response). Rows 3 and 7 are padding (no policy
    token), observations sit between turns, and masked positions hold garbage.
    """
    b = make_batch(seed=seed, dummy_rows=(3, 7), dtype=dtype)
    rng = np.random.default_rng(seed + 100)
    mask = b["loss_mask"] == 1
    seg = np_segment_ids(b["loss_mask"])
    gap = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        for k in range(seg[i].max() + 1):
            lag = int(rng.integers(0, 3))
            g = (0.0, rng.normal(0.0, 0.3), rng.normal(0.0, 0.8))[lag]
            if i == 0:
                g = 1.5
            elif i == 2:
                g = 1.5 if k == 0 else -0.6
            gap[i, seg[i] == k] = g
    sampler = b["old_logp"] - gap - rng.normal(0.0, 0.02, mask.shape)
    b["sampler_logp"] = np.where(mask, sampler, b["sampler_logp"]).astype(dtype)
    return b


def behaviour_kwargs(b: dict, cap: float | None = BEHAVIOUR_CAP) -> dict:
    """KL and entropy on, sampler log-probs given, the behaviour weight with cap `cap`."""
    return dict(ref_logprobs=b["ref_logp"], sampler_logprobs=b["sampler_logp"], entropy=b["entropy"],
                kl_coef=0.05, entropy_coef=0.01, behaviour_cap=cap)


@pytest.mark.parametrize("granularity", GRANS)
def test_behaviour_weight_with_mixed_version_turns_matches_numpy_reference(granularity):
    """Loss, every metric and the gradient (finite differences of the closed form) in float64."""
    b = make_mixed_version_batch(seed=21)
    kw = behaviour_kwargs(b)
    with jax.enable_x64(True):
        loss, m, g = run(b, granularity, **kw)
        unweighted = run(b, granularity, **behaviour_kwargs(b, cap=None))
    ref, rm = ref_loss(b, granularity, **kw)
    np.testing.assert_allclose(loss, ref, rtol=1e-9, atol=1e-12)
    assert set(m) == set(rm), (sorted(m), sorted(rm))
    for k in rm:
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-9, atol=1e-12, err_msg=k)
    # Some units (row 0's, row 2's first turn) hit the cap and others not; the weight moves the loss.
    assert 0.0 < rm["behaviour_capped_frac"] < 1.0
    assert abs(loss - unweighted[0]) > 1e-3
    assert set(m) - set(unweighted[1]) == {"behaviour_weight_mean", "behaviour_capped_frac"}
    # Turns generated by different versions: the turn-level mismatch is not the response-level one.
    assert rm["sampler_mismatch_subsequence"] > rm["sampler_mismatch_sequence"] + 0.05
    # One constant weight per unit: the surrogate's gradient is the weighted closed form's (no
    # detached evaluation needed, unlike the per-token TIS weight).
    h = 1e-6
    for (i, t) in _fd_entries(b["loss_mask"], np.random.default_rng(22)):
        vals = []
        for s in (+1, -1):
            lp = b["logp"].copy()
            lp[i, t] += s * h
            vals.append(reference_policy_loss(lp, b["old_logp"], b["advantages"], b["loss_mask"],
                                              granularity=granularity, **kw)[0])
        np.testing.assert_allclose(g[i, t], (vals[0] - vals[1]) / (2 * h), rtol=1e-6, atol=1e-10,
                                   err_msg=f"{granularity} {(i, t)}")


@pytest.mark.parametrize("granularity", GRANS)
def test_behaviour_weight_is_one_when_behaviour_is_the_proximal_policy(granularity):
    """μ == π_prox (every token generated by the learner's own weights): the loss and gradient are
    bit for bit those without the weight."""
    b = make_mixed_version_batch(seed=23, dtype=np.float32)
    b["sampler_logp"] = b["old_logp"].copy()
    loss, m, g = run(b, granularity, **behaviour_kwargs(b))
    loss0, m0, g0 = run(b, granularity, **behaviour_kwargs(b, cap=None))
    assert loss == loss0
    np.testing.assert_array_equal(g, g0)
    assert m["behaviour_weight_mean"] == 1.0 and m["behaviour_capped_frac"] == 0.0
    assert m["sampler_mismatch_sequence"] == m["sampler_mismatch_subsequence"] == 0.0


def test_token_behaviour_weight_is_the_truncated_is_weight():
    b = make_mixed_version_batch(seed=24, dtype=np.float32)
    opts = {k: v for k, v in behaviour_kwargs(b).items() if k != "behaviour_cap"}
    loss, m, g = run(b, "token", behaviour_cap=1.5, **opts)
    loss_t, m_t, g_t = run(b, "token", tis_cap=1.5, **opts)
    assert loss == loss_t
    np.testing.assert_array_equal(g, g_t)
    assert m["behaviour_weight_mean"] == m_t["tis_weight_mean"]


@pytest.mark.parametrize("granularity", GRANS)
def test_behaviour_cap_binds_on_a_large_gap(granularity):
    """Every policy token 3 nats more likely under π_prox than under μ: every unit's weight is C
    (loss and gradient C times the unweighted ones); a gap of -0.5 gives weight e^-0.5, below C."""
    b = make_mixed_version_batch(seed=25, dtype=np.float32)
    on = b["loss_mask"] == 1
    base_l, _, base_g = run(b, granularity, sampler_logprobs=b["sampler_logp"])
    for gap, w, frac in ((3.0, BEHAVIOUR_CAP, 1.0), (-0.5, np.exp(-0.5), 0.0)):
        b["sampler_logp"] = np.where(on, b["old_logp"] - gap, b["sampler_logp"]).astype(np.float32)
        loss, m, g = run(b, granularity, sampler_logprobs=b["sampler_logp"], behaviour_cap=BEHAVIOUR_CAP)
        np.testing.assert_allclose(loss, w * base_l, rtol=1e-5)
        np.testing.assert_allclose(g, w * base_g, rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(m["behaviour_weight_mean"], w, rtol=1e-5)
        assert m["behaviour_capped_frac"] == frac
        np.testing.assert_allclose(m["sampler_mismatch_subsequence"], abs(gap), rtol=1e-5)


@pytest.mark.parametrize("granularity", GRANS)
def test_behaviour_weight_carries_no_gradient(granularity):
    """The weight is a constant of the update: no gradient reaches the sampler or proximal log-probs
    even when the caller's arrays carry one."""
    b = make_mixed_version_batch(seed=26, dtype=np.float32)
    arrays = [jnp.asarray(b[k]) for k in ("logp", "old_logp", "sampler_logp", "advantages", "loss_mask")]

    def f(old, sampler, logp, adv, mask):
        return losses.policy_loss(logp, old, adv, mask, granularity=granularity, sampler_logprobs=sampler,
                                  behaviour_cap=BEHAVIOUR_CAP)[0]

    logp, old, sampler, adv, mask = arrays
    g_old, g_sampler = jax.jit(jax.grad(f, argnums=(0, 1)))(old, sampler, logp, adv, mask)
    np.testing.assert_array_equal(g_old, 0.0)
    np.testing.assert_array_equal(g_sampler, 0.0)
