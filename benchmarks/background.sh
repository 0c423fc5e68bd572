#!/usr/bin/env bash
# Long GPU work that outlives a device call: a call may run 10 minutes and a held machine goes back 30 s after a
# call ends, so work of 20-25 minutes starts in its own session (setsid) in one call and is read by the next.
#     bash benchmarks/background.sh start NAME COMMAND...   run COMMAND (through bash -c) in the background, from
#                                                           this folder; its output in $BG/NAME.log, exit status
#                                                           in $BG/NAME.rc once it ends; returns at once
#     bash benchmarks/background.sh wait SECONDS NAME...     until every NAME has ended, or SECONDS passed
#     bash benchmarks/background.sh report [LINES]          each job: running or its exit status, elapsed
#                                                           seconds, the last LINES (12) lines of its log
# BG defaults to /tmp/bg (it stays while the machine is held).
set -u
BG=${BG:-/tmp/bg}
mkdir -p "$BG"
cmd=${1:-}
shift || true
case $cmd in
    start)
        name=$1; shift
        [[ -f $BG/$name.pid && ! -f $BG/$name.rc ]] && { echo "$name is running already"; exit 1; }
        rm -f "$BG/$name.rc"
        date +%s > "$BG/$name.start"
        setsid nohup bash -c "( $* ); echo \$? > '$BG/$name.rc'" > "$BG/$name.log" 2>&1 < /dev/null &
        echo $! > "$BG/$name.pid"
        echo "started $name (pid $!): $*" ;;
    wait)
        limit=$1; shift
        end=$((SECONDS + limit))
        while ((SECONDS < end)); do
            left=0
            for name in "$@"; do [[ -f $BG/$name.rc ]] || left=1; done
            ((left)) || break
            sleep 5
        done ;;
    report)
        for start in "$BG"/*.start; do
            [[ -f $start ]] || continue
            name=$(basename "$start" .start)
            if [[ -f $BG/$name.rc ]]; then state="exit $(cat "$BG/$name.rc")"; else state=running; fi
            echo "== $name: $state, $(($(date +%s) - $(cat "$start"))) s since its start"
            tail -n "${1:-12}" "$BG/$name.log"
        done ;;
    *) echo "usage: bash benchmarks/background.sh start NAME COMMAND... | wait SECONDS NAME... | report [LINES]"; exit 2 ;;
esac
