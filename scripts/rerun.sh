#!/usr/bin/env bash
# Rerun test files (or node ids) N times, optionally beside a busy loop pinned to one core, to shake out
# races before CI does: the CI host is shared and noisy, and a flaky test is a bug to find, not to retry.
#
#   scripts/rerun.sh tests/kv/test_connectors.py                      # 3 runs
#   scripts/rerun.sh tests/kv/store/test_redis_tier.py -n 10 --busy   # 10 runs, core 0 kept busy
#
# Each run is `.venv/bin/python -m pytest -q -p no:randomly -x FILE...`. Printed: each run's pass/fail and a
# last line "N passed, M failed" (runs, not tests); the exit status is 1 if any run failed. Every process the
# script starts (each pytest run, the busy loop) is stopped by its PID when the script ends, however it ends.
set -euo pipefail
set -m  # each background job in its own process group, with SIGINT left working (pytest tears down on it)

usage() {
  echo "usage: $0 FILE_OR_NODEID... [-n N] [--busy]" >&2
  exit 2
}

runs=3
busy=0
targets=()
while (($#)); do
  case "$1" in
    -n)
      [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || usage
      runs=$2
      shift 2
      ;;
    --busy) busy=1; shift ;;
    -h | --help) usage ;;
    -*) echo "unknown option: $1" >&2; usage ;;
    *) targets+=("$1"); shift ;;
  esac
done
((${#targets[@]})) || usage

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

busy_pid=""
test_pid=""

int_ignored() {  # int_ignored PID: true if PID ignores SIGINT (a script started in the background does)
  local mask
  mask=$(awk '/^SigIgn:/ {print $2}' "/proc/$1/status" 2>/dev/null) || return 1
  [[ -n $mask ]] && (((16#$mask >> 1) & 1))
}

stop_group() {  # stop_group PID: to PID's process group, SIGINT (pytest tears down), then SIGTERM, then SIGKILL
  local pid=$1 sig tries limit
  [[ -n $pid ]] || return 0
  for sig in INT TERM KILL; do
    kill -0 "$pid" 2>/dev/null || break
    limit=100  # tenths of a second: 10 s
    if [[ $sig == INT ]]; then
      int_ignored "$pid" && continue
      limit=600  # 60 s for pytest's teardown
    fi
    kill -s "$sig" -- "-$pid" 2>/dev/null || kill -s "$sig" "$pid" 2>/dev/null || true
    for ((tries = 0; tries < limit; tries++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  done
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  stop_group "$test_pid"
  stop_group "$busy_pid"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ((busy)); then
  command -v taskset >/dev/null || { echo "--busy needs taskset (util-linux)" >&2; exit 2; }
  # A noisy neighbour: spins on core 0 until this script is gone or 2 hours have passed, whichever is first
  # (so it ends by itself even if the script is SIGKILLed and its trap never runs).
  taskset -c 0 python3 -c '
import os, time
parent, end = os.getppid(), time.monotonic() + 2 * 3600
try:
    while time.monotonic() < end and os.getppid() == parent:
        for _ in range(200_000):
            pass
except KeyboardInterrupt:  # stopped by the script: a quiet exit
    pass
' &
  busy_pid=$!
  echo "busy loop on core 0: pid $busy_pid"
fi

passed=0
failed=0
for ((i = 1; i <= runs; i++)); do
  start=$SECONDS
  .venv/bin/python -m pytest -q -p no:randomly -x "${targets[@]}" &
  test_pid=$!
  if wait "$test_pid"; then
    result=PASS
    passed=$((passed + 1))
  else
    result="FAIL (exit $?)"
    failed=$((failed + 1))
  fi
  test_pid=""
  echo "run $i/$runs: $result in $((SECONDS - start)) s"
done

echo "$passed passed, $failed failed"
((failed == 0))
