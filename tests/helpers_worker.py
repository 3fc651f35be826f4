"""An embedded worker as a user starts it (`python -m slime_meta_engine`), and JSON over HTTP to it.

The worker picks a free port itself (`--port 0`) and prints `worker ready on URL` once it serves;
its stderr goes to a log file whose text is the failure message when it never gets there.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_PREFIX = "worker ready on http://127.0.0.1:"


@contextlib.contextmanager
def embedded_worker(
    model_path: Path | str,
    log_path: Path,
    *flags: str,
    device: str = "cpu",
    dtype: str | None = "float32",
    startup_timeout_s: float = 120,
) -> Iterator[str]:
    """A worker on `model_path` with `flags` added; yields its URL and stops it after.

    `dtype` None leaves the worker its own default (bfloat16 on CUDA)."""
    command = [
        sys.executable,
        "-m",
        "slime_meta_engine",
        "--model-path",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--device",
        device,
        *(["--dtype", dtype] if dtype else []),
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, env=env)
    # Read the ready line in a thread: a worker that hangs before printing it must not hang the test.
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(process.stdout.readline().decode()), daemon=True)
    reader.start()
    reader.join(startup_timeout_s)
    try:
        assert ready and ready[0].startswith(READY_PREFIX), log_path.read_text()
        yield ready[0].split()[-1]
    finally:
        process.terminate()
        process.wait(10)


def post(url: str, body: Any, raw: bytes | None = None, timeout_s: float = 60) -> tuple[int, Any]:
    """POST `body` as JSON (or `raw` bytes as they are); the status and the decoded JSON answer."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
