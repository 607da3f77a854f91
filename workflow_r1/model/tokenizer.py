"""Tokenizer of an HF checkpoint directory and the chat-template helper (no torch)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from workflow_r1 import storage

Message = dict[str, str]


def is_tokenizer_file(name: str) -> bool:
    """Whether `load` may read the file `name` of a checkpoint directory: any but the weights."""
    return not name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf"))


def load(ckpt_dir: str | pathlib.Path) -> Any:
    """The checkpoint's `transformers` tokenizer (read from the directory only; never a hub). A URI
    (gs://...) has its small files downloaded to a temporary directory for the load."""
    import transformers

    source = storage.source(ckpt_dir)
    with storage.reading(ckpt_dir, "tokenizer directory"):
        found = (source / "tokenizer.json").exists() or (source / "tokenizer_config.json").exists()
    if not found:
        raise FileNotFoundError(f"no tokenizer files in {ckpt_dir}; expected tokenizer.json from an HF checkpoint "
                                "(the bundled model: python -m workflow_r1.assets)")
    with storage.fetched(ckpt_dir, is_tokenizer_file, "tokenizer directory") as local:
        return transformers.AutoTokenizer.from_pretrained(str(local), local_files_only=True)


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes one token of `tokenizer` stands for (its longest vocabulary
    entry, special tokens included; a byte-level alphabet character counts as its own UTF-8 bytes,
    never fewer than the byte it stands for). Cached on the tokenizer."""
    cached = getattr(tokenizer, "_workflow_r1_max_token_bytes", None)
    if cached is None:
        cached = max(len(t.encode("utf-8")) for t in tokenizer.get_vocab())
        tokenizer._workflow_r1_max_token_bytes = cached
    return cached


def surely_longer(tokenizer: Any, text: str, limit: int) -> bool:
    """True when `text` alone has more than `limit` tokens whatever it holds (more bytes than `limit`
    of the longest tokens): a 10 MiB question is dropped without being tokenized."""
    return len(text.encode("utf-8", "surrogatepass")) > limit * max_token_bytes(tokenizer)


def chat_ids(tokenizer: Any, messages: str | Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
    """A user message (str) or chat messages -> token ids with the checkpoint's chat template applied."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
    # The template already wrote every special token; do not let the tokenizer add a BOS.
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


# ChatML, the format of Qwen's template without its tool-definition preamble: enough for the
# protocol (system, user, assistant and tool messages) and for tests that need no real checkpoint.
CHATML_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level BPE alphabet: byte value -> the printable character standing for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_level() -> Any:
    """A tokenizer with one token per byte (ids 0-255) plus <|endoftext|> 256, <|im_start|> 257 and
    <|im_end|> 258 (the end of a turn), with a ChatML chat template.

    For the `tiny` preset's random model (model preset "tiny-chat"): the whole pipeline (chat
    template, observations, stop at <|im_end|>, decoding) runs without a real checkpoint.
    """
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in BYTE_SPECIAL_TOKENS])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE)
