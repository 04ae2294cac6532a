#!/usr/bin/env bash
# compute-sanitizer over scripts/sanitize.py: memcheck on its 24 cases, then
# racecheck and synccheck on the 6-case --quick subset. One process, no
# children that touch the GPU, so --target-processes is not needed.
#
#   scripts/sanitize.sh              # forward cases; logs in $OUT (default ./out)
#   scripts/sanitize.sh --backward   # the backward's cases (sanitize.py --backward: 20 for
#                                    # memcheck, 7 for racecheck/synccheck); logs sanitize-bwd-*.txt
#
# Steps:
#   1. python scripts/sanitize.py without the sanitizer: checks the cases and
#      fills Triton's cache (TRITON_CACHE_DIR, default ~/.triton/cache), so the
#      runs under the tools load kernels instead of compiling them;
#   2. memcheck  -> $OUT/sanitize-memcheck.txt  (full output of the tool and the script)
#   3. racecheck -> $OUT/sanitize-racecheck.txt
#   4. synccheck -> $OUT/sanitize-synccheck.txt (barrier usage: every
#      bar.sync reached by the threads it counts, no divergent barrier)
# Only kernels named attention_forward_kernel are instrumented (with --backward:
# attention_backward_kernel, the Gluon kernel with the TMA reduce-add and the
# semaphores; SANITIZER_KERNELS=kns=_bwd_p instruments the Triton pre- and
# postprocess instead); PyTorch's own kernels, e.g. the reference's, run as usual. PyTorch's caching allocator is
# off under the tools, so each tensor is its own allocation and memcheck sees
# its true bounds. The tools' summary lines are printed last; the exit status
# is 0 only if every tool ran clean and every case matched the reference.
#
# Environment: OUT; PYTHON; COMPUTE_SANITIZER (the binary); TOOLS (default
# "memcheck racecheck synccheck": the tools to run, e.g. TOOLS=memcheck to fit
# a short device slot); WARMUP_TIMEOUT (default 300) for step 1; MEMCHECK_TIMEOUT,
# RACECHECK_TIMEOUT and SYNCCHECK_TIMEOUT (seconds, default 240 each); SANITIZER_ARGS (extra
# arguments for every tool, e.g. "--report-api-errors no"). Exit status 2
# when compute-sanitizer is not found.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODE=() TAG="" KERNELS=${SANITIZER_KERNELS:-kns=attention_forward_kernel}
if [ "${1:-}" = "--backward" ]; then
  MODE=(--backward) TAG="bwd-" KERNELS=${SANITIZER_KERNELS:-kns=attention_backward_kernel}
  shift
fi
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-$(command -v python || command -v python3)}
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$SAN" ]; then
  echo "$(basename "$0"): compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi
echo "== $("$SAN" --version | tail -n 1); kernel $(uname -r)"

echo "== warm-up run without the sanitizer"
if ! timeout "${WARMUP_TIMEOUT:-300}" "$PY" scripts/sanitize.py ${MODE[@]+"${MODE[@]}"}; then
  echo "sanitize.sh: scripts/sanitize.py failed without the sanitizer; not running the tools" >&2
  exit 1
fi

run_tool() {  # tool, time limit, sanitize.py arguments...
  local tool=$1 limit=$2
  shift 2
  local log="$OUT/sanitize-$TAG$tool.txt"
  echo "== $tool: python scripts/sanitize.py $* (log $log)"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 15 "$limit" \
    "$SAN" --tool "$tool" --error-exitcode 1 --kernel-name "$KERNELS" ${SANITIZER_ARGS:-} \
    "$PY" scripts/sanitize.py "$@" >"$log" 2>&1
  local rc=$?
  grep -E '^(case|warm-up|sanitize\.py)' "$log"
  case $rc in
    0) ;;
    124|137) echo "$tool: timed out after ${limit} s" ;;
    *) echo "$tool: exit status $rc" ;;
  esac
  return $rc
}

TOOLS=${TOOLS:-memcheck racecheck synccheck}
wanted() { [[ " $TOOLS " == *" $1 "* ]]; }
rc_mem=0 rc_race=0 rc_sync=0
if wanted memcheck; then
  run_tool memcheck "${MEMCHECK_TIMEOUT:-240}" ${MODE[@]+"${MODE[@]}"}
  rc_mem=$?
fi
if wanted racecheck; then
  run_tool racecheck "${RACECHECK_TIMEOUT:-240}" --quick ${MODE[@]+"${MODE[@]}"}
  rc_race=$?
fi
if wanted synccheck; then
  run_tool synccheck "${SYNCCHECK_TIMEOUT:-240}" --quick ${MODE[@]+"${MODE[@]}"}
  rc_sync=$?
fi

summarize() {  # tool
  local log="$OUT/sanitize-$TAG$1.txt"
  if grep -qE 'Device not supported|Target application terminated before first instrumented API call' "$log"; then
    echo "$1: the sanitizer could not attach to this GPU/runtime:"
    grep -m3 -E 'Device not supported|Target application|Error' "$log"
  fi
  # First findings (errors, hazards, API errors), then the summary lines.
  grep -m6 -E '^========= +(Invalid|Error|Race|Program hit|Warning|Hazard)' "$log" | sed "s/^/$1: /"
  if ! grep -qE 'sanitize\.py: all [0-9]+ cases OK' "$log"; then
    echo "$1: scripts/sanitize.py did not finish cleanly under the tool (see $log)"
  fi
  local summaries
  summaries=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log")
  if [ -n "$summaries" ]; then
    echo "$summaries" | sed "s/^/$1: /"
  else
    echo "$1: no summary line (timed out or crashed; see $log)"
  fi
}

echo "== summaries"
for tool in memcheck racecheck synccheck; do
  if wanted "$tool"; then summarize "$tool"; fi
done
[ "$rc_mem" -eq 0 ] && [ "$rc_race" -eq 0 ] && [ "$rc_sync" -eq 0 ]
