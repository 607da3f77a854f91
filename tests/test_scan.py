"""Scanned layers (`scan_layers=True`): the same model as the unrolled one for every consumer.

The forward against the HF torch model (the independent reference); logits, gradients, the KV
cache path and the train step against the unrolled model, which test_model.py checks against HF
in turn; the sharding table, HF checkpoint load and export, the sampler's two paths, orbax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.hf_reference import hf_logits, left_padded, save_random_hf
from workflow_r1 import checkpointing as ckpt
from workflow_r1 import sharding
from workflow_r1.model import checkpoint, qwen2
from workflow_r1.model.config import get_preset
from workflow_r1 import trajectory
from workflow_r1.rl import train_state, train_step as ts
from workflow_r1.sampler import Sampler

CFG = get_preset("tiny")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hf_scan")
    return save_random_hf(CFG, d, seed=3), d


def _rows(seed=0, lengths=(9, 5, 7, 8)):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(2, CFG.vocab_size, n)) for n in lengths]


def _stacked(unrolled_layers_state, name):
    return np.stack([np.asarray(unrolled_layers_state[i][name[0]][name[1]][...]) for i in range(CFG.num_layers)])


def test_loaded_stacked_params_are_the_hf_layers_and_logits_match_hf(hf_dir):
    hf, d = hf_dir
    flat = checkpoint.load(d)
    scanned = checkpoint.load(d, scan_layers=True)
    assert scanned.layers.attn.q_kernel[...].shape == (CFG.num_layers,) + flat.layers[0].attn.q_kernel[...].shape
    for name in (("attn", "q_kernel"), ("attn", "o_kernel"), ("mlp", "down_kernel"), ("input_norm", "scale")):
        got = np.asarray(getattr(getattr(scanned.layers, name[0]), name[1])[...])
        np.testing.assert_array_equal(got, _stacked(nnx.state(flat.layers), name))
    tokens, mask, pos = left_padded(_rows(), CFG.pad_token_id)
    ref = hf_logits(hf, tokens, mask, pos)
    ours, _ = scanned(jnp.asarray(tokens), jnp.asarray(pos), input_mask=jnp.asarray(mask))
    diff = np.abs(np.asarray(ours) - ref)[mask.astype(bool)]
    assert diff.max() < 1e-4, diff.max()


@pytest.mark.parametrize("remat", [False, True])
def test_logits_and_gradients_equal_the_unrolled_model_fp32(remat):
    flat = qwen2.create(CFG, seed=1, remat=remat)
    scanned = qwen2.create(CFG, seed=1, remat=remat, scan_layers=True)  # same init, stacked
    tokens, mask, pos = (jnp.asarray(a) for a in left_padded(_rows(2), CFG.pad_token_id))
    target = jax.random.randint(jax.random.key(0), tokens.shape, 0, CFG.vocab_size)

    def loss(m):
        logits, _ = m(tokens, pos, input_mask=mask)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits), target[..., None], axis=-1)[..., 0]
        return jnp.sum(lp * mask), logits

    grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (la, za), ga = grad(flat)
    (lb, zb), gb = grad(scanned)
    np.testing.assert_allclose(np.asarray(zb), np.asarray(za), rtol=0, atol=2e-6)
    np.testing.assert_allclose(float(lb), float(la), rtol=1e-6)
    flat_layers = nnx.state(ga.layers)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(gb.layers)):
        keys = [p.key for p in path if hasattr(p, "key")]
        want = np.stack([np.asarray(_get(flat_layers[i], keys)) for i in range(CFG.num_layers)])
        np.testing.assert_allclose(np.asarray(g), want, rtol=0, atol=1e-6 * max(1.0, np.abs(want).max()))
    want = np.asarray(ga.embed[...])
    np.testing.assert_allclose(np.asarray(gb.embed[...]), want, rtol=0, atol=1e-6 * np.abs(want).max())


def _get(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree[...] if hasattr(tree, "get_value") else tree


def test_bf16_remat_path_tracks_the_unrolled_model():
    """bf16 compute through mixed.py's custom VJPs, under scan and remat: the same products."""
    flat = qwen2.create(CFG, seed=2, dtype=jnp.bfloat16, remat=True)
    scanned = qwen2.create(CFG, seed=2, dtype=jnp.bfloat16, remat=True, scan_layers=True)
    tokens, mask, pos = (jnp.asarray(a) for a in left_padded(_rows(4), CFG.pad_token_id))

    def loss(m):
        return jnp.sum(m(tokens, pos, input_mask=mask)[0][..., :8] * mask[..., None])

    grad = nnx.jit(nnx.grad(loss))
    ga, gb = grad(flat), grad(scanned)
    want = np.stack([np.asarray(ga.layers[i].mlp.down_kernel[...]) for i in range(CFG.num_layers)])
    got = np.asarray(gb.layers.mlp.down_kernel[...])
    assert got.dtype == np.float32  # fp32 master weights get fp32 gradients
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * np.abs(want).max())


def test_cache_prefill_and_decode_equal_the_unrolled_model():
    flat = qwen2.create(CFG, seed=4)
    scanned = qwen2.create(CFG, seed=4, scan_layers=True)
    tokens, mask, pos = (jnp.asarray(a) for a in left_padded(_rows(6), CFG.pad_token_id))
    ca, cb = flat.init_cache(4, 16), scanned.init_cache(4, 16)
    assert cb.stacked and cb.k.shape == (CFG.num_layers, 4, 16, CFG.num_kv_heads, CFG.head_dim)
    za, ca = flat(tokens, pos, input_mask=mask, cache=ca)
    zb, cb = scanned(tokens, pos, input_mask=mask, cache=cb)
    np.testing.assert_allclose(np.asarray(zb), np.asarray(za), atol=2e-6)
    np.testing.assert_allclose(np.asarray(cb.k), np.stack([np.asarray(k) for k in ca.k]), atol=1e-6)
    step = jnp.full((4, 1), 7, jnp.int32)
    za, _ = flat(step, pos[:, -1:] + 1, cache=ca)
    zb, _ = scanned(step, pos[:, -1:] + 1, cache=cb)
    np.testing.assert_allclose(np.asarray(zb), np.asarray(za), atol=2e-6)


@pytest.mark.parametrize("impl", ["model", "fused_cpu"])
def test_sampler_generates_what_the_unrolled_model_does(impl):
    flat = qwen2.create(CFG, seed=5)
    scanned = qwen2.create(CFG, seed=5, scan_layers=True)
    prompts = _rows(7, (5, 9, 3))
    kw = dict(temperature=1.0, seed=11)
    a = Sampler(flat, cache_size=48, impl=impl).generate(prompts, 20, **kw)
    b = Sampler(scanned, cache_size=48, impl=impl).generate(prompts, 20, **kw)
    assert a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs):
        np.testing.assert_allclose(y, x, atol=1e-5)


def test_sharding_table_leaves_the_layers_axis_whole():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    scanned = qwen2.abstract(CFG, scan_layers=True)
    specs = sharding.state_shardings(nnx.state(scanned), mesh)
    # q_kernel [L, D, H, Dh]: the unrolled layer's ("fsdp", "tensor", None) behind an unsharded L.
    assert specs["layers"]["attn"]["q_kernel"].get_value().spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor",
                                                                                               None)
    assert specs["layers"]["mlp"]["down_kernel"].get_value().spec == jax.sharding.PartitionSpec(None, "tensor", "fsdp")


def test_hf_export_of_the_scanned_model_equals_the_unrolled_export(hf_dir, tmp_path):
    _, d = hf_dir
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    scanned = checkpoint.load(d, scan_layers=True, mesh=mesh)
    assert scanned.layers.attn.q_kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    a = dict(checkpoint.iter_hf_tensors(checkpoint.load(d)))
    b = dict(checkpoint.iter_hf_tensors(scanned))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    checkpoint.save(scanned, tmp_path / "out")
    back = checkpoint.load(tmp_path / "out")
    np.testing.assert_array_equal(np.asarray(back.layers[1].mlp.up_kernel[...]),
                                  np.asarray(scanned.layers.mlp.up_kernel[...])[1])


def _batch(seed, b=8, t=12):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(2, CFG.vocab_size, (b, t))
    loss_mask = np.zeros((b, t), np.int32)
    loss_mask[:, 4:] = 1
    return trajectory.make_batch(tokens, loss_mask, rng.randn(b).astype(np.float32))


def test_train_step_and_orbax_round_trip_with_scanned_layers(tmp_path):
    """Two mini-batches of two micro-batches, remat: the scanned update is the unrolled one; its
    state saves and restores through orbax."""
    cfg = train_state.TrainConfig(learning_rate=1e-3, num_mini_batches=2, micro_batch_size=2)
    step = ts.make_train_step(cfg, donate=False)
    flat = train_state.create_train_state(qwen2.create(CFG, seed=6, remat=True), cfg)
    scanned = train_state.create_train_state(qwen2.create(CFG, seed=6, remat=True, scan_layers=True), cfg)
    batch = trajectory.shard_batch(_batch(1), None)
    fa, ma = step(flat, batch)
    fb, mb = step(scanned, batch)
    np.testing.assert_allclose(np.asarray(mb["loss"]), np.asarray(ma["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(fb.params["layers"]["attn"]["k_kernel"][...])[1],
                               np.asarray(fa.params["layers"][1]["attn"]["k_kernel"][...]), atol=1e-6)
    with ckpt.Checkpointer(tmp_path, ckpt.CheckpointConfig(async_save=False)) as c:
        c.save(1, fb, {}, force=True)
        restored, _ = c.restore(train_state.create_train_state(qwen2.create(CFG, seed=9, scan_layers=True), cfg))
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(fb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
