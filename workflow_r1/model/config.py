"""Qwen2 / Qwen2.5 architecture configuration: presets and HF `config.json` reading."""

from __future__ import annotations

import dataclasses
import difflib
import json
import pathlib
from typing import Any

from workflow_r1 import storage


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Architecture of a Qwen2-family decoder. Sizes are counts, not bytes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = (151645, 151643)
    pad_token_id: int = 151643

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings and LM head included)."""
        d, h, kv, hd, m = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        attn = d * h * hd + h * hd + 2 * (d * kv * hd + kv * hd) + h * hd * d
        layer = attn + 3 * d * m + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head

    def replace(self, **kw: Any) -> "Qwen2Config":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen2Config":
        """Builds a config from our own field names; unknown keys are an error that names them."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            k = unknown[0]
            hint = difflib.get_close_matches(k, fields, n=1)
            raise ValueError(f"unknown Qwen2Config key {k!r}" + (f"; did you mean {hint[0]!r}?" if hint else f"; known: {sorted(fields)}"))
        d = dict(d)
        if "eos_token_ids" in d:
            d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | pathlib.Path) -> "Qwen2Config":
        """Reads a Hugging Face Qwen2 `config.json` (a dict, the file, or the checkpoint directory; a
        local path or a URI such as gs://...)."""
        if not isinstance(hf, dict):
            path = storage.source(hf)
            with storage.reading(hf, "model config"):
                if path.is_dir():
                    path = path / "config.json"
                exists = path.exists()
            if not exists:
                raise FileNotFoundError(f"no config.json at {path}: is this a Hugging Face checkpoint directory?")
            with storage.reading(path, "model config"):
                hf = json.loads(path.read_text())
        model_type = hf.get("model_type", "qwen2")
        if model_type != "qwen2":
            raise ValueError(f"config.json has model_type={model_type!r}; only 'qwen2' (Qwen2 / Qwen2.5) is supported")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported (only default RoPE)")
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        if hf.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported (no Qwen2.5 release uses it)")
        eos = hf.get("eos_token_id", 151645)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        if 151643 not in eos and hf.get("vocab_size", 0) > 151643:
            eos = eos + (151643,)  # <|endoftext|> ends base-model text too.
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=151643 if hf.get("pad_token_id") is None else hf["pad_token_id"],
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict for this architecture."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
        }


def _qwen25(vocab, d, m, layers, heads, kv, tie):
    return Qwen2Config(vocab_size=vocab, hidden_size=d, intermediate_size=m, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, head_dim=d // heads, tie_word_embeddings=tie)


# Published Qwen2.5 sizes. 0.5B-3B tie the LM head to the embedding; 7B+ do not.
PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": _qwen25(151936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _qwen25(151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": _qwen25(151936, 2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": _qwen25(152064, 3584, 18944, 28, 28, 4, False),
    "qwen2.5-14b": _qwen25(152064, 5120, 13824, 48, 40, 8, False),
    "qwen2.5-32b": _qwen25(152064, 5120, 27648, 64, 40, 8, False),
    "qwen2.5-72b": _qwen25(152064, 8192, 29568, 80, 64, 8, False),
    # Tiny shapes for tests and CPU smoke runs (random weights).
    "tiny": Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=10000.0, eos_token_ids=(1,), pad_token_id=0),
    # The `tiny` training preset: a random model over `tokenizer.byte_level()` (259 ids, padded to
    # 320), ending turns at <|im_end|> = 258.
    "tiny-chat": Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, rope_theta=10000.0, eos_token_ids=(258, 256),
                             pad_token_id=256),
    "tiny-tied": Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
                             eos_token_ids=(1,), pad_token_id=0),
}


def get_preset(name: str) -> Qwen2Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
