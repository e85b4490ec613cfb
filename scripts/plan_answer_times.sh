#!/bin/bash
# pstar-plan's answer times, cold: every model of docs/BENCHMARKS.md's answer-time table with
# default flags (H200 rates, batch 8, depth and batch searched), each in a fresh process with an
# empty XDG_CACHE_HOME (no kept XLA compilations), wall time around the command. Prints the
# table's rows and the load before and after.  Usage: bash scripts/plan_answer_times.sh
set -u
cd "$(dirname "$0")/.."
models=$(sed -n '/^| --model | seconds, cold/,/^$/p' docs/BENCHMARKS.md | grep '^| `' | sed 's/^| `\([^`]*\)`.*/\1/')
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
while IFS= read -r m; do
  cache=$(mktemp -d)
  start=$(date +%s.%N)
  # shellcheck disable=SC2086  # a row may hold flags after the model
  out=$(XDG_CACHE_HOME=$cache python3 -m pstar_jax.cli.plan --model $m 2>/dev/null); rc=$?
  end=$(date +%s.%N)
  rm -rf "$cache"
  fit=$([ $rc = 0 ] && echo fits || echo "does not fit (exit $rc)")
  depth=$(echo "$out" | sed -n 's/^largest depth that fits with this batch: \([^(]*\).*/\1/p' | sed 's/ *$//')
  printf '| `%s` | %.1f | %s | %s |\n' "$m" "$(awk "BEGIN {print $end - $start}")" "$fit" "${depth:--}"
done <<< "$models"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
