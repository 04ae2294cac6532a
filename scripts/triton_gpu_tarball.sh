#!/usr/bin/env bash
# Another triton release on the device machine (torch 2.11 + triton 3.6.0
# there, Python 3.12, no network) in ONE carry of the 64 MiB limit, instead of
# scripts/triton39_gpu.sh's five gathered parts: the cp312 wheel without what
# a CUDA run of hopper_flash never loads (the AMD backend, Blackwell's ptxas,
# which 3.8+ only look up by name, proton, CUPTI, instrumentation, FileCheck)
# and with libtriton.so's debug sections stripped, as one tar.xz (triton
# 3.7.1: 198 MB wheel -> 51 MB; 3.9.0: 55 MB).
#
#   CPU:    bash scripts/triton_gpu_tarball.sh prepare 3.7.1
#           (writes .whltar/triton-3.7.1-cp312.tar.xz; add /.whltar/ to .git/info/exclude)
#   device: bash scripts/triton_gpu_tarball.sh run 3.7.1 tests/test_c_launch_gpu.py
#           (carry: [".whltar"]; any pytest arguments; default: the C-launch GPU tests)
#
# Without the AMD backend, triton's entry-point discovery fails (the dist-info
# still names it), so the run sets TRITON_BACKENDS_IN_TREE=1: only backends
# present in the tree load. The twenty-seventh session ran the whole GPU
# suite under 3.7.1 this way (BENCHMARKS.md).
set -euo pipefail
cmd=${1:?usage: $0 prepare VERSION | run VERSION [pytest args]}
version=${2:?triton version, e.g. 3.7.1}
shift 2
tarball=.whltar/triton-$version-cp312.tar.xz

case $cmd in
  prepare)
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --platform manylinux_2_28_x86_64 "triton==$version" -d "$work"
    mkdir "$work/x"
    python -m zipfile -e "$work"/triton-"$version"-*.whl "$work/x"
    (cd "$work/x" && rm -rf triton/backends/amd triton/backends/nvidia/bin/ptxas-blackwell triton/_C/libproton.so \
      triton/backends/nvidia/lib/cupti triton/backends/nvidia/lib/cupti-blackwell triton/instrumentation \
      triton/FileCheck)
    strip --strip-unneeded "$work/x/triton/_C/libtriton.so"
    # zipfile drops the mode bits: ptxas and friends must stay executable.
    chmod +x "$work"/x/triton/backends/nvidia/bin/*
    # 3.8+ look Blackwell's ptxas up by name on every compile, sm_90 included.
    ln -s ptxas "$work/x/triton/backends/nvidia/bin/ptxas-blackwell"
    mkdir -p .whltar
    (cd "$work/x" && tar -cf - triton "triton-$version.dist-info") | xz -6 -T0 > "$tarball"
    ls -l "$tarball"
    ;;
  run)
    site=/tmp/triton-$version
    [ -d "$site/triton" ] || { mkdir -p "$site" && tar -xJf "$tarball" -C "$site"; }
    export TRITON_BACKENDS_IN_TREE=1 PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
    python -c "import triton, torch; print('triton', triton.__version__, 'from', triton.__file__, '| torch', torch.__version__)"
    python -m pytest -m gpu -q -rs --timeout 300 -p no:cacheprovider -p no:benchmark "${@:-tests/test_c_launch_gpu.py}"
    ;;
  *)
    echo "usage: $0 prepare VERSION | run VERSION [pytest args]" >&2
    exit 2
    ;;
esac
