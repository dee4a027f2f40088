"""SGLang's API key check (``--api-key``), shared by the twin and the omni front (standard library only).

As SGLang (``python/sglang/srt/utils/auth.py``): with a key set, every request needs ``Authorization:
Bearer <key>`` (the scheme in any case) or ``x-api-key: <key>``, except OPTIONS and the paths starting
``/health``, ``/ready`` or ``/metrics`` (Kubernetes probes and Prometheus work without the secret);
anything else is answered 401 ``{"error": "Unauthorized"}``.
"""

from __future__ import annotations

import os
import secrets

# Where loadlab's servers (the twin, the omni front, `loadlab cluster`) read the key they require: the
# environment keeps it out of every process's command line (ps). The twin also takes SGLang's --api-key.
API_KEY_ENV = "LOADLAB_SERVER_API_KEY"
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
UNAUTHORIZED = b'{"error":"Unauthorized"}'


def needs_key(method: str, path: str) -> bool:
    """Whether SGLang asks a request for the key (it does for every path but the open ones)."""
    return method != "OPTIONS" and not path.startswith(OPEN_PREFIXES)


def authorized(authorization: str | None, x_api_key: str | None, key: str) -> bool:
    """SGLang's ``_check_token``: a Bearer token (scheme in any case) or an ``x-api-key`` equal to ``key``."""
    if authorization:
        parts = authorization.split(" ", 1)
        if len(parts) == 2 and parts[0].lower() == "bearer" and _same(parts[1], key):
            return True
    return bool(x_api_key) and _same(x_api_key, key)


def _same(given: str, key: str) -> bool:
    # Bytes: compare_digest refuses non-ASCII str, and a client may send anything.
    return secrets.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode())


def key_problem(key: str) -> str | None:
    """What makes ``key`` unusable (it travels in an HTTP header), or None; never quotes the key."""
    if not key:
        return "the API key is empty"
    if any(c.isspace() or not c.isprintable() for c in key) or not key.isascii():
        return "the API key must be printable ASCII without spaces"
    return None


def server_api_key(given: str | None = None) -> str | None:
    """The key a server requires: ``given`` (a command-line flag), else ``LOADLAB_SERVER_API_KEY``, else
    none (an open server)."""
    return given or os.environ.get(API_KEY_ENV, "").strip() or None
