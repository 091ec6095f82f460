#!/usr/bin/env bash
# Train on one machine with N processes:  launch/local.sh N --config <yaml> [key=value ...]
#
# Runs `torchrun --standalone --nproc_per_node N -m tape_train.train.cli ...` (N=1 runs the
# trainer directly, no torchrun). Exit code: the trainer's own (0 done, 75 stopped on
# SIGUSR1/SIGTERM after a checkpoint, 130 Ctrl-C after a checkpoint, 1 error), which torchrun
# alone would flatten to 1: the trainer writes it to $TAPE_TRAIN_EXIT_FILE and we re-raise it.
# SIGUSR1/SIGTERM sent to this script are forwarded to the workers (one worker is enough: the
# ranks agree at the next step boundary). This script or its torchrun killed with SIGKILL: the
# workers stop as on SIGTERM (they watch their parent: docs/training.md, "Stopping").
set -uo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
    echo "usage: $0 NUM_PROCESSES --config <yaml> [section.key=value ...]" >&2
    exit 2
fi
nproc=$1
shift

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python=python3; fi
fi
# Without the venv, python3 must have the package (an activated venv, a pip install), or the
# run would end in a ModuleNotFoundError traceback.
if [[ "$python" == python3 ]] && ! python3 -c "import tape_train, torch" 2>/dev/null; then
    echo "$0: no virtualenv at $here/.venv, and python3 cannot import tape_train and torch:" \
         "run 'make install' in $here (or set PYTHON to a Python that has them)" >&2
    exit 2
fi
# Share the cores that are idle now between the workers unless the caller decided: a thread
# on a core that other work keeps busy slows every step. tape_train/cpu_threads.py decides
# (a value OpenMP cannot read is no decision: libgomp would take a thread per core) and prints
# the value, then what to log. Without tape_train: cores / processes when none is set.
if choice="$("$python" -m tape_train.cpu_threads "$nproc" 2>/dev/null)" && [[ -n "$choice" ]]; then
    export OMP_NUM_THREADS="${choice%%$'\n'*}"
    if [[ "$choice" == *$'\n'* ]]; then
        while IFS= read -r line; do echo "$0: $line" >&2; done <<< "${choice#*$'\n'}"
    fi
elif [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    cores=$(nproc 2>/dev/null || echo 1)
    export OMP_NUM_THREADS=$(( cores / nproc > 0 ? cores / nproc : 1 ))
fi

if ! exit_file="$(mktemp "${TMPDIR:-/tmp}/tape-train-exit.XXXXXX")"; then
    # Without it a worker's exit code (75: stopped for a requeue) would be torchrun's 1.
    echo "$0: cannot create a file in ${TMPDIR:-/tmp} (TMPDIR) for the trainer's exit code;" \
         "point TMPDIR at a writable directory" >&2
    exit 2
fi
trap 'rm -f "$exit_file"' EXIT
export TAPE_TRAIN_EXIT_FILE="$exit_file"
# The trainer removes the file instead of writing it once this script is gone (SIGKILLed: the
# trap above never runs), so no exit-code file is left behind in $TMPDIR.
export TAPE_TRAIN_EXIT_FILE_READER=$$
# This script (or its torchrun) killed outright, with SIGKILL, sends nothing: what it started
# asks the kernel for a SIGTERM when its parent dies, and stops as for one (checkpoint, 75).
export TAPE_TRAIN_STOP_WITH_LAUNCHER=1

if [[ "$nproc" -eq 1 ]]; then
    cmd=("$python" -m tape_train.train.cli "$@")
else
    # torchrun, whose report of a failed worker (the rank that failed first, its exit code)
    # comes without the Python traceback torchrun wraps it in (tape_train/cluster/torchrun.py)
    cmd=("$python" -m tape_train.cluster.torchrun --standalone --nproc_per_node "$nproc"
         -m tape_train.train.cli "$@")
fi

"${cmd[@]}" &
child=$!

forward() {  # deliver $1 to the training processes (torchrun's children, or the trainer)
    local pids
    if [[ "$nproc" -eq 1 ]]; then pids=$child; else pids=$(pgrep -P "$child" || true); fi
    for pid in $pids; do kill -s "$1" "$pid" 2>/dev/null || true; done
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
# Ctrl-C in a terminal reaches the workers directly; this covers `kill -INT <script>`.
trap 'forward INT' INT

# `wait` returns early when a trapped signal arrives: keep waiting until the child is gone.
while true; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break
done

code="$(tr -d '[:space:]' < "$exit_file" 2>/dev/null)"
if [[ -n "$code" ]]; then
    exit "$code"
fi
exit "$rc"
