"""Training attention through jax's Pallas splash kernel (model/splash.py), run by Pallas'
interpreter on the CPU against the blocked jnp attention (`ops.attend`): outputs and gradients at
every real query of a packed row and a left-padded row, grouped-query heads."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workflow_r1.model import ops, qwen2, splash
from workflow_r1.model.config import PRESETS
from workflow_r1.policy import ModelConfig

B, T, K, G, DH = 2, 200, 2, 2, 64  # T pads to 256


def _inputs():
    rng = np.random.default_rng(0)
    qg = jnp.asarray(rng.normal(size=(B, T, K, G, DH)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, DH)), jnp.float32) for _ in range(2))
    # Row 0 packs three episodes (the third crosses the kernel's block edge at 128) and ends in
    # padding; row 1 is one episode after 5 padding tokens.
    seg = np.zeros((B, T), np.int32)
    seg[0, :60], seg[0, 60:110], seg[0, 110:190] = 1, 2, 3
    seg[1, 5:] = 1
    return qg, k, v, jnp.asarray(seg)


def _loss(impl, qg, k, v, seg):
    slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out = ops.attend(qg, k, v, seg, slots, jnp.float32, None, None, impl=impl, interpret=True)
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))  # every output its own weight
    real = (seg > 0)[:, :, None, None, None]
    return (jnp.where(real, out, 0) * w).sum(), out


def test_splash_kernel_in_interpret_mode_equals_jnp_attention(monkeypatch):
    monkeypatch.setattr(splash, "BLOCKS", (128,))  # two blocks of queries and keys, not one of 256
    qg, k, v, seg = _inputs()
    grads = {}
    for impl in ("jnp", "splash"):
        fn = jax.jit(jax.value_and_grad(lambda *a: _loss(impl, *a, seg), argnums=(0, 1, 2), has_aux=True))
        grads[impl] = fn(qg, k, v)
    (_, out_j), g_j = grads["jnp"]
    (_, out_s), g_s = grads["splash"]
    real = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(out_s)[real], np.asarray(out_j)[real], atol=2e-5)
    for a, ref in zip(g_s, g_j):  # padding queries' outputs carry no loss, so every gradient is real
        np.testing.assert_allclose(a, ref, atol=2e-5)


def test_attention_config_fails_closed_off_tpu():
    with pytest.raises(ValueError, match="use one of"):
        ModelConfig(attention="flash")
    assert splash.resolve("auto") == ("splash" if jax.default_backend() == "tpu" else "jnp")
    if jax.default_backend() == "tpu":
        return
    model = qwen2.use_attention(nnx.eval_shape(lambda: qwen2.create(PRESETS["tiny-chat"])), "splash")
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="runs on TPU only"):  # traced only: nothing compiles
        jax.eval_shape(lambda st: nnx.merge(graphdef, st)(tokens, jnp.broadcast_to(jnp.arange(8), (1, 8))), state)
