# `make test` and `make train` each set up the virtualenv first, so either one works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: venv test train plots clean bench-venv

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest tests -q

# The README's main command, Multi30k SRC->TGT end to end: train with configs/multi30k.json (small preset,
# 22 epochs on any machine), average the last 5 epoch checkpoints, score beam search on test_2016_flickr
# with sacreBLEU, and export the averaged model for TF Serving. `make train SRC=de TGT=en` for German->English.
SRC ?= en
TGT ?= de
RUN ?= runs/$(SRC)-$(TGT)
BEAM ?= 4
ALPHA ?= 1.0

train: venv
	$(PY) -m training.train --config configs/multi30k.json --source-lang $(SRC) --target-lang $(TGT) --model-dir $(RUN)
	$(PY) -m training.average_checkpoints --model-dir $(RUN) --last 5
	$(PY) -m training.evaluate --model-dir $(RUN) --model-file $(RUN)/averaged.keras --split test_2016_flickr \
		--beam-size $(BEAM) --alpha $(ALPHA)
	$(PY) -m export.export_model --model-dir $(RUN) --model-file $(RUN)/averaged.keras --export-dir exports/$(SRC)-$(TGT) \
		--beam-size $(BEAM) --alpha $(ALPHA)

# The README figures of a run: `make plots RUN=runs/en-de` writes docs/images/{lr_schedule,loss,attention}.png.
SOURCE ?= A man in an orange hat starring at something.

plots: venv
	$(PY) -m training.plots schedule --model-dir $(RUN) --out docs/images/lr_schedule.png
	$(PY) -m training.plots loss --model-dir $(RUN) --out docs/images/loss.png
	$(PY) -m training.plots attention --model-dir $(RUN) --source "$(SOURCE)" --out docs/images/attention.png

# Peers for bench/peers_throughput.py (torch, keras-hub) and bench/ctranslate2_side_by_side.py (ctranslate2;
# sacrebleu and sentencepiece come with -e .), kept out of the project's own venv.
BENCH_VENV := .venv-bench

$(BENCH_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/pip install --quiet -e . keras-hub ctranslate2==4.8.5
	touch $@

bench-venv: $(BENCH_VENV)/.installed

clean:
	rm -rf $(VENV) *.egg-info
