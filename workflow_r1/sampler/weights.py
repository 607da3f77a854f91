"""The sampler's weights: their dtype, their layout over a host's chips, and the per-step sync.

The trainer holds fp32 master weights sharded over every chip (FSDP; LoRA adapters beside a frozen
base); the sampler decodes from its own copy, read in full at every decode step:

- dtype (`rollout.weights_dtype`): a bf16 copy of a model that computes in bf16 holds the numbers
  its forward computes with anyway (every parameter is cast to the compute dtype where it is used:
  `mixed.einsum`, `mixed.add`, `mixed.mul`, the embedding and the head), at half the bytes.
- layout: on a sampler mesh (data, fsdp=1, tensor) over a host's chips (`sharding.make_meshes`,
  `rollout.tensor_parallel`), the logical-axis table puts query and KV heads, the MLP hidden
  dimension and the vocabulary on `tensor` (Megatron's split: each chip holds 1/tp of those
  weights and computes its heads and its slice of the MLP; norm scales stay whole); nothing is
  split over `data`, whose groups each hold a whole copy (none when tp spans the host).
- sync (`Sync`, `program`): one compiled program from the training state's weights to the
  sampler's: the LoRA merge (W + scale A B in fp32, `lora.merge`), the cast and the move to the
  sampler's layout as the program's out_shardings, so each chip receives only its own shards, in
  the sampler's dtype (XLA casts where a weight lives, then moves the bf16 bytes).

On several hosts the training weights span every process while each host samples on its own
chips: the program's outputs live on a mesh over every process's devices whose per-process slices
are the hosts' sampler meshes (`_global_mesh`), and each process keeps its own shards as arrays on
its host's mesh (no copy).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from workflow_r1 import sharding
from workflow_r1.model import lora

DTYPES = ("bfloat16", "float32")


def resolve_dtype(weights_dtype: Any) -> Any:
    """"" / None -> None (the parameters' own dtype); a name in DTYPES (or a dtype) -> that dtype."""
    if weights_dtype in (None, ""):
        return None
    dt = jnp.dtype(weights_dtype)
    if dt.name not in DTYPES:
        raise ValueError(f"rollout.weights_dtype={weights_dtype!r}: use '' (the parameters' own) or one of {DTYPES}")
    return dt


def _split(model_or_state: Any, graphdef: Any) -> tuple[Any, Any]:
    if isinstance(model_or_state, nnx.Module):
        return nnx.split(model_or_state)
    return graphdef, model_or_state


def _sampled(graphdef: Any, state: Any, dtype: Any) -> Any:
    """The sampler's parameters of a model state (LoRA merged, floats in `dtype` unless None)."""
    merged = lora.merge(nnx.merge(graphdef, state), dtype)
    _, params = nnx.split(merged)
    if dtype is None:
        return params
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def abstract_params(graphdef: Any, state: Any, dtype: Any, mesh: Mesh | None) -> Any:
    """The sampler's parameters as ShapeDtypeStructs (on `mesh`'s layout when given), from a model
    state of arrays or ShapeDtypeStructs: what `sync` returns, without computing it."""
    out = jax.eval_shape(functools.partial(_sampled, graphdef, dtype=resolve_dtype(dtype)), state)
    if mesh is None:
        return out
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), out,
                        sharding.state_shardings(out, mesh))


def needed(state: Any, dtype: Any, mesh: Mesh | None) -> bool:
    """False when `state` (arrays, or ShapeDtypeStructs with their shardings) already is the
    sampler's parameters: the right dtype (`dtype`, resolved or not) on `mesh`'s layout. The sampler
    then reads the training arrays themselves, with no copy and no sync. LoRA adapters are not
    looked at here: a model with adapters always needs the merge."""
    dtype = resolve_dtype(dtype)
    leaves = jax.tree.leaves(state)
    if dtype is not None and any(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype for x in leaves):
        return True
    if mesh is None:
        return False
    want = jax.tree.leaves(sharding.state_shardings(state, mesh))
    return not all(isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and getattr(x, "sharding", None) is not None
                   and x.sharding.is_equivalent_to(sh, x.ndim) for x, sh in zip(leaves, want))


def _devices(state: Any) -> set[Any]:
    return {d for x in jax.tree.leaves(state) if getattr(x, "sharding", None) is not None
            for d in x.sharding.device_set}


def _global_mesh(mesh: Mesh, devices: list[Any]) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` of several processes whose slice of each process is
    that process's sampler mesh built as `mesh` was (`sharding.tensor_mesh`), stacked over data."""
    tp = mesh.shape["tensor"]
    blocks = {}
    for p in sorted({d.process_index for d in devices}):
        blocks[p] = sharding.tensor_mesh([d for d in devices if d.process_index == p], tp).devices
    mine = next(iter(mesh.devices.flat)).process_index
    if blocks.get(mine) is None or blocks[mine].tolist() != mesh.devices.tolist():
        raise ValueError("the sampler's mesh is not this host's sharding.tensor_mesh of its devices; build it with "
                         "sharding.make_meshes (every host must lay its devices out alike)")
    return Mesh(np.concatenate(list(blocks.values()), axis=0), sharding.MESH_AXES)


def program(graphdef: Any, state: Any, dtype: Any, mesh: Mesh | None) -> tuple[Any, Any]:
    """(the jitted sync, its out_shardings) for a model state like `state` (arrays or abstract).

    The sync maps that state (the training weights, any sharding, on any devices) to the
    sampler's parameters on `mesh`'s layout (None: no mesh, the default device). When `state`
    spans devices beyond `mesh` (several hosts), the outputs are on `_global_mesh`; see `Sync`.
    """
    dtype = resolve_dtype(dtype)
    out = jax.eval_shape(functools.partial(_sampled, graphdef, dtype=dtype), state)
    if mesh is None:
        return _jit(graphdef, dtype, None), None
    devices = _devices(state)
    if len({d.process_index for d in devices}) > 1:
        mesh = _global_mesh(mesh, sorted(devices, key=lambda d: d.id))
    shardings = sharding.state_shardings(out, mesh)
    return _jit(graphdef, dtype, _in_order(shardings, _device_order(state))), shardings


def _device_order(state: Any) -> tuple[Any, ...] | None:
    """The device list of `state`'s shardings (the training mesh's flat order), None when unsharded."""
    for x in jax.tree.leaves(state):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding):
            return tuple(sh.mesh.devices.flat)
    return None


def _in_order(shardings: Any, order: tuple[Any, ...] | None) -> Any:
    """`shardings` (NamedShardings on one mesh) as shardings listing their devices in `order`, the
    same placement: one compiled program lists one device order, and the training mesh orders a
    slice's chips for its own collectives (mesh_utils: 0, 4, 2, 6, ... on a v5p-16) while the
    sampler's mesh lists a host's (on several hosts, host by host). Unchanged when the orders agree;
    otherwise the logical device ids jax's own device_put gives such a reordering."""
    leaves = jax.tree.leaves(shardings)
    if order is None or not leaves:
        return shardings
    mesh = leaves[0].mesh
    target = tuple(mesh.devices.flat)
    if target == order or set(target) != set(order):
        return shardings
    index = {d: i for i, d in enumerate(order)}
    ids = tuple(index[d] for d in target)  # mesh position i -> the device target[i], listed in `order`
    listed = Mesh(np.asarray(order, dtype=object).reshape(mesh.devices.shape), mesh.axis_names)
    return jax.tree.map(lambda s: NamedSharding(listed, s.spec, memory_kind=s.memory_kind,
                                                _logical_device_ids=ids), shardings)


def _jit(graphdef: Any, dtype: Any, shardings: Any) -> Any:
    # XLA converts each weight where it lives and moves the converted bytes (the TPU compiler's
    # program has only bf16 collectives: tests/test_sampler_weights.py).
    return jax.jit(functools.partial(_sampled, graphdef, dtype=dtype), out_shardings=shardings)


class Sync:
    """The per-step weight sync of one sampler: `__call__(model or state)` -> its parameters.

    graphdef: the training model's graphdef (used when called with a state rather than a model).
    dtype: the sampler's weights dtype (None: the parameters' own). mesh: the sampler's mesh (None:
    the default device). The program is compiled once per model structure and reused every step.
    """

    def __init__(self, dtype: Any, mesh: Mesh | None):
        self.dtype, self.mesh = resolve_dtype(dtype), mesh
        self._programs: dict[Any, tuple[Any, Any]] = {}
        self.seconds = 0.0  # the last call's wall time, outputs ready

    def needed(self, state: Any) -> bool:
        """False when `state` already is the sampler's parameters (`needed`)."""
        return needed(state, self.dtype, self.mesh)

    def __call__(self, model_or_state: Any, graphdef: Any = None) -> Any:
        graphdef, state = _split(model_or_state, graphdef)
        devices = _devices(state)
        if self.mesh is not None and devices != set(self.mesh.devices.flat) and \
                len({d.process_index for d in devices}) == 1:
            # e.g. weights on one device for a sampler on a mesh: placed first, as the program needs.
            state = jax.device_put(state, sharding.state_shardings(state, self.mesh))
        if not lora.has_adapters(nnx.merge(graphdef, state)) and not self.needed(state):
            self.seconds = 0.0
            return state
        key = (graphdef, jax.tree.structure(state),
               tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(state)))
        if key not in self._programs:  # compiled here, so that `seconds` times the sync alone
            fn, shardings = program(graphdef, state, self.dtype, self.mesh)
            self._programs[key] = fn.lower(state).compile(), shardings
        fn, shardings = self._programs[key]
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(state))
        self.seconds = time.perf_counter() - t0
        if shardings is not None and self.mesh is not None:
            out = _local(out, self.mesh)
        return out


def _local(tree: Any, mesh: Mesh) -> Any:
    """The sync's outputs as arrays on this process's sampler `mesh`, its own shards with no copy:
    from a global output (several hosts) or one listed in the training mesh's order (`_in_order`)."""
    def one(x):
        if x.sharding == NamedSharding(mesh, x.sharding.spec, memory_kind=x.sharding.memory_kind):
            return x
        sh = NamedSharding(mesh, x.sharding.spec)
        return jax.make_array_from_single_device_arrays(x.shape, sh, [s.data for s in x.addressable_shards])
    return jax.tree.map(one, tree)


def for_aot(graphdef: Any, state: Any, weights_dtype: Any, mesh: Mesh) -> tuple[Any, Any]:
    """The sampler's side of a step for ahead-of-time compilation (workflow_r1.aot): (sync,
    sampled) for a training model state of ShapeDtypeStructs with their shardings (LoRA adapters
    included) and the sampler's `mesh` (e.g. `sharding.make_meshes(..., sampler_tensor=-1)[1]`):
    `sync` is the per-step program (`sync.lower(state).compile()`), `sampled` the parameters it
    returns, as ShapeDtypeStructs on `mesh`: the weights argument of the prefill and decode."""
    return program(graphdef, state, weights_dtype, mesh)[0], abstract_params(graphdef, state, weights_dtype, mesh)


__all__ = ["DTYPES", "Sync", "abstract_params", "for_aot", "needed", "program", "resolve_dtype"]
