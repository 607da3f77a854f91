"""Sampler: exactness against HF / teacher-forced forwards, stops, sampling, multi-turn, bad input.

References are computed another way: HF torch (`generate`, or a cache-free forward per step), a
teacher-forced forward of the whole sequence, NumPy from the formula, or str.find on the text.
Tiny-model tests use random weights; real-model tests use Qwen2.5-Coder-0.5B-Instruct (fp32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp
from flax import nnx

from tests.hf_reference import left_padded, save_random_hf
from workflow_r1 import sampler as sampler_lib
from workflow_r1 import sharding
from workflow_r1.executor.local_backend import make_local_generate_fn
from workflow_r1.model import checkpoint
from workflow_r1.model.config import get_preset
from workflow_r1.sampler import Sampler, SamplerError
from workflow_r1.sampler import fused_cpu
from workflow_r1.sampler import loop as sampler_loop
from workflow_r1.sampler import session as sampler_session
from workflow_r1.sampler import sampling
from workflow_r1.sampler import text as sampler_text

CFG = get_preset("tiny")  # vocab 256, eos id 1, pad id 0
# A synthetic byte vocabulary for stop strings: token i is the 3 bytes "<2 hex digits>.".
TOKEN_BYTES = [f"{i:02x}.".encode() for i in range(CFG.vocab_size)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF torch model, our model loaded from its checkpoint, checkpoint dir)."""
    d = tmp_path_factory.mktemp("tiny_sampler")
    hf = save_random_hf(CFG, d, seed=1)
    return hf, checkpoint.load(d), d


def _prompts(seed=0, lengths=(9, 5, 7, 12)):
    rng = np.random.RandomState(seed)
    return [[int(t) for t in rng.randint(2, CFG.vocab_size, n)] for n in lengths]


def _hf_greedy(hf, prompt, n, eos=None):
    """Greedy continuation by full cache-free torch forwards, one step at a time."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if eos is not None and t in eos:
                break
    return out


def _forward_logits(model, seqs):
    """Teacher-forced fp32 logits [B, T, V] of our model on left-padded full sequences (no cache)."""
    tokens, mask, pos = left_padded(seqs, 0)
    logits = _FORWARD(model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    return np.asarray(logits), tokens.shape[1]


_FORWARD = nnx.jit(lambda m, t, p, k: m(t, p, input_mask=k)[0])  # weights are arguments, not constants


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _gen_logits(model, prompts, gens):
    """For each row, the teacher-forced logits [n_gen, V] that predicted each generated token."""
    seqs = [p + g for p, g in zip(prompts, gens)]
    logits, t = _forward_logits(model, seqs)
    return [logits[i, t - len(g) - 1:t - 1] for i, g in enumerate(gens)]


# ------------------------------------------------------------------------------------ exactness

def test_greedy_matches_hf_tiny(tiny):
    hf, model, _ = tiny
    prompts = _prompts(lengths=(9, 5, 7, 16))
    out = Sampler(model, cache_size=64).generate(prompts, 12)
    for p, toks, reason in zip(prompts, out.tokens, out.finish_reason):
        ref = _hf_greedy(hf, p, 12, eos={1})
        assert toks == ref
        assert reason == ("eos" if ref[-1] == 1 else "length")


def test_fused_cpu_path_equals_model_path(tiny):
    _, model, _ = tiny
    prompts = _prompts(3, (4, 11, 6, 2))
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, seed=3)
    a = Sampler(model, cache_size=64, impl="fused_cpu").generate(prompts, 10, **kw)
    b = Sampler(model, cache_size=64, impl="model").generate(prompts, 10, **kw)
    assert a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_bf16_model_path_decodes_on_cpu_like_the_fused_path(tiny):
    """The model path's head in bf16 used to fail on XLA:CPU at run time (a transposed bf16 dot
    with fp32 output has no kernel there); both paths now give the same greedy tokens."""
    _, _, d = tiny
    model = checkpoint.load(d, dtype=jnp.bfloat16)
    prompts = _prompts(3, (4, 11, 6, 2))
    a = Sampler(model, cache_size=64, impl="fused_cpu").generate(prompts, 6)
    b = Sampler(model, cache_size=64, impl="model").generate(prompts, 6)
    assert a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs):
        np.testing.assert_allclose(x, y, atol=5e-2)  # a few bf16 ulps at |logprob| ~ 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_fused_dense_is_x_times_w_transposed_in_either_gemm_order(dtype):
    """`fused_cpu.dense` picks the GEMM's operand order per shape (`weight_as_lhs`); both orders give
    x @ w.T with fp32 accumulation, rounded once to the compute dtype (NumPy float64 reference)."""
    rng = np.random.default_rng(0)
    orders = set()
    for rows, (out_f, in_f) in [(2, (24, 40)), (2, (40, 24)), (32, (48, 16)), (40, (48, 16)), (40, (16, 48)),
                                (96, (48, 16))]:
        x = jnp.asarray(rng.standard_normal((rows, in_f)), dtype)
        w = jnp.asarray(rng.standard_normal((out_f, in_f)), dtype)
        orders.add(fused_cpu.weight_as_lhs(rows, w.shape, dtype))
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        got = jax.jit(fused_cpu.dense)(x, w)
        assert got.shape == (rows, out_f) and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5 if dtype == jnp.float32 else 8e-3,
                                   atol=1e-4 if dtype == jnp.float32 else 3e-2)
    assert orders == {True, False}  # both orders were exercised


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7, top_k=30, top_p=0.9, seed=5),
                                dict(temperature=1.3, top_p=0.8, seed=6)], ids=["greedy", "topk_topp", "topp"])
def test_logprobs_equal_teacher_forced(tiny, kw):
    """Returned log-probs = log_softmax(logits / T) of a full forward on the generated sequence."""
    _, model, _ = tiny
    prompts = _prompts(1)
    out = Sampler(model, cache_size=64).generate(prompts, 10, **kw)
    temp = kw.get("temperature", 1.0)
    for lg, toks, lp in zip(_gen_logits(model, prompts, out.tokens), out.tokens, out.logprobs):
        ref = _log_softmax(lg / temp)[np.arange(len(toks)), toks]
        assert lp.dtype == np.float32 and lp.shape == (len(toks),)
        np.testing.assert_allclose(lp, ref, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(temperature=1.0, seed=2)], ids=["greedy", "sampled"])
def test_bf16_fused_cpu_path_tracks_fp32_teacher_forcing(tiny, kw):
    """The bf16 CPU path (uint16 head-major cache, weight-as-lhs GEMMs) compiles, runs and is close.

    Its log-probs are checked against a fp32 teacher-forced forward on the tokens it generated:
    bf16 rounding only (projections, cache, attention probabilities), so agreement to ~bf16 eps.
    """
    _, model, _ = tiny
    prompts = _prompts(4, (3, 17, 9, 1, 30))  # 5 rows: a batch that is not a power of two
    s = Sampler(model, cache_size=96, impl="fused_cpu", dtype=jnp.bfloat16)
    out = s.generate(prompts, 12, **kw)
    s.generate(prompts, 2, **kw)  # a second call reuses the compiled programs and the cache layout
    temp = kw.get("temperature", 1.0)
    for lg, toks, lp in zip(_gen_logits(model, prompts, out.tokens), out.tokens, out.logprobs):
        assert len(toks) == 12
        ref = _log_softmax(lg / temp)[np.arange(len(toks)), toks]
        np.testing.assert_allclose(lp, ref, atol=0.05)


# ------------------------------------------------------------------------------------ stop strings

def _first_stop(text: str, stops) -> int | None:
    """Char offset just past the first occurrence of any stop string, or None."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return min(ends) if ends else None


def _expected_with_stops(ref_tokens, stops, n):
    """Reference cut: keep tokens through the one whose bytes complete the first stop string."""
    text = "".join(TOKEN_BYTES[t].decode() for t in ref_tokens)
    end = _first_stop(text, stops)
    if end is None:
        return ref_tokens[:n], "length"
    return ref_tokens[:(end - 1) // 3 + 1], "stop"


def test_stop_strings_spanning_tokens_and_per_row(tiny):
    hf, model, _ = tiny
    prompts = _prompts(7, (6, 9, 4, 12))
    n = 14
    refs = [_hf_greedy(hf, p, n) for p in prompts]
    text0 = "".join(TOKEN_BYTES[t].decode() for t in refs[0])
    text1 = "".join(TOKEN_BYTES[t].decode() for t in refs[1])
    cases = {
        "spans 3 tokens": [text0[3 * 2 + 1:3 * 4 + 2]],        # starts inside token 2, ends inside token 4
        "spans 2 tokens": [text1[3 * 5 + 2:3 * 6 + 1]],        # last byte of token 5 + first of token 6
        "first token": [text0[0:2]],                           # inside the very first generated token
        "never": ["zz"],                                       # not a byte sequence any token can produce
        "two strings": [text0[3 * 8:3 * 10], text1[3 * 3 + 1:3 * 5]],
    }
    s = Sampler(model, cache_size=64, token_bytes=TOKEN_BYTES)
    for name, stops in cases.items():
        out = s.generate(prompts, n, stop_strings=stops, eos_ids=())
        for i, ref in enumerate(refs):
            exp, reason = _expected_with_stops(ref, stops, n)
            assert out.tokens[i] == exp, (name, i)
            assert out.finish_reason[i] == reason, (name, i)
            assert len(out.logprobs[i]) == len(exp)
    # At least one case really stops a row early while another runs to the limit.
    out = s.generate(prompts, n, stop_strings=cases["spans 3 tokens"], eos_ids=())
    assert out.finish_reason[0] == "stop" and len(out.tokens[0]) == 5
    assert "length" in out.finish_reason


def _automaton_hit(tables, stop_index: int, seq) -> int | None:
    """Runs stop string `stop_index`'s token automaton over `seq`: index of the completing token, or None."""
    state = 0
    for j, t in enumerate(seq):
        state = int(tables[stop_index, state, t])
        if state < 0:
            return j
    return None


def test_stop_tables_match_str_find():
    """The token-level automaton finds the first occurrence exactly, overlaps and repeats included."""
    rng = np.random.RandomState(0)
    alphabet = ["a", "b", "ab", "ba", "aab", "", "bb", "aaa", "c"]
    tb = [s.encode() for s in alphabet]
    stops = ["abab", "aab", "bba", "cc", "a"]
    tables = sampler_lib.stop_tables(stops, tb)
    for _ in range(300):
        seq = list(rng.randint(0, len(alphabet), rng.randint(1, 12)))
        text = "".join(alphabet[t] for t in seq)
        for s_idx, s in enumerate(stops):
            hit = _automaton_hit(tables, s_idx, seq)
            pos = text.find(s)
            if pos < 0:
                assert hit is None, (seq, s)
            else:  # the token whose bytes contain the end of the first occurrence
                ends = np.cumsum([len(alphabet[t]) for t in seq])
                assert hit == int(np.searchsorted(ends, pos + len(s))), (seq, s)


# ------------------------------------------------------------------------------------ sampling

def test_top_k_and_top_p_stay_in_their_sets(tiny):
    _, model, _ = tiny
    prompts = _prompts(11, (5, 8, 3, 10))
    s = Sampler(model, cache_size=64)
    out = s.generate(prompts, 16, temperature=1.5, top_k=3, seed=1)
    for lg, toks in zip(_gen_logits(model, prompts, out.tokens), out.tokens):
        rank = (lg > lg[np.arange(len(toks)), toks][:, None]).sum(-1)
        assert (rank < 3).all()
    out = s.generate(prompts, 16, temperature=1.0, top_p=0.3, seed=2)
    for lg, toks in zip(_gen_logits(model, prompts, out.tokens), out.tokens):
        p = np.exp(_log_softmax(lg))
        for j, t in enumerate(toks):  # kept iff the mass of strictly more probable tokens is < top_p
            assert p[j][p[j] > p[j, t]].sum() < 0.3


def test_temperature_to_zero_is_greedy_and_seeds_are_deterministic(tiny):
    _, model, _ = tiny
    prompts = _prompts(4, (7, 3, 12, 1))
    s = Sampler(model, cache_size=64)
    greedy = s.generate(prompts, 10)
    assert s.generate(prompts, 10, temperature=1e-5, seed=9).tokens == greedy.tokens
    a = s.generate(prompts, 10, temperature=1.0, seed=123)
    b = s.generate(prompts, 10, temperature=1.0, seed=123)
    c = s.generate(prompts, 10, temperature=1.0, seed=124)
    assert a.tokens == b.tokens and all(np.array_equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    assert a.tokens != c.tokens


def _hf_filtered(p, top_k=0, top_p=1.0):
    """The distribution HF samples from: top-k, renormalise, then keep a token iff the mass of the
    strictly more probable kept tokens is < top_p, renormalise. NumPy float64, by sorting."""
    order = np.argsort(-p, kind="stable")[:top_k or len(p)]
    q = p[order] / p[order].sum()
    keep = order[np.cumsum(q) - q < top_p]
    out = np.zeros_like(p)
    out[keep] = p[keep] / p[keep].sum()
    return out


def _assert_frequencies(tokens, p, n):
    freq = np.bincount(tokens, minlength=len(p)) / n
    sigma = np.sqrt(p * (1 - p) / n)
    assert (np.abs(freq - p) <= 5 * sigma + 1e-9).all(), (np.abs(freq - p).max(), np.flatnonzero(freq), np.flatnonzero(p))


# p = [.5, .3, .15, .05] (the example): (top_k, top_p) -> the kept set under HF's rule. top-p
# acts on the renormalised top-k distribution; a token stays iff the mass strictly above it is < top_p.
_NUCLEUS_CASES = [(4, 0.6, {0, 1}), (3, 0.9, {0, 1, 2}), (2, 0.7, {0, 1}), (0, 0.6, {0, 1}), (0, 0.9, {0, 1, 2})]


@pytest.mark.parametrize("top_k,top_p,kept", _NUCLEUS_CASES, ids=[f"k{k}_p{p}" for k, p, _ in _NUCLEUS_CASES])
def test_top_k_and_top_p_rule_on_a_known_distribution(top_k, top_p, kept):
    """`sampling.sample` on fixed logits: the kept set, its frequencies (5 sigma) and the full-vocab log-prob."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    n = 8192
    logits_vb = jnp.asarray(np.repeat(np.log(p)[:, None], n, axis=1), jnp.float32)  # [V, B]
    keys = sampling.row_keys(jax.random.PRNGKey(7), jnp.int32(0), n)
    tok, lp = sampling.sample(logits_vb, keys, jnp.float32(1.0), jnp.float32(top_p), jnp.int32(top_k or 4),
                              greedy=False, top_k_bucket=4 if top_k else 0, use_top_p=True)
    tok, lp = np.asarray(tok), np.asarray(lp)
    expect = _hf_filtered(p, top_k, top_p)
    assert set(np.flatnonzero(expect)) == kept
    assert set(tok.tolist()) == kept
    _assert_frequencies(tok, expect, n)
    np.testing.assert_allclose(lp, np.log(p)[tok], atol=1e-6)  # not renormalised (see sampling.py)


def test_sample_frequencies_follow_the_distribution(tiny):
    """One step for 2048 copies of a prompt: frequencies match softmax(logits / T) (top-k / top-p filtered)."""
    _, model, _ = tiny
    prompt = _prompts(5, (6,))[0]
    lg, t = _forward_logits(model, [prompt])
    s = Sampler(model, cache_size=32)
    n = 2048
    # The top-p values sit >= 0.01 away from every cumulative mass of this prompt's distribution, so
    # float32 vs float64 cannot move a token across the nucleus boundary.
    for kw in (dict(temperature=0.5), dict(temperature=0.8, top_k=4), dict(temperature=0.5, top_p=0.2),
               dict(temperature=0.8, top_k=4, top_p=0.7)):
        p = np.exp(_log_softmax(lg[0, t - 1].astype(np.float64) / kw["temperature"]))
        p = _hf_filtered(p, kw.get("top_k", 0), kw.get("top_p", 1.0))
        out = s.generate([prompt] * n, 1, seed=17, eos_ids=(), **kw)
        _assert_frequencies([t[0] for t in out.tokens], p, n)


# ------------------------------------------------------------------------------------ multi-turn

def test_continue_after_append_equals_fresh_generation(tiny):
    _, model, _ = tiny
    prompts = _prompts(21, (5, 9, 7))
    obs = _prompts(22, (4, 6))
    s = Sampler(model, cache_size=256)
    sess = s.start(prompts)
    first = s.generate_from(sess, 8)
    s.append(sess, [0, 2], obs)
    second = s.generate_from(sess, 8, rows=[2, 0])  # any row order; row 1 is left untouched
    for k, r in enumerate([2, 0]):
        whole = prompts[r] + first.tokens[r] + obs[[0, 2].index(r)]
        ref = s.generate([whole], 8)
        assert second.tokens[k] == ref.tokens[0]
        np.testing.assert_allclose(second.logprobs[k], ref.logprobs[0], atol=1e-5)
        assert sess.sequences[r] == whole + ref.tokens[0]
    # Row 1 was not touched by the second call: continuing it now equals a fresh run too.
    third = s.generate_from(sess, 6, rows=[1])
    assert third.tokens[0] == s.generate([prompts[1] + first.tokens[1]], 6).tokens[0]


def test_writing_a_few_rows_computes_only_those_rows(tiny, monkeypatch):
    """Seven rows with one pending token and one with a 41-token observation: the seven are written
    as a one-token chunk and the long row alone at a 64-token chunk (a one-row sub-batch of the
    cache, gathered, extended, scattered back), and every row continues as a fresh run would."""
    _, model, _ = tiny
    prompts = _prompts(23, (5, 9, 7, 3, 6, 8, 4, 10))
    obs = _prompts(24, (40,))[0]
    s = Sampler(model, cache_size=256)
    sess = s.start(prompts)
    first = s.generate_from(sess, 6)
    shapes = []
    extend = sampler_loop.extend

    def recorded(impl, weights, cache, logits, tokens, counts, rows=None):
        shapes.append(tokens.shape + (None if rows is None else np.asarray(rows).tolist(),))
        return extend(impl, weights, cache, logits, tokens, counts, rows)

    monkeypatch.setattr(sampler_loop, "extend", recorded)
    s.append(sess, [5], [obs])
    second = s.generate_from(sess, 5)
    assert shapes == [(8, 1, None), (1, 64, [5])]
    for r in range(8):
        whole = prompts[r] + first.tokens[r] + (obs if r == 5 else [])
        ref = s.generate([whole], 5)
        assert second.tokens[r] == ref.tokens[0], r
        np.testing.assert_allclose(second.logprobs[r], ref.logprobs[0], atol=1e-5)


def test_write_plan_groups_rows_by_chunk_and_sub_batches_them():
    """Cost R x T per extend: grouping by chunk and sub-batching only when it computes less."""
    chunk = lambda k: max(16, 1 << (k - 1).bit_length())  # noqa: E731 - powers of two >= 16
    left = np.array([1] * 31 + [100])
    plan = sampler_session.write_plan(left, 32, chunk=chunk, min_rows=1, sub_batches=True)
    assert [(t, w.tolist(), None if i is None else i.tolist()) for t, w, i in plan] == [
        (16, list(range(31)), None), (128, [31], [31])]  # 16 x 32 + 128 x 1 positions, not 128 x 32
    # bf16's two-row minimum pads the single row with another that writes nothing.
    plan = sampler_session.write_plan(left, 32, chunk=chunk, min_rows=2, sub_batches=True)
    assert plan[1][2].tolist() == [0, 31]
    # Rows at one chunk length stay one extend; a few of many rows take a power-of-two sub-batch.
    plan = sampler_session.write_plan(np.array([0, 3, 0, 5, 9, 0, 0, 0]), 8, chunk=chunk, min_rows=1,
                                          sub_batches=True)
    assert [(t, w.tolist(), i.tolist()) for t, w, i in plan] == [(16, [1, 3, 4], [0, 1, 3, 4])]
    # On a mesh: one extend over every row at the longest chunk.
    plan = sampler_session.write_plan(left, 32, chunk=chunk, min_rows=1, sub_batches=False)
    assert [(t, len(w), i) for t, w, i in plan] == [(128, 32, None)]


def test_per_row_token_limits(tiny):
    """One limit per selected row (the rollout's remaining budgets): each row stops at its own."""
    hf, model, _ = tiny
    prompts = _prompts(23, (6, 11, 8))
    s = Sampler(model, cache_size=64)
    sess = s.start(prompts)
    out = s.generate_from(sess, [3, 9], rows=[2, 0], eos_ids=())
    assert [len(t) for t in out.tokens] == [3, 9] and out.finish_reason == ["length", "length"]
    assert out.tokens[0] == _hf_greedy(hf, prompts[2], 3) and out.tokens[1] == _hf_greedy(hf, prompts[0], 9)
    with pytest.raises(SamplerError, match="one positive int per row"):
        s.generate_from(sess, [3], rows=[2, 0])
    with pytest.raises(SamplerError, match="one positive int per row"):
        s.generate_from(sess, [3, 0], rows=[2, 0])


def test_continue_sampled_multi_turn_grows_the_cache(tiny):
    """Several turns past the first cache bucket, sampled with a seed; all rows continued each turn."""
    _, model, _ = tiny
    prompts = _prompts(31, (60, 20, 35))
    s = Sampler(model, cache_size=512)
    sess = s.start(prompts)
    seqs = [list(p) for p in prompts]
    rng = np.random.RandomState(3)
    for turn in range(2):
        out = s.generate_from(sess, 30, temperature=1.0, top_k=40, seed=turn)
        ref = s.generate(seqs, 30, temperature=1.0, top_k=40, seed=turn)
        assert out.tokens == ref.tokens and out.finish_reason == ref.finish_reason
        obs = [[int(t) for t in rng.randint(2, 256, rng.randint(10, 40))] for _ in seqs]
        s.append(sess, [0, 1, 2], obs)
        seqs = [q + g + o for q, g, o in zip(seqs, out.tokens, obs)]
    assert sess.cache.size > 128  # it grew past the first bucket
    assert sess.sequences == seqs


def test_cache_full_stops_rows_exactly(tiny):
    hf, model, _ = tiny
    prompts = _prompts(41, (20, 23, 10))
    s = Sampler(model, cache_size=24)
    out = s.generate(prompts, 10, eos_ids=())
    for p, toks, reason in zip(prompts, out.tokens, out.finish_reason):
        room = 24 - len(p)
        assert toks == _hf_greedy(hf, p, min(10, room))
        assert reason == ("cache_full" if room <= 10 else "length")
    sess = s.start([prompts[0]])
    s.generate_from(sess, 10, eos_ids=())
    again = s.generate_from(sess, 5)  # a full row generates nothing, and says so
    assert again.tokens == [[]] and again.finish_reason == ["cache_full"]
    with pytest.raises(SamplerError, match="exceeds cache_size=24"):
        s.append(sess, [0], [[5]])


def test_compiles_are_reused_and_new_params_take_effect(tiny):
    """Bucketed shapes and params-as-argument: new lengths and new weights do not recompile."""
    _, model, _ = tiny
    s = Sampler(model, cache_size=64)
    prompts = _prompts(51, (5, 9, 2, 14))
    before = s.generate(prompts, 10)
    n_ext, n_dec = sampler_loop.extend._cache_size(), sampler_loop.decode._cache_size()
    s.generate(_prompts(52, (3, 12, 16, 1)), 9)  # same buckets (chunk 16, cache 128, output buffer 16)
    graphdef, state = nnx.split(model)
    new_state = jax.tree.map(lambda w: w * 0.5, state)
    s.update_params(new_state)
    after = s.generate(prompts, 10)
    assert (sampler_loop.extend._cache_size(), sampler_loop.decode._cache_size()) == (n_ext, n_dec)
    assert after.tokens != before.tokens
    assert after.tokens == Sampler(nnx.merge(graphdef, new_state), cache_size=64).generate(prompts, 10).tokens


# ------------------------------------------------------------------------------------ mesh

def test_mesh_generation_equals_single_device(tiny):
    _, model, d = tiny
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = checkpoint.load(d, mesh=mesh)
    s = Sampler(sharded, cache_size=64, mesh=mesh, token_bytes=TOKEN_BYTES)
    assert s.impl == "model"
    ref = Sampler(model, cache_size=64, token_bytes=TOKEN_BYTES)
    prompts = _prompts(71, (5, 9, 7))  # 3 rows: padded to 4 for the (data, fsdp) = 4-way batch
    for kw in (dict(), dict(temperature=1.0, top_p=0.9, seed=4, stop_strings=["a."])):
        a, b = s.generate(prompts, 10, **kw), ref.generate(prompts, 10, **kw)
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        for x, y in zip(a.logprobs, b.logprobs):
            np.testing.assert_allclose(x, y, atol=1e-5)
    sess = s.start(prompts)
    s.generate_from(sess, 4)
    assert len(sess.cache.k[0].sharding.device_set) == 8


def test_row_offset_samples_what_the_whole_batch_samples_for_those_rows(tiny):
    _, model, _ = tiny
    s = Sampler(model, cache_size=64, token_bytes=TOKEN_BYTES)
    prompts = _prompts(72, (5, 9, 7, 6))
    kw = dict(temperature=1.0, seed=11)
    whole = s.generate(prompts, 10, **kw)
    # Two hosts of 2 rows each: the second passes its first row's global index.
    halves = [s.generate_from(s.start(prompts[o:o + 2], row_offset=o), 10, **kw) for o in (0, 2)]
    assert halves[0].tokens + halves[1].tokens == whole.tokens
    assert s.generate_from(s.start(prompts[2:]), 10, **kw).tokens != whole.tokens[2:]  # offset 0: other draws


# ------------------------------------------------------------------------------------ bad input

def test_bad_input_is_a_clear_error(tiny):
    _, model, _ = tiny
    s = Sampler(model, cache_size=32)
    cases = [
        (lambda: s.generate([], 4), "prompts is empty"),
        (lambda: s.generate([[3, 4], []], 4), "prompt 1 is empty"),
        (lambda: s.generate([[3] * 40], 4), r"prompt 0 has 40 tokens but cache_size=32"),
        (lambda: s.generate([[3, 4]], 4, eos_ids=[300]), r"eos id 300 is outside the vocabulary \[0, 256\)"),
        (lambda: s.generate([[3, 999]], 4), r"token id in prompt 0: 999 is outside the vocabulary"),
        (lambda: s.generate([[3, 4]], 0), "max_new_tokens=0 must be a positive int"),
        (lambda: s.generate([[3, 4]], 4, top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (lambda: s.generate([[3, 4]], 4, temperature=-1.0), "temperature=-1.0 must be >= 0"),
        (lambda: s.generate([[3, 4]], 4, top_k=-2), "top_k=-2 must be in"),
        (lambda: s.generate([[3, 4]], 4, stop_strings=["x"]), "pass tokenizer="),
        (lambda: Sampler(model, cache_size=32, token_bytes=TOKEN_BYTES).generate([[3]], 4, stop_strings=[""]),
         "must be a non-empty str"),
        (lambda: s.generate_from(s.start([[3]]), 4, rows=[2]), "row 2 is not in this session of 1 rows"),
        (lambda: Sampler(model, impl="gpu"), "impl='gpu' unknown"),
    ]
    for fn, msg in cases:
        with pytest.raises(SamplerError, match=msg):
            fn()


# ------------------------------------------------------------------------------------ real 0.5B

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in one sentence why the sky is blue.",
    "2+2=",
    "Name three primary colours, separated by commas.",
]
REAL_STOPS = ("</answer>", "</tool>")  # never produced by these prompts; keeps one compiled program


@pytest.fixture(scope="module")
def real(qwen05b_dir):
    """Our fp32 sampler's outputs and HF greedy `generate` on the same 5 chat prompts x 32 tokens."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(qwen05b_dir)
    model = checkpoint.load(qwen05b_dir)
    s = Sampler(model, tok, cache_size=512)
    prompts = [sampler_text.encode_chat(s, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) > 1
    out = s.generate(prompts, 32, stop_strings=REAL_STOPS)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(qwen05b_dir, dtype=torch.float32).eval()
    tokens, mask, _ = left_padded(prompts, 151643)
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                          attention_mask=torch.as_tensor(mask, dtype=torch.long), max_new_tokens=32,
                          do_sample=False, eos_token_id=[151645, 151643], pad_token_id=151643)
    del hf
    eos = {151645, 151643}
    hf_rows = []
    for row in ref[:, tokens.shape[1]:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        hf_rows.append(row[:cut])
    return {"dir": qwen05b_dir, "tok": tok, "model": model, "sampler": s, "prompts": prompts, "out": out,
            "hf": hf_rows}


@pytest.mark.real_model
def test_real_greedy_matches_hf_generate(real):
    out = real["out"]
    for i, (ours, ref) in enumerate(zip(out.tokens, real["hf"])):
        assert ours == ref, (i, real["tok"].decode(ours), real["tok"].decode(ref))
        assert out.finish_reason[i] == ("eos" if ref[-1] in (151645, 151643) else "length")
    assert "eos" in out.finish_reason and "length" in out.finish_reason


@pytest.mark.real_model
def test_real_logprobs_equal_teacher_forced(real):
    out = real["out"]
    for lg, toks, lp in zip(_gen_logits(real["model"], real["prompts"], out.tokens), out.tokens, out.logprobs):
        ref = _log_softmax(lg.astype(np.float64))[np.arange(len(toks)), toks]
        assert np.abs(lp - ref).max() < 1e-4, np.abs(lp - ref).max()


@pytest.mark.real_model
def test_real_vocab_bytes_and_stop_tables(real):
    tok, s = real["tok"], real["sampler"]
    tb = s.token_bytes()
    texts = ["Héllo wörld ✓ 中文 <tool>search</tool> done", "x</answer>\n\n", "</ans" + "wer> twice </answer>",
             "<answer>Paris</answer><|im_end|>"]
    for text in texts:
        ids = tok.encode(text)
        assert b"".join(tb[t] for t in ids).decode("utf-8") == tok.decode(ids)
    tables = sampler_lib.stop_tables(list(REAL_STOPS), tb)
    for text in texts:
        ids = tok.encode(text)
        ends = np.cumsum([len(tb[t]) for t in ids])
        raw = text.encode()
        for k, stop in enumerate(REAL_STOPS):
            hit = _automaton_hit(tables, k, ids)
            pos = raw.find(stop.encode())
            assert hit == (None if pos < 0 else int(np.searchsorted(ends, pos + len(stop)))), (text, stop)


@pytest.mark.real_model
def test_real_generate_fn_for_the_executor(real):
    """make_local_generate_fn: chat template on one user message, text without the EOS token."""
    # The function loads a second model and sampler: drop the fixture's sampler weights first (the
    # fused path's re-laid-out copy, ~2 GB), which this module's real-model tests no longer need.
    real["sampler"].release_params()
    fn = make_local_generate_fn(real["dir"], stop_strings=REAL_STOPS, cache_size=512)
    got = fn(QUESTIONS, 32)
    out = real["out"]
    for (text, reason), toks, r in zip(got, out.tokens, out.finish_reason):
        assert reason == r
        assert text == real["tok"].decode(toks, skip_special_tokens=True)
    assert fn([], 8) == []
