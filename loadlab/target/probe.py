"""Asking a target who it is: ``/server_info`` and, for the OpenAI APIs, ``/v1/models``."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urljoin

import orjson
from geventhttpclient import URL, HTTPClient


class TargetError(Exception):
    """The target cannot be used; the message is the one line to print."""


def get_json(base_url: str, path: str, timeout_s: float = 10.0) -> tuple[int, Any]:
    """GET base_url + path; returns (status, decoded JSON or None)."""
    url = URL(urljoin(base_url.rstrip("/") + "/", path.lstrip("/")))
    client = HTTPClient.from_url(url, connection_timeout=timeout_s, network_timeout=timeout_s)
    try:
        resp = client.get(url.request_uri)
        body = resp.read()
        try:
            return resp.status_code, orjson.loads(body)
        except orjson.JSONDecodeError:
            return resp.status_code, None
    finally:
        client.close()


def probe(base_url: str, need_model: bool, wait_s: float = 0.0) -> dict[str, Any]:
    """Checks the target answers and returns {"server_info": ..., "model": ...}.

    Raises TargetError with one line when it cannot be reached. ``wait_s`` retries connection errors for
    that long (a server that is still starting)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = _first_json(base_url, ("/server_info", "/get_server_info"))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TargetError(f"cannot reach target {base_url}: {e.strerror or e}") from None
            time.sleep(0.5)
    model = None
    if need_model:
        status, models = get_json(base_url, "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if status != 200 or not data:
            raise TargetError(
                f"target {base_url}: GET /v1/models gave no model (HTTP {status}); set target.model or --model"
            )
        model = data[0].get("id")
    return {"server_info": info, "model": model}


def _first_json(base_url: str, paths: tuple[str, ...]) -> Any:
    for path in paths:
        status, data = get_json(base_url, path)
        if status == 200 and isinstance(data, dict):
            return data
    return None
