"""Extraction of `<tag>...</tag>` blocks: the one place the tag rule is written.

A block is `<tag>` up to the nearest following `</tag>` (non-greedy, across newlines); nested
blocks of the same tag are not paired. Used by the turn parser (first block decides), the reward
(last `<answer>` counts) and the executor (operator input fields and LLM replies).

Why `str.find` and not the regex `<tag>(.*?)</tag>`: the regex retries from every `<tag>` that has
no closing tag, scanning to the end of the text each time, so text full of unclosed tags costs
time quadratic in its length (65 KB of `<task>` held the executor's event loop for seconds). Here
each character is looked at a bounded number of times: if the first `<tag>` has no `</tag>` after
it, no later one has either, so the search stops. The results are those of the regex.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple


class TagBlock(NamedTuple):
    """One block in a text: `start`/`end` bound `<tag>...</tag>`, `inner` is the raw inner text."""

    start: int
    end: int
    inner: str


def iter_tags(text: str, tag: str, pos: int = 0) -> Iterator[TagBlock]:
    """Every `<tag>...</tag>` block of `text` from `pos` on, in order, without overlaps."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    while True:
        start = text.find(opening, pos)
        if start < 0:
            return
        inner_start = start + len(opening)
        inner_end = text.find(closing, inner_start)
        if inner_end < 0:  # no closing tag after this opening, hence after no later one either
            return
        pos = inner_end + len(closing)
        yield TagBlock(start, pos, text[inner_start:inner_end])


def first_block(text: str, tag: str) -> TagBlock | None:
    """The first `<tag>...</tag>` block of `text`, or None."""
    return next(iter_tags(text, tag), None)


def first_tag(text: str, tag: str) -> str | None:
    """Stripped inner text of the first `<tag>...</tag>` in `text`, or None if there is none."""
    block = first_block(text, tag)
    return None if block is None else block.inner.strip()


def last_tag(text: str, tag: str) -> str | None:
    """Stripped inner text of the last `<tag>...</tag>` in `text`, or None if there is none."""
    last = None
    for last in iter_tags(text, tag):
        pass
    return None if last is None else last.inner.strip()


def all_tags(text: str, tag: str) -> list[str]:
    """Stripped inner texts of every `<tag>...</tag>` in `text`, in order (empty ones included)."""
    return [block.inner.strip() for block in iter_tags(text, tag)]
