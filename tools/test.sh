#!/usr/bin/env bash
# The whole test suite on a 2-core machine, in two phases (make test; README: Tests).
#
#   1. The multi-node module (its own Ray cluster of 4 raylets; its faults wait on heartbeats,
#      drain deadlines and slowed steps) in one pytest process, and beside it the e2e modules
#      (real Prefect servers, a process worker, a browser: they wait more than they compute),
#      then the unit tests (no Ray), in another. The multi-node module never runs beside the
#      integration modules, which keep both cores busy: its drain deadlines and node heartbeats
#      do not hold there.
#   2. The integration modules on 2 xdist processes, a module to each at a time
#      (tests/conftest.py groups them), each process with its own session Ray cluster.
#
# Arguments go to every pytest call (-x, -k ...). Exits non-zero when any phase failed, after
# running them all.
set -u
cd "$(dirname "$0")/.."
PYTEST=${PYTEST:-.venv/bin/pytest}
MULTINODE=tests/integration/multinode
BESIDE=(tests/e2e tests/unit)

# pytest, where "no test selected" (exit 5, under -k) is no failure
run() {
    "$PYTEST" "$@"
    local code=$?
    [ $code -eq 0 ] || [ $code -eq 5 ]
}

status=0
lane_log=$(mktemp)
trap 'rm -f "$lane_log"' EXIT

echo "== phase 1: $MULTINODE beside ${BESIDE[*]}"
run "$MULTINODE" --durations=10 "$@" >"$lane_log" 2>&1 &
lane=$!
run "${BESIDE[@]}" --durations=10 "$@" || status=1
wait "$lane" || status=1
echo "== phase 1, $MULTINODE:"
cat "$lane_log"

echo "== phase 2: the integration modules on 2 processes"
run tests/integration --ignore="$MULTINODE" -n 2 --dist loadgroup --no-loadscope-reorder \
    --durations=30 "$@" || status=1
exit $status
