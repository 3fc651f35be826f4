#!/usr/bin/env bash
# Gather what the slime backend needs on a GPU host without network into one folder, on a machine
# that reaches PyPI (and GitHub, unless both sources are given). The host keeps its own torch
# 2.11.0+cu130; the bundle carries what it lacks or needs at another version
# (scripts/offline/gpu-host-py312.lock), slime and Megatron-LM at the commits this backend is
# checked against, Megatron already patched with slime's patches, slime's SGLang patches for the
# install to apply, and this project as a wheel. docs/cluster.md, "3. offline, from a bundle".
#
#   bash scripts/offline_bundle.sh OUT --dry-run                  # what would be fetched, from where
#   bash scripts/offline_bundle.sh OUT                            # everything (about 1.3 GiB)
#   bash scripts/offline_bundle.sh OUT --hopper-only \
#       --slime-src slime-624b824a.tar.gz --megatron-src ~/Megatron-LM   # H100/H200 only, no GitHub
#
# Then, on the host: bash OUT/install.sh OUT [--prefix DIR]   (scripts/offline_install.sh)
#
# --hopper-only: sglang-kernel without FlashAttention 3 (sgl_kernel/flash_ops.abi3.so, loaded only by
#   sgl_kernel/flash_attn.py) and without the Blackwell kernels (sgl_kernel/sm100/), no
#   flashinfer-cubin (flashinfer compiles its kernels with the host's nvcc instead); serve with
#   --attention-backend triton or flashinfer.
# --python X.Y: the host's Python (default 3.12); the lock scripts/offline/gpu-host-pyXY.lock must exist.
# --slime-src PATH: a slime checkout (git) or a tarball of slime's tree at the commit below.
# --megatron-src PATH: a Megatron-LM git checkout or mirror that has the commit below.
set -euo pipefail
REPO_DIR="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON=${PYTHON:-python3}

SLIME_COMMIT=624b824a898ab0ec1fcb4d373004c7f3852bf515      # docs/cluster.md: the slime this backend is checked against
MEGATRON_COMMIT=1dcf0dafa884ad52ffb243625717a3471643e087   # slime's docker/Dockerfile MEGATRON_COMMIT
SLIME_URL=https://github.com/THUDM/slime.git
MEGATRON_URL=https://github.com/NVIDIA/Megatron-LM.git
# slime's docker/Dockerfile applies these from docker/patch/latest, in this order
MEGATRON_PATCHES=(megatron.patch megatron-sglang-aligned.patch)
SGLANG_PATCHES=(sglang.patch sglang-top_p.patch sglang-release_hicache.patch sglang-pull_weights.patch
  sglang-deterministic.patch)

die() { echo "offline_bundle: $*" >&2; exit 2; }

OUT_DIR="" HOPPER_ONLY=0 PY_VERSION=3.12 SLIME_SRC="" MEGATRON_SRC="" DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --hopper-only) HOPPER_ONLY=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --python|--slime-src|--megatron-src)
      [ $# -ge 2 ] || die "$1 needs a value, e.g. $1 $( [ "$1" = --python ] && echo 3.12 || echo PATH)"
      case "$1" in
        --python) PY_VERSION=$2 ;;
        --slime-src) SLIME_SRC=$2 ;;
        --megatron-src) MEGATRON_SRC=$2 ;;
      esac
      shift ;;
    -*) die "unknown flag $1: use OUT_DIR [--hopper-only] [--python 3.12] [--slime-src PATH] [--megatron-src PATH] [--dry-run]" ;;
    *) [ -z "$OUT_DIR" ] || die "two output folders ($OUT_DIR, $1): give one OUT_DIR"; OUT_DIR=$1 ;;
  esac
  shift
done
[ -n "$OUT_DIR" ] || die "no OUT_DIR: bash scripts/offline_bundle.sh OUT_DIR [--hopper-only] [--dry-run]"
[[ "$PY_VERSION" =~ ^3\.[0-9]+$ ]] || die "--python $PY_VERSION: give the host's Python as X.Y, e.g. --python 3.12"
PY_TAG=${PY_VERSION/./}
LOCK="$REPO_DIR/scripts/offline/gpu-host-py$PY_TAG.lock"
[ -f "$LOCK" ] || die "--python $PY_VERSION: no lock file scripts/offline/gpu-host-py$PY_TAG.lock; use --python 3.12"
[ -z "$SLIME_SRC" ] || [ -e "$SLIME_SRC" ] || die "--slime-src $SLIME_SRC: not found; give a slime checkout or tarball"
[ -z "$MEGATRON_SRC" ] || [ -d "$MEGATRON_SRC" ] || die "--megatron-src $MEGATRON_SRC: not a folder; give a Megatron-LM git checkout"
if [ -e "$OUT_DIR" ] && [ -n "$(ls -A "$OUT_DIR" 2>/dev/null)" ] && [ "$DRY_RUN" = 0 ]; then
  die "OUT_DIR $OUT_DIR is not empty: give a new or empty folder"
fi

# The host's wheels: CPython X.Y on x86_64 glibc. Without manylinux_2_34, pip quietly picks
# sglang 0.5.10.post1, the last release not built for it.
PLATFORM_ARGS=(
  --python-version "$PY_VERSION" --implementation cp --abi "cp$PY_TAG" --abi abi3 --abi none
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
  --platform linux_x86_64 --platform any
)
DOWNLOAD_ARGS=(--no-deps --only-binary=:all: --require-hashes --disable-pip-version-check "${PLATFORM_ARGS[@]}")

# The pins to fetch: the lock without flashinfer-cubin under --hopper-only.
pins() {
  "$PYTHON" - "$LOCK" "$HOPPER_ONLY" <<'EOF'
import re, sys
text = re.sub(r"\\\n", " ", open(sys.argv[1]).read())
for line in text.splitlines():
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    if sys.argv[2] == "1" and line.startswith("flashinfer-cubin=="):
        continue
    print(line)
EOF
}

if [ "$DRY_RUN" = 1 ]; then
  echo "[dry run] would write $OUT_DIR (nothing is fetched now)"
  echo "[dry run] wheels/ from PyPI: $PYTHON -m pip download ${DOWNLOAD_ARGS[*]} -r <lock>, lock $LOCK:"
  pins | awk '{print "  " $1}'
  [ "$HOPPER_ONLY" = 0 ] || echo "[dry run] --hopper-only: flashinfer-cubin left out; sglang-kernel repacked without sgl_kernel/flash_ops.abi3.so and sgl_kernel/sm100/"
  echo "[dry run] wheels/: slime-meta, built from $REPO_DIR (pip wheel --no-deps)"
  echo "[dry run] src/slime.tar.gz: slime $SLIME_COMMIT from ${SLIME_SRC:-$SLIME_URL (git clone)}"
  echo "[dry run] src/Megatron-LM.tar.gz: Megatron-LM $MEGATRON_COMMIT from ${MEGATRON_SRC:-$MEGATRON_URL (git clone)}, patched with slime's ${MEGATRON_PATCHES[*]}"
  echo "[dry run] patches/sglang/: slime's ${SGLANG_PATCHES[*]} (python/sglang/ hunks only), applied by install.sh"
  exit 0
fi

mkdir -p "$OUT_DIR"/{wheels,src,patches/sglang}
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# git must not mistake a folder below WORK for part of an enclosing repository
export GIT_CEILING_DIRECTORIES="$WORK"

echo "[bundle] wheels from PyPI, checked against $LOCK"
pins > "$WORK/pins.txt"
"$PYTHON" -m pip download -q "${DOWNLOAD_ARGS[@]}" -r "$WORK/pins.txt" -d "$OUT_DIR/wheels"

if [ "$HOPPER_ONLY" = 1 ]; then
  echo "[bundle] --hopper-only: sglang-kernel without flash_ops.abi3.so and sm100/"
  "$PYTHON" - "$OUT_DIR"/wheels/sglang_kernel-*.whl <<'EOF'
# Rewrite the wheel in place without the Hopper-unneeded kernels; RECORD loses their lines.
import os, sys, zipfile
path = sys.argv[1]
drop = lambda n: n == "sgl_kernel/flash_ops.abi3.so" or n.startswith("sgl_kernel/sm100/")
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".new", "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if drop(info.filename):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not drop(line.split(",", 1)[0])).encode()
        dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(path + ".new", path)
EOF
fi

echo "[bundle] slime $SLIME_COMMIT"
mkdir -p "$WORK/slime"
if [ -z "$SLIME_SRC" ]; then
  git clone -q "$SLIME_URL" "$WORK/slime-git"
  SLIME_SRC="$WORK/slime-git"
fi
if [ -d "$SLIME_SRC" ] && git -C "$SLIME_SRC" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$SLIME_SRC" cat-file -e "$SLIME_COMMIT^{commit}" 2>/dev/null \
    || die "--slime-src $SLIME_SRC: commit $SLIME_COMMIT is missing; git fetch it there"
  git -C "$SLIME_SRC" archive "$SLIME_COMMIT" | tar -x -C "$WORK/slime"
elif [ -d "$SLIME_SRC" ]; then
  cp -a "$SLIME_SRC"/. "$WORK/slime/"
else
  tar -xf "$SLIME_SRC" -C "$WORK/slime"
  # a tarball of slime's tree, with or without one top folder
  if [ ! -f "$WORK/slime/setup.py" ] && [ "$(ls "$WORK/slime" | wc -l)" = 1 ]; then
    top="$WORK/slime/$(ls "$WORK/slime")"; mv "$top" "$WORK/slime.top"; rmdir "$WORK/slime"; mv "$WORK/slime.top" "$WORK/slime"
  fi
fi
[ -f "$WORK/slime/slime/backends/sglang_utils/arguments.py" ] \
  || die "--slime-src $SLIME_SRC: no slime tree in it (slime/backends/sglang_utils/arguments.py missing)"
PATCH_DIR="$WORK/slime/docker/patch/latest"
tar -czf "$OUT_DIR/src/slime.tar.gz" -C "$WORK" slime

echo "[bundle] Megatron-LM $MEGATRON_COMMIT with ${MEGATRON_PATCHES[*]}"
if [ -z "$MEGATRON_SRC" ]; then
  git clone -q "$MEGATRON_URL" "$WORK/megatron-git"
  MEGATRON_SRC="$WORK/megatron-git"
fi
git -C "$MEGATRON_SRC" cat-file -e "$MEGATRON_COMMIT^{commit}" 2>/dev/null \
  || die "--megatron-src $MEGATRON_SRC: commit $MEGATRON_COMMIT is missing; git fetch it there"
mkdir -p "$WORK/Megatron-LM"
git -C "$MEGATRON_SRC" archive "$MEGATRON_COMMIT" | tar -x -C "$WORK/Megatron-LM"
for p in "${MEGATRON_PATCHES[@]}"; do
  (cd "$WORK/Megatron-LM" && git apply "$PATCH_DIR/$p")
done
tar -czf "$OUT_DIR/src/Megatron-LM.tar.gz" -C "$WORK" Megatron-LM

echo "[bundle] slime's SGLang patches, python/sglang/ hunks (the wheel has no sgl-kernel/ or test/)"
for p in "${SGLANG_PATCHES[@]}"; do
  awk '/^diff --git /{keep = ($3 ~ /^a\/python\/sglang\//)} keep' "$PATCH_DIR/$p" > "$OUT_DIR/patches/sglang/$p"
  echo "$p" >> "$OUT_DIR/patches/sglang/series"
done

echo "[bundle] slime-meta wheel"
git -C "$REPO_DIR" ls-files -co --exclude-standard -z | (cd "$REPO_DIR" && tar --null -T - -c) \
  | (mkdir -p "$WORK/slime-meta" && tar -x -C "$WORK/slime-meta")
"$PYTHON" -m pip wheel -q --no-deps --disable-pip-version-check -w "$OUT_DIR/wheels" "$WORK/slime-meta"

cp "$REPO_DIR/scripts/offline_install.sh" "$OUT_DIR/install.sh"
cp "$LOCK" "$OUT_DIR/wheels.lock"
cat > "$OUT_DIR/bundle.txt" <<EOF
python=$PY_VERSION
slime=$SLIME_COMMIT
megatron=$MEGATRON_COMMIT
hopper_only=$HOPPER_ONLY
EOF
cat > "$OUT_DIR/README.txt" <<EOF
slime-meta offline bundle: what the slime backend needs on a GPU host without network that has
Python $PY_VERSION and torch 2.11.0+cu130 (slime-meta's docs/cluster.md, "3. offline, from a bundle").
wheels/   pinned wheels (wheels.lock), slime-meta's own wheel$( [ "$HOPPER_ONLY" = 1 ] && printf '%s' "; sglang-kernel repacked for Hopper
          (no sgl_kernel/flash_ops.abi3.so, no sgl_kernel/sm100/), no flashinfer-cubin" )
src/      slime $SLIME_COMMIT, Megatron-LM $MEGATRON_COMMIT with slime's patches
patches/  slime's SGLang patches, applied by install.sh onto the installed sglang
Install:  bash install.sh . [--prefix DIR]    then: source DIR/env.sh (default DIR: ./site)
Every file's sha256 is in MANIFEST.sha256; install.sh checks it first.
EOF
(cd "$OUT_DIR" && find . -type f ! -name MANIFEST.sha256 -printf '%P\n' | LC_ALL=C sort | xargs -d '\n' sha256sum > MANIFEST.sha256)
echo "[bundle] $OUT_DIR: $(du -sh "$OUT_DIR" | cut -f1), $(ls "$OUT_DIR/wheels" | wc -l) wheels"
