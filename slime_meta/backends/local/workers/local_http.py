"""HTTP between this process and its local workers and routers: loopback calls, no proxies, JSON."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

ROUTER_CALL_TIMEOUT_S = 10.0

# No proxies: these are loopback addresses, and an http_proxy variable must not reroute them.
LOOPBACK_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with LOOPBACK_OPENER.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def http_json(method: str, url: str, body: Any = None, timeout_s: float = ROUTER_CALL_TIMEOUT_S) -> tuple[int, Any]:
    """(status, parsed JSON body or None) of one request; HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with LOOPBACK_OPENER.open(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None
