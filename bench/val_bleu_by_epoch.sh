#!/usr/bin/env bash
# Validation BLEU as a function of training length, from one run: for each epoch E given, average the N epoch
# checkpoints that end at E and score the result on val (never on test), in both protocols.
#
#     bash bench/val_bleu_by_epoch.sh RUN 20 30 40 50         # RUN: a kt-train model directory
#     AVG=5 BEAM=5 ALPHA=1.0 bash bench/val_bleu_by_epoch.sh RUN 22
#
# The learning-rate schedule depends on the step only, not on the number of epochs asked for, so the first E
# epochs of a longer run are the run of E epochs (same data order, same seed): the averaged checkpoints are
# what `kt-train --epochs E` followed by `kt-average-checkpoints --last N` would give. Each E is scored in a
# scratch copy of RUN whose checkpoints folder holds links to epochs 1..E only; RUN itself is not written to.
set -euo pipefail
RUN=${1:?usage: val_bleu_by_epoch.sh RUN EPOCH [EPOCH ...]}; shift
[[ $# -gt 0 ]] || { echo "give at least one epoch" >&2; exit 2; }
PY=${PY:-.venv/bin/python}
AVG=${AVG:-10} BEAM=${BEAM:-4} ALPHA=${ALPHA:-1.0}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
RUN=$(cd "$RUN" && pwd)
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT

for E in "$@"; do
    ckpt=$(printf '%s/checkpoints/epoch-%03d.weights.h5' "$RUN" "$E")
    [[ -f $ckpt ]] || { echo "epoch $E: no $ckpt" >&2; continue; }
    dir="$SCRATCH/e$E"
    mkdir -p "$dir/checkpoints"
    for f in "$RUN"/*; do [[ -f $f ]] && ln -s "$f" "$dir/"; done
    for ((e = 1; e <= E; e++)); do
        c=$(printf '%s/checkpoints/epoch-%03d.weights.h5' "$RUN" "$e")
        [[ -f $c ]] && ln -s "$c" "$dir/checkpoints/"
    done
    "$PY" -m training.average_checkpoints --model-dir "$dir" --last "$AVG" --output "$dir/avg.keras" > "$dir/avg.log" 2>&1 \
        || { tail -3 "$dir/avg.log"; continue; }
    out="$RUN/val.e$E.avg$AVG.beam$BEAM.alpha$ALPHA"
    "$PY" -m training.evaluate --model-dir "$dir" --model-file "$dir/avg.keras" --split val --no-progress \
        --beam-size "$BEAM" --alpha "$ALPHA" --output "$out" > "$out.log" 2>&1 || { tail -3 "$out.log"; continue; }
    cased=$(grep -m1 -o '^BLEU[^=]*= [0-9.]*' "$out.log" | grep -o '[0-9.]*$' || true)
    multi30k=$(grep -m1 -o 'Multi30k protocol[^=]*= [0-9.]*' "$out.log" | grep -o '[0-9.]*$' || true)
    printf 'epoch %3d  last %2d averaged  beam %s alpha %s   sacreBLEU %6s   Multi30k protocol %6s\n' \
        "$E" "$AVG" "$BEAM" "$ALPHA" "$cased" "$multi30k"
done
