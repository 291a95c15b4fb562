# study: `make install`, `make test`, `make bench`; later: `make ablation`, `make report`, `make compare`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of this version is on disk on our machines. GPU users: install your own
# torch build into the venv first (any torch >= 2.3); `make install` then keeps it.
TORCH_VERSION ?= 2.13.0

.PHONY: install test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[test]"
	touch $@

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

bench: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
