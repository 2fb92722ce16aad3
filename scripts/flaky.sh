#!/usr/bin/env bash
# Run the whole test suite N times and print, per test, how often it failed.
#
#   bash scripts/flaky.sh 3                  # the README's test command, three times
#   bash scripts/flaky.sh 5 tests/test_x.py  # extra arguments go to pytest
#   FLAKY_HOG=1 bash scripts/flaky.sh 1      # with a busy loop taking one core meanwhile
#
# Each run's JUnit XML and log are kept in $FLAKY_DIR (default: a new temporary folder).
# Exits 0 when no run had a failure or an error, 1 otherwise. A run that collects nothing
# (pytest exit 5) counts as a failure: it tested nothing.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:?usage: scripts/flaky.sh N [pytest args...]}
shift
case $runs in '' | *[!0-9]* | 0) echo "N must be a positive integer, got '$runs'" >&2; exit 2 ;; esac
out=${FLAKY_DIR:-$(mktemp -d -t flaky-XXXXXX)}
mkdir -p "$out"
python=${PYTHON:-python}
if [ "${FLAKY_HOG:-0}" = 1 ]; then  # a CPU hog on one core for the whole time; ours to stop
  "$python" -c "while True: pass" &
  hog=$!
  trap 'kill "$hog" 2>/dev/null' EXIT
  echo "CPU hog: pid $hog"
fi

for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  # -p no:cacheprovider: no --lf/--ff state carried from one run to the next
  "$python" -m pytest -p no:cacheprovider --junitxml="$out/run-$i.xml" "$@" \
    >"$out/run-$i.log" 2>&1
  rc=$?
  echo "run $i/$runs: exit $rc in $(( $(date +%s) - start )) s (load $(cut -d' ' -f1-3 /proc/loadavg)); log $out/run-$i.log"
  echo "$rc" >"$out/run-$i.rc"
done

"$python" - "$out" "$runs" <<'EOF'
"""Per test id: the runs it failed or errored in, with the first line of each message."""
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

out, runs = Path(sys.argv[1]), int(sys.argv[2])
failed: dict[str, list[str]] = defaultdict(list)
bad_runs = 0
for i in range(1, runs + 1):
    rc = int((out / f"run-{i}.rc").read_text())
    xml = out / f"run-{i}.xml"
    if rc != 0:
        bad_runs += 1
    if not xml.exists():
        failed[f"(run {i}: no report; exit {rc})"].append(f"run {i}")
        continue
    tests = 0
    for case in ET.parse(xml).iter("testcase"):
        tests += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for kind in ("failure", "error"):
            for node in case.iter(kind):
                first = (node.get("message") or "").strip().splitlines()[:1]
                failed[name].append(f"run {i} {kind}: {first[0][:160] if first else ''}")
    if tests == 0 or rc == 5:
        failed[f"(run {i}: no tests ran; exit {rc})"].append(f"run {i}")
if not failed:
    print(f"\n{runs} run(s), no failures")
    sys.exit(0 if bad_runs == 0 else 1)
print(f"\n{len(failed)} test(s) failed in at least one of {runs} run(s):")
for name, lines in sorted(failed.items(), key=lambda kv: (-len(kv[1]), kv[0])):
    print(f"  {name}: {len(lines)}/{runs}")
    for line in lines:
        print(f"      {line}")
sys.exit(1)
EOF
