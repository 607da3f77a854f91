"""Shared-prompt scoring: each distinct prompt of a micro-batch runs through the model once, and every
response of it attends to that one copy (`TrainConfig.share_prompts`).

Shapes: B rows of the `TrainBatch`, T its padded length; per micro-batch b rows, U prompt slots,
Pp positions per prompt slot, Rr response rows of R positions, V prompt slots read per response
row; L layers, K kv heads, Dh head dim, D hidden size.

Layout (two tensors, never one long row):

    prompts   [U, Pp]   the micro-batch's distinct prompts, one row each (right-padded)
    responses [Rr, R]   the responses: a row's tokens from its first policy token on

Unpacked, response row j is the micro-batch's row j (Rr = b, V = 1, R the longest response).
Packed (`TrainConfig.pack_tokens` = P), the micro-batch's responses go first-fit-decreasing into
rows of R = P positions, each response a segment (1, 2, ...) of its row; a row may hold responses
of several prompts, V the most any row holds.

In every layer the prompts run first, as an ordinary causal forward whose keys and values come out
as a per-row cache ([U, Pp, K, Dh]). Each response row then reads its V prompts' K/V (a gather by
prompt slot) into slots 0 .. V x Pp - 1 of a [V x Pp + R] key buffer, writes its own K/V after
them, and attends with causality by slot order and integer key ids (`_key_ids`,
`ops.attention_mask`): a response token sees the valid keys of its own prompt and the earlier
tokens of its own response, nothing of the row's other responses or their prompts. Positions are
the batch's own (`TrainBatch.positions`), so a response continues its prompt's RoPE positions
exactly, packed or not. Attention costs U x Pp^2 + Rr x R x (V x Pp + R) scores instead of
b x T^2, and the matmuls U x Pp + Rr x R tokens instead of b x T.

Exactness: every response token sees the same keys and values, at the same positions, as in its
own unshared row (prompt keys masked where the prompt slot is padding), so its hidden states are
the same up to float rounding. A response's first token is predicted from its prompt's last hidden
state (computed once per prompt slot); the later ones from the response's own.
Gradients: the prompt's K/V feed every response of its slot inside one differentiated function,
so autodiff sums their cotangents into the one prompt forward (the gather's transpose is a
scatter-add). Prompt tokens are never scored (they are never policy tokens): their log-prob and
entropy come out 0.

A row's prompt is its real tokens before its first policy token (at least its first real token).
Rows whose prompts (tokens and positions) are equal share a slot; which rows those are is found on
the host from the data (`make_plan`), so no group size is assumed: the DAPO filter's padding rows
(no policy token) get an empty response and the plan stays exact. The plan follows the strided
mini-/micro-batch split of `scoring.split_rows`, so each micro-batch shares the prompts it holds;
packing lays out a micro-batch's responses and never moves one to another micro-batch, so the
micro-batches, and with them the learner's row order (`micro_batch_order`), are the same packed
or not. The plan needs only the rows' records, so hosts can build it together, packed too.
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
from workflow_r1.model import ops, qwen2
from workflow_r1.rl import packed, shapes
from workflow_r1.rl.logprobs import logprobs_from_hidden

Array = jax.Array

# Pp and R are rounded up to the ladder of multiples of this (`shapes.ladder_ceil`, capped at T):
# few distinct shapes, so few compilations of the update.
MULTIPLE = 32


def plan_width(n: int, t: int, multiple: int = MULTIPLE) -> int:
    """The Pp or R a plan gives its longest prompt or response of n tokens, in a batch of T columns."""
    return min(t, shapes.ladder_ceil(n, multiple))


@flax.struct.dataclass
class SharePlan:
    """Where each micro-batch's prompt slots and response rows come from. Leading axes [M, k]
    (mini-batches, micro-batches per mini-batch) on the host; one micro-batch's plan has none.
    int32. Response rows: Rr rows of R positions, each holding V prompt slots' worth of segments.

    prompt_row:   [..., U]      the micro-batch row a prompt slot is read from (0 for an empty slot).
    prompt_start: [..., U]      the column of that row's first prompt token.
    prompt_mask:  [..., U, Pp]  1 on the slot's prompt tokens (0 on its padding; all 0: empty slot).
    row_prompt:   [..., Rr, V]  the prompt slots a response row's segments continue (0 where unused).
    resp_row:     [..., Rr, R]  the micro-batch row each response token is read from (0 on padding).
    resp_col:     [..., Rr, R]  its column in that row (0 on padding).
    resp_segment: [..., Rr, R]  1, 2, ... for the responses of a response row in order, 0 on padding.
    resp_prompt:  [..., Rr, R]  which of the row's V prompt slots the token's response continues.

    Unpacked, response row j is the micro-batch's row j (Rr = b, V = 1): its tokens from its first
    policy token on, one segment. Packed (`pack_tokens`), a row holds several responses of the
    micro-batch in R = pack_tokens positions, each continuing its own prompt slot.
    """

    prompt_row: Any
    prompt_start: Any
    prompt_mask: Any
    row_prompt: Any
    resp_row: Any
    resp_col: Any
    resp_segment: Any
    resp_prompt: Any


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
              micro_batch_size: int | None, multiple: int = MULTIPLE, pack_tokens: int = 0) -> SharePlan:
    """The host-side plan of a [B, T] batch (see the module docstring), leaves [M, k, ...]:
    `plan_from_records` of its `row_records`."""
    return plan_from_records(row_records(tokens, positions, input_mask, loss_mask), np.shape(tokens)[1],
                             num_mini_batches=num_mini_batches, micro_batch_size=micro_batch_size, multiple=multiple,
                             pack_tokens=pack_tokens)


def plan_from_records(records: np.ndarray, t: int, *, num_mini_batches: int, micro_batch_size: int | None,
                      multiple: int = MULTIPLE, pack_tokens: int = 0) -> SharePlan:
    """The plan of a batch of T columns from its rows' records [B, 7] (`row_records`), leaves
    [M, k, ...]. Rows whose prompt digests are equal share a slot. Pp and R are rounded up to the
    ladder of multiples of `multiple` (`shapes.ladder_ceil`: few distinct shapes, so few
    compilations), capped at T.

    pack_tokens: 0, one response row per row of the micro-batch. > 0: each micro-batch's responses
    go first-fit-decreasing into response rows of R = pack_tokens positions (`packed.first_fit_decreasing`);
    every micro-batch gets the same number of rows Rr (empty ones are all padding). The micro-batches
    are the same rows either way: packing changes how their responses are laid out, not which."""
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
    # Per part: its prompt slots [(row, start, length)] and its response rows, each a list of
    # responses (row, slot, start, length).
    parts: list[tuple[list[tuple[int, int, int]], list[list[tuple[int, int, int, int]]]]] = []
    for part in index.reshape(m * k, -1):
        slots: dict[tuple[int, ...], int] = {}
        slot_src, responses = [], []
        for j, r in enumerate(part):
            a, p, end, *key = (int(x) for x in records[r])
            if end < 0:  # nothing scored: an empty response
                responses.append((j, 0, 0, 0))
                continue
            if tuple(key) not in slots:
                slots[tuple(key)] = len(slot_src)
                slot_src.append((j, a, p - a))
            responses.append((j, slots[tuple(key)], p, end - p))
        if pack_tokens:
            longest = max(n for *_, n in responses)
            if longest > pack_tokens:
                raise ValueError(f"a response of {longest} tokens does not fit train.pack_tokens={pack_tokens} "
                                 "(with train.share_prompts packed rows hold responses, not prompts); raise it")
            bins = packed.first_fit_decreasing([n for *_, n in responses], pack_tokens)
            rows = [[responses[i] for i in bin_] for bin_ in bins]
        else:
            rows = [[x] if x[-1] else [] for x in responses]  # row j: row j's response (or none)
        parts.append((slot_src, rows))
    up = lambda n: plan_width(n, t, multiple)  # noqa: E731
    u = max([len(s) for s, _ in parts] + [1])
    pp = up(max([n for s, _ in parts for *_, n in s] + [1]))
    resp_rows = max([len(rows) for _, rows in parts] + [1])  # Rr
    width = pack_tokens or up(max([n for _, rows in parts for row in rows for *_, n in row] + [1]))  # R
    v = max([len({s for _, s, *_ in row}) for _, rows in parts for row in rows] + [1])
    segs = max([len(row) for _, rows in parts for row in rows] + [1])
    # The attention ids (`_key_ids`) hold a segment below ops.PREFIX and (V + 1) x PREFIX in int32.
    if segs >= ops.PREFIX or (v + 1) * ops.PREFIX > np.iinfo(np.int32).max:
        raise ValueError(f"a response row holds {segs} responses of {v} prompts, more than its attention ids "
                         "can tell apart; lower train.pack_tokens")
    shape = (m * k, resp_rows, width)
    plan = SharePlan(prompt_row=np.zeros((m * k, u), np.int32), prompt_start=np.zeros((m * k, u), np.int32),
                     prompt_mask=np.zeros((m * k, u, pp), np.int32), row_prompt=np.zeros((m * k, resp_rows, v), np.int32),
                     resp_row=np.zeros(shape, np.int32), resp_col=np.zeros(shape, np.int32),
                     resp_segment=np.zeros(shape, np.int32), resp_prompt=np.zeros(shape, np.int32))
    for i, (slot_src, rows) in enumerate(parts):
        for s, (j, a, n) in enumerate(slot_src):
            plan.prompt_row[i, s], plan.prompt_start[i, s] = j, a
            plan.prompt_mask[i, s, :n] = 1
        for q, row in enumerate(rows):
            used: dict[int, int] = {}  # prompt slot -> its index among the row's V
            at = 0
            for seg, (j, s, start, n) in enumerate(row, start=1):
                w = used.setdefault(s, len(used))
                plan.row_prompt[i, q, w] = s
                cut = slice(at, at + n)
                plan.resp_row[i, q, cut], plan.resp_col[i, q, cut] = j, np.arange(start, start + n)
                plan.resp_segment[i, q, cut], plan.resp_prompt[i, q, cut] = seg, w
                at += n
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


def plan_stats(plan: SharePlan, shape: tuple[int, int]) -> dict[str, float]:
    """Host metrics of the plan of a [B, T] batch: the tokens the shared forward computes per token
    of the unshared one (padding included on both sides: the positions the matmuls run on), and the
    prompt slots per micro-batch."""
    u, pp = np.asarray(plan.prompt_mask).shape[-2:]
    m, k, rows, r = np.asarray(plan.resp_segment).shape
    b = shape[0] // (m * k)
    return {"share_token_fraction": float((u * pp + rows * r) / (b * shape[1])), "share_prompt_slots": float(u)}


# --------------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------------

def _layer(layer: Any, xp: Array, xr: Array, pos_p: Array, mask_p: Array, pos_r: Array, key_ids_r: Array,
           row_prompt: Array) -> tuple[Array, Array]:
    """One decoder layer on the prompt slots xp [U, Pp, D] and the response rows xr [Rr, R, D];
    key_ids_r [Rr, V x Pp + R] (`_key_ids`), row_prompt [Rr, V]."""
    u, pp = xp.shape[:2]
    rows, r = xr.shape[:2]
    v = row_prompt.shape[1]
    attn = layer.attn
    kv_shape = (attn.cfg.num_kv_heads, attn.cfg.head_dim)
    dt = attn.dtype
    # The prompts: a causal forward whose K/V come back through an empty per-row cache of Pp slots.
    empty = jnp.zeros((u, pp) + kv_shape, dt)
    slots_p = jnp.broadcast_to(jnp.arange(pp, dtype=jnp.int32), (u, pp))
    xp, (kp, vp) = layer(xp, pos_p, mask_p, slots_p, (empty, empty), jnp.zeros((u,), jnp.int32))
    # The response rows: their V prompts' K/V in slots 0 .. V x Pp - 1, their own written after.
    pad = jnp.zeros((rows, r) + kv_shape, dt)
    kr = jnp.concatenate([jnp.take(kp, row_prompt, axis=0).reshape((rows, v * pp) + kv_shape), pad], axis=1)
    vr = jnp.concatenate([jnp.take(vp, row_prompt, axis=0).reshape((rows, v * pp) + kv_shape), pad], axis=1)
    slots_r = jnp.broadcast_to(v * pp + jnp.arange(r, dtype=jnp.int32), (rows, r))
    xr, _ = layer(xr, pos_r, key_ids_r, slots_r, (kr, vr), jnp.full((rows,), v * pp, jnp.int32))
    return xp, xr


def _key_ids(plan: SharePlan) -> Array:
    """Attention ids [Rr, V x Pp + R] of a response row's key buffer (`ops.attention_mask`): the
    keys of its w-th prompt slot are prefix (w + 1) x PREFIX (0 on the slot's padding), its own
    tokens (w + 1) x PREFIX + segment, w their response's prompt (0 on padding). A token then sees
    its own prompt's keys and the earlier tokens of its own response, nothing of another response
    in the row, whichever prompt that one continues."""
    rows, v = plan.row_prompt.shape
    prefix = (jnp.arange(v, dtype=jnp.int32) + 1) * ops.PREFIX                   # [V]
    valid = jnp.take(plan.prompt_mask, plan.row_prompt, axis=0) > 0               # [Rr, V, Pp]
    prompts = jnp.where(valid, prefix[None, :, None], 0).reshape(rows, -1)
    own = jnp.where(plan.resp_segment > 0, (plan.resp_prompt + 1) * ops.PREFIX + plan.resp_segment, 0)
    return jnp.concatenate([prompts, own], axis=1)


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

    Returns (prompt hidden states [U, Pp, D], response-row hidden states [Rr, R, D], both
    final-normed in the compute dtype; response tokens [Rr, R], 0 on padding).
    """
    t = tokens.shape[1]
    pp = plan.prompt_mask.shape[-1]
    p_cols = jnp.clip(plan.prompt_start[:, None] + jnp.arange(pp, dtype=jnp.int32), 0, t - 1)  # [U, Pp]
    p_tok, p_pos = (x[plan.prompt_row[:, None], p_cols] for x in (tokens, positions))
    # The batch's own positions: each response continues its prompt's.
    r_tok, r_pos = (packed.gather(x, plan.resp_row, plan.resp_col, plan.resp_segment) for x in (tokens, positions))
    mask_p = plan.prompt_mask.astype(bool)
    embed = lambda x: sharding.constrain(jnp.take(model.embed[...], x, axis=0).astype(model.dtype),  # noqa: E731
                                         ("batch", "length", "embed"))
    xp, xr = embed(p_tok), embed(r_tok)
    rest = (p_pos, mask_p, r_pos, _key_ids(plan), plan.row_prompt)
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
    seg = plan.resp_segment
    hp, hr, r_tok = hidden_states(model, tokens, positions, plan)
    # Each response token is predicted from the hidden state before it: a response's first token
    # from its prompt's last position (computed once per prompt slot), the others from the row.
    last = jnp.sum(plan.prompt_mask, axis=1) - 1                                     # [U]
    h_last = hp[jnp.arange(hp.shape[0]), last]                                       # [U, D]
    slot = jnp.take_along_axis(plan.row_prompt, plan.resp_prompt, axis=1)            # [Rr, R]
    first = (seg > 0) & (seg != jnp.pad(seg, ((0, 0), (1, 0)))[:, :-1])
    h_prev = jnp.pad(hr, ((0, 0), (1, 0), (0, 0)))[:, :-1]
    h = jnp.where(first[..., None], jnp.take(h_last, slot, axis=0), h_prev)         # [Rr, R, D]
    scored = seg > 0
    if score_mask is not None:
        scored &= packed.gather(score_mask, plan.resp_row, plan.resp_col, seg).astype(bool)
    w = model.unembed()
    w = w if temperature == 1.0 else w.astype(jnp.float32) / temperature
    # logprobs_from_hidden scores column c + 1 from hidden state c: h then one unused column.
    lp, ent = logprobs_from_hidden(jnp.pad(h, ((0, 0), (0, 1), (0, 0))), w, jnp.pad(r_tok, ((0, 0), (1, 0))),
                                   score_mask=jnp.pad(scored, ((0, 0), (1, 0))), chunk_size=chunk_size,
                                   unchunked_max_bytes=unchunked_max_bytes, with_entropy=with_entropy,
                                   entropy_grad=entropy_grad, compute_dtype=model.dtype)
    # Back to the batch layout [b, T]: each response token to its row and column.
    back = functools.partial(packed.scatter, plan_row=plan.resp_row, plan_col=plan.resp_col, segment=seg,
                             shape=tokens.shape)
    return back(lp[:, 1:]), back(ent[:, 1:])


__all__ = ["MULTIPLE", "plan_width", "RECORD", "SharePlan", "hidden_states", "make_plan", "micro_batch_order", "plan_from_records", "plan_stats",
           "row_records", "split_index", "token_logprobs"]
