#!/usr/bin/env bash
# The shipped kernels timed under two triton releases on one GPU: the device
# image's (3.6.0, beside torch 2.11) and another from
# scripts/triton_gpu_tarball.sh's tarball (carry .whltar), in alternating
# processes with SDPA cuDNN beside in each (the judge between processes: the
# power cap moves a process's medians by a few percent). Every figure in
# BENCHMARKS.md so far is triton 3.6.0's, while a CUDA torch 2.12-2.15 pins
# 3.7-3.9, whose compiles differ (spills in the per-batch-length modes, other
# schedules: BENCHMARKS.md, forty-eighth to fifty-first sessions).
#
#   CPU:    bash scripts/triton_gpu_tarball.sh prepare 3.7.1
#   device: bash scripts/triton_ab_bench.sh 3.7.1 benchmarks/decode.json benchmarks/triton-ab.json [-- BENCH ARGS]
#           (carry .whltar; AB_ROUNDS rounds, default 2; JSON per process under $OUT,
#           ab-CONFIG-TRITON-ROUND.json: two configs fill the eight files a call brings back)
set -uo pipefail
version=${1:?usage: triton_ab_bench.sh VERSION CONFIG... [-- BENCH ARGS]}; shift
configs=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do configs+=("$1"); shift; done
[ "${1:-}" = -- ] && shift
OUT=${OUT:-out}; mkdir -p "$OUT"
site=/tmp/triton-$version
[ -d "$site/triton" ] || { mkdir -p "$site" && tar -xJf ".whltar/triton-$version-cp312.tar.xz" -C "$site"; } || exit 1
image=$(python -c "import triton; print(triton.__version__)")
for round in $(seq "${AB_ROUNDS:-2}"); do
  for cfg in "${configs[@]}"; do
    tag=$(basename "$cfg" .json)
    for side in "$image" "$version"; do
      # -P: the checkout's package through PYTHONPATH only; TRITON_BACKENDS_IN_TREE
      # for the tarball's triton, which has no AMD backend (triton_gpu_tarball.sh).
      if [ "$side" = "$image" ]; then env=(PYTHONPATH=.); else env=(PYTHONPATH="$site:." TRITON_BACKENDS_IN_TREE=1); fi
      echo "== $tag, triton $side, round $round"
      env "${env[@]}" timeout "${AB_TIMEOUT:-240}" python -P -m hopper_flash.bench \
        --quiet --rep-ms "${REP_MS:-100}" --warmup-ms 30 --config "$cfg" --backends hopper_flash sdpa-cudnn "$@" \
        --json "$OUT/ab-$tag-$side-$round.json" 2>&1 | grep -v -E '^(nanobind| - leaked| - \.\.\. skipped|See https://nanobind)' | tail -14
    done
  done
done
