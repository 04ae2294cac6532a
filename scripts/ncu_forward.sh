#!/usr/bin/env bash
# Nsight Compute on the forward kernel, and on FA3's when this machine built
# it (/tmp/fa3pkg; `bash scripts/device_session.sh tests` starts the build),
# at one shape (default B4 H32 S8192 D128 non-causal, where the twelfth and
# thirteenth sessions found the steady state of long items 3-7% behind
# FA3's). Per kernel: the summary sections into $OUT/ncu-NAME.txt and the
# per-SASS-instruction source page (warp-state samples) as
# $OUT/ncu-NAME-sass.csv.gz, to read on the CPU machine.
#
#   run:  bash scripts/ncu_forward.sh [B H S D causal]      (on the GPU machine)
#         PASS=bwd bash scripts/ncu_forward.sh ...            the backward's main kernels instead
#         (ours: attention_backward_kernel; FA3's: FlashAttnBwdSm90), files ncu-bwd-NAME*
# SET=full adds every section (shared-memory and pipe tables; more replays);
# SET=traffic only the speed-of-light summary and the DRAM/L2 metrics (few replays).
# VARLEN=1: issue 12's varlen batch instead (the bench's `--varlen 512:8192
# --batch 16` lengths and seed, GQA 32/8, D=128, causal; the shape and
# causal arguments are then ignored), through each library's
# flash_attn_varlen_func.
# SK=... HKV=...: keys of another length than the queries' and fewer KV
# heads (GQA), e.g. issue 10's chunked-prefill row: `SK=8192 HKV=8 bash
# scripts/ncu_forward.sh 4 32 128 128 True` (causal is bottom-right then).
# FA3PKG=...: another FA3 build than /tmp/fa3pkg (e.g. /tmp/fa3pkg16 from
# `scripts/fa3_extra_build.sh fp16`).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
B=${1:-4} H=${2:-32} S=${3:-8192} D=${4:-128} CAUSAL=${5:-False} PASS=${PASS:-fwd}
SK=${SK:-$S} HKV=${HKV:-$H} FA3PKG=${FA3PKG:-/tmp/fa3pkg}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
cat > /tmp/ncu_driver.py <<PY
import sys, torch
torch.manual_seed(0)
if sys.argv[1] == "fa3":
    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func
else:
    from hopper_flash import flash_attn_func, flash_attn_varlen_func
if "${VARLEN:-0}" == "1":
    from hopper_flash.bench.varlen import VarlenConfig
    cfg = VarlenConfig(512, 8192, batch=16)
    lengths = cfg.lengths()
    q, k, v, cu = cfg.inputs()
    varlen_func = flash_attn_varlen_func

    def flash_attn_func(q, k, v, causal):  # the batch's own mask (cfg.causal), whatever the arguments say
        return varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=cfg.causal)
else:
    q = torch.randn($B, $S, $H, $D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn($B, $SK, $HKV, $D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
if "$PASS" == "bwd":
    for t in (q, k, v):
        t.requires_grad_(True)
    out = flash_attn_func(q, k, v, causal=$CAUSAL)
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(out)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
else:
    for _ in range(3):
        flash_attn_func(q, k, v, causal=$CAUSAL)
torch.cuda.synchronize()
PY
TAG=$([ "$PASS" = bwd ] && echo bwd-)$([ "${VARLEN:-0}" = 1 ] && echo varlen-)
SECTIONS=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis)
[ "${SET:-}" = full ] && SECTIONS=(--set full)
[ "${SET:-}" = traffic ] && SECTIONS=(--section SpeedOfLight)
# HBM and L2 traffic by count (the H200 runs these kernels at its power cap,
# where bytes moved cost clock): DRAM bytes read and written, L2 hit rate.
SECTIONS+=(--metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct)
profile() {  # name, kernel regex, extra ncu args
  local label=$1 name=$TAG$1 regex=$2; shift 2
  PYTHONPATH=$FA3PKG:. timeout 240 "$NCU" --clock-control none "$@" -k "regex:$regex" --launch-skip 2 \
    --launch-count 1 "${SECTIONS[@]}" \
    -o "/tmp/ncu-$name" -f python -P /tmp/ncu_driver.py "$label" > "$OUT/ncu-$name-run.txt" 2>&1 || tail -5 "$OUT/ncu-$name-run.txt"
  "$NCU" --import "/tmp/ncu-$name.ncu-rep" --print-summary none > "$OUT/ncu-$name.txt" 2>&1
  "$NCU" --import "/tmp/ncu-$name.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu-$name-sass.csv.gz"
  grep -E "Duration|Elapsed Cycles|SM Frequency|Executed Ipc A|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|L2 Cache Throughput|DRAM Throughput|L2 Hit Rate|dram__bytes|lts__t_sector_hit|Shared Memory|Tensor|Bank" "$OUT/ncu-$name.txt"
}
if [ "$PASS" = bwd ]; then ours=attention_backward_kernel theirs=FlashAttnBwdSm90; else
  ours=attention_forward_kernel theirs=FlashAttnFwdSm90; fi
echo "== hopper_flash"; profile hopper_flash $ours
if [ -d "$FA3PKG" ]; then echo "== fa3"; profile fa3 $theirs --kernel-name-base demangled; fi
