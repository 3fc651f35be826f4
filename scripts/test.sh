#!/usr/bin/env bash
# Run the test suite: makes .venv if missing, installs with the dev extras, checks formatting and lint
# (ruff, configured in pyproject.toml), runs pytest.
#   scripts/test.sh                  # everything but the slow soak tests
#   scripts/test.sh -k router -x     # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh dev
python -m ruff format --check --quiet . || { echo "formatting differs: run 'ruff format .'" >&2; exit 1; }
python -m ruff check --quiet . || { echo "lint errors above: fix them, or 'ruff check --fix .'" >&2; exit 1; }
exec python -m pytest -q -m "not slow" --durations=30 "$@"
