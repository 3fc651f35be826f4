"""scripts/demo.sh hands its arguments to the run, not to the environment setup it sources first."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_flags_reach_the_run_and_not_the_install(tmp_path):
    for name in ("scripts/demo.sh", "scripts/_env.sh", "pyproject.toml", "constraints.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    # The run itself, replaced by one that prints what it was given.
    (tmp_path / "scripts/run_synthetic.sh").write_text('echo "run got: $*"\n')
    # A .venv already made and installed (no extras), as after a first demo.
    venv = tmp_path / ".venv/bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text(f'export PATH="{venv}:$PATH"\n')
    os.symlink(sys.executable, venv / "python")
    stamp = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + (REPO / "constraints.txt").read_bytes())
    (tmp_path / ".venv/.slime-meta-installed").write_text(stamp.hexdigest()[:16] + "\n")

    done = subprocess.run(
        ["bash", "scripts/demo.sh", "--use-tis", "--lr", "1e-4"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "run got: --use-tis --lr 1e-4" in done.stdout
    assert "installing" not in done.stdout + done.stderr  # the flags named no extras to install
