"""HTTP helpers shared by the executor's three clients (of the executor, the LLM server, the
retrieval server): bounded reply reads, `Retry-After`, and URL checks with one-line errors.

Why bounded reads: a reply is read into memory whole, so a peer that sends gigabytes (a bug, a
proxy's error page, a hostile server) would otherwise cost that much memory. Each client names
its own limit; past it the read stops and the caller reports the reply as too large.
"""
from __future__ import annotations

import email.utils
import math
import time
from urllib.parse import urlsplit

import aiohttp

# Longest reply read from an LLM server or a retrieval server, bytes. A chat completion of a few
# thousand tokens, or a few passages, is tens of KB; 4 MiB leaves room for verbose servers.
UPSTREAM_REPLY_BYTES = 4 * 1024 * 1024
# Longest reply the executor client reads from the executor, bytes: an operator may quote several
# LLM replies (MultiAnswerGenerate, ScEnsemble), each up to UPSTREAM_REPLY_BYTES, JSON-escaped.
EXECUTOR_REPLY_BYTES = 64 * 1024 * 1024
# Longest wait honoured from a `Retry-After` header, seconds (longer values are clipped to this).
MAX_RETRY_AFTER_S = 60.0


class ReplyTooLarge(Exception):
    """A reply body was longer than the reader's limit; the message names the limit."""


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of `resp`, or ReplyTooLarge once more than `limit` bytes arrive (or are announced
    by Content-Length, in which case nothing is read)."""
    announced = resp.content_length
    if announced is not None:
        if announced > limit:
            raise ReplyTooLarge(f"reply of {announced} bytes is over the limit of {limit} bytes")
        return await resp.read()  # the fast path: one read of a known, bounded length
    chunks, size = [], 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise ReplyTooLarge(f"reply is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header value (delay-seconds or an HTTP date), clipped to
    [0, MAX_RETRY_AFTER_S]; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def check_url(url: str, what: str, example: str) -> str:
    """`url` if it is an absolute http(s) URL with a host (and a valid port); else ValueError with
    one line naming `what` (e.g. "OpenAI-compatible base URL") and an `example`."""
    problem = ""
    if not url.startswith(("http://", "https://")):
        problem = "must start with http:// or https://"
    elif any(c.isspace() for c in url):
        problem = "contains white space"
    else:
        try:
            parsed = urlsplit(url)
            if not parsed.hostname:
                problem = "has no host"
            else:
                parsed.port  # noqa: B018  # raises ValueError on a port out of range
        except (ValueError, TypeError) as exc:
            problem = f"is not a valid URL ({exc})"
    if problem:
        raise ValueError(f"{what} {url!r} {problem}, e.g. {example}")
    return url
