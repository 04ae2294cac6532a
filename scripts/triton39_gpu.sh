#!/usr/bin/env bash
# The GPU suite under triton 3.9.0 on the device machine, which has triton
# 3.6.0 installed and no network. The cp312 wheel (~286 MB) travels in parts
# of 55 MiB (each under the 64 MiB carry limit of one call), gathered in /tmp
# over consecutive calls while the machine stays warm, then installed with
# `pip --no-deps --target` and put first on PYTHONPATH. torch stays 2.11.
#
# Prepare (CPU machine, once; /.whl39/ is git-ignored through .git/info/exclude):
#   mkdir -p .whl39 && cd .whl39
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --abi cp312 --platform manylinux_2_28_x86_64 triton==3.9.0 -d .
#   split -b 55M -d -a 2 triton-3.9.0-*.whl triton-3.9.0-cp312.whl.part-
#
# On the device, one call per part, back to back (a cold machine loses /tmp;
# `status` says which parts are there):
#   run: bash scripts/triton39_gpu.sh gather .whl39/triton-3.9.0-cp312.whl.part-00
#        carry: [".whl39/triton-3.9.0-cp312.whl.part-00"]        (then -01 ... -04)
#   run: bash scripts/triton39_gpu.sh install-and-test [pytest args]
#
# Each part is kept under its own name, so gathering one twice (a retried
# call) does no harm; install-and-test joins them in name order and checks
# the wheel's sha256 before installing.
set -euo pipefail

WHEEL=triton-3.9.0-cp312-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
SHA256=5e52ab4e2f1d64f0ac494c9aa723697b793f81a91c4cae4c36608ca0bc4267bf
NPARTS=5
T=/tmp/t39
SITE=/tmp/t39site
OUT=${OUT:-$T/out}

usage() { echo "usage: $0 gather PART | status | install-and-test [pytest args] | reset" >&2; exit 2; }

status() {
  local n
  n=$(ls "$T"/parts 2>/dev/null | wc -l)
  echo "parts gathered: $n of $NPARTS"
  ls -l "$T"/parts 2>/dev/null | tail -n +2 || true
  [ -d "$SITE/triton" ] && echo "installed: $SITE" || true
}

case "${1:-}" in
  gather)
    part=${2:-}; [ -f "$part" ] || { echo "no such part: '$part' (did the call carry it?)" >&2; exit 1; }
    mkdir -p "$T/parts"
    cp "$part" "$T/parts/$(basename "$part")"
    status
    ;;
  status)
    status
    ;;
  reset)
    rm -rf "$T" "$SITE"
    ;;
  install-and-test)
    shift
    if [ ! -d "$SITE/triton" ]; then
      n=$(ls "$T"/parts 2>/dev/null | wc -l)
      [ "$n" -eq "$NPARTS" ] || { status; echo "need all $NPARTS parts first" >&2; exit 1; }
      cat "$T"/parts/* > "$T/wheel.part"
      echo "$SHA256  $T/wheel.part" | sha256sum -c -
      mv "$T/wheel.part" "$T/$WHEEL"   # pip wants the wheel's own file name
      python -m pip install --quiet --no-deps --no-index --target "$SITE" "$T/$WHEEL"
    fi
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
    # The triton the tests will see, first: the --target copy must shadow the
    # image's 3.6.0.
    python -c "import triton, torch; print('triton', triton.__version__, triton.__file__); print('torch', torch.__version__)"
    python -c "import triton; assert triton.__version__ == '3.9.0', triton.__version__"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    # Compile-only census under this triton (no GPU needed, quick), then the GPU suite.
    # (CENSUS=0 skips it: CI runs the same census under 3.9.0 on every change.)
    [ "${CENSUS:-1}" = 0 ] || python -m hopper_flash.compile_check 2>/dev/null | tee "$OUT/census-3.9.0.txt"
    set +e
    timeout "${SUITE_TIMEOUT:-520}" python -m pytest -m gpu -q -rs --timeout 300 -p no:cacheprovider "$@" 2>&1 \
      | tee "$OUT/pytest-gpu-triton-3.9.0.log" | grep -v -E "^(nanobind| - leaked|See https://nanobind)" | tail -40
    rc=${PIPESTATUS[0]}
    echo "pytest exit status: $rc (log: $OUT/pytest-gpu-triton-3.9.0.log)"
    exit "$rc"
    ;;
  *)
    usage
    ;;
esac
