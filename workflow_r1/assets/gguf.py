"""GGUF -> Hugging Face Qwen2 checkpoint with numpy, `gguf` and `ml_dtypes` (never torch).

`convert_gguf` reads a llama.cpp qwen2 GGUF and writes model.safetensors (bf16), config.json,
generation_config.json and the tokenizer files. The GGUF-specific knowledge lives here: tensor
names (blk.N.attn_q -> model.layers.N.self_attn.q_proj), reversed dims, metadata keys, token types.
What an HF Qwen2 checkpoint must contain comes from the model code: the architecture is a
`Qwen2Config`, config.json is its `to_hf()`, and the expected tensors and shapes are
`workflow_r1.model.checkpoint.hf_param_shapes`, the mapping `checkpoint.load` reads with.

Heavy packages (gguf, ml_dtypes, jax via the checkpoint module, transformers) are imported only
when a conversion runs.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from workflow_r1.assets.registry import AssetError, log, mb
from workflow_r1.model.config import Qwen2Config

_DEQUANT_CHUNK_ELEMS = 16 * 1024 * 1024

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# llama.cpp token types (gguf.TokenType): NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4, UNUSED=5, BYTE=6
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# config.json keys written beyond `Qwen2Config.to_hf()` (with "max_window_layers"): settings the
# model does not use (weight init range, rope scaling, sliding window, KV-cache flag) spelled out for
# transformers, and the dtype model.safetensors is stored in.
_EXTRA_CONFIG: dict[str, Any] = {
    "initializer_range": 0.02,
    "rope_scaling": None,
    "sliding_window": None,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
}


def hf_tensor_name(gguf_name: str) -> str:
    """The HF Qwen2 parameter name for a llama.cpp qwen2 tensor name.

    Raises:
        AssetError: the name is not part of the qwen2 layout this converter knows.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, kind, suffix = match.groups()
        return f"model.layers.{int(layer)}.{_LAYER_NAMES[kind]}.{suffix}"
    raise AssetError(
        f"GGUF tensor {gguf_name!r} has no HF Qwen2 equivalent; extend _LAYER_NAMES in workflow_r1/assets/gguf.py"
    )


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    """The HF shape of a GGUF tensor (GGUF lists dims fastest-first, i.e. reversed)."""
    return tuple(int(dim) for dim in reversed(tensor.shape))


def _field(reader: Any, key: str, default: Any = None, required: bool = True) -> Any:
    """The value of GGUF metadata `key` (scalars, strings and arrays as Python values).

    Raises:
        AssetError: the key is missing and `required` is set.
    """
    entry = reader.fields.get(key)
    if entry is None:
        if required:
            raise AssetError(f"GGUF metadata has no {key!r}; this file is not a complete llama.cpp qwen2 export")
        return default
    return entry.contents()


def _clean_float(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999997e-07 -> 1e-06)."""
    return float(f"{float(value):.7g}")


def _token_id(reader: Any, key: str) -> int | None:
    """An optional token id from the GGUF metadata."""
    value = _field(reader, key, None, required=False)
    return None if value is None else int(value)


def _read_config(reader: Any, has_output: bool) -> tuple[Qwen2Config, dict[str, Any]]:
    """The architecture in the GGUF metadata, and the config.json dict to write for it.

    config.json is `cfg.to_hf()` plus `_EXTRA_CONFIG`, except that `eos_token_id` is the GGUF's
    single eos id, as in the official Qwen2 config.json (generation_config.json lists every stop
    id, `cfg.eos_token_ids`), and `pad_token_id` is the GGUF's (None when it has none).

    Raises:
        AssetError: the GGUF is not a qwen2 model, lacks a required key, or describes an invalid one.
    """
    arch = _field(reader, "general.architecture")
    if arch != "qwen2":
        raise AssetError(f"GGUF architecture is {arch!r}, but this converter handles only 'qwen2'")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise AssetError("GGUF has no token_embd.weight tensor; it is not a complete qwen2 model")
    embd_rows = _hf_shape(embd)[0]
    vocab_size = max(len(tokens.data), embd_rows) if tokens is not None else embd_rows
    layers = int(_field(reader, "qwen2.block_count"))
    hidden = int(_field(reader, "qwen2.embedding_length"))
    heads = int(_field(reader, "qwen2.attention.head_count"))
    eos = _token_id(reader, "tokenizer.ggml.eos_token_id")
    pad = _token_id(reader, "tokenizer.ggml.padding_token_id")
    try:
        cfg = Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(_field(reader, "qwen2.feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(_field(reader, "qwen2.attention.head_count_kv")),
            head_dim=hidden // heads,
            rope_theta=_clean_float(_field(reader, "qwen2.rope.freq_base", 1_000_000.0, required=False)),
            rms_norm_eps=_clean_float(_field(reader, "qwen2.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings=not has_output,
            max_position_embeddings=int(_field(reader, "qwen2.context_length")),
            bos_token_id=_token_id(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(i for i in (eos, pad) if i is not None)),
            **({} if pad is None else {"pad_token_id": pad}),
        )
    except ValueError as error:
        raise AssetError(f"GGUF metadata describes an invalid qwen2 model ({error}); the file is malformed") from None
    config = {**cfg.to_hf(), **_EXTRA_CONFIG, "max_window_layers": layers, "eos_token_id": eos, "pad_token_id": pad}
    return cfg, config


def _write_safetensors_bf16(
    tensors: list[tuple[str, Any]],
    out_path: Path,
    metadata: dict[str, str],
) -> int:
    """Dequantize each GGUF tensor, cast to bfloat16, and stream it into a safetensors file.

    The header is computed from the shapes up front, so only one tensor is ever held in memory.
    `tensors` is a list of (hf_name, gguf ReaderTensor) in the order to write. Returns the number of
    parameters written.

    Raises:
        AssetError: a tensor's type cannot be dequantized, or it dequantizes to non-finite values.
    """
    import ml_dtypes
    from gguf.quants import dequantize

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    shapes = {}
    for hf_name, tensor in tensors:
        shape = shapes[hf_name] = _hf_shape(tensor)
        nbytes = int(np.prod(shape)) * 2
        header[hf_name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # keep the data 8-byte aligned

    total = len(tensors)
    params = 0
    start = time.perf_counter()
    report_every = max(1, total // 12)
    with open(out_path, "wb") as out:
        out.write(len(header_bytes).to_bytes(8, "little"))
        out.write(header_bytes)
        for index, (hf_name, tensor) in enumerate(tensors, start=1):
            shape = shapes[hf_name]
            data = tensor.data
            # Matrices are dequantized a block of rows at a time (GGUF stores each HF row as one
            # row of blocks), which keeps the float32 intermediates small for the 151936-row ones.
            rows_per_chunk = max(1, _DEQUANT_CHUNK_ELEMS // int(np.prod(shape[1:]))) if len(shape) == 2 else None
            if rows_per_chunk is None or data.ndim != 2 or data.shape[0] != shape[0]:
                chunks = [(data, shape)]
            else:
                chunks = [
                    (data[row : row + rows_per_chunk], (min(rows_per_chunk, shape[0] - row), shape[1]))
                    for row in range(0, shape[0], rows_per_chunk)
                ]
            for chunk, chunk_shape in chunks:
                try:
                    values = dequantize(chunk, tensor.tensor_type)
                except NotImplementedError as error:
                    raise AssetError(
                        f"cannot dequantize GGUF tensor {tensor.name} of type {tensor.tensor_type.name} ({error}); "
                        f"upgrade the gguf package"
                    ) from None
                values = np.asarray(values, dtype=np.float32).reshape(chunk_shape)
                if not np.isfinite(values).all():
                    raise AssetError(f"GGUF tensor {tensor.name} dequantizes to non-finite values; the file is corrupt")
                as_bf16 = np.ascontiguousarray(values.astype(ml_dtypes.bfloat16))
                out.write(as_bf16.view(np.uint16).tobytes())
                params += as_bf16.size
            if index % report_every == 0 or index == total:
                log(
                    f"convert: {index}/{total} tensors, {params / 1e6:.1f}M params "
                    f"({time.perf_counter() - start:.1f}s, last {hf_name} "
                    f"{tensor.tensor_type.name} {list(shapes[hf_name])})"
                )
    expected_size = 8 + len(header_bytes) + offset
    if out_path.stat().st_size != expected_size:
        raise AssetError(
            f"wrote {out_path} with {out_path.stat().st_size} bytes, expected {expected_size}; check free disk space"
        )
    return params


def _write_tokenizer(reader: Any, config: dict[str, Any], out_dir: Path) -> None:
    """Build a Qwen2 tokenizer from the GGUF vocabulary/merges and `save_pretrained` it into `out_dir`.

    Normal tokens form the byte-level BPE vocabulary, control tokens become special added tokens and
    user-defined ones (e.g. <tool_call>) plain added tokens, each at its GGUF id; the padding entries
    llama.cpp marks unused ("[PAD151665]"...) are left out, as in the official tokenizer. Uses
    transformers' torch-free `Qwen2Tokenizer` (built on `tokenizers`).

    Raises:
        AssetError: the GGUF tokenizer is not byte-level BPE, or an added token lands on a wrong id.
    """
    from tokenizers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise AssetError(f"GGUF tokenizer model is {model!r}; only byte-level BPE ('gpt2') is supported for qwen2")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]
    merges = [tuple(merge.split(" ")) for merge in _field(reader, "tokenizer.ggml.merges")]
    kept = {_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED}
    vocab = {token: index for index, (token, kind) in enumerate(zip(tokens, types)) if kind in kept}
    eos_id, pad_id = config["eos_token_id"], config["pad_token_id"]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        pad_token=tokens[pad_id] if pad_id is not None else None,
        errors="replace",
        model_max_length=config["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    added = [
        AddedToken(token, special=(kind == _TOKEN_CONTROL), normalized=False)
        for token, kind in zip(tokens, types)
        if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    for token, kind in zip(tokens, types):
        if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            got = tokenizer.convert_tokens_to_ids(token)
            if got != vocab[token]:
                raise AssetError(f"tokenizer put added token {token!r} at id {got}, GGUF says {vocab[token]}")
    template = _field(reader, "tokenizer.chat_template", None, required=False)
    if template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Convert a llama.cpp qwen2 GGUF into an HF Qwen2 checkpoint in `out_dir` (no torch involved).

    Writes model.safetensors (bf16), config.json, generation_config.json and the tokenizer files.
    Tensor names are mapped to HF Qwen2 names with GGUF's reversed dims undone; q/k rows are NOT
    un-permuted, because llama.cpp does not permute them for qwen2 (it uses NEOX-style rope, the same
    rotate-half layout as HF). Returns the config.json dict, with "num_parameters" added (not written).

    Raises:
        AssetError: the file is not a qwen2 GGUF this converter understands, or a check fails.
    """
    from gguf import GGUFReader

    from workflow_r1.model import checkpoint

    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log(f"convert: reading {gguf_path.name} (metadata and {mb(gguf_path.stat().st_size)} of tensors)")
    reader = GGUFReader(str(gguf_path))
    names = {tensor.name for tensor in reader.tensors}
    cfg, config = _read_config(reader, has_output="output.weight" in names)
    log(
        f"convert: qwen2 with {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{len(reader.tensors)} tensors ({time.perf_counter() - start:.1f}s)"
    )

    expected = checkpoint.hf_param_shapes(cfg)
    mapped: dict[str, Any] = {}
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name)
        if hf_name in mapped:
            raise AssetError(f"GGUF has two tensors mapping to {hf_name}; the file is malformed")
        shape = _hf_shape(tensor)
        if hf_name not in expected:
            raise AssetError(
                f"GGUF tensor {tensor.name} ({hf_name}) is not expected by the config; the file is malformed"
            )
        if shape != expected[hf_name]:
            raise AssetError(
                f"GGUF tensor {tensor.name} has HF shape {list(shape)}, config implies {list(expected[hf_name])}"
            )
        mapped[hf_name] = tensor
    missing = sorted(set(expected) - set(mapped))
    if missing:
        raise AssetError(f"GGUF lacks tensors for {len(missing)} HF parameters, e.g. {missing[:3]}")

    params = _write_safetensors_bf16(
        sorted(mapped.items()),
        out_dir / "model.safetensors",
        metadata={"format": "pt", "source": "gguf", "converter": "workflow_r1.assets"},
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
        "pad_token_id": config["pad_token_id"],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    log("convert: writing tokenizer files")
    _write_tokenizer(reader, config, out_dir)
    del reader
    log(f"convert: done, {params / 1e6:.1f}M params ({time.perf_counter() - start:.1f}s)")
    return {**config, "num_parameters": params}
