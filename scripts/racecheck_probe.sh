#!/usr/bin/env bash
# Each probe of scripts/racecheck_probe.py in its own racecheck run; one line
# per probe (its result and racecheck's summary), full logs in $OUT/probes.txt.
#
#   OUT=out REPEAT=20 bash scripts/racecheck_probe.sh [PROBE ...]
#
# The last column adds up racecheck's "[N hazards]" counts: the number of
# conflicting access pairs behind the reports.
source "$(dirname "${BASH_SOURCE[0]}")/sanitizer_env.sh"
"$PY" scripts/racecheck_probe.py "$@" >/dev/null || echo "probes failed without the sanitizer"  # fills Triton's cache
probes=("$@")
[ ${#probes[@]} -eq 0 ] && mapfile -t probes < <("$PY" -c "
import sys; sys.path.insert(0, 'scripts'); import racecheck_probe; print('\n'.join(racecheck_probe.PROBES))")
: >"$OUT/probes.txt"
for p in "${probes[@]}"; do
  log=$(PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 10 180 "$SAN" --tool racecheck ${SANITIZER_ARGS:-} \
        "$PY" scripts/racecheck_probe.py "$p" --repeat "${REPEAT:-1}" 2>&1)
  { echo "##### $p"; echo "$log"; } >>"$OUT/probes.txt"
  result=$(echo "$log" | grep -oE "^probe +$p +(ok|WRONG)" | awk '{print $3}')
  summary=$(echo "$log" | grep -oE "RACECHECK SUMMARY: .*" | sed 's/RACECHECK SUMMARY: //')
  pairs=$(echo "$log" | grep -oE '\[[0-9]+ hazards?\]' | grep -oE '[0-9]+' | awk '{s += $1} END {print s + 0}')
  printf '%-26s %-6s %-44s pairs=%s\n' "$p" "${result:-?}" "${summary:-no summary}" "${pairs:-0}"
done
