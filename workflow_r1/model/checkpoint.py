"""Hugging Face safetensors checkpoints <-> our NNX Qwen2, one tensor at a time.

Loading builds the model abstractly (no memory), then reads each tensor from disk, reshapes it to
our layout and places it directly onto its target sharding, so a host never holds more than one
tensor beyond the model's own shards. Missing, unexpected and mis-shaped tensors are errors that
name the tensor.

The directory may be a URI (gs://...; `workflow_r1.storage`): every file is read in place, by byte
ranges, with nothing downloaded first. Each host reads only what its own devices hold: for each
parameter, the rows (first axis) of its HF tensor that this host's shards are computed from, once
for all of its devices; a tensor none of whose part lands on the host is not read at all. HF stores
a Linear weight as [out, in], so a host whose shards split the `in` axis (fsdp across hosts: q/k/v,
gate/up, the embedding) still reads every row of it, and one splitting `out` (o_proj, down_proj
under fsdp) reads its block of rows.

A model with scanned layers (`scan_layers=True`) holds each layer parameter as one [L, ...] array:
HF's `model.layers.{i}.*` tensors are its slices i, read one layer at a time while each device's
shard of the stacked array is assembled (and exported slice by slice).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import struct
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
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


# safetensors' dtype names -> NumPy (the float types HF checkpoints hold; integers for completeness)
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class _SafetensorsFile:
    """One safetensors file read by byte ranges (a URI's through fsspec: gcsfs for gs://), never whole.

    The format: an 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end)}} and the tensors' bytes, row-major, offsets counted from byte 8 + N.
    So rows [r0, r1) of a tensor (along its first axis) are one contiguous range: what `rows` reads.
    """

    def __init__(self, path: storage.Path, label: str):
        self.path, self.name, self.label = path, path.name, label
        self._fs = None  # a URI's fsspec file system (gcsfs for gs://); plain file reads for a local path
        with storage.reading(label, "checkpoint directory", CheckpointError):
            if storage.is_remote(path):
                import fsspec

                self._fs, self._fs_path = fsspec.core.url_to_fs(os.fspath(path))
                size = self._fs.size(self._fs_path)
            else:
                size = os.path.getsize(path)
        (n,) = struct.unpack("<Q", self._read(0, 8)) if size >= 8 else (size,)
        if size < 8 or 8 + n > size:
            raise CheckpointError(f"{self.name} in {label} is not a safetensors file ({size} bytes)")
        try:
            header = json.loads(self._read(8, 8 + n))
        except ValueError:
            raise CheckpointError(f"{self.name} in {label} has an unreadable safetensors header") from None
        header.pop("__metadata__", None)
        self._base, self.tensors = 8 + n, header

    def _read(self, start: int, end: int) -> bytes:
        with storage.reading(self.label, "checkpoint directory", CheckpointError):
            if self._fs is not None:
                return self._fs.cat_file(self._fs_path, start=start, end=end)
            with open(self.path, "rb") as f:
                f.seek(start)
                return f.read(end - start)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of tensor `name` (all of a 0-d tensor), as stored."""
        info = self.tensors[name]
        dtype, shape = np.dtype(_ST_DTYPES[info["dtype"]]), tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"tensor {name} in {self.name} of {self.label}: {end - begin} bytes for shape "
                                  f"{list(shape)} {info['dtype']}; the file is corrupt")
        if not shape:
            return np.frombuffer(self._read(self._base + begin, self._base + end), dtype).reshape(())
        row = math.prod(shape[1:]) * dtype.itemsize
        data = self._read(self._base + begin + r0 * row, self._base + begin + r1 * row)
        return np.frombuffer(data, dtype).reshape((r1 - r0,) + shape[1:])


def _weight_files(ckpt_dir: storage.Path, label: str) -> dict[str, _SafetensorsFile]:
    """HF tensor name -> the safetensors file holding it (single file or sharded with an index). Only
    the index and each file's header are read here."""
    index = ckpt_dir / "model.safetensors.index.json"
    with storage.reading(label, "checkpoint directory", CheckpointError):
        weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
        files = [] if weight_map is not None else sorted(ckpt_dir.glob("*.safetensors"))
    if weight_map is not None:
        opened = {f: _SafetensorsFile(ckpt_dir / f, label) for f in sorted(set(weight_map.values()))}
        out = {name: opened[f] for name, f in weight_map.items()}
        for name, f in out.items():
            if name not in f.tensors:
                raise CheckpointError(f"{label}/model.safetensors.index.json maps tensor {name} to {f.name}, "
                                      "which does not hold it")
        return out
    if not files:
        raise CheckpointError(f"no *.safetensors in {label}; expected a Hugging Face checkpoint directory")
    return {name: st for st in (_SafetensorsFile(f, label) for f in files) for name in st.tensors}


def _rows_needed(to_ours: Callable[[np.ndarray], np.ndarray], hf_shape: tuple[int, ...],
                 indices: list[tuple[slice, ...]]) -> tuple[int, int]:
    """The first-axis range [r0, r1) of an HF tensor of `hf_shape` that the parts `indices` of its
    image in our layout (`to_ours(hf)[idx]`) are computed from: traced through `to_ours` with an array
    of row numbers that is a zero-copy broadcast (the maps are transposes and reshapes; one that copies
    falls back to every row)."""
    if not indices:
        return 0, 0
    if not hf_shape:
        return 0, 1
    numbers = np.broadcast_to(np.arange(hf_shape[0], dtype=np.int32).reshape((-1,) + (1,) * (len(hf_shape) - 1)),
                              hf_shape)
    mapped = to_ours(numbers)
    if not np.shares_memory(mapped, numbers):
        return 0, hf_shape[0]
    parts = [mapped[idx] for idx in indices]
    parts = [p for p in parts if p.size]
    if not parts:
        return 0, 0
    return int(min(p.min() for p in parts)), int(max(p.max() for p in parts)) + 1


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
    return _load(storage.source(ckpt_dir), label, cfg, mesh=mesh, dtype=dtype, param_dtype=param_dtype, remat=remat,
                 scan_layers=scan_layers)


def _load(ckpt_dir: storage.Path, label: str, cfg: Qwen2Config, *, mesh: Mesh | None, dtype: Any, param_dtype: Any,
          remat: bool, scan_layers: bool) -> qwen2.Qwen2:
    """`load` from `ckpt_dir` (`label`: the directory as the caller named it)."""
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

    def read(hf_name: str, to_ours: Callable, to_hf: Callable, shape: tuple[int, ...],
             indices: list[tuple[slice, ...]]) -> np.ndarray:
        """HF tensor `hf_name` in our layout (`shape`) and param_dtype, as a view whose parts `indices`
        hold its values: only the rows of the HF tensor those parts are computed from are read (the
        rest stay zero and are never looked at)."""
        f = files[hf_name]
        hf_shape, want = f.shape(hf_name), _hf_shape(to_hf, shape)
        if hf_shape != want:
            raise CheckpointError(f"tensor {hf_name} in {f.name} has shape {list(hf_shape)}; the config "
                                  f"{label}/config.json implies {list(want)}")
        r0, r1 = _rows_needed(to_ours, hf_shape, indices)
        if not hf_shape:
            return to_ours(f.rows(hf_name, 0, 1))
        raw = np.zeros(hf_shape, _ST_DTYPES[f.tensors[hf_name]["dtype"]])
        if r1 > r0:
            raw[r0:r1] = f.rows(hf_name, r0, r1)
        return to_ours(raw)

    def place(var: Any, shape: tuple[int, ...], stacked: list[tuple[str, Callable, Callable]] | None,
              single: tuple[str, Callable, Callable] | None) -> None:
        """Sets var to its array of `shape`, built shard by shard on this host's devices: a plain
        parameter from the HF tensor `single`; a stacked one ([L, ...]) from the HF tensors `stacked`
        (one per layer), each read once for all of this host's shards that hold a slice of it."""
        if mesh is not None:
            sh = NamedSharding(mesh, sharding.logical_to_spec(var.get_metadata().get("axes"), shape, mesh))
            by_device = sh.addressable_devices_indices_map(shape)
        else:
            sh, by_device = None, {None: tuple(slice(None) for _ in shape)}
        blocks: dict[tuple, np.ndarray] = {}  # a shard's index -> its block (replicas share one)
        key = {d: tuple(s.indices(n) for s, n in zip(idx, shape)) for d, idx in by_device.items()}
        for d, idx in by_device.items():
            if key[d] not in blocks:
                blocks[key[d]] = np.empty(tuple(len(range(*k)) for k in key[d]), param_dtype)
        unique = {key[d]: idx for d, idx in by_device.items()}
        if single is not None:
            ours = read(*single, shape, list(unique.values()))
            for k, idx in unique.items():
                blocks[k][...] = ours[idx]
        else:
            for i, layer in enumerate(stacked):  # one HF tensor at a time: this host's slices of layer i
                holders = {k: idx for k, idx in unique.items() if i in range(*k[0])}
                if not holders:
                    continue
                ours = read(*layer, shape[1:], [idx[1:] for idx in holders.values()])
                for k, idx in holders.items():
                    blocks[k][range(*k[0]).index(i)] = ours[idx[1:]]
        if sh is None:
            var.set_value(jnp.asarray(next(iter(blocks.values()))))
        else:
            var.set_value(jax.make_array_from_single_device_arrays(
                shape, sh, [jax.device_put(blocks[key[d]], d) for d in by_device]))

    stacked: dict[tuple[Any, ...], list[tuple[str, Callable, Callable]]] = {}
    for path, hf_name, to_ours, to_hf in mapping:
        own, layer = _locate(path, model.scan_layers)
        if layer is not None:
            stacked.setdefault(own, []).append((hf_name, to_ours, to_hf))
            continue
        var = _get_path(abstract_state, own)
        place(var, tuple(var.get_value().shape), None, (hf_name, to_ours, to_hf))
    for own, layers in stacked.items():
        var = _get_path(abstract_state, own)
        place(var, tuple(var.get_value().shape), layers, None)
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

