#!/usr/bin/env bash
# Install a bundle made by scripts/offline_bundle.sh on a GPU host without network (the bundle
# carries this script as install.sh). Nothing here reaches the network: pip runs with --no-index.
#
#   bash BUNDLE/install.sh BUNDLE                   # into BUNDLE/site
#   bash BUNDLE/install.sh BUNDLE --prefix /opt/slime-offline
#   source /opt/slime-offline/env.sh                # PYTHONPATH, PATH, SLIME_DIR, MEGATRON_DIR
#
# 1. every file against MANIFEST.sha256 (a differing or missing file: exit 2, naming it);
# 2. the wheels into PREFIX/site-packages with pip --target, apart from the host's own
#    site-packages, so the host's torch stays and the bundle's numpy 1.26 (Megatron asserts 1.x),
#    transformers 5.12.1 and the rest come first on PYTHONPATH only where env.sh is sourced;
# 3. slime's SGLang patches onto the installed sglang (patches/sglang/series, in order);
# 4. slime and the patched Megatron-LM unpacked into PREFIX/src;
# 5. PREFIX/env.sh, and the one `export PYTHONPATH=...` line it holds.
# PYTHON (default python3) must be the host's Python of the bundle (bundle.txt: python=3.12).
set -euo pipefail
PYTHON=${PYTHON:-python3}

die() { echo "offline_install: $*" >&2; exit 2; }

BUNDLE="" PREFIX=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix)
      [ $# -ge 2 ] || die "--prefix needs a folder, e.g. --prefix /opt/slime-offline"
      PREFIX=$2; shift ;;
    -*) die "unknown flag $1: use BUNDLE_DIR [--prefix DIR]" ;;
    *) [ -z "$BUNDLE" ] || die "two bundles ($BUNDLE, $1): give one BUNDLE_DIR"; BUNDLE=$1 ;;
  esac
  shift
done
[ -n "$BUNDLE" ] || die "no BUNDLE_DIR: bash install.sh BUNDLE_DIR [--prefix DIR]"
[ -f "$BUNDLE/MANIFEST.sha256" ] || die "$BUNDLE/MANIFEST.sha256 not found: give the folder offline_bundle.sh wrote"
BUNDLE="$(cd "$BUNDLE" && pwd)"
PREFIX=${PREFIX:-$BUNDLE/site}

echo "[install] checking $BUNDLE/MANIFEST.sha256"
bad=$(cd "$BUNDLE" && sha256sum -c --quiet MANIFEST.sha256 2>/dev/null | sed -n '1s/: FAILED.*//p' || true)
[ -z "$bad" ] || die "$BUNDLE/$bad differs from MANIFEST.sha256 or is missing: copy the bundle again"

want=$(sed -n 's/^python=//p' "$BUNDLE/bundle.txt")
have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
  || die "PYTHON=$PYTHON does not run: set PYTHON to the host's python$want"
[ "$have" = "$want" ] || die "PYTHON=$PYTHON is Python $have, the bundle's wheels are for $want: set PYTHON=python$want"

SITE="$PREFIX/site-packages"
mkdir -p "$SITE" "$PREFIX/src"
PREFIX="$(cd "$PREFIX" && pwd)"
SITE="$PREFIX/site-packages"

echo "[install] $(ls "$BUNDLE"/wheels/*.whl | wc -l) wheels -> $SITE"
PIP_ARGS=(--no-index --no-deps --find-links "$BUNDLE/wheels" --target "$SITE" --upgrade
  --disable-pip-version-check --no-warn-script-location --no-compile -q)
PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install "${PIP_ARGS[@]}" "$BUNDLE"/wheels/*.whl

if [ -s "$BUNDLE/patches/sglang/series" ]; then
  [ -d "$SITE/sglang" ] || die "$BUNDLE/patches/sglang: the bundle has SGLang patches but no sglang wheel"
  while read -r p; do
    [ -n "$p" ] || continue
    echo "[install] sglang: $p"
    # the patches name python/sglang/...; the installed package is SITE/sglang/...
    if command -v patch >/dev/null; then
      patch -p2 -d "$SITE" --forward --batch -s < "$BUNDLE/patches/sglang/$p" \
        || die "$BUNDLE/patches/sglang/$p does not apply to $SITE/sglang: install into an empty --prefix"
    else
      (cd "$SITE" && GIT_CEILING_DIRECTORIES="$SITE" git apply -p2 "$BUNDLE/patches/sglang/$p") \
        || die "$BUNDLE/patches/sglang/$p does not apply (or neither patch nor git is installed)"
    fi
  done < "$BUNDLE/patches/sglang/series"
fi

for src in slime Megatron-LM; do
  if [ -f "$BUNDLE/src/$src.tar.gz" ]; then
    echo "[install] $src -> $PREFIX/src/$src"
    rm -rf "${PREFIX:?}/src/$src"
    tar -xzf "$BUNDLE/src/$src.tar.gz" -C "$PREFIX/src"
  fi
done

LINE="export PYTHONPATH=$SITE:$PREFIX/src/Megatron-LM:$PREFIX/src/slime\${PYTHONPATH:+:\$PYTHONPATH}"
cat > "$PREFIX/env.sh" <<EOF
# slime-meta's offline bundle ($BUNDLE): source it before train.py, ray start and the launch scripts
$LINE
export PATH=$SITE/bin\${PATH:+:\$PATH}
export SLIME_DIR=$PREFIX/src/slime
export MEGATRON_DIR=$PREFIX/src/Megatron-LM
EOF
echo "[install] done; source $PREFIX/env.sh, or:"
echo "$LINE"
