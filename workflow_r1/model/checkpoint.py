"""Hugging Face safetensors checkpoints <-> our NNX Qwen2, one tensor at a time.

Loading builds the model abstractly (no memory), then reads each tensor from disk, reshapes it to
our layout and places it directly onto its target sharding, so a host never holds more than one
tensor beyond the model's own shards. Missing, unexpected and mis-shaped tensors are errors that
name the tensor.

The directory may be a URI (gs://...; `workflow_r1.storage`): its config.json is read in place and
its safetensors files are downloaded to a temporary local directory for the load (safetensors reads
through a memory map; a host reads each byte once), which is deleted when the model is on its devices.

A model with scanned layers (`scan_layers=True`) holds each layer parameter as one [L, ...] array:
HF's `model.layers.{i}.*` tensors are its slices i, read one layer at a time while each device's
shard of the stacked array is assembled (and exported slice by slice).
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from workflow_r1 import sharding, storage
from workflow_r1.model import qwen2
from workflow_r1.model.config import Qwen2Config


class CheckpointError(ValueError):
    """A checkpoint does not match the model (missing/unexpected tensor, wrong shape, bad path)."""


# Each entry: our param path (tuple) <- HF name, with to_ours(hf_array) and to_hf(our_array).
Mapping = tuple[tuple[Any, ...], str, Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]


def _mapping(cfg: Qwen2Config) -> list[Mapping]:
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = (lambda a: a, lambda a: a)
    # HF Linear weights are [out, in]; ours are [in, ...out] with heads split out.
    q_w = (lambda a: a.T.reshape(d, h, dh), lambda a: a.reshape(d, h * dh).T)
    kv_w = (lambda a: a.T.reshape(d, k, dh), lambda a: a.reshape(d, k * dh).T)
    q_b = (lambda a: a.reshape(h, dh), lambda a: a.reshape(h * dh))
    kv_b = (lambda a: a.reshape(k, dh), lambda a: a.reshape(k * dh))
    o_w = (lambda a: a.T.reshape(h, dh, d), lambda a: a.reshape(h * dh, d).T)
    t = (lambda a: a.T, lambda a: a.T)
    out: list[Mapping] = [(("embed",), "model.embed_tokens.weight", *ident),
                          (("final_norm", "scale"), "model.norm.weight", *ident)]
    if not cfg.tie_word_embeddings:
        out.append((("lm_head",), "lm_head.weight", *t))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        L = ("layers", i)
        out += [
            (L + ("input_norm", "scale"), p + "input_layernorm.weight", *ident),
            (L + ("post_attn_norm", "scale"), p + "post_attention_layernorm.weight", *ident),
            (L + ("attn", "q_kernel"), p + "self_attn.q_proj.weight", *q_w),
            (L + ("attn", "q_bias"), p + "self_attn.q_proj.bias", *q_b),
            (L + ("attn", "k_kernel"), p + "self_attn.k_proj.weight", *kv_w),
            (L + ("attn", "k_bias"), p + "self_attn.k_proj.bias", *kv_b),
            (L + ("attn", "v_kernel"), p + "self_attn.v_proj.weight", *kv_w),
            (L + ("attn", "v_bias"), p + "self_attn.v_proj.bias", *kv_b),
            (L + ("attn", "o_kernel"), p + "self_attn.o_proj.weight", *o_w),
            (L + ("mlp", "gate_kernel"), p + "mlp.gate_proj.weight", *t),
            (L + ("mlp", "up_kernel"), p + "mlp.up_proj.weight", *t),
            (L + ("mlp", "down_kernel"), p + "mlp.down_proj.weight", *t),
        ]
    return out


def is_weight_file(name: str) -> bool:
    """Whether `load` reads the file `name` of a checkpoint directory: its tensors and their index."""
    return name.endswith(".safetensors") or name == "model.safetensors.index.json"


def _weight_files(ckpt_dir: pathlib.Path, label: str) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: ckpt_dir / f for name, f in weight_map.items()}
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {label}; expected a Hugging Face checkpoint directory")
    out = {}
    for f in files:
        with safe_open(str(f), "np") as fh:
            for name in fh.keys():
                out[name] = f
    return out


def _get_path(tree: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _locate(path: tuple[Any, ...], stacked: bool) -> tuple[tuple[Any, ...], int | None]:
    """A mapping path -> (the param's path in the model, its layer index in a stacked array or None).

    ("layers", i, ...) is layer i's own param when unrolled, slice i of ("layers", ...) when stacked.
    """
    if stacked and path[0] == "layers":
        return ("layers",) + path[2:], path[1]
    return path, None


def _hf_shape(to_hf: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a parameter of shape `shape` in our layout, traced abstractly (no memory)."""
    return tuple(jax.eval_shape(to_hf, jax.ShapeDtypeStruct(shape, jnp.int8)).shape)


def hf_param_shapes(cfg: Qwen2Config) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a `cfg` checkpoint holds, with its HF shape (lm_head only when untied).

    The same mapping `load` and `save` use, applied to the model's abstract parameter shapes, so
    converters (e.g. `workflow_r1.assets.gguf`) check against exactly what `load` will read.
    """
    state = nnx.state(qwen2.abstract(cfg), nnx.Param)
    return {hf_name: _hf_shape(to_hf, tuple(_get_path(state, path).get_value().shape))
            for path, hf_name, _, to_hf in _mapping(cfg)}


def load(ckpt_dir: str | pathlib.Path, *, cfg: Qwen2Config | None = None, mesh: Mesh | None = None,
         dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, remat: bool = False,
         scan_layers: bool = False) -> qwen2.Qwen2:
    """Loads an HF Qwen2 checkpoint directory into a (sharded, if `mesh`) NNX model.

    Args:
      ckpt_dir: directory with config.json and model.safetensors (or shards + index); a local path or
        a URI (its files downloaded to a temporary directory for the load: the module docstring).
      cfg: architecture; read from config.json when None.
      mesh: place each parameter on its logical-axis sharding over this mesh; default device if None.
      dtype, param_dtype: compute and storage dtypes of the model.
      remat, scan_layers: see `qwen2.Qwen2`.

    Raises CheckpointError (one line naming `ckpt_dir` as given) for a missing or unreadable directory
    and for tensors that do not fit the config.
    """
    label = str(ckpt_dir)
    with storage.reading(label, "checkpoint directory", CheckpointError):
        exists = storage.source(ckpt_dir).is_dir()
    if not exists:
        raise CheckpointError(f"checkpoint directory {label} does not exist "
                              "(for the bundled model run: python -m workflow_r1.assets)")
    cfg = cfg or Qwen2Config.from_hf(storage.source(ckpt_dir))
    with storage.fetched(ckpt_dir, is_weight_file, "checkpoint directory") as local:
        return _load(local, label, cfg, mesh=mesh, dtype=dtype, param_dtype=param_dtype, remat=remat,
                     scan_layers=scan_layers)


def _load(ckpt_dir: pathlib.Path, label: str, cfg: Qwen2Config, *, mesh: Mesh | None, dtype: Any, param_dtype: Any,
          remat: bool, scan_layers: bool) -> qwen2.Qwen2:
    """`load` from the local directory `ckpt_dir` (`label`: the directory as the caller named it)."""
    model = qwen2.abstract(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan_layers)
    graphdef, abstract_state = nnx.split(model)
    files = _weight_files(ckpt_dir, label)
    mapping = _mapping(cfg)
    expected = {hf for _, hf, _, _ in mapping}
    missing = sorted(expected - set(files))
    if missing:
        raise CheckpointError(f"checkpoint {label} is missing tensor {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(n for n in set(files) - expected
                        if not (cfg.tie_word_embeddings and n == "lm_head.weight")
                        and not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise CheckpointError(f"checkpoint {label} has tensor {unexpected[0]} that the model does not use"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    handles: dict[pathlib.Path, Any] = {}

    def read(hf_name: str, to_ours: Callable, to_hf: Callable, shape: tuple[int, ...]) -> np.ndarray:
        """HF tensor `hf_name` in our layout and param_dtype, checked against `shape`."""
        f = files[hf_name]
        if f not in handles:
            handles[f] = safe_open(str(f), "np")
        raw = handles[f].get_tensor(hf_name)
        try:
            arr = to_ours(raw)
        except ValueError:
            arr = None
        if arr is None or arr.shape != shape:
            raise CheckpointError(f"tensor {hf_name} in {f.name} has shape {list(raw.shape)}; the config "
                                  f"{label}/config.json implies {list(_hf_shape(to_hf, shape))}")
        return np.asarray(arr).astype(param_dtype)

    def place(var: Any, shape: tuple[int, ...], block: Callable[[tuple[slice, ...]], np.ndarray]) -> None:
        """Sets var to the array of `shape` whose part at index `idx` is block(idx), built per shard."""
        if mesh is not None:
            sh = NamedSharding(mesh, sharding.logical_to_spec(var.get_metadata().get("axes"), shape, mesh))
            var.set_value(jax.make_array_from_callback(shape, sh, block))
        else:
            var.set_value(jnp.asarray(block(tuple(slice(None) for _ in shape))))

    stacked: dict[tuple[Any, ...], list[tuple[str, Callable, Callable]]] = {}
    try:
        for path, hf_name, to_ours, to_hf in mapping:
            own, layer = _locate(path, model.scan_layers)
            if layer is not None:
                stacked.setdefault(own, []).append((hf_name, to_ours, to_hf))
                continue
            var = _get_path(abstract_state, own)
            shape = tuple(var.get_value().shape)
            arr = read(hf_name, to_ours, to_hf, shape)
            place(var, shape, lambda idx, a=arr: a[idx])
        for own, layers in stacked.items():
            var = _get_path(abstract_state, own)
            shape = tuple(var.get_value().shape)

            def block(idx: tuple[slice, ...], layers=layers, shape=shape) -> np.ndarray:
                # One HF tensor at a time: this shard's slice of each layer it covers.
                return np.stack([read(*layers[i], shape[1:])[idx[1:]] for i in range(shape[0])[idx[0]]])
            place(var, shape, block)
    finally:
        handles.clear()
    return nnx.merge(graphdef, abstract_state)


def iter_hf_tensors(model: qwen2.Qwen2, dtype: Any = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF name, host array in HF layout) for every parameter, gathering shards one at a time."""
    state = nnx.state(model, nnx.Param)
    for path, hf_name, _, to_hf in _mapping(model.cfg):
        own, layer = _locate(path, getattr(model, "scan_layers", False))
        value = _get_path(state, own).get_value()
        arr = np.asarray(jax.device_get(value if layer is None else value[layer]))
        if dtype is not None:
            arr = arr.astype(dtype)
        yield hf_name, np.ascontiguousarray(to_hf(arr))


_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def save(model: qwen2.Qwen2, out_dir: str | pathlib.Path, *, dtype: str | None = None,
         max_shard_bytes: int = 2 << 30, extra_files_from: storage.PathLike | None = None) -> pathlib.Path:
    """Exports the model as an HF checkpoint directory (config.json + safetensors [+ index]).

    dtype: "float32" | "bfloat16" | "float16" or None (keep the parameter dtype).
    extra_files_from: copy tokenizer/generation files from this directory (e.g. the source checkpoint;
      local or a URI). `out_dir` is local (`storage.staged` gives one for a URI).
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    np_dtype = _DTYPES[dtype] if dtype else None
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in iter_hf_tensors(model, np_dtype):
        if size and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        total = sum(a.nbytes for s in shards for a in s.values())
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf_cfg = model.cfg.to_hf()
    some = next(iter(shards[0].values()))
    hf_cfg["torch_dtype"] = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                             np.dtype(np.float16): "float16"}.get(some.dtype, "float32")
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    if extra_files_from is not None:  # a local directory or a URI (the checkpoint the run started from)
        src = storage.source(extra_files_from)
        for f in src.iterdir():
            if f.is_file() and re.match(r"(tokenizer.*|special_tokens_map\.json|vocab\.json|merges\.txt|"
                                        r"generation_config\.json|chat_template\.jinja)$", f.name):
                (out_dir / f.name).write_bytes(f.read_bytes())
    return out_dir

