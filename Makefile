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

train: venv
	$(PY) -m training.train --preset small --data-dir ../shared/data/multi30k --source-lang en --target-lang de --model-dir runs/en-de

# The README figures of a run: `make plots RUN=runs/en-de` writes docs/images/{lr_schedule,loss,attention}.png.
RUN ?= runs/en-de
SOURCE ?= A man in an orange hat starring at something.

plots: venv
	$(PY) -m training.plots schedule --model-dir $(RUN) --out docs/images/lr_schedule.png
	$(PY) -m training.plots loss --model-dir $(RUN) --out docs/images/loss.png
	$(PY) -m training.plots attention --model-dir $(RUN) --source "$(SOURCE)" --out docs/images/attention.png

# Peers for bench/peers_throughput.py (torch, keras-hub), kept out of the project's own venv.
BENCH_VENV := .venv-bench

$(BENCH_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/pip install --quiet -e . keras-hub
	touch $@

bench-venv: $(BENCH_VENV)/.installed

clean:
	rm -rf $(VENV) *.egg-info
