"""Text in and out of the token-level sampler: chat-templated prompts, decoded generations.

Used by the embedded executor's local LLM (executor/local_backend.py) and `python -m workflow_r1.generate`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workflow_r1.model import tokenizer as tokenizer_lib
from workflow_r1.sampler.sampler import Sampler
from workflow_r1.sampler.session import SamplerError


def encode_chat(sampler: Sampler, item: str | Sequence[dict[str, str]]) -> list[int]:
    """A user message (str) or a list of chat messages -> prompt ids with the chat template applied."""
    if sampler.tokenizer is None:
        raise SamplerError("text helpers need a tokenizer: pass tokenizer= to Sampler")
    return tokenizer_lib.chat_ids(sampler.tokenizer, item)


def decode(sampler: Sampler, tokens: Sequence[int], finish_reason: str = "length",
           stop_strings: Sequence[str] = (), eos_ids: Sequence[int] | None = None) -> str:
    """Generated ids -> text: a final EOS token is dropped; with a stop, text ends right after the string."""
    eos = set(sampler.eos_ids if eos_ids is None else eos_ids)
    tokens = list(tokens)
    if finish_reason == "eos" and tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    tb = sampler.token_bytes()
    raw = b"".join(tb[t] for t in tokens)
    if finish_reason == "stop":
        ends = [raw.find(s.encode()) + len(s.encode()) for s in stop_strings if raw.find(s.encode()) >= 0]
        if ends:
            raw = raw[:min(ends)]
    return raw.decode("utf-8", errors="replace")


def generate_text(sampler: Sampler, items: Sequence[str | Sequence[dict[str, str]]], max_new_tokens: int,
                  **kw: Any) -> list[tuple[str, str]]:
    """Chat-templated generation: each item is a user message or a message list -> (text, finish_reason).
    Keywords go to `Sampler.generate`."""
    if isinstance(items, str):
        raise SamplerError("generate_text takes a list of messages or texts, not a single str")
    out = sampler.generate([encode_chat(sampler, x) for x in items], max_new_tokens, **kw)
    stops = kw.get("stop_strings", ())
    stops = (stops,) if isinstance(stops, str) else tuple(stops)
    return [(decode(sampler, t, r, stops, kw.get("eos_ids")), r) for t, r in zip(out.tokens, out.finish_reason)]
