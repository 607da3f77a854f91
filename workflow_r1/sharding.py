"""Logical axis names -> mesh axes, in one place.

Every parameter and every constrained activation names its dimensions with logical axes
("batch", "embed", "heads", ...). `LOGICAL_RULES` maps each to mesh axes of a (data, fsdp, tensor)
mesh. Changing the parallelism strategy means editing this table, not the model.

A dimension that the mapped mesh axes do not divide is replicated instead (e.g. 2 KV heads on a
tensor axis of 4), so any model runs on any mesh.

Multi-host start-up (`maybe_initialize_distributed`) lives here too: it decides how many devices
the mesh spans, and must run before anything touches a JAX backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "length": None,
    "cache_length": None,
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "lora_rank": None,  # LoRA adapters' rank dimension (model/lora.py): a few entries, never split
}

_state = threading.local()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The devices' layout (the `mesh` config section): sizes of the (data, fsdp, tensor) axes of the
    training mesh; one may be -1 (the devices left). `tensor` is also the tensor-parallel size of
    each host's sampler when a run spans several hosts (`make_meshes`)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"mesh sizes must be >= 1 with at most one -1 (the devices left), got data={self.data} "
                             f"fsdp={self.fsdp} tensor={self.tensor}")


def make_meshes(cfg: MeshConfig, devices: Sequence[Any] | None = None,
                host_devices: Sequence[Any] | None = None,
                sampler_tensor: int = 0) -> tuple[Mesh | None, Mesh | None]:
    """(training mesh, rollout mesh) of a run, the one place both are built.

    devices: the training mesh's (default: every device of every host; with one device there is
    no mesh: (None, None)). sampler_tensor (`rollout.tensor_parallel`): 0 = the rollout mesh is
    the training mesh when the devices belong to one host; on several, each host samples its own
    rows on its own devices (`host_devices`, default this process's) with tensor parallelism
    `cfg.tensor` reduced to what tiles them (`host_mesh`). N > 0 (-1: all of a host's devices):
    each host samples on its own devices, N of them per tensor-parallel group (`tensor_mesh`),
    whatever the training mesh.
    """
    if devices is None and jax.device_count() == 1:
        if sampler_tensor > 1:  # not silently one device: the run would not be the one configured
            raise ValueError(f"rollout.tensor_parallel={sampler_tensor} needs that many devices on a host, and this "
                             "one has 1; use 0 (the training mesh) or -1 (all of a host's devices)")
        return None, None
    devices = list(jax.devices() if devices is None else devices)
    train = make_mesh(cfg.data, cfg.fsdp, cfg.tensor, devices=devices)
    if sampler_tensor:
        if host_devices is None:
            single = len({d.process_index for d in devices}) == 1
            host_devices = devices if single else [d for d in devices if d.process_index == jax.process_index()]
        host_devices = list(host_devices)
        return train, tensor_mesh(host_devices, len(host_devices) if sampler_tensor == -1 else sampler_tensor)
    if len({d.process_index for d in devices}) == 1:
        return train, train
    if host_devices is None:
        return train, host_mesh(cfg.tensor)
    return train, make_mesh(-1, 1, math.gcd(max(cfg.tensor, 1), len(host_devices)), devices=list(host_devices))


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all). One size may be -1 (= the rest)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not split into mesh data={data} fsdp={fsdp} tensor={tensor}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = {math.prod(sizes)} "
                         f"does not match the {len(devices)} available devices")
    # mesh_utils orders devices so that the tensor axis lands on the fastest interconnect.
    from jax.experimental import mesh_utils
    try:
        arr = mesh_utils.create_device_mesh(sizes, devices=devices)
    except Exception:  # CPU / odd topologies: plain order is fine.
        arr = np.asarray(devices).reshape(sizes)
    return Mesh(arr, MESH_AXES)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None):
    """Makes `mesh` the one that `constrain` uses inside this block (and jax's abstract mesh)."""
    prev = getattr(_state, "mesh", None)
    _state.mesh = mesh
    try:
        if mesh is None:
            yield mesh
        else:
            with jax.set_mesh(mesh):
                yield mesh
    finally:
        _state.mesh = prev


def current_mesh() -> Mesh | None:
    return getattr(_state, "mesh", None)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int] | None = None, mesh: Mesh | None = None) -> P:
    """PartitionSpec for an array whose dimensions carry logical names `axes`.

    With `shape` and `mesh`, a dimension the mesh axes do not divide is replicated, and a mesh axis
    is used at most once per array (first dimension wins).
    """
    used: set[str] = set()
    out = []
    for i, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        if name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no rule in sharding.LOGICAL_RULES")
        rule = LOGICAL_RULES[name]
        mesh_axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
        mesh_axes = tuple(a for a in mesh_axes if a not in used and (mesh is None or a in mesh.shape))
        if mesh is not None:
            mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
        if mesh is not None and shape is not None and mesh_axes:
            # Drop trailing mesh axes until the dimension divides evenly.
            while mesh_axes and shape[i] % math.prod(mesh.shape[a] for a in mesh_axes):
                mesh_axes = mesh_axes[:-1]
        used.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*out)


def named_sharding(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical axes; a no-op when no mesh is active (see `use_mesh`)."""
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(mesh, axes, x.shape))


def state_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    """Maps an nnx State of Params carrying `axes` metadata to a tree of NamedShardings.

    Variables without `axes` (and non-array leaves) are replicated.
    """
    from flax import nnx

    def one(v):
        if isinstance(v, nnx.Variable):
            value = v.get_value() if hasattr(v, "get_value") else v.value
            axes = v.get_metadata().get("axes")
            spec = logical_to_spec(axes, value.shape, mesh) if axes else P()
            return v.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding for a [B, ...] batch array: batch over (data, fsdp), the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), None, mesh))


def host_mesh(tensor: int = 1) -> Mesh:
    """A (data, fsdp=1, tensor) mesh over this process's devices only, e.g. for its sampler.

    tensor: the tensor-parallel size wanted; reduced to the largest divisor of the local device
    count that divides it (a mesh must tile this host's devices).
    """
    local = jax.local_devices()
    return make_mesh(-1, 1, math.gcd(max(tensor, 1), len(local)), devices=local)


def tensor_mesh(devices: Sequence[Any], tensor: int) -> Mesh:
    """A (data, fsdp=1, tensor) mesh over one host's `devices`: groups of `tensor` devices, each a
    tensor-parallel sampler of its own rows (the sampler's weights: sampler/weights.py)."""
    devices = list(devices)
    if tensor < 1 or len(devices) % tensor:
        raise ValueError(f"rollout.tensor_parallel={tensor} does not divide a host's {len(devices)} devices; "
                         "use a divisor, or -1 (all of them)")
    return make_mesh(-1, 1, tensor, devices=devices)


def on_devices(tree: Any, mesh: Mesh) -> bool:
    """True when every array of `tree` lives on exactly the devices of `mesh`."""
    want = set(mesh.devices.flat)
    return all(set(x.sharding.device_set) == want for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


@functools.lru_cache(maxsize=8)
def _replicate(shardings: tuple[NamedSharding, ...]) -> Any:
    """One compiled program (reused every step) that all-gathers a list of arrays onto `shardings`."""
    return jax.jit(lambda xs: xs, out_shardings=list(shardings))


def copy_to_mesh(tree: Any, shardings: Any) -> Any:
    """`tree` placed on `shardings` (a matching tree of NamedShardings, e.g. over `host_mesh()`).

    Arrays that span other processes (a multi-host training state) are first gathered: every
    process must make this call, and each of its devices briefly holds a full copy of such arrays.
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    spanning = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if spanning:
        out = _replicate(tuple(NamedSharding(leaves[i].sharding.mesh, P()) for i in spanning))(
            [leaves[i] for i in spanning])
        for i, x in zip(spanning, out):
            leaves[i] = x.addressable_data(0)
    return treedef.unflatten([jax.device_put(x, sh) if isinstance(x, jax.Array) else x
                              for x, sh in zip(leaves, targets)])


def allgather_objects(value: Any) -> list[Any]:
    """Every process's `value` (any picklable object), in process order; [value] on one process.

    Every process must call it (a collective), e.g. to report metrics of all hosts' episodes or to
    merge the evaluation episodes of every host's slice. Pickle is fine here: the processes of one
    job run the same code and trust each other.
    """
    if jax.process_count() == 1:
        return [value]
    import pickle

    from jax.experimental import multihost_utils
    data = np.frombuffer(pickle.dumps(value), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array(data.size, np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [pickle.loads(row[:n].tobytes()) for row, n in zip(rows, sizes)]


_TRUE = ("1", "true", "yes", "on")


def _use_gloo_on_cpu() -> None:
    """CPU devices of several processes reduce over gloo (without it, a cross-process collective on
    the CPU backend fails). TPU / GPU collectives are unaffected. Must run before the backend starts."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as e:  # an unknown value: a jaxlib built without gloo
        raise RuntimeError(f"this jaxlib cannot run CPU collectives over gloo ({e}); multi-process runs on CPU "
                           "need a jaxlib with gloo (the Linux wheels on PyPI have it)") from None


def maybe_initialize_distributed(enabled: bool | None = None) -> bool:
    """Calls `jax.distributed.initialize()` for multi-host runs; a no-op on a single machine.

    Args:
      enabled: True/False forces the decision. None (default) initialises only when the environment
        says this is a multi-process job: WORKFLOW_R1_DISTRIBUTED=1, or JAX_COORDINATOR_ADDRESS set.
        On a TPU pod slice or under SLURM, set WORKFLOW_R1_DISTRIBUTED=1 and JAX detects the rest; elsewhere set
        JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID
        (what `python -m workflow_r1.multiprocess` sets for N processes on one machine).

    Must run before anything touches a JAX backend. Returns True when JAX is (now) distributed.
    """
    if enabled is None:
        enabled = (os.environ.get("WORKFLOW_R1_DISTRIBUTED", "").lower() in _TRUE
                   or bool(os.environ.get("JAX_COORDINATOR_ADDRESS")))
    if not enabled:
        return False
    if jax.distributed.is_initialized():
        return True
    _use_gloo_on_cpu()
    kwargs: dict[str, Any] = {}
    # JAX itself reads JAX_COORDINATOR_ADDRESS, but not the process count / id.
    for env, key in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
        if os.environ.get(env):
            kwargs[key] = int(os.environ[env])
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed initialised: process %d of %d, %d devices (%d local)", jax.process_index(),
             jax.process_count(), jax.device_count(), jax.local_device_count())
    return True
