# Sourced by demo.sh and test.sh: a .venv with this project installed, made once.
#
# torch: where a usable torch is already importable (a GPU box, a cluster image) it is reused
# (the venv sees the system site-packages); otherwise the CPU build pinned in constraints.txt
# is installed: plain `pip install torch` would pull a multi-GB CUDA build.
# Usage: source scripts/_env.sh [EXTRAS]     e.g. "dev"

_extras=${1:-}
_python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$_python" -c "import torch" >/dev/null 2>&1; then
    echo "[env] creating .venv on top of the torch already installed for $_python"
    "$_python" -m venv --system-site-packages .venv
  else
    echo "[env] creating .venv"
    "$_python" -m venv .venv
  fi
fi
# shellcheck disable=SC1091
source .venv/bin/activate

_stamp=".venv/.slime-meta-installed${_extras:+-$_extras}"
_want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ]; then
  _pip_args=(-q --disable-pip-version-check)
  if ! python -c "import torch" >/dev/null 2>&1; then
    echo "[env] installing torch (CPU build pinned in constraints.txt)"
    pip install "${_pip_args[@]}" -c constraints.txt torch
    _pip_args+=(-c constraints.txt)
  fi
  echo "[env] installing slime-meta${_extras:+[$_extras]}"
  pip install "${_pip_args[@]}" -e ".${_extras:+[$_extras]}"
  echo "$_want" > "$_stamp"
fi
