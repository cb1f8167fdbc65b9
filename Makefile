# The two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3.11
VENV   := .venv
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: setup demo test bench-download clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

demo: setup
	$(VENV)/bin/shardsmith demo

test: setup
	$(VENV)/bin/python -m pytest

bench-download: setup
	$(VENV)/bin/python bench/bench_download.py

clean:
	rm -rf $(VENV) shardsmith-demo .bench
