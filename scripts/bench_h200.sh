#!/usr/bin/env bash
# The benchmark set behind BENCHMARKS.md's tables, in one run, FA3 beside it.
# On the H200: build FA3 first (shared/tools/fa3: prepare.sh here, build.sh
# there), then
#   PYTHONPATH=/tmp/fa3pkg:. bash scripts/bench_h200.sh OUTDIR [prefill|decode|bwd|varlen|serving ...]
# Each block writes OUTDIR/<block>.json and prints its table.
set -uo pipefail
out=${1:?usage: bench_h200.sh OUTDIR [block ...]}; shift
blocks=${*:-prefill decode bwd varlen}
mkdir -p "$out"
# ROUNDS: each cell's backends timed in that many interleaved rounds (--rounds;
# the H100 and H200 run attention at their 700 W cap, whose clock drift moved
# one process's medians by up to 18%: BENCHMARKS.md, sixty-fourth session).
# Blocks before that session timed one backend after the other (ROUNDS=1).
bench() { python -m hopper_flash.bench --quiet --rep-ms "${REP_MS:-200}" --warmup-ms 50 --rounds "${ROUNDS:-4}" "$@"; }
for block in $blocks; do
  echo "== $block"
  case $block in
    prefill)  # issue 13's rows (benchmarks/prefill.json), then its CUDA-graph row
      # The whole file with FA3 beside it died with a segfault (exit 139, no
      # output) in 3 of 5 processes on the H200, with and without sdpa-flash;
      # its bf16 rows alone ran every time (cause not isolated; FA3 is built
      # bf16-only). So: the bf16 rows with FA3, the fp16 row without it.
      python -c "import json; r = json.load(open('benchmarks/prefill.json'));
json.dump([c for c in r if c.get('dtype', 'bf16') == 'bf16'], open('$out/prefill-bf16-rows.json', 'w'))"
      bench --config "$out/prefill-bf16-rows.json" --backends hopper_flash fa3 sdpa-cudnn --json "$out/prefill.json"
      bench --seqlen 8192 --dtype fp16 --backends hopper_flash sdpa-cudnn sdpa-flash --json "$out/prefill-fp16.json"
      bench --seqlen 512 --batch 16 --heads 16 --cuda-graph --backends hopper_flash fa3 sdpa-cudnn \
        --json "$out/prefill-graph.json" ;;
    decode)  # issue 10's table: graph replay (serving loops replay decode steps), then plain calls
      bench --config benchmarks/decode.json --cuda-graph \
        --backends hopper_flash hopper_flash-kvcache fa3 fa3-kvcache sdpa-cudnn --json "$out/decode-graph.json"
      bench --config benchmarks/decode.json --backends hopper_flash-kvcache fa3-kvcache --json "$out/decode-plain.json" ;;
    bwd)  # issue 11's anchors (backward only), then GQA, D64 and D256 at S=8192 (causal and not)
      bench --pass bwd --seqlen 2048 8192 --backends hopper_flash fa3 sdpa-cudnn sdpa-flash --memory --json "$out/bwd-causal.json"
      bench --pass bwd --seqlen 8192 --no-causal --backends hopper_flash fa3 sdpa-cudnn sdpa-flash --json "$out/bwd-full.json"
      bench --pass bwd --seqlen 1024 --batch 16 --heads 16 --backends hopper_flash fa3 sdpa-cudnn sdpa-flash --json "$out/bwd-b16.json"
      bench --pass bwd --seqlen 8192 --kv-heads 8 --backends hopper_flash fa3 sdpa-cudnn --json "$out/bwd-gqa.json"
      bench --pass bwd --seqlen 8192 --headdim 64 --backends hopper_flash fa3 sdpa-cudnn --json "$out/bwd-d64.json"
      bench --pass bwd --seqlen 8192 --headdim 64 --no-causal --backends hopper_flash fa3 sdpa-cudnn --json "$out/bwd-d64-full.json"
      bench --pass bwd --seqlen 8192 --headdim 256 --heads 16 --backends hopper_flash fa3 sdpa-cudnn --json "$out/bwd-d256.json"
      bench --pass bwd --seqlen 8192 --headdim 256 --heads 16 --no-causal --backends hopper_flash fa3 sdpa-cudnn \
        --json "$out/bwd-d256-full.json" ;;
    varlen)  # issue 12's mixed batch: 16 sequences, lengths uniform in 512..8192, causal, GQA 32/8
      bench --varlen 512:8192 --batch 16 --json "$out/varlen.json" ;;
    serving)  # packed serving batches beside FA3 (and FA3's own split heuristic), groups of 5 and 7 too (packed
      # and fixed-length), then cache_leftpad's route and the chunked decode step (attention_chunk, contiguous and
      # paged), then the transformers backend's padded decode steps (FA3's cache_leftpad call beside)
      python -P scripts/varlen_pack_bench.py 2>&1 | tee "$out/varlen-pack.txt"
      python -P scripts/varlen_pack_bench.py --groups 2>&1 | tee "$out/varlen-pack-groups.txt"
      python -P scripts/pack_view_bench.py 2>&1 | tee "$out/pack-view.txt"
      python -P scripts/leftpad_bench.py 2>&1 | tee "$out/leftpad.txt"
      python -P scripts/chunk_decode_probe.py 2>&1 | tee "$out/chunk-decode.txt"
      python -P scripts/padded_decode_bench.py 2>&1 | tee "$out/padded-decode.txt" ;;
    *) echo "unknown block $block" >&2; exit 2 ;;
  esac
done
