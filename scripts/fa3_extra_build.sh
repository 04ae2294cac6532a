#!/usr/bin/env bash
# FA3 builds beyond shared/tools/fa3's stock one (bf16 only, no windows), each
# from the same sources, head dim 128 only (the d256 kinds: 256). Run on the device from the
# checkout's top with .fa3 carried (prepare.sh's folder). (Was
# scripts/fa3_local_build.sh, which built the `local` kind only.)
#   local: bf16 forward and backward with FA3's sliding-window ("local")
#          kernels, for timing windows beside FA3 (the stock build crashes on
#          a window); installs to /tmp/fa3local.
#   fp16:  the forward only, bf16 and fp16 (no split-KV, PackGQA or varlen
#          kernels; FA3's heuristics pick none of them on plain prefill),
#          for issue 13's fp16 row; installs to /tmp/fa3pkg16. About 110 s.
#   d256, d256n64: head dim 256 instead, the bf16 forward only, as fp16's
#          (plain prefill); d256n64 with FA3's key tile cut from 80 keys to
#          64 (ours), in tile_size.h: how much of FA3's lead at head dim
#          256 its wider tile is (1.8-3.3% at S=8192, BENCHMARKS.md,
#          forty-ninth section). Install to /tmp/fa3d256, /tmp/fa3d256n64;
#          both builds at once take the 16 cores, ~95 s.
#   append: the bf16 forward with FA3's in-kernel append (APPENDKV, which the
#          stock build leaves out: its flash_attn_with_kvcache with k, v then
#          crashes the process, seventy-seventh session), for
#          `scripts/decode_splits.py --append --fa3-append`; installs to
#          /tmp/fa3append.
# Then PYTHONPATH=/tmp/fa3local:. (or /tmp/fa3pkg16) for the bench's fa3
# columns. Start it in the background the way scripts/device_session.sh
# starts the stock build:
#   (setsid nohup bash scripts/fa3_extra_build.sh fp16 > /tmp/fa3fp16.out 2>&1 < /dev/null &)
set -u
kind=${1:?usage: fa3_extra_build.sh local|fp16|d256|d256n64|append}
export GIT_DIR=/nonexistent FLASH_ATTENTION_DISABLE_PAGEDKV=TRUE \
  FLASH_ATTENTION_DISABLE_APPENDKV=TRUE FLASH_ATTENTION_DISABLE_SOFTCAP=TRUE \
  FLASH_ATTENTION_DISABLE_FP8=TRUE FLASH_ATTENTION_DISABLE_CLUSTER=TRUE \
  FLASH_ATTENTION_DISABLE_HDIM64=TRUE FLASH_ATTENTION_DISABLE_HDIM96=TRUE FLASH_ATTENTION_DISABLE_HDIM192=TRUE \
  FLASH_ATTENTION_DISABLE_HDIM256=TRUE FLASH_ATTENTION_DISABLE_SM80=TRUE \
  FLASH_ATTENTION_DISABLE_HDIMDIFF64=TRUE FLASH_ATTENTION_DISABLE_HDIMDIFF192=TRUE \
  MAX_JOBS=16 NVCC_THREADS=2
case $kind in
  local) dest=/tmp/fa3local; export FLASH_ATTENTION_DISABLE_FP16=TRUE ;;
  fp16) dest=/tmp/fa3pkg16; export FLASH_ATTENTION_DISABLE_LOCAL=TRUE FLASH_ATTENTION_DISABLE_BACKWARD=TRUE \
          FLASH_ATTENTION_DISABLE_SPLIT=TRUE FLASH_ATTENTION_DISABLE_PACKGQA=TRUE FLASH_ATTENTION_DISABLE_VARLEN=TRUE ;;
  d256|d256n64) dest=/tmp/fa3$kind; export FLASH_ATTENTION_DISABLE_HDIM128=TRUE FLASH_ATTENTION_DISABLE_HDIM256=FALSE \
          FLASH_ATTENTION_DISABLE_FP16=TRUE FLASH_ATTENTION_DISABLE_LOCAL=TRUE FLASH_ATTENTION_DISABLE_BACKWARD=TRUE \
          FLASH_ATTENTION_DISABLE_SPLIT=TRUE FLASH_ATTENTION_DISABLE_PACKGQA=TRUE FLASH_ATTENTION_DISABLE_VARLEN=TRUE ;;
  append) dest=/tmp/fa3append; export FLASH_ATTENTION_DISABLE_APPENDKV=FALSE FLASH_ATTENTION_DISABLE_FP16=TRUE \
          FLASH_ATTENTION_DISABLE_LOCAL=TRUE FLASH_ATTENTION_DISABLE_BACKWARD=TRUE ;;
  *) echo "unknown kind $kind (local, fp16, d256, d256n64 or append)"; exit 2 ;;
esac
src=/tmp/fa3${kind}src
rm -rf "$src" && cp -r .fa3 "$src" && cd "$src/hopper" || exit 1
if [ "$kind" = d256n64 ]; then
  # bf16/fp16, head dim > 192: FA3's 128 x 80 tile becomes 128 x 64.
  sed -i 's|return {128, is_local ? 64 : 80, true, true};|return {128, 64, true, true};|' tile_size.h
  grep -q 'return {128, 64, true, true};' tile_size.h || { echo "tile_size.h: FA3's 80-key line not found"; exit 1; }
fi
start=$(date +%s)
python3 setup.py build_ext --inplace > "/tmp/fa3${kind}_build.log" 2>&1
rc=$?
[ $rc = 0 ] && mkdir -p "$dest" && cp -r flash_attn_interface.py flash_attn_3 "$dest/"
echo "fa3 ($kind) build rc=$rc in $(( $(date +%s) - start )) s (log /tmp/fa3${kind}_build.log)"
exit $rc
