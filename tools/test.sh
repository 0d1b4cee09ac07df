#!/usr/bin/env bash
# The whole test suite on a 2-core machine, in three phases (make test; README: Layout).
#
#   1. The multi-node package (its own Ray cluster of 4 raylets; its faults wait on heartbeats,
#      drain deadlines and slowed steps) in one pytest process, and beside it the e2e modules
#      (real Prefect servers, a process worker, a browser: they wait more than they compute) in
#      another. Nothing CPU-bound runs beside the multi-node package: its steps and waits slow
#      down as much as that saves (with the unit tests beside it too it took 800 s; beside the
#      e2e modules alone, 624 and 740 s), and its drain deadlines and heartbeats need the CPU.
#      With phase 2 beside it as well (all at once), the three lanes ended after 2160 s against
#      2394 s in phases, but the multi-node module took 1780 s and one of its waits timed out.
#      Its two modules in two processes (two clusters) beside the e2e modules: 842 s, and three
#      tests of test_jobs.py timed out waiting for their workers.
#      The e2e modules ended 355 s before the multi-node package (533 against 888 s on
#      2026-11-28), so two integration modules that wait on servers of their own (a tracking
#      server, moto) follow them in that process instead of running in phase 2: on 2026-11-28
#      that lane took 866 s beside the multi-node package's 1054 s, and phase 2 1893 s against
#      2165 s measured with them earlier that day.
#   2. The other integration modules and the unit tests on 2 xdist processes, a module to each
#      at a time (xdist's loadfile; tests/conftest.py orders them, the longest first), each
#      process with its own session Ray cluster. They keep the 2 cores 97-99% busy (/proc/stat,
#      2026-11-28): less work is what shortens this phase, not more lanes. Until 2026-11-28 the
#      modules were dealt out test by test (see PHASE2_PROCESSES), their module fixtures built
#      in both processes: that day, 1351 s that way (1f9fd38) against 1210 s whole (8cc2dda,
#      which also trains five attempts fewer).
#   3. The step-time module alone: it holds measured seconds against the sleeps it injects, which
#      another process's load distorts (beside one, a straggler's all-reduce wait and a slow
#      transform's data wait missed their marks by a few milliseconds).
#
# Arguments go to every pytest call (-x, -k ...). Exits non-zero when any phase failed, after
# running them all.
set -u
cd "$(dirname "$0")/.."
PYTEST=${PYTEST:-.venv/bin/pytest}
MULTINODE=tests/integration/multinode
BESIDE=(tests/e2e tests/integration/test_tracking.py tests/integration/test_object_storage.py)
ALONE=tests/integration/test_step_time.py
# Phase 2's processes: each module whole to one of them (its module fixtures built once), in
# tests/conftest.py's order. Not --dist loadgroup: under pytest 9.2 xdist 3.8 no longer reads
# its groups (pytest-xdist#1386), and modules were split test by test, their fixtures built twice.
PHASE2_PROCESSES=(-n 2 --dist loadfile --no-loadscope-reorder)

# pytest, where "no test selected" (exit 5, under -k) is no failure
run() {
    "$PYTEST" "$@"
    local code=$?
    [ $code -eq 0 ] || [ $code -eq 5 ]
}

status=0
MOVED=()
for path in "${BESIDE[@]}"; do
    [[ $path == tests/integration/* ]] && MOVED+=(--ignore="$path")
done
lane_log=$(mktemp)
trap 'rm -f "$lane_log"' EXIT

echo "== phase 1: $MULTINODE beside ${BESIDE[*]}"
run "$MULTINODE" --durations=10 "$@" >"$lane_log" 2>&1 &
lane=$!
run "${BESIDE[@]}" --durations=10 "$@" || status=1
wait "$lane" || status=1
echo "== phase 1, $MULTINODE:"
cat "$lane_log"

echo "== phase 2: the unit and integration tests on 2 processes"
run tests/integration tests/unit --ignore="$MULTINODE" --ignore="$ALONE" "${MOVED[@]}" \
    "${PHASE2_PROCESSES[@]}" --durations=30 "$@" || status=1

echo "== phase 3: $ALONE alone"
run "$ALONE" --durations=5 "$@" || status=1
exit $status
