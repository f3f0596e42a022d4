# `make test` and `make train` each set up their virtualenvs first, so either one works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The library on the other Keras backends, each in a virtualenv without TensorFlow.
JAX_VENV := .venv-jax
TORCH_VENV := .venv-torch
# PyTorch's CPU wheel for $(PYTHON) (a plain `pip install torch` brings gigabytes of CUDA libraries). Without
# one the PyTorch tests are skipped (make says so).
PYTHON_TAG := $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
TORCH_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-*+cpu-$(PYTHON_TAG)-*.whl))
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: venv venv-jax venv-torch test test-tf test-jax test-torch train plots clean bench-venv

# TensorFlow: training/, export/, the kt-* commands and the whole test suite.
$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[tensorflow,test]"
	touch $@

venv: $(VENV)/.installed

$(JAX_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(JAX_VENV)
	$(JAX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(JAX_VENV)/bin/python -m pip install --quiet -e ".[jax,test]"
	touch $@

venv-jax: $(JAX_VENV)/.installed

$(TORCH_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TORCH_VENV)/bin/python -m pip install --quiet "$(TORCH_WHEEL)"
	$(TORCH_VENV)/bin/python -m pip install --quiet -e ".[test,marian-reference]"
	touch $@

ifneq ($(TORCH_WHEEL),)
venv-torch: $(TORCH_VENV)/.installed
else
venv-torch:
	@echo "No PyTorch CPU wheel for $(PYTHON_TAG) in /opt/wheels (or TORCH_WHEEL=/path/to/torch-*+cpu-*.whl): the PyTorch tests are skipped."
endif

# pytest-xdist's worker processes, each given whole test files (their module fixtures are built once): most of
# the suite's time is single-threaded tracing, compiling and subprocess start-up, which overlaps on 2 cores.
# TEST_WORKERS=0 runs the suite in this one process. Not PyTorch's: its eager ops keep both cores busy already,
# and 2 workers made it slower (docs/testing.md, "The three suites").
TEST_WORKERS ?= auto
# -rs: every skipped test's reason in the summary (under CI=true a skip not on tests/ci_skips.py's list fails).
PYTEST := -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile

# What CI runs (.ci/run): the whole suite on TensorFlow (tests/portable included, and the cross-backend tests of
# tests/test_backends.py), then tests/portable on JAX and on PyTorch. All three run; any failure fails `make test`.
test: venv venv-jax venv-torch
	@status=0; \
	$(MAKE) --no-print-directory test-tf || status=1; \
	$(MAKE) --no-print-directory test-jax || status=1; \
	$(MAKE) --no-print-directory test-torch || status=1; \
	exit $$status

test-tf: venv
	KERAS_BACKEND=tensorflow $(PY) $(PYTEST) tests --durations=25

# The JAX suite's time is mostly XLA compiling many small programs, each run a few times: LLVM's slower
# optimisations cost more there than they save (docs/testing.md). The same programs, compiled with less effort;
# your own XLA_FLAGS come after these. Users' programs keep JAX's defaults.
JAX_TEST_XLA_FLAGS := --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true

test-jax: venv-jax
	KERAS_BACKEND=jax XLA_FLAGS="$(JAX_TEST_XLA_FLAGS) $$XLA_FLAGS" $(JAX_VENV)/bin/python $(PYTEST) tests/portable --durations=15

ifneq ($(TORCH_WHEEL),)
test-torch: venv-torch
	KERAS_BACKEND=torch $(TORCH_VENV)/bin/python -m pytest -q -rs tests/portable
else
# Without the wheel the PyTorch suite is skipped, but not under CI, which must not pass having skipped it.
test-torch: venv-torch
	@if [ "$$CI" = "true" ]; then echo "CI: no PyTorch CPU wheel for $(PYTHON_TAG) in /opt/wheels (TORCH_WHEEL=...): the PyTorch suite cannot be skipped under CI"; exit 1; fi
endif

# README's first command, Multi30k SRC->TGT end to end: train with CONFIG (configs/multi30k.json: small preset,
# 22 epochs on any machine), average the last epoch checkpoints, score beam search on test_2016_flickr with
# sacreBLEU, and export the averaged model for TF Serving. `make train SRC=de TGT=en` for German->English;
# `make train CONFIG=configs/multi30k-best.json` for the best recipe (runs/multi30k-best-en-de);
# `make train CONFIG=configs/wmt14-base.json` (or wmt14-big.json) for the paper's WMT14 English-German, by
# updates (TFDS downloads and prepares wmt14_translate, kt-train prepares it into the run). How many
# checkpoints are averaged, the beam and the length penalty come from the config (average_last, beam_size,
# length_penalty); AVG, BEAM and LENGTH_PENALTY on the make line override them (ALPHA, LENGTH_PENALTY's old name,
# is still read as it, with a note, until keras-transformer 0.3.0: docs/design.md lists the old names). Run it
# again after an interruption: training resumes from its backup, and a run whose model.keras exists is not
# trained again.
#
# Your own parallel text instead of Multi30k: TRAIN="train.en train.de" (any number of pairs of files, plain or
# gzip), VALID="dev.en dev.de", TEST="test.en test.de", with RUN: `kt-prepare` prepares TRAIN into
# $(RUN)/prepared (the vocabulary's settings from CONFIG), then kt-train trains on it, and the test set scored is
# TEST. PREPARED=DIR trains on a corpus kt-prepare made before.
CONFIG ?= configs/multi30k.json
# The languages: the config's "source_lang" and "target_lang" where it sets them (configs/wmt14-en-fr-big.json:
# en, fr), else en and de.
config_value = $(shell sed -n 's/^ *"$(1)": *"\([^"]*\)".*/\1/p' $(CONFIG) 2>/dev/null)
SRC ?= $(or $(call config_value,source_lang),en)
TGT ?= $(or $(call config_value,target_lang),de)
TRAIN ?=
VALID ?=
TEST ?=
PREPARED ?= $(if $(TRAIN),$(RUN)/prepared)
# kt-prepare's --train-files for TRAIN's files, taken two by two.
TRAIN_PAIRS = $(foreach i,$(shell seq 1 2 $(words $(TRAIN))),--train-files $(word $(i),$(TRAIN)) $(word $(shell echo $$(($(i) + 1))),$(TRAIN)))
# Without TEST, kt-evaluate scores the test split of the dataset trained on: Multi30k's test_2016_flickr, a TFDS
# corpus's test split (wmt14_translate: newstest2014).
TEST_FLAGS = $(if $(TEST),--source-file $(word 1,$(TEST)) --references $(word 2,$(TEST)))
RECIPE := $(basename $(notdir $(CONFIG)))
RUN_NAME := $(if $(filter multi30k,$(RECIPE)),,$(RECIPE)-)$(SRC)-$(TGT)
RUN ?= runs/$(RUN_NAME)
EXPORT ?= exports/$(notdir $(RUN))
# More kt-train flags, after the config's settings, e.g. TRAIN_FLAGS="--tokens-per-replica 3125 --grad-accum 8"
# (the paper's 25,000 tokens per update on one GPU).
TRAIN_FLAGS ?=
# More kt-prepare flags for TRAIN, after the config's settings, e.g. PREPARE_FLAGS="--vocab-size 8000".
PREPARE_FLAGS ?=
AVG ?=
BEAM ?=
LENGTH_PENALTY ?= $(ALPHA)
SEARCH_FLAGS = $(if $(BEAM),--beam-size $(BEAM)) $(if $(LENGTH_PENALTY),--length-penalty $(LENGTH_PENALTY))

train: venv
	$(if $(ALPHA),@echo "make train: ALPHA is now LENGTH_PENALTY (read as such; the old name will be removed in keras-transformer 0.3.0)")
	@if [ -f $(RUN)/model.keras ]; then \
		echo "make train: $(RUN)/model.keras exists, so its training is done (delete it, or set RUN, to train again)"; \
	else \
		$(if $(TRAIN),$(PY) -m training.prepare --config $(CONFIG) $(TRAIN_PAIRS) $(if $(VALID),--valid-files $(VALID)) \
			--source-lang $(SRC) --target-lang $(TGT) --out $(PREPARED)$(if $(PREPARE_FLAGS), $(PREPARE_FLAGS)) &&) \
		$(PY) -m training.train --config $(CONFIG) --source-lang $(SRC) --target-lang $(TGT) --model-dir $(RUN) \
			$(if $(PREPARED),--prepared $(PREPARED)) $(if $(VALID),--valid-files $(VALID))$(if $(TRAIN_FLAGS), $(TRAIN_FLAGS)); \
	fi
	$(PY) -m training.average_checkpoints --model-dir $(RUN) $(if $(AVG),--last $(AVG))
	$(PY) -m training.evaluate --model-dir $(RUN) --model-file $(RUN)/averaged.keras $(TEST_FLAGS) $(SEARCH_FLAGS)
	$(PY) -m export.export_model --model-dir $(RUN) --model-file $(RUN)/averaged.keras --export-dir $(EXPORT) \
		$(SEARCH_FLAGS)

# The figures of docs/training.md ("Plots") for a run: `make plots RUN=runs/en-de` writes docs/images/{lr_schedule,loss,attention}.png.
SOURCE ?= A man in an orange hat starring at something.

plots: venv
	$(PY) -m training.plots schedule --model-dir $(RUN) --out docs/images/lr_schedule.png
	$(PY) -m training.plots loss --model-dir $(RUN) --out docs/images/loss.png
	$(PY) -m training.plots attention --model-dir $(RUN) --source "$(SOURCE)" --out docs/images/attention.png

# Peers for bench/peers_throughput.py (torch, keras-hub) and bench/ctranslate2_side_by_side.py (ctranslate2;
# sacrebleu and sentencepiece come with -e ".[tensorflow]"), kept out of the project's own venv. torch from the
# CPU wheel in /opt/wheels where there is one: from PyPI, torch brings several GB of CUDA packages.
BENCH_VENV := .venv-bench

$(BENCH_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet "$(or $(TORCH_WHEEL),torch==2.13.0)"
	$(BENCH_VENV)/bin/pip install --quiet -e ".[tensorflow]" keras-hub ctranslate2==4.8.5
	touch $@

bench-venv: $(BENCH_VENV)/.installed

clean:
	rm -rf $(VENV) $(JAX_VENV) $(TORCH_VENV) *.egg-info
