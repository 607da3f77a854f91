"""The sampler's weights (sampler/weights.py): bf16 copies, the tensor-parallel layout over a host's
chips, and the per-step sync from the trainer's FSDP fp32 parameters as one compiled program.

On 8 simulated CPU devices (tests/conftest.py): the training state FSDP over all 8, the sampler
tensor-parallel over all 8 (a host's chips, `rollout.tensor_parallel=-1`). References: the
unsharded sampler on the fp32 weights, the weights themselves cast with NumPy, and each weight's
logical axes read from the model (which dimensions the tensor axis must split). The collectives'
dtype is checked on the TPU compiler's program (XLA:CPU carries bf16 collectives in fp32)."""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from tests.test_aot import REPO, libtpu_env, python_with_libtpu  # noqa: F401  (the fixture)
from workflow_r1 import configlib, run_config, sharding
from workflow_r1.model import lora, qwen2
from workflow_r1.model.config import get_preset
from workflow_r1.sampler import Sampler, SamplerError, weights

# 16 query heads over 8 KV heads, MLP 128, vocabulary 256: each divides by a tensor axis of 8.
CFG = dataclasses.replace(get_preset("tiny"), num_heads=16, num_kv_heads=8, head_dim=8)
TP_AXES = {"heads", "kv_heads", "mlp", "vocab"}


def _meshes():
    """(training mesh: FSDP over 8, sampler mesh: tensor over 8), as the trainer builds them."""
    return sharding.make_meshes(sharding.MeshConfig(data=1, fsdp=-1), sampler_tensor=-1)


def _trained(model, mesh):
    """`model`'s state placed on the training mesh (FSDP), as the train state holds it."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))


def _model(scan: bool, rank: int = 0):
    model = qwen2.create(CFG, seed=3, dtype=jnp.bfloat16, param_dtype=jnp.float32, scan_layers=scan)
    if rank:
        lora.attach(model, rank, 8.0, tuple(lora.TARGETS), seed=1)
        for _, _, ad in lora.adapters(model):  # B starts at zero: make the merge change the kernels
            ad.b.set_value(jax.random.normal(jax.random.key(7), ad.b.get_value().shape) * 0.05)
    return model


def _expected_shard(var: nnx.Variable, tp: int) -> tuple[int, ...]:
    """A weight's shape on one device of the sampler mesh: its first dimension named a tensor-parallel
    axis, divided by tp (the rest whole)."""
    shape, axes = list(var.get_value().shape), var.get_metadata().get("axes") or ()
    for i, name in enumerate(axes):
        if name in TP_AXES and shape[i] % tp == 0:
            shape[i] //= tp
            break
    return tuple(shape)


def test_the_tensor_parallel_sampler_equals_the_unsharded_one():
    train, tp_mesh = _meshes()
    assert dict(tp_mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 8} and dict(train.shape)["fsdp"] == 8
    model = _model(scan=True)
    s = Sampler(_trained(model, train), cache_size=64, mesh=tp_mesh, weights_dtype="bfloat16")
    ref = Sampler(model, cache_size=64, impl="model")  # one device, the fp32 weights
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 11], [11, 12], [40, 41, 42]]
    a, b = s.generate(prompts, 12), ref.generate(prompts, 12)
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    diff = max(float(np.abs(x - y).max()) for x, y in zip(a.logprobs, b.logprobs))
    assert diff <= 2 ** -6, diff  # bf16's rounding of a log-prob of magnitude ~5
    # Every weight the sampler reads is bf16, split over the tensor axis by its heads / MLP / vocabulary.
    _, want = nnx.split(model)
    for got, var in zip(jax.tree.leaves(s._weights), jax.tree.leaves(want, is_leaf=lambda v: isinstance(v, nnx.Variable))):
        assert got.dtype == jnp.bfloat16 and got.addressable_shards[0].data.shape == _expected_shard(var, 8)


@pytest.mark.parametrize("scan, rank", [(True, 0), (False, 4)])
def test_the_sync_is_one_program_that_delivers_each_device_its_bf16_shards(scan, rank):
    train, tp_mesh = _meshes()
    model = _model(scan, rank)
    graphdef, state = nnx.split(_trained(model, train))
    fn, out_shardings = weights.program(graphdef, state, "bfloat16", tp_mesh)
    compiled = fn.lower(state).compile()
    # The reference: the merged weights (LoRA: W + scale A B, lora.merge) cast with NumPy, and each
    # one's shard read off its logical axes.
    merged = nnx.split(lora.merge(model))[1]
    variables = jax.tree.leaves(merged, is_leaf=lambda v: isinstance(v, nnx.Variable))
    need = sum(math.prod(_expected_shard(v, 8)) * 2 for v in variables)
    whole = sum(v.get_value().size * 2 for v in variables)
    # Each device's outputs: its bf16 shards, plus the output tuple's table of 8-byte pointers.
    assert need <= compiled.memory_analysis().output_size_in_bytes <= need + 8 * len(variables) and need < whole / 4
    out = compiled(state)
    for got, var in zip(jax.tree.leaves(out), variables):
        assert got.dtype == jnp.bfloat16 and got.sharding.mesh.devices.tolist() == tp_mesh.devices.tolist()
        assert got.addressable_shards[0].data.shape == _expected_shard(var, 8)
        want = np.asarray(var.get_value(), np.float32).astype(ml_dtypes.bfloat16)
        if rank:  # the fp32 sum W + scale A B is computed on the FSDP shards: within one bf16 step
            np.testing.assert_allclose(np.asarray(got, np.float32), want.astype(np.float32), rtol=2 ** -7, atol=0)
        else:  # a cast alone: bit-exact
            np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))


def test_the_sync_takes_a_training_mesh_that_lists_the_devices_in_another_order():
    """On a TPU slice mesh_utils orders the training mesh's chips for its collectives (0, 4, 2, 6, 1, 5,
    3, 7 for FSDP over a v5p-16) while the sampler's mesh lists them in its own order; one program
    takes one device order, so the sync lists its outputs in the inputs' order (the same placement)
    and hands the sampler arrays on its own mesh, each device's bf16 shard, no copy."""
    devices = jax.devices()
    train = jax.sharding.Mesh(np.asarray([devices[i] for i in (0, 4, 2, 6, 1, 5, 3, 7)], dtype=object)
                              .reshape(1, 8, 1), sharding.MESH_AXES)
    tp_mesh = sharding.tensor_mesh(devices, 8)
    model = _model(scan=True)
    out = weights.Sync("bfloat16", tp_mesh)(_trained(model, train))
    want = nnx.split(model)[1]
    for got, var, sh in zip(jax.tree.leaves(out), jax.tree.leaves(want, is_leaf=lambda v: isinstance(v, nnx.Variable)),
                            jax.tree.leaves(sharding.state_shardings(out, tp_mesh))):
        assert got.sharding == sh and got.addressable_shards[0].data.shape == _expected_shard(var, 8)
        cast = np.asarray(var.get_value(), np.float32).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), cast.view(np.uint16))


def test_the_sync_moves_bf16_on_a_tpu_host(libtpu_env):  # noqa: F811
    """Compiled by the TPU compiler for a v5p-8 host (4 chips): training FSDP over 4, sampler tensor
    over 4: every collective of the sync carries bf16. (Its output bytes are checked on CPU above: the
    TPU's tiled layouts pad these tiny shapes.)"""
    code = ("import jax, jax.numpy as jnp, dataclasses\nfrom flax import nnx\n"
            "from workflow_r1 import aot, sharding\nfrom workflow_r1.model import qwen2\n"
            "from workflow_r1.model.config import get_preset\nfrom workflow_r1.sampler import weights\n"
            "devices = aot.tpu_devices(aot.topology_string('v5p-8')[1])\n"
            "train, tp = sharding.make_meshes(sharding.MeshConfig(data=1, fsdp=-1), devices=devices, sampler_tensor=-1)\n"
            "cfg = dataclasses.replace(get_preset('tiny'), num_heads=16, num_kv_heads=8, head_dim=8)\n"
            "g, st = nnx.split(nnx.eval_shape(lambda: qwen2.create(cfg, dtype=jnp.bfloat16, scan_layers=True)))\n"
            "st = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), st,\n"
            "                  sharding.state_shardings(st, train))\n"
            "c = weights.program(g, st, 'bfloat16', tp)[0].lower(st).compile()\n"
            "print('MESH', dict(tp.shape))\n"
            "print(c.as_text())\n")
    p = python_with_libtpu(libtpu_env, code)
    assert p.returncode == 0, p.stderr[-3000:]
    collectives = [ln for ln in p.stdout.splitlines()
                   if re.search(r"= \S+ (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)", ln)]
    assert collectives and all(re.search(r"= \(?bf16\[", ln) for ln in collectives), collectives
    assert "MESH {'data': 1, 'fsdp': 1, 'tensor': 4}" in p.stdout


def test_the_keys_are_checked_and_the_presets_resolve():
    def run(preset, *overrides):
        needs = (["executor.url=http://executor:8000", "data.train_files=train.jsonl"] if preset == "paper"
                 else ["mesh.tensor=2"])  # 4 rows over 8 devices: 4 on data
        return run_config.Run.from_config(configlib.load(f"{REPO}/configs/gsspo.py:{preset}", [*needs, *overrides]))

    assert [(run(p).rollout.weights_dtype, run(p).rollout.tensor_parallel) for p in ("paper", "local", "tiny")] == [
        ("bfloat16", -1), ("bfloat16", 0), ("", 0)]
    for override, line in (("rollout.weights_dtype=float16", "rollout.weights_dtype must be one of ['', 'bfloat16', "
                                                             "'float32'] ('': the parameters' own), got 'float16'"),
                           ("rollout.tensor_parallel=-2", "rollout.tensor_parallel must be in [-1, 65536]")):
        with pytest.raises(configlib.ConfigError, match=re.escape(line)):
            run("tiny", override)
    with pytest.raises(ValueError, match=r"^rollout.tensor_parallel=3 does not divide a host's 8 devices; "):
        sharding.make_meshes(sharding.MeshConfig(), sampler_tensor=3)



def test_a_tensor_parallel_sampler_on_a_one_device_host_is_refused(monkeypatch):
    """On one device there is no mesh: rollout.tensor_parallel=2 would run unsplit without a word."""
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    for tensor in (2, 3):
        with pytest.raises(ValueError, match=rf"^rollout.tensor_parallel={tensor} needs that many devices on a "
                                             r"host, and this one has 1; use 0 .* or -1 .*$"):
            sharding.make_meshes(sharding.MeshConfig(), sampler_tensor=tensor)
    assert sharding.make_meshes(sharding.MeshConfig(), sampler_tensor=-1) == (None, None)
    assert sharding.make_meshes(sharding.MeshConfig(), sampler_tensor=0) == (None, None)
    # The fused CPU sampler holds its weights in its compute dtype: another weights dtype is refused.
    model = qwen2.create(get_preset("tiny"), seed=0)
    with pytest.raises(SamplerError, match=r"^rollout.weights_dtype=bfloat16 differs from the fused CPU path's "
                                           r"compute dtype float32, .* set it to '' or float32$"):
        Sampler(model, impl="fused_cpu", weights_dtype="bfloat16")
    assert Sampler(model, impl="fused_cpu", dtype="bfloat16", weights_dtype="bfloat16").impl == "fused_cpu"
