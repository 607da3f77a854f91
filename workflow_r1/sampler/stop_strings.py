"""Stop strings as token-level automata: which token completes a stop string, found on device.

Stop strings are matched on the bytes of the generated tokens by a KMP automaton lifted to whole
tokens: a [states, vocab] transition table per stop string, built once on the host, so a string
spanning several tokens, or ending inside a token, is caught at the exact token that completes it.
The decode loop (sampler/loop.py) carries one automaton state per (row, stop string).

Shapes: V vocabulary size, L a stop string's length in UTF-8 bytes, N number of stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from workflow_r1.model import tokenizer as tokenizer_lib


def vocab_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """The raw bytes each token id stands for (b"" for ids the tokenizer does not define).

    Works for byte-level BPE tokenizers (Qwen, GPT-2 family): the concatenation of a sequence's token
    bytes is the UTF-8 of its decoded text, special tokens included as their literal content.
    """
    byte_of = {c: b for b, c in tokenizer_lib.bytes_to_unicode().items()}
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    n = min(vocab_size, len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    out: list[bytes] = []
    for i, piece in enumerate(pieces):
        if i in added:
            out.append(added[i].encode("utf-8"))
        elif piece is None:
            out.append(b"")
        elif all(c in byte_of for c in piece):
            out.append(bytes(byte_of[c] for c in piece))
        else:  # not byte-level (e.g. sentencepiece): best effort through the tokenizer's own decode
            out.append(tokenizer.decode([i]).encode("utf-8"))
    return out + [b""] * (vocab_size - n)


def _kmp_automaton(pattern: bytes) -> np.ndarray:
    """[L+1, 256] byte transitions of the KMP automaton for `pattern`; state L (= matched) absorbs."""
    n = len(pattern)
    prefix = [0] * n  # longest proper prefix of pattern[:q+1] that is also its suffix
    k = 0
    for q in range(1, n):
        while k and pattern[q] != pattern[k]:
            k = prefix[k - 1]
        if pattern[q] == pattern[k]:
            k += 1
        prefix[q] = k
    delta = np.zeros((n + 1, 256), np.int32)
    for q in range(n):
        if q:
            delta[q] = delta[prefix[q - 1]]
        delta[q, pattern[q]] = q + 1
    delta[n] = n
    return delta


def stop_tables(stop_strings: Sequence[str], token_bytes: Sequence[bytes]) -> np.ndarray:
    """int16 [num_stops, max_len, V]: next automaton state after a token, or -1 if it completes the string.

    Entry [s, q, t] is where stop string s's matcher goes from state q (q bytes of s matched) after
    the bytes of token t; -1 means the string occurs ending inside t. States q >= len(s) are unused.
    """
    v = len(token_bytes)
    lengths = np.fromiter((len(b) for b in token_bytes), np.int64, v)
    order = np.argsort(-lengths, kind="stable")  # longest first: column j is needed by a prefix only
    maxlen = int(lengths.max(initial=0))
    mat = np.zeros((v, max(maxlen, 1)), np.uint8)
    for row, t in enumerate(order):
        b = token_bytes[t]
        if b:
            mat[row, :len(b)] = np.frombuffer(b, np.uint8)
    counts = [int((lengths > j).sum()) for j in range(maxlen)]  # tokens with a byte at column j
    pats = [s.encode("utf-8") for s in stop_strings]
    width = max(len(p) for p in pats)
    out = np.zeros((len(pats), width, v), np.int16)
    for s, pat in enumerate(pats):
        n = len(pat)
        delta = _kmp_automaton(pat)
        cur = np.repeat(np.arange(n, dtype=np.int32)[:, None], v, axis=1)  # [n, V] in sorted token order
        for j in range(maxlen):
            m = counts[j]
            cur[:, :m] = delta[cur[:, :m], mat[None, :m, j]]
        out[s, :n][:, order] = np.where(cur == n, -1, cur)
    return out


__all__ = ["stop_tables", "vocab_bytes"]
