#!/usr/bin/env bash
# The transformers backend's GPU tests under another transformers release than
# the device image's (5.17.0): the release's wheel, and what it needs that the
# image lacks, installed without dependencies into /tmp/tf-VERSION, first on
# PYTHONPATH. Continuous batching reaches the attention function differently
# from 5.19 and from 5.24 (hopper_flash/integrations/transformers.py), and the
# image's release exercises neither.
#
# The wheels travel in the checkout's ignored .wt (the device has no network).
# On the CPU machine, from the repository root:
#   mkdir -p .wt/tfwheels && cd .wt/tfwheels
#   pip download --no-deps transformers==5.23.0 transformers==5.25.0 huggingface_hub==2.5.0 \
#     httpx2==2.17.0 httpcore2==2.17.0 tomlkit==0.15.3 click==8.5.1
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 kernels==0.19.1 hf_xet==1.8.0
# (5.23.0 needs only its own wheel next to the image's huggingface_hub 1.x;
# 5.25.0 needs huggingface_hub >= 2.4 and kernels, and those theirs.) Then on
# the device (carry .wt, not .fa3: 64 MiB in all):
#   bash scripts/transformers_gpu.sh 5.23.0 [PYTEST ARGS]
# and likewise 5.25.0; the test log is $OUT/pytest-transformers-VERSION.log.
set -uo pipefail
version=${1:?usage: transformers_gpu.sh VERSION [PYTEST ARGS]}; shift
wheels=.wt/tfwheels
dest=/tmp/tf-$version
extra=()
case $version in
  5.19.*|5.2[0-3].*) ;;
  *) extra=("$wheels"/huggingface_hub-*.whl "$wheels"/httpx2-*.whl "$wheels"/httpcore2-*.whl "$wheels"/kernels-*.whl
            "$wheels"/hf_xet-*.whl "$wheels"/tomlkit-*.whl "$wheels"/click-*.whl) ;;
esac
rm -rf "$dest"
python -m pip install --quiet --no-deps --target "$dest" "$wheels/transformers-$version-py3-none-any.whl" "${extra[@]}" || exit 1
PYTHONPATH="$dest:." python -c "import transformers; assert transformers.__version__ == '$version', transformers.__file__; print('transformers', transformers.__version__, 'from', transformers.__file__)" || exit 1
OUT=${OUT:-out}; mkdir -p "$OUT"
PYTHONPATH="$dest:." timeout "${TF_TIMEOUT:-400}" python -P -m pytest -m gpu -q -rf -n "${TF_WORKERS:-4}" --timeout 100 \
  -p no:cacheprovider -p no:benchmark -o pythonpath="$dest:." tests/test_transformers_integration.py "$@" \
  > "$OUT/pytest-transformers-$version.log" 2>&1
tail -15 "$OUT/pytest-transformers-$version.log"
