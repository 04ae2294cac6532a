#!/usr/bin/env bash
# FA3 with its sliding-window ("local") kernels, head dim 128 only, bf16, for
# timing windows beside FA3 (shared/tools/fa3's build.sh sets
# FLASH_ATTENTION_DISABLE_LOCAL: that build crashes on a window). Run on the
# device from the checkout's top with .fa3 carried (prepare.sh's folder);
# installs to /tmp/fa3local (then PYTHONPATH=/tmp/fa3local:. for the bench's
# fa3 columns). About as long as the stock build; start it in the
# background the way scripts/device_session.sh starts that one:
#   (setsid nohup bash scripts/fa3_local_build.sh > /tmp/fa3local.out 2>&1 < /dev/null &)
set -u
src=/tmp/fa3localsrc
rm -rf "$src" && cp -r .fa3 "$src" && cd "$src/hopper" || exit 1
export GIT_DIR=/nonexistent FLASH_ATTENTION_DISABLE_PAGEDKV=TRUE \
  FLASH_ATTENTION_DISABLE_APPENDKV=TRUE FLASH_ATTENTION_DISABLE_SOFTCAP=TRUE \
  FLASH_ATTENTION_DISABLE_FP16=TRUE FLASH_ATTENTION_DISABLE_FP8=TRUE FLASH_ATTENTION_DISABLE_CLUSTER=TRUE \
  FLASH_ATTENTION_DISABLE_HDIM64=TRUE FLASH_ATTENTION_DISABLE_HDIM96=TRUE FLASH_ATTENTION_DISABLE_HDIM192=TRUE \
  FLASH_ATTENTION_DISABLE_HDIM256=TRUE FLASH_ATTENTION_DISABLE_SM80=TRUE \
  FLASH_ATTENTION_DISABLE_HDIMDIFF64=TRUE FLASH_ATTENTION_DISABLE_HDIMDIFF192=TRUE \
  MAX_JOBS=16 NVCC_THREADS=2
start=$(date +%s)
python3 setup.py build_ext --inplace > /tmp/fa3local_build.log 2>&1
rc=$?
[ $rc = 0 ] && mkdir -p /tmp/fa3local && cp -r flash_attn_interface.py flash_attn_3 /tmp/fa3local/
echo "fa3 (local, hdim 128) build rc=$rc in $(( $(date +%s) - start )) s (log /tmp/fa3local_build.log)"
exit $rc
