#!/usr/bin/env bash
# Run the test suite: makes .venv if missing, installs with the dev extras, runs pytest.
#   scripts/test.sh                  # everything but the slow soak tests
#   scripts/test.sh -k router -x     # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh dev
exec python -m pytest -q -m "not slow" "$@"
