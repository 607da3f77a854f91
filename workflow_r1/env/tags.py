"""Extraction of `<tag>...</tag>` blocks: the one place the tag pattern is written.

A block is `<tag>` up to the nearest following `</tag>` (non-greedy, across newlines); nested
blocks of the same tag are not paired. Used by the turn parser (first block decides), the reward
(last `<answer>` counts) and the executor (operator input fields and LLM replies).
"""
from __future__ import annotations

import re

_PATTERNS: dict[str, re.Pattern] = {}


def tag_pattern(tag: str) -> re.Pattern:
    """The compiled pattern of one `<tag>...</tag>` block; group 1 is the inner text."""
    pattern = _PATTERNS.get(tag)
    if pattern is None:
        pattern = _PATTERNS[tag] = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL)
    return pattern


def first_tag(text: str, tag: str) -> str | None:
    """Stripped inner text of the first `<tag>...</tag>` in `text`, or None if there is none."""
    match = tag_pattern(tag).search(text)
    return None if match is None else match.group(1).strip()


def last_tag(text: str, tag: str) -> str | None:
    """Stripped inner text of the last `<tag>...</tag>` in `text`, or None if there is none."""
    last = None
    for last in tag_pattern(tag).finditer(text):
        pass
    return None if last is None else last.group(1).strip()


def all_tags(text: str, tag: str) -> list[str]:
    """Stripped inner texts of every `<tag>...</tag>` in `text`, in order (empty ones included)."""
    return [inner.strip() for inner in tag_pattern(tag).findall(text)]
