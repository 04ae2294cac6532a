#!/usr/bin/env bash
# A session's device work on one warm H200, in few calls (the machine is
# given back after ~30 s idle, so make each call right after the last):
#
#   run (carry .fa3):  bash scripts/device_session.sh tests
#       FA3's build starts in the background (its own process session, so it
#       outlives the call; ~3 min on 16 cores), then the whole GPU suite runs,
#       4 workers (SUITE_WORKERS), each test capped at 100 s: a hang (a barrier deadlock, say)
#       costs one test, not the call. Log: $OUT/pytest-gpu.log.
#   run (carry .fa3):  bash scripts/device_session.sh bench [prefill decode bwd]
#       waits for the FA3 build (starting it if no call on this machine
#       has), then scripts/bench_h200.sh with FA3 on the path; JSON per block
#       under $OUT.
#   run [carry .fa3]:  bash scripts/device_session.sh vtests NAME [PYTEST PATHS]
#       a measurement variant's GPU tests alone (default: the whole suite);
#       with .fa3 carried FA3's build starts in the background first, as in
#       tests, so that a screen right after it finds FA3 built.
#   run (carry .fa3):  bash scripts/device_session.sh screen CONFIG.json NAME... [-- BENCH ARGS]
#       several variants timed without their tests: two rounds (SCREEN_ROUNDS), each a
#       process for the shipped package and then one per variant, FA3 and
#       SDPA cuDNN beside (waits for FA3's build, as bench does, unless
#       SCREEN_FA3=0); JSON per process. At most 8
#       files come back from a call: three variants fill them (2 rounds x 4).
#       A NAME that is a folder is a package copy timed as it is (another
#       branch against the checked-out tree).
#   run (carry .fa3 .wt): bash scripts/device_session.sh vscreen NAME... [-- BATCHES]
#       the varlen block (`--varlen 512:8192`) for the checked-out tree and
#       each NAME (a package copy folder or a variant), alternating processes,
#       two rounds (SCREEN_ROUNDS), per batch size (default 16 32), FA3's varlen beside
#       (waits for its build, as bench does); JSON per process
#       (vl-TAG-BATCH-ROUND.json: eight files with one NAME and two batch
#       sizes). VSCREEN_ARGS: more bench arguments (e.g. "--headdim 64"),
#       VSCREEN_TAG: a word for their JSON names (vl-WORD-TAG-...).
#   run (carry .wt [.fa3]): bash scripts/device_session.sh branches .wt/NAME[:FILE,FILE] ...
#       other branches' GPU tests, each from its own tree (see the case below).
#   run (carry .fa3 .wt): bash scripts/device_session.sh pscreen SCRIPT [ARGS] -- NAME...
#       a timing script (its own judge, FA3 beside) for the checked-out tree
#       and each package copy NAME, alternating processes, two rounds.
#   run:               bash scripts/device_session.sh memcheck
#       compute-sanitizer memcheck on the forward and backward cases.
#   run:               bash scripts/device_session.sh variant NAME CONFIG.json [BENCH ARGS]
#       a measurement variant (scripts/kernel_variant.py NAME): its GPU tests
#       ($VARIANT_TESTS, default tests/test_forward_gpu.py), then two rounds of
#       alternating processes, the shipped package and the variant, each next
#       to SDPA cuDNN (and FA3 once built) on CONFIG (e.g. benchmarks/d64.json);
#       JSON per process.
# The triton 3.9.0 suite has its own script (scripts/triton39_gpu.sh).
# The device's copy of the tree may carry a stale .git (the thirteenth
# session's bench headers named the session's first commit, "-dirty"): start
# each run's command with `export HOPPER_FLASH_COMMIT=<git describe --always
# --dirty, run here>;` so that the JSON and the headers name the tree measured.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
quiet() { grep -v -E '^(nanobind| - leaked| - \.\.\. skipped|See https://nanobind)'; }
build_variant() { python scripts/kernel_variant.py "$1" "/tmp/variant-$1" > /dev/null; }
# The screens' labels: "shipped" (the checked-out tree), a folder (a package
# copy, e.g. another branch's tree: `git archive main hopper_flash | tar -x
# -C .wt/main`, carry .wt) or a variant's name. build_variants makes the
# variants; package_of prints a label's package path and its JSON tag.
build_variants() { for name in "$@"; do [ -d "$name" ] || build_variant "$name" || return 1; done; }
package_of() {
  if [ "$1" = shipped ]; then echo ". shipped"
  elif [ -d "$1" ]; then echo "$1 $(basename "$1")"
  else echo "/tmp/variant-$1 $1"; fi
}
# A variant's GPU tests (default: the whole suite). -o pythonpath: pyproject's
# pythonpath = ["."] would put the shipped package first (the header says which ran).
variant_tests() {
  local name=$1; shift
  PYTHONPATH="/tmp/variant-$name" timeout "${VARIANT_TEST_TIMEOUT:-240}" python -P -m pytest -m gpu -rf -n 4 \
    --timeout 100 -p no:cacheprovider -p no:benchmark -o pythonpath="/tmp/variant-$name" \
    "${@:-tests}" 2>&1 | tee "$OUT/pytest-$name.log" | quiet | grep -E "imported from|passed|failed|error|skipped" | tail -8
}
# each_package ROUNDS LABEL...: the processes of an alternating screen, one
# line "ROUND LABEL PKG TAG" each: ROUNDS rounds, in each the shipped tree,
# then every label (package_of). Read on fd 3, so that what the loop runs
# cannot take the lines from its stdin.
each_package() {
  local rounds=$1; shift
  for round in $(seq "$rounds"); do
    for label in shipped "$@"; do echo "$round $label $(package_of "$label")"; done
  done
}
# alternate CONFIG NAME... [-- BENCH ARGS]: SCREEN_ROUNDS rounds (2) of one
# process for the shipped package, then one per variant, FA3 beside them when this machine
# built it (the tests call starts the build).
alternate() {
  local config=$1; shift
  local names=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do names+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  local backends=${VARIANT_BACKENDS:-hopper_flash sdpa-cudnn$([ -d /tmp/fa3pkg ] && echo " fa3")}
  local round label pkg tag
  while read -r -u 3 round label pkg tag; do
    echo "== $label, round $round"
    PYTHONPATH=$pkg:/tmp/fa3pkg timeout 150 python -P -m hopper_flash.bench --quiet --rep-ms 100 --warmup-ms 30 \
      --config "$config" --backends $backends "$@" --json "$OUT/ab-$tag-$round.json" \
      2>&1 | quiet | tail -12
  done 3< <(each_package "${SCREEN_ROUNDS:-2}" "${names[@]}")
}
# FA3's build on this machine, in the background (its own process session,
# so it outlives the call), unless a call on this machine started it.
start_fa3() {
  if [ -d .fa3 ] && [ ! -d /tmp/fa3src ]; then
    cp -r .fa3 /tmp/fa3src
    (setsid nohup bash /tmp/fa3src/build.sh /tmp/fa3_build.log > /tmp/fa3_build.out 2>&1 < /dev/null &)
  fi
}
# Wait for it (at most FA3_WAIT seconds), starting it first where no call on
# this machine has: a machine given back between two calls comes back bare,
# and waiting for a build that never started would spend the whole call (the
# thirty-fourth session lost 420 device seconds so). Without .fa3 carried the
# bench runs without FA3.
wait_fa3() {
  start_fa3
  if [ ! -d /tmp/fa3src ]; then echo "no FA3: .fa3 was not carried"; return 0; fi
  local waited=0
  until [ -d /tmp/fa3pkg ] || grep -q "rc=[1-9]" /tmp/fa3_build.out 2>/dev/null || [ "$waited" -ge "${FA3_WAIT:-400}" ]; do
    sleep 5; waited=$((waited + 5))
  done
  cat /tmp/fa3_build.out 2>/dev/null
}
case "${1:-}" in
  tests)
    start_fa3
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    timeout "${SUITE_TIMEOUT:-520}" python -m pytest -m gpu -q -rf -n "${SUITE_WORKERS:-4}" --timeout 100 -p no:cacheprovider \
      -p no:benchmark "${@:2}" 2>&1 | tee "$OUT/pytest-gpu.log" | quiet | tail -40 ;;
  bench)
    wait_fa3
    PYTHONPATH=/tmp/fa3pkg:. timeout "${BENCH_TIMEOUT:-540}" bash scripts/bench_h200.sh "$OUT" "${@:2}" 2>&1 | quiet ;;
  variant)
    name=${2:?variant name}; config=${3:?bench config}; extra=("${@:4}")
    build_variant "$name" || exit 1
    variant_tests "$name" ${VARIANT_TESTS:-tests/test_forward_gpu.py}
    alternate "$config" "$name" -- "${extra[@]}" ;;
  branches)
    # Each argument DIR[:FILE,FILE...]: another branch's tree (`git archive
    # BRANCH hopper_flash tests scripts pyproject.toml benchmarks | tar -x -C
    # .wt/NAME`, carry .wt) and its GPU test files (default: its whole
    # suite), run in turn from that tree, BRANCH_TIMEOUT seconds each (then
    # SIGINT: pytest still reports what ran). Log: $OUT/pytest-NAME.log.
    start_fa3  # with .fa3 carried, FA3 builds while the tests run (for a bench next)
    out=$(cd "$OUT" && pwd)
    for spec in "${@:2}"; do
      dir=${spec%%:*}; files=(tests); [ "$spec" != "$dir" ] && IFS=, read -ra files <<< "${spec#*:}"
      log="$out/pytest-$(basename "$dir").log"
      (cd "$dir" && python -c "import hopper_flash; print('package:', hopper_flash.__file__)" &&
       timeout -s INT "${BRANCH_TIMEOUT:-150}" python -m pytest -m gpu -q -rf -n "${SUITE_WORKERS:-8}" \
         --timeout 100 -p no:cacheprovider -p no:benchmark -o pythonpath=. "${files[@]}") > "$log" 2>&1
      echo "$dir: $(grep -E '^package:|passed|failed|skipped|error|Interrupted' "$log" | tail -3 | tr '\n' ' ')"
    done ;;
  vtests)
    name=${2:?variant name}
    start_fa3  # with .fa3 carried, FA3 builds while the tests run (for a vscreen next)
    build_variant "$name" || exit 1
    VARIANT_TEST_TIMEOUT=${VARIANT_TEST_TIMEOUT:-520} variant_tests "$name" "${@:3}" ;;
  screen)
    config=${2:?bench config}; shift 2
    names=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do names+=("$1"); shift; done
    build_variants "${names[@]}" || exit 1
    # FA3 beside the screen: wait for its build (starting it on a bare
    # machine; the forty-second session's screens ran without it after the
    # machine was handed back between calls). SCREEN_FA3=0 skips it.
    [ "${SCREEN_FA3:-1}" = 1 ] && wait_fa3 > /dev/null
    alternate "$config" "${names[@]}" "$@" ;;
  vscreen)
    shift
    names=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do names+=("$1"); shift; done
    [ "${1:-}" = -- ] && shift
    batches=("$@"); [ ${#batches[@]} -eq 0 ] && batches=(16 32)
    build_variants "${names[@]}" || exit 1
    wait_fa3 > /dev/null
    while read -r -u 3 round label pkg tag; do
      for b in "${batches[@]}"; do
        echo "== $label, round $round, $b sequences"
        PYTHONPATH=$pkg:/tmp/fa3pkg timeout 150 python -P -m hopper_flash.bench --quiet --rep-ms 150 --warmup-ms 30 \
          --varlen 512:8192 --batch "$b" ${VSCREEN_ARGS:-} --json "$OUT/vl${VSCREEN_TAG:+-$VSCREEN_TAG}-$tag-$b-$round.json" \
          2>&1 | quiet | grep -E "varlen|imported" | tail -8
      done
    done 3< <(each_package "${SCREEN_ROUNDS:-2}" "${names[@]}") ;;
  pscreen)
    # A timing script with its own judge and FA3 column (e.g.
    # scripts/varlen_pack_bench.py --skew) for the checked-out tree and each
    # package copy NAME (a folder, e.g. .wt/main: `git archive main
    # hopper_flash | tar -x -C .wt/main`, carry .wt), alternating processes,
    # PSCREEN_ROUNDS rounds (2), after FA3's build; each process's output in
    # $OUT/ps-TAG-ROUND.txt, its last PSCREEN_TAIL lines printed.
    script=${2:?timing script}; shift 2
    args=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do args+=("$1"); shift; done
    [ "${1:-}" = -- ] && shift
    wait_fa3 > /dev/null
    while read -r -u 3 round label pkg tag; do
      PYTHONPATH=$pkg:/tmp/fa3pkg timeout "${PSCREEN_TIMEOUT:-150}" python -P "$script" "${args[@]}" \
        > "$OUT/ps-$tag-$round.txt" 2>&1
      echo "== $tag, round $round"; tail -n "${PSCREEN_TAIL:-8}" "$OUT/ps-$tag-$round.txt"
    done 3< <(each_package "${PSCREEN_ROUNDS:-2}" "$@") ;;
  memcheck)
    TOOLS=memcheck bash scripts/sanitize.sh 2>&1 | quiet | tail -20
    TOOLS=memcheck bash scripts/sanitize.sh --backward 2>&1 | quiet | tail -20 ;;
  *) echo "usage: $0 tests [pytest args] | bench [block ...] | memcheck | variant NAME CONFIG [args]" \
          "| vtests NAME [paths] | screen CONFIG NAME... [-- args] | vscreen NAME... [-- batches]" \
          "| pscreen SCRIPT [args] -- NAME..." >&2; exit 2 ;;
esac
