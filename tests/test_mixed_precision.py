"""Mixed precision: bf16 GEMMs in both passes with fp32 accumulation and fp32 master weights.

References are independent: NumPy float64 products of the bf16-rounded operands for the values and
gradients of `mixed.einsum`, and the fp32 model for the train step.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workflow_r1.model import mixed, qwen2
from workflow_r1.model.config import get_preset
from workflow_r1 import trajectory
from workflow_r1.rl import train_state, train_step as ts

BF16 = jnp.bfloat16


def _round(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16, as float64."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(BF16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("spec,shape_a,shape_b", [
    ("btd,dm->btm", (2, 5, 16), (16, 24)),           # MLP
    ("btd,dhk->bthk", (2, 5, 16), (16, 3, 8)),       # q/k/v projections
    ("bthk,hkd->btd", (2, 5, 3, 8), (3, 8, 16)),     # output projection
    ("btkgd,bskd->bkgts", (2, 5, 2, 2, 8), (2, 7, 2, 8)),  # attention scores
    ("bkgts,bskd->btkgd", (2, 2, 3, 5, 7), (2, 7, 2, 8)),  # attention-weighted values
])
def test_mixed_einsum_values_and_gradients_against_numpy(spec, shape_a, shape_b):
    rng = np.random.RandomState(0)
    a = rng.randn(*shape_a).astype(np.float32)
    w = rng.randn(*shape_b).astype(np.float32)          # an fp32 master weight
    g = rng.randn(*np.einsum(spec, a, w).shape).astype(np.float32)
    ab = jnp.asarray(a).astype(BF16)                      # a bf16 activation

    out, vjp = jax.vjp(lambda x, y: mixed.einsum(spec, x, y, BF16), ab, jnp.asarray(w))
    da, dw = vjp(jnp.asarray(g).astype(BF16))
    assert out.dtype == BF16 and da.dtype == BF16
    assert dw.dtype == jnp.float32, "the master weight's gradient must stay fp32"

    ra, rw, rg = _round(a), _round(w), _round(g)
    sa, sb, so = spec.replace(" ", "").replace("->", ",").split(",")
    want = np.einsum(spec, ra, rw)
    want_da = np.einsum(f"{so},{sb}->{sa}", rg, rw)
    want_dw = np.einsum(f"{sa},{so}->{sb}", ra, rg)
    # Products of bf16 values accumulated in fp32: only the final rounding to bf16 of the outputs
    # (out, da) differs from float64; dw is fp32 (no rounding at all beyond accumulation order).
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(da, np.float64), want_da, rtol=1e-2, atol=1e-2 * np.abs(want_da).max())
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=1e-5, atol=1e-5 * np.abs(want_dw).max())


def test_mixed_einsum_fp32_is_the_plain_einsum():
    a = jnp.asarray(np.random.RandomState(1).randn(3, 4), jnp.float32)
    w = jnp.asarray(np.random.RandomState(2).randn(4, 5), jnp.float32)
    f = lambda x, y: jnp.sum(mixed.einsum("td,dm->tm", x, y, jnp.float32) ** 2)  # noqa: E731
    g = lambda x, y: jnp.sum(jnp.einsum("td,dm->tm", x, y) ** 2)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.grad(f, (0, 1))(a, w)[1]), np.asarray(jax.grad(g, (0, 1))(a, w)[1]))


def test_mixed_einsum_refuses_an_index_summed_within_one_operand():
    with pytest.raises(ValueError, match="summed within it"):
        mixed.einsum("bij,jk->bk", jnp.ones((2, 3, 4), BF16), jnp.ones((4, 5)), BF16)


@pytest.mark.parametrize("op", ["add", "mul"])
def test_broadcast_parameter_gradient_is_an_fp32_sum(op):
    """mixed.add / mixed.mul (biases, norm scales): bf16 values, the parameter's gradient summed
    over [B, T] in fp32 and returned unrounded in the parameter's dtype.

    Reference: float64 from the bf16 operands and cotangent. A bf16 sum (what autodiff gives) is
    rounded to bf16 at the end: a relative error of up to 2^-9 per entry; fp32 leaves ~1e-6.
    """
    rng = np.random.RandomState(5)
    x = jnp.asarray(rng.randn(4, 64, 3, 8), jnp.float32).astype(BF16)
    p = jnp.asarray(rng.randn(3, 8), jnp.float32)              # an fp32 parameter
    g = jnp.asarray(rng.randn(4, 64, 3, 8), jnp.float32).astype(BF16)
    f = getattr(mixed, op)
    out, vjp = jax.vjp(f, x, p)
    dx, dp = vjp(g)
    assert out.dtype == BF16 and dx.dtype == BF16 and dp.dtype == jnp.float32
    xr, pr, gr = (_round(np.asarray(a, np.float32)) for a in (x, p, g))
    want, want_dx, want_dp = ((xr + pr, gr, gr.sum((0, 1))) if op == "add" else
                              (xr * pr, gr * pr, (gr * xr).sum((0, 1))))
    np.testing.assert_array_equal(np.asarray(out, np.float64), _round(want.astype(np.float32)))
    np.testing.assert_array_equal(np.asarray(dx, np.float64), _round(want_dx.astype(np.float32)))
    err = np.abs(np.asarray(dp, np.float64) - want_dp).max() / np.abs(want_dp).max()
    assert err < 1e-5, f"parameter gradient off by {err:.1e} (bf16 rounding is ~2e-3)"
    # The fp32 recipe is the plain broadcast op, JAX's own gradient.
    x32 = jnp.asarray(rng.randn(2, 5, 3, 8), jnp.float32)
    plain = (lambda a, b: a + b) if op == "add" else (lambda a, b: a * b)
    for got, ref in zip(jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), (0, 1))(x32, p),
                        jax.grad(lambda a, b: jnp.sum(plain(a, b) ** 2), (0, 1))(x32, p)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    with pytest.raises(ValueError, match="trailing axes"):
        f(x, jnp.ones((8, 3)))


def test_broadcast_parameter_gradient_compiles_without_a_reduce_window():
    """XLA:CPU takes a bf16 sum over many rows through a reduce-window (a naive loop, ~70x slower
    than its fp32 reduction: 0.22 s of a 4 x 256 step on the real 0.5B); mixed.add / mixed.mul
    sum in fp32. Checked on the compiled gradient of a [4, 256, 64] bias add and scale."""
    x = g = jnp.ones((4, 256, 64), BF16)
    p = jnp.ones((64,), jnp.float32)

    def compiled(f):
        grad = jax.jit(lambda x, p, g: jax.vjp(f, x, p)[1](g)[1])
        return grad.lower(x, p, g).compile().as_text()

    for f in (mixed.add, mixed.mul):
        assert "reduce-window" not in compiled(f), f"mixed.{f.__name__}: the gradient compiles to a reduce-window"
    # The form it replaces does compile to one (else this test could not fail).
    assert "reduce-window" in compiled(lambda x, p: x + p.astype(BF16))


def test_swiglu_values_and_gradients_against_numpy():
    """mixed.swiglu on bf16 activations: silu(g) * u and both gradients computed from the bf16
    operands and rounded once, against float64 (autodiff's bf16 chain rounds after every op)."""
    rng = np.random.RandomState(6)
    g, u, dh = (jnp.asarray(rng.randn(3, 7, 40) * 3, jnp.float32).astype(BF16) for _ in range(3))
    out, vjp = jax.vjp(mixed.swiglu, g, u)
    dg, du = vjp(dh)
    assert out.dtype == dg.dtype == du.dtype == BF16
    gr, ur, dr = (_round(np.asarray(a, np.float32)) for a in (g, u, dh))
    s = 1 / (1 + np.exp(-gr))
    for got, want in ((out, gr * s * ur), (dg, dr * ur * s * (1 + gr * (1 - s))), (du, dr * gr * s)):
        # One rounding to bf16: within half a bf16 ulp (2^-9 relative) of the float64 value.
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -8, atol=1e-6)
    g32, u32 = (jnp.asarray(rng.randn(2, 5, 8), jnp.float32) for _ in range(2))
    for got, ref in zip(jax.grad(lambda a, b: jnp.sum(mixed.swiglu(a, b) ** 2), (0, 1))(g32, u32),
                        jax.grad(lambda a, b: jnp.sum((jax.nn.silu(a) * b) ** 2), (0, 1))(g32, u32)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_attention_softmax_values_and_gradient_against_numpy():
    """mixed.softmax (attention probabilities): fp32 softmax of the masked scores rounded to bf16;
    its gradient computed in fp32 from those rounded probabilities, zero on masked entries.
    Reference: float64 from the same rounded probabilities."""
    rng = np.random.RandomState(7)
    scores = jnp.asarray(rng.randn(2, 3, 6, 9) * 4, jnp.float32)
    mask = jnp.asarray(np.tril(np.ones((6, 9), bool), 3))[None, None] & jnp.asarray(rng.rand(2, 1, 1, 9) > 0.2)
    mask = mask.at[1, :, 0].set(False)                    # one fully-masked query per head of row 1
    dp = jnp.asarray(rng.randn(2, 3, 6, 9), jnp.float32).astype(BF16)
    p, vjp = jax.vjp(lambda s: mixed.softmax(s, mask, BF16), scores)
    (ds,) = vjp(dp)
    assert p.dtype == BF16 and ds.dtype == jnp.float32
    m = np.broadcast_to(np.asarray(mask), scores.shape)
    z = np.where(m, np.asarray(scores, np.float64), -np.inf)
    z = np.where(m.any(-1, keepdims=True), z, 0.0)        # fully masked: uniform
    want = np.exp(z - z.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(p, np.float64), want, rtol=2 ** -8, atol=1e-7)
    pr, dr = np.asarray(p, np.float64), _round(np.asarray(dp, np.float32))
    want_ds = pr * (dr - (pr * dr).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(ds, np.float64), want_ds, rtol=1e-5, atol=1e-6)
    assert not np.asarray(ds)[~m & m.any(-1, keepdims=True)].any(), "a masked score got a gradient"
    s32 = jnp.asarray(rng.randn(2, 3, 6, 9), jnp.float32)
    got = jax.grad(lambda s: jnp.sum(mixed.softmax(s, mask, jnp.float32) ** 3))(s32)
    ref = jax.grad(lambda s: jnp.sum(jax.nn.softmax(jnp.where(mask, s, jnp.finfo(jnp.float32).min), -1) ** 3))(s32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def _tiny_batch(cfg, b: int = 2, t: int = 24) -> trajectory.TrainBatch:
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.int32)
    mask[:, 8:14] = 1
    mask[:, 18:22] = 1
    return trajectory.make_batch(tokens, mask, np.array([1.0, -0.5], np.float32))


def _loss_and_grads(dtype):
    cfg = get_preset("tiny")
    model = qwen2.create(cfg, seed=0, dtype=dtype, param_dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    state = train_state.TrainState(graphdef=graphdef, params=params, opt_state=None, step=jnp.zeros((), jnp.int32))
    tcfg = train_state.TrainConfig(num_mini_batches=1, kl_coef=0.0)
    batch = jax.tree.map(jnp.asarray, _tiny_batch(cfg))
    fn = jax.jit(lambda s, bt: ts._loss_and_grads(s.params, s.graphdef, bt, tcfg))
    return fn, state, batch


def test_bf16_step_gradient_matches_fp32_and_is_fp32():
    """The mixed step's gradient (fp32 leaves) is the fp32 step's up to bf16 rounding."""
    fn32, s32, batch = _loss_and_grads(jnp.float32)
    fn16, s16, _ = _loss_and_grads(BF16)
    loss32, g32, _ = fn32(s32, batch)
    loss16, g16, _ = fn16(s16, batch)
    l32, l16 = jax.tree.leaves(g32), jax.tree.leaves(g16)
    assert all(x.dtype == jnp.float32 for x in l16)
    v32 = np.concatenate([np.ravel(x) for x in l32]).astype(np.float64)
    v16 = np.concatenate([np.ravel(x) for x in l16]).astype(np.float64)
    cos = v32 @ v16 / np.linalg.norm(v32) / np.linalg.norm(v16)
    assert cos > 0.995, cos
    assert abs(np.linalg.norm(v16) / np.linalg.norm(v32) - 1) < 0.02
    np.testing.assert_allclose(float(loss16), float(loss32), rtol=1e-2, atol=1e-3)


def test_bf16_step_runs_every_matmul_on_bf16_operands():
    """No dot of the mixed train step (forward, backward, output head) multiplies fp32 operands.

    XLA:CPU runs a bf16 x bf16 -> bf16 product, or one with an fp32 operand, as an fp32 GEMM (2x
    slower than bf16 on the CPUs we measured; see model/mixed.py), so this is what keeps the step
    on the fast path. Checked on the lowered program (what JAX asks XLA to compute).
    """
    fn, state, batch = _loss_and_grads(BF16)
    text = fn.lower(state, batch).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*?:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)", text)
    assert len(dots) > 20, f"expected the step's matmuls in the program, found {len(dots)}"
    bad = [d for d in dots if not (d[0].endswith("xbf16>") and d[1].endswith("xbf16>"))]
    assert not bad, f"{len(bad)} of {len(dots)} matmuls take a non-bf16 operand, e.g. {bad[0]}"
    assert all(d[2].endswith("xf32>") for d in dots), "every bf16 product accumulates into fp32"


def _compiled_dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    """(lhs type, rhs type) of every dot in an optimized HLO module's text, e.g. ('bf16', 'f32')."""
    out = []
    for comp in re.split(r"\n(?=\S)", hlo):  # one computation per block
        types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", comp))
        for lhs, rhs in re.findall(r"= \w+\[[\d,]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", comp):
            out.append((types.get(lhs, "?"), types.get(rhs, "?")))
    return out


def test_bf16_step_compiles_every_matmul_to_a_bf16_gemm():
    """What XLA:CPU actually runs: no GEMM of the compiled mixed step converts its operands to fp32.

    The lowered program can be all bf16 and XLA still upcast a product it has no bf16 kernel for:
    the output head's weight gradient (h^T dz, contracting both operands' leading axis) was
    converted to an fp32 GEMM over the [M, V] logits gradient, a seventh of a 4 x 256 step on the
    real 0.5B (benchmarks/README.md); rl/logprobs.py keeps it bf16.
    """
    fn, state, batch = _loss_and_grads(BF16)
    dots = _compiled_dot_operand_types(fn.lower(state, batch).compile().as_text())
    assert len(dots) > 20, f"expected the step's GEMMs in the compiled module, found {len(dots)}"
    bad = [d for d in dots if d != ("bf16", "bf16")]
    assert not bad, f"{len(bad)} of {len(dots)} compiled GEMMs run on {sorted(set(bad))} operands, not bf16"


@pytest.mark.parametrize("spec", ["btkgd,bskd->bkgts", "bkgts,bskd->btkgd"])
def test_attention_products_never_transpose_the_probabilities(spec):
    """The [B, K, G, T, S] scores/probabilities and their gradients reach every GEMM in place.

    XLA copies a GEMM operand or result that is not in its [batch, free, contracted] order into a
    transposed buffer; for the two attention products and their four backward products, only the
    small q / k / v / output arrays may be copied (model/mixed.py `_product`). Checked on the
    compiled program: no transpose reads or writes an array of the probabilities' size.
    """
    b, t, k, g, d = 2, 32, 2, 3, 8
    qs = {"btkgd": (b, t, k, g, d), "bskd": (b, t, k, d), "bkgts": (b, k, g, t, t)}
    sa, sb = spec.split("->")[0].split(",")
    x = jnp.ones(qs[sa], jnp.float32)
    y = jnp.ones(qs[sb], jnp.float32)
    f = jax.jit(jax.grad(lambda x, y: jnp.sum(mixed.einsum(spec, x, y, BF16, jnp.float32) ** 2), (0, 1)))
    hlo = f.lower(x, y).compile().as_text()
    big = b * k * g * t * t
    shapes = [tuple(int(n) for n in s.split(",")) for s in re.findall(r"\w+\[([\d,]+)\]\{[\d,]*\} transpose\(", hlo)]
    assert shapes, "expected some (small) transposes in the compiled program"
    assert all(int(np.prod(s)) != big for s in shapes), f"a probabilities-sized array is transposed: {shapes}"


def test_output_head_weight_gradient_is_accumulated_in_fp32():
    """bf16 head products, but the fp32 master weight's gradient is not rounded to bf16 on its way.

    Reference: float64 from the bf16-rounded h, w and logits gradient (the product's operands).
    Rounding dW to bf16 (what a bf16 copy of the weight as the differentiated input did) would put
    a relative error of ~2^-9 on every entry; accumulating in fp32 leaves ~1e-6.
    """
    from workflow_r1.rl.logprobs import logprobs_from_hidden
    rng = np.random.RandomState(3)
    t, d, v = 12, 32, 64
    h = jnp.asarray(rng.randn(1, t, d), jnp.float32).astype(BF16)
    w = jnp.asarray(rng.randn(d, v) * 0.3, jnp.float32)
    tokens = jnp.asarray(rng.randint(0, v, (1, t)), jnp.int32)
    coef = jnp.asarray(rng.randn(1, t), jnp.float32)

    def f(w):
        lp, _ = logprobs_from_hidden(h, w, tokens, chunk_size=None, compute_dtype=BF16)
        return jnp.sum(coef * lp)

    dw = np.asarray(jax.grad(f)(w), np.float64)
    assert jax.grad(f)(w).dtype == jnp.float32
    hr, wr = _round(np.asarray(h, np.float32))[0, :-1], _round(np.asarray(w))
    z = hr @ wr
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(v)[np.asarray(tokens)[0, 1:]]
    dz = _round((np.asarray(coef, np.float64)[0, 1:, None] * (onehot - p)).astype(np.float32))
    want = hr.T @ dz
    err = np.abs(dw - want).max() / np.abs(want).max()
    assert err < 1e-4, f"head weight gradient off by {err:.1e} of its scale (bf16 rounding is ~2e-3)"
