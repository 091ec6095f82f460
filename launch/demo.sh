#!/usr/bin/env bash
# The README demo (`make demo`): a tiny TAPE language model trained on CPU in a few minutes.
#
#   1. demo corpus      tape-data prepare --demo --out data/demo        (Debian docs via apt,
#                       ~30 MB; without apt or the archive: this Python's stdlib, ~2.7 MB)
#   2. tokenizer        tape-tokenizer train ... --out data/demo/tokenizer   (8k BPE)
#   3. training         launch/local.sh 1 --config configs/train/demo.yaml   (runs/demo)
#   4. evaluation       tape-eval: perplexity at the run's eval: lengths -> runs/demo/eval
#
# Idempotent: a complete corpus/tokenizer is reused, training resumes from its latest
# checkpoint (or reports it is complete), evaluation is redone (it takes seconds).
# Extra arguments are passed to tape-train as overrides, e.g. `bash launch/demo.sh
# train.max_steps=100`; the evaluation follows the run's eval: section, overrides included
# (`eval.lengths=[64,128]`), as the run's scheduled evaluations did; `train.run_dir=runs/mine`
# trains, evaluates and reports there instead of runs/demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bin=.venv/bin
if [[ ! -x $bin/python ]]; then
    echo "demo.sh: no virtualenv at .venv; run 'make demo' (it creates one)" >&2
    exit 2
fi
export PYTHON="$PWD/$bin/python"
export PYTHONUNBUFFERED=1
data=data/demo
run_dir=runs/demo
# A train.run_dir override (the last one given, as tape-train reads them) moves the run, and
# with it the evaluation and the paths printed at the end.
for arg in "$@"; do
    if [[ $arg == train.run_dir=* ]]; then run_dir=${arg#train.run_dir=}; fi
done

step() { printf '\n==> %s (%ds so far)\n' "$*" "$SECONDS"; }

step "1/4 demo corpus -> $data"
if [[ -f $data/manifest.json ]]; then
    echo "present ($data/manifest.json); delete $data to rebuild"
else
    "$bin/tape-data" prepare --demo --out "$data"
fi

step "2/4 sentencepiece tokenizer -> $data/tokenizer.model"
if [[ -f $data/tokenizer.model ]]; then
    echo "present; delete $data/tokenizer.model to retrain"
else
    "$bin/tape-tokenizer" train --input "$data" --spec tokenizer/demo.yaml --out "$data/tokenizer"
fi

step "3/4 training the tiny TAPE model on CPU -> $run_dir"
code=0
bash launch/local.sh 1 --config configs/train/demo.yaml "train.run_dir=$run_dir" "$@" || code=$?
if (( code != 0 )); then
    if (( code == 130 || code == 75 )); then  # Ctrl-C; SIGTERM/SIGUSR1 (tape_train.train.signals)
        echo "demo.sh: training stopped with a checkpoint (exit $code); run 'make demo' again" \
             "to continue from it" >&2
    fi
    exit "$code"
fi

step "4/4 perplexity at the context lengths of the run's eval: section -> $run_dir/eval"
progress=()
[[ -t 2 ]] || progress=(--no-progress)  # no carriage-return bars in a log file
"$bin/tape-eval" --checkpoint "$run_dir" --out "$run_dir/eval" "${progress[@]}"

cat <<MSG

Done in ${SECONDS}s.
  metrics (JSON lines):  $run_dir/metrics.jsonl
  TensorBoard:           $bin/tensorboard --logdir $run_dir/tensorboard
  perplexity plot:       $run_dir/eval/ppl_vs_length.png   (table: $run_dir/eval/eval.md)
  checkpoints:           $run_dir/checkpoints   (re-run this script to resume / re-evaluate)
MSG
