#!/usr/bin/env bash
# One device session longer than one call: device_session.sh's steps run detached from the call (setsid), in a
# snapshot of the tree, and later calls wait on them and bring back what they wrote so far. A machine goes back
# after a short idle time, and a call lasts at most 10 minutes: a session of several calls back to back keeps one
# machine busy with no gap, and the tree that later calls send (edited meanwhile) does not reach the running steps.
#   bash benchmarks/device_detached.sh start [SECONDS] -- STEP...   snapshot the tree, start the steps, then poll
#   bash benchmarks/device_detached.sh poll [SECONDS]               wait for the end or SECONDS (default 560)
# STEPs are device_session.sh's, in groups: `then:SECONDS` ends a group and sets the next one's time limit (give one
# first for the first group: else 1500 s). Each group is one device_session.sh (the wheels installed by the first)
# under `timeout -k 30` of its seconds, so a stuck step does not eat the session; the log says each group's exit.
# `start` is refused while a session it started is still running (the machine's GPUs are the running one's).
# Every poll packs $BG's out/ and log into one archive in $OUT (a call brings back at most 8 files).
set -uo pipefail
OUT=${OUT:-/tmp/out}
BG=/tmp/dgls_bg
mode=${1:?start or poll}
shift
poll() {
  local limit=${1:-560} waited=0
  while [ ! -f "$BG/rc" ] && [ "$waited" -lt "$limit" ]; do sleep 5; waited=$((waited + 5)); done
  tail -40 "$BG/log"
  if [ -f "$BG/rc" ]; then echo "== detached session ended, rc $(cat "$BG/rc")"; else echo "== still running"; fi
  mkdir -p "$OUT" && tar czf "$OUT/detached_$(date +%H%M%S).tgz" -C "$BG" out log
}
case "$mode" in
  start)
    limit=560
    if [ "${1:-}" != "--" ]; then limit=$1; shift; fi
    [ "${1:-}" = "--" ] && shift
    if [ -d "$BG" ] && [ ! -f "$BG/rc" ] && [ -f "$BG/pid" ] && kill -0 "$(cat "$BG/pid")" 2>/dev/null; then
      echo "device_detached.sh: a session is still running (poll it, or wait for its end)"; exit 2
    fi
    rm -rf "$BG" && mkdir -p "$BG/out" "$BG/tree"
    tar cf - --exclude=./.git . | tar xf - -C "$BG/tree"
    # groups of steps, split at `then:SECONDS`; each group is one device_session.sh under its timeout
    script="cd $BG/tree; rc=0; export OUT=$BG/out"
    group=() seconds=1500 first=1
    flush() {
      [ ${#group[@]} -eq 0 ] && return
      local skip=""; [ $first -eq 1 ] || skip="DGLS_SKIP_INSTALL=1 "
      script+="; echo \"== group: ${group[*]}\"; stamp=\$(mktemp)"
      script+="; ${skip}timeout -k 30 $seconds bash benchmarks/device_session.sh ${group[*]}"
      script+="; g=\$?; echo \"== group exit \$g\"; [ \$g -eq 0 ] || rc=1"
      # what a bench wrote comes back even when its group ran out of time (bench_scaling.py writes each row at once)
      script+="; find benchmarks/results -maxdepth 1 -type f -newer \$stamp ! -name README.md -exec cp {} $BG/out/ \\;"
      group=() first=0
    }
    for step in "$@"; do
      case "$step" in
        then:*) flush; seconds=${step#then:} ;;
        *) group+=("$step") ;;
      esac
    done
    flush
    script+="; echo \$rc > $BG/rc"
    setsid bash -c "$script" >"$BG/log" 2>&1 </dev/null &
    echo $! >"$BG/pid"
    poll "$limit" ;;
  poll) poll "${1:-560}" ;;
  *) echo "device_detached.sh: start or poll, got $mode"; exit 2 ;;
esac
