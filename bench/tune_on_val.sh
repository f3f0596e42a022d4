#!/usr/bin/env bash
# Choose the decoding settings of the Multi30k recipe on the validation split (never on test):
# how many epoch checkpoints to average (the last N, or the N best by validation loss), then beam size and
# length penalty.
#
#     bash bench/tune_on_val.sh runs/en-de        # after training, e.g. `make train`
#
# Writes RUN/avgN.keras, RUN/bestN.keras and RUN/val.* hypothesis files (with .scores.json) and prints, per
# setting, the cased sacreBLEU and the BLEU of the Multi30k protocol (kt-evaluate prints both).
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: bash bench/tune_on_val.sh [RUN]     # RUN: a kt-train model directory, runs/en-de if not given"
    echo "Chooses a run's decoding settings on val: the checkpoints averaged, then beam size and length penalty."
    exit 0
fi
RUN=${1:-runs/en-de}
PY=${PY:-.venv/bin/python}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

bleu() {  # bleu LABEL MODEL_FILE [evaluate flags...]
    local label=$1 model=$2; shift 2
    local out="$RUN/val.$label"
    "$PY" -m training.evaluate --model-dir "$RUN" --model-file "$model" --split val --output "$out" "$@" > "$out.log" 2>&1
    local cased multi30k
    cased=$(grep -m1 -o '^BLEU[^=]*= [0-9.]*' "$out.log" | grep -o '[0-9.]*$' || true)
    multi30k=$(grep -m1 -o 'Multi30k protocol[^=]*= [0-9.]*' "$out.log" | grep -o '[0-9.]*$' || true)
    if [[ -z $cased ]]; then tail -3 "$out.log"; fi
    printf '%-28s sacreBLEU %6s   Multi30k protocol %6s\n' "$label" "$cased" "$multi30k"
}

for n in 1 3 5 8 10; do  # 10: the anchor recipe (Wu et al., 2021) averages its last 10
    "$PY" -m training.average_checkpoints --model-dir "$RUN" --last "$n" --output "$RUN/avg$n.keras" > /dev/null 2>&1
    bleu "avg$n.beam4.lp0.6" "$RUN/avg$n.keras" --beam-size 4 --length-penalty 0.6
done
for n in 5 10; do
    "$PY" -m training.average_checkpoints --model-dir "$RUN" --best "$n" --by val_loss --output "$RUN/best$n.keras" \
        > /dev/null 2>&1 && bleu "best$n.beam4.lp0.6" "$RUN/best$n.keras" --beam-size 4 --length-penalty 0.6
done
best=${BEST_AVG:-5}
for setting in "1 0.6" "4 1.0" "5 1.0" "8 0.6" "8 1.0"; do
    set -- $setting
    bleu "avg$best.beam$1.lp$2" "$RUN/avg$best.keras" --beam-size "$1" --length-penalty "$2"
done
