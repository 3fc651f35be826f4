#!/usr/bin/env bash
# Run the test suite: makes .venv if missing, installs with the dev extras, checks formatting and lint
# (ruff, configured in pyproject.toml), runs pytest. With slime's vendored source next to the repository
# (../shared/vendor/slime-*.tar.gz, as in CI) it is extracted once outside the repository and the slime
# tests run against it through SLIME_SRC; a SLIME_SRC already set wins.
#   scripts/test.sh                  # everything but the slow soak tests
#   scripts/test.sh -k router -x     # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh dev
python -m ruff format --check --quiet . || { echo "formatting differs: run 'ruff format .'" >&2; exit 1; }
python -m ruff check --quiet . || { echo "lint errors above: fix them, or 'ruff check --fix .'" >&2; exit 1; }

# Extracted into a temporary folder and renamed into place, so an interrupted or concurrent run never
# leaves a half tree; the checksum stamp says which tarball the tree came from.
slime_src_from_vendor() {
  local tarball dest name sum tmp
  tarball=$(find ../shared/vendor -maxdepth 1 -name 'slime-*.tar.gz' 2>/dev/null | sort | tail -n 1)
  [ -n "$tarball" ] || return 0
  dest="${TMPDIR:-/tmp}/slime-meta-vendor"
  name=$(basename "$tarball" .tar.gz)
  sum=$(sha256sum "$tarball" | cut -d' ' -f1)
  if [ "$(cat "$dest/$name.sha256" 2>/dev/null)" != "$sum" ] || [ ! -f "$dest/$name/slime/utils/arguments.py" ]; then
    mkdir -p "$dest"
    tmp=$(mktemp -d "$dest/.extract.XXXXXX")
    tar xzf "$tarball" -C "$tmp" || { rm -rf "$tmp"; return 1; }
    rm -rf "$dest/$name" "$dest/$name.sha256"
    mv -T "$tmp/$name" "$dest/$name" 2>/dev/null || true # a concurrent run may have put its own there first
    rm -rf "$tmp"
    echo "$sum" >"$dest/$name.sha256"
  fi
  echo "$dest/$name"
}
if [ -z "${SLIME_SRC:-}" ]; then
  SLIME_SRC=$(slime_src_from_vendor)
  [ -z "$SLIME_SRC" ] || { export SLIME_SRC; echo "[test] SLIME_SRC=$SLIME_SRC (vendored slime source)"; }
fi
exec python -m pytest -q -m "not slow" --durations=30 "$@"
