"""Asking a target who it is: ``/server_info`` and, for the OpenAI APIs, ``/v1/models``; with the run's API
key when it has one. A secured target that refuses (401, 403) ends the start with one line naming the
endpoint."""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any
from urllib.parse import urljoin

import orjson
from geventhttpclient import URL, HTTPClient

from loadlab.profile import API_KEY_ENV, auth_headers, redact


class TargetError(Exception):
    """The target cannot be used; the message is the one line to print."""


class TargetAuthError(TargetError):
    """The target refused loadlab's credentials (HTTP 401 or 403): waiting will not help."""


def get_json(
    base_url: str, path: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """GET base_url + path; returns (status, decoded JSON or None)."""
    url = URL(urljoin(base_url.rstrip("/") + "/", path.lstrip("/")))
    client = HTTPClient.from_url(url, connection_timeout=timeout_s, network_timeout=timeout_s)
    try:
        resp = client.get(url.request_uri, headers=headers or {})
        body = resp.read()
        try:
            return resp.status_code, orjson.loads(body)
        except orjson.JSONDecodeError:
            return resp.status_code, None
    finally:
        client.close()


def probe(
    base_url: str,
    need_model: bool,
    wait_s: float = 0.0,
    api_key: str | None = None,
    key_source: str | None = None,
) -> dict[str, Any]:
    """Checks the target answers and returns {"server_info": ..., "model": ...}.

    Raises TargetError with one line when it cannot be reached, TargetAuthError when it refuses the key
    (or wants one). ``wait_s`` retries connection errors for that long (a server that is still starting).
    ``api_key`` is sent as ``Authorization: Bearer``; ``key_source`` says where it came from (messages).
    The server_info returned has no API key in it (SGLang lists its server arguments, ``api_key`` too)."""
    headers = auth_headers(api_key)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = _first_json(base_url, ("/server_info", "/get_server_info"), headers, api_key, key_source)
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TargetError(f"cannot reach target {base_url}: {e.strerror or e}") from None
            time.sleep(0.5)
    model = None
    if need_model:
        status, models = get_json(base_url, "/v1/models", headers=headers)
        _check_auth(base_url, "/v1/models", status, api_key, key_source)
        data = models.get("data") if isinstance(models, dict) else None
        if status != 200 or not data:
            raise TargetError(
                f"target {base_url}: GET /v1/models gave no model (HTTP {status}); set target.model or --model"
            )
        model = data[0].get("id")
    return {"server_info": redact(info, api_key, hide_named=True), "model": model}


def _first_json(base_url: str, paths: tuple[str, ...], headers, api_key, key_source) -> Any:
    for path in paths:
        status, data = get_json(base_url, path, headers=headers)
        _check_auth(base_url, path, status, api_key, key_source)
        if status == 200 and isinstance(data, dict):
            return data
    return None


def _check_auth(base_url: str, path: str, status: int, api_key: str | None, key_source: str | None) -> None:
    if status in REFUSED:
        raise TargetAuthError(refusal(base_url, f"GET {path}", status, api_key, key_source))


REFUSED = (401, 403)  # the target's answer to missing or wrong credentials


def refusal(base_url: str, request: str, status: int, api_key: str | None, key_source: str | None) -> str:
    """The one line for a target that refused a request (``request``: ``GET /server_info``) for want of
    credentials: whether a key was sent, and where it came from (never the key)."""
    said = f"target {base_url}: {request}: HTTP {status} {HTTPStatus(status).phrase}"
    if api_key:
        return f"{said}: the target refused the API key from {key_source or 'the run'}"
    return (
        f"{said}: the target wants an API key and none was sent (set {API_KEY_ENV}, or name the variable "
        "or file holding it in the profile: target.api_key_env, target.api_key_file)"
    )
