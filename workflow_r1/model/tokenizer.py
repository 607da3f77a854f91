"""Tokenizer of an HF checkpoint directory and the chat-template helper (no torch)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

Message = dict[str, str]


def load(ckpt_dir: str | pathlib.Path) -> Any:
    """The checkpoint's `transformers` tokenizer (read from disk only; never a hub)."""
    import transformers

    ckpt_dir = pathlib.Path(ckpt_dir)
    if not (ckpt_dir / "tokenizer.json").exists() and not (ckpt_dir / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"no tokenizer files in {ckpt_dir}; expected tokenizer.json from an HF checkpoint "
                                "(the bundled model: python -m workflow_r1.assets)")
    return transformers.AutoTokenizer.from_pretrained(str(ckpt_dir), local_files_only=True)


def chat_ids(tokenizer: Any, messages: str | Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
    """A user message (str) or chat messages -> token ids with the checkpoint's chat template applied."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
    # The template already wrote every special token; do not let the tokenizer add a BOS.
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
