"""LoRA adapters on the Qwen2 projections: W x + (alpha / r) · (x A) B, with A, B `nnx.LoRAParam`s.

An adapter on a projection whose kernel W is used as `einsum("X,W->Y", x, W)` splits W's indices
into its input part `in` (contracted with x) and its output part `out`:

    A [*in, r]   random, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as PEFT      axes (*W's in axes, "lora_rank")
    B [r, *out]  zeros, so a fresh adapter leaves the model exactly as it was   ("lora_rank", *W's out axes)
    delta = scale · einsum(einsum(x, A), B),  scale = alpha / r

Both products are `mixed.einsum` in the layer's compute dtype (bf16 operands, fp32 accumulation,
the same custom VJP as the base projection), so a bf16 model trains its adapters on any backend.
The adapters are kept in fp32 whatever the base's parameter dtype. In a model with scanned layers
(`scan_layers`) each adapter carries the leading [L] axis ("layers") like every other layer param.

Adapters are `nnx.LoRAParam` (a subclass of `nnx.Param`), so `nnx.split(model, nnx.LoRAParam, ...)`
separates what trains from the frozen base (`trainable`). `merge` folds them into the kernels
(W + scale · A B, computed in fp32) and returns a model without adapters: the sampler's and the HF
export's weights.

Targets (`TARGETS`): q, k, v, o (attention), gate, up, down (MLP).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from workflow_r1.model import mixed

Array = jax.Array

# target -> (the layer's submodule, the kernel's einsum spec "x,W->y" as the layer computes it)
TARGETS: dict[str, tuple[str, str]] = {
    "q": ("attn", "btd,dhk->bthk"), "k": ("attn", "btd,dhk->bthk"), "v": ("attn", "btd,dhk->bthk"),
    "o": ("attn", "bthk,hkd->btd"),
    "gate": ("mlp", "btd,dm->btm"), "up": ("mlp", "btd,dm->btm"), "down": ("mlp", "btm,md->btd"),
}
RANK_AXIS = "lora_rank"  # the adapters' rank dimension (sharding.LOGICAL_RULES: replicated)


def _split_spec(spec: str) -> tuple[str, str, str, str, str]:
    """"X,W->Y" -> (X, W, Y, in, out): W's indices contracted with x, and those kept in y."""
    ins, y = spec.split("->")
    x, w = ins.split(",")
    return x, w, y, "".join(c for c in w if c in x), "".join(c for c in w if c in y)


class Adapter(nnx.Module):
    """The low-rank update of one projection (or of L stacked ones): `__call__(x) -> delta`, in y's layout.

    spec: the projection's einsum "X,W->Y"; kernel_shape / kernel_axes: W's shape and logical axes
    (without the layer axis); layers: L for a stacked (scanned) layer, None for one layer.
    """

    def __init__(self, spec: str, kernel_shape: Sequence[int], kernel_axes: Sequence[str | None], rank: int,
                 alpha: float, key: Array, layers: int | None = None):
        x, w, y, i, o = _split_spec(spec)
        size = dict(zip(w, kernel_shape))
        axis = dict(zip(w, kernel_axes))
        lead, lead_axes = ((layers,), ("layers",)) if layers else ((), ())
        bound = 1.0 / math.sqrt(math.prod(size[c] for c in i))
        a = jax.random.uniform(key, lead + tuple(size[c] for c in i) + (rank,), jnp.float32, -bound, bound)
        self.a = nnx.LoRAParam(a, axes=lead_axes + tuple(axis[c] for c in i) + (RANK_AXIS,))
        self.b = nnx.LoRAParam(jnp.zeros(lead + (rank,) + tuple(size[c] for c in o), jnp.float32),
                               axes=lead_axes + (RANK_AXIS,) + tuple(axis[c] for c in o))
        self.scale = float(alpha) / rank
        lx = "".join(c for c in x if c not in i)  # x's indices that reach y (batch, length)
        self.spec_a, self.spec_b = f"{x},{i}r->{lx}r", f"{lx}r,r{o}->{y}"
        self.spec_merge = f"{i}r,r{o}->{w}"

    def __call__(self, x: Array, dtype: Any) -> Array:
        """x (the projection's input) -> scale · (x A) B in `dtype`, shaped like the projection's output."""
        xa = mixed.einsum(self.spec_a, x, self.a[...], dtype)
        return mixed.einsum(self.spec_b, xa, self.b[...], dtype) * jnp.asarray(self.scale, dtype)

    def merged(self, kernel: Array, dtype: Any = None) -> Array:
        """kernel + scale · A B, computed in fp32, in `dtype` (default: the kernel's). A stacked
        kernel [L, ...] takes a stacked adapter."""
        spec = self.spec_merge
        if self.a.get_value().ndim > len(spec.split(",")[0]):
            ins, out = spec.split("->")
            spec = ",".join("l" + s for s in ins.split(",")) + "->l" + out
        delta = jnp.einsum(spec, self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
        return (kernel.astype(jnp.float32) + self.scale * delta).astype(dtype or kernel.dtype)


def _layers(model: Any) -> list[Any]:
    return [model.layers] if getattr(model, "scan_layers", False) else list(model.layers)


def adapters(model: Any) -> Iterator[tuple[Any, str, Adapter]]:
    """(owner module, target, adapter) for every adapter of `model`, in layer order."""
    for layer in _layers(model):
        for target, (sub, _) in TARGETS.items():
            owner = getattr(layer, sub)
            adapter = getattr(owner, f"{target}_lora", None)
            if adapter is not None:
                yield owner, target, adapter


def has_adapters(model: Any) -> bool:
    return next(adapters(model), None) is not None


def trainable(model: Any) -> Any:
    """The nnx filter of what trains: the adapters when `model` has any, else every parameter."""
    return nnx.LoRAParam if has_adapters(model) else nnx.Param


def attach(model: Any, rank: int, alpha: float, targets: Sequence[str], seed: int = 0) -> Any:
    """Adds an adapter of rank `rank` to each projection named in `targets` of every layer (in place;
    returns `model`). B starts at zero: the model computes exactly what it did."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"model.lora_targets={tuple(targets)!r}: use a non-empty subset of {tuple(TARGETS)}")
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}; model.lora_rank=0 trains every parameter")
    if has_adapters(model):
        raise ValueError("the model already has LoRA adapters")
    stacked = getattr(model, "scan_layers", False)
    key = jax.random.key(seed)
    for li, layer in enumerate(_layers(model)):
        for ti, (target, (sub, spec)) in enumerate(TARGETS.items()):
            if target not in targets:
                continue
            owner = getattr(layer, sub)
            kernel = getattr(owner, f"{target}_kernel")
            shape = tuple(kernel.get_value().shape)
            axes = tuple(kernel.get_metadata().get("axes"))
            if stacked:
                layers, shape, axes = shape[0], shape[1:], axes[1:]
            else:
                layers = None
            adapter = Adapter(spec, shape, axes, rank, alpha, jax.random.fold_in(key, li * len(TARGETS) + ti),
                              layers=layers)
            setattr(owner, f"{target}_lora", nnx.data(adapter))
    return model


def _merged_kernels_jit(found: tuple[Adapter, ...], dtype: Any, kernels: list[Array]) -> list[Array]:
    """kernel + scale · A B for each (adapter, kernel), in one jitted program per structure."""
    graphdef, factors = nnx.split(found)
    return _merged_kernels(graphdef, dtype, kernels, factors)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _merged_kernels(graphdef: Any, dtype: Any, kernels: list[Array], factors: Any) -> list[Array]:
    found = nnx.merge(graphdef, factors)
    return [ad.merged(k, dtype) for ad, k in zip(found, kernels)]


def merge(model: Any, dtype: Any = None) -> Any:
    """A new model without adapters whose kernels are W + scale · A B (fp32 sums, stored in `dtype`,
    default each kernel's own); every other parameter is shared with `model`, which is unchanged.
    One jitted program per model structure. A model without adapters is returned as it is."""
    if not has_adapters(model):
        return model
    out = nnx.merge(*nnx.split(model))  # a second module tree over the same arrays
    found = list(adapters(out))
    kernels = [getattr(owner, f"{t}_kernel") for owner, t, _ in found]
    merged = _merged_kernels_jit(tuple(ad for _, _, ad in found), None if dtype is None else jnp.dtype(dtype),
                                 [k.get_value() for k in kernels])
    for (owner, target, _), kernel, value in zip(found, kernels, merged):
        # A new Variable: the original model's kernel object is never written.
        setattr(owner, f"{target}_kernel", kernel.replace(value))
        delattr(owner, f"{target}_lora")
    return out


__all__ = ["TARGETS", "RANK_AXIS", "Adapter", "adapters", "has_adapters", "trainable", "attach", "merge"]
