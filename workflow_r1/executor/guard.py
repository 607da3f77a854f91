"""Who may call the executor: the checks every request passes before a handler runs.

The executor spends LLM calls for whoever reaches it, so it must not answer a web page or a
stranger:
- `Content-Type: application/json` on every POST. A browser page can send a cross-origin "simple"
  request (text/plain) to 127.0.0.1 without asking; a JSON one needs a CORS preflight, which this
  server never grants.
- No `Content-Encoding` but identity: the server never inflates a body (a small gzip bomb would
  cost the event loop seconds and gigabytes), so an encoded body is refused before it is read.
- On a loopback socket, the `Host` header must be a loopback name (localhost, 127.x.x.x, ::1), so
  a DNS-rebinding page that resolves its own name to 127.0.0.1 is refused.
- An optional bearer token (`Authorization: Bearer <token>`, compared in constant time) on every
  endpoint but `GET /health`. It is never required: an executor on loopback is reachable only from
  this machine; one bound to another address should have one (the command line warns).

The token comes from a file (`--token_file`) or from the environment variable TOKEN_ENV; the
executor client sends the same variable's value by default.
"""
from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path
from typing import Callable

TOKEN_ENV = "WORKFLOW_R1_EXECUTOR_TOKEN"


class GuardError(Exception):
    """A request refused before its handler: HTTP `status`, error `kind`, one-line `message`."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers


def load_token(token_file: str = "") -> str:
    """The bearer token: the stripped contents of `token_file` if given, else $WORKFLOW_R1_EXECUTOR_TOKEN,
    else "" (no token). ValueError with one line when the file is unreadable or empty."""
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"token file {token_file}: cannot read it ({type(exc).__name__}: "
                             f"{getattr(exc, 'strerror', None) or exc})") from None
        if not token:
            raise ValueError(f"token file {token_file} is empty; write the token on its first line")
        return token
    return os.environ.get(TOKEN_ENV, "").strip()


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine only."""
    host = host.strip().strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a `Host` header value, without the port: "[::1]:80" -> "::1", "a:80" -> "a"."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """The checks of one server. `check(...)` raises GuardError or returns None.

    token: the bearer token every request but GET /health must carry ("" = none).
    """

    def __init__(self, token: str = ""):
        self._expected = f"Bearer {token}".encode() if token else b""
        # Host header or local address -> is loopback; bounded, since callers choose the Host.
        self._loopback: dict[str, bool] = {}

    def _is_loopback(self, host: str) -> bool:
        known = self._loopback.get(host)
        if known is None:
            known = is_loopback(_host_name(host))
            if len(self._loopback) < 1024:
                self._loopback[host] = known
        return known

    def check(self, method: str, path: str, headers, local_address: Callable[[], str | None]) -> None:
        """Refuse the request (GuardError) unless it passes every check above.

        headers: the request's case-insensitive header mapping; local_address: returns the
        server-side address of the connection (None if unknown, e.g. a Unix socket: no Host
        check); called only when the Host is not a loopback name.
        """
        host = headers.get("Host", "")
        if not self._is_loopback(host):
            local = local_address()
            if local is not None and self._is_loopback(local):
                raise GuardError(403, "bad_host", f"Host {host!r} is not a loopback "
                                 "name; an executor on loopback answers only localhost, 127.0.0.1 or "
                                 "[::1] (this refuses DNS-rebinding pages)")
        if self._expected and not (method == "GET" and path == "/health"):
            given = headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, self._expected):
                raise GuardError(401, "unauthorized", "missing or wrong bearer token: send "
                                 f"'Authorization: Bearer <token>' (the client sends ${TOKEN_ENV})",
                                 {"WWW-Authenticate": "Bearer"})
        encoding = headers.get("Content-Encoding", "")
        if encoding and any(c.strip().lower() not in ("", "identity") for c in encoding.split(",")):
            raise GuardError(415, "bad_content_encoding", f"Content-Encoding {encoding[:64]!r}: "
                             "send the body uncompressed (Content-Encoding identity or none)")
        if method == "POST":
            content_type = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
            if content_type != "application/json":
                raise GuardError(415, "bad_content_type", f"Content-Type {content_type or 'none'!r}:"
                                 " send the request body as application/json")
