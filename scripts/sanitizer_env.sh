# Sourced by scripts/sanitize.sh and scripts/racecheck_probe.sh: repository
# root as working directory, $OUT, $PY and $SAN (compute-sanitizer), or exit 2.
# Environment: OUT (default ./out), PYTHON, COMPUTE_SANITIZER.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
