"""How a `TrainState` is laid out in a checkpoint: a tree of plain nested dicts with string keys, and
the restore targets that put it back.

The saved tree (`nest(state_items(state))`) is {"params": ..., "opt_state": ..., "step": int32 []},
its keys built from the pytree key paths of the state (`nnx.to_pure_dict` for the model's
`nnx.State`s, field names for optax's named tuples), so the files are readable without our classes.
`named_leaves` lists a tree's arrays by those string paths; `rebuild` / `unflatten_like` put
restored arrays back into the structure of a target (nnx.States, named tuples), never writing into it.

A restore target is the ShapeDtypeStruct of each array with its sharding (`abstract_leaf`; the
default device when it has none); `abstract_train_state` builds a whole `TrainState` of them for a
model and optimizer without allocating anything. checkpointing.py saves and restores these trees
with orbax.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from workflow_r1 import sharding

if TYPE_CHECKING:  # the update is imported only to build an optimizer's restore target
    from workflow_r1.rl.train_state import TrainConfig, TrainState


def _key_name(k: Any) -> str:
    """One pytree key-path entry as a string key ('embed', '0', 'mu', ...)."""
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(k, attr):
            return str(getattr(k, attr))
    raise TypeError(f"cannot name pytree key {k!r}")


def _pure(tree: Any) -> Any:
    """Every nnx.State in `tree` as its pure dict (arrays only, no Variable wrappers)."""
    return jax.tree.map(lambda x: nnx.to_pure_dict(x) if isinstance(x, nnx.State) else x, tree,
                        is_leaf=lambda x: isinstance(x, nnx.State))


def named_leaves(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    """(string key path, leaf) for every array of `tree`, nnx.States taken as pure dicts."""
    flat, _ = jax.tree_util.tree_flatten_with_path(_pure(tree))
    return [(tuple(_key_name(k) for k in path), leaf) for path, leaf in flat]


def nest(items: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """(key path, leaf) items as one tree of nested dicts (what a checkpoint holds)."""
    out: dict[str, Any] = {}
    for path, leaf in items:
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = leaf
    return out


def state_items(state: TrainState) -> list[tuple[tuple[str, ...], Any]]:
    """The saved arrays of a TrainState: params/..., opt_state/..., step."""
    return ([(("params",) + p, x) for p, x in named_leaves(state.params)]
            + [(("opt_state",) + p, x) for p, x in named_leaves(state.opt_state)]
            + [(("step",), state.step)])


def rebuild(prefix: str, tree: Any, restored: dict[str, Any]) -> Any:
    """The arrays of `restored[prefix]` in the structure of `tree` (nnx.States, named tuples)."""
    def lookup(path: tuple[str, ...]) -> Any:
        d = restored
        for k in path:
            d = d[k]
        return d

    pure = _pure(tree)
    leaves = [lookup((prefix,) + p) for p, _ in named_leaves(tree)]
    pure = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pure), leaves)

    def back(t: Any, p: Any) -> Any:
        if not isinstance(t, nnx.State):
            return p
        t = jax.tree.map(lambda x: x, t)  # a copy: never write into the caller's target
        nnx.replace_by_pure_dict(t, p)
        return t

    return jax.tree.map(back, tree, pure, is_leaf=lambda x: isinstance(x, nnx.State))


def unflatten_like(target: TrainState, restored: dict[str, Any]) -> TrainState:
    """Puts the restored nested dict back into the structure of `target` (States, named tuples)."""
    return target.replace(params=rebuild("params", target.params, restored),
                          opt_state=rebuild("opt_state", target.opt_state, restored), step=restored["step"])


def abstract_leaf(x: Any, sh: Any = None) -> jax.ShapeDtypeStruct:
    """The restore target of one leaf: its shape, dtype and sharding (default device if it has none)."""
    sh = sh or getattr(x, "sharding", None) or SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh)


def abstract_train_state(model: nnx.Module, cfg: TrainConfig, mesh: Mesh | None = None) -> TrainState:
    """The `TrainState` that `create_train_state(model, cfg, mesh)` would build, as ShapeDtypeStructs
    with its shardings: a restore target that allocates nothing. `model` may itself be abstract
    (`qwen2.abstract(model_cfg)`), so resuming never materialises a freshly initialised model."""
    from workflow_r1.rl.train_state import create_train_state

    state = jax.eval_shape(lambda m: create_train_state(m, cfg, mesh), model)
    if mesh is None:
        return jax.tree.map(abstract_leaf, state)
    return state.replace(params=jax.tree.map(abstract_leaf, state.params,
                                             sharding.state_shardings(state.params, mesh)),
                         opt_state=jax.tree.map(abstract_leaf, state.opt_state,
                                                sharding.state_shardings(state.opt_state, mesh)),
                         step=abstract_leaf(state.step, NamedSharding(mesh, PartitionSpec())),
                         frozen=None if state.frozen is None else jax.tree.map(
                             abstract_leaf, state.frozen, sharding.state_shardings(state.frozen, mesh)))
