#!/usr/bin/env bash
# session-30 device steps (untracked helper)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
quiet() { grep -v -E '^(nanobind| - leaked| - \.\.\. skipped|See https://nanobind)'; }
case $1 in
  t1)
    SUITE_TIMEOUT=300 bash scripts/device_session.sh tests tests/test_varlen_gpu.py tests/test_packed_gpu.py tests/test_training_gpu.py tests/test_torch_integration_gpu.py
    VARIANT_TEST_TIMEOUT=240 bash scripts/device_session.sh vtests varlen-skip-dead tests/test_varlen_gpu.py tests/test_packed_gpu.py
    ;;
  ab)
    for n in main-zerofill varlen-skip-dead; do python scripts/kernel_variant.py $n /tmp/variant-$n >/dev/null; done
    until [ -d /tmp/fa3pkg ] || grep -q "rc=[1-9]" /tmp/fa3_build.out 2>/dev/null; do sleep 5; done
    tail -2 /tmp/fa3_build.out
    for round in 1 2; do for label in shipped main-zerofill varlen-skip-dead; do
      pkg=$([ $label = shipped ] && echo . || echo /tmp/variant-$label)
      echo "== $label round $round"
      PYTHONPATH=$pkg:/tmp/fa3pkg timeout 170 python -P -m hopper_flash.bench --quiet --rep-ms 200 --warmup-ms 50 \
        --varlen 512:8192 --batch 16 --json $OUT/v-$label-$round.json 2>&1 | quiet | grep -v "^lengths" | tail -14
    done; done ;;
  prof)
    for s in 1 2; do echo "== max-scale $s"; PYTHONPATH=/tmp/fa3pkg:. timeout 150 python -P scripts/varlen_profile.py --max-scale $s 2>&1 | quiet | tail -30; done ;;
esac
