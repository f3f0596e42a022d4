# `make test` and `make train` each set up the virtualenv first, so either one works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: venv test train clean

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

clean:
	rm -rf $(VENV) *.egg-info
