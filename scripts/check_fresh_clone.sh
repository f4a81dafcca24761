#!/usr/bin/env bash
# Fresh-clone check: does the committed HEAD set itself up and pass its suite from nothing, the way a new
# user's clone (or CI's) would? Clones the repository into a temp dir, makes a clean virtual environment,
# runs the Makefile's install steps, then `make test`; prints the wall time of the set-up and of the suite.
# Only what is committed is tested: uncommitted changes in the working tree are not in the clone.
#
#   scripts/check_fresh_clone.sh [--demo-time] [--demo-timeout S] [--setup-only] [--keep] [--repo DIR]
#
#   --demo-time       also time `make demo` to a served dashboard (after the set-up, before the suite):
#                     start it, poll http://127.0.0.1:8501/_stcore/health, print the seconds, then stop
#                     it with SIGINT to its process group. Needs port 8501 free (the demo's port).
#   --demo-timeout S  give up on the demo after S seconds (default 1800)
#   --setup-only      stop after the set-up (clone, venv, make install install-servers)
#   --keep            keep the temp dir (clone and venv) and say where it is
#   --repo DIR        the repository to clone (default: the one this script is in)
#
# Exit status: make test's (0 passed, 2 failed); 1 when it passed but the demo did not serve; bad
# arguments 64 (EX_USAGE: not to be read as a failed suite).
set -euo pipefail

prog=check_fresh_clone.sh
demo=0 demo_timeout=1800 setup_only=0 keep=0
repo=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
usage() { sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; }
die() { echo "$prog: error: $*" >&2; exit 64; }
while (($#)); do
    case $1 in
        --demo-time) demo=1 ;;
        --demo-timeout) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || die "--demo-timeout needs a whole number of seconds"
                        demo_timeout=$2; shift ;;
        --setup-only) setup_only=1 ;;
        --keep) keep=1 ;;
        --repo) [[ -n ${2:-} ]] || die "--repo needs a directory"; repo=$2; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
git -C "$repo" rev-parse --verify -q HEAD >/dev/null 2>&1 || die "no git repository with a commit at '$repo'"

now() { echo "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

work=$(mktemp -d "${TMPDIR:-/tmp}/meshscope-fresh.XXXXXX")
demo_pgid=""
cleanup() {
    if [[ -n $demo_pgid ]] && kill -0 -- "-$demo_pgid" 2>/dev/null; then
        kill -KILL -- "-$demo_pgid" 2>/dev/null || true
    fi
    if ((keep)); then echo "$prog: kept $work (clone: $work/meshscope, venv: $work/venv)"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Nothing from the caller's environment may leak into the clone's imports or installs.
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV PYTHONSTARTUP PIP_USER

# ------------------------------------------------------------------------------------------- set-up
echo "$prog: cloning $repo (HEAD $(git -C "$repo" rev-parse --short HEAD)) into $work/meshscope"
t0=$(now)
git clone --quiet --no-hardlinks "$repo" "$work/meshscope"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091 # created just above
source "$work/venv/bin/activate"
py="$work/venv/bin/python"
echo "$prog: venv $work/venv ($("$py" --version)); make install install-servers"
make -C "$work/meshscope" --no-print-directory PY="$py" install install-servers
setup_s=$(since "$t0")
echo "$prog: set-up (clone, venv, make install): ${setup_s} s"
if ((setup_only)); then
    exit 0
fi

# --------------------------------------------------------------------------------------------- demo
demo_status=0
if ((demo)); then
    # SO_REUSEADDR as a server binds (Tornado, under Streamlit, does): a closed connection lingering in
    # TIME_WAIT does not make the port busy.
    if ! "$py" -c 'import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 8501)); s.listen()' 2>/dev/null; then
        echo "$prog: error: port 8501 (the demo dashboard's) is in use; free it to time the demo" >&2
        demo_status=1
    else
        log="$work/demo.log"
        t0=$(now)
        # Its own session, so the SIGINT below reaches make and the demo (which stops its children) and
        # nothing else; stdin closed like a CI job's. A non-interactive shell starts background commands
        # with SIGINT ignored, and an ignored signal stays ignored across exec (Python would then never
        # raise KeyboardInterrupt): restore the default before exec'ing make.
        setsid "$py" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp("make", sys.argv[1:])' \
            make -C "$work/meshscope" --no-print-directory PY="$py" demo >"$log" 2>&1 </dev/null &
        demo_pid=$!
        # setsid makes make the leader of a new group (pgid = its pid) once it has run; until then the
        # child is still in this script's group, which must never be signalled.
        for _ in $(seq 50); do
            [[ $(ps -o pgid= -p "$demo_pid" | tr -d ' ') == "$demo_pid" ]] && { demo_pgid=$demo_pid; break; }
            sleep 0.1
        done
        [[ -n $demo_pgid ]] || { echo "$prog: error: make demo did not get its own process group" >&2; exit 1; }
        served=""
        while :; do
            if curl -fsS -o /dev/null --max-time 2 http://127.0.0.1:8501/_stcore/health 2>/dev/null; then
                served=$(since "$t0"); break
            fi
            if ! kill -0 "$demo_pid" 2>/dev/null; then
                echo "$prog: error: make demo exited before serving the dashboard; its last lines:" >&2
                tail -n 20 "$log" >&2; break
            fi
            if awk -v s="$(since "$t0")" -v t="$demo_timeout" 'BEGIN { exit !(s > t) }'; then
                echo "$prog: error: no dashboard after ${demo_timeout} s; its last lines:" >&2
                tail -n 20 "$log" >&2; break
            fi
            sleep 1
        done
        if [[ -n $served ]]; then
            echo "$prog: make demo: dashboard served after ${served} s (set-up already done)"
            grep -o 'time to served dashboard: [0-9]*s' "$log" | sed "s/^/$prog: the demo's own count: /" || true
        else
            demo_status=1
        fi
        kill -INT -- "-$demo_pgid" 2>/dev/null || true
        for _ in $(seq 30); do kill -0 -- "-$demo_pgid" 2>/dev/null || break; sleep 1; done
        if kill -0 -- "-$demo_pgid" 2>/dev/null; then
            echo "$prog: make demo did not stop on SIGINT within 30 s; killing its process group" >&2
            kill -KILL -- "-$demo_pgid" 2>/dev/null || true
        fi
        wait "$demo_pid" 2>/dev/null || true
        demo_pgid=""
    fi
fi

# -------------------------------------------------------------------------------------------- suite
echo "$prog: make test"
t0=$(now)
status=0
make -C "$work/meshscope" --no-print-directory PY="$py" test || status=$?
if ((status == 0)); then outcome=passed; else outcome="failed (status $status)"; fi
echo "$prog: set-up ${setup_s} s; make test ${outcome} in $(since "$t0") s"
if ((status == 0 && demo_status != 0)); then
    exit 1
fi
exit "$status"
