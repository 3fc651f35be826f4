"""Running a test module's checks under Triton's CPU interpreter, in a child process.

TRITON_INTERPRET=1 must be set before triton is imported, so the checks run in a child that
executes the test file as a script; its last stdout line is a JSON object of results.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def run_interpreted(test_file: str, timeout_s: float = 600) -> dict:
    """Run `test_file` as a script with TRITON_INTERPRET=1; return the JSON of its last line (once
    per file and session: later calls get the same results)."""
    # The child runs the file as a script: the repository root must be on its path.
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    child = subprocess.run([sys.executable, str(test_file)], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])
