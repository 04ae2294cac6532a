#!/usr/bin/env bash
# One device call: GPU tests, host overhead, the default benchmark (table,
# JSON, CSV, plot) and the general-attention rows. Logs go to $OUT.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 240 python -m pytest tests/test_forward_gpu.py tests/test_bench_gpu.py -q --timeout 120 -p no:cacheprovider \
  2>&1 | tee "$OUT/pytest.log" | tail -3
timeout 60 python scripts/host_overhead.py 2>&1 | tail -1 | tee "$OUT/host.txt"
if [ "${1:-}" != "--no-bench" ]; then
  timeout 400 python -m hopper_flash.bench --quiet --json "$OUT/default.json" --csv "$OUT/default.csv" \
    --plot "$OUT/bench-h200.png" 2>&1 | tee "$OUT/default.txt" | tail -40
  timeout 200 python -m hopper_flash.bench --quiet --config benchmarks/general.json \
    --backends hopper_flash sdpa-cudnn sdpa-flash --json "$OUT/general.json" 2>&1 | tee "$OUT/general.txt" | tail -45
fi
