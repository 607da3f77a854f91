"""Shared-prompt scoring: each distinct prompt of a micro-batch runs through the model once, and every
response of it attends to that one copy (`TrainConfig.share_prompts`).

Shapes: B rows of the `TrainBatch`, T its padded length; per micro-batch b rows, U prompt slots,
Pp positions per prompt slot, R positions per response row; L layers, K kv heads, Dh head dim,
D hidden size.

Layout (two tensors, never one long row):

    prompts   [U, Pp]   the micro-batch's distinct prompts, one row each (right-padded)
    responses [b, R]    each row's tokens from its first policy token on (right-padded)

In every layer the prompts run first, as an ordinary causal forward whose keys and values come out
as a per-row cache ([U, Pp, K, Dh]). Each response row then reads its prompt's K/V (a gather by
prompt slot) into slots 0 .. Pp - 1 of a [Pp + R] key buffer, writes its own K/V at Pp .. Pp + R - 1,
and attends with causality by slot order: a response query sees every valid prompt key and its own
earlier tokens. Positions are the batch's own (`TrainBatch.positions`), so a response continues
its prompt's RoPE positions exactly. Attention costs U x Pp^2 + b x R x (Pp + R) scores instead of
b x T^2, and the matmuls U x Pp + b x R tokens instead of b x T.

Exactness: every response token sees the same keys and values, at the same positions, as in its
own unshared row (prompt keys masked where the prompt slot is padding), so its hidden states are
the same up to float rounding. The token at a row's first response column is predicted from the
prompt's last hidden state (computed once per prompt slot); the later ones from the response's own.
Gradients: the prompt's K/V feed every response of its slot inside one differentiated function,
so autodiff sums their cotangents into the one prompt forward (the gather's transpose is a
scatter-add). Prompt tokens are never scored (they are never policy tokens): their log-prob and
entropy come out 0.

A row's prompt is its real tokens before its first policy token (at least its first real token).
Rows whose prompts (tokens and positions) are equal share a slot; which rows those are is found on
the host from the data (`make_plan`), so no group size is assumed: the DAPO filter's padding rows
(no policy token) get an empty response and the plan stays exact. The plan follows the strided
mini-/micro-batch split of `scoring.split_rows`, so each micro-batch shares the prompts it holds.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workflow_r1 import sharding
from workflow_r1.model import qwen2
from workflow_r1.rl.logprobs import logprobs_from_hidden

Array = jax.Array

# Pp and R are rounded up to a multiple of this (capped at T): fewer distinct shapes, fewer compilations.
MULTIPLE = 64


@flax.struct.dataclass
class SharePlan:
    """Where each micro-batch's prompt slots and responses come from. Leading axes [M, k] (mini-
    batches, micro-batches per mini-batch) on the host; one micro-batch's plan has none. int32.

    prompt_row:   [..., U]      the micro-batch row a prompt slot is read from (0 for an empty slot).
    prompt_start: [..., U]      the column of that row's first prompt token.
    prompt_mask:  [..., U, Pp]  1 on the slot's prompt tokens (0 on its padding; all 0: empty slot).
    row_prompt:   [..., b]      each row's prompt slot.
    row_start:    [..., b]      each row's first response column (its prompt's end).
    resp_mask:    [..., b, R]   1 on the row's response tokens (its real tokens from row_start on).
    """

    prompt_row: Any
    prompt_start: Any
    prompt_mask: Any
    row_prompt: Any
    row_start: Any
    resp_mask: Any


def split_index(n_rows: int, m: int, k: int) -> np.ndarray:
    """[M, k, b] batch-row indices of `scoring.split_rows` applied twice (mini-, then micro-batches):
    part i of a split in n holds rows i, i + n, ... ."""
    return np.stack([np.stack([mini[j::k] for j in range(k)]) for mini in (np.arange(n_rows)[i::m] for i in range(m))])


# One row's record: its first real column, first response column (its prompt's end), end of its real
# tokens, and a 128-bit digest of its prompt's tokens and positions in four words; all -1 for a row
# with nothing scored. int32, as JAX moves integers between processes (64-bit ones would be cut).
RECORD = ("start", "response", "end", "key0", "key1", "key2", "key3")


def row_records(tokens: Any, positions: Any, input_mask: Any, loss_mask: Any,
                row_ids: Any = None) -> np.ndarray:
    """int32 [B, 7] (`RECORD`) of [B, T] host rows: all a plan needs, so hosts can share it cheaply.

    A row's prompt is its real tokens before its first policy token (at least its first real
    token). Real tokens must be one contiguous run per row (left or right padding). row_ids: the
    rows' indices in the batch, for errors (default 0 .. B - 1).
    """
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    input_mask, loss_mask = np.asarray(input_mask).astype(bool), np.asarray(loss_mask).astype(bool)
    out = np.full((tokens.shape[0], len(RECORD)), -1, np.int32)
    for i in range(tokens.shape[0]):
        real = np.flatnonzero(input_mask[i])
        policy = np.flatnonzero(loss_mask[i] & input_mask[i])
        if real.size == 0 or policy.size == 0:  # nothing scored: an empty response
            continue
        a, end = int(real[0]), int(real[-1]) + 1
        if end - a != real.size:
            r = i if row_ids is None else int(np.asarray(row_ids)[i])
            raise ValueError(f"row {r} has padding between real tokens; train.share_prompts needs one "
                             "contiguous run of real tokens per row")
        p = max(int(policy[0]), a + 1)
        digest = hashlib.blake2b(tokens[i, a:p].astype(np.int64).tobytes() + positions[i, a:p].astype(np.int64).tobytes(),
                                 digest_size=16).digest()
        out[i] = (a, p, end, *np.frombuffer(digest, np.int32))
    return out


def make_plan(tokens: Any, positions: Any, input_mask: Any, loss_mask: Any, *, num_mini_batches: int,
              micro_batch_size: int | None, multiple: int = MULTIPLE) -> SharePlan:
    """The host-side plan of a [B, T] batch (see the module docstring), leaves [M, k, ...]:
    `plan_from_records` of its `row_records`."""
    return plan_from_records(row_records(tokens, positions, input_mask, loss_mask), np.shape(tokens)[1],
                             num_mini_batches=num_mini_batches, micro_batch_size=micro_batch_size, multiple=multiple)


def plan_from_records(records: np.ndarray, t: int, *, num_mini_batches: int, micro_batch_size: int | None,
                      multiple: int = MULTIPLE) -> SharePlan:
    """The plan of a batch of T columns from its rows' records [B, 7] (`row_records`), leaves
    [M, k, ...]. Rows whose prompt digests are equal share a slot. Pp and R are rounded up to
    `multiple` (fewer distinct shapes, so fewer compilations), capped at T."""
    n_rows = records.shape[0]
    m = num_mini_batches
    if n_rows % m:
        raise ValueError(f"a batch of {n_rows} rows does not split into {m} mini-batches "
                         "(TrainConfig.num_mini_batches); make the rollout batch a multiple of it")
    b = n_rows // m
    k = 1 if micro_batch_size is None or micro_batch_size >= b else b // micro_batch_size
    if b % k:
        raise ValueError(f"mini-batch of {b} rows is not a multiple of TrainConfig.micro_batch_size={micro_batch_size}")
    index = split_index(n_rows, m, k)  # [M, k, b/k]
    parts = []  # per part: (slots [(row, start, length)], row_slot, row_start, row_len)
    for part in index.reshape(m * k, -1):
        slots: dict[tuple[int, ...], int] = {}
        slot_src, row_slot, row_start, row_len = [], [], [], []
        for j, r in enumerate(part):
            a, p, end, *key = (int(x) for x in records[r])
            if end < 0:  # nothing scored: an empty response
                row_slot.append(-1), row_start.append(0), row_len.append(0)
                continue
            if tuple(key) not in slots:
                slots[tuple(key)] = len(slot_src)
                slot_src.append((j, a, p - a))
            row_slot.append(slots[tuple(key)]), row_start.append(p), row_len.append(end - p)
        parts.append((slot_src, row_slot, row_start, row_len))
    up = lambda n: min(t, max(multiple, -(-n // multiple) * multiple))  # noqa: E731
    u = max([len(s) for s, *_ in parts] + [1])
    pp = up(max([n for s, *_ in parts for *_, n in s] + [1]))
    rr = up(max([n for *_, lens in parts for n in lens] + [1]))
    rows = index.shape[-1]
    plan = SharePlan(prompt_row=np.zeros((m * k, u), np.int32), prompt_start=np.zeros((m * k, u), np.int32),
                     prompt_mask=np.zeros((m * k, u, pp), np.int32), row_prompt=np.zeros((m * k, rows), np.int32),
                     row_start=np.zeros((m * k, rows), np.int32), resp_mask=np.zeros((m * k, rows, rr), np.int32))
    for i, (slot_src, row_slot, row_start, row_len) in enumerate(parts):
        for s, (j, a, n) in enumerate(slot_src):
            plan.prompt_row[i, s], plan.prompt_start[i, s] = j, a
            plan.prompt_mask[i, s, :n] = 1
        for j, (s, start, n) in enumerate(zip(row_slot, row_start, row_len)):
            plan.row_prompt[i, j], plan.row_start[i, j] = max(s, 0), start
            plan.resp_mask[i, j, :n] = 1
    return jax.tree.map(lambda x: x.reshape((m, k) + x.shape[1:]), plan)


def micro_batch_order(rows: np.ndarray, num_mini_batches: int, num_micro: int) -> np.ndarray:
    """A reordering of a host's rows (their global indices `rows` [n] in the batch, ascending) that
    puts adjacent rows (a group's samples) in one micro-batch: returns src [n], the new row i being
    old row src[i].

    The strided split (`scoring.split_rows`, mini-batches then micro-batches) sends global row r to
    mini-batch r mod M and micro-batch (r div M) mod k of it, so a group's adjacent rows land in k
    different micro-batches and each computes the group's prompt. Each row keeps its mini-batch (so
    every update sees the rows it sees unshared, and accumulation over micro-batches is exact);
    within it the rows are dealt out micro-batch by micro-batch in their order. A micro-batch's
    rows stay spread over the devices as before (the positions are the same set)."""
    rows = np.asarray(rows)
    mini, micro = rows % num_mini_batches, (rows // num_mini_batches) % num_micro
    src = np.empty(rows.shape[0], np.int64)
    for i in range(num_mini_batches):
        q = np.flatnonzero(mini == i)                  # this mini-batch's rows, in order
        src[q[np.argsort(micro[q], kind="stable")]] = q
    return src


def plan_stats(plan: SharePlan, t: int) -> dict[str, float]:
    """Host metrics: the tokens the shared forward computes per token of the unshared one (padding
    included on both sides: the positions the matmuls run on), and the prompt slots per micro-batch."""
    u, pp = np.asarray(plan.prompt_mask).shape[-2:]
    b, r = np.asarray(plan.resp_mask).shape[-2:]
    return {"share_token_fraction": float((u * pp + b * r) / (b * t)), "share_prompt_slots": float(u)}


# --------------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------------

def _layer(layer: Any, xp: Array, xr: Array, pos_p: Array, mask_p: Array, pos_r: Array, key_valid_r: Array,
           row_prompt: Array) -> tuple[Array, Array]:
    """One decoder layer on the prompt slots xp [U, Pp, D] and the responses xr [b, R, D]."""
    u, pp = xp.shape[:2]
    b, r = xr.shape[:2]
    attn = layer.attn
    kv_shape = (attn.cfg.num_kv_heads, attn.cfg.head_dim)
    dt = attn.dtype
    # The prompts: a causal forward whose K/V come back through an empty per-row cache of Pp slots.
    empty = jnp.zeros((u, pp) + kv_shape, dt)
    slots_p = jnp.broadcast_to(jnp.arange(pp, dtype=jnp.int32), (u, pp))
    xp, (kp, vp) = layer(xp, pos_p, mask_p, slots_p, (empty, empty), jnp.zeros((u,), jnp.int32))
    # The responses: their prompt's K/V in slots 0 .. Pp - 1, their own written at Pp ...
    pad = jnp.zeros((b, r) + kv_shape, dt)
    kr = jnp.concatenate([jnp.take(kp, row_prompt, axis=0), pad], axis=1)
    vr = jnp.concatenate([jnp.take(vp, row_prompt, axis=0), pad], axis=1)
    slots_r = jnp.broadcast_to(pp + jnp.arange(r, dtype=jnp.int32), (b, r))
    xr, _ = layer(xr, pos_r, key_valid_r, slots_r, (kr, vr), jnp.full((b,), pp, jnp.int32))
    return xp, xr


def _apply(graphdef: Any, state: Any, xp: Array, xr: Array, *rest: Array) -> tuple[Array, Array]:
    return _layer(nnx.merge(graphdef, state), xp, xr, *rest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _remat(graphdef: Any, state: Any, xp: Array, xr: Array, *rest: Array) -> tuple[Array, Array]:
    """`_layer` keeping only its inputs for the backward pass (see `qwen2._remat_layer` for why a
    custom VJP rather than `jax.checkpoint`)."""
    return _apply(graphdef, state, xp, xr, *rest)


def _remat_fwd(graphdef, state, xp, xr, *rest):
    return _apply(graphdef, state, xp, xr, *rest), (state, xp, xr, rest)


def _remat_bwd(graphdef, residuals, ct):
    state, xp, xr, rest = residuals
    # The recomputation depends on the cotangent, so no compiler can hoist it into the forward.
    xp = xp + (0.0 * ct[0][:, :1, :1]).astype(xp.dtype)
    xr = xr + (0.0 * ct[1][:, :1, :1]).astype(xr.dtype)
    _, vjp = jax.vjp(functools.partial(_apply, graphdef), state, xp, xr, *rest)
    return vjp(ct)


_remat.defvjp(_remat_fwd, _remat_bwd)


def _run_layer(layer: Any, remat: bool, xp: Array, xr: Array, *rest: Array) -> tuple[Array, Array]:
    if not remat:
        return _layer(layer, xp, xr, *rest)
    graphdef, state = nnx.split(layer)
    return _remat(graphdef, state, xp, xr, *rest)


def hidden_states(model: Any, tokens: Array, positions: Array, plan: SharePlan) -> tuple[Array, Array, Array]:
    """One micro-batch [b, T] through the model with its prompts shared.

    Returns (prompt hidden states [U, Pp, D], response hidden states [b, R, D], both final-normed in
    the compute dtype; response tokens [b, R]).
    """
    t = tokens.shape[1]
    pp, rr = plan.prompt_mask.shape[-1], plan.resp_mask.shape[-1]
    p_cols = jnp.clip(plan.prompt_start[:, None] + jnp.arange(pp, dtype=jnp.int32), 0, t - 1)  # [U, Pp]
    r_cols = jnp.clip(plan.row_start[:, None] + jnp.arange(rr, dtype=jnp.int32), 0, t - 1)      # [b, R]
    p_tok, p_pos = (x[plan.prompt_row[:, None], p_cols] for x in (tokens, positions))
    r_tok, r_pos = (jnp.take_along_axis(x, r_cols, axis=1) for x in (tokens, positions))
    mask_p = plan.prompt_mask.astype(bool)
    key_valid_r = jnp.concatenate([jnp.take(mask_p, plan.row_prompt, axis=0), plan.resp_mask.astype(bool)], axis=1)
    embed = lambda x: sharding.constrain(jnp.take(model.embed[...], x, axis=0).astype(model.dtype),  # noqa: E731
                                         ("batch", "length", "embed"))
    xp, xr = embed(p_tok), embed(r_tok)
    rest = (p_pos, mask_p, r_pos, key_valid_r, plan.row_prompt)
    if model.scan_layers:
        graphdef, state = nnx.split(model.layers)

        def body(carry, layer_state):
            return _run_layer(nnx.merge(graphdef, layer_state), model.remat, *carry, *rest), None

        (xp, xr), _ = jax.lax.scan(body, (xp, xr), state)
    else:
        for layer in model.layers:
            xp, xr = _run_layer(layer, model.remat, xp, xr, *rest)
    return model.final_norm(xp), model.final_norm(xr), r_tok


def token_logprobs(model: Any, tokens: Array, positions: Array, plan: SharePlan, *, score_mask: Array | None,
                   chunk_size: int | None = 256, unchunked_max_bytes: int = 0, with_entropy: bool = True,
                   entropy_grad: bool = False, temperature: float = 1.0) -> tuple[Array, Array]:
    """`logprobs.token_logprobs` of one micro-batch [b, T] with its prompts shared (plan: the
    micro-batch's, no leading axes): (logp [b, T], entropy [b, T]) fp32, 0 outside the responses.

    score_mask: [b, T] (the loss mask) or None: every response token.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts are scored at 1.0)")
    b, t = tokens.shape
    rr = plan.resp_mask.shape[-1]
    hp, hr, r_tok = hidden_states(model, tokens, positions, plan)
    # A row's first response token is predicted at its prompt's last position.
    last = jnp.sum(plan.prompt_mask, axis=1) - 1                                     # [U]
    h_last = hp[plan.row_prompt, jnp.take(last, plan.row_prompt)]                    # [b, D]
    prev = jnp.take_along_axis(tokens, jnp.maximum(plan.row_start - 1, 0)[:, None], axis=1)
    r_cols = plan.row_start[:, None] + jnp.arange(rr, dtype=jnp.int32)
    scored = plan.resp_mask.astype(bool)
    if score_mask is not None:
        scored &= jnp.take_along_axis(score_mask, jnp.clip(r_cols, 0, t - 1), axis=1).astype(bool)
    h = jnp.concatenate([h_last[:, None], hr], axis=1)                               # [b, 1 + R, D]
    w = model.unembed()
    w = w if temperature == 1.0 else w.astype(jnp.float32) / temperature
    lp, ent = logprobs_from_hidden(h, w, jnp.concatenate([prev, r_tok], axis=1),
                                   score_mask=jnp.pad(scored, ((0, 0), (1, 0))), chunk_size=chunk_size,
                                   unchunked_max_bytes=unchunked_max_bytes, with_entropy=with_entropy,
                                   entropy_grad=entropy_grad, compute_dtype=model.dtype)
    # Back to the batch layout: column c of row b is response position c - row_start[b].
    j = jnp.arange(t, dtype=jnp.int32)[None, :] - plan.row_start[:, None]
    inside = (j >= 0) & (j < rr)
    back = lambda x: jnp.where(inside, jnp.take_along_axis(x[:, 1:], jnp.clip(j, 0, rr - 1), axis=1), 0.0)  # noqa: E731
    return back(lp), back(ent)


__all__ = ["MULTIPLE", "RECORD", "SharePlan", "hidden_states", "make_plan", "micro_batch_order", "plan_from_records", "plan_stats",
           "row_records", "split_index", "token_logprobs"]
