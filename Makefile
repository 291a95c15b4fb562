# study: `make install`, `make test`, `make ablation`, `make report`, `make compare`, `make bench`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of this version is on disk on our machines. GPU users: install your own
# torch build into the venv first (any torch >= 2.3); `make install` then keeps it.
TORCH_VERSION ?= 2.13.0
# pytest-xdist processes for `make test`: many tests wait on subprocesses (sweep workers, trial processes, a
# PostgreSQL server), so two share two cores well (CI: 21 min of tests in one process, 14 in two). 0: one process.
TEST_JOBS ?= 2

# The sweep `make ablation` runs (and `make report`/`make compare` read): any spec in experiments/.
SPEC ?= experiments/ablation_default.yaml
# (a spec without `name:` is named by its file, as `study sweep` names it)
SWEEP ?= $(or $(shell sed -n 's/^name: *//p' $(SPEC) | head -n 1),$(basename $(notdir $(SPEC))))
WORKERS ?=
# Local data: $$STUDY_DATA_DIR, else ../shared/data when present, else the Hugging Face hub.
DATA_DIR ?= $(if $(STUDY_DATA_DIR),$(STUDY_DATA_DIR),$(wildcard ../shared/data))

.PHONY: install test test-fast bench ablation status report compare clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[test]"
	touch $@

test: install
	$(PY) -m pytest -n $(TEST_JOBS)

test-fast: install
	$(PY) -m pytest -n $(TEST_JOBS) -m "not slow"

bench: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/throughput.py

ablation: install
	$(PY) -m study.cli sweep $(SPEC) $(if $(DATA_DIR),--data-dir $(DATA_DIR)) $(if $(WORKERS),--workers $(WORKERS))

status: install
	$(PY) -m study.cli status results/$(SWEEP)

report: install
	$(PY) -m study.cli report results/$(SWEEP)

compare: install
	$(PY) -m study.cli compare results/$(SWEEP)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
